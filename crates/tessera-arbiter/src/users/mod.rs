//! A shared workstation's users: the user socket and its access model.
//!
//! The operator names a group (`--users-group`) and a quota per user (`--user-quota`, with
//! `--user-quota-for` overrides). The arbiter then serves a third socket, the user socket
//! (`--user-socket`, mode 0660, owned by that group, never in the tenant socket's folder), on
//! which the group's members speak the admin protocol with less power:
//! - the caller is who the kernel says (`SO_PEERCRED` uid and gid of the peer, its
//!   supplementary groups read from `/proc/<pid>/status` while its pidfd proves it is still
//!   the process that connected), never anything the client sends; a peer outside the group
//!   is refused at the handshake even if the socket's mode let it in;
//! - what a user creates is recorded as theirs (the uid) and counted against their quota:
//!   memory over all their allocations on every GPU, shares over theirs on one GPU;
//! - a user may delete, relabel and read the kill records of their own allocations only, may
//!   create no latency-tier allocation and set no `tessera.dev/` label (those steer the
//!   backstop and the device plugin), and may own an allocation only by the very process
//!   that asks (`tessera run`), so no one can tie another's processes to their allocation;
//! - listing shows every allocation with its owner's uid (tokens are never listed: a token
//!   is handed out once, to its creator).
//!
//! Modules: [`names`] (user and group names to ids), [`caller`] (the peer's identity),
//! [`socket`] (the socket's server).

pub(crate) mod caller;
pub(crate) mod names;
pub(crate) mod socket;

use std::collections::BTreeMap;
use std::path::PathBuf;

use tessera_protocol::node;

/// What one user's allocations may hold together (defined with the state's access rules,
/// which enforce it).
pub(crate) use crate::state::Quota;

/// One user's quota in place of the default (`--user-quota-for`): the keys it gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaOverride {
    /// The user.
    pub uid: u32,
    /// Memory, if given.
    pub memory: Option<u64>,
    /// Shares, if given.
    pub shares: Option<u32>,
}

/// Errors of the quota flags (clap prints them, exit 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum QuotaError {
    /// An item that is not `key=value`, or an unknown key.
    #[error("{0:?}: expected memory=SIZE,shares=N (e.g. memory=16GiB,shares=50)")]
    Item(String),
    /// A bad size.
    #[error("memory={0}: {1}")]
    Memory(String, String),
    /// Shares not in 0..=100.
    #[error("shares={0}: expected a number from 0 to 100")]
    Shares(String),
    /// The default quota must give both.
    #[error("{0:?}: the default quota needs both memory=SIZE and shares=N")]
    Incomplete(String),
    /// `USER:` missing in `--user-quota-for`.
    #[error("{0:?}: expected USER:memory=SIZE,shares=N (USER a name or uid)")]
    NoUser(String),
    /// A user name the system does not know.
    #[error(transparent)]
    Name(#[from] names::NameError),
}

/// `memory=SIZE,shares=N`, either key optional.
fn parse_items(text: &str) -> Result<(Option<u64>, Option<u32>), QuotaError> {
    let (mut memory, mut shares) = (None, None);
    for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| QuotaError::Item(item.into()))?;
        let v = v.trim();
        match k.trim() {
            "memory" => {
                memory = Some(
                    tessera_protocol::size::parse_size_or_zero(v)
                        .map_err(|e| QuotaError::Memory(v.into(), e.to_string()))?,
                )
            }
            "shares" => {
                shares = Some(
                    v.parse::<u32>()
                        .ok()
                        .filter(|s| *s <= 100)
                        .ok_or_else(|| QuotaError::Shares(v.into()))?,
                )
            }
            _ => return Err(QuotaError::Item(item.into())),
        }
    }
    Ok((memory, shares))
}

/// `--user-quota`: `memory=SIZE,shares=N`, both given.
pub(crate) fn parse_quota(text: &str) -> Result<Quota, QuotaError> {
    match parse_items(text)? {
        (Some(memory), Some(shares)) => Ok(Quota { memory, shares }),
        _ => Err(QuotaError::Incomplete(text.into())),
    }
}

/// `--user-quota-for`: `USER:memory=SIZE,shares=N`, USER a name (looked up now) or a uid.
pub(crate) fn parse_override(text: &str) -> Result<QuotaOverride, QuotaError> {
    let (user, items) = text
        .split_once(':')
        .ok_or_else(|| QuotaError::NoUser(text.into()))?;
    let uid = names::uid_of(user.trim())?;
    let (memory, shares) = parse_items(items)?;
    Ok(QuotaOverride {
        uid,
        memory,
        shares,
    })
}

