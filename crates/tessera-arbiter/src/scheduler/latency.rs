//! The latency tier ([`Tier`], set by the operator): a latency allocation's share is its
//! guarantee and its ceiling; its eligible requests go first and revoke a best-effort lease at
//! once ([`Revocation`]); it may linger on the GPU after an early hand-back.

use crate::ledger::{AccountKey, ConnId};

use super::{GpuScheduler, SchedulerError, Tier};

/// A lease taken back before its end (a latency request became eligible): the holder must
/// stop launching at once; its lease is already over in the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Revocation {
    /// The holder.
    pub conn: ConnId,
    /// The lease revoked.
    pub lease_id: u64,
}

/// Tiers, revocations and the linger.
impl GpuScheduler {
    /// Sets `key`'s tier (before its first request; the operator's choice, stored with the
    /// allocation). A latency allocation's share becomes its ceiling too: its cap is its share
    /// (or its own cap, if lower) over the cap window.
    pub(crate) fn set_tier(&mut self, key: AccountKey, tier: Tier) -> Result<(), SchedulerError> {
        let a = self
            .allocs
            .get_mut(&key)
            .ok_or(SchedulerError::UnknownAllocation(key))?;
        a.tier = tier;
        if tier == Tier::Latency {
            a.meter.cap = Some(
                a.meter
                    .cap
                    .map_or(a.share, |c| c.min(a.share))
                    .clamp(1, 100),
            );
        }
        Ok(())
    }

    /// Whether a latency allocation on this GPU is in use: one of its connections has asked
    /// for a lease and is still open (best-effort grants are then bounded in flight). An
    /// allocation that no process of it uses bounds nobody: the bound cost best-effort work
    /// 1-1.6 points of GPU time with 1-10 ms kernels (docs/benchmarks.md), for a service
    /// that was not there. Its first request then meets the best-effort lease in progress
    /// unbounded; the lease is revoked at that request, and every later grant is bounded.
    pub(crate) fn latency_in_use(&self) -> bool {
        self.allocs
            .values()
            .any(|a| a.tier == Tier::Latency && !a.asked.is_empty())
    }

    /// The leases revoked since the last call, for their holders to be told.
    pub(crate) fn take_revocations(&mut self) -> Vec<Revocation> {
        std::mem::take(&mut self.revoked)
    }

    /// The eligible latency waiter to serve first (least virtual time), if any: one whose
    /// window still has room for a minimal lease.
    pub(super) fn latency_waiter(&self, now: u64) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (i, w) in self.waiting.iter().enumerate() {
            let Some(a) = self.allocs.get(&w.key) else {
                continue;
            };
            if a.tier != Tier::Latency || self.room(a, now) < self.need(w.key, a, now) as f64 {
                continue;
            }
            if best.is_none_or(|(_, v)| a.vtime < v) {
                best = Some((i, a.vtime));
            }
        }
        best.map(|(i, _)| i)
    }

    /// A best-effort lease gives way at once to an eligible latency request: it is ended here
    /// (charged as held) and its holder told to stop launching.
    pub(super) fn revoke_for_latency(&mut self, now: u64) {
        if let Some(l) = self.current
            && self
                .allocs
                .get(&l.key)
                .is_some_and(|a| a.tier != Tier::Latency)
            && self.latency_waiter(now).is_some()
        {
            self.end_lease(l, 0, false, now);
            self.start_drain(l, now);
            self.revoked.push(Revocation {
                conn: l.conn,
                lease_id: l.id,
            });
        }
    }

    /// After `key`'s early hand-back: a latency allocation keeps the GPU for
    /// [`SchedulerParams::latency_linger_ns`](super::SchedulerParams::latency_linger_ns), if
    /// its cap window has room for the linger beside a minimal lease (the linger is charged as
    /// GPU time: see [`Self::end_hold`]).
    pub(super) fn linger(&mut self, key: AccountKey, now: u64) {
        let linger = self.params.latency_linger_ns;
        let Some(a) = self.allocs.get(&key) else {
            return;
        };
        if linger == 0 || a.tier != Tier::Latency {
            return;
        }
        if self.room(a, now) < (self.need(key, a, now) + linger) as f64 {
            return;
        }
        self.held_for = Some((key, now + linger));
        self.linger_since = Some(now);
    }

    /// Ends the GPU's hold at `now` (its time, or a grant): a latency linger is charged to its
    /// allocation for the time it held the GPU (at most its length), so the share stays the
    /// ceiling whatever it lingers.
    pub(super) fn end_hold(&mut self, now: u64) {
        let Some((key, until)) = self.held_for.take() else {
            return;
        };
        if let Some(since) = self.linger_since.take() {
            let held = now.min(until).saturating_sub(since);
            if held > 0 {
                let end = since + held;
                if let Some(a) = self.charge(key, held, end) {
                    a.leased_total_ns += held;
                }
            }
        }
    }
}
