//! The process's session with the arbiter: lazy connection, reservations with memory credit,
//! one-way releases, the pressure channel, reconnection with `Redeclare`, and the policy while
//! the arbiter is down.
//!
//! Behaviour while the arbiter is unreachable (documented in docs/interposer.md):
//! - an allocation waits up to [`Policy::outage_wait`] (5 s) for the arbiter to come back,
//!   retrying with backoff, then fails with `CUDA_ERROR_OUT_OF_MEMORY`;
//! - a free never waits: it is applied locally, and the `Redeclare` sent on reconnection
//!   carries the bytes this process still holds, so the new arbiter's ledger is exact;
//! - a background watcher notices the arbiter closing the socket (restart, crash) and
//!   reconnects on its own, so an idle process's memory is re-declared too;
//! - memory queries answer from the last known limit and use without waiting; with no limit
//!   known yet they wait like an allocation, then fail.
//! - an arbiter that refuses the token fails allocations at once (no waiting) and is retried
//!   after a pause.
//!
//! Credit: `held` is what the arbiter counts for this process; `credit` is the part of it
//! that is not allocated (frees not announced, and room granted ahead of need). An allocation
//! no larger than the credit takes it locally (one compare-and-swap, no round trip); a free
//! adds to it (one atomic add, no system call). A larger allocation puts all the credit
//! towards its request (`ReserveCredit { bytes: request - credit, extra }`), so the arbiter is
//! asked only for what is missing, plus a granule of credit for the next ones. So that credit
//! never causes a false out-of-memory in a sibling process, each process subscribes a second
//! connection as its *pressure channel*: before refusing anyone, the arbiter sends `Pressure`
//! there, and the watcher thread answers at once with `Relinquish`, giving back every unused
//! byte. A pressed process keeps no credit for a while ([`PRESSED_FOR`]); an idle one returns
//! its credit after a quiet tick; the watcher returns credit above [`Session::keep`] after the
//! release delay.

use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};
use tessera_protocol::{TenantReply, TenantRequest};

use crate::conn::{Conn, ConnError};
use crate::tlog;

/// Timing of the session.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// How long an allocation waits for an unreachable arbiter before failing.
    pub outage_wait: Duration,
    /// Bound on one request/reply exchange; past it the connection is dropped.
    pub rpc_timeout: Duration,
    /// First pause between connection attempts.
    pub backoff_min: Duration,
    /// Longest pause between connection attempts.
    pub backoff_max: Duration,
    /// Pause before retrying after the arbiter refused the token.
    pub refused_pause: Duration,
    /// Start a watcher thread that reconnects after the arbiter closes the socket, flushes
    /// deferred releases and answers pressure. Without it, every free sends its `Release` at
    /// once and the process holds no credit.
    pub watch: bool,
    /// Longest time a free above the kept credit waits before its `Release` is sent.
    pub release_delay: Duration,
    /// How often the watcher looks at an idle process; credit untouched for a whole tick is
    /// given back.
    pub tick: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            outage_wait: Duration::from_secs(5),
            rpc_timeout: Duration::from_secs(3),
            backoff_min: Duration::from_millis(5),
            backoff_max: Duration::from_millis(200),
            refused_pause: Duration::from_secs(1),
            watch: true,
            release_delay: Duration::from_millis(1),
            tick: Duration::from_millis(100),
        }
    }
}

/// How long after a `Pressure` the process asks for no credit and keeps none: its siblings
/// need the room.
pub const PRESSED_FOR: Duration = Duration::from_millis(50);

/// The `seq` of a `Relinquish` that answers no `Pressure` (credit given back on the process's
/// own initiative).
pub const UNASKED: u64 = 0;

/// Smallest and largest credit granule (what a round trip asks for on top of the request).
const GRANULE_MIN: u64 = 2 << 20;
const GRANULE_MAX: u64 = 512 << 20;

/// The credit granule of an allocation with `limit` bytes: 1/32 of it, within bounds.
pub fn granule(limit: u64) -> u64 {
    (limit / 32).clamp(GRANULE_MIN, GRANULE_MAX)
}

/// Why a reservation was not granted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// The arbiter refused: the allocation's limit would be passed.
    #[error("limit reached: {in_use} of {limit} bytes in use")]
    Denied {
        /// The allocation's limit.
        limit: u64,
        /// Bytes in use across the allocation.
        in_use: u64,
    },
    /// No arbiter answered in time, or it refused this process.
    #[error("arbiter unavailable")]
    Unavailable,
}

struct Link {
    conn: Option<Conn>,
    next_attempt: Instant,
    backoff: Duration,
    refused: bool,
    ever_connected: bool,
    /// Incremented on every new connection, so the watcher can tell them apart.
    generation: u64,
    warned_down: bool,
    watcher_started: bool,
}

/// The process's arbiter session. One per process; a forked child gets a fresh one.
pub struct Session {
    socket: Option<PathBuf>,
    token: String,
    policy: Policy,
    link: Mutex<Link>,
    /// Bytes the arbiter counts for this process (allocated plus credit).
    held: AtomicU64,
    /// Unused part of `held`: frees not announced and room granted ahead of need.
    credit: AtomicU64,
    conn_fd: AtomicI32,
    limit: AtomicU64,
    limit_known: AtomicBool,
    last_in_use: AtomicU64,
    /// The watcher's eventfd (-1 until it runs): a free that finds the watcher armed wakes it.
    wake_fd: AtomicI32,
    /// True while the watcher waits and no wake-up is on its way.
    armed: AtomicBool,
    /// `Link::generation`, readable without the lock (the watcher checks it every round).
    generation: AtomicU64,
    /// The pressure channel (read and written by the watcher only, set up under the link lock).
    channel: Mutex<Option<Conn>>,
    /// Its socket, -1 without one: credit is kept only while a channel can give it back.
    channel_fd: AtomicI32,
    /// When the last `Pressure` came, ms since `origin` (0: never).
    pressed_ms: AtomicU64,
    /// Set when an answer on the channel may or may not have reached the arbiter: the watcher
    /// then drops the memory connection, so the reconnection's `Redeclare` is exact.
    reset_memory_conn: AtomicBool,
    /// `Relinquish` frames sent on the current pressure channel.
    given_back: AtomicU64,
    origin: Instant,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

/// What one locked step of a request decided.
enum Step<R> {
    Done(R),
    Fail(SessionError),
    Wait(Instant),
}

impl Session {
    /// A session that will connect to `socket` with `token` on first use.
    pub fn new(socket: Option<PathBuf>, token: String, policy: Policy) -> Self {
        Self {
            socket,
            token,
            policy,
            link: Mutex::new(Link {
                conn: None,
                next_attempt: Instant::now(),
                backoff: policy.backoff_min,
                refused: false,
                ever_connected: false,
                generation: 0,
                warned_down: false,
                watcher_started: false,
            }),
            held: AtomicU64::new(0),
            credit: AtomicU64::new(0),
            conn_fd: AtomicI32::new(-1),
            limit: AtomicU64::new(0),
            limit_known: AtomicBool::new(false),
            last_in_use: AtomicU64::new(0),
            wake_fd: AtomicI32::new(-1),
            armed: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            channel: Mutex::new(None),
            channel_fd: AtomicI32::new(-1),
            pressed_ms: AtomicU64::new(0),
            reset_memory_conn: AtomicBool::new(false),
            given_back: AtomicU64::new(0),
            origin: Instant::now(),
        }
    }

