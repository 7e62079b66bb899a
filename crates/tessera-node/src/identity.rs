//! Per-container identity files on the host (see [`tessera_protocol::identity`]).
//!
//! `Allocate` writes one file per container into the identity folder and has the runtime
//! mount it read-only at [`CONTAINER_IDENTITY_FILE`]: the interposer takes its token and socket
//! from it, and the arbiter's backstop attributes the container's processes by it even when
//! none connects. The folder is `0711` and each name carries 64 random bits, so other host
//! users cannot list or guess the files (each holds a secret token); the files are `0644` so
//! a container running as any user can read its own.
//!
//! [`CONTAINER_IDENTITY_FILE`]: tessera_protocol::identity::CONTAINER_IDENTITY_FILE

use std::collections::HashSet;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tessera_protocol::identity::Identity;

/// Errors of the identity folder.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A file or the folder could not be written.
    #[error("identity file {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// No randomness for the file name.
    #[error("no randomness for an identity file name: {0}")]
    Random(String),
}

/// Writes `identity` for allocation `id` into `dir` (created `0711` if missing) and returns
/// the file's path. The write goes to a temporary name first, so a reader never sees half.
pub fn write(dir: &Path, id: &str, identity: &Identity) -> Result<PathBuf, IdentityError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| IdentityError::Io { path, source }
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o711)
        .create(dir)
        .map_err(io(dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).map_err(io(dir))?;
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|e| IdentityError::Random(e.to_string()))?;
    let suffix: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let path = dir.join(format!("{id}.{suffix}"));
    let tmp = dir.join(format!(".{id}.{suffix}.tmp"));
    std::fs::write(&tmp, identity.render()).map_err(io(&tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(path)
}

/// Removes the files of allocations not in `live` (deleted ones); returns how many went.
/// Errors are skipped: a file left behind names a token the arbiter no longer knows.
pub fn sweep(dir: &Path, live: &HashSet<String>) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let id = name.trim_start_matches('.').split('.').next().unwrap_or("");
        if !live.contains(id) && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_files_parse_are_private_to_find_and_are_swept_with_their_allocation() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("identity");
        let id = Identity {
            token: "secret".into(),
            socket: Some("/run/tessera/tessera.sock".into()),
            allocation: Some("a1".into()),
        };
        let p1 = write(&dir, "a1", &id).unwrap();
        let p2 = write(
            &dir,
            "b2",
            &Identity {
                token: "t2".into(),
                socket: None,
                allocation: None,
            },
        )
        .unwrap();
        assert_ne!(
            p1.file_name(),
            Some(std::ffi::OsStr::new("a1")),
            "a random suffix"
        );
        assert_eq!(
            Identity::parse(&std::fs::read_to_string(&p1).unwrap()).unwrap(),
            id
        );
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o711);
        assert_eq!(mode(&p1), 0o644);
        assert_eq!(sweep(&dir, &HashSet::from(["b2".to_owned()])), 1);
        assert!(!p1.exists() && p2.exists());
        assert_eq!(sweep(&tmp.path().join("missing"), &HashSet::new()), 0);
    }
}
