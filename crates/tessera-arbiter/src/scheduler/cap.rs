//! Caps: a capped allocation's [`CapMeter`] (token bucket and cap window, a value type), and
//! the room an allocation needs to be granted a lease.

use std::collections::VecDeque;

use crate::ledger::AccountKey;

use super::alloc::Alloc;
use super::usage::prune;
use super::{GpuScheduler, SchedulerParams, Tier};

/// What a cap lets an allocation use: a token bucket filled at `cap`% of wall time (depth
/// [`SchedulerParams::bucket_depth_ns`]) and a cap window (its GPU time over the last
/// [`SchedulerParams::cap_window_ns`], plus its largest recent overrun, within `cap`% of the
/// window plus [`SchedulerParams::cap_window_slack_ns`]). Uncapped, every answer is "no limit"
/// and noting time is a no-op. Pure: time is a parameter.
#[derive(Debug)]
pub(super) struct CapMeter {
    /// The cap, percent (`None`: uncapped).
    pub(super) cap: Option<u32>,
    /// Token bucket in ns of GPU time (capped allocations only); may go negative on overrun.
    bucket_ns: f64,
    bucket_at: u64,
    /// When its running lease was granted (the bucket was settled then): while it holds the
    /// GPU the bucket fills and drains at once, so the fill is not clipped at the depth (those
    /// tokens would otherwise be lost at every lease).
    leasing: Option<u64>,
    /// It has a request waiting for the GPU: the bucket keeps filling unclipped too. The
    /// depth is there so that an idle tenant banks nothing; a waiting one is not idle, and
    /// clipped while it waited through another tenant's lease a high cap lost its fill (a
    /// cap of 79 beside a share-11 tenant got 74.6% in the pure model). The cap window
    /// still bounds every second.
    backlogged: bool,
    /// Capped allocations only: (time, ns) of its charges and of the GPU time the backstop
    /// forgave it outside leases, over the last cap window (the cap bounds GPU time, forgiven
    /// or not).
    seen: VecDeque<(u64, u64)>,
    /// Capped allocations only: (time, ns) of GPU time it was charged beyond the lease it was
    /// granted (a late release, kernels overrunning the deadline) or that the backstop
    /// reported after the fact, over the last cap window. The largest is kept free in its cap
    /// window at every grant: a lease is checked against the window when granted, so what it
    /// runs past its length would otherwise land on top of a full window.
    overruns: VecDeque<(u64, u64)>,
}

impl CapMeter {
    /// A meter with a full bucket at `now`.
    pub(super) fn new(cap: Option<u32>, params: &SchedulerParams, now: u64) -> Self {
        Self {
            cap,
            bucket_ns: params.bucket_depth_ns as f64,
            bucket_at: now,
            leasing: None,
            backlogged: false,
            seen: VecDeque::new(),
            overruns: VecDeque::new(),
        }
    }

    /// Counts `ns` used up to `now` against the bucket and the cap window (no-op when
    /// uncapped).
    pub(super) fn note(&mut self, p: &SchedulerParams, ns: u64, now: u64) {
        if self.cap.is_none() {
            return;
        }
        let b = self.tokens_before_use(p, now);
        self.bucket_ns = b - ns as f64;
        self.bucket_at = now;
        self.seen.push_back((now, ns));
        prune(&mut self.seen, now, p.cap_window_ns);
    }

    /// Returns `ns` of lease time it held without using it (the card's measure) to the bucket
    /// and the cap window: the cap bounds GPU time used, and a tenant whose own
    /// synchronisation idles the GPU inside its leases would otherwise get less than its cap
    /// (24.7% at a cap of 30 alone, `speed --rows cap`). The window gives it back from its
    /// newest charges first: the idle was measured over the last poll (250 ms), in the
    /// leases charged last or the one running. Taken from the oldest instead, the refund
    /// went with charges about to leave the window anyway, and a tenant whose turns the
    /// window sets (three 100 ms leases a second at a cap of 30) gained nothing from it.
    /// No-op when uncapped.
    pub(super) fn refund(&mut self, p: &SchedulerParams, ns: u64, now: u64) {
        if self.cap.is_none() {
            return;
        }
        // A refund never fills the bucket beyond its depth (a tenant always waiting and idle
        // in its leases would otherwise bank refunds without end). The depth is compared with
        // what the bucket holds net of the running lease: its tokens before that lease's use
        // are over the depth for most of a lease, and compared with them every refund that
        // came during a lease was lost.
        let net = self.bucket(p, now);
        let add = (ns as f64).min((p.bucket_depth_ns as f64 - net).max(0.0));
        self.bucket_ns = self.tokens_before_use(p, now) + add;
        self.bucket_at = now;
        prune(&mut self.seen, now, p.cap_window_ns);
        let mut left = ns;
        for (_, charged) in self.seen.iter_mut().rev() {
            let back = left.min(*charged);
            *charged -= back;
            left -= back;
            if left == 0 {
                break;
            }
        }
    }

