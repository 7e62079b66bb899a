//! State folder and library folder layout.

use std::path::{Path, PathBuf};

use crate::{ENV_DIR, ENV_LIB_DIR};

/// File name of the built simulated driver library.
pub const CUDA_LIB_FILE: &str = "libtessera_sim_cuda.so";
/// File name of the built simulated NVML library.
pub const NVML_LIB_FILE: &str = "libtessera_sim_nvml.so";

/// Errors of the folder helpers.
#[derive(Debug, thiserror::Error)]
pub enum DirsError {
    #[error("cannot create {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "simulated libraries not found in {0} (expected {CUDA_LIB_FILE} and {NVML_LIB_FILE}; build with `cargo build --workspace` or pass --lib-dir / {ENV_LIB_DIR})"
    )]
    LibsMissing(PathBuf),
    #[error("cannot locate the running executable: {0}")]
    CurrentExe(std::io::Error),
}

/// The fixed per-user default state folder, `/tmp/tessera-sim-<uid>`, so separate or nested
/// `tessera sim` commands share one simulated machine.
pub fn default_state_dir() -> PathBuf {
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/tmp/tessera-sim-{uid}"))
}

/// `TESSERA_SIM_DIR` when set and non-empty, else [`default_state_dir`].
pub fn state_dir_from_env() -> PathBuf {
    match std::env::var_os(ENV_DIR) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => default_state_dir(),
    }
}

/// Creates the state folder and its `procs/` subfolder.
pub fn ensure_state_dir(dir: &Path) -> Result<(), DirsError> {
    let procs = dir.join("procs");
    std::fs::create_dir_all(&procs).map_err(|source| DirsError::Create {
        path: procs.clone(),
        source,
    })
}

/// Finds the folder holding the built libraries: `explicit`, else `TESSERA_SIM_LIB_DIR`, else
/// the folder of the running executable (cargo puts cdylibs next to binaries).
pub fn find_built_lib_dir(explicit: Option<&Path>) -> Result<PathBuf, DirsError> {
    let dir = match explicit {
        Some(d) => d.to_path_buf(),
        None => match std::env::var_os(ENV_LIB_DIR) {
            Some(v) if !v.is_empty() => PathBuf::from(v),
            _ => {
                let exe = std::env::current_exe().map_err(DirsError::CurrentExe)?;
                exe.parent().map(Path::to_path_buf).unwrap_or_default()
            }
        },
    };
    if dir.join(CUDA_LIB_FILE).is_file() && dir.join(NVML_LIB_FILE).is_file() {
        Ok(std::fs::canonicalize(&dir).unwrap_or(dir))
    } else {
        Err(DirsError::LibsMissing(dir))
    }
}

/// Makes `<state_dir>/lib/` with `libcuda.so.1`, `libcuda.so`, `libnvidia-ml.so.1` and
/// `libnvidia-ml.so` pointing at the libraries in `built_lib_dir`; returns the folder to put on
/// `LD_LIBRARY_PATH`. Links are replaced atomically so concurrent runs never see a gap.
pub fn prepare_lib_dir(state_dir: &Path, built_lib_dir: &Path) -> Result<PathBuf, DirsError> {
    ensure_state_dir(state_dir)?;
    let lib = state_dir.join("lib");
    std::fs::create_dir_all(&lib).map_err(|source| DirsError::Create {
        path: lib.clone(),
        source,
    })?;
    let links = [
        ("libcuda.so.1", CUDA_LIB_FILE),
        ("libcuda.so", CUDA_LIB_FILE),
        ("libnvidia-ml.so.1", NVML_LIB_FILE),
        ("libnvidia-ml.so", NVML_LIB_FILE),
    ];
    for (name, target) in links {
        let dest = lib.join(name);
        let target = built_lib_dir.join(target);
        if std::fs::read_link(&dest).ok().as_deref() == Some(target.as_path()) {
            continue;
        }
        // A name no other writer uses at once, also one in another PID namespace with the
        // same pid: the pid and the time (the folder layer asks no one; `driver` sits above it).
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let tmp = lib.join(format!(".{name}.{}.{nanos}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let made =
            std::os::unix::fs::symlink(&target, &tmp).and_then(|()| std::fs::rename(&tmp, &dest));
        made.map_err(|source| DirsError::Create {
            path: dest.clone(),
            source,
        })?;
    }
    Ok(lib)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lib_dir_links_point_at_built_libs() {
        let built = tempfile::tempdir().unwrap();
        std::fs::write(built.path().join(CUDA_LIB_FILE), b"x").unwrap();
        std::fs::write(built.path().join(NVML_LIB_FILE), b"y").unwrap();
        let state = tempfile::tempdir().unwrap();
        let found = find_built_lib_dir(Some(built.path())).unwrap();
        let lib = prepare_lib_dir(state.path(), &found).unwrap();
        assert_eq!(std::fs::read(lib.join("libcuda.so.1")).unwrap(), b"x");
        assert_eq!(std::fs::read(lib.join("libnvidia-ml.so")).unwrap(), b"y");
        // A second call (e.g. a nested `tessera sim`) keeps working.
        prepare_lib_dir(state.path(), &found).unwrap();
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            find_built_lib_dir(Some(empty.path())),
            Err(DirsError::LibsMissing(_))
        ));
    }
}
