//! The lease manager: the thread that runs each lease, and the launcher side that obtains one.
//! All I/O of a lease happens here (the arbiter connection, the driver's events through
//! [`Events`], the clock, the gate's counters); every decision is the state machine's
//! ([`Leases`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tessera_protocol::{Role, TenantReply, TenantRequest};

use super::events::{DriverEvents, Events, Query};
use super::gate::{Begun, Gate, MAX_STREAMS, Manage, StreamKind};
use super::lease::{Action, Leases, Load, Observation, WaitMode};
use crate::conn::{Conn, ConnError};
use crate::ffi::*;
use crate::tlog;

/// Longest wait for a grant before the arbiter is considered wedged.
const GRANT_TIMEOUT: Duration = Duration::from_secs(60);
/// First and longest pause between attempts while the arbiter does not admit the lease
/// connection.
const NOT_ADMITTED_BACKOFF_MIN: Duration = Duration::from_millis(5);
const NOT_ADMITTED_BACKOFF_MAX: Duration = Duration::from_millis(200);

/// What opening the lease connection found.
enum Link {
    Up,
    /// The socket cannot be connected: the arbiter is down (local leases).
    Down,
    /// The arbiter is there and did not admit it (retry; no local lease).
    NotAdmitted(ConnError),
}

/// Longest the lease-end drain waits for the streams before reporting anyway.
const DRAIN_BOUND: Duration = Duration::from_secs(2);

/// One sample event on a stream.
struct Sample {
    ev: CUevent,
    ctx: CUcontext,
    /// The stream's launch count when it was recorded.
    launches: u64,
    /// The previous sample was still pending when this one was recorded: the stream was busy
    /// all the time in between, so the elapsed time is GPU time.
    backlogged: bool,
}

/// What the manager knows of one slot.
#[derive(Default)]
struct Track {
    generation: u64,
    pending: VecDeque<Sample>,
    last_done: Option<Sample>,
    /// Launch count up to which the work is known complete.
    completed: u64,
    /// Launch count at the last recorded sample.
    sampled: u64,
    /// Estimated GPU ns per launch (0: unknown).
    est_ns: f64,
    /// When the manager first saw the stream in use (bounds the first sample's cost).
    first_seen: Option<u64>,
    /// The stream's launch count when the current lease began.
    lease_start: u64,
    /// (launches known complete, when a look first saw that with more in flight): the
    /// oldest launch in flight has run since then at least.
    head: Option<(u64, u64)>,
}

/// What one look at the lease's streams found.
struct Seen {
    total: u64,
    credits: i64,
    drained: bool,
    waiters: u32,
}

pub(super) struct Manager<E: Events> {
    gate: &'static Gate,
    /// Leases are local ones (the arbiter could not be reached).
    local: bool,
    /// The lease rules and what they learnt.
    leases: Leases,
    events: E,
    conn: Option<Conn>,
    tracks: Vec<Track>,
    pool: HashMap<usize, Vec<CUevent>>,
    current_ctx: CUcontext,
}

// SAFETY: driver handles (contexts, events) are process-wide and valid on any thread; the one
// thread-bound piece, `current_ctx` (the context current on the thread that set it), is only
// set and read by the manager thread (`set_ctx`); launchers holding the `mgr` lock only talk to
// the arbiter and hand out credits.
unsafe impl<E: Events + Send> Send for Manager<E> {}

/// What a grant from the arbiter asks of its holder, beside its id and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Terms {
    /// `LeaseGranted`: the lease's time left bounds the work in flight.
    Plain,
    /// `LeaseGrantedBounded`: at most this much predicted kernel time in flight, ns.
    Bounded(u64),
    /// `LeaseGrantedLatency`: see [`Leases::grant_latency`].
    Latency,
}

/// The process's lease manager, for [`Gate`]'s constructor.
pub(super) fn new_manager(gate: &'static Gate, events: DriverEvents) -> Box<dyn Manage> {
    Box::new(Manager::new(gate, events))
}