/// The user socket's flags (flattened into the arbiter's [`crate::config::Config`]).
#[derive(Debug, Clone, clap::Args)]
pub struct UserArgs {
    /// Serve the user socket for this group (a name or gid): its members create, list and
    /// delete their own allocations there, within their quota, without root (docs/install.md,
    /// "A shared workstation"). Needs --user-quota. Without it there is no user socket.
    #[arg(long, value_name = "GROUP", value_parser = names::parse_group, requires = "user_quota")]
    pub users_group: Option<u32>,
    /// The user socket (mode 0660, group --users-group). Not in the tenant socket's folder,
    /// which containers see.
    #[arg(
        long,
        value_name = "PATH",
        env = node::ENV_USER_SOCKET,
        default_value = node::DEFAULT_USER_SOCKET
    )]
    pub user_socket: PathBuf,
    /// Each user's quota: memory=SIZE (all their allocations together, every GPU) and
    /// shares=N (theirs on any one GPU, 0-100), e.g. memory=16GiB,shares=50.
    #[arg(
        long,
        value_name = "memory=SIZE,shares=N",
        value_parser = parse_quota,
        requires = "users_group"
    )]
    pub user_quota: Option<Quota>,
    /// One user's quota in place of the default: USER:memory=SIZE,shares=N (USER a name or
    /// uid; a key not given is the default's). Repeat for more users.
    #[arg(
        long,
        value_name = "USER:memory=SIZE,shares=N",
        value_parser = parse_override,
        requires = "users_group"
    )]
    pub user_quota_for: Vec<QuotaOverride>,
}

/// The user socket's settings, once the flags are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Users {
    /// The group whose members may connect.
    pub gid: u32,
    /// Every user's quota but those in `per_uid`.
    pub default: Quota,
    /// Quotas of named users.
    pub per_uid: BTreeMap<u32, Quota>,
}

impl UserArgs {
    /// The settings, or `None` without `--users-group` (no user socket).
    pub fn users(&self) -> Option<Users> {
        let gid = self.users_group?;
        let default = self.user_quota?;
        let per_uid = self
            .user_quota_for
            .iter()
            .map(|o| {
                let q = Quota {
                    memory: o.memory.unwrap_or(default.memory),
                    shares: o.shares.unwrap_or(default.shares),
                };
                (o.uid, q)
            })
            .collect();
        Some(Users {
            gid,
            default,
            per_uid,
        })
    }
}

impl Users {
    /// `uid`'s quota.
    pub fn quota(&self, uid: u32) -> Quota {
        self.per_uid.get(&uid).copied().unwrap_or(self.default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    const GIB: u64 = 1 << 30;

    #[derive(Debug, clap::Parser)]
    struct Flags {
        #[command(flatten)]
        users: UserArgs,
    }

    fn parse(args: &[&str]) -> Result<Flags, clap::Error> {
        Flags::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
    }

    #[test]
    fn quotas_default_and_per_user() {
        let f = parse(&[
            "--users-group",
            "61000",
            "--user-quota",
            "memory=16GiB,shares=50",
            "--user-quota-for",
            "61001:memory=32GiB",
            "--user-quota-for",
            "61002:shares=100,memory=0",
        ])
        .unwrap();
        let u = f.users.users().unwrap();
        assert_eq!(u.gid, 61000);
        assert_eq!(
            u.quota(7),
            Quota {
                memory: 16 * GIB,
                shares: 50
            }
        );
        assert_eq!(
            u.quota(61001),
            Quota {
                memory: 32 * GIB,
                shares: 50
            }
        );
        assert_eq!(
            u.quota(61002),
            Quota {
                memory: 0,
                shares: 100
            }
        );
        // No group, no user socket.
        assert_eq!(parse(&[]).unwrap().users.users(), None);
    }

    #[test]
    fn bad_quotas_are_usage_errors() {
        // A group needs a quota, and a quota a group.
        assert!(parse(&["--users-group", "61000"]).is_err());
        assert!(parse(&["--user-quota", "memory=1GiB,shares=5"]).is_err());
        assert_eq!(
            parse_quota("memory=16GiB"),
            Err(QuotaError::Incomplete("memory=16GiB".into()))
        );
        let e = parse_quota("memory=16,shares=5").unwrap_err().to_string();
        assert!(e.contains("a size needs a unit, e.g. 16GiB"), "{e}");
        assert_eq!(
            parse_quota("memory=1GiB,shares=101"),
            Err(QuotaError::Shares("101".into()))
        );
        assert!(matches!(parse_quota("cpu=4"), Err(QuotaError::Item(_))));
        assert!(matches!(
            parse_override("memory=1GiB"),
            Err(QuotaError::NoUser(_))
        ));
        assert!(matches!(
            parse_override("no-such-user-here:memory=1GiB"),
            Err(QuotaError::Name(_))
        ));
    }
}