    /// Notes `ns` used beyond what was granted (see [`Self::margin`]; no-op when uncapped).
    pub(super) fn note_overrun(&mut self, p: &SchedulerParams, ns: u64, now: u64) {
        if self.cap.is_none() {
            return;
        }
        self.overruns.push_back((now, ns));
        prune(&mut self.overruns, now, p.cap_window_ns);
    }

    /// A lease is granted at `now`: the bucket is settled, and from here it fills and drains
    /// together until [`Self::end_lease`].
    pub(super) fn start_lease(&mut self, p: &SchedulerParams, now: u64) {
        let tokens = self.bucket(p, now);
        self.bucket_ns = tokens;
        self.bucket_at = now;
        self.leasing = Some(now);
    }

    /// Whether it has a request waiting from `now` on: the bucket is settled at the change.
    pub(super) fn set_backlogged(&mut self, p: &SchedulerParams, backlogged: bool, now: u64) {
        if self.cap.is_none() || self.backlogged == backlogged {
            return;
        }
        let tokens = self.tokens_before_use(p, now);
        self.bucket_ns = tokens;
        self.bucket_at = now;
        self.backlogged = backlogged;
    }

    /// The lease ended (after its charge was noted).
    pub(super) fn end_lease(&mut self) {
        self.leasing = None;
    }

    /// What the cap window keeps free at a grant: the largest of the recent overruns.
    pub(super) fn margin(&self, p: &SchedulerParams, now: u64) -> u64 {
        let from = now.saturating_sub(p.cap_window_ns);
        self.overruns
            .iter()
            .filter(|(t, _)| *t > from)
            .map(|(_, ns)| *ns)
            .max()
            .unwrap_or(0)
    }

    /// Tokens in the bucket at `now` (infinite when uncapped); during a lease, net of the time
    /// the lease has used so far.
    pub(super) fn bucket(&self, p: &SchedulerParams, now: u64) -> f64 {
        let running = self.leasing.map_or(0.0, |t| now.saturating_sub(t) as f64);
        self.tokens_before_use(p, now) - running
    }

    /// Tokens at `now` before what is about to be charged is taken out: filled at `cap`% of
    /// wall time since `bucket_at`, up to the depth, except while it held the GPU (it drained
    /// the bucket faster than it filled, so nothing overflowed) or waited for it.
    pub(super) fn tokens_before_use(&self, p: &SchedulerParams, now: u64) -> f64 {
        match self.cap {
            None => f64::INFINITY,
            Some(cap) => {
                let filled = (now.saturating_sub(self.bucket_at)) as f64 * f64::from(cap) / 100.0;
                if self.leasing.is_some() || self.backlogged {
                    self.bucket_ns + filled
                } else {
                    (self.bucket_ns + filled).min(p.bucket_depth_ns as f64)
                }
            }
        }
    }

    /// GPU time that may still be granted at `now`: what the bucket holds and what the cap
    /// leaves of the cap window ending now (infinite when uncapped). A lease granted within
    /// both keeps every window of that length within the cap: a window ending during the lease
    /// holds at most what the one ending at the grant held, plus the lease. For a latency
    /// allocation (`latency`) the window alone.
    pub(super) fn room(&self, p: &SchedulerParams, latency: bool, now: u64) -> f64 {
        let Some(cap) = self.cap else {
            return f64::INFINITY;
        };
        let left = match self.leasing {
            // During its own lease (not charged yet): what is left beside the time held.
            Some(t) => {
                let used = self.window_used(p, now) + self.margin(p, now);
                Self::limit(p, cap) as f64 - used as f64 - now.saturating_sub(t) as f64
            }
            None => self.window_room(p, cap, now),
        };
        // A latency allocation's budget is the window alone: a request is a burst, and a
        // bucket a few leases deep would make the second of two close requests wait.
        if latency {
            return left;
        }
        Self::bucket_affords(cap, self.bucket(p, now)).min(left)
    }