impl<E: Events + Send> Manage for Manager<E> {
    fn acquire_and_begin(&mut self, asked: u64) -> Begun {
        let grant = self.acquire();
        match (grant.is_some(), self.local) {
            (true, true) => {
                tlog!(Info, "arbiter back: leases come from it again");
                self.local = false;
            }
            (false, false) => {
                tlog!(
                    Warn,
                    "arbiter unreachable: local leases keep launches bounded until it is back"
                );
                self.local = true;
            }
            _ => {}
        }
        self.begin(grant, asked)
    }

    fn run_lease(&mut self, begun: Begun) {
        self.run(begun);
    }
}

impl<E: Events> Manager<E> {
    pub(super) fn new(gate: &'static Gate, events: E) -> Self {
        Self {
            gate,
            local: false,
            leases: Leases::default(),
            events,
            conn: None,
            tracks: (0..MAX_STREAMS).map(|_| Track::default()).collect(),
            pool: HashMap::new(),
            current_ctx: std::ptr::null_mut(),
        }
    }

    /// Opens the lease connection: as a companion of the process's admitted memory connection
    /// (a ticket from it) when there is one, else with the token alone.
    fn connect(&mut self) -> Link {
        if self.conn.is_some() {
            return Link::Up;
        }
        let Some(path) = self.gate.socket.as_deref() else {
            return Link::Down;
        };
        let token = self.gate.token.clone();
        let role = match (self.gate.companion)() {
            Some(ticket) => Role::Companion { token, ticket },
            None => Role::Tenant { token },
        };
        match Conn::connect_as(path, role, Some(GRANT_TIMEOUT)) {
            Ok((c, _)) => {
                self.gate.lease_fd.store(c.fd(), Ordering::Release);
                self.conn = Some(c);
                Link::Up
            }
            // Nothing listens there: the arbiter is down.
            Err(e @ ConnError::Connect { .. }) => {
                tlog!(Info, "lease connection: {e}");
                Link::Down
            }
            // It is there but did not admit this connection (closed it during the handshake,
            // or refused it).
            Err(e) => Link::NotAdmitted(e),
        }
    }

    fn drop_conn(&mut self) {
        self.conn = None;
        self.gate.lease_fd.store(-1, Ordering::Release);
    }

