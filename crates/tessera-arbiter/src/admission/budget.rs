//! Budgets per group: a token bucket per pod for the closes of its failed and evicted
//! handshakes, so that a pod flooding the tenant socket pays for its flood and its neighbours
//! do not.
//!
//! Why closes: the pending caps bound how many handshakes wait at once, but a flood's
//! connections that are evicted, or that fail (garbage, oversized frames), are closed, and a
//! flooder reconnects at once: every cycle costs the arbiter an accept, a read of the peer's
//! cgroup, a task and a close, and waits in the kernel's listen queue, one FIFO for all pods,
//! ahead of a neighbour's `connect` ([`super::park`] has the measurements). Within its budget a
//! pod's failed or evicted connection is closed at once (a client with a bug gets its answer
//! promptly); past it the connection is held until the handshake deadline, so the flooder's
//! slot is busy for a second instead of cycling. New connections are never refused by the
//! budget: a newcomer in a flooding pod still takes the place of the pod's oldest pending
//! connection, as before.
//!
//! The decision is pure: the caller passes the time ([`Budgets::take`]), so the tests run on a
//! fake clock. Memory is bounded: at most [`BudgetParams::max_buckets`] buckets; a full bucket
//! is forgotten when room is needed (a new bucket starts full, so nothing is lost), and a
//! group arriving while every bucket is in use draws from one shared overflow bucket: it can
//! only slow the groups that overflowed with it, never one that has its own bucket.

use std::collections::HashMap;
use std::time::Instant;

use super::group::Group;

/// The budget of every group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BudgetParams {
    /// Failed or evicted handshakes a group may have closed at once (a full bucket).
    pub burst: u32,
    /// Closes a group's bucket gains per second.
    pub per_sec: u32,
    /// Groups with a bucket of their own at most.
    pub max_buckets: usize,
}

impl Default for BudgetParams {
    /// An honest pod fails a handshake only by mistake (a wrong token, a stale ticket) and
    /// has one evicted only under its own flood: 128 at once and 64 a second after that leave
    /// it every answer at once. A flood's closes are cut to 64 a second per pod. 1,024 buckets
    /// (about 100 bytes each) are ten times the pods a node runs.
    fn default() -> Self {
        Self {
            burst: 128,
            per_sec: 64,
            max_buckets: 1024,
        }
    }
}

/// One handshake in a bucket's units: integers, so a refill is exact (a float bucket could be a
/// rounding short of its token).
const UNIT: u64 = 1_000_000_000;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Handshakes left at `at`, in [`UNIT`]s.
    credit: u64,
    at: Instant,
}

impl Bucket {
    fn cap(p: &BudgetParams) -> u64 {
        u64::from(p.burst) * UNIT
    }

    fn full(p: &BudgetParams, now: Instant) -> Self {
        Self {
            credit: Self::cap(p),
            at: now,
        }
    }

    /// Refills up to `now`: `per_sec` handshakes a second, one [`UNIT`] each, so a
    /// nanosecond adds `per_sec` units. A clock that went back refills nothing.
    fn refill(&mut self, p: &BudgetParams, now: Instant) {
        let ns =
            u64::try_from(now.saturating_duration_since(self.at).as_nanos()).unwrap_or(u64::MAX);
        self.credit = self
            .credit
            .saturating_add(ns.saturating_mul(u64::from(p.per_sec)))
            .min(Self::cap(p));
        self.at = self.at.max(now);
    }

    fn is_full(&self, p: &BudgetParams, now: Instant) -> bool {
        let mut b = *self;
        b.refill(p, now);
        b.credit >= Self::cap(p)
    }

    fn take(&mut self, p: &BudgetParams, now: Instant) -> bool {
        self.refill(p, now);
        if self.credit >= UNIT {
            self.credit -= UNIT;
            true
        } else {
            false
        }
    }
}

