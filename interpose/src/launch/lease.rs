//! The lease rules as a pure state machine: what the manager thread does next, given what it
//! saw and the time. No clock, no driver, no socket: the manager thread (`manager`) reads them
//! and feeds [`Observation`]s in; [`Action`]s come back.
//!
//! Times are nanoseconds since an origin the caller picks (the gate's creation); spans are
//! [`Duration`]s. One lease runs:
//!
//! 1. [`Leases::grant`] on the launcher that received it (first credits),
//! 2. [`Leases::take_over`] on the manager thread: an [`Action::Wait`],
//! 3. after each wait a [`Observation::Look`] at the lease's streams: [`Action::Refill`] (then
//!    [`Observation::Refilled`] with the counter it replaced: [`Action::Wait`]) or
//!    [`Action::Stop`],
//! 4. after a stop [`Observation::Stopped`]: [`Action::Release`] at once, or [`Action::Drain`]
//!    and, once drained, [`Observation::Drained`]: [`Action::Release`].
//!
//! The rules, each pinned by a test below:
//! - **Refill**: credits keep the estimated work in flight within the time left less
//!   [`MARGIN_NS`]; with nothing measured, one probe launch at a time; with nothing in flight,
//!   at least one launch even when a kernel is longer than the lease (its overrun is charged).
//! - **Bound** (a best-effort holder beside a latency tenant): the estimated kernel time still to
//!   run in flight stays within the bound (no margin; the oldest kernel's part surely run is
//!   taken off, with one stream busy), one launch at least when nothing is in flight, and the
//!   holder is looked at every [`BOUNDED_TICK`].
//! - **Deadline**: at the deadline the lease ends, whatever is in flight: credits drop to zero
//!   (the interposer's side of revocation), the streams are drained and the whole time from
//!   the grant to the drain is reported (overrun included).
//! - **Early hand-back**: no launch (nor credit taken) for [`IDLE`], no thread waiting, and the
//!   streams drained for the learnt drain wait: the lease goes back with `early`.
//! - **Learnt drain wait** ([`RelaunchGap`]): twice the recent longest gap between a drain and
//!   the next launch (or the next request after an early hand-back), within
//!   [`DRAIN_IDLE`]..[`MAX_DRAIN_IDLE`], decayed once per lease.
//! - **Used up**: drained with less than [`MARGIN_NS`] left: the lease ends before its deadline.
//! - **Cancellation**: a credit taken, a launch counted or a waiter cancels a drain and a
//!   pending hand-back (also a credit taken between a look and its refill).
//! - **First look**: work of the grant's launcher already complete at the first look is not
//!   recent: the quiet counts from the grant.
//! - **Report**: drained with no credit taken since, it goes out at once (busy until now);
//!   otherwise after a drain. A lease ending any way on an idle holder says `early`.
//! - **Arbiter unreachable**: a local lease of [`LOCAL_LEASE`].

#![forbid(unsafe_code)]

use std::time::Duration;

/// Length of the leases the manager grants itself while the arbiter is unreachable.
pub const LOCAL_LEASE: Duration = Duration::from_millis(100);
/// Manager tick while a lease is held and launches go on.
pub const TICK: Duration = Duration::from_micros(500);
/// Manager tick of a bounded holder (best-effort beside a latency tenant) while it has work:
/// its bound keeps one or two kernels in flight, so each refill must follow the completion
/// it waits for closely, or the GPU idles between them (at [`TICK`], 0.1-1 ms kernels kept a
/// best-effort tenant busy 51-69% of the time the latency tenant left).
pub const BOUNDED_TICK: Duration = Duration::from_micros(100);
/// Manager tick while launches have stopped and work is still in flight: the drain is what
/// starts the idle clock, so it is looked for more often than the refill needs.
pub const DRAIN_TICK: Duration = Duration::from_micros(250);
/// No launch for this long (and nothing taken from the credits) before a lease can be handed
/// back early.
pub const IDLE: Duration = Duration::from_millis(1);
/// And the streams must have stayed drained, with no launch, for at least this long: a busy
/// tenant that synchronises and launches again at once must not look idle at the drain itself.
/// A tenant seen to launch again later than that after its drains gets a longer wait (see
/// [`RelaunchGap`]).
pub const DRAIN_IDLE: Duration = Duration::from_micros(250);
/// The longest drain wait [`RelaunchGap`] asks for.
pub const MAX_DRAIN_IDLE: Duration = Duration::from_millis(2);
/// An early hand-back this close is waited for by spinning (see [`WaitMode::Spin`]).
pub const SPIN: Duration = Duration::from_micros(300);
/// Shortest sleep before an early hand-back that is not spun through.
const MIN_SLEEP: Duration = Duration::from_micros(50);
/// Most credits handed out at once.
pub const MAX_CREDITS: i64 = 4096;
/// Safety margin kept free at the end of a lease.
pub const MARGIN_NS: f64 = 300_000.0;

fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

/// How long this process takes to launch again after its streams drained (a synchronise, then
/// some host work, then the next launch), learnt from what it did: launches that came after a
/// drain the manager had seen, and requests for a lease that came soon after an early
/// hand-back (the hand-back was premature). The drain wait before an early hand-back is twice
/// the recent longest gap, within [`DRAIN_IDLE`]..[`MAX_DRAIN_IDLE`], so a training loop that
/// does a little host work between steps keeps its lease, while a process that really went
/// idle still hands back within 0.25 ms. One long gap is forgotten over a few dozen leases.
#[derive(Debug, Default, Clone, Copy)]
pub struct RelaunchGap {
    /// The recent longest gap, decayed, ns.
    ns: f64,
}

impl RelaunchGap {
    /// A launch came `gap` after a drain.
    pub fn observe(&mut self, gap: Duration) {
        if gap <= MAX_DRAIN_IDLE {
            self.ns = self.ns.max(gap.as_nanos() as f64);
        }
    }

    /// Once per lease.
    pub fn decay(&mut self) {
        self.ns *= 0.9;
    }

    /// How long the streams must stay drained before an early hand-back.
    pub fn drain_idle(&self) -> Duration {
        Duration::from_nanos((2.0 * self.ns) as u64).clamp(DRAIN_IDLE, MAX_DRAIN_IDLE)
    }
}

