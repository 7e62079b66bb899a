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
/// The shortest drain wait of a latency holder's lease (see [`Leases::grant_latency`]): a
/// request in several synchronised steps that launches again sooner than [`DRAIN_IDLE`] after a
/// drain is learnt as for any holder, so the wait need not cover the moment of a drain itself.
pub const LATENCY_DRAIN_IDLE: Duration = Duration::from_micros(50);
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
        self.drain_idle_from(DRAIN_IDLE)
    }

    /// [`RelaunchGap::drain_idle`] with `least` as its floor.
    fn drain_idle_from(&self, least: Duration) -> Duration {
        Duration::from_nanos((2.0 * self.ns) as u64).clamp(least, MAX_DRAIN_IDLE)
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
    /// A latency holder's lease (see [`Leases::grant_latency`]).
    pub latency: bool,
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

// ---- a lease's start and end: grants, the take-over, revocation, what the manager reads ----

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
            latency: false,
        }
    }

    /// [`Leases::grant`] for a latency holder's lease (the arbiter's `LeaseGrantedLatency`):
    /// its drain wait starts at [`LATENCY_DRAIN_IDLE`], and a request that follows its last
    /// early hand-back is not taken for a premature hand-back: a latency service's requests
    /// come when its clients send them, and a drain wait learnt from the odd one that came soon
    /// kept the GPU idle up to 2 ms after every later request (0.87 ms on the mean, 5 points of
    /// best-effort work beside a service sending 33 requests a second). Gaps between a drain
    /// and a launch inside its lease are still learnt (a request in several synchronised steps
    /// keeps its lease between them).
    pub fn grant_latency(&mut self, grant: (u64, u64), asked: u64, now: u64) -> Started {
        self.handed_back = None;
        Started {
            latency: true,
            ..self.grant_bounded(Some(grant), None, asked, now)
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
            drain_idle: if s.latency {
                self.gap.drain_idle_from(LATENCY_DRAIN_IDLE)
            } else {
                self.gap.drain_idle()
            },
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
}

// ---- the running lease's turn: an observation in, the next action out --------------------

impl Leases {
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
                    // A kernel in flight past its estimate has not ended: it still counts as
                    // something to run, so a next kernel is queued behind it only if the
                    // whole next kernel fits the bound. Taken for done, a 1-10 ms kernel
                    // that ran past its 5.5 ms estimate had the next queued behind it, and a
                    // latency request met both (4.4 ms of best-effort work on the mean where
                    // the one in flight had 3.4 left).
                    if outstanding > 0.0 {
                        left_to_run = left_to_run.max(1.0);
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
mod tests;