    /// The longest lease from `now` that keeps every cap window within the limit (beside the
    /// margin): the window ending at the lease's end holds the lease and what was charged
    /// since that window began. (Each window ending earlier holds no more, as the lease grows
    /// by what older charges lose.) Counting the whole last window beside the lease, as
    /// before, made the window `cap_window_ns` plus the lease long: a 30% cap alone with
    /// 57 ms turns got 27.9% in the pure model. Negative when even the window ending now is
    /// over.
    fn window_room(&self, p: &SchedulerParams, cap: u32, now: u64) -> f64 {
        let limit = Self::limit(p, cap);
        let margin = self.margin(p, now);
        let fits = |l: u64| self.window_used(p, now + l) + margin + l <= limit;
        if !fits(0) {
            return limit as f64 - (self.window_used(p, now) + margin) as f64;
        }
        // `fits` holds up to some length and not beyond (the window ending at the lease's
        // end gains the lease's time and loses at most as much of the older charges).
        let (mut lo, mut hi) = (0, limit + 1);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) { lo = mid } else { hi = mid }
        }
        lo as f64
    }

    /// The longest lease a full bucket pays for (infinite when uncapped).
    pub(super) fn full_bucket_affords(&self, p: &SchedulerParams) -> f64 {
        self.cap.map_or(f64::INFINITY, |cap| {
            Self::bucket_affords(cap, p.bucket_depth_ns as f64)
        })
    }

    /// The longest lease a bucket holding `tokens` pays for: the bucket fills at `cap`% while
    /// the lease runs (unclipped, see [`Self::start_lease`]), so a lease of `L` takes only
    /// `L x (1 - cap)` out of it. Sized by the tokens alone, a capped tenant's turns were
    /// shorter than its fill allowed, and beside a tenant with a small share (whose leases it
    /// waited through) a cap of 79 got 70.9% in the pure model (`props`); alone, a 30% cap
    /// had a lease (and a hand-over) every 66 ms instead of every 190.
    fn bucket_affords(cap: u32, tokens: f64) -> f64 {
        if cap >= 100 {
            return f64::INFINITY;
        }
        tokens / (1.0 - f64::from(cap) / 100.0)
    }

    /// What a cap allows in one cap window: `cap`% of it plus the window's allowance.
    pub(super) fn limit(p: &SchedulerParams, cap: u32) -> u64 {
        (p.cap_window_ns as f64 * f64::from(cap) / 100.0) as u64 + p.cap_window_slack_ns
    }

    /// The GPU time (charges and forgiven time) that falls in the cap window ending at `now`;
    /// `ns` noted at `t` covers `[t - ns, t]` (a lease is charged when it ends).
    pub(super) fn window_used(&self, p: &SchedulerParams, now: u64) -> u64 {
        let from = now.saturating_sub(p.cap_window_ns);
        self.seen
            .iter()
            .rev()
            .take_while(|(t, _)| *t > from)
            .map(|&(t, ns)| ns.min(t - from))
            .sum()
    }

    /// When a lease of `need` can be granted within the cap window beside the margin (`now`
    /// if it can already; see [`Self::window_room`]): the window ending at the lease's end
    /// must have room for it.
    pub(super) fn window_frees(&self, p: &SchedulerParams, need: u64, now: u64) -> u64 {
        self.window_frees_at_end(p, need, now)
            .saturating_sub(need)
            .max(now)
    }

    /// When enough of the charges have left the cap window for `need` to fit beside the
    /// margin in the window ending then (`now` if they already have). Charges are taken as
    /// back to back, oldest first, as leases are; a later tick re-checks anyway.
    fn window_frees_at_end(&self, p: &SchedulerParams, need: u64, now: u64) -> u64 {
        let Some(cap) = self.cap else {
            return now;
        };
        let w = p.cap_window_ns;
        let limit = Self::limit(p, cap);
        let used = self.window_used(p, now) + self.margin(p, now);
        let Some(mut excess) = (used + need).checked_sub(limit).filter(|e| *e > 0) else {
            return now;
        };
        let from = now.saturating_sub(w);
        for &(t, ns) in self.seen.iter().filter(|(t, _)| *t > from) {
            let start = t.saturating_sub(ns).max(from);
            let part = t - start;
            if excess <= part {
                return start + excess + w;
            }
            excess -= part;
        }
        now + w
    }

    /// When there is room for `need` again (`None`: uncapped): a latency allocation's window
    /// has freed it, a best-effort one's bucket has refilled and its window freed it.
    pub(super) fn ready_at(
        &self,
        p: &SchedulerParams,
        latency: bool,
        need: u64,
        now: u64,
    ) -> Option<u64> {
        let cap = self.cap?;
        if latency {
            return Some(self.window_frees(p, need, now));
        }
        // The tokens a lease of `need` takes out of the bucket (see `bucket_affords`).
        let have = self.bucket(p, now);
        let missing = need as f64 * (1.0 - f64::from(cap.min(100)) / 100.0) - have;
        let refilled = if missing <= 0.0 {
            now
        } else {
            now + (missing * 100.0 / f64::from(cap)).ceil() as u64
        };
        Some(refilled.max(self.window_frees(p, need, now)))
    }
}