/// Every group's bucket (see the module docs).
#[derive(Debug)]
pub(crate) struct Budgets {
    params: BudgetParams,
    buckets: HashMap<Group, Bucket>,
    overflow: Option<Bucket>,
}

impl Budgets {
    pub(crate) fn new(params: BudgetParams) -> Self {
        Self {
            params,
            buckets: HashMap::new(),
            overflow: None,
        }
    }

    /// Takes one handshake from `group`'s bucket at time `now`; false when it has none left
    /// (the connection is then refused).
    pub(crate) fn take(&mut self, group: &Group, now: Instant) -> bool {
        let p = self.params;
        if let Some(b) = self.buckets.get_mut(group) {
            return b.take(&p, now);
        }
        if self.buckets.len() >= p.max_buckets {
            // Full buckets carry nothing a fresh one would not.
            self.buckets.retain(|_, b| !b.is_full(&p, now));
        }
        if self.buckets.len() >= p.max_buckets {
            return self
                .overflow
                .get_or_insert_with(|| Bucket::full(&p, now))
                .take(&p, now);
        }
        let mut b = Bucket::full(&p, now);
        let ok = b.take(&p, now);
        self.buckets.insert(group.clone(), b);
        ok
    }

    /// Groups with a bucket of their own now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.buckets.len()
    }

    /// How long a drained bucket takes to refill completely (tests).
    #[cfg(test)]
    pub(crate) fn refill_time(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(
            f64::from(self.params.burst) / f64::from(self.params.per_sec),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn p() -> BudgetParams {
        BudgetParams {
            burst: 4,
            per_sec: 2,
            max_buckets: 3,
        }
    }

    fn g(n: u32) -> Group {
        Group::Cgroup(format!("/kubepods/pod{n}"))
    }

    fn drain(b: &mut Budgets, group: &Group, now: Instant) -> usize {
        (0..100).take_while(|_| b.take(group, now)).count()
    }

    #[test]
    fn a_flooding_group_drains_its_own_bucket_and_nobody_elses() {
        let t0 = Instant::now();
        let mut b = Budgets::new(p());
        assert_eq!(drain(&mut b, &g(1), t0), 4);
        assert!(!b.take(&g(1), t0));
        // Its neighbour and the unknown peers have their whole burst.
        assert_eq!(drain(&mut b, &g(2), t0), 4);
        assert_eq!(drain(&mut b, &Group::Unknown, t0), 4);
        // The rate: 2 a second, refilled from the last take.
        assert!(!b.take(&g(1), t0 + Duration::from_millis(400)));
        assert!(b.take(&g(1), t0 + Duration::from_millis(500)));
        assert!(!b.take(&g(1), t0 + Duration::from_millis(900)));
        assert!(b.take(&g(1), t0 + Duration::from_millis(1000)));
        // Never more than the burst, however long it waited.
        assert_eq!(drain(&mut b, &g(1), t0 + Duration::from_secs(3600)), 4);
        // A clock that goes back refills nothing and breaks nothing.
        assert!(!b.take(&g(1), t0));
    }

    #[test]
    fn buckets_are_capped_and_an_overflowing_group_never_lands_on_a_neighbour() {
        let t0 = Instant::now();
        let mut b = Budgets::new(p());
        for n in 1..=3 {
            assert_eq!(drain(&mut b, &g(n), t0), 4);
        }
        assert_eq!(b.len(), 3);
        // Every bucket in use: group 4 and 5 share the overflow bucket, 1-3 keep theirs.
        assert_eq!(drain(&mut b, &g(4), t0), 4);
        assert!(!b.take(&g(5), t0));
        assert_eq!(b.len(), 3);
        assert!(!b.take(&g(1), t0));
        // Once refilled, the old buckets are forgotten to make room: a new group gets its own.
        let later = t0 + b.refill_time();
        assert_eq!(drain(&mut b, &g(6), later), 4);
        assert_eq!(b.len(), 1);
        assert_eq!(drain(&mut b, &g(1), later), 4);
    }
}
