//! Installs the interposer library on the host, where containers bind-mount it from.
//!
//! The host copy is named `libtessera_interpose-<version>-<hash8>.so` (hash8: the first 8 hex
//! digits of the SHA-256 of its bytes), next to a `ld.so.preload-<version>-<hash8>` file that
//! names the library's path inside the container. Containers mount both read-only, so:
//! - a file a running container may have mapped is never written again: a new build gets a new
//!   name, an identical file is left alone, old versions are kept;
//! - every file is written to a temporary name and renamed into place, so a reader never sees
//!   half a library (and a rename never touches the inode a container already mounted).

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// File name of the built interposer, as cargo names it.
pub const INTERPOSER_FILE: &str = "libtessera_interpose.so";

/// Errors of the installation.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The interposer was not found.
    #[error("interposer library not found at {0} (build it, or pass --interposer PATH)")]
    NotFound(PathBuf),
    /// The file does not load as the interposer (pods would run without limits: the loader
    /// skips a preload that does not load, with a mere warning).
    #[error("refusing to install it for pods: {0}")]
    NotInterposer(#[from] tessera_preload::CheckError),
    /// Reading the source failed.
    #[error("cannot read {path}: {source}")]
    Read {
        /// Path read.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Writing into the host folder failed.
    #[error("cannot install into {path}: {source}")]
    Write {
        /// Path written.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The own executable's folder is unknown.
    #[error("cannot locate the running executable: {0}")]
    CurrentExe(std::io::Error),
}

/// What was installed, with host paths for the container mounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    /// Host path of the versioned library.
    pub lib_path: PathBuf,
    /// Host path of the matching `ld.so.preload` file.
    pub preload_path: PathBuf,
    /// The `<version>-<hash8>` tag in both names.
    pub tag: String,
    /// True if the library was written now (false: an identical copy was already there).
    pub wrote_lib: bool,
}

/// `explicit`, else `libtessera_interpose.so` next to the running executable; it must load
/// and export the interposer's hooks ([`tessera_preload::check`]).
pub fn find_interposer(explicit: Option<&Path>) -> Result<PathBuf, InstallError> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let exe = std::env::current_exe().map_err(InstallError::CurrentExe)?;
            exe.parent().unwrap_or(Path::new("/")).join(INTERPOSER_FILE)
        }
    };
    if !path.is_file() {
        return Err(InstallError::NotFound(path));
    }
    tessera_preload::check(&path)?;
    Ok(path)
}

/// First 8 hex digits of the SHA-256 of `bytes`.
pub(crate) fn hash8(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().take(4).map(|b| format!("{b:02x}")).collect()
}

/// Installs `src` into `host_lib_dir` for `version`, with a preload file naming
/// `container_lib_path`. Idempotent; safe while containers use older or identical copies.
pub fn install(
    src: &Path,
    host_lib_dir: &Path,
    version: &str,
    container_lib_path: &Path,
) -> Result<Installed, InstallError> {
    let bytes = std::fs::read(src).map_err(|source| InstallError::Read {
        path: src.to_path_buf(),
        source,
    })?;
    std::fs::create_dir_all(host_lib_dir).map_err(|source| InstallError::Write {
        path: host_lib_dir.to_path_buf(),
        source,
    })?;
    remove_stale_temps(host_lib_dir);
    let tag = format!("{version}-{}", hash8(&bytes));
    let lib_path = host_lib_dir.join(format!("libtessera_interpose-{tag}.so"));
    let preload_path = host_lib_dir.join(format!("ld.so.preload-{tag}"));

    let wrote_lib = place(&lib_path, &bytes, 0o755)?;
    let preload = format!("{}\n", container_lib_path.display());
    place(&preload_path, preload.as_bytes(), 0o644)?;
    Ok(Installed {
        lib_path,
        preload_path,
        tag,
        wrote_lib,
    })
}

/// Puts `bytes` at `dest` unless an identical file is there; returns whether it wrote.
fn place(dest: &Path, bytes: &[u8], mode: u32) -> Result<bool, InstallError> {
    if let Ok(existing) = std::fs::read(dest) {
        if existing == bytes {
            return Ok(false);
        }
        // Same name, other bytes: a damaged copy (the name carries the hash). Replacing it by
        // rename leaves any container that mounted the old inode untouched.
        tracing::warn!(
            "{} differs from its name's content; replacing it",
            dest.display()
        );
    }
    let dir = dest.parent().unwrap_or(Path::new("."));
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".tmp-{}-{name}", std::process::id()));
    let werr = |source| InstallError::Write {
        path: dest.to_path_buf(),
        source,
    };
    let write = || -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dest)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        werr(e)
    })?;
    Ok(true)
}

