//! Usage: charging GPU time (virtual time, cap meter, history, totals), and the counters read
//! at scrape time.

use std::collections::VecDeque;

use crate::ledger::AccountKey;

use super::GpuScheduler;
use super::alloc::Alloc;

/// Counters of one allocation, read at scrape time ([`GpuScheduler::alloc_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct AllocStats {
    /// GPU time charged so far, ns, the running lease's elapsed part included.
    pub gpu_ns: u64,
    /// Time its processes waited for a lease, ns, the waits in progress included.
    pub throttled_ns: u64,
    /// Leases granted.
    pub leases: u64,
}

/// Drops the (time, ns) entries of `history` older than `window` at `now`.
pub(super) fn prune(history: &mut VecDeque<(u64, u64)>, now: u64, window: u64) {
    while history
        .front()
        .is_some_and(|(t, _)| now.saturating_sub(*t) > window)
    {
        history.pop_front();
    }
}

/// Charges and counters.
impl GpuScheduler {
    /// GPU time charged to `key` over the last window, ns.
    pub(crate) fn gpu_time(&mut self, key: AccountKey, now: u64) -> u64 {
        let window = self.params.window_ns;
        match self.allocs.get_mut(&key) {
            Some(a) => {
                prune(&mut a.history, now, window);
                a.history.iter().map(|(_, ns)| ns).sum()
            }
            None => 0,
        }
    }

    /// GPU time granted to `key` since it was added, ns: every lease charged so far plus the
    /// part of its current lease already elapsed. `None` for an unknown allocation.
    pub(crate) fn leased_total(&self, key: AccountKey, now: u64) -> Option<u64> {
        let a = self.allocs.get(&key)?;
        let running = self
            .current
            .filter(|l| l.key == key)
            .map_or(0, |l| now.saturating_sub(l.granted_at));
        Some(a.leased_total_ns + running + self.drained(|d| d.key == key, now))
    }

    /// The counters of `key` at `now` (`None`: unknown allocation). Each only grows: the running
    /// lease's elapsed part is at most what its end charges, a wait in progress at most what
    /// its end adds.
    pub(crate) fn alloc_stats(&self, key: AccountKey, now: u64) -> Option<AllocStats> {
        let a = self.allocs.get(&key)?;
        let running = self
            .current
            .filter(|l| l.key == key)
            .map_or(0, |l| now.saturating_sub(l.granted_at));
        let waiting: u64 = self
            .waiting
            .iter()
            .filter(|w| w.key == key)
            .map(|w| now.saturating_sub(w.since))
            .sum();
        let running = running + self.drained(|d| d.key == key, now);
        Some(AllocStats {
            gpu_ns: a.charged_total_ns.saturating_add(running),
            throttled_ns: a.waited_total_ns.saturating_add(waiting),
            leases: a.leases,
        })
    }

    /// GPU time charged on this GPU so far, ns, the running lease's elapsed part included.
    pub(crate) fn busy_total(&self, now: u64) -> u64 {
        let running = self.current.map_or(0, |l| now.saturating_sub(l.granted_at))
            + self.drained(|_| true, now);
        self.charged_total_ns.saturating_add(running)
    }

    /// Charges GPU time that `key`'s processes used outside any lease (seen by the backstop):
    /// its virtual time and cap bucket pay for it as for a lease, so the fair queue gives the
    /// others that time back.
    pub(crate) fn charge_unleased(&mut self, key: AccountKey, ns: u64, now: u64) {
        self.charge(key, ns, now);
    }

    /// Charges `ns` of GPU time to `key`: virtual time, cap bucket and the 10 s history.
    /// Returns the allocation for the caller's own bookkeeping (`None`: unknown).
    pub(super) fn charge(&mut self, key: AccountKey, ns: u64, now: u64) -> Option<&mut Alloc> {
        let p = self.params;
        let a = self.allocs.get_mut(&key)?;
        a.meter.note(&p, ns, now);
        self.charged_total_ns = self.charged_total_ns.saturating_add(ns);
        a.charged_total_ns = a.charged_total_ns.saturating_add(ns);
        a.vtime += ns as f64 / f64::from(a.share);
        a.history.push_back((now, ns));
        prune(&mut a.history, now, p.window_ns);
        Some(a)
    }
}
