//! Which of the arbiter's sockets an admin command (`run`, `status`, `delete`) talks to, and
//! user names for `status`.
//!
//! The admin socket is root's (mode 0600); a workstation's users use the user socket (mode
//! 0660, the arbiter's `--users-group`), where the arbiter lets them create, list and delete
//! their own allocations within their quota. Rule: a socket named explicitly (flag or
//! environment) is used, the user socket first when both are; otherwise root gets the admin
//! socket and anyone else the user socket.

use std::path::PathBuf;

use tessera_protocol::node;

/// The socket flags of the admin commands.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SocketArgs {
    /// Arbiter admin socket (root's) [default: /run/tessera/admin.sock when run as root].
    #[arg(long, value_name = "PATH", env = node::ENV_ADMIN_SOCKET)]
    pub admin_socket: Option<PathBuf>,
    /// Arbiter user socket (a workstation's users, see docs/install.md) [default:
    /// /run/tessera/user.sock when not run as root].
    #[arg(long, value_name = "PATH", env = node::ENV_USER_SOCKET)]
    pub user_socket: Option<PathBuf>,
}

/// The socket to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// Its path.
    pub path: PathBuf,
    /// True for the user socket.
    pub user: bool,
}

impl SocketArgs {
    /// The socket by the rule in the module docs.
    pub(crate) fn endpoint(&self) -> Endpoint {
        choose(
            self.admin_socket.clone(),
            self.user_socket.clone(),
            is_root(),
        )
    }
}

fn choose(admin: Option<PathBuf>, user: Option<PathBuf>, root: bool) -> Endpoint {
    match (admin, user) {
        (_, Some(path)) => Endpoint { path, user: true },
        (Some(path), None) => Endpoint { path, user: false },
        (None, None) if root => Endpoint {
            path: node::DEFAULT_ADMIN_SOCKET.into(),
            user: false,
        },
        (None, None) => Endpoint {
            path: node::DEFAULT_USER_SOCKET.into(),
            user: true,
        },
    }
}

/// True when this process runs as root (effective uid 0).
pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The name of user `uid` (through the C library, so NSS sources count), if it has one.
pub(crate) fn user_name(uid: u32) -> Option<String> {
    let mut size = 16 * 1024;
    loop {
        let mut buf = vec![0u8; size];
        // SAFETY: a zeroed `passwd` is a valid value to be filled in.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: `pw`, `out` and `buf` (`size` bytes) are ours and valid for the call; the
        // name is copied out of `buf` before it is dropped.
        let rc = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), size, &mut out) };
        if rc == libc::ERANGE && size < 1 << 20 {
            size *= 4;
            continue;
        }
        if rc != 0 || out.is_null() || pw.pw_name.is_null() {
            return None;
        }
        // SAFETY: on success `pw_name` points at a NUL-terminated string inside `buf`.
        let name = unsafe { std::ffi::CStr::from_ptr(pw.pw_name) };
        return Some(name.to_string_lossy().into_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_named_wins_else_root_gets_admin_and_users_the_user_socket() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(
            choose(p("/a"), None, false),
            Endpoint {
                path: "/a".into(),
                user: false
            }
        );
        assert_eq!(
            choose(p("/a"), p("/u"), true),
            Endpoint {
                path: "/u".into(),
                user: true
            }
        );
        assert_eq!(
            choose(None, None, true),
            Endpoint {
                path: node::DEFAULT_ADMIN_SOCKET.into(),
                user: false
            }
        );
        assert_eq!(
            choose(None, None, false),
            Endpoint {
                path: node::DEFAULT_USER_SOCKET.into(),
                user: true
            }
        );
    }

    #[test]
    fn root_has_a_name() {
        assert_eq!(user_name(0).as_deref(), Some("root"));
        assert_eq!(user_name(4_000_000_000), None);
    }
}