/// Whether a launch took a credit since `handed` were handed out, given the counter's value
/// `now`. With none handed out, a decrement is a launcher that found none and waits.
pub fn credit_taken(handed: i64, now: i64) -> bool {
    handed > 0 && now != handed
}

/// Whatever ended a lease (its deadline can fall on the drain of a burst that ran long), a
/// holder drained for long enough, that launched nothing for [`IDLE`] and has no thread
/// waiting, is idle: its release says so (`early`), so the arbiter passes the GPU on at once
/// rather than keep it for a re-request that will not come. A busy tenant at its deadline is
/// either not drained (work in flight, e.g. waiting in a synchronise), has a launcher waiting,
/// or is in a host-work gap it was seen to take after its drains: `drained_for` (`None`: not
/// seen drained) must reach `drain_idle` less the shortest drain wait.
pub fn idle_at_end(
    drained_for: Option<Duration>,
    drain_idle: Duration,
    untouched: bool,
    waiters: u32,
    since_launch: Duration,
) -> bool {
    drained_for.is_some_and(|d| d + DRAIN_IDLE >= drain_idle)
        && untouched
        && waiters == 0
        && since_launch >= IDLE
}

/// Credits that keep the estimated work in flight within `left`. `per`: the estimated GPU ns
/// of one launch (0: nothing measured yet); `outstanding`: estimated ns in flight; `unknown`:
/// launches in flight whose cost nothing measured yet.
pub fn credits_for(per: f64, left: Duration, outstanding: f64, unknown: u64) -> i64 {
    if per <= 0.0 {
        // Nothing measured yet: one probe launch at a time until a sample completes.
        return if unknown > 0 { 0 } else { 1 };
    }
    if outstanding <= 0.0 && unknown == 0 && (left.as_nanos() as f64) > MARGIN_NS {
        // Nothing in flight: at least one launch, even a kernel longer than the lease
        // (its overrun is measured and charged), or such a tenant would never run.
        let spare = left.as_nanos() as f64 - MARGIN_NS;
        return ((spare / per) as i64).clamp(1, MAX_CREDITS);
    }
    let spare = left.as_nanos() as f64 - outstanding - unknown as f64 * per - MARGIN_NS;
    if spare <= 0.0 {
        return 0;
    }
    ((spare / per) as i64).clamp(0, MAX_CREDITS)
}

/// Credits that keep the estimated kernel time in flight within a holder's bound
/// `bound_ns` (not a lease's end: no margin is kept). `outstanding`: estimated ns still to run
/// of the launches in flight. With nothing in flight, one launch at least (a kernel longer
/// than the bound runs, alone).
pub fn bounded_credits(per: f64, bound_ns: f64, outstanding: f64, unknown: u64) -> i64 {
    if per <= 0.0 {
        return if unknown > 0 { 0 } else { 1 };
    }
    if outstanding <= 0.0 && unknown == 0 {
        return ((bound_ns / per) as i64).clamp(1, MAX_CREDITS);
    }
    let spare = bound_ns - outstanding - unknown as f64 * per;
    ((spare / per).max(0.0) as i64).clamp(0, MAX_CREDITS)
}

/// The tick of lease `l` where `normal` would be: [`BOUNDED_TICK`] at most for a bounded one.
fn tick_of(l: &Lease, normal: Duration) -> Duration {
    if l.max_inflight_ns.is_some() {
        normal.min(BOUNDED_TICK)
    } else {
        normal
    }
}

/// A lease as started on the launcher that received it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Started {
    /// `None`: a local lease (arbiter unreachable).
    pub id: Option<u64>,
    pub duration_ns: u64,
    /// When it started.
    pub start: u64,
    /// Credits handed out at the start.
    pub first: i64,
    /// Most estimated kernel time in flight, ns (`None`: the lease's time left bounds it):
    /// a best-effort holder's bound while a latency tenant is on the GPU.
    pub max_inflight_ns: Option<u64>,
}

/// One stream used during the lease, for the refill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// Launches returned from the driver and not yet known complete.
    pub in_flight: u64,
    /// Estimated GPU ns per launch (0: unknown).
    pub est_ns: f64,
    /// How long the oldest launch in flight has at least been running, ns: since the first
    /// look that saw it launched with everything before it complete (it started by then).
    pub running_ns: f64,
}

/// What the manager thread saw.
#[derive(Debug, Clone, Copy)]
pub enum Observation<'a> {
    /// A look at the lease's streams after a wait.
    Look {
        /// Launches returned from the driver on the lease's streams (ever).
        total: u64,
        /// The credit counter.
        credits: i64,
        /// Every stream's work is known complete.
        drained: bool,
        /// Threads waiting for a credit.
        waiters: u32,
        /// The streams, for the refill.
        streams: &'a [Load],
    },
    /// The refill replaced `previous` credits (pass the look's time).
    Refilled { previous: i64 },
    /// Credits were set to zero, replacing `previous`.
    Stopped { previous: i64, waiters: u32 },
    /// The drain after a stop ended (its end events completed, or its bound passed).
    Drained { waiters: u32 },
}

/// How the manager waits before its next look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitMode {
    /// A timed sleep.
    Sleep,
    /// A timed sleep that a returning synchronise cuts short (launches stopped, work in flight).
    Watch,
    /// Spun through (an early hand-back is close), until a launch moves the counter from
    /// `handed`.
    Spin { handed: i64 },
}

/// Why a lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Its deadline passed.
    Deadline,
    /// The holder went idle: handed back early.
    Idle,
    /// Drained with too little left for one more launch.
    UsedUp,
}

/// What the manager thread does next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    /// Wait up to `tick` (never past the deadline), then look again.
    Wait { tick: Duration, mode: WaitMode },
    /// Set the credit counter to `credits`, then report the old value ([`Observation::Refilled`]).
    Refill { credits: i64 },
    /// The lease ends: set the credits to zero ([`Observation::Stopped`]).
    Stop(End),
    /// Record an end event on every stream of the lease and wait for them (bounded), then
    /// [`Observation::Drained`].
    Drain,
    /// Send `LeaseRelease` (for an arbiter lease); the lease is over.
    Release {
        lease_id: Option<u64>,
        busy_ns: u64,
        early: bool,
    },
}

