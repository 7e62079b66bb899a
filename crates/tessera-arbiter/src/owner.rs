//! Allocations owned by a process (`tessera run`): everything under the owner is the
//! allocation's, and the allocation lives exactly as long as its processes.
//!
//! The owner is named by pid and start time ([`ProcessOwner`]), checked at every use, so a
//! recycled pid owns nothing. `tessera run` is a child subreaper: a process that double-forks
//! away from its parent is reparented to it, so every process the command starts stays under
//! the owner in `/proc`. The backstop ([`crate::backstop`]) attributes a GPU process that no
//! connection or identity file names to the allocation whose live owner is its ancestor, and
//! remembers it as a *member* (pid and start time), so it stays attributed after the owner is
//! gone. The reaper ([`crate::reaper`]) deletes an owned allocation once its owner is gone, no
//! process of it is connected and no member is alive ([`gone`]).

#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};

use tessera_protocol::ProcessOwner;

pub(crate) use tessera_protocol::process::{alive, start_time};

/// The members the backstop found, per allocation id.
#[derive(Debug, Default)]
pub(crate) struct Members {
    by_id: HashMap<String, HashSet<ProcessOwner>>,
}

impl Members {
    /// `p` is a process of allocation `id`.
    pub(crate) fn note(&mut self, id: &str, p: ProcessOwner) {
        self.by_id.entry(id.to_owned()).or_default().insert(p);
    }

    /// The allocation `p` is a member of.
    pub(crate) fn of(&self, p: ProcessOwner) -> Option<&str> {
        self.by_id
            .iter()
            .find(|(_, m)| m.contains(&p))
            .map(|(id, _)| id.as_str())
    }

    /// Drops members that exited (`alive` says which run); returns how many of `id`'s live.
    pub(crate) fn prune(&mut self, id: &str, alive: impl Fn(ProcessOwner) -> bool) -> usize {
        let Some(m) = self.by_id.get_mut(id) else {
            return 0;
        };
        m.retain(|p| alive(*p));
        let n = m.len();
        if n == 0 {
            self.by_id.remove(id);
        }
        n
    }

    /// Forgets allocation `id`.
    pub(crate) fn forget(&mut self, id: &str) {
        self.by_id.remove(id);
    }

    /// Forgets every allocation `keep` does not name (deleted ones).
    pub(crate) fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.by_id.retain(|id, _| keep(id));
    }
}

/// The allocation (index into `owners`) whose owner is `pid` or its nearest ancestor that is
/// an owner; `parent` and `start` read `/proc` (fakes in tests). An owner counts only with its
/// recorded start time.
pub(crate) fn owned_ancestor(
    pid: i32,
    owners: &[ProcessOwner],
    parent: &dyn Fn(i32) -> Option<i32>,
    start: &dyn Fn(i32) -> Option<u64>,
) -> Option<usize> {
    let mut p = pid;
    // Bounded: a pid cycle read mid-change cannot loop forever.
    for _ in 0..64 {
        if let Some(i) = owners.iter().position(|o| o.pid == p)
            && start(p) == Some(owners[i].start_time)
        {
            return Some(i);
        }
        match parent(p) {
            Some(pp) if pp > 1 && pp != p => p = pp,
            _ => return None,
        }
    }
    None
}

/// What the reaper decides for one owned allocation.
pub(crate) fn gone(owner_alive: bool, connected: usize, members_alive: usize) -> bool {
    !owner_alive && connected == 0 && members_alive == 0
}

/// A child process that sleeps until killed, and its name as an owner, for tests of what
/// happens when an owner exits.
#[cfg(test)]
pub(crate) fn test_owner() -> (std::process::Child, ProcessOwner) {
    let (child, id) = crate::peer::test_child();
    let owner = ProcessOwner {
        pid: id.pid,
        start_time: id.start,
    };
    (child, owner)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: ProcessOwner = ProcessOwner {
        pid: 10,
        start_time: 500,
    };

    #[test]
    fn a_descendant_of_a_live_owner_is_its_allocations_and_a_recycled_owner_pid_owns_nothing() {
        // 30 -> 20 -> 10 (owner) -> 1
        let parent = |p: i32| match p {
            30 => Some(20),
            20 => Some(10),
            10 => Some(1),
            _ => None,
        };
        let owners = [ME];
        assert_eq!(
            owned_ancestor(30, &owners, &parent, &|_| Some(500)),
            Some(0)
        );
        assert_eq!(
            owned_ancestor(10, &owners, &parent, &|_| Some(500)),
            Some(0)
        );
        // Pid 10 now belongs to a process started later: not the owner.
        assert_eq!(owned_ancestor(30, &owners, &parent, &|_| Some(999)), None);
        assert_eq!(owned_ancestor(40, &owners, &parent, &|_| Some(500)), None);
        // A cycle ends.
        let cycle = |p: i32| Some(if p == 30 { 31 } else { 30 });
        assert_eq!(owned_ancestor(30, &owners, &cycle, &|_| Some(1)), None);
    }

    #[test]
    fn members_are_kept_while_they_live_and_the_allocation_goes_only_when_all_are_gone() {
        let mut m = Members::default();
        let child = ProcessOwner {
            pid: 11,
            start_time: 600,
        };
        m.note("a", child);
        assert_eq!(m.of(child), Some("a"));
        assert_eq!(
            m.of(ProcessOwner {
                pid: 11,
                start_time: 601
            }),
            None
        );
        assert_eq!(m.prune("a", |_| true), 1);
        assert!(!gone(false, 0, 1), "a member still runs");
        assert!(!gone(false, 1, 0), "a process is still connected");
        assert!(!gone(true, 0, 0), "the owner still runs");
        assert_eq!(m.prune("a", |_| false), 0);
        assert!(gone(false, 0, 0));
        assert_eq!(m.of(child), None);
        // Members of a deleted allocation are forgotten.
        m.note("b", child);
        m.retain(|id| id != "b");
        assert_eq!(m.of(child), None);
    }
}
