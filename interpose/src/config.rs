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
use std::path::Path;
use std::sync::OnceLock;

pub use tessera_protocol::identity::CONTAINER_IDENTITY_FILE;
use tessera_protocol::identity::{Identity, IdentityReadError};
use tessera_protocol::node::{self, Closed, Target};

/// The process's settings, read once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Which allocation the process belongs to, by the node contract's rule
    /// ([`node::resolve`], shared with `tessera doctor`).
    pub target: Target,
    /// Path of the real driver to load instead of `libcuda.so.1`.
    pub real_libcuda: Option<CString>,
}

impl Config {
    /// Builds the configuration from the identity file (`None`: no such file; `Some(Err)`: it
    /// exists but could not be read or parsed) and a variable lookup.
    pub fn from_sources(
        identity: Option<Result<Identity, IdentityReadError>>,
        get: impl Fn(&str) -> Option<OsString>,
    ) -> Self {
        let real_libcuda = get(node::ENV_REAL_LIBCUDA)
            .filter(|v| !v.is_empty())
            .and_then(|v| CString::new(v.into_vec()).ok());
        Self {
            target: node::resolve(identity, &get),
            real_libcuda,
        }
    }

    /// Builds the configuration from a variable lookup alone (no identity file).
    pub fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Self {
        Self::from_sources(None, get)
    }

    /// True when limits are enforced (the process is a tenant, able to prove it or not).
    pub fn enforcing(&self) -> bool {
        !matches!(self.target, Target::NotATenant)
    }

    /// True when the process enforces but cannot reach an arbiter it can prove itself to:
    /// allocations are refused and launches fail.
    pub fn closed(&self) -> bool {
        matches!(self.target, Target::Closed(_))
    }

    /// Why it is closed.
    pub fn closed_reason(&self) -> Option<&Closed> {
        match &self.target {
            Target::Closed(why) => Some(why),
            _ => None,
        }
    }

    /// The allocation's token (empty when closed: there is nothing to prove with).
    pub fn token(&self) -> Option<String> {
        match &self.target {
            Target::NotATenant => None,
            Target::Closed(_) => Some(String::new()),
            Target::Tenant { token, .. } => Some(token.clone()),
        }
    }

    /// The tenant socket (none when closed).
    pub fn socket(&self) -> Option<&Path> {
        match &self.target {
            Target::Tenant { socket, .. } => Some(socket),
            _ => None,
        }
    }
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// The process configuration (read on first use).
pub fn get() -> &'static Config {
    CONFIG.get_or_init(|| {
        let identity = Identity::read(Path::new(CONTAINER_IDENTITY_FILE));
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

    /// The interposer follows the node contract in every case of its table (the one
    /// `tessera doctor` is checked against too).
    #[test]
    fn the_interposer_follows_the_node_contract() {
        for (what, file, vars, want) in node::contract_cases() {
            let identity = file.map(|t| Identity::read_from(t.as_bytes()));
            let c = Config::from_sources(identity, env(&vars));
            assert_eq!(c.target, want, "{what}");
            assert_eq!(c.enforcing(), want != Target::NotATenant, "{what}");
            assert_eq!(c.closed(), matches!(want, Target::Closed(_)), "{what}");
            assert_eq!(c.socket().is_some(), matches!(want, Target::Tenant { .. }));
        }
    }

    #[test]
    fn the_real_driver_is_read_and_other_tools_limits_ignored() {
        let c = Config::from_lookup(env(&[
            ("TESSERA_TOKEN", "abc"),
            ("TESSERA_SOCKET", "/run/t.sock"),
            ("TESSERA_REAL_LIBCUDA", "/opt/libcuda.so.1"),
            // Variables other tools use for their limits are ignored here.
            ("CUDA_DEVICE_MEMORY_LIMIT", "99g"),
        ]));
        assert_eq!(c.token().as_deref(), Some("abc"));
        assert_eq!(
            c.real_libcuda.as_deref().map(|s| s.to_bytes()),
            Some(&b"/opt/libcuda.so.1"[..])
        );
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
    fn an_unreadable_identity_file_closes_the_process() {
        let c = Config::from_sources(
            Some(Identity::read_from(BrokenRead)),
            env(&[("TESSERA_TOKEN", "t"), ("TESSERA_SOCKET", "/s")]),
        );
        assert!(c.enforcing() && c.closed(), "unreadable: {c:?}");
        assert!(
            c.closed_reason()
                .unwrap()
                .to_string()
                .contains("permission denied")
        );
        assert_eq!(c.socket(), None);
    }
}
