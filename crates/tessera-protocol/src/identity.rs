//! The container identity file: which allocation a container's processes belong to.
//!
//! The device plugin writes one per container on the host and has the runtime mount it
//! read-only at [`CONTAINER_IDENTITY_FILE`]. A process in the container cannot change it
//! (read-only bind mount, no `CAP_SYS_ADMIN` to remount), so both sides trust it:
//! - the interposer takes its token and socket from it instead of the environment, so
//!   `unset TESSERA_TOKEN` or a `TESSERA_SOCKET` pointing at a fake arbiter changes nothing;
//! - the arbiter's backstop reads it through `/proc/<pid>/root`, so a process of the container
//!   is attributed to its allocation even if it never connected.
//!
//! Format: UTF-8 `key=value` lines; `token` is required, `socket` (the tenant socket's path
//! inside the container) and `allocation` (the public id, for people) are optional; blank
//! lines and lines starting with `#` are ignored; unknown keys are refused so a typo cannot
//! pass silently.

use std::path::PathBuf;

/// Where the identity file appears inside a container.
pub const CONTAINER_IDENTITY_FILE: &str = "/etc/tessera/tenant";

/// Largest identity file read (a few lines; anything larger is not ours).
pub const MAX_IDENTITY_LEN: usize = 4096;

/// Errors of [`Identity::parse`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// Longer than [`MAX_IDENTITY_LEN`].
    #[error("identity file longer than {MAX_IDENTITY_LEN} bytes")]
    TooLong,
    /// A line without `=`.
    #[error("identity file line {0}: expected key=value")]
    BadLine(usize),
    /// A key this version does not know.
    #[error("identity file line {0}: unknown key {1:?}")]
    UnknownKey(usize, String),
    /// No `token` line, or an empty one.
    #[error("identity file has no token")]
    NoToken,
}

/// Errors of reading an identity file: it could not be read, or its text is not an identity.
/// Each names the file when it was read from a path.
#[derive(Debug, thiserror::Error)]
pub enum IdentityReadError {
    /// It could not be opened or read.
    #[error("{}{source}", at(path))]
    Io {
        /// The file, when read from a path.
        path: Option<PathBuf>,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Its text is not an identity.
    #[error("{}{source}", at(path))]
    Parse {
        /// The file, when read from a path.
        path: Option<PathBuf>,
        /// Cause.
        #[source]
        source: IdentityError,
    },
}

fn at(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map(|p| format!("{}: ", p.display()))
        .unwrap_or_default()
}

impl IdentityReadError {
    fn at(self, p: &std::path::Path) -> Self {
        let path = Some(p.to_owned());
        match self {
            Self::Io { source, .. } => Self::Io { path, source },
            Self::Parse { source, .. } => Self::Parse { path, source },
        }
    }
}

/// The parsed identity file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The allocation's secret token.
    pub token: String,
    /// The tenant socket inside the container.
    pub socket: Option<PathBuf>,
    /// Public allocation id (informational).
    pub allocation: Option<String>,
}

impl Identity {
    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<Self, IdentityError> {
        if text.len() > MAX_IDENTITY_LEN {
            return Err(IdentityError::TooLong);
        }
        let (mut token, mut socket, mut allocation) = (None, None, None);
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (k, v) = line.split_once('=').ok_or(IdentityError::BadLine(i + 1))?;
            let v = v.trim();
            match k.trim() {
                "token" => token = Some(v.to_owned()),
                "socket" if !v.is_empty() => socket = Some(PathBuf::from(v)),
                "socket" => socket = None,
                "allocation" => allocation = Some(v.to_owned()).filter(|a| !a.is_empty()),
                other => return Err(IdentityError::UnknownKey(i + 1, other.to_owned())),
            }
        }
        let token = token
            .filter(|t| !t.is_empty())
            .ok_or(IdentityError::NoToken)?;
        Ok(Self {
            token,
            socket,
            allocation,
        })
    }

    /// Reads and parses an identity file from `file`, reading at most one byte more than
    /// [`MAX_IDENTITY_LEN`] (a larger file is refused by [`Identity::parse`] without being read
    /// whole).
    pub fn read_from(file: impl std::io::Read) -> Result<Self, IdentityReadError> {
        use std::io::Read;
        let mut text = String::new();
        file.take(MAX_IDENTITY_LEN as u64 + 1)
            .read_to_string(&mut text)
            .map_err(|source| IdentityReadError::Io { path: None, source })?;
        Self::parse(&text).map_err(|source| IdentityReadError::Parse { path: None, source })
    }

    /// Reads the identity file at `path`: `None` when there is none, `Some(Err)` when it exists
    /// but cannot be opened, read or parsed (the error names the path).
    pub fn read(path: &std::path::Path) -> Option<Result<Self, IdentityReadError>> {
        match std::fs::File::open(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => Some(Err(IdentityReadError::Io {
                path: Some(path.to_owned()),
                source,
            })),
            Ok(f) => Some(Self::read_from(f).map_err(|e| e.at(path))),
        }
    }

    /// The file's text.
    pub fn render(&self) -> String {
        let mut out = format!("token={}\n", self.token);
        if let Some(s) = &self.socket {
            out.push_str(&format!("socket={}\n", s.display()));
        }
        if let Some(a) = &self.allocation {
            out.push_str(&format!("allocation={a}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let id = Identity {
            token: "abc".into(),
            socket: Some("/run/tessera/tessera.sock".into()),
            allocation: Some("a-1".into()),
        };
        assert_eq!(Identity::parse(&id.render()), Ok(id));
        let bare = Identity {
            token: "t".into(),
            socket: None,
            allocation: None,
        };
        assert_eq!(Identity::parse(&bare.render()), Ok(bare));
    }

    #[test]
    fn comments_blank_lines_and_spaces_are_fine() {
        let id = Identity::parse("# made by tessera-device-plugin\n\n token = xyz \n").unwrap();
        assert_eq!(id.token, "xyz");
    }

    #[test]
    fn read_tells_absent_from_unusable() {
        let dir = std::env::temp_dir().join(format!("tessera-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tenant");
        assert!(Identity::read(&path).is_none(), "absent");
        std::fs::write(&path, "token=abc\n").unwrap();
        assert_eq!(Identity::read(&path).unwrap().unwrap().token, "abc");
        std::fs::write(&path, "token\n").unwrap();
        let err = Identity::read(&path).unwrap().unwrap_err().to_string();
        assert!(
            err.starts_with(&path.display().to_string()) && err.contains("line 1"),
            "{err}"
        );
        std::fs::write(&path, "#".repeat(MAX_IDENTITY_LEN * 3)).unwrap();
        assert!(
            Identity::read(&path)
                .unwrap()
                .unwrap_err()
                .to_string()
                .contains("longer than")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_files_are_refused() {
        assert_eq!(Identity::parse(""), Err(IdentityError::NoToken));
        assert_eq!(Identity::parse("token=\n"), Err(IdentityError::NoToken));
        assert_eq!(Identity::parse("token\n"), Err(IdentityError::BadLine(1)));
        assert_eq!(
            Identity::parse("token=a\nlimit=80GiB\n"),
            Err(IdentityError::UnknownKey(2, "limit".into()))
        );
        assert_eq!(
            Identity::parse(&"#".repeat(5000)),
            Err(IdentityError::TooLong)
        );
    }
}
