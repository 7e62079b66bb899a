//! Leases: [`LeaseLength`] (adapted per allocation, a value type), and a lease's grant and end.

use crate::ledger::{AccountKey, ConnId};

use super::{GpuScheduler, Grant, SchedulerParams, Tier};

/// The lease outstanding on a GPU.
#[derive(Debug, Clone, Copy)]
pub(super) struct Lease {
    pub(super) id: u64,
    pub(super) conn: ConnId,
    pub(super) key: AccountKey,
    pub(super) granted_at: u64,
    pub(super) duration_ns: u64,
}

/// An allocation's next lease length: it starts at [`SchedulerParams::initial_lease_ns`], is
/// halved after an early hand-back (down to [`SchedulerParams::min_lease_ns`]) and grown by a
/// quarter after a lease used to its end (up to [`SchedulerParams::max_lease_ns`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LeaseLength(u64);

impl LeaseLength {
    /// The first lease's length.
    pub(super) fn new(p: &SchedulerParams) -> Self {
        Self(p.initial_lease_ns)
    }

    /// The length, ns.
    pub(super) fn ns(self) -> u64 {
        self.0
    }

    /// A lease of `duration` ended after `held`, handed back `early` or not.
    pub(super) fn adapt(&mut self, p: &SchedulerParams, early: bool, held: u64, duration: u64) {
        self.0 = if early {
            (self.0 / 2).max(p.min_lease_ns)
        } else if held >= duration {
            (self.0 + self.0 / 4).min(p.max_lease_ns)
        } else {
            self.0
        };
    }
}

/// Granting and ending leases.
impl GpuScheduler {
    /// Whether an allocation other than `key` wants the GPU: one waits, or had it moments ago
    /// (it asks again right after each release, so it is usually not waiting at this instant).
    pub(super) fn contended(&self, key: AccountKey, now: u64) -> bool {
        self.waiting.iter().any(|o| o.key != key)
            || self.allocs.iter().any(|(k, o)| {
                *k != key
                    && o.last_lease_end
                        .is_some_and(|t| now.saturating_sub(t) <= self.params.idle_after_ns)
            })
    }

    /// Ends lease `l` at `now`: charged `max(busy_ns, time held)`, its allocation's next lease
    /// length adapted.
    pub(super) fn end_lease(&mut self, l: Lease, busy_ns: u64, early: bool, now: u64) {
        self.current = None;
        let held = now.saturating_sub(l.granted_at);
        let charged = busy_ns.max(held);
        let p = self.params;
        let Some(a) = self.charge(l.key, charged, now) else {
            return;
        };
        a.meter.end_lease();
        let over = charged.saturating_sub(l.duration_ns);
        if over > 0 {
            a.meter.note_overrun(&p, over, now);
        }
        a.lease_len.adapt(&p, early, held, l.duration_ns);
        a.last_lease_end = Some(now);
        a.leased_total_ns += charged;
    }

    /// Grants the GPU, when free, to the waiter to serve (see `best_waiter`), after revoking
    /// a best-effort lease for an eligible latency request.
    pub(super) fn dispatch(&mut self, now: u64) -> Vec<Grant> {
        self.revoke_for_latency(now);
        if self.current.is_some() {
            return Vec::new();
        }
        if self.held_for.is_some_and(|(_, until)| now >= until) {
            self.end_hold(now);
        }
        let Some(i) = self.best_waiter(now) else {
            return Vec::new();
        };
        self.end_hold(now);
        let w = self.waiting.remove(i).expect("index from the scan");
        let a = self.allocs.get_mut(&w.key).expect("checked in the scan");
        a.waited_total_ns = a
            .waited_total_ns
            .saturating_add(now.saturating_sub(w.since));
        a.leases += 1;
        let a = &self.allocs[&w.key];
        let room = self.room(a, now);
        let mut duration = a.lease_len.ns();
        let contended = self.contended(w.key, now);
        // Capped or not (a capped one at most twice the others'): sized by its room alone, a
        // capped tenant's turns took from the others beyond their shares (a share-11 tenant
        // capped at 33 beside a cap of 79 had 56-85 ms turns and 22-24%, against 19.25, in
        // the pure model); cut to the others' length, it lost the odd part of a turn its cap
        // window had room for at every second (29.2% of the busy time at 30/70 with 1 ms of
        // hand-over per lease).
        if contended {
            let most = if a.meter.cap.is_some() { 2 } else { 1 };
            duration = duration.min(most * self.params.contended_lease_ns);
        }
        if a.meter.cap.is_some() {
            duration = duration
                .min(room as u64)
                .max(self.params.min_lease_ns.min(duration));
            // Settle the bucket at the grant: from here it fills and drains together.
            let p = self.params;
            let a = self.allocs.get_mut(&w.key).expect("checked in the scan");
            a.meter.start_lease(&p, now);
        }
        self.sync_backlog(now);
        let latency = self.allocs[&w.key].tier == Tier::Latency;
        let max_inflight_ns =
            (!latency && self.latency_in_use()).then_some(self.params.best_effort_inflight_ns);
        let id = self.next_lease;
        self.next_lease += 1;
        self.current = Some(Lease {
            id,
            conn: w.conn,
            key: w.key,
            granted_at: now,
            duration_ns: duration,
        });
        vec![Grant {
            conn: w.conn,
            lease_id: id,
            duration_ns: duration,
            max_inflight_ns,
            latency,
        }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn starts_at_the_initial_length() {
        let p = SchedulerParams::default();
        assert_eq!(LeaseLength::new(&p).ns(), p.initial_lease_ns);
    }

    #[test]
    fn halves_after_an_early_hand_back_down_to_the_minimum() {
        let p = SchedulerParams::default();
        let mut l = LeaseLength::new(&p);
        // Early wins over "used to its end".
        l.adapt(&p, true, 20 * MS, 20 * MS);
        assert_eq!(l.ns(), 10 * MS);
        l.adapt(&p, true, MS, 10 * MS);
        assert_eq!(l.ns(), p.min_lease_ns, "never below the minimum");
    }

    #[test]
    fn grows_by_a_quarter_when_used_to_its_end_up_to_the_maximum() {
        let p = SchedulerParams::default();
        let mut l = LeaseLength::new(&p);
        l.adapt(&p, false, 20 * MS, 20 * MS);
        assert_eq!(l.ns(), 25 * MS);
        // Held past its length (a late release) counts as used to its end.
        l.adapt(&p, false, 40 * MS, 25 * MS);
        assert_eq!(l.ns(), 31_250_000);
        for _ in 0..20 {
            let d = l.ns();
            l.adapt(&p, false, d, d);
        }
        assert_eq!(l.ns(), p.max_lease_ns, "never above the maximum");
    }

    #[test]
    fn stays_when_released_before_its_end_but_not_early() {
        // A lease ended short by the scheduler (a connection closed, a revocation) is neither.
        let p = SchedulerParams::default();
        let mut l = LeaseLength::new(&p);
        l.adapt(&p, false, 5 * MS, 20 * MS);
        assert_eq!(l.ns(), p.initial_lease_ns);
    }
}
