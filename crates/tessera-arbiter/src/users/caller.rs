//! Who is on the other end of the user socket, as the kernel says: `SO_PEERCRED`'s uid, gid
//! and pid, the supplementary groups from `/proc/<pid>/status`, and the process's start time.
//! Nothing a client sends takes part.

#![forbid(unsafe_code)]

use std::os::fd::AsFd;
use std::path::Path;

use crate::peer::{self, ProcId};

/// Why a peer could not be named (its connection is refused).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallerError {
    /// The kernel gave no credentials.
    #[error("no peer credentials: {0}")]
    Cred(#[source] std::io::Error),
    /// The kernel named no pid (a peer in a pid namespace we cannot see).
    #[error("the peer's pid is not visible from the arbiter's pid namespace")]
    NoPid,
    /// The process exited (or its pid was reused) before it could be read.
    #[error("the peer process {0} is gone")]
    Gone(i32),
}

/// The user socket's peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Caller {
    /// Its uid when it connected.
    pub uid: u32,
    /// Its primary gid when it connected.
    pub gid: u32,
    /// Its supplementary groups (read from `/proc` after it connected, while it was alive).
    pub groups: Vec<u32>,
    /// The process, by pid and start time.
    pub process: ProcId,
}

impl Caller {
    /// The peer of `stream`, read now (at the handshake).
    pub(crate) fn of(stream: &tokio::net::UnixStream) -> Result<Self, CallerError> {
        let cred = stream.peer_cred().map_err(CallerError::Cred)?;
        let pid = cred.pid().filter(|p| *p > 0).ok_or(CallerError::NoPid)?;
        // The pidfd (where the kernel has SO_PEERPIDFD) is the very process that connected: the
        // groups read below are its own if it is still alive after the read.
        let proc_ = peer::peer_process(stream.as_fd(), pid).ok_or(CallerError::Gone(pid))?;
        let status = tessera_protocol::process::read_proc_file(
            &Path::new("/proc").join(pid.to_string()).join("status"),
        )
        .map_err(|_| CallerError::Gone(pid))?;
        let same = proc_.is_alive() && peer::proc_start(pid) == Some(proc_.id.start);
        if !same {
            return Err(CallerError::Gone(pid));
        }
        Ok(Self {
            uid: cred.uid(),
            gid: cred.gid(),
            groups: supplementary_groups(&status),
            process: proc_.id,
        })
    }

    /// True when it is in group `gid` (primary or supplementary), or is root.
    pub(crate) fn in_group(&self, gid: u32) -> bool {
        self.uid == 0 || self.gid == gid || self.groups.contains(&gid)
    }

    /// True when `owner` names this very process (the only owner a user may give).
    pub(crate) fn is(&self, owner: &tessera_protocol::ProcessOwner) -> bool {
        owner.pid == self.process.pid && owner.start_time == self.process.start
    }
}

/// The `Groups:` line of a `/proc/<pid>/status` (empty when absent).
pub(crate) fn supplementary_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| {
            g.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_from_proc_status() {
        let s = "Name:\tpython3\nUid:\t61001\t61001\t61001\t61001\nGroups:\t27 61000 \nNgid:\t0\n";
        assert_eq!(supplementary_groups(s), vec![27, 61000]);
        assert_eq!(supplementary_groups("Groups:\t\n"), Vec::<u32>::new());
        assert_eq!(supplementary_groups("Name:\tx\n"), Vec::<u32>::new());
    }

    #[test]
    fn membership_and_ownership() {
        let c = Caller {
            uid: 61001,
            gid: 100,
            groups: vec![61000],
            process: ProcId { pid: 42, start: 7 },
        };
        assert!(c.in_group(61000) && c.in_group(100) && !c.in_group(61002));
        let me = tessera_protocol::ProcessOwner {
            pid: 42,
            start_time: 7,
        };
        assert!(c.is(&me));
        assert!(!c.is(&tessera_protocol::ProcessOwner {
            pid: 42,
            start_time: 8
        }));
    }

    #[tokio::test]
    async fn the_peer_of_a_socket_pair_is_this_process() {
        let (a, _b) = tokio::net::UnixStream::pair().unwrap();
        let c = Caller::of(&a).unwrap();
        // `Uid:` is real, effective, saved, filesystem: SO_PEERCRED gives the effective one.
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let uid: u32 = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(c.uid, uid);
        assert_eq!(c.process.pid, std::process::id() as i32);
        assert_eq!(c.groups, supplementary_groups(&status));
    }
}