    /// Bytes this process has allocated (held at the arbiter, less unused credit).
    pub fn held(&self) -> u64 {
        self.held
            .load(Ordering::Acquire)
            .saturating_sub(self.credit.load(Ordering::Acquire))
    }

    /// Unused credit: bytes the arbiter counts for this process that it has not allocated.
    pub fn credit(&self) -> u64 {
        self.credit.load(Ordering::Acquire)
    }

    /// The allocation's limit, if a `Welcome` was ever received.
    pub fn known_limit(&self) -> Option<u64> {
        self.limit_known
            .load(Ordering::Acquire)
            .then(|| self.limit.load(Ordering::Acquire))
    }

    /// True while a connection is open.
    pub fn connected(&self) -> bool {
        self.conn_fd.load(Ordering::Acquire) >= 0
    }

    /// True while a pressure channel is open (credit can be given back on demand).
    pub fn has_channel(&self) -> bool {
        self.channel_fd.load(Ordering::Acquire) >= 0
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64 + 1
    }

    /// True within [`PRESSED_FOR`] of a `Pressure` (the watcher clears the mark afterwards,
    /// so the free path reads no clock).
    fn pressed_recently(&self) -> bool {
        self.pressed_ms.load(Ordering::Relaxed) != 0
    }

    fn pressure_expired(&self) -> bool {
        let at = self.pressed_ms.load(Ordering::Relaxed);
        at != 0 && self.now_ms().saturating_sub(at) >= PRESSED_FOR.as_millis() as u64
    }

    /// Credit this process keeps after frees (more is given back after the release delay):
    /// two granules while it has a pressure channel and was not pressed lately, else none.
    pub fn keep(&self) -> u64 {
        if !self.has_channel() || self.pressed_recently() {
            return 0;
        }
        2 * granule(self.limit.load(Ordering::Relaxed))
    }

    /// Credit asked for on top of a request that makes a round trip.
    fn extra(&self) -> u64 {
        if !self.has_channel() || self.pressed_recently() {
            return 0;
        }
        granule(self.limit.load(Ordering::Relaxed))
    }

    /// Reserves `bytes`: locally from the credit when it covers them, else at the arbiter
    /// (one round trip, the credit counted towards the request). Waits for an unreachable
    /// arbiter up to the outage bound. Returns the allocation's bytes in use as last reported
    /// by the arbiter.
    pub fn reserve(&'static self, bytes: u64) -> Result<u64, SessionError> {
        if self.take_credit(bytes) {
            return Ok(self.last_in_use.load(Ordering::Acquire));
        }
        self.request(true, |s, link| {
            // All the credit goes towards this request: the arbiter is asked for the rest.
            let credit = s.credit.swap(0, Ordering::SeqCst);
            if credit >= bytes {
                // Frees of other threads arrived meanwhile.
                s.credit.fetch_add(credit - bytes, Ordering::SeqCst);
                return Some(Ok(s.last_in_use.load(Ordering::Acquire)));
            }
            let need = bytes - credit;
            let extra = s.extra();
            let req = if s.has_channel() {
                let given_back = s.given_back.load(Ordering::Acquire);
                TenantRequest::ReserveCredit {
                    bytes: need,
                    extra,
                    given_back,
                }
            } else {
                TenantRequest::Reserve { bytes: need }
            };
            let conn = link.conn.as_mut().expect("connected");
            let answer = conn.call(&req);
            let granted = match &answer {
                Ok(TenantReply::Reserved { in_use }) => Some((need, *in_use)),
                Ok(TenantReply::Granted { bytes: g, in_use }) if *g >= need => Some((*g, *in_use)),
                _ => None,
            };
            if let Some((g, in_use)) = granted {
                s.held.fetch_add(g, Ordering::SeqCst);
                let credit = s.credit.fetch_add(g - need, Ordering::SeqCst) + g - need;
                // What is allocated, as far as this process knows (its own credit is not).
                let in_use = in_use.saturating_sub(credit);
                s.last_in_use.store(in_use, Ordering::Release);
                return Some(Ok(in_use));
            }
            // Not granted: the credit is still ours.
            s.credit.fetch_add(credit, Ordering::SeqCst);
            match answer {
                Ok(TenantReply::Denied { limit, in_use }) => {
                    s.last_in_use.store(in_use, Ordering::Release);
                    Some(Err(SessionError::Denied { limit, in_use }))
                }
                Ok(TenantReply::Error { message }) => {
                    tlog!(Warn, "arbiter could not reserve {need} bytes: {message}");
                    Some(Err(SessionError::Unavailable))
                }
                Ok(other) => {
                    tlog!(Warn, "unexpected reply to {req:?}: {other:?}");
                    None
                }
                Err(e) => {
                    tlog!(Info, "arbiter connection lost during Reserve: {e}");
                    None
                }
            }
        })?
    }

    /// Takes `bytes` out of the credit when it covers them (one compare-and-swap): the arbiter
    /// already counts them for this process, so the allocation needs no round trip and the
    /// limit still holds exactly. A free followed by an allocation of no more than it freed
    /// (what frameworks' caching allocators do) thus costs no round trip at all.
    fn take_credit(&self, bytes: u64) -> bool {
        let mut credit = self.credit.load(Ordering::SeqCst);
        while bytes > 0 && credit >= bytes {
            match self.credit.compare_exchange_weak(
                credit,
                credit - bytes,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return true,
                Err(now) => credit = now,
            }
        }
        false
    }