/// The running lease's state.
#[derive(Debug, Clone)]
struct Lease {
    id: Option<u64>,
    start: u64,
    deadline: u64,
    /// See [`Started::max_inflight_ns`].
    max_inflight_ns: Option<u64>,
    drain_idle: Duration,
    /// Launch total at the last look (`None`: no look yet).
    last_total: Option<u64>,
    /// Last time a launch was seen.
    last_change: u64,
    /// When the streams were first seen drained with no launch since (None: not drained).
    drained_since: Option<u64>,
    early: bool,
    /// Credits as last handed out: fewer now means a launch took one since.
    handed: i64,
    phase: Phase,
}

/// Where a lease is in its turn of observations.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Waiting, then a look.
    Looking,
    /// A refill of `credits` under way, then `wait`.
    Refilling { credits: i64, wait: Action },
    /// Credits going to zero.
    Stopping,
    /// Draining; `untouched`: no credit was taken since the last look.
    Draining { untouched: bool },
}

/// The lease rules of one process: what persists across leases, and the running lease.
#[derive(Debug, Default)]
pub struct Leases {
    /// How soon this process launches again after a drain.
    gap: RelaunchGap,
    /// When the streams drained before the last early hand-back (to learn whether it was
    /// premature).
    handed_back: Option<u64>,
    /// Estimate for streams without one yet (the largest known).
    default_est: f64,
    lease: Option<Lease>,
}

impl Leases {
    /// A lease was obtained (`grant`: id and length from the arbiter; `None`: unreachable, a
    /// local one) by a launch that found no credit at `asked`; it starts `now`.
    pub fn grant(&mut self, grant: Option<(u64, u64)>, asked: u64, now: u64) -> Started {
        self.grant_bounded(grant, None, asked, now)
    }

    /// [`Leases::grant`] for a lease whose holder keeps at most `max_inflight_ns` of estimated
    /// kernel time in flight (`None`: no bound beyond the lease's time left).
    pub fn grant_bounded(
        &mut self,
        grant: Option<(u64, u64)>,
        max_inflight_ns: Option<u64>,
        asked: u64,
        now: u64,
    ) -> Started {
        if let Some(drained) = self.handed_back.take() {
            // Asked again soon after handing back: the gap belongs to the work, not to idleness.
            self.gap
                .observe(Duration::from_nanos(asked.saturating_sub(drained)));
        }
        let (id, duration_ns) = match grant {
            Some((id, d)) => (Some(id), d),
            None => (None, ns(LOCAL_LEASE)),
        };
        // First credits: with no estimate yet, one probe launch.
        let mut first = credits_for(self.default_est, Duration::from_nanos(duration_ns), 0.0, 0);
        if let Some(bound) = max_inflight_ns {
            first = first.min(bounded_credits(self.default_est, bound as f64, 0.0, 0));
        }
        Started {
            id,
            duration_ns,
            start: now,
            first,
            max_inflight_ns,
        }
    }

    /// The manager thread takes a started lease over at `now`: its first wait.
    pub fn take_over(&mut self, s: Started, now: u64) -> Action {
        self.gap.decay();
        self.lease = Some(Lease {
            id: s.id,
            start: s.start,
            deadline: s.start.saturating_add(s.duration_ns),
            max_inflight_ns: s.max_inflight_ns,
            drain_idle: self.gap.drain_idle(),
            last_total: None,
            last_change: now,
            drained_since: None,
            early: false,
            handed: s.first,
            phase: Phase::Looking,
        });
        let tick = match s.max_inflight_ns {
            Some(_) => BOUNDED_TICK,
            None => TICK,
        };
        Action::Wait {
            tick,
            mode: WaitMode::Sleep,
        }
    }

    /// The arbiter revoked lease `lease_id` (a latency request): if it is the running one, its
    /// deadline becomes `now`, so the next look stops it (credits to zero, the drain, the
    /// release, which the arbiter ignores: it ended the lease already). Whether it was.
    pub fn revoke(&mut self, lease_id: u64, now: u64) -> bool {
        match self.lease.as_mut() {
            Some(l) if l.id == Some(lease_id) => {
                l.deadline = l.deadline.min(now);
                true
            }
            _ => false,
        }
    }

    /// The running lease's deadline (`None`: none running).
    pub fn deadline(&self) -> Option<u64> {
        self.lease.as_ref().map(|l| l.deadline)
    }

    /// The running lease's drain wait before an early hand-back.
    pub fn drain_idle(&self) -> Option<Duration> {
        self.lease.as_ref().map(|l| l.drain_idle)
    }

    /// Estimate for a launch on a stream not measured yet (0: none).
    pub fn default_est(&self) -> f64 {
        self.default_est
    }

