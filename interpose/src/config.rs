//! Where the interposer learns which allocation its process belongs to. Limits never come
//! from here: they come from the arbiter's `Welcome`.
//!
//! - **In a container wired by the device plugin** the read-only identity file
//!   ([`CONTAINER_IDENTITY_FILE`]) names the token and the tenant socket, and the environment
//!   is not consulted for them: `unset TESSERA_TOKEN` or a `TESSERA_SOCKET` pointing at a fake
//!   arbiter changes nothing. A file that exists but cannot be read or parsed *closes* the
//!   process: every allocation fails with `CUDA_ERROR_OUT_OF_MEMORY` and every launch with
//!   `CUDA_ERROR_NOT_PERMITTED`, since it cannot prove its allocation.
//! - **Elsewhere** (`tessera run`, a laptop) `TESSERA_TOKEN` and `TESSERA_SOCKET` are read
//!   from the environment. A token without a socket is closed the same way.
//! - No identity and no token: pass everything through (host processes untouched).
//!
//! `TESSERA_REAL_LIBCUDA` and `TESSERA_LOG` are read from the environment in every case.
//! There is deliberately no variable that turns enforcement off while a token is present.

#![forbid(unsafe_code)]

use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::sync::OnceLock;

pub use tessera_protocol::identity::CONTAINER_IDENTITY_FILE;
use tessera_protocol::identity::Identity;

/// The process's settings, read once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The tenant's allocation token; `None` means pass everything through untouched.
    pub token: Option<String>,
    /// The arbiter's tenant socket. `None` with a token closes the process (see
    /// [`Config::closed`]).
    pub socket: Option<PathBuf>,
    /// Path of the real driver to load instead of `libcuda.so.1`.
    pub real_libcuda: Option<CString>,
    /// Why the process cannot prove its allocation (an unreadable identity file).
    pub identity_error: Option<String>,
}

impl Config {
    /// Builds the configuration from the identity file (`None`: no such file; `Some(Err)`: it
    /// exists but could not be read or parsed) and a variable lookup.
    pub fn from_sources(
        identity: Option<Result<Identity, String>>,
        get: impl Fn(&str) -> Option<OsString>,
    ) -> Self {
        let non_empty = |k: &str| get(k).filter(|v| !v.is_empty());
        let real_libcuda =
            non_empty("TESSERA_REAL_LIBCUDA").and_then(|v| CString::new(v.into_vec()).ok());
        match identity {
            Some(Ok(id)) => Self {
                token: Some(id.token),
                socket: id.socket,
                real_libcuda,
                identity_error: None,
            },
            Some(Err(e)) => Self {
                // Enforcing, with nothing to connect with: closed.
                token: Some(String::new()),
                socket: None,
                real_libcuda,
                identity_error: Some(e),
            },
            None => {
                let token =
                    non_empty("TESSERA_TOKEN").map(|v| v.to_string_lossy().trim().to_owned());
                let token = token.filter(|t| !t.is_empty());
                let socket = non_empty("TESSERA_SOCKET").map(PathBuf::from);
                Self {
                    token,
                    socket,
                    real_libcuda,
                    identity_error: None,
                }
            }
        }
    }

    /// Builds the configuration from a variable lookup alone (no identity file).
    pub fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Self {
        Self::from_sources(None, get)
    }

    /// True when limits are enforced.
    pub fn enforcing(&self) -> bool {
        self.token.is_some()
    }

