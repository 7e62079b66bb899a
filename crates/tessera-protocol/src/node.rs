//! The node contract: the names and paths every Tessera program on a node agrees on (the
//! environment variables, the default sockets and folders), and the one rule by which a
//! process finds the allocation it belongs to ([`resolve`]), used by the interposer and by
//! `tessera doctor` alike so that the two can never disagree about where a process connects.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::identity::{Identity, IdentityReadError};

/// The allocation's secret token (`tessera run` sets it; in a container the identity file
/// wins).
pub const ENV_TOKEN: &str = "TESSERA_TOKEN";
/// The arbiter's tenant socket.
pub const ENV_SOCKET: &str = "TESSERA_SOCKET";
/// The arbiter's admin socket (operators' tools; removed from a `tessera run` command).
pub const ENV_ADMIN_SOCKET: &str = "TESSERA_ADMIN_SOCKET";
/// The arbiter's user socket (a workstation's users create their own allocations there).
pub const ENV_USER_SOCKET: &str = "TESSERA_USER_SOCKET";
/// The interposer library `tessera run` and `tessera doctor` use.
pub const ENV_INTERPOSER: &str = "TESSERA_INTERPOSER";
/// The public id of a container's allocation (for people; the device plugin sets it).
pub const ENV_ALLOCATION_ID: &str = "TESSERA_ALLOCATION_ID";
/// The real driver the interposer loads instead of `libcuda.so.1`.
pub const ENV_REAL_LIBCUDA: &str = "TESSERA_REAL_LIBCUDA";
/// The interposer's log level.
pub const ENV_LOG: &str = "TESSERA_LOG";
/// The daemons' log format (`text` or `json`).
pub const ENV_LOG_FORMAT: &str = "TESSERA_LOG_FORMAT";
/// The NVML library the daemons load.
pub const ENV_NVML_LIB: &str = "TESSERA_NVML_LIB";
/// The GPUs a kubelet plugin offers (its `--gpus`).
pub const ENV_GPUS: &str = "TESSERA_GPUS";
/// Where the arbiter serves its metrics (its `--metrics-addr`).
pub const ENV_METRICS_ADDR: &str = "TESSERA_METRICS_ADDR";

/// The arbiter's tenant socket on a host (in its own folder, which the plugins mount into
/// containers: the admin socket is never in it).
pub const DEFAULT_TENANT_SOCKET: &str = "/run/tessera/tenant/tessera.sock";
/// The arbiter's admin socket on a host.
pub const DEFAULT_ADMIN_SOCKET: &str = "/run/tessera/admin.sock";
/// The arbiter's user socket on a host (mode 0660, group `--users-group`; outside the tenant
/// folder, so never in a container).
pub const DEFAULT_USER_SOCKET: &str = "/run/tessera/user.sock";
/// The arbiter's state folder.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/tessera";
/// Where the tenant socket's folder appears inside a container.
pub const CONTAINER_SOCKET_DIR: &str = "/run/tessera";
/// Where the interposer appears inside a container.
pub const CONTAINER_LIB_PATH: &str = "/usr/lib/tessera/libtessera_interpose.so";
/// The host folder of the versioned interposer copies the plugins install.
pub const HOST_LIB_DIR: &str = "/var/lib/tessera/lib";
/// The host folder of the per-container identity files.
pub const HOST_IDENTITY_DIR: &str = "/var/lib/tessera/identity";

pub use crate::identity::CONTAINER_IDENTITY_FILE;

/// Where a process's allocation was named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The container's read-only identity file.
    IdentityFile,
    /// `TESSERA_TOKEN` and `TESSERA_SOCKET` (outside a container).
    Environment,
}

/// Why a process that must enforce limits cannot prove its allocation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Closed {
    /// The identity file exists but cannot be read or parsed.
    #[error("the identity file is unusable: {0}")]
    UnusableIdentity(String),
    /// The identity file names no socket.
    #[error("the identity file names no tenant socket")]
    IdentityWithoutSocket,
    /// A token in the environment without a socket.
    #[error("{ENV_TOKEN} is set but {ENV_SOCKET} is not")]
    TokenWithoutSocket,
}

