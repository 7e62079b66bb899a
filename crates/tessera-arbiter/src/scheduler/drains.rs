//! Drains: a lease the scheduler ended before its holder did (overdue, or revoked for a
//! latency request) still counts as leased, and is charged, until the holder releases it, asks
//! again or closes, for at most [`SchedulerParams::revoked_drain_ns`](super::SchedulerParams):
//! [`Drains`] (a value type) and the scheduler's use of it.

use crate::ledger::{AccountKey, ConnId};

use super::GpuScheduler;
use super::lease::Lease;

/// A lease the scheduler ended before its holder released it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Drain {
    pub(super) conn: ConnId,
    pub(super) key: AccountKey,
    pub(super) lease_id: u64,
    /// When the scheduler ended it.
    pub(super) since: u64,
}

impl Drain {
    /// Its drain time by `now`, at most `bound`, ns.
    pub(super) fn part(&self, now: u64, bound: u64) -> u64 {
        now.min(self.since.saturating_add(bound))
            .saturating_sub(self.since)
    }
}

/// The drains in progress on a GPU, each counted for at most `bound` ns.
#[derive(Debug)]
pub(super) struct Drains {
    bound: u64,
    list: Vec<Drain>,
}

impl Drains {
    /// No drain; each to come bounded by `bound` ns.
    pub(super) fn new(bound: u64) -> Self {
        Self {
            bound,
            list: Vec::new(),
        }
    }

    /// A drain begins.
    pub(super) fn push(&mut self, d: Drain) {
        self.list.push(d);
    }

    /// The drain time of the drains matching `which` so far (each at most the bound), ns.
    pub(super) fn drained(&self, which: impl Fn(&Drain) -> bool, now: u64) -> u64 {
        self.list
            .iter()
            .filter(|d| which(d))
            .map(|d| d.part(now, self.bound))
            .sum()
    }

    /// Ends the drains matching `which`: (allocation, drain time) of each, in the order they
    /// began, for the caller to charge.
    pub(super) fn settle(
        &mut self,
        which: impl Fn(&Drain) -> bool,
        now: u64,
    ) -> Vec<(AccountKey, u64)> {
        let (done, kept): (Vec<Drain>, Vec<Drain>) = self.list.drain(..).partition(|d| which(d));
        self.list = kept;
        done.into_iter()
            .map(|d| (d.key, d.part(now, self.bound)))
            .collect()
    }

    /// Drops the drains matching `which`, uncharged (their allocation is gone).
    pub(super) fn forget(&mut self, which: impl Fn(&Drain) -> bool) {
        self.list.retain(|d| !which(d));
    }
}

/// The scheduler's drains: begun when it ends a lease, charged as leases when they end.
impl GpuScheduler {
    /// Lease `l` was ended by the scheduler: it counts on while its holder drains.
    pub(super) fn start_drain(&mut self, l: Lease, now: u64) {
        self.settle_drains(|d| d.conn == l.conn, now);
        self.draining.push(Drain {
            conn: l.conn,
            key: l.key,
            lease_id: l.id,
            since: now,
        });
    }

    /// The drain time of the leases matching `which` so far (each at most the bound), ns.
    pub(super) fn drained(&self, which: impl Fn(&Drain) -> bool, now: u64) -> u64 {
        self.draining.drained(which, now)
    }

    /// Ends the drains matching `which`: each is charged, as a lease, its drain time.
    pub(super) fn settle_drains(&mut self, which: impl Fn(&Drain) -> bool, now: u64) {
        for (key, part) in self.draining.settle(which, now) {
            if part > 0
                && let Some(a) = self.charge(key, part, now)
            {
                a.leased_total_ns += part;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(conn: ConnId, key: AccountKey, lease_id: u64, since: u64) -> Drain {
        Drain {
            conn,
            key,
            lease_id,
            since,
        }
    }

    #[test]
    fn a_drain_counts_from_its_start_up_to_the_bound() {
        let d = drain(10, 1, 7, 100);
        assert_eq!(d.part(50, 30), 0, "not begun");
        assert_eq!(d.part(110, 30), 10);
        assert_eq!(d.part(130, 30), 30);
        assert_eq!(d.part(1_000, 30), 30, "bounded");
        assert_eq!(drain(10, 1, 7, u64::MAX - 5).part(u64::MAX, 30), 5);
    }

    #[test]
    fn drained_sums_the_matching_drains() {
        let mut ds = Drains::new(30);
        ds.push(drain(10, 1, 7, 100));
        ds.push(drain(20, 2, 8, 120));
        assert_eq!(ds.drained(|_| true, 130), 30 + 10);
        assert_eq!(ds.drained(|d| d.key == 2, 200), 30);
        assert_eq!(ds.drained(|d| d.conn == 30, 200), 0);
    }

    #[test]
    fn settle_ends_the_matching_drains_once_in_order() {
        let mut ds = Drains::new(30);
        ds.push(drain(10, 1, 7, 100));
        ds.push(drain(20, 2, 8, 120));
        ds.push(drain(30, 1, 9, 125));
        assert_eq!(ds.settle(|d| d.key == 1, 140), vec![(1, 30), (1, 15)]);
        assert!(ds.settle(|d| d.key == 1, 150).is_empty(), "settled once");
        assert_eq!(ds.drained(|_| true, 140), 20, "the other drains on");
        assert_eq!(ds.settle(|d| d.lease_id == 8, 500), vec![(2, 30)]);
        assert_eq!(ds.drained(|_| true, 500), 0);
    }

    #[test]
    fn forget_drops_without_charging() {
        let mut ds = Drains::new(30);
        ds.push(drain(10, 1, 7, 100));
        ds.push(drain(20, 2, 8, 100));
        ds.forget(|d| d.key == 1);
        assert_eq!(ds.drained(|_| true, 200), 30);
        assert_eq!(ds.settle(|_| true, 200), vec![(2, 30)]);
    }
}