/// The cap rules as the scheduler applies them to an allocation.
impl GpuScheduler {
    /// Counts `ns` of GPU time against `key`'s cap (bucket and cap window) only: for time the
    /// backstop saw its processes use outside leases and forgave from the GPU's slack (not
    /// charged to its share, but a cap is a ceiling on GPU time). No-op when uncapped.
    pub(crate) fn count_for_cap(&mut self, key: AccountKey, ns: u64, now: u64) {
        let p = self.params;
        if let Some(a) = self.allocs.get_mut(&key) {
            a.meter.note(&p, ns, now);
            // Reported after the GPU time was used: the next report is likely alike.
            a.meter.note_overrun(&p, ns, now);
        }
    }

    /// Returns `ns` of lease time `key` held idle to its cap (see [`CapMeter::refund`]).
    pub(crate) fn refund_cap(&mut self, key: AccountKey, ns: u64, now: u64) {
        let p = self.params;
        if let Some(a) = self.allocs.get_mut(&key) {
            a.meter.refund(&p, ns, now);
        }
    }

    /// Whether `key` is capped (false when unknown).
    pub(crate) fn capped(&self, key: AccountKey) -> bool {
        self.allocs.get(&key).is_some_and(|a| a.meter.cap.is_some())
    }

    /// The shortest lease worth granting, ns.
    pub(super) fn threshold(&self) -> u64 {
        self.params.min_lease_ns.min(self.params.bucket_depth_ns)
    }

    /// The room `a` needs to be granted a lease: a minimal lease, or for a capped allocation
    /// the lease it would be given uncapped (its adapted length, at most the contended length
    /// and the bucket's depth). Each lease costs a hand-over the tenant does not compute in (the
    /// grant reaching it, the drain at its end); granting a capped tenant the first minimal
    /// lease its bucket allows made its leases shorter than its competitors', so it lost more
    /// of its charged time to hand-overs (28.5/71.5 of the GPU's busy time, capped 30 against
    /// uncapped 70, in `compute_share`).
    pub(super) fn need(&self, key: AccountKey, a: &Alloc, now: u64) -> u64 {
        let floor = self.threshold();
        if a.meter.cap.is_none() || a.tier == Tier::Latency {
            return floor;
        }
        let len = a.lease_len.ns();
        // Alone, its turns are as long as a full bucket pays for (a 30% cap: 57 ms every
        // 190 ms): each turn costs a hand-over, and at 20 ms turns a capped tenant alone ran
        // 24.9% of the wall time at a cap of 30 (`compute_share`). Beside others, as long as
        // theirs.
        let len = if self.contended(key, now) {
            len.min(self.params.contended_lease_ns)
        } else {
            len
        };
        len.min(a.meter.full_bucket_affords(&self.params) as u64)
            .max(floor)
    }