    /// Returns `bytes` (a free, or a failed driver call): one atomic add, never waits, never
    /// fails. The bytes become credit; what exceeds [`Session::keep`] is announced by the
    /// watcher within the release delay. While disconnected it is applied locally and the
    /// reconnection's `Redeclare` reflects it.
    pub fn release(&'static self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let credit = self.credit.fetch_add(bytes, Ordering::SeqCst) + bytes;
        if self.pressed_recently() && self.give_back_now() {
            // Another process of the allocation waits for room: it gets these bytes now, not
            // after the release delay (and not this process's next allocation first).
            return;
        }
        let fd = self.wake_fd.load(Ordering::Acquire);
        if fd < 0 {
            // No watcher: send now.
            self.try_flush();
        } else if credit > self.keep() && self.armed.swap(false, Ordering::AcqRel) {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a live u64 to the watcher's eventfd.
            let _ = unsafe { libc::write(fd, (&raw const one).cast(), 8) };
        }
    }

    /// Gives all the credit back at once on the pressure channel (one `send`, no wait); false
    /// when the channel is busy or gone (the watcher then does it).
    fn give_back_now(&self) -> bool {
        let Some(mut channel) = self.channel.try_lock() else {
            return false;
        };
        let Some(ch) = channel.as_mut() else {
            return false;
        };
        let bytes = self.drop_credit_above(0);
        if bytes == 0 {
            return true;
        }
        let sent = ch.send_nowait(&TenantRequest::Relinquish {
            seq: UNASKED,
            bytes,
        });
        if sent.is_ok() {
            self.given_back.fetch_add(1, Ordering::AcqRel);
            return true;
        }
        // Not announced: still ours; the watcher gives them back (it may wait for the socket).
        self.held.fetch_add(bytes, Ordering::SeqCst);
        self.credit.fetch_add(bytes, Ordering::SeqCst);
        if let Err(e) = sent
            && !matches!(e, ConnError::WouldBlock)
        {
            tlog!(Info, "pressure channel lost: {e}");
            *channel = None;
            self.channel_fd.store(-1, Ordering::Release);
        }
        false
    }

    /// The allocation's `(limit, in_use)`, exact: this process's credit is given back first
    /// and the arbiter takes back the other processes' before it answers. Asks the arbiter
    /// when connected; otherwise answers from the last known values without waiting; waits
    /// only while no limit is known yet.
    pub fn mem_info(&'static self) -> Option<(u64, u64)> {
        let asked = self.request(false, |s, link| {
            let release = s.drop_credit();
            let conn = link.conn.as_mut().expect("connected");
            match conn.call_after_release(release, &TenantRequest::MemInfo) {
                Ok(TenantReply::MemInfo { limit, in_use }) => {
                    s.limit.store(limit, Ordering::Release);
                    s.limit_known.store(true, Ordering::Release);
                    s.last_in_use.store(in_use, Ordering::Release);
                    Some((limit, in_use))
                }
                Ok(other) => {
                    tlog!(Warn, "unexpected reply to MemInfo: {other:?}");
                    None
                }
                Err(e) => {
                    tlog!(Info, "arbiter connection lost during MemInfo: {e}");
                    None
                }
            }
        });
        if let Ok(v) = asked {
            return Some(v);
        }
        if let Some(limit) = self.known_limit() {
            let in_use = self.last_in_use.load(Ordering::Acquire).max(self.held());
            return Some((limit, in_use));
        }
        // Nothing known yet: wait like an allocation would.
        self.limit()
            .map(|l| (l, self.last_in_use.load(Ordering::Acquire).max(self.held())))
    }

    /// The allocation's limit; connects (waiting up to the outage bound) if none is known.
    pub fn limit(&'static self) -> Option<u64> {
        if let Some(l) = self.known_limit() {
            return Some(l);
        }
        self.request(true, |_, _| Some(())).ok()?;
        self.known_limit()
    }

    /// A one-use ticket from this process's memory connection (connecting it if needed, one
    /// attempt), for the lease connection to present as a [`tessera_protocol::Role::Companion`]:
    /// tied to the admitted memory connection, it does not meet the arbiter's caps again.
    pub fn companion_ticket(&'static self) -> Option<u64> {
        self.request(false, |_, link| {
            let conn = link.conn.as_mut()?;
            match conn.call(&TenantRequest::Ticket) {
                Ok(TenantReply::Ticket { ticket }) => Some(Some(ticket)),
                Ok(_) => Some(None),
                Err(_) => None,
            }
        })
        .ok()
        .flatten()
    }