    /// Asks for a lease; `None` when the arbiter is down (its socket cannot be connected), or
    /// answers a lease request with something else. An arbiter that is up but does not admit
    /// the lease connection (a flood filling its caps, a handshake cut short) is retried with
    /// backoff while the launch waits: a local lease then would be GPU time outside any lease
    /// of the arbiter's, which its backstop charges and kills for.
    fn acquire(&mut self) -> Option<(u64, u64, Terms)> {
        let mut backoff = NOT_ADMITTED_BACKOFF_MIN;
        let mut warned = false;
        let mut broken = 0u32;
        loop {
            match self.connect() {
                Link::Up => {}
                Link::Down => return None,
                Link::NotAdmitted(e) => {
                    if !warned {
                        tlog!(
                            Warn,
                            "lease connection not admitted ({e}): launches wait and retry"
                        );
                        warned = true;
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(NOT_ADMITTED_BACKOFF_MAX);
                    continue;
                }
            }
            if warned {
                tlog!(Info, "lease connection admitted");
                warned = false;
            }
            let conn = self.conn.as_mut().expect("connected");
            // Tiered: this interposer reads a latency holder's grant (`LeaseGrantedLatency`).
            let mut reply = conn.call(&TenantRequest::LeaseAcquireTiered);
            // A revocation of a lease already over (sent while this process drained it) may
            // come before the answer: it is stale.
            while let Ok(TenantReply::LeaseRevoked { .. }) = reply {
                reply = conn.recv_reply();
            }
            match reply {
                Ok(TenantReply::LeaseGranted {
                    lease_id,
                    duration_ns,
                }) => return Some((lease_id, duration_ns, Terms::Plain)),
                Ok(TenantReply::LeaseGrantedBounded {
                    lease_id,
                    duration_ns,
                    max_inflight_ns,
                }) => return Some((lease_id, duration_ns, Terms::Bounded(max_inflight_ns))),
                Ok(TenantReply::LeaseGrantedLatency {
                    lease_id,
                    duration_ns,
                }) => return Some((lease_id, duration_ns, Terms::Latency)),
                Ok(other) => {
                    tlog!(Warn, "unexpected answer to LeaseAcquire: {other:?}");
                    self.drop_conn();
                    return None;
                }
                // A broken connection (arbiter restarted, or evicted): a fresh one, after a
                // pause from the second time on.
                Err(ConnError::Closed) => {
                    self.drop_conn();
                    broken += 1;
                    if broken > 1 {
                        std::thread::sleep(backoff);
                        backoff = (backoff * 2).min(NOT_ADMITTED_BACKOFF_MAX);
                    }
                }
                Err(ConnError::Io(e)) if broken == 0 => {
                    tlog!(Info, "LeaseAcquire: {e}; reconnecting");
                    self.drop_conn();
                    broken += 1;
                }
                Err(e) => {
                    tlog!(Warn, "LeaseAcquire failed: {e}");
                    self.drop_conn();
                    return None;
                }
            }
        }
    }
}

// ---- the driver's side: the context, events on each stream, their samples -------------

impl<E: Events> Manager<E> {
    fn set_ctx(&mut self, ctx: CUcontext) -> bool {
        if self.current_ctx == ctx {
            return true;
        }
        // SAFETY: `ctx` is a context a launching thread had current.
        if !unsafe { self.events.set_context(ctx) } {
            return false;
        }
        self.current_ctx = ctx;
        true
    }

    fn event(&mut self, ctx: CUcontext) -> Option<CUevent> {
        if let Some(ev) = self.pool.get_mut(&(ctx as usize)).and_then(Vec::pop) {
            return Some(ev);
        }
        if !self.set_ctx(ctx) {
            return None;
        }
        // SAFETY: the context is current on this thread.
        unsafe { self.events.create() }
    }

    fn recycle(&mut self, s: Sample) {
        self.pool.entry(s.ctx as usize).or_default().push(s.ev);
    }

    /// Records an event on slot `i`'s stream (the legacy stream for default streams).
    fn record(&mut self, i: usize) -> Option<Sample> {
        let gate = self.gate;
        let slot = &gate.slots[i];
        let ctx = slot.ctx.load(Ordering::Relaxed);
        let kind = slot.kind.load(Ordering::Relaxed);
        if kind == u8::MAX {
            return None;
        }
        let handle = if kind == StreamKind::Explicit as u8 {
            slot.handle.load(Ordering::Relaxed)
        } else {
            0
        };
        // SAFETY: a stream the table lock keeps alive (the caller holds it).
        if handle != 0 && unsafe { self.events.is_capturing(handle as CUstream) } {
            return None;
        }
        let ev = self.event(ctx)?;
        if !self.set_ctx(ctx) {
            return None;
        }
        let launches = slot.launches.load(Ordering::Acquire);
        // SAFETY: our event, and a stream the table lock keeps alive (or the legacy stream).
        if !unsafe { self.events.record(ev, handle as CUstream) } {
            // SAFETY: our own event.
            unsafe { self.events.destroy(ev) };
            return None;
        }
        Some(Sample {
            ev,
            ctx,
            launches,
            backlogged: false,
        })
    }