    /// GPU time `a` may still be granted at `now` (see [`CapMeter::room`]).
    pub(super) fn room(&self, a: &Alloc, now: u64) -> f64 {
        a.meter.room(&self.params, a.tier == Tier::Latency, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000 * MS;
    /// Far enough from 0 that a cap window never reaches before the clock's origin.
    const T0: u64 = 10 * S;

    fn p() -> SchedulerParams {
        SchedulerParams::default()
    }

    #[test]
    fn uncapped_has_no_limit_and_notes_nothing() {
        let p = p();
        let mut m = CapMeter::new(None, &p, T0);
        m.note(&p, 5 * S, T0);
        m.note_overrun(&p, S, T0);
        assert_eq!(m.room(&p, false, T0), f64::INFINITY);
        assert_eq!(m.room(&p, true, T0), f64::INFINITY);
        assert_eq!(m.tokens_before_use(&p, T0), f64::INFINITY);
        assert_eq!((m.window_used(&p, T0), m.margin(&p, T0)), (0, 0));
        assert_eq!(m.ready_at(&p, false, 20 * MS, T0), None);
        assert_eq!(m.window_frees(&p, 20 * MS, T0), T0);
    }

    #[test]
    fn a_refund_returns_tokens_and_frees_the_newest_charges_of_the_window() {
        let p = p();
        let mut m = CapMeter::new(Some(30), &p, T0);
        // Three 57 ms turns charged in the window; the bucket emptied by them.
        for k in 1..=3 {
            m.note(&p, 57 * MS, T0 + k * 190 * MS);
        }
        let now = T0 + 600 * MS;
        let before = (m.bucket(&p, now), m.window_used(&p, now));
        assert!(before.0 < 30.0 * MS as f64, "{before:?}");
        m.refund(&p, 10 * MS, now);
        assert_eq!(m.window_used(&p, now), before.1 - 10 * MS);
        assert_eq!(m.bucket(&p, now), before.0 + 10.0 * MS as f64);
        // Taken from the newest charge: a window that no longer holds the first charge holds
        // the second whole and 47 ms of the third.
        assert_eq!(m.window_used(&p, T0 + 190 * MS + S), 57 * MS + 47 * MS);
        assert_eq!(m.window_used(&p, T0 + 380 * MS + S), 47 * MS);
        // More than the window holds: the window is at zero, newest first, and the bucket
        // is full but no more (refunds bank nothing beyond its depth).
        m.refund(&p, S, now);
        assert_eq!(m.window_used(&p, now), 0);
        assert_eq!(m.bucket(&p, now), p.bucket_depth_ns as f64);
        // During a lease the depth is compared with the bucket net of the lease so far:
        // 40 ms full at the grant, 60 ms into the lease it holds 40 + 18 - 60 = -2 ms, and
        // a 10 ms refund then is kept whole (its tokens before the lease's use, 58 ms, are
        // over the depth).
        let mut m = CapMeter::new(Some(30), &p, T0);
        m.start_lease(&p, T0);
        let at = T0 + 60 * MS;
        assert!((m.bucket(&p, at) + 2.0 * MS as f64).abs() < 1.0);
        m.refund(&p, 10 * MS, at);
        assert!((m.bucket(&p, at) - 8.0 * MS as f64).abs() < 1.0);
        m.note(&p, 60 * MS, at);
        m.end_lease();
        assert!((m.bucket(&p, at) - 8.0 * MS as f64).abs() < 1.0);
        // Uncapped: nothing to refund.
        let mut u = CapMeter::new(None, &p, T0);
        u.refund(&p, S, T0);
        assert_eq!(u.window_used(&p, T0), 0);
    }

    #[test]
    fn the_bucket_starts_full_and_refills_at_the_cap_up_to_its_depth() {
        let p = p();
        let mut m = CapMeter::new(Some(10), &p, T0);
        assert_eq!(m.tokens_before_use(&p, T0), 40.0 * MS as f64, "full");
        m.note(&p, 40 * MS, T0);
        assert_eq!(m.bucket(&p, T0), 0.0);
        // 10% of 100 ms.
        assert_eq!(m.bucket(&p, T0 + 100 * MS), 10.0 * MS as f64);
        assert_eq!(
            m.bucket(&p, T0 + S),
            40.0 * MS as f64,
            "clipped at the depth"
        );
        // A 20 ms lease takes 18 ms out of the bucket (it refills 2 ms during the lease):
        // 18 ms missing at 10%, 180 ms.
        let ready = m.ready_at(&p, false, 20 * MS, T0).unwrap();
        assert!(ready.abs_diff(T0 + 180 * MS) <= 1, "{ready}");
        assert!((m.room(&p, false, ready) - 20.0 * MS as f64).abs() < 1.0);
        assert_eq!(m.ready_at(&p, false, 20 * MS, T0 + S), Some(T0 + S));
    }

    #[test]
    fn a_lease_fills_and_drains_the_bucket_together_unclipped() {
        let p = p();
        let mut m = CapMeter::new(Some(50), &p, T0);
        m.start_lease(&p, T0);
        // 40 ms + 50% of 100 ms, net of the 100 ms used so far.
        assert_eq!(m.tokens_before_use(&p, T0 + 100 * MS), 90.0 * MS as f64);
        assert_eq!(m.bucket(&p, T0 + 100 * MS), -10.0 * MS as f64);
        m.note(&p, 100 * MS, T0 + 100 * MS);
        m.end_lease();
        // Clipped at the depth during the lease it would be 40 - 100 = -60 ms.
        assert_eq!(m.bucket(&p, T0 + 100 * MS), -10.0 * MS as f64);
        assert_eq!(m.bucket(&p, T0 + 120 * MS), 0.0);
    }

    #[test]
    fn the_cap_window_bounds_every_window_whatever_the_bucket() {
        let p = p();
        let mut m = CapMeter::new(Some(10), &p, T0);
        // 10% of 1 s plus 5 ms of slack.
        assert_eq!(CapMeter::limit(&p, 10), 105 * MS);
        // 10 ms every 100 ms for a second: at the cap, so the bucket stays nearly full.
        for k in 1..=10 {
            m.note(&p, 10 * MS, T0 + k * 100 * MS);
        }
        let now = T0 + S;
        assert_eq!(m.window_used(&p, now), 100 * MS);
        // The bucket holds 30 ms (a 33.3 ms lease), the window only 5: every window ending
        // during a longer lease would hold more than 105 ms.
        assert_eq!(m.bucket(&p, now), 30.0 * MS as f64);
        assert_eq!(m.room(&p, false, now), 5.0 * MS as f64);
        // A latency allocation's room is the window alone.
        assert_eq!(m.room(&p, true, now), 5.0 * MS as f64);
        // A 20 ms lease fits when the window ending at its end has lost 15 ms of the charges:
        // the first (ran [T0 + 90, T0 + 100] ms) and half the second ([T0 + 190, T0 + 200]),
        // so a lease granted at T0 + 1.175 s and ending at T0 + 1.195 s.
        let at = T0 + S + 175 * MS;
        assert_eq!(m.window_frees(&p, 20 * MS, now), at);
        assert_eq!(m.ready_at(&p, true, 20 * MS, now), Some(at));
        // Even 25 ms: the second charge leaves the windows as fast as the lease grows.
        assert_eq!(m.room(&p, true, at), 25.0 * MS as f64);
        // A full bucket (40 ms) pays for a 44.4 ms lease at 10%: it refills 4.4 ms meanwhile.
        let later = T0 + 3 * S;
        let room = m.room(&p, false, later);
        assert!((room - 40.0 * MS as f64 / 0.9).abs() < 1.0, "{room}");
    }

    #[test]
    fn a_lease_may_be_as_long_as_the_window_ending_at_its_end_allows() {
        let p = p();
        let mut m = CapMeter::new(Some(10), &p, T0);
        m.note(&p, 100 * MS, T0);
        // Noted at T0, it covers [T0 - 100 ms, T0]: all of it in the window ending at T0 + 900
        // ms, half in the one ending at T0 + 950 ms, none after T0 + 1 s.
        assert_eq!(m.window_used(&p, T0 + 900 * MS), 100 * MS);
        assert_eq!(m.window_used(&p, T0 + 950 * MS), 50 * MS);
        assert_eq!(m.window_used(&p, T0 + S), 0);
        // From T0 + 900 ms, a lease of up to 105 ms keeps every window within 105 ms: as it
        // runs, the old charge leaves the window as fast. (Counting the whole charge beside
        // the lease allowed 5 ms.)
        assert_eq!(m.room(&p, true, T0 + 900 * MS), 105.0 * MS as f64);
        assert_eq!(m.window_frees(&p, 20 * MS, T0 + 900 * MS), T0 + 900 * MS);
        // Not from T0 + 850 ms: the window ending at T0 + 1 s would hold 100 + 150 ms.
        assert!(m.room(&p, true, T0 + 850 * MS) < 105.0 * MS as f64);
    }

    #[test]
    fn the_largest_recent_overrun_is_kept_free() {
        let p = p();
        let mut m = CapMeter::new(Some(10), &p, T0);
        m.note_overrun(&p, 3 * MS, T0);
        m.note_overrun(&p, 7 * MS, T0 + MS);
        m.note_overrun(&p, 2 * MS, T0 + 2 * MS);
        assert_eq!(m.margin(&p, T0 + 500 * MS), 7 * MS);
        assert_eq!(m.room(&p, true, T0 + 500 * MS), 98.0 * MS as f64);
        // The 7 ms left the window; the 2 ms has not.
        assert_eq!(m.margin(&p, T0 + S + MS), 2 * MS);
        assert_eq!(m.margin(&p, T0 + S + 2 * MS), 0);
    }
}