    /// Runs `op` on a connected link, reconnecting as needed. `op` returns `None` when the
    /// connection broke (it is dropped and the request retried). With `wait`, an unreachable
    /// arbiter is waited for up to the outage bound; without, one attempt is made.
    fn request<R>(
        &'static self,
        wait: bool,
        mut op: impl FnMut(&'static Self, &mut Link) -> Option<R>,
    ) -> Result<R, SessionError> {
        let deadline = Instant::now() + self.policy.outage_wait;
        loop {
            let step = self.with_link(|link| {
                let now = Instant::now();
                if !self.ensure_connected(link, now) {
                    if link.refused {
                        return Step::Fail(SessionError::Unavailable);
                    }
                    return Step::Wait(link.next_attempt);
                }
                match op(self, link) {
                    Some(r) => Step::Done(r),
                    None => {
                        self.drop_conn(link);
                        Step::Wait(link.next_attempt)
                    }
                }
            });
            match step {
                Step::Done(r) => return Ok(r),
                Step::Fail(e) => return Err(e),
                Step::Wait(at) => {
                    let now = Instant::now();
                    if !wait || now >= deadline {
                        return Err(SessionError::Unavailable);
                    }
                    let until = at.min(deadline);
                    std::thread::sleep(
                        until
                            .saturating_duration_since(now)
                            .max(Duration::from_millis(1)),
                    );
                }
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Link> {
        // No poisoning: a panic inside the lock leaves consistent data (every update is a
        // single store).
        self.link.lock()
    }

    /// Runs `f` under the link lock. Without a watcher, pending releases are flushed after.
    fn with_link<R>(&'static self, f: impl FnOnce(&mut Link) -> R) -> R {
        let mut link = self.lock();
        let r = f(&mut link);
        drop(link);
        if self.wake_fd.load(Ordering::Acquire) < 0 {
            self.try_flush();
        }
        r
    }

    /// Announces credit above what is kept if the lock is free; otherwise its holder will.
    fn try_flush(&'static self) {
        while self.credit.load(Ordering::SeqCst) > self.keep() {
            let Some(mut link) = self.link.try_lock() else {
                return;
            };
            self.flush_locked(&mut link, self.keep());
        }
    }

    /// Takes all the credit out of `held`; returns it (the bytes to announce, if connected).
    fn drop_credit(&self) -> u64 {
        let bytes = self.credit.swap(0, Ordering::SeqCst);
        if bytes > 0 {
            self.held.fetch_sub(bytes, Ordering::SeqCst);
        }
        bytes
    }

    /// Takes the credit above `keep` out of `held`; returns it.
    fn drop_credit_above(&self, keep: u64) -> u64 {
        let mut credit = self.credit.load(Ordering::SeqCst);
        loop {
            if credit <= keep {
                return 0;
            }
            match self.credit.compare_exchange_weak(
                credit,
                keep,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => {
                    let bytes = credit - keep;
                    self.held.fetch_sub(bytes, Ordering::SeqCst);
                    return bytes;
                }
                Err(now) => credit = now,
            }
        }
    }

    /// Sends the credit above `keep` back, now: on the pressure channel when there is one (an
    /// unasked `Relinquish`), so that it reaches the arbiter before any answer to a later
    /// `Pressure` does; a refusal elsewhere must not race with bytes still in flight on
    /// another socket. Otherwise as a `Release` on the memory connection.
    fn flush_locked(&'static self, link: &mut Link, keep: u64) {
        let bytes = self.drop_credit_above(keep);
        if bytes == 0 {
            return;
        }
        {
            let mut channel = self.channel.lock();
            if let Some(ch) = channel.as_mut() {
                // Blocking (bounded by the connection's timeout): a full socket means the
                // arbiter is busy, not that the bytes may be dropped.
                match ch.send_blocking(&TenantRequest::Relinquish {
                    seq: UNASKED,
                    bytes,
                }) {
                    Ok(()) => {
                        self.given_back.fetch_add(1, Ordering::AcqRel);
                        return;
                    }
                    Err(e) => {
                        // Whether the arbiter booked them is unknown (half a frame may have
                        // gone): the memory connection starts over, its `Redeclare` exact.
                        tlog!(Info, "pressure channel lost: {e}");
                        *channel = None;
                        self.channel_fd.store(-1, Ordering::Release);
                        drop(channel);
                        self.drop_conn(link);
                        return;
                    }
                }
            }
        }
        if let Some(conn) = link.conn.as_mut()
            && let Err(e) = conn.send_nowait(&TenantRequest::Release { bytes })
        {
            tlog!(Info, "arbiter connection lost during Release: {e}");
            self.drop_conn(link);
        }
    }

    fn drop_conn(&self, link: &mut Link) {
        // Closing is all the arbiter needs to release this connection's ledger (credit too).
        link.conn = None;
        self.conn_fd.store(-1, Ordering::Release);
        self.close_channel();
        let now = Instant::now();
        link.next_attempt = now + link.backoff.min(self.policy.backoff_min);
    }

    fn close_channel(&self) {
        self.channel_fd.store(-1, Ordering::Release);
        *self.channel.lock() = None;
    }

    /// Connects if needed (respecting the backoff); on a new connection re-declares what is
    /// allocated and opens the pressure channel.
    fn ensure_connected(&'static self, link: &mut Link, now: Instant) -> bool {
        if link.conn.is_some() {
            return true;
        }
        if now < link.next_attempt {
            return false;
        }
        let Some(path) = self.socket.as_deref() else {
            if !link.refused {
                match crate::config::get().closed_reason() {
                    Some(e) => tlog!(
                        Error,
                        "cannot prove this process's allocation ({e}): every allocation is refused and every launch fails"
                    ),
                    None => tlog!(
                        Error,
                        "no tenant socket to prove this process's allocation to: every allocation is refused and every launch fails"
                    ),
                }
            }
            link.refused = true;
            link.next_attempt = now + self.policy.refused_pause;
            return false;
        };
        // Credit died with the old connection: only what is allocated is re-declared.
        self.drop_credit();
        let held = self.held.load(Ordering::SeqCst);
        let attempt = Conn::connect(path, &self.token, Some(self.policy.rpc_timeout)).and_then(
            |(mut conn, view)| {
                if held > 0 {
                    match conn.call(&TenantRequest::Redeclare { bytes: held })? {
                        TenantReply::Reserved { in_use } => {
                            self.last_in_use.store(in_use, Ordering::Release)
                        }
                        other => {
                            return Err(ConnError::Frame(format!("Redeclare answered {other:?}")));
                        }
                    }
                }
                Ok((conn, view))
            },
        );
        match attempt {
            Ok((mut conn, view)) => {
                self.limit.store(view.memory_limit, Ordering::Release);
                self.limit_known.store(true, Ordering::Release);
                if self.policy.watch {
                    self.open_channel(path, &mut conn);
                }
                self.conn_fd.store(conn.fd(), Ordering::Release);
                if link.ever_connected {
                    tlog!(Info, "reconnected to the arbiter; re-declared {held} bytes");
                } else {
                    tlog!(
                        Debug,
                        "connected to the arbiter: allocation {} limit {}",
                        view.id,
                        view.memory_limit
                    );
                }
                link.conn = Some(conn);
                link.generation += 1;
                self.generation.store(link.generation, Ordering::Release);
                link.backoff = self.policy.backoff_min;
                link.refused = false;
                link.warned_down = false;
                link.ever_connected = true;
                if self.policy.watch && !link.watcher_started {
                    link.watcher_started = self.start_watcher();
                }
                true
            }
            Err(ConnError::Refused(reason)) => {
                tlog!(Error, "arbiter refused this process: {reason}");
                link.refused = true;
                link.next_attempt = now + self.policy.refused_pause;
                false
            }
            Err(e) => {
                if !link.warned_down {
                    tlog!(Warn, "arbiter unreachable ({e}); retrying");
                    link.warned_down = true;
                }
                link.refused = false;
                link.next_attempt = now + link.backoff;
                link.backoff = (link.backoff * 2).min(self.policy.backoff_max);
                false
            }
        }
    }

    /// Opens the pressure channel for memory connection `mem`: a ticket on `mem`, a second
    /// connection that subscribes with it. Done before any credit is taken, so every byte of
    /// credit can be pressed back. Without it the process simply keeps no credit.
    fn open_channel(&self, path: &std::path::Path, mem: &mut Conn) {
        self.close_channel();
        let opened = (|| {
            let ticket = match mem.call(&TenantRequest::Ticket)? {
                TenantReply::Ticket { ticket } => ticket,
                other => return Err(ConnError::Frame(format!("Ticket answered {other:?}"))),
            };
            let (mut ch, _) = Conn::connect(path, &self.token, Some(self.policy.rpc_timeout))?;
            ch.send_blocking(&TenantRequest::Subscribe { ticket })?;
            let mut answers = 0;
            loop {
                match ch.recv_reply()? {
                    TenantReply::Subscribed => return Ok((ch, answers)),
                    // Pressed before the answer: nothing is held as credit yet.
                    TenantReply::Pressure { seq } => {
                        ch.send_blocking(&TenantRequest::Relinquish { seq, bytes: 0 })?;
                        answers += 1;
                    }
                    other => return Err(ConnError::Frame(format!("Subscribe answered {other:?}"))),
                }
            }
        })();
        match opened {
            Ok((ch, answers)) => {
                self.given_back.store(answers, Ordering::Release);
                self.channel_fd.store(ch.fd(), Ordering::Release);
                *self.channel.lock() = Some(ch);
            }
            Err(e) => tlog!(
                Info,
                "no pressure channel ({e}); this process keeps no memory credit"
            ),
        }
    }

    /// Answers every `Pressure` waiting on the channel: all unused credit goes back at once.
    fn answer_pressure(&'static self) {
        let mut guard = self.channel.lock();
        let Some(ch) = guard.as_mut() else { return };
        loop {
            let seq = match ch.recv_reply() {
                Ok(TenantReply::Pressure { seq }) => seq,
                Ok(other) => {
                    tlog!(Warn, "unexpected frame on the pressure channel: {other:?}");
                    break;
                }
                Err(e) => {
                    tlog!(Info, "pressure channel lost: {e}");
                    break;
                }
            };
            self.pressed_ms.store(self.now_ms(), Ordering::Relaxed);
            let bytes = self.drop_credit();
            // Blocking (bounded by the connection's timeout): the answer must not be lost.
            let sent = ch.send_blocking(&TenantRequest::Relinquish { seq, bytes });
            if sent.is_ok() {
                self.given_back.fetch_add(1, Ordering::AcqRel);
            }
            if let Err(e) = sent {
                tlog!(Info, "pressure channel lost while relinquishing: {e}");
                // Whether the arbiter booked them is unknown: the memory connection is
                // re-established, and its `Redeclare` makes the ledger exact again.
                self.reset_memory_conn.store(true, Ordering::Release);
                break;
            }
            if !ch.has_buffered_frame() && !wait_readable(ch.fd(), Duration::ZERO) {
                return;
            }
        }
        // A broken channel: the process keeps no credit until the next connection opens one.
        *guard = None;
        self.channel_fd.store(-1, Ordering::Release);
    }

    /// One round of the watcher thread: waits up to the tick for a free above the kept credit
    /// or a `Pressure`; answers pressure at once; announces credit above what is kept after
    /// the release delay; gives back credit left untouched for a whole tick; checks (without
    /// waiting on it) whether the arbiter closed the socket, and reconnects (and re-declares)
    /// if so.
    ///
    /// The memory socket itself is only polled with a zero timeout: a thread blocked in `poll`
    /// on it would be woken by every frame that passes (two context switches per request).
    pub fn watch_once(&'static self) {
        #[cfg(test)]
        if tests::PANIC_IN_WATCHER
            .compare_exchange(
                self as *const Self as usize,
                0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            panic!("injected: a panic in the watcher");
        }
        let generation = self.generation.load(Ordering::Acquire);
        let before = self.credit.load(Ordering::SeqCst);
        // Arm before looking at the credit: a free after this point wakes us again.
        self.armed.store(true, Ordering::Release);
        if self.pressure_expired() {
            self.pressed_ms.store(0, Ordering::Relaxed);
        }
        let (woken, mut pressed) = if before > self.keep() {
            (true, false)
        } else {
            wait_either(
                self.wake_fd.load(Ordering::Acquire),
                self.channel_fd.load(Ordering::Acquire),
                self.policy.tick,
            )
        };
        if pressed {
            self.answer_pressure();
        }
        if self.reset_memory_conn.swap(false, Ordering::AcqRel) {
            let mut link = self.lock();
            self.drop_conn(&mut link);
        }
        if woken {
            self.drain_wake_fd();
            // Give the process the chance to allocate the freed bytes again; a pressure that
            // comes meanwhile is answered at once.
            let end = Instant::now() + self.policy.release_delay;
            loop {
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                (_, pressed) = wait_either(-1, self.channel_fd.load(Ordering::Acquire), left);
                if pressed {
                    self.answer_pressure();
                }
            }
            if self.credit.load(Ordering::SeqCst) > self.keep() {
                let mut link = self.lock();
                self.flush_locked(&mut link, self.keep());
            }
        } else if !pressed && before > 0 && self.credit.load(Ordering::SeqCst) == before {
            // Quiet for a whole tick: an idle process holds no credit.
            let mut link = self.lock();
            self.flush_locked(&mut link, 0);
        }
        let fd = self.conn_fd.load(Ordering::Acquire);
        if hung_up(fd) {
            let mut link = self.lock();
            if link.generation == generation && link.conn.is_some() {
                tlog!(Info, "arbiter closed the connection");
                self.drop_conn(&mut link);
            }
        }
        // Connected (the common case): nothing to do, and no lock taken.
        let reconnected = self.conn_fd.load(Ordering::Acquire) >= 0 || {
            let mut link = self.lock();
            !link.ever_connected
                || link.conn.is_some()
                || self.ensure_connected(&mut link, Instant::now())
        };
        if !reconnected {
            std::thread::sleep(self.policy.tick.min(self.policy.backoff_max));
        }
    }

    fn drain_wake_fd(&self) {
        let fd = self.wake_fd.load(Ordering::Acquire);
        if fd >= 0 {
            let mut v = 0u64;
            // SAFETY: reading 8 bytes into a live u64 from our non-blocking eventfd.
            let _ = unsafe { libc::read(fd, (&raw mut v).cast(), 8) };
        }
    }

    /// Starts the thread that flushes deferred releases, answers pressure and notices the
    /// arbiter closing the socket (so an idle process's memory is re-declared after an arbiter
    /// restart).
    fn start_watcher(&'static self) -> bool {
        // SAFETY: eventfd has no memory preconditions.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            tlog!(
                Warn,
                "cannot create the watcher's eventfd; frees send their release at once"
            );
        }
        let spawned = std::thread::Builder::new()
            .name("tessera-watch".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                // A panic mid-look leaves nothing half-done that matters: the link's lock is
                // released on unwind, and `watcher_died` then gives every byte of credit back.
                let look =
                    || std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.watch_once()));
                while look().is_ok() {}
                self.watcher_died();
            });
        match spawned {
            Ok(_) => {
                // Frees defer their release only once the watcher runs.
                self.wake_fd.store(efd, Ordering::Release);
                true
            }
            Err(_) => {
                tlog!(
                    Warn,
                    "cannot start the watcher thread; reconnection waits for the next call"
                );
                if efd >= 0 {
                    // SAFETY: our own eventfd, never published.
                    unsafe { libc::close(efd) };
                }
                // Nobody would answer pressure: keep no credit.
                self.close_channel();
                false
            }
        }
    }