    /// Polls slot `i`'s samples at `now`; updates what is complete and the per-launch estimate.
    fn poll(&mut self, i: usize, lease_start: u64, now: u64) {
        loop {
            let Some(front) = self.tracks[i].pending.front() else {
                return;
            };
            // SAFETY: our own recorded event.
            match unsafe { self.events.query(front.ev) } {
                Query::Done => {}
                Query::NotReady => return,
                Query::Failed => {
                    let s = self.tracks[i].pending.pop_front().expect("front");
                    self.recycle(s);
                    continue;
                }
            }
            let s = self.tracks[i].pending.pop_front().expect("front");
            let t = &mut self.tracks[i];
            let n = s.launches.saturating_sub(t.completed);
            if n > 0 {
                let per = match &t.last_done {
                    // SAFETY: two completed events of our own on the same stream.
                    Some(prev) => unsafe { self.events.elapsed_ms(prev.ev, s.ev) }
                        .map(|ms| f64::from(ms.max(0.0)) * 1e6 / n as f64),
                    // First sample on this stream: the time since it was first seen bounds it.
                    None => Some(
                        now.saturating_sub(t.first_seen.unwrap_or(lease_start)) as f64 / n as f64,
                    ),
                };
                if let Some(per) = per {
                    t.est_ns = if t.est_ns == 0.0 {
                        per
                    } else if s.backlogged {
                        0.7 * t.est_ns + 0.3 * per
                    } else {
                        // Idle time may hide in the interval: it only bounds the estimate.
                        t.est_ns.min(per)
                    };
                }
            }
            t.completed = t.completed.max(s.launches);
            let prev = t.last_done.replace(s);
            if let Some(prev) = prev {
                self.recycle(prev);
            }
        }
    }

    /// Indices of the slots used during this lease (marked with its epoch, or launched on since
    /// it began: a thread that looked its stream up just before the lease started still
    /// launches under it), with their tracks in step.
    fn used(&mut self, epoch: u64, now: u64) -> Vec<usize> {
        let mut v = Vec::new();
        for (i, s) in self.gate.slots.iter().enumerate() {
            if !s.in_use.load(Ordering::Acquire) {
                continue;
            }
            let generation = s.generation.load(Ordering::Acquire);
            let fresh = self.tracks[i].generation != generation;
            let launched = s.launches.load(Ordering::Acquire);
            let marked = s.used_epoch.load(Ordering::Acquire) == epoch;
            if !marked && (fresh || launched == self.tracks[i].lease_start) {
                continue;
            }
            if fresh {
                let old = std::mem::take(&mut self.tracks[i]);
                for smp in old.pending.into_iter().chain(old.last_done) {
                    self.recycle(smp);
                }
                self.tracks[i].generation = generation;
                let b = s.base.load(Ordering::Acquire);
                self.tracks[i].completed = b;
                self.tracks[i].sampled = b;
                self.tracks[i].lease_start = b;
            }
            if self.tracks[i].first_seen.is_none() {
                self.tracks[i].first_seen = Some(now);
            }
            v.push(i);
        }
        v
    }
}

// ---- a lease's turn: its start, each look, the waits between, a revocation ---------------

impl<E: Events> Manager<E> {
    /// Starts a lease (on the launcher that received it): `grant` from the arbiter, or `None`
    /// for a local one; a new epoch, and its first credits. No driver call: the context cache
    /// belongs to the manager thread.
    fn begin(&mut self, grant: Option<(u64, u64, Terms)>, asked: u64) -> Begun {
        let now = self.gate.now_ns();
        self.gate.stats.leases.fetch_add(1, Ordering::Relaxed);
        // A new epoch: streams re-register (fresh capture check, "used in this lease" mark).
        let epoch = self.gate.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        for (t, slot) in self.tracks.iter_mut().zip(self.gate.slots.iter()) {
            // Work of earlier leases was drained: start from what has been launched.
            t.sampled = t.sampled.max(t.completed);
            t.lease_start = slot.launches.load(Ordering::Acquire);
        }
        let started = match grant {
            Some((id, d, Terms::Latency)) => self.leases.grant_latency((id, d), asked, now),
            Some((id, d, Terms::Bounded(bound))) => {
                self.leases
                    .grant_bounded(Some((id, d)), Some(bound), asked, now)
            }
            Some((id, d, Terms::Plain)) => {
                self.leases.grant_bounded(Some((id, d)), None, asked, now)
            }
            None => self.leases.grant_bounded(None, None, asked, now),
        };
        self.gate.set_credits(started.first);
        Begun { started, epoch }
    }