    /// The next action given what was seen at `now`.
    ///
    /// # Panics
    /// When no lease is running, or an observation comes out of turn (a bug in the caller).
    pub fn step(&mut self, obs: Observation<'_>, now: u64) -> Action {
        let l = self.lease.as_mut().expect("a lease is running");
        match obs {
            Observation::Look {
                total,
                credits,
                drained,
                waiters,
                streams,
            } => {
                assert_eq!(l.phase, Phase::Looking, "a look out of turn");
                let wait = Self::look(l, &mut self.gap, total, credits, drained, waiters, now);
                if let Action::Stop(end) = wait {
                    l.early = end == End::Idle;
                    l.phase = Phase::Stopping;
                    return wait;
                }
                // Refill: what may still be launched so that the work in flight ends by the
                // deadline.
                let max_est = streams.iter().map(|s| s.est_ns).fold(0.0, f64::max);
                if max_est > 0.0 {
                    self.default_est = max_est;
                }
                let mut outstanding = 0.0;
                let mut unknown = 0u64;
                for s in streams {
                    let est = if s.est_ns > 0.0 {
                        s.est_ns
                    } else {
                        self.default_est
                    };
                    if est > 0.0 {
                        outstanding += s.in_flight as f64 * est;
                    } else {
                        unknown += s.in_flight;
                    }
                }
                let left = Duration::from_nanos(l.deadline - now);
                let mut credits = credits_for(self.default_est, left, outstanding, unknown);
                // A bounded holder keeps at most its bound in flight, whatever the lease has
                // left. What counts is the time still to run: the oldest kernel's part already
                // run is taken off (at most its estimate), so the next one is queued before it
                // ends and the GPU does not idle between them. Only with one stream busy: the
                // streams of one context share its engine time, so a stream's wall time is not
                // its kernel's progress.
                if let Some(bound) = l.max_inflight_ns {
                    let mut busy = streams.iter().filter(|s| s.in_flight > 0);
                    let mut left_to_run = outstanding;
                    if let (Some(one), None) = (busy.next(), busy.next()) {
                        let est = if one.est_ns > 0.0 {
                            one.est_ns
                        } else {
                            self.default_est
                        };
                        if est > 0.0 {
                            left_to_run -= one.running_ns.clamp(0.0, est);
                        }
                    }
                    credits = credits.min(bounded_credits(
                        self.default_est,
                        bound as f64,
                        left_to_run,
                        unknown,
                    ));
                }
                l.phase = Phase::Refilling { credits, wait };
                Action::Refill { credits }
            }
            Observation::Refilled { previous } => {
                let Phase::Refilling { credits, wait } = l.phase else {
                    panic!("a refill out of turn");
                };
                l.phase = Phase::Looking;
                if credit_taken(l.handed, previous) {
                    // Taken between the look and the refill.
                    l.last_change = now;
                    l.drained_since = None;
                }
                l.handed = credits;
                match wait {
                    // The spin watches the credits just handed out.
                    Action::Wait {
                        tick,
                        mode: WaitMode::Spin { .. },
                    } => Action::Wait {
                        tick,
                        mode: WaitMode::Spin { handed: credits },
                    },
                    w => w,
                }
            }
            Observation::Stopped { previous, waiters } => {
                assert_eq!(l.phase, Phase::Stopping, "a stop out of turn");
                let untouched = !credit_taken(l.handed, previous);
                if l.drained_since.is_some() && untouched {
                    // Every stream was seen drained and no launch took a credit since: nothing
                    // is in flight, so there is nothing to wait for, and the lease was busy
                    // (and is charged) until now.
                    self.release(waiters, true, now)
                } else {
                    l.phase = Phase::Draining { untouched };
                    Action::Drain
                }
            }
            Observation::Drained { waiters } => {
                let Phase::Draining { untouched } = l.phase else {
                    panic!("a drain out of turn");
                };
                self.release(waiters, untouched, now)
            }
        }
    }

    /// The rules of one look; the wait after the refill, or the end.
    fn look(
        l: &mut Lease,
        gap: &mut RelaunchGap,
        total: u64,
        credits: i64,
        drained: bool,
        waiters: u32,
        now: u64,
    ) -> Action {
        // A credit taken is a launch under way, even before the driver returned it.
        let took = credit_taken(l.handed, credits);
        let mut launched = l.last_total != Some(total) || took;
        if l.last_total.is_none() && drained {
            // First look, and what the launcher did since the grant has already completed
            // (this thread may have taken the lease over late): those launches are not
            // recent, so the quiet counts from the lease's start.
            launched = false;
            l.last_total = Some(total);
            l.last_change = l.start;
            // Credits taken so far are those launches; a later take shows against this.
            l.handed = credits;
        } else if launched {
            l.last_total = Some(total);
            l.last_change = now;
        }
        if launched && let Some(t) = l.drained_since {
            gap.observe(Duration::from_nanos(now.saturating_sub(t)));
        }
        l.drained_since = match (drained && !launched, l.drained_since) {
            (false, _) => None,
            (true, Some(t)) => Some(t),
            (true, None) => Some(now),
        };
        if now >= l.deadline {
            return Action::Stop(End::Deadline);
        }
        let since_change = Duration::from_nanos(now.saturating_sub(l.last_change));
        let quiet = waiters == 0 && since_change >= IDLE;
        if quiet
            && l.drained_since
                .is_some_and(|t| Duration::from_nanos(now.saturating_sub(t)) >= l.drain_idle)
        {
            return Action::Stop(End::Idle);
        }
        if l.drained_since.is_some() && (l.deadline.saturating_sub(now)) as f64 <= MARGIN_NS {
            // Nothing in flight and too little time left to hand out a launch: the lease
            // is used up; holding it to the deadline would only leave the GPU idle.
            return Action::Stop(End::UsedUp);
        }
        // The next look: when the idle clocks run out, or at the drain. The last stretch
        // before an early hand-back is spun through, not slept: a timed wake-up of an idle
        // CPU is occasionally late by milliseconds, and a waiting tenant pays for it. The spin
        // watches the credits the refill hands out (filled in by `step`).
        let (tick, mode) = match l.drained_since {
            Some(t) if waiters == 0 => {
                let at = (t + ns(l.drain_idle)).max(l.last_change + ns(IDLE));
                let left = Duration::from_nanos(at.saturating_sub(now));
                if left <= SPIN {
                    (left, WaitMode::Spin { handed: 0 })
                } else {
                    (left.clamp(MIN_SLEEP, TICK), WaitMode::Sleep)
                }
            }
            None if !launched => (tick_of(l, DRAIN_TICK), WaitMode::Watch),
            _ => (tick_of(l, TICK), WaitMode::Sleep),
        };
        Action::Wait { tick, mode }
    }