    /// True when the process enforces but cannot reach an arbiter it can prove itself to:
    /// allocations are refused and launches fail.
    pub fn closed(&self) -> bool {
        self.enforcing() && (self.socket.is_none() || self.identity_error.is_some())
    }
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// The process configuration (read on first use).
pub fn get() -> &'static Config {
    CONFIG.get_or_init(|| {
        let identity = Identity::read(std::path::Path::new(CONTAINER_IDENTITY_FILE));
        Config::from_sources(identity, |k| std::env::var_os(k))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn cfg(pairs: &[(&str, &str)]) -> Config {
        Config::from_lookup(env(pairs))
    }

    #[test]
    fn no_token_means_pass_through() {
        let c = cfg(&[("TESSERA_SOCKET", "/tmp/s")]);
        assert!(!c.enforcing());
        assert!(!c.closed());
        assert!(!cfg(&[("TESSERA_TOKEN", "  ")]).enforcing());
        assert!(!cfg(&[("TESSERA_TOKEN", "")]).enforcing());
    }

    #[test]
    fn token_without_socket_is_closed() {
        let c = cfg(&[("TESSERA_TOKEN", "abc")]);
        assert!(c.enforcing());
        assert!(c.closed());
        assert_eq!(c.socket, None);
    }

    #[test]
    fn all_variables_read() {
        let c = cfg(&[
            ("TESSERA_TOKEN", "abc\n"),
            ("TESSERA_SOCKET", "/run/t.sock"),
            ("TESSERA_REAL_LIBCUDA", "/opt/libcuda.so.1"),
            // Variables other tools use for their limits are ignored here.
            ("CUDA_DEVICE_MEMORY_LIMIT", "99g"),
        ]);
        assert_eq!(c.token.as_deref(), Some("abc"));
        assert_eq!(c.socket, Some(PathBuf::from("/run/t.sock")));
        assert!(!c.closed());
        assert_eq!(
            c.real_libcuda.as_deref().map(|s| s.to_bytes()),
            Some(&b"/opt/libcuda.so.1"[..])
        );
    }

    #[test]
    fn the_identity_file_wins_over_the_environment() {
        let file = Identity::parse("token=from-file\nsocket=/run/tessera/tessera.sock\n").unwrap();
        // The tenant unset its token and pointed the socket at a fake arbiter.
        let c = Config::from_sources(
            Some(Ok(file.clone())),
            env(&[("TESSERA_SOCKET", "/tmp/fake.sock")]),
        );
        assert_eq!(c.token.as_deref(), Some("from-file"));
        assert_eq!(c.socket, Some(PathBuf::from("/run/tessera/tessera.sock")));
        assert!(!c.closed());
        let c = Config::from_sources(Some(Ok(file)), env(&[("TESSERA_TOKEN", "other")]));
        assert_eq!(c.token.as_deref(), Some("from-file"));
    }

    /// A file whose read fails, as an unreadable identity file's does.
    struct BrokenRead;

    impl std::io::Read for BrokenRead {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "permission denied",
            ))
        }
    }

    #[test]
    fn an_identity_file_that_cannot_be_used_closes_the_process() {
        let path = std::path::Path::new(CONTAINER_IDENTITY_FILE);
        let unreadable =
            Identity::read_from(BrokenRead).map_err(|e| format!("{}: {e}", path.display()));
        for (what, text) in [("empty", ""), ("unknown key", "token=x\nlimit=9\n")] {
            let bad = Identity::read_from(text.as_bytes())
                .map_err(|e| format!("{}: {e}", path.display()));
            assert!(bad.is_err(), "{what}");
            let c = Config::from_sources(
                Some(bad),
                env(&[("TESSERA_TOKEN", "t"), ("TESSERA_SOCKET", "/s")]),
            );
            assert!(c.enforcing() && c.closed(), "{what}: {c:?}");
            assert!(
                c.identity_error
                    .as_deref()
                    .unwrap()
                    .starts_with(CONTAINER_IDENTITY_FILE)
            );
        }
        let c = Config::from_sources(
            Some(unreadable),
            env(&[("TESSERA_TOKEN", "t"), ("TESSERA_SOCKET", "/s")]),
        );
        assert!(c.enforcing() && c.closed(), "unreadable: {c:?}");
        assert!(
            c.identity_error
                .as_deref()
                .unwrap()
                .contains("permission denied")
        );
        // A file without a socket line cannot reach the arbiter either.
        let c = Config::from_sources(
            Some(Identity::parse("token=t\n").map_err(|e| e.to_string())),
            env(&[("TESSERA_SOCKET", "/s")]),
        );
        assert!(c.closed());
    }
}