    /// Samples the streams used in lease `epoch` (started at `start`) at `now`; `loads` gets
    /// what each has in flight.
    fn look(&mut self, epoch: u64, start: u64, now: u64, loads: &mut Vec<Load>) -> Seen {
        // The look runs at the deadline too: a drain seen then still makes the release say the
        // holder is idle. Read before the counts: with no launcher between credit and count
        // then, every launch made so far is in them.
        let launching = self.gate.launching.load(Ordering::Acquire) > 0;
        let used = {
            let _t = self.gate.lock_table();
            let used = self.used(epoch, now);
            for &i in &used {
                self.poll(i, start, now);
                let l = self.gate.slots[i].launches.load(Ordering::Acquire);
                if l > self.tracks[i].sampled
                    && self.tracks[i].pending.len() < 4
                    && let Some(mut smp) = self.record(i)
                {
                    smp.backlogged = !self.tracks[i].pending.is_empty();
                    self.tracks[i].sampled = smp.launches;
                    self.tracks[i].pending.push_back(smp);
                    // A stream already idle completes it at once: the drain is seen now, not
                    // a tick later.
                    self.poll(i, start, now);
                }
            }
            used
        };
        let launches = |i: usize| self.gate.slots[i].launches.load(Ordering::Acquire);
        let total: u64 = used.iter().map(|&i| launches(i)).sum();
        let credits = self.gate.credits.load(Ordering::Acquire);
        let drained = !launching
            && used.iter().all(|&i| {
                let t = &self.tracks[i];
                t.pending.is_empty() && t.completed >= launches(i)
            });
        loads.clear();
        for &i in &used {
            let t = &mut self.tracks[i];
            let in_flight = self.gate.slots[i]
                .launches
                .load(Ordering::Acquire)
                .saturating_sub(t.completed);
            // The oldest launch in flight started by the first look that saw it launched with
            // all before it complete: from then on it has run at least that long.
            let running_ns = if in_flight == 0 {
                t.head = None;
                0.0
            } else {
                let since = match t.head {
                    Some((head, since)) if head == t.completed => since,
                    _ => {
                        t.head = Some((t.completed, now));
                        now
                    }
                };
                now.saturating_sub(since) as f64
            };
            loads.push(Load {
                in_flight,
                est_ns: t.est_ns,
                running_ns,
            });
        }
        Seen {
            total,
            credits,
            drained,
            waiters: self.gate.waiters(),
        }
    }

