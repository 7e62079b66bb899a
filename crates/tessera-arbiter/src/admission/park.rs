//! Failed and evicted handshakes past their pod's budget are held, not closed.
//!
//! Closed, a flooder's connection comes straight back, and every return costs the arbiter an
//! accept, a read of the peer's cgroup, a task, the reading of what the flooder sent and a
//! close that frees whatever else it had written (with `perf` on the arbiter under eight
//! burst flooders: the closes alone were a third of its time; the whole cycle about 0.3 ms of
//! CPU per connection, most of it in the kernel, so a faster arbiter build barely changes it).
//! All those returns wait in the kernel's listen queue, one FIFO for every pod, and a
//! neighbour's `connect` waits behind them: that is how a flood in one pod slowed another
//! pod's newcomer. So a pod may have its failed or evicted connections closed at once only at
//! its budget's rate ([`super::budget`]); past that each is held until the handshake deadline,
//! unread (a task that only sleeps, and a descriptor), and then closed without an answer. A
//! held connection keeps a flooder's slot busy for a second instead of cycling through the
//! listen queue. An honest client's connection is never held unless it failed its handshake
//! (it got its answer already) or was the oldest pending one of a pod over its budget.
//!
//! Bounded like pending connections: at most the per-container pending cap per pod and the
//! global pending cap in all; beyond that the connection is closed at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UnixStream;

use super::group::Group;
use super::{Admission, PendingSlot, close_refused};

/// Held connections, per pod and in all.
#[derive(Debug, Default)]
pub(crate) struct Parked {
    total: usize,
    by_group: HashMap<Group, usize>,
}

impl Parked {
    /// Counts one more held connection of `group`, unless the group has `per_group` or
    /// everyone `total` already.
    pub(crate) fn add(&mut self, group: &Group, per_group: usize, total: usize) -> bool {
        let n = self.by_group.get(group).copied().unwrap_or(0);
        if n >= per_group || self.total >= total {
            return false;
        }
        self.by_group.insert(group.clone(), n + 1);
        self.total += 1;
        true
    }

    /// Forgets one held connection of `group` (the map holds groups with some only).
    pub(crate) fn remove(&mut self, group: &Group) {
        if let Some(n) = self.by_group.get_mut(group) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.by_group.remove(group);
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn total(&self) -> usize {
        self.total
    }
}

/// A held connection's place, given back when dropped.
#[derive(Debug)]
pub(crate) struct ParkedSlot {
    adm: Arc<Admission>,
    group: Group,
}

impl ParkedSlot {
    pub(crate) fn new(adm: Arc<Admission>, group: Group) -> Self {
        Self { adm, group }
    }
}

impl Drop for ParkedSlot {
    fn drop(&mut self) {
        self.adm.unpark(&self.group);
    }
}

/// Holds `stream` unread for `deadline` (the handshake deadline), then closes it without an
/// answer and gives its place back.
async fn hold(stream: UnixStream, slot: ParkedSlot, deadline: Duration) {
    tokio::time::sleep(deadline).await;
    close_refused(stream);
    drop(slot);
}

/// Ends a failed or evicted handshake of `group`: closes it at once while the pod is within
/// its budget, else holds it until the handshake deadline (while there is room to). Its
/// pending place is given back first, whatever happens.
pub(crate) async fn close_or_hold(
    adm: &Arc<Admission>,
    stream: UnixStream,
    pending: PendingSlot,
    group: &Group,
) {
    drop(pending);
    if adm.spend(group, Instant::now()) {
        return close_refused(stream);
    }
    match adm.park(group) {
        Some(slot) => hold(stream, slot, adm.limits().handshake_timeout).await,
        None => close_refused(stream),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(n: u32) -> Group {
        Group::Cgroup(format!("/kubepods/pod{n}"))
    }

    #[test]
    fn held_connections_are_capped_per_pod_and_in_all_and_given_back() {
        let mut p = Parked::default();
        assert!(p.add(&g(1), 2, 3) && p.add(&g(1), 2, 3));
        assert!(!p.add(&g(1), 2, 3), "the pod's cap");
        assert!(p.add(&g(2), 2, 3));
        assert!(!p.add(&Group::Unknown, 2, 3), "the global cap");
        p.remove(&g(1));
        assert!(p.add(&Group::Unknown, 2, 3));
        for grp in [g(1), g(2), Group::Unknown] {
            p.remove(&grp);
        }
        assert_eq!(p.total(), 0);
        assert!(p.by_group.is_empty());
        // Removing what is not there changes nothing.
        p.remove(&g(9));
        assert_eq!(p.total(), 0);
    }
}