/// Removes temporaries left by an install that died; they were never renamed into place, so
/// no container can have them mounted.
fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(".tmp-") else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        // Leave a temporary of a live installer alone (an init container racing the plugin).
        if let Some(pid) = pid
            && pid != std::process::id()
            && Path::new(&format!("/proc/{pid}")).exists()
        {
            continue;
        }
        let _ = std::fs::remove_file(e.path());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    const CONTAINER: &str = "/usr/lib/tessera/libtessera_interpose.so";

    #[test]
    fn installs_versioned_copy_and_preload() {
        let src_dir = tempfile::tempdir().unwrap();
        let src = src_dir.path().join(INTERPOSER_FILE);
        std::fs::write(&src, b"build one").unwrap();
        let host = tempfile::tempdir().unwrap();
        let dir = host.path().join("lib");
        let a = install(&src, &dir, "0.1.0", Path::new(CONTAINER)).unwrap();
        assert!(a.wrote_lib);
        let name = a.lib_path.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            name,
            format!("libtessera_interpose-0.1.0-{}.so", hash8(b"build one"))
        );
        assert_eq!(std::fs::read(&a.lib_path).unwrap(), b"build one");
        assert_eq!(
            std::fs::read_to_string(&a.preload_path).unwrap(),
            format!("{CONTAINER}\n")
        );

        // Same build again: the file (same inode) is left alone.
        let ino = std::fs::metadata(&a.lib_path).unwrap().ino();
        let again = install(&src, &dir, "0.1.0", Path::new(CONTAINER)).unwrap();
        assert!(!again.wrote_lib);
        assert_eq!(
            again,
            Installed {
                wrote_lib: false,
                ..a.clone()
            }
        );
        assert_eq!(std::fs::metadata(&a.lib_path).unwrap().ino(), ino);

        // A new build gets a new name; the old one stays for containers still using it.
        std::fs::write(&src, b"build two").unwrap();
        let b = install(&src, &dir, "0.1.0", Path::new(CONTAINER)).unwrap();
        assert_ne!(a.lib_path, b.lib_path);
        assert_eq!(std::fs::read(&a.lib_path).unwrap(), b"build one");
        assert_eq!(std::fs::read(&b.lib_path).unwrap(), b"build two");
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            .collect();
        assert!(leftovers.is_empty());
    }

    #[test]
    fn damaged_copy_is_replaced_by_rename() {
        let src_dir = tempfile::tempdir().unwrap();
        let src = src_dir.path().join(INTERPOSER_FILE);
        std::fs::write(&src, b"good").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let a = install(&src, dir.path(), "0.1.0", Path::new(CONTAINER)).unwrap();
        let old_ino = std::fs::metadata(&a.lib_path).unwrap().ino();
        std::fs::write(&a.lib_path, b"damaged").unwrap();
        let b = install(&src, dir.path(), "0.1.0", Path::new(CONTAINER)).unwrap();
        assert!(b.wrote_lib);
        assert_eq!(std::fs::read(&b.lib_path).unwrap(), b"good");
        assert_ne!(std::fs::metadata(&b.lib_path).unwrap().ino(), old_ino);
    }

    #[test]
    fn dead_temporaries_are_cleaned_and_missing_source_is_clear() {
        let dir = tempfile::tempdir().unwrap();
        // pid 0 is never a live installer.
        std::fs::write(dir.path().join(".tmp-0-libtessera_interpose-x.so"), b"half").unwrap();
        let src = dir.path().join("src.so");
        std::fs::write(&src, b"x").unwrap();
        install(&src, dir.path(), "0.1.0", Path::new(CONTAINER)).unwrap();
        assert!(!dir.path().join(".tmp-0-libtessera_interpose-x.so").exists());

        let err = find_interposer(Some(&dir.path().join("nope.so"))).unwrap_err();
        assert!(err.to_string().contains("--interposer"), "{err}");
        // A file that is there but does not load as the interposer is refused too.
        let err = find_interposer(Some(&src)).unwrap_err();
        assert!(matches!(err, InstallError::NotInterposer(_)), "{err}");
        assert!(
            err.to_string().contains("refusing to install it for pods"),
            "{err}"
        );
    }
}