    /// The watcher thread panicked: nobody answers pressure or flushes deferred releases any
    /// more, so the process keeps no credit. The channel is closed (which makes [`Self::keep`]
    /// 0), frees send their releases at once from now on, and the credit held is given back.
    fn watcher_died(&'static self) {
        tlog!(
            Error,
            "the watcher thread failed: this process now keeps no memory credit (every free is announced at once)"
        );
        let fd = self.wake_fd.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: our own eventfd; no one reads it any more (frees see -1 from now on).
            unsafe { libc::close(fd) };
        }
        self.close_channel();
        self.try_flush();
    }

    /// In a forked child: close the inherited sockets without sending anything on them, so
    /// the parent's connections (and ledger) are left untouched.
    pub fn abandon_in_child(&self) {
        for fd in [
            self.conn_fd.swap(-1, Ordering::AcqRel),
            self.wake_fd.swap(-1, Ordering::AcqRel),
            self.channel_fd.swap(-1, Ordering::AcqRel),
        ] {
            if fd >= 0 {
                // SAFETY: `fd` is this session's socket or eventfd, inherited through fork; the
                // parent keeps its own copy. The objects owning the numbers are leaked, never
                // used again.
                unsafe { libc::close(fd) };
            }
        }
    }
}

/// Waits up to `tick` for `wake` or `chan` to become readable (negative fds are ignored; with
/// neither it just sleeps). Returns which were readable.
fn wait_either(wake: RawFd, chan: RawFd, tick: Duration) -> (bool, bool) {
    if wake < 0 && chan < 0 {
        std::thread::sleep(tick);
        return (false, false);
    }
    let mut pfd = [
        libc::pollfd {
            fd: wake,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: chan,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let ms = tick.as_millis().min(i32::MAX as u128) as i32;
    // Sub-millisecond waits round up so the release delay is not a busy loop.
    let ms = if ms == 0 && !tick.is_zero() { 1 } else { ms };
    // SAFETY: `pfd` is a valid pollfd array of length 2; negative fds are ignored by poll.
    let n = unsafe { libc::poll(pfd.as_mut_ptr(), 2, ms) };
    if n <= 0 {
        return (false, false);
    }
    let ready = |p: &libc::pollfd| {
        p.fd >= 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
    };
    (ready(&pfd[0]), ready(&pfd[1]))
}

/// True when `fd` is readable now.
fn wait_readable(fd: RawFd, tick: Duration) -> bool {
    wait_either(-1, fd, tick).1
}

/// True when the peer of socket `fd` has closed it (checked without waiting).
fn hung_up(fd: RawFd) -> bool {
    if fd < 0 {
        return false;
    }
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `pfd` is a valid pollfd array of length 1; a zero timeout never blocks. A stale
    // fd number at worst reports another file's state; the caller re-checks the generation.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock_arbiter::{MockArbiter, TOKEN};

    fn policy(outage_ms: u64, watch: bool) -> Policy {
        Policy {
            outage_wait: Duration::from_millis(outage_ms),
            rpc_timeout: Duration::from_secs(2),
            backoff_min: Duration::from_millis(2),
            backoff_max: Duration::from_millis(20),
            refused_pause: Duration::from_millis(200),
            watch,
            release_delay: Duration::from_millis(1),
            tick: Duration::from_millis(100),
        }
    }

    fn session(path: &std::path::Path, token: &str, p: Policy) -> &'static Session {
        Box::leak(Box::new(Session::new(
            Some(path.to_owned()),
            token.to_owned(),
            p,
        )))
    }

    #[test]
    fn reserve_deny_release() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        let s = session(&sock, TOKEN, policy(500, false));
        assert!(!s.connected(), "lazy: nothing before the first call");
        assert_eq!(arb.connections(), 0);
        assert_eq!(s.reserve(600), Ok(600));
        assert_eq!(s.known_limit(), Some(1000));
        assert_eq!(
            s.reserve(600),
            Err(SessionError::Denied {
                limit: 1000,
                in_use: 600
            })
        );
        assert_eq!(s.held(), 600);
        s.release(600);
        assert_eq!(s.held(), 0);
        arb.wait_for("release", |a| a.in_use() == 0);
        assert_eq!(s.reserve(600), Ok(600));
        assert_eq!(s.mem_info(), Some((1000, 600)));
        // One connection for all of it, and frees were one-way frames.
        assert_eq!(arb.connections(), 1);
        let log = arb.log();
        assert!(log.contains(&TenantRequest::Release { bytes: 600 }));
        assert_eq!(
            log.iter()
                .filter(|r| matches!(r, TenantRequest::Reserve { .. }))
                .count(),
            3
        );
    }

    #[test]
    fn outage_waits_then_redeclares() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        let s = session(&sock, TOKEN, policy(3000, false));
        s.reserve(300).unwrap();
        s.reserve(200).unwrap();
        arb.kill();
        // A free while the arbiter is down never waits.
        let t = Instant::now();
        s.release(200);
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "free waited {:?}",
            t.elapsed()
        );
        assert_eq!(s.held(), 300);
        // The arbiter comes back after 300 ms; the allocation waits for it.
        let sock2 = sock.clone();
        let back = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            MockArbiter::start(&sock2, 1000)
        });
        let t = Instant::now();
        assert_eq!(s.reserve(100), Ok(400));
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(250),
            "did not wait: {waited:?}"
        );
        let arb2 = back.join().unwrap();
        // The new arbiter's ledger is exact: 300 re-declared + 100 new.
        assert_eq!(arb2.in_use(), 400);
        assert_eq!(arb2.log()[0], TenantRequest::Redeclare { bytes: 300 });
        assert!(arb2.violations().is_empty(), "{:?}", arb2.violations());
    }

    #[test]
    fn outage_past_the_bound_fails() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("none.sock");
        let s = session(&sock, TOKEN, policy(300, false));
        let t = Instant::now();
        assert_eq!(s.reserve(1), Err(SessionError::Unavailable));
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        assert_eq!(s.mem_info(), None);
        assert_eq!(s.held(), 0);
    }

    #[test]
    fn refused_token_fails_fast() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let _arb = MockArbiter::start(&sock, 1000);
        let s = session(&sock, "wrong", policy(3000, false));
        let t = Instant::now();
        assert_eq!(s.reserve(1), Err(SessionError::Unavailable));
        assert_eq!(s.reserve(1), Err(SessionError::Unavailable));
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn token_without_socket_refuses_everything() {
        let s: &'static Session = Box::leak(Box::new(Session::new(
            None,
            TOKEN.into(),
            policy(3000, false),
        )));
        let t = Instant::now();
        assert_eq!(s.reserve(1), Err(SessionError::Unavailable));
        assert!(t.elapsed() < Duration::from_millis(500));
        assert_eq!(s.limit(), None);
    }

    /// The session whose watcher panics at its next look (its address; 0: none).
    pub(super) static PANIC_IN_WATCHER: std::sync::atomic::AtomicUsize =
        std::sync::atomic::AtomicUsize::new(0);

    #[test]
    fn a_watcher_that_panics_leaves_no_credit_and_frees_still_reach_the_arbiter() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        let s = session(&sock, TOKEN, policy(3000, true));
        s.reserve(300).unwrap();
        arb.wait_for("channel", |a| a.channels() == 1);
        PANIC_IN_WATCHER.store(s as *const Session as usize, Ordering::Release);
        // A free wakes the watcher, which panics at its next look.
        s.release(100);
        let end = Instant::now() + Duration::from_secs(5);
        while s.has_channel() {
            assert!(
                Instant::now() < end,
                "the watcher's panic left the channel open"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(
            PANIC_IN_WATCHER.load(Ordering::Acquire),
            0,
            "it never looked"
        );
        assert_eq!(s.keep(), 0, "credit kept with nobody to answer pressure");
        // What the process does not use is back at the arbiter, and frees go at once.
        arb.wait_for("credit returned", |a| a.in_use() == 200);
        s.release(150);
        arb.wait_for("a free announced at once", |a| a.in_use() == 50);
        // Allocations still work.
        s.reserve(500).unwrap();
        arb.wait_for("reserved", |a| a.in_use() >= 550);
    }

    #[test]
    fn watcher_redeclares_for_an_idle_process() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        let s = session(&sock, TOKEN, policy(3000, true));
        s.reserve(700).unwrap();
        arb.kill();
        let arb2 = MockArbiter::start(&sock, 1000);
        // No call from the process: the watcher reconnects and re-declares on its own.
        arb2.wait_for("redeclare", |a| a.in_use() == 700);
        arb2.wait_for("channel", |a| a.channels() == 1);
        assert_eq!(arb2.connections(), 1);
        assert!(s.connected());
        // Known use survives; a new reservation is counted on top.
        assert_eq!(s.reserve(300), Ok(1000));
        assert_eq!(
            s.reserve(1),
            Err(SessionError::Denied {
                limit: 1000,
                in_use: 1000
            })
        );
    }

    const MIB: u64 = 1 << 20;
    /// A 1 GiB allocation: granule 32 MiB, two granules kept.
    const GIB: u64 = 1024 * MIB;

    /// The memory requests the mock saw (the channel's set-up left out).
    fn mem_log(arb: &MockArbiter) -> Vec<TenantRequest> {
        arb.log()
            .into_iter()
            .filter(|r| !matches!(r, TenantRequest::Ticket | TenantRequest::Subscribe { .. }))
            .collect()
    }

    fn slow_flush(p: Policy) -> Policy {
        // The watcher does not announce a free before the next allocation in these tests.
        Policy {
            release_delay: Duration::from_secs(5),
            tick: Duration::from_secs(5),
            ..p
        }
    }

    #[test]
    fn a_round_trip_asks_only_for_what_the_credit_lacks_plus_a_granule() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, GIB);
        let s = session(&sock, TOKEN, slow_flush(policy(3000, true)));
        assert_eq!(granule(GIB), 32 * MIB);
        assert_eq!(s.reserve(600 * MIB), Ok(600 * MIB));
        arb.wait_for("channel", |a| a.channels() == 1);
        assert_eq!(
            mem_log(&arb),
            vec![TenantRequest::ReserveCredit {
                bytes: 600 * MIB,
                extra: 32 * MIB,
                given_back: 0
            }]
        );
        assert_eq!((s.held(), s.credit()), (600 * MIB, 32 * MIB));
        // A free becomes credit; a larger allocation puts it all towards the request.
        s.release(600 * MIB);
        assert_eq!(s.reserve(700 * MIB), Ok(700 * MIB));
        assert_eq!(
            mem_log(&arb)[1..],
            [TenantRequest::ReserveCredit {
                bytes: 68 * MIB,
                extra: 32 * MIB,
                given_back: 0
            }]
        );
        assert_eq!((s.held(), s.credit()), (700 * MIB, 32 * MIB));
        assert_eq!(arb.in_use(), 732 * MIB);
        // Credit never passes the limit: the granule is given only from free room.
        // 268 MiB missing; of the 24 MiB left, half (12) is given as credit.
        assert_eq!(s.reserve(300 * MIB), Ok(1000 * MIB));
        assert_eq!(s.credit(), 12 * MIB);
        assert_eq!(arb.in_use(), 1012 * MIB);
    }

    #[test]
    fn a_free_above_the_kept_credit_is_announced_within_the_delay_and_an_idle_process_returns_the_rest()
     {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, GIB);
        let s = session(
            &sock,
            TOKEN,
            Policy {
                // The idle return comes a tick after the free, the flush after the 1 ms
                // release delay: a tick long enough that even a loaded machine tells them apart.
                tick: Duration::from_secs(1),
                ..policy(3000, true)
            },
        );
        s.reserve(600 * MIB).unwrap();
        arb.wait_for("channel", |a| a.channels() == 1);
        let t = Instant::now();
        s.release(600 * MIB);
        // Down to the two granules kept, after the release delay and before the tick.
        arb.wait_for("flush above keep", |a| a.in_use() == 64 * MIB);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "flushed after {:?}, not within the release delay",
            t.elapsed()
        );
        assert_eq!(s.credit(), 64 * MIB);
        // Untouched for a tick: given back.
        arb.wait_for("idle return", |a| a.in_use() == 0);
        assert_eq!((s.held(), s.credit()), (0, 0));
        // Given back unasked on the pressure channel (ordered before any answer to a pressure).
        let log = mem_log(&arb);
        assert!(
            !log.iter()
                .any(|r| matches!(r, TenantRequest::Release { .. })),
            "{log:?}"
        );
        let released: u64 = log
            .iter()
            .map(|r| match r {
                TenantRequest::Relinquish {
                    seq: UNASKED,
                    bytes,
                } => *bytes,
                _ => 0,
            })
            .sum();
        assert_eq!(released, 632 * MIB);
    }

    #[test]
    fn concurrent_frees_and_reserves_stay_exact() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1 << 40);
        let s = session(&sock, TOKEN, policy(3000, true));
        let threads: Vec<_> = (0..8)
            .map(|i| {
                std::thread::spawn(move || {
                    for j in 0..500u64 {
                        let bytes = (1 + (i + j) % 5) * MIB;
                        s.reserve(bytes).unwrap();
                        s.release(bytes);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(s.held(), 0);
        // The credit goes back once the process is idle; what the arbiter counts balances.
        arb.wait_for("all releases", |a| a.in_use() == 0);
        assert_eq!(s.credit(), 0);
        // Never more released than held, on either connection.
        assert!(arb.violations().is_empty(), "{:?}", arb.violations());
    }

    fn count(log: &[TenantRequest], f: impl Fn(&TenantRequest) -> bool) -> usize {
        log.iter().filter(|r| f(r)).count()
    }

    fn is_reserve(r: &TenantRequest) -> bool {
        matches!(
            r,
            TenantRequest::Reserve { .. } | TenantRequest::ReserveCredit { .. }
        )
    }

    #[test]
    fn free_then_alloc_of_no_more_is_taken_from_the_credit_without_a_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, GIB);
        let s = session(&sock, TOKEN, slow_flush(policy(3000, true)));
        s.reserve(600 * MIB).unwrap();
        assert_eq!(mem_log(&arb).len(), 1);
        // Free then allocate the same size: no request at all, the arbiter still counts it.
        s.release(600 * MIB);
        assert_eq!(s.held(), 0);
        s.reserve(600 * MIB).unwrap();
        assert_eq!(s.held(), 600 * MIB);
        assert_eq!(
            mem_log(&arb).len(),
            1,
            "local reservation reached the arbiter: {:?}",
            arb.log()
        );
        assert_eq!(arb.in_use(), 632 * MIB);
        // A smaller one, and one within the granule, are local too.
        s.release(600 * MIB);
        s.reserve(400 * MIB).unwrap();
        s.reserve(232 * MIB).unwrap();
        assert_eq!((s.held(), s.credit()), (632 * MIB, 0));
        assert_eq!(mem_log(&arb).len(), 1);
        // The credit never grants past the limit: the arbiter's count covers it.
        assert_eq!(
            s.reserve(393 * MIB),
            Err(SessionError::Denied {
                limit: GIB,
                in_use: 632 * MIB
            })
        );
        assert_eq!((s.held(), s.credit()), (632 * MIB, 0));
        assert_eq!(count(&mem_log(&arb), is_reserve), 2);
    }

    #[test]
    fn mem_info_is_exact_with_credit_held() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, GIB);
        let s = session(&sock, TOKEN, slow_flush(policy(3000, true)));
        s.reserve(500 * MIB).unwrap();
        s.reserve(300 * MIB).unwrap();
        s.release(500 * MIB);
        s.reserve(200 * MIB).unwrap(); // local: credit left
        assert_eq!(count(&mem_log(&arb), is_reserve), 2);
        assert!(s.credit() > 0);
        // The query gives the credit back first, so the answer is what is allocated.
        assert_eq!(s.mem_info(), Some((GIB, 500 * MIB)));
        assert_eq!(arb.in_use(), 500 * MIB);
        assert_eq!((s.held(), s.credit()), (500 * MIB, 0));
        assert_eq!(arb.log().last(), Some(&TenantRequest::MemInfo));
    }

    #[test]
    fn pressure_takes_every_unused_byte_back_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, GIB);
        // An idle tick of 1 s: long enough not to return the credit during the test, short
        // enough to see the pressed mark wear off.
        let s = session(
            &sock,
            TOKEN,
            Policy {
                tick: Duration::from_secs(1),
                ..slow_flush(policy(3000, true))
            },
        );
        s.reserve(300 * MIB).unwrap();
        s.reserve(100 * MIB).unwrap();
        s.release(300 * MIB);
        arb.wait_for("channel", |a| a.channels() == 1);
        let credit = s.credit();
        assert!(credit >= 300 * MIB);
        let t = Instant::now();
        assert_eq!(arb.press_all(7), credit);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "answered after {:?}",
            t.elapsed()
        );
        assert_eq!(arb.in_use(), 100 * MIB);
        assert_eq!((s.held(), s.credit()), (100 * MIB, 0));
        // Pressed lately: no credit asked for or kept.
        assert_eq!(s.keep(), 0);
        s.reserve(50 * MIB).unwrap();
        assert_eq!(
            mem_log(&arb).last(),
            Some(&TenantRequest::ReserveCredit {
                bytes: 50 * MIB,
                extra: 0,
                given_back: 1
            })
        );
        // A second pressure with nothing to give answers 0.
        assert_eq!(arb.press_all(8), 0);
        // The pressed mark wears off: credit again.
        let t = Instant::now();
        while s.keep() == 0 {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the pressed mark never wore off"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(t.elapsed() >= PRESSED_FOR - Duration::from_millis(20));
    }

    #[test]
    fn no_credit_without_a_pressure_channel() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, GIB);
        // No watcher: nobody could answer pressure, so nothing is held ahead of need.
        let s = session(&sock, TOKEN, policy(3000, false));
        s.reserve(100 * MIB).unwrap();
        assert_eq!(s.credit(), 0);
        assert_eq!(arb.channels(), 0);
        s.release(100 * MIB);
        arb.wait_for("release", |a| a.in_use() == 0);
        assert_eq!(
            mem_log(&arb),
            vec![
                TenantRequest::Reserve { bytes: 100 * MIB },
                TenantRequest::Release { bytes: 100 * MIB }
            ]
        );
    }

    #[test]
    fn netted_bytes_are_redeclared_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        // The watcher, woken by the free, sleeps the release delay before it looks at the socket.
        let s = session(
            &sock,
            TOKEN,
            Policy {
                release_delay: Duration::from_millis(300),
                ..policy(3000, true)
            },
        );
        s.reserve(400).unwrap();
        s.reserve(100).unwrap();
        s.release(400);
        s.reserve(250).unwrap(); // netted: 150 pending, 350 live
        arb.kill();
        let arb2 = MockArbiter::start(&sock, 1000);
        // The watcher reconnects and re-declares exactly what is live.
        arb2.wait_for("redeclare", |a| a.connections() == 1 && a.in_use() == 350);
        assert_eq!(arb2.log()[0], TenantRequest::Redeclare { bytes: 350 });
        assert_eq!(s.held(), 350);
        assert_eq!(s.reserve(650), Ok(1000));
        assert!(arb2.violations().is_empty(), "{:?}", arb2.violations());
    }
}
