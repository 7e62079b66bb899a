//! What the interposer takes from the environment: only `TESSERA_SOCKET`, `TESSERA_TOKEN`,
//! `TESSERA_REAL_LIBCUDA` and `TESSERA_LOG`. Limits never come from here: they come from the
//! arbiter's `Welcome`. There is deliberately no variable that turns enforcement off while a
//! token is present.

use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The process's settings, read once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The tenant's allocation token; `None` means pass everything through untouched.
    pub token: Option<String>,
    /// The arbiter's tenant socket. `None` with a token means enforcement without an arbiter:
    /// every allocation is refused (unsetting the variable must not turn limits off).
    pub socket: Option<PathBuf>,
    /// Path of the real driver to load instead of `libcuda.so.1`.
    pub real_libcuda: Option<CString>,
}

impl Config {
    /// Builds the configuration from a variable lookup (the environment, or a map in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Self {
        let non_empty = |k: &str| get(k).filter(|v| !v.is_empty());
        let token = non_empty("TESSERA_TOKEN").map(|v| v.to_string_lossy().trim().to_owned());
        let token = token.filter(|t| !t.is_empty());
        let socket = non_empty("TESSERA_SOCKET").map(PathBuf::from);
        let real_libcuda =
            non_empty("TESSERA_REAL_LIBCUDA").and_then(|v| CString::new(v.into_vec()).ok());
        Self { token, socket, real_libcuda }
    }

    /// True when limits are enforced.
    pub fn enforcing(&self) -> bool {
        self.token.is_some()
    }
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// The process configuration (read from the environment on first use).
pub fn get() -> &'static Config {
    CONFIG.get_or_init(|| Config::from_lookup(|k| std::env::var_os(k)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Config {
        let m: HashMap<String, OsString> =
            pairs.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn no_token_means_pass_through() {
        let c = cfg(&[("TESSERA_SOCKET", "/tmp/s")]);
        assert!(!c.enforcing());
        assert!(!cfg(&[("TESSERA_TOKEN", "  ")]).enforcing());
        assert!(!cfg(&[("TESSERA_TOKEN", "")]).enforcing());
    }

    #[test]
    fn token_without_socket_still_enforces() {
        let c = cfg(&[("TESSERA_TOKEN", "abc")]);
        assert!(c.enforcing());
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
        assert_eq!(c.real_libcuda.as_deref().map(|s| s.to_bytes()), Some(&b"/opt/libcuda.so.1"[..]));
    }
}