    /// Waits up to `wait` on the manager condition variable; `watch`: a returning synchronise
    /// wakes it. Whether a synchronise did.
    fn sleep(&self, wait: Duration, watch: bool) -> bool {
        let gate = self.gate;
        let mut sh = gate.lock_shared();
        if watch && !sh.synced {
            gate.watch.store(true, Ordering::Release);
        }
        if !sh.synced {
            sh = gate
                .manager
                .wait_timeout(sh, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let synced = sh.synced;
        sh.synced = false;
        gate.watch.store(false, Ordering::Release);
        synced
    }

    /// Runs a begun lease to its end (on the manager thread): performs what the lease rules
    /// ask, feeding back what it saw.
    fn run(&mut self, begun: Begun) {
        let Begun { started, epoch } = begun;
        let mut action = self.leases.take_over(started, self.gate.now_ns());
        let drain_idle = self.leases.drain_idle().unwrap_or_default();
        let mut sync_wakes = 0u64;
        let mut looked = 0u64;
        let mut loads = Vec::new();
        loop {
            action = match action {
                Action::Wait { tick, mode } => {
                    let deadline = self.leases.deadline().unwrap_or_default();
                    let wait =
                        Duration::from_nanos(deadline.saturating_sub(self.gate.now_ns())).min(tick);
                    match mode {
                        WaitMode::Spin { handed } => self.spin(wait, handed),
                        _ if wait.is_zero() => {}
                        mode => {
                            if self.sleep(wait, mode == WaitMode::Watch) {
                                sync_wakes += 1;
                            }
                        }
                    }
                    looked = self.gate.now_ns();
                    self.check_revoked(looked);
                    let seen = self.look(epoch, started.start, looked, &mut loads);
                    let obs = Observation::Look {
                        total: seen.total,
                        credits: seen.credits,
                        drained: seen.drained,
                        waiters: seen.waiters,
                        streams: &loads,
                    };
                    self.leases.step(obs, looked)
                }
                Action::Refill { credits } => {
                    let previous = self.gate.set_credits(credits);
                    // At the look's time: what it saw is what the refill answers.
                    self.leases.step(Observation::Refilled { previous }, looked)
                }
                Action::Stop(_) => {
                    let previous = self.gate.set_credits(0);
                    let waiters = self.gate.waiters();
                    let obs = Observation::Stopped { previous, waiters };
                    self.leases.step(obs, self.gate.now_ns())
                }
                Action::Drain => {
                    self.drain(epoch);
                    let waiters = self.gate.waiters();
                    self.leases
                        .step(Observation::Drained { waiters }, self.gate.now_ns())
                }
                Action::Release {
                    lease_id,
                    busy_ns,
                    early,
                } => {
                    self.release(lease_id, busy_ns, early);
                    tlog!(
                        Debug,
                        "lease {lease_id:?}: {:.1} ms granted, busy {:.1} ms, early {early}, synchronise wakes {sync_wakes}, drain wait {} us",
                        started.duration_ns as f64 / 1e6,
                        busy_ns as f64 / 1e6,
                        drain_idle.as_micros()
                    );
                    return;
                }
            };
        }
    }

    /// Reads a revocation the arbiter sent (without blocking): the lease ends at this look.
    /// One `recv` per look on this thread; launches never pay for it.
    fn check_revoked(&mut self, now: u64) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        match conn.try_recv_reply() {
            Ok(None) => {}
            Ok(Some(TenantReply::LeaseRevoked { lease_id })) => {
                if self.leases.revoke(lease_id, now) {
                    tlog!(Debug, "lease {lease_id} revoked for a latency request");
                }
            }
            Ok(Some(other)) => {
                tlog!(Warn, "unexpected frame during a lease: {other:?}");
                self.drop_conn();
            }
            Err(e) => {
                // The arbiter went away: it ended the lease; the next acquire reconnects.
                tlog!(Info, "lease connection: {e}");
                self.drop_conn();
            }
        }
    }
}

// ---- a lease's end: the report, the hand-over spin, the drain -----------------------------

impl<E: Events> Manager<E> {
    /// Counts the lease and reports it to the arbiter (a local lease is only counted).
    fn release(&mut self, lease_id: Option<u64>, busy_ns: u64, early: bool) {
        let stats = &self.gate.stats;
        if early {
            stats.early.fetch_add(1, Ordering::Relaxed);
        }
        stats.busy_ns.fetch_add(busy_ns, Ordering::Relaxed);
        if let Some(lease_id) = lease_id
            && let Some(conn) = self.conn.as_mut()
            && let Err(e) = conn.send_nowait(&TenantRequest::LeaseRelease {
                lease_id,
                busy_ns,
                early,
            })
        {
            tlog!(Info, "LeaseRelease not sent: {e}");
            self.drop_conn();
        }
    }

    /// Spins for up to `wait` (at most a few hundred microseconds), until then or until a
    /// launch takes a credit (or finds none: a waiter), whichever comes first. It never calls
    /// `sched_yield`: under CPU load that gives away a whole time slice (measured: hand-over
    /// p50 3.4 ms).
    fn spin(&self, wait: Duration, handed: i64) {
        let until = Instant::now() + wait;
        while Instant::now() < until && self.gate.credits.load(Ordering::Acquire) == handed {
            std::hint::spin_loop();
        }
    }

