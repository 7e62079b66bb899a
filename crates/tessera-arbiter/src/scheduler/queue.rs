//! Weighted fair queueing on virtual time (`vtime += charged_ns / share`, charged in `usage`):
//! the waiting requests, who is eligible, who is served next, and the hold for a holder's
//! re-request.

use crate::ledger::{AccountKey, ConnId};

use super::GpuScheduler;
use super::Tier;
use super::alloc::Alloc;

/// A request waiting for a lease.
#[derive(Debug, Clone, Copy)]
pub(super) struct Waiter {
    pub(super) conn: ConnId,
    pub(super) key: AccountKey,
    /// When it asked.
    pub(super) since: u64,
}

/// The fair queue.
impl GpuScheduler {
    /// Whether `key` holds the GPU or has a request waiting.
    pub(super) fn is_active(&self, key: AccountKey) -> bool {
        self.current.is_some_and(|l| l.key == key) || self.waiting.iter().any(|w| w.key == key)
    }

    /// `key` is about to ask: after a pause (neither active nor just out of a lease) it starts
    /// at the least virtual time of the active allocations if it was behind, so it banks no
    /// credit while idle.
    pub(super) fn rejoin(&mut self, key: AccountKey, now: u64) {
        let recent = self.allocs[&key]
            .last_lease_end
            .is_some_and(|t| now.saturating_sub(t) <= self.params.idle_after_ns);
        if !self.is_active(key) && !recent {
            // Becoming active after a pause: no credit banked while idle.
            let floor = self
                .allocs
                .iter()
                .filter(|(k, _)| self.is_active(**k))
                .map(|(_, a)| a.vtime)
                .fold(f64::INFINITY, f64::min);
            let a = self.allocs.get_mut(&key).expect("checked above");
            if floor.is_finite() && floor > a.vtime {
                a.vtime = floor;
            }
        }
    }

    /// Drops the waiting requests matching `drop`, adding the time each waited to its
    /// allocation.
    pub(super) fn stop_waiting(&mut self, drop: impl Fn(&Waiter) -> bool, now: u64) {
        let allocs = &mut self.allocs;
        self.waiting.retain(|w| {
            if !drop(w) {
                return true;
            }
            if let Some(a) = allocs.get_mut(&w.key) {
                a.waited_total_ns = a
                    .waited_total_ns
                    .saturating_add(now.saturating_sub(w.since));
            }
            false
        });
        self.sync_backlog(now);
    }

    /// Tells each capped allocation's meter whether it has a request waiting (its bucket
    /// fills unclipped meanwhile: see `CapMeter::set_backlogged`).
    pub(super) fn sync_backlog(&mut self, now: u64) {
        let p = self.params;
        for (k, a) in &mut self.allocs {
            let waits = self.waiting.iter().any(|w| w.key == *k);
            a.meter.set_backlogged(&p, waits, now);
        }
    }

    /// Keeps the GPU briefly for `key` when it is still backlogged (its lease ran to the end)
    /// and would be served before every waiter.
    pub(super) fn hold_for_rerequest(&mut self, key: AccountKey, now: u64) {
        let Some(a) = self.allocs.get(&key) else {
            return;
        };
        if self.room(a, now) < self.need(key, a, now) as f64
            || self.waiting.iter().any(|w| w.key == key)
        {
            return;
        }
        if self.latency_waiter(now).is_some() {
            return;
        }
        // A latency holder asking again is served first anyway: granting best-effort in
        // between would only be revoked at once.
        if a.tier == Tier::Latency {
            self.held_for = Some((key, now + self.params.rerequest_window_ns));
            return;
        }
        // Held too when no waiter could take a whole lease: the holder is the one that can.
        let best_waiter = self
            .waiting
            .iter()
            .filter_map(|w| Some((w.key, self.allocs.get(&w.key)?)))
            .filter(|(k, o)| self.room(o, now) >= self.need(*k, o, now) as f64)
            .map(|(_, o)| o.vtime)
            .fold(f64::INFINITY, f64::min);
        if !self.waiting.is_empty() && a.vtime < best_waiter {
            self.held_for = Some((key, now + self.params.rerequest_window_ns));
        }
    }

    /// Whether an allocation other than `key` could take a whole lease now: one waiting with
    /// the room it needs, or the one the GPU is held for.
    pub(super) fn others_ready(&self, key: AccountKey, now: u64) -> bool {
        self.held_for.is_some_and(|(k, _)| k != key)
            || self.waiting.iter().any(|w| {
                w.key != key
                    && self
                        .allocs
                        .get(&w.key)
                        .is_some_and(|o| self.room(o, now) >= self.need(w.key, o, now) as f64)
            })
    }

    /// Whether `key` (allocation `a`) may be granted now: it has the room it needs, or, when
    /// others wait but none could take a whole lease, room for a minimal one (better than an
    /// idle GPU: two capped tenants whose caps add up to the whole GPU both wait otherwise).
    pub(super) fn eligible(&self, key: AccountKey, a: &Alloc, now: u64) -> bool {
        let room = self.room(a, now);
        room >= self.need(key, a, now) as f64
            || (room >= self.threshold() as f64
                && self.waiting.iter().any(|w| w.key != key)
                && !self.others_ready(key, now))
    }

    /// The waiter to serve: an eligible latency one first (by virtual time among them), else
    /// by virtual time among the eligible ones (the GPU held for a re-request serves only its
    /// allocation, unless a latency request is eligible).
    pub(super) fn best_waiter(&self, now: u64) -> Option<usize> {
        if let Some(i) = self.latency_waiter(now) {
            return Some(i);
        }
        let mut best: Option<(usize, f64)> = None;
        for (i, w) in self.waiting.iter().enumerate() {
            if self.held_for.is_some_and(|(k, _)| k != w.key) {
                continue;
            }
            let Some(a) = self.allocs.get(&w.key) else {
                continue;
            };
            if !self.eligible(w.key, a, now) {
                continue;
            }
            if best.is_none_or(|(_, v)| a.vtime < v) {
                best = Some((i, a.vtime));
            }
        }
        best.map(|(i, _)| i)
    }
}