/// What a process is, as far as Tessera goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Not a tenant: no identity file and no token; the interposer passes everything through.
    NotATenant,
    /// A tenant of the allocation `token`, served on `socket`.
    Tenant {
        /// The allocation's token.
        token: String,
        /// The arbiter's tenant socket.
        socket: PathBuf,
        /// Where they came from.
        source: Source,
    },
    /// A tenant that cannot prove its allocation: every allocation is refused and every launch
    /// fails.
    Closed(Closed),
}

/// The rule: the identity file (read-only, mounted by the plugin) wins over the environment,
/// which a tenant controls; a file that exists but cannot be used, or names no socket, closes
/// the process, as does a token without a socket. Without a file or a token the process is no
/// tenant. `identity` is the result of reading the file (`None`: there is none); `get` looks
/// up a variable.
pub fn resolve(
    identity: Option<Result<Identity, IdentityReadError>>,
    get: impl Fn(&str) -> Option<OsString>,
) -> Target {
    match identity {
        Some(Err(e)) => Target::Closed(Closed::UnusableIdentity(e.to_string())),
        Some(Ok(id)) => match id.socket {
            Some(socket) => Target::Tenant {
                token: id.token,
                socket,
                source: Source::IdentityFile,
            },
            None => Target::Closed(Closed::IdentityWithoutSocket),
        },
        None => {
            let token = get(ENV_TOKEN)
                .map(|v| v.to_string_lossy().trim().to_owned())
                .filter(|t| !t.is_empty());
            let socket = get(ENV_SOCKET).filter(|v| !v.is_empty()).map(PathBuf::from);
            match (token, socket) {
                (None, _) => Target::NotATenant,
                (Some(_), None) => Target::Closed(Closed::TokenWithoutSocket),
                (Some(token), Some(socket)) => Target::Tenant {
                    token,
                    socket,
                    source: Source::Environment,
                },
            }
        }
    }
}

/// One case of [`contract_cases`]: what it is, the identity file's text (`None`: no file), the
/// environment, the expected target.
#[doc(hidden)]
pub type ContractCase = (
    &'static str,
    Option<&'static str>,
    Vec<(&'static str, &'static str)>,
    Target,
);

/// The cases every user of [`resolve`] is checked against.
/// Kept here so the interposer's and `doctor`'s tests use one table.
#[doc(hidden)]
pub fn contract_cases() -> Vec<ContractCase> {
    let tenant = |token: &str, socket: &str, source| Target::Tenant {
        token: token.into(),
        socket: socket.into(),
        source,
    };
    vec![
        ("nothing", None, vec![], Target::NotATenant),
        (
            "a socket alone is no tenant",
            None,
            vec![(ENV_SOCKET, "/s")],
            Target::NotATenant,
        ),
        (
            "a blank token is no token",
            None,
            vec![(ENV_TOKEN, "  "), (ENV_SOCKET, "/s")],
            Target::NotATenant,
        ),
        (
            "token and socket",
            None,
            vec![(ENV_TOKEN, "abc\n"), (ENV_SOCKET, "/run/t.sock")],
            tenant("abc", "/run/t.sock", Source::Environment),
        ),
        (
            "a token without a socket closes",
            None,
            vec![(ENV_TOKEN, "abc")],
            Target::Closed(Closed::TokenWithoutSocket),
        ),
        (
            "the identity file wins over the environment",
            Some("token=from-file\nsocket=/run/tessera/tessera.sock\n"),
            vec![(ENV_TOKEN, "other"), (ENV_SOCKET, "/tmp/fake.sock")],
            tenant(
                "from-file",
                "/run/tessera/tessera.sock",
                Source::IdentityFile,
            ),
        ),
        (
            "an identity file without a socket closes, whatever the environment says",
            Some("token=t\n"),
            vec![(ENV_SOCKET, "/s")],
            Target::Closed(Closed::IdentityWithoutSocket),
        ),
        (
            "an identity file that does not parse closes",
            Some("token=x\nlimit=9\n"),
            vec![(ENV_TOKEN, "t"), (ENV_SOCKET, "/s")],
            Target::Closed(Closed::UnusableIdentity(
                "identity file line 2: unknown key \"limit\"".into(),
            )),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(text: Option<&str>) -> Option<Result<Identity, IdentityReadError>> {
        text.map(|t| Identity::read_from(t.as_bytes()))
    }

    #[test]
    fn every_case_of_the_contract() {
        for (what, file, env, want) in contract_cases() {
            let got = resolve(identity(file), |k| {
                env.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| OsString::from(v))
            });
            assert_eq!(got, want, "{what}");
        }
    }
}