    /// Lets launches that took a credit before it dropped to zero return from the driver,
    /// records an end event on every stream of the lease, and polls them until they completed
    /// (at most [`DRAIN_BOUND`]).
    fn drain(&mut self, epoch: u64) {
        let total = |m: &mut Self| -> u64 {
            let _t = m.gate.lock_table();
            let used = m.used(epoch, m.gate.now_ns());
            used.iter()
                .map(|&i| m.gate.slots[i].launches.load(Ordering::Acquire))
                .sum()
        };
        // Launchers that hold a credit of this lease launch first (their kernels are this
        // lease's), then the count settles.
        let bound = Instant::now() + DRAIN_BOUND;
        while self.gate.launching.load(Ordering::Acquire) > 0 && Instant::now() < bound {
            std::thread::sleep(Duration::from_micros(50));
        }
        let settle = Instant::now() + Duration::from_millis(2);
        let mut seen = total(self);
        while Instant::now() < settle {
            std::thread::sleep(Duration::from_micros(50));
            let now = total(self);
            if now == seen {
                break;
            }
            seen = now;
        }
        let mut ends = Vec::new();
        {
            let _t = self.gate.lock_table();
            for i in self.used(epoch, self.gate.now_ns()) {
                if let Some(s) = self.record(i) {
                    ends.push((i, s));
                }
            }
        }
        let bound = Instant::now() + DRAIN_BOUND;
        let mut sleep = Duration::from_micros(50);
        loop {
            // SAFETY: our own recorded events.
            let all = ends
                .iter()
                .all(|(_, s)| unsafe { self.events.query(s.ev) } != Query::NotReady);
            if all || Instant::now() >= bound {
                break;
            }
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(Duration::from_micros(400));
        }
        for (i, s) in ends {
            let launches = s.launches;
            let stale: Vec<Sample> = self.tracks[i].pending.drain(..).collect();
            let prev = self.tracks[i].last_done.replace(s);
            let t = &mut self.tracks[i];
            t.completed = t.completed.max(launches);
            t.sampled = t.sampled.max(launches);
            for p in stale.into_iter().chain(prev) {
                self.recycle(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::events::FakeEvents;

    const MS: u64 = 1_000_000;
    const STREAM: usize = 0x5000;

    fn manager() -> (&'static Gate, Manager<FakeEvents>) {
        let gate: &'static Gate = Box::leak(Box::new(Gate::new(None, "t".into())));
        (gate, Manager::new(gate, FakeEvents::default()))
    }

    /// `n` launches on `STREAM` (slot `i`) returned from the driver.
    fn launch(gate: &Gate, m: &Manager<FakeEvents>, i: usize, n: u64) {
        gate.slots[i].launches.fetch_add(n, Ordering::AcqRel);
        m.events.submit(STREAM, n);
    }

    #[test]
    fn samples_measure_the_per_launch_time_and_see_the_drain() {
        let (gate, mut m) = manager();
        let begun = m.begin(None, 0);
        assert_eq!(gate.credits.load(Ordering::Relaxed), 1, "one probe launch");
        let epoch = begun.epoch;
        let i = gate.use_stream(STREAM, 0x77usize as CUcontext, epoch);
        launch(gate, &m, i, 4);
        let mut loads = Vec::new();
        let seen = m.look(epoch, 0, 0, &mut loads);
        assert!(!seen.drained);
        assert_eq!(seen.total, 4);
        assert_eq!(
            loads,
            [Load {
                in_flight: 4,
                est_ns: 0.0,
                running_ns: 0.0
            }]
        );
        // Completed, seen 8 ms after the stream was first seen: the first sample can only
        // bound the cost (2 ms a launch).
        m.events.complete(STREAM, 4, 2.0);
        // A launcher holding a credit, its launch not counted yet (descheduled between the
        // two): no drain, whatever the streams say; once it is counted, the drain.
        gate.launching.fetch_add(1, Ordering::AcqRel);
        let seen = m.look(epoch, 0, 8 * MS, &mut loads);
        assert!(!seen.drained, "a launch in progress was taken for a drain");
        gate.launching.fetch_sub(1, Ordering::AcqRel);
        let seen = m.look(epoch, 0, 8 * MS, &mut loads);
        assert!(seen.drained);
        assert_eq!(
            loads,
            [Load {
                in_flight: 0,
                est_ns: 2e6,
                running_ns: 0.0
            }]
        );
        // Four more, done 4 ms of GPU time later: 1 ms a launch lowers the bound.
        launch(gate, &m, i, 4);
        let seen = m.look(epoch, 0, 9 * MS, &mut loads);
        assert!(!seen.drained);
        // Seen at 9 ms with all before it complete, the oldest has run 0.5 ms by 9.5 ms.
        m.look(epoch, 0, 9 * MS + MS / 2, &mut loads);
        assert_eq!(loads[0].running_ns, 0.5e6);
        m.events.complete(STREAM, 8, 6.0);
        m.look(epoch, 0, 10 * MS, &mut loads);
        assert_eq!(
            loads,
            [Load {
                in_flight: 0,
                est_ns: 1e6,
                running_ns: 0.0
            }]
        );
        // A third sample reuses the first one's event.
        launch(gate, &m, i, 1);
        m.look(epoch, 0, 11 * MS, &mut loads);
        assert_eq!(
            m.events.counts(),
            (2, 0, 3),
            "(created, destroyed, recorded)"
        );
    }

    #[test]
    fn the_drain_records_an_end_event_on_every_stream_and_catches_up() {
        let (gate, mut m) = manager();
        let epoch = m.begin(None, 0).epoch;
        let i = gate.use_stream(STREAM, 0x77usize as CUcontext, epoch);
        launch(gate, &m, i, 3);
        let mut loads = Vec::new();
        m.look(epoch, 0, 0, &mut loads);
        launch(gate, &m, i, 2);
        m.events.complete(STREAM, 5, 1.0);
        m.drain(epoch);
        let t = &m.tracks[i];
        assert_eq!(
            (t.completed, t.sampled),
            (5, 5),
            "the end event covers every launch"
        );
        assert!(
            t.pending.is_empty(),
            "the stale sample went back to the pool"
        );
        assert_eq!(m.pool.values().map(Vec::len).sum::<usize>(), 1);
        let (created, _, recorded) = m.events.counts();
        assert_eq!((created, recorded), (2, 2));
    }

    #[test]
    fn an_unused_lease_is_handed_back_early_by_the_manager() {
        let (gate, mut m) = manager();
        let begun = m.begin(None, gate.now_ns());
        m.run(begun);
        assert_eq!(gate.credits.load(Ordering::Relaxed), 0, "credits withdrawn");
        assert_eq!(gate.stats.leases.load(Ordering::Relaxed), 1);
        assert_eq!(
            gate.stats.early.load(Ordering::Relaxed),
            1,
            "handed back early"
        );
        assert!(gate.stats.busy_ns.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn a_synchronise_cuts_a_watched_wait_short() {
        let (gate, m) = manager();
        let t = std::thread::spawn(move || {
            while !gate.watch.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            gate.synchronised();
        });
        let begun = Instant::now();
        assert!(
            m.sleep(Duration::from_secs(60), true),
            "woken by the synchronise"
        );
        // Woken, not timed out: well before the minute (one-sided, no machine is that slow).
        assert!(begun.elapsed() < Duration::from_secs(30));
        assert!(!gate.watch.load(Ordering::Acquire), "no longer watching");
        t.join().unwrap();
        // Unwatched, a synchronise does not wake it.
        gate.synchronised();
        assert!(!m.sleep(Duration::from_millis(1), false));
    }
}