    fn release(&mut self, waiters: u32, untouched: bool, now: u64) -> Action {
        let l = self.lease.take().expect("a lease is running");
        let busy_ns = now.saturating_sub(l.start);
        let early = l.early
            || idle_at_end(
                l.drained_since
                    .map(|t| Duration::from_nanos(now.saturating_sub(t))),
                l.drain_idle,
                untouched,
                waiters,
                Duration::from_nanos(now.saturating_sub(l.last_change)),
            );
        if early {
            self.handed_back = l.drained_since;
        }
        Action::Release {
            lease_id: l.id,
            busy_ns,
            early,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;
    const MS: u64 = 1_000_000;
    const LEASE_ID: u64 = 7;

    /// One process under the lease rules, on a fake clock: the test launches and completes
    /// work, and looks when the manager thread would.
    struct Sim {
        m: Leases,
        /// The gate's credit counter.
        credits: i64,
        /// Launches returned on the lease's streams.
        total: u64,
        drained: bool,
        waiters: u32,
        loads: Vec<Load>,
        now: u64,
    }

    impl Sim {
        fn new() -> Self {
            Self {
                m: Leases::default(),
                credits: 0,
                total: 0,
                drained: true,
                waiters: 0,
                loads: Vec::new(),
                now: 0,
            }
        }

        /// A lease of `ms` from the arbiter, asked for and taken over at `at`.
        fn lease(&mut self, ms: u64, at: u64) -> Started {
            let s = self.m.grant(Some((LEASE_ID, ms * MS)), at, at);
            self.credits = s.first;
            let first = self.m.take_over(s, at);
            assert_eq!(
                first,
                Action::Wait {
                    tick: TICK,
                    mode: WaitMode::Sleep
                },
                "a lease starts with a tick's wait"
            );
            s
        }

        /// `n` launches take credits and return from the driver; their work is in flight.
        fn launch(&mut self, n: u64) {
            self.credits -= n as i64;
            self.total += n;
            self.drained = false;
        }

        /// A look at `at`; a refill is answered at once and the wait after it returned.
        fn look(&mut self, at: u64) -> Action {
            self.now = at;
            let obs = Observation::Look {
                total: self.total,
                credits: self.credits,
                drained: self.drained,
                waiters: self.waiters,
                streams: &self.loads,
            };
            match self.m.step(obs, at) {
                Action::Refill { credits } => {
                    let previous = std::mem::replace(&mut self.credits, credits);
                    let wait = self.m.step(Observation::Refilled { previous }, at);
                    assert!(matches!(wait, Action::Wait { .. }), "{wait:?}");
                    wait
                }
                a => a,
            }
        }

        /// Credits to zero after a stop, at `at`: a release, or a drain first.
        fn stop(&mut self, at: u64) -> Action {
            self.now = at;
            let previous = std::mem::replace(&mut self.credits, 0);
            self.m.step(
                Observation::Stopped {
                    previous,
                    waiters: self.waiters,
                },
                at,
            )
        }
    }

    fn sleep(us: u64) -> Action {
        Action::Wait {
            tick: Duration::from_micros(us),
            mode: WaitMode::Sleep,
        }
    }

    fn release(busy_ns: u64, early: bool) -> Action {
        Action::Release {
            lease_id: Some(LEASE_ID),
            busy_ns,
            early,
        }
    }

    #[test]
    fn an_idle_holder_hands_back_after_the_drain_wait_spinning_through_the_last_stretch() {
        let mut s = Sim::new();
        s.lease(20, 0);
        s.launch(1);
        assert_eq!(s.look(500 * US), sleep(500), "launching: the refill tick");
        s.drained = true;
        // Drained at 1 ms; the quiet runs from the launch seen at 0.5 ms: the hand-back is due
        // at 1.5 ms, slept towards while further than the spin.
        assert_eq!(s.look(MS), sleep(500));
        let handed = s.credits;
        assert_eq!(
            s.look(1300 * US),
            Action::Wait {
                tick: Duration::from_micros(200),
                mode: WaitMode::Spin { handed }
            },
            "the last 0.3 ms are spun through, watching the credits handed out"
        );
        assert_eq!(s.look(1500 * US), Action::Stop(End::Idle));
        assert_eq!(
            s.stop(1500 * US),
            release(1500 * US, true),
            "drained and untouched: reported at once, busy until now, early"
        );
        assert_eq!(s.m.deadline(), None, "the lease is over");
    }

    #[test]
    fn the_drain_wait_is_learnt_from_relaunches_and_from_re_requests() {
        let mut s = Sim::new();
        s.lease(20, 0);
        assert_eq!(
            s.m.drain_idle(),
            Some(DRAIN_IDLE),
            "nothing learnt: the floor"
        );
        s.launch(1);
        s.look(200 * US);
        s.drained = true;
        s.look(400 * US);
        // Host work for 0.6 ms after the drain, then the next step's launch.
        s.launch(1);
        s.look(MS);
        s.drained = true;
        s.look(1200 * US);
        // Nothing more: handed back once the (still short) drain wait passed.
        assert_eq!(s.look(2200 * US), Action::Stop(End::Idle));
        assert_eq!(s.stop(2200 * US), release(2200 * US, true));

        // Next lease: twice the 0.6 ms gap, decayed once.
        let start = 10 * MS;
        s.lease(20, start);
        assert_eq!(s.m.drain_idle(), Some(Duration::from_micros(1080)));
        s.launch(1);
        s.look(start + 500 * US);
        s.drained = true;
        s.look(start + 600 * US);
        // Quiet for 1 ms, drained for 0.9 ms: the learnt gap, not idleness.
        assert!(matches!(s.look(start + 1500 * US), Action::Wait { .. }));
        assert_eq!(s.look(start + 1680 * US), Action::Stop(End::Idle));
        assert_eq!(s.stop(start + 1680 * US), release(1680 * US, true));

        // The process asks again 1.4 ms after the drain that preceded that hand-back (at
        // 0.6 ms): the hand-back was premature; the gap is learnt, the drain wait capped.
        let asked = start + 2 * MS;
        let g = s.m.grant(Some((8, 20 * MS)), asked, asked);
        assert_eq!(g.id, Some(8));
        s.m.take_over(g, asked);
        assert_eq!(s.m.drain_idle(), Some(MAX_DRAIN_IDLE));
    }

    #[test]
    fn a_re_request_soon_after_an_early_hand_back_lengthens_the_drain_wait() {
        let mut s = Sim::new();
        s.lease(20, 0);
        // Nothing launched: drained from the first look, quiet since the grant.
        assert!(matches!(s.look(1000 * US), Action::Wait { .. }));
        assert_eq!(s.look(1250 * US), Action::Stop(End::Idle));
        assert_eq!(s.stop(1250 * US), release(1250 * US, true));
        // Drained at 1 ms, asked again at 2 ms: the 1 ms gap is the work's.
        let g = s.m.grant(Some((8, 20 * MS)), 2 * MS, 2 * MS);
        s.m.take_over(g, 2 * MS);
        assert_eq!(s.m.drain_idle(), Some(Duration::from_micros(1800)));
        // A pause longer than the longest drain wait is no gap: nothing more learnt.
        let mut s = Sim::new();
        s.lease(20, 0);
        s.look(1000 * US);
        s.look(1250 * US);
        s.stop(1250 * US);
        let g = s.m.grant(Some((8, 20 * MS)), 5 * MS, 5 * MS);
        s.m.take_over(g, 5 * MS);
        assert_eq!(s.m.drain_idle(), Some(DRAIN_IDLE));
    }

    #[test]
    fn launches_and_waiters_cancel_a_pending_hand_back() {
        let mut s = Sim::new();
        s.lease(20, 0);
        s.launch(1);
        s.look(500 * US);
        s.drained = true;
        s.look(MS);
        assert!(matches!(
            s.look(1300 * US),
            Action::Wait {
                mode: WaitMode::Spin { .. },
                ..
            }
        ));
        // A credit taken during the spin (the launch has not returned from the driver yet).
        s.credits -= 1;
        assert_eq!(
            s.look(1500 * US),
            sleep(500),
            "launching again: no hand-back"
        );
        // It returns and completes; a thread now waits for a credit.
        s.total += 1;
        s.drained = true;
        s.waiters = 1;
        s.look(2 * MS);
        assert_eq!(
            s.look(4 * MS),
            sleep(500),
            "drained and quiet, but a launcher waits: kept, at the refill tick"
        );
        s.waiters = 0;
        assert_eq!(s.look(5 * MS), Action::Stop(End::Idle));
        assert_eq!(s.stop(5 * MS), release(5 * MS, true));
    }

    #[test]
    fn a_credit_taken_between_a_look_and_its_refill_cancels_the_drain() {
        let mut s = Sim::new();
        s.lease(20, 0);
        s.launch(1);
        s.look(500 * US);
        s.drained = true;
        let look = Observation::Look {
            total: s.total,
            credits: s.credits,
            drained: true,
            waiters: 0,
            streams: &[],
        };
        let Action::Refill { credits } = s.m.step(look, 2 * MS) else {
            panic!("a refill")
        };
        // The counter the refill replaced is one lower than handed out: a launch under way.
        let previous = s.credits - 1;
        s.credits = credits;
        s.m.step(Observation::Refilled { previous }, 2 * MS);
        s.total += 1;
        s.drained = false;
        // Without the cancellation the drain seen at 2 ms would hand back here.
        assert_eq!(s.look(2400 * US), sleep(500));
        s.drained = true;
        s.look(2500 * US);
        assert_eq!(s.look(3500 * US), Action::Stop(End::Idle));
    }

    #[test]
    fn the_deadline_ends_a_busy_lease_and_its_overrun_is_charged() {
        let mut s = Sim::new();
        s.lease(2, 0);
        s.launch(3);
        s.look(500 * US);
        s.launch(3);
        s.look(MS);
        s.launch(3);
        assert_eq!(s.look(2 * MS), Action::Stop(End::Deadline));
        assert_eq!(
            s.stop(2 * MS),
            Action::Drain,
            "work in flight: the report waits for it"
        );
        // The last kernel completes 1.5 ms past the deadline: charged.
        let end = s.m.step(Observation::Drained { waiters: 1 }, 3500 * US);
        assert_eq!(end, release(3500 * US, false));
    }

    #[test]
    fn a_drained_holder_at_its_deadline_is_reported_early_only_when_idle() {
        // Drained long before the deadline but a launcher waiting: kept, then not early.
        let mut s = Sim::new();
        s.lease(2, 0);
        s.launch(1);
        s.look(100 * US);
        s.drained = true;
        s.waiters = 1;
        s.look(200 * US);
        s.look(1500 * US);
        assert_eq!(s.look(1700 * US), Action::Stop(End::UsedUp));
        assert_eq!(s.stop(1700 * US), release(1700 * US, false));
        // The drain first seen at the deadline, quiet and nobody waiting: early.
        let mut s = Sim::new();
        s.lease(2, 0);
        s.launch(1);
        s.look(1000 * US);
        s.drained = true;
        assert_eq!(s.look(2 * MS), Action::Stop(End::Deadline));
        assert_eq!(s.stop(2100 * US), release(2100 * US, true));
        // Not drained at the deadline (a synchronise pending): drained later, not early.
        let mut s = Sim::new();
        s.lease(2, 0);
        s.launch(1);
        s.look(500 * US);
        assert_eq!(s.look(2 * MS), Action::Stop(End::Deadline));
        assert_eq!(s.stop(2 * MS), Action::Drain);
        let end = s.m.step(Observation::Drained { waiters: 0 }, 2100 * US);
        assert_eq!(end, release(2100 * US, false));
    }

    #[test]
    fn a_used_up_lease_ends_before_its_deadline() {
        let mut s = Sim::new();
        s.lease(10, 0);
        s.launch(1);
        s.look(9500 * US);
        s.drained = true;
        assert_eq!(
            s.look(9750 * US),
            Action::Stop(End::UsedUp),
            "drained with 0.25 ms left: under the margin"
        );
        assert_eq!(s.stop(9750 * US), release(9750 * US, false));
    }

    #[test]
    fn a_credit_taken_at_the_stop_makes_the_report_wait_for_the_drain() {
        let mut s = Sim::new();
        s.lease(10, 0);
        s.launch(1);
        s.look(9500 * US);
        s.drained = true;
        assert_eq!(s.look(9750 * US), Action::Stop(End::UsedUp));
        s.credits -= 1;
        assert_eq!(s.stop(9750 * US), Action::Drain);
        let end = s.m.step(Observation::Drained { waiters: 0 }, 11 * MS);
        assert_eq!(end, release(11 * MS, false));
    }

    #[test]
    fn the_first_look_counts_the_quiet_from_the_grant() {
        // The launcher's work completed before the manager took the lease over (at 0.9 ms):
        // quiet since the grant, so the hand-back needs only the drain wait.
        let mut s = Sim::new();
        let g = s.m.grant(Some((LEASE_ID, 20 * MS)), 0, 0);
        s.credits = g.first - 1;
        s.total = 1;
        s.m.take_over(g, 900 * US);
        assert!(matches!(s.look(MS), Action::Wait { .. }));
        assert_eq!(s.look(1250 * US), Action::Stop(End::Idle));
        // Still in flight at the first look: the quiet runs from that look.
        let mut s = Sim::new();
        let g = s.m.grant(Some((LEASE_ID, 20 * MS)), 0, 0);
        s.m.take_over(g, 900 * US);
        s.launch(1);
        assert_eq!(s.look(MS), sleep(500));
        s.drained = true;
        assert_eq!(s.look(1250 * US), sleep(500));
        assert_eq!(s.look(2 * MS), Action::Stop(End::Idle));
    }

    #[test]
    fn launches_stopped_with_work_in_flight_are_watched_for_the_drain() {
        let mut s = Sim::new();
        s.lease(20, 0);
        s.launch(2);
        s.look(500 * US);
        assert_eq!(
            s.look(MS),
            Action::Wait {
                tick: DRAIN_TICK,
                mode: WaitMode::Watch
            },
            "no launch since, not drained: a synchronise may end the wait"
        );
    }

    #[test]
    fn refills_keep_the_estimated_work_in_flight_within_the_lease() {
        let mut s = Sim::new();
        let g = s.lease(20, 0);
        assert_eq!(g.first, 1, "nothing measured: one probe launch");
        s.launch(1);
        // The probe is in flight, its cost unknown: no second one.
        s.loads = vec![Load {
            in_flight: 1,
            est_ns: 0.0,
            running_ns: 0.0,
        }];
        s.look(100 * US);
        assert_eq!(s.credits, 0);
        // Measured: 1 ms per launch, 5 in flight on one stream, 2 of unknown cost on another
        // (counted at the known pace): 19.9 - 5 - 2 - 0.3 ms of room at 0.1 ms.
        s.loads = vec![
            Load {
                in_flight: 5,
                est_ns: 1e6,
                running_ns: 0.0,
            },
            Load {
                in_flight: 2,
                est_ns: 0.0,
                running_ns: 0.0,
            },
        ];
        s.total += 6;
        s.look(100 * US);
        assert_eq!(s.credits, 12);
        assert_eq!(
            s.m.default_est(),
            1e6,
            "the largest estimate is the default"
        );
        // The next lease starts from what was learnt.
        s.drained = true;
        s.loads.clear();
        let _ = s.look(19_800 * US);
        let g = s.m.grant(Some((8, 10 * MS)), 30 * MS, 30 * MS);
        assert_eq!(g.first, 9, "9.7 ms of room at 1 ms a launch");
    }

    #[test]
    fn an_unreachable_arbiter_gets_a_local_lease() {
        let mut s = Sim::new();
        let g = s.m.grant(None, 0, 3 * MS);
        assert_eq!(
            g,
            Started {
                id: None,
                duration_ns: ns(LOCAL_LEASE),
                start: 3 * MS,
                first: 1,
                max_inflight_ns: None,
            }
        );
        s.credits = g.first;
        s.m.take_over(g, 3 * MS);
        assert_eq!(s.m.deadline(), Some(103 * MS));
        s.look(4 * MS);
        assert_eq!(s.look(5 * MS), Action::Stop(End::Idle));
        assert_eq!(
            s.stop(5 * MS),
            Action::Release {
                lease_id: None,
                busy_ns: 2 * MS,
                early: true
            },
            "a local lease has no id to report"
        );
    }

    #[test]
    #[should_panic(expected = "a look out of turn")]
    fn a_look_during_a_refill_is_a_bug() {
        let mut s = Sim::new();
        s.lease(20, 0);
        let look = Observation::Look {
            total: 0,
            credits: 1,
            drained: false,
            waiters: 0,
            streams: &[],
        };
        s.m.step(look, 100 * US);
        s.m.step(look, 200 * US);
    }

    #[test]
    fn the_drain_wait_follows_the_relaunch_gap() {
        let mut g = RelaunchGap::default();
        assert_eq!(g.drain_idle(), DRAIN_IDLE, "nothing learnt: the floor");
        g.observe(Duration::from_micros(40));
        assert_eq!(
            g.drain_idle(),
            DRAIN_IDLE,
            "a prompt relaunch keeps the floor"
        );
        g.observe(Duration::from_micros(600));
        assert_eq!(
            g.drain_idle(),
            Duration::from_micros(1200),
            "twice the longest recent gap"
        );
        g.observe(Duration::from_micros(300));
        assert_eq!(
            g.drain_idle(),
            Duration::from_micros(1200),
            "a shorter gap does not lower it"
        );
        g.observe(Duration::from_millis(40));
        assert_eq!(
            g.drain_idle(),
            Duration::from_micros(1200),
            "a real pause is not a gap"
        );
        g.observe(Duration::from_micros(1500));
        assert_eq!(g.drain_idle(), MAX_DRAIN_IDLE, "capped");
        for _ in 0..40 {
            g.decay();
        }
        assert_eq!(
            g.drain_idle(),
            DRAIN_IDLE,
            "forgotten after a few dozen leases"
        );
    }

    #[test]
    fn a_lease_ending_on_an_idle_holder_is_reported_early() {
        let long = IDLE + Duration::from_micros(1);
        let now = Some(Duration::ZERO);
        assert!(
            idle_at_end(now, DRAIN_IDLE, true, 0, long),
            "drained, quiet, nobody waiting"
        );
        assert!(
            !idle_at_end(None, DRAIN_IDLE, true, 0, long),
            "work in flight (a synchronise pending)"
        );
        assert!(
            !idle_at_end(now, DRAIN_IDLE, false, 0, long),
            "a credit was taken since the last look"
        );
        assert!(
            !idle_at_end(now, DRAIN_IDLE, true, 1, long),
            "a launcher waits for the next lease"
        );
        assert!(
            !idle_at_end(now, DRAIN_IDLE, true, 0, IDLE / 2),
            "launched just now"
        );
        // A process seen to work 0.6 ms on the host between its drains and launches (drain
        // wait 1.2 ms): drained 0.3 ms is its gap, not idleness; drained 1 ms is.
        let learnt = Duration::from_micros(1200);
        assert!(!idle_at_end(
            Some(Duration::from_micros(300)),
            learnt,
            true,
            0,
            long
        ));
        assert!(idle_at_end(
            Some(Duration::from_millis(1)),
            learnt,
            true,
            0,
            long
        ));
    }

    #[test]
    fn credits_bound_the_work_in_flight() {
        let ms = Duration::from_millis;
        // Nothing known: one probe at a time.
        assert_eq!(credits_for(0.0, ms(20), 0.0, 0), 1);
        assert_eq!(credits_for(0.0, ms(20), 0.0, 1), 0);
        // 1 ms kernels, 20 ms left, 5 ms in flight: 14.7 ms of room = 14 launches.
        assert_eq!(credits_for(1e6, ms(20), 5e6, 0), 14);
        // Launches of unknown cost count at the known pace.
        assert_eq!(credits_for(1e6, ms(20), 5e6, 2), 12);
        // No room left: none.
        assert_eq!(credits_for(1e6, ms(2), 5e6, 0), 0);
        // A kernel longer than the lease still gets one launch when nothing is in flight.
        assert_eq!(credits_for(30e6, ms(20), 0.0, 0), 1);
        assert_eq!(credits_for(30e6, ms(20), 30e6, 0), 0);
        // Tiny kernels: capped.
        assert_eq!(credits_for(10.0, ms(100), 0.0, 0), MAX_CREDITS);
    }

    #[test]
    fn a_bounded_holder_keeps_at_most_its_bound_in_flight_whatever_the_lease_has_left() {
        let mut s = Sim::new();
        // A 20 ms lease bounded at 1 ms in flight, with 0.2 ms launches measured.
        let g = s.m.grant_bounded(Some((LEASE_ID, 20 * MS)), Some(MS), 0, 0);
        assert_eq!(g.first, 1, "nothing measured: one probe launch");
        s.credits = g.first;
        s.m.take_over(g, 0);
        s.launch(1);
        s.loads = vec![Load {
            in_flight: 1,
            est_ns: 200_000.0,
            running_ns: 0.0,
        }];
        s.look(100 * US);
        // 1 ms - 0.2 in flight: 0.8 ms of room, 4 launches (no end-of-lease margin in a
        // bound; unbounded: 19.4 ms of room, 97).
        assert_eq!(s.credits, 4);
        // Nothing in flight: still one launch at least, even one longer than the bound.
        s.loads = vec![Load {
            in_flight: 0,
            est_ns: 5e6,
            running_ns: 0.0,
        }];
        s.total += 1;
        s.look(200 * US);
        assert_eq!(s.credits, 1, "a 5 ms kernel alone, not 3");
        // The next lease without a bound is back to the lease's length.
        let g = s.m.grant(Some((8, 20 * MS)), 30 * MS, 30 * MS);
        assert!(g.first >= 3, "{}", g.first);
    }

    #[test]
    fn a_bounded_holder_queues_the_next_kernel_before_the_running_one_ends() {
        // 0.55 ms kernels under a 1 ms bound: one in flight leaves 0.45 ms, no room for a
        // second; once it has run 0.3 ms (0.25 left), the next fits, so the GPU does not idle
        // between them waiting for the manager to see the completion.
        let mut s = Sim::new();
        let g = s.m.grant_bounded(Some((LEASE_ID, 20 * MS)), Some(MS), 0, 0);
        s.credits = g.first;
        let first = s.m.take_over(g, 0);
        assert_eq!(
            first,
            Action::Wait {
                tick: BOUNDED_TICK,
                mode: WaitMode::Sleep
            },
            "a bounded lease is looked at every 0.1 ms"
        );
        s.launch(1);
        let load = |running_ns: f64| Load {
            in_flight: 1,
            est_ns: 550_000.0,
            running_ns,
        };
        s.loads = vec![load(0.0)];
        let wait = s.look(100 * US);
        assert_eq!(s.credits, 0, "just started: no room");
        assert!(
            matches!(wait, Action::Wait { tick, .. } if tick <= BOUNDED_TICK),
            "{wait:?}"
        );
        s.loads = vec![load(300_000.0)];
        s.look(400 * US);
        assert_eq!(s.credits, 1, "0.25 ms left to run: the next is queued");
        // Its part run counts at most its estimate: a stale head (the sample covering it not
        // yet done) is taken for one with nothing left to run, never for less than nothing.
        s.loads = vec![Load {
            in_flight: 2,
            est_ns: 550_000.0,
            running_ns: 5e6,
        }];
        s.total += 1;
        s.look(500 * US);
        assert_eq!(
            s.credits, 0,
            "0.55 ms of the second still to run: 0.45 ms of room"
        );
        // Two streams busy share the context's engine time: their wall time is not progress.
        s.loads = vec![load(300_000.0), load(300_000.0)];
        s.total += 1;
        s.look(600 * US);
        assert_eq!(s.credits, 0);
        assert_eq!(bounded_credits(550_000.0, 1e6, 250_000.0, 0), 1);
        assert_eq!(bounded_credits(0.0, 1e6, 0.0, 0), 1, "one probe");
        assert_eq!(bounded_credits(5e6, 1e6, 0.0, 0), 1, "a long kernel alone");
        assert_eq!(bounded_credits(5e6, 1e6, 4e6, 0), 0);
    }

    #[test]
    fn a_revoked_lease_stops_at_the_next_look_and_another_ids_revocation_is_stale() {
        let mut s = Sim::new();
        s.lease(20, 0);
        s.launch(3);
        s.loads = vec![Load {
            in_flight: 3,
            est_ns: 1e6,
            running_ns: 0.0,
        }];
        assert!(matches!(s.look(500 * US), Action::Wait { .. }));
        assert!(!s.m.revoke(LEASE_ID + 1, 600 * US), "not the running lease");
        assert!(matches!(s.look(1_000 * US), Action::Wait { .. }));
        assert!(s.m.revoke(LEASE_ID, 1_100 * US));
        assert_eq!(s.m.deadline(), Some(1_100 * US), "ends now, not at 20 ms");
        assert_eq!(s.look(1_200 * US), Action::Stop(End::Deadline));
        // Work in flight: the drain, then the release (which the arbiter ignores).
        assert_eq!(s.stop(1_200 * US), Action::Drain);
        let r = s.m.step(Observation::Drained { waiters: 1 }, 3_000 * US);
        assert!(
            matches!(
                r,
                Action::Release {
                    lease_id: Some(LEASE_ID),
                    early: false,
                    ..
                }
            ),
            "{r:?}"
        );
        assert!(!s.m.revoke(LEASE_ID, 3_100 * US), "over: nothing to revoke");
    }
}
