//! The process's session with the arbiter: lazy connection, reservations, one-way releases,
//! reconnection with `Redeclare`, and the policy while the arbiter is down.
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
//! Locking: `held` changes only under the link lock, which also serialises frames on the
//! socket. A free takes no lock and makes no system call on its own: it adds to
//! `pending_release`. The next request carries the pending `Release` in the same `send`, and
//! the watcher thread flushes it on its own within [`Policy::release_delay`] (1 ms) when no
//! request comes, so the arbiter's ledger lags a free by at most about a millisecond.
//!
//! Netting: an allocation covered by releases not announced yet takes its bytes out of
//! `pending_release` and makes no request: the arbiter still counts those bytes for this
//! connection, so its ledger never falls below what is live.

use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

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
    /// Start a watcher thread that reconnects after the arbiter closes the socket and flushes
    /// deferred releases. Without it, every free sends its `Release` at once.
    pub watch: bool,
    /// Longest time a free's `Release` waits for a request to ride along with.
    pub release_delay: Duration,
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
        }
    }
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
    /// Bytes this process holds as the arbiter should see them.
    held: u64,
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
    pending_release: AtomicU64,
    conn_fd: AtomicI32,
    limit: AtomicU64,
    limit_known: AtomicBool,
    last_in_use: AtomicU64,
    held_view: AtomicU64,
    /// The watcher's eventfd (-1 until it runs): a free that finds the watcher armed wakes it.
    wake_fd: AtomicI32,
    /// True while the watcher waits and no wake-up is on its way.
    armed: AtomicBool,
    /// `Link::generation`, readable without the lock (the watcher checks it every round).
    generation: AtomicU64,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("socket", &self.socket).finish_non_exhaustive()
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
                held: 0,
                next_attempt: Instant::now(),
                backoff: policy.backoff_min,
                refused: false,
                ever_connected: false,
                generation: 0,
                warned_down: false,
                watcher_started: false,
            }),
            pending_release: AtomicU64::new(0),
            conn_fd: AtomicI32::new(-1),
            limit: AtomicU64::new(0),
            limit_known: AtomicBool::new(false),
            last_in_use: AtomicU64::new(0),
            held_view: AtomicU64::new(0),
            wake_fd: AtomicI32::new(-1),
            armed: AtomicBool::new(false),
            generation: AtomicU64::new(0),
        }
    }

    /// Bytes this process holds (reserved and not yet released).
    pub fn held(&self) -> u64 {
        self.held_view.load(Ordering::Acquire)
            .saturating_sub(self.pending_release.load(Ordering::Acquire))
    }

    /// The allocation's limit, if a `Welcome` was ever received.
    pub fn known_limit(&self) -> Option<u64> {
        self.limit_known.load(Ordering::Acquire).then(|| self.limit.load(Ordering::Acquire))
    }

    /// True while a connection is open.
    pub fn connected(&self) -> bool {
        self.conn_fd.load(Ordering::Acquire) >= 0
    }

    /// Reserves `bytes`: at the arbiter (one round trip), or locally when this process freed at
    /// least as much and has not announced it yet (see [`Session::net_pending`]). Waits for an
    /// unreachable arbiter up to the outage bound. Returns the allocation's bytes in use as last
    /// reported by the arbiter (after a netted reservation: the last known figure, which
    /// already counted the reused bytes).
    pub fn reserve(&'static self, bytes: u64) -> Result<u64, SessionError> {
        if self.net_pending(bytes) {
            return Ok(self.last_in_use.load(Ordering::Acquire));
        }
        self.request(true, |s, link| {
            let release = s.take_pending(link);
            let conn = link.conn.as_mut().expect("connected");
            match conn.call_after_release(release, &TenantRequest::Reserve { bytes }) {
                Ok(TenantReply::Reserved { in_use }) => {
                    link.held = link.held.saturating_add(bytes);
                    s.held_view.store(link.held, Ordering::Release);
                    s.last_in_use.store(in_use, Ordering::Release);
                    Some(Ok(in_use))
                }
                Ok(TenantReply::Denied { limit, in_use }) => {
                    s.last_in_use.store(in_use, Ordering::Release);
                    Some(Err(SessionError::Denied { limit, in_use }))
                }
                Ok(TenantReply::Error { message }) => {
                    tlog!(Warn, "arbiter could not reserve {bytes} bytes: {message}");
                    Some(Err(SessionError::Unavailable))
                }
                Ok(other) => {
                    tlog!(Warn, "unexpected reply to Reserve: {other:?}");
                    None
                }
                Err(e) => {
                    tlog!(Info, "arbiter connection lost during Reserve: {e}");
                    None
                }
            }
        })?
    }

    /// Netting: when the releases this process has not announced yet cover `bytes`, takes
    /// `bytes` out of them and grants the reservation without asking the arbiter. The arbiter
    /// still counts those bytes as held by this connection (their `Release` was never sent),
    /// so its ledger stays at least what is live and the limit holds exactly; `held` rises by
    /// `bytes` as `pending_release` falls. A free followed by an allocation of no more than
    /// it freed (what frameworks' caching allocators do) thus costs no round trip at all.
    fn net_pending(&self, bytes: u64) -> bool {
        let mut pending = self.pending_release.load(Ordering::SeqCst);
        while bytes > 0 && pending >= bytes {
            match self.pending_release.compare_exchange_weak(
                pending,
                pending - bytes,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return true,
                Err(now) => pending = now,
            }
        }
        false
    }

    /// Returns `bytes` to the arbiter: one-way, never waits, never fails. The `Release` rides
    /// along with the next request or is flushed by the watcher within the release delay.
    /// While disconnected it is applied locally and the reconnection's `Redeclare` reflects it.
    pub fn release(&'static self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.pending_release.fetch_add(bytes, Ordering::SeqCst);
        let fd = self.wake_fd.load(Ordering::Acquire);
        if fd < 0 {
            // No watcher: send now.
            self.try_flush();
        } else if self.armed.swap(false, Ordering::AcqRel) {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a live u64 to the watcher's eventfd.
            let _ = unsafe { libc::write(fd, (&raw const one).cast(), 8) };
        }
    }

    /// The allocation's `(limit, in_use)`. Asks the arbiter when connected; otherwise answers
    /// from the last known values without waiting; waits only while no limit is known yet.
    pub fn mem_info(&'static self) -> Option<(u64, u64)> {
        let asked = self.request(false, |s, link| {
            let release = s.take_pending(link);
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
        self.limit().map(|l| (l, self.last_in_use.load(Ordering::Acquire).max(self.held())))
    }

    /// The allocation's limit; connects (waiting up to the outage bound) if none is known.
    pub fn limit(&'static self) -> Option<u64> {
        if let Some(l) = self.known_limit() {
            return Some(l);
        }
        self.request(true, |_, _| Some(())).ok()?;
        self.known_limit()
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
                    std::thread::sleep(until.saturating_duration_since(now).max(Duration::from_millis(1)));
                }
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Link> {
        // A panic inside the lock leaves consistent data (every update is a single store).
        self.link.lock().unwrap_or_else(|e| e.into_inner())
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

    /// Flushes pending releases if the lock is free; otherwise its holder will.
    fn try_flush(&'static self) {
        while self.pending_release.load(Ordering::SeqCst) != 0 {
            let mut link = match self.link.try_lock() {
                Ok(l) => l,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => return,
            };
            self.flush_locked(&mut link);
        }
    }

    /// Applies pending releases to `held`; returns the bytes to announce to the arbiter.
    fn take_pending(&self, link: &mut Link) -> u64 {
        let bytes = self.pending_release.swap(0, Ordering::SeqCst);
        if bytes > 0 {
            link.held = link.held.saturating_sub(bytes);
            self.held_view.store(link.held, Ordering::Release);
        }
        bytes
    }

    /// Sends pending releases as one `Release` frame, now.
    fn flush_locked(&'static self, link: &mut Link) {
        let bytes = self.take_pending(link);
        if bytes == 0 {
            return;
        }
        if let Some(conn) = link.conn.as_mut()
            && let Err(e) = conn.send_nowait(&TenantRequest::Release { bytes })
        {
            tlog!(Info, "arbiter connection lost during Release: {e}");
            self.drop_conn(link);
        }
    }

    fn drop_conn(&self, link: &mut Link) {
        // Closing is all the arbiter needs to release this connection's ledger.
        link.conn = None;
        self.conn_fd.store(-1, Ordering::Release);
        let now = Instant::now();
        link.next_attempt = now + link.backoff.min(self.policy.backoff_min);
    }

    /// Connects if needed (respecting the backoff); on a new connection re-declares `held`.
    fn ensure_connected(&'static self, link: &mut Link, now: Instant) -> bool {
        if link.conn.is_some() {
            return true;
        }
        if now < link.next_attempt {
            return false;
        }
        let Some(path) = self.socket.as_deref() else {
            if !link.refused {
                tlog!(Error, "TESSERA_TOKEN is set but TESSERA_SOCKET is not: every allocation is refused");
            }
            link.refused = true;
            link.next_attempt = now + self.policy.refused_pause;
            return false;
        };
        // Frees made while disconnected are in `held` already; nothing to announce.
        self.take_pending(link);
        let attempt = Conn::connect(path, &self.token, Some(self.policy.rpc_timeout)).and_then(
            |(mut conn, view)| {
                if link.held > 0 {
                    match conn.call(&TenantRequest::Redeclare { bytes: link.held })? {
                        TenantReply::Reserved { in_use } => {
                            self.last_in_use.store(in_use, Ordering::Release)
                        }
                        other => return Err(ConnError::Frame(format!("Redeclare answered {other:?}"))),
                    }
                }
                Ok((conn, view))
            },
        );
        match attempt {
            Ok((conn, view)) => {
                self.limit.store(view.memory_limit, Ordering::Release);
                self.limit_known.store(true, Ordering::Release);
                self.conn_fd.store(conn.fd(), Ordering::Release);
                if link.ever_connected {
                    tlog!(Info, "reconnected to the arbiter; re-declared {} bytes", link.held);
                } else {
                    tlog!(Debug, "connected to the arbiter: allocation {} limit {}", view.id, view.memory_limit);
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

    /// One round of the watcher thread: waits up to `tick` for a free to ask for a flush;
    /// flushes deferred releases after the release delay; checks (without waiting on it) whether
    /// the arbiter closed the socket, and reconnects (and re-declares) if so.
    ///
    /// The socket itself is only polled with a zero timeout: a thread blocked in `poll` on it
    /// would be woken by every frame that passes (two context switches per request).
    pub fn watch_once(&'static self, tick: Duration) {
        let generation = self.generation.load(Ordering::Acquire);
        // Arm before looking at pending releases: a free after this point wakes us again.
        self.armed.store(true, Ordering::Release);
        let woken = self.pending_release.load(Ordering::SeqCst) != 0
            || wait_readable(self.wake_fd.load(Ordering::Acquire), tick);
        if woken {
            self.drain_wake_fd();
            // Give a request the chance to carry the release; then send it on its own. When a
            // request did carry it, there is nothing left and the link lock is not touched: a
            // watcher blocking on the lock held across a round trip costs the caller two
            // extra context switches.
            std::thread::sleep(self.policy.release_delay);
            if self.pending_release.load(Ordering::SeqCst) != 0 {
                let mut link = self.lock();
                self.flush_locked(&mut link);
            }
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
            !link.ever_connected || link.conn.is_some() || self.ensure_connected(&mut link, Instant::now())
        };
        if !reconnected {
            std::thread::sleep(tick.min(self.policy.backoff_max));
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

    /// Starts the thread that flushes deferred releases and notices the arbiter closing the
    /// socket (so an idle process's memory is re-declared after an arbiter restart).
    fn start_watcher(&'static self) -> bool {
        // SAFETY: eventfd has no memory preconditions.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            tlog!(Warn, "cannot create the watcher's eventfd; frees send their release at once");
        }
        let spawned = std::thread::Builder::new()
            .name("tessera-watch".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                loop {
                    self.watch_once(Duration::from_millis(250));
                }
            });
        match spawned {
            Ok(_) => {
                // Frees defer their release only once the watcher runs.
                self.wake_fd.store(efd, Ordering::Release);
                true
            }
            Err(_) => {
                tlog!(Warn, "cannot start the watcher thread; reconnection waits for the next call");
                if efd >= 0 {
                    // SAFETY: our own eventfd, never published.
                    unsafe { libc::close(efd) };
                }
                false
            }
        }
    }

    /// In a forked child: close the inherited socket without sending anything on it, so the
    /// parent's connection (and ledger) is left untouched.
    pub fn abandon_in_child(&self) {
        for fd in [self.conn_fd.swap(-1, Ordering::AcqRel), self.wake_fd.swap(-1, Ordering::AcqRel)] {
            if fd >= 0 {
                // SAFETY: `fd` is this session's socket or eventfd, inherited through fork; the
                // parent keeps its own copy. The objects owning the numbers are leaked, never
                // used again.
                unsafe { libc::close(fd) };
            }
        }
    }
}

/// Waits up to `tick` for `fd` to become readable (a negative fd: just sleeps `tick`).
fn wait_readable(fd: RawFd, tick: Duration) -> bool {
    if fd < 0 {
        std::thread::sleep(tick);
        return false;
    }
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = tick.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `pfd` is a valid pollfd array of length 1.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    n > 0 && pfd.revents & libc::POLLIN != 0
}

/// True when the peer of socket `fd` has closed it (checked without waiting).
fn hung_up(fd: RawFd) -> bool {
    if fd < 0 {
        return false;
    }
    let mut pfd = libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 };
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
        }
    }

    fn session(path: &std::path::Path, token: &str, p: Policy) -> &'static Session {
        Box::leak(Box::new(Session::new(Some(path.to_owned()), token.to_owned(), p)))
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
        assert_eq!(s.reserve(600), Err(SessionError::Denied { limit: 1000, in_use: 600 }));
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
        assert_eq!(log.iter().filter(|r| matches!(r, TenantRequest::Reserve { .. })).count(), 3);
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
        assert!(t.elapsed() < Duration::from_millis(100), "free waited {:?}", t.elapsed());
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
        assert!(waited >= Duration::from_millis(250), "did not wait: {waited:?}");
        let arb2 = back.join().unwrap();
        // The new arbiter's ledger is exact: 300 re-declared + 100 new.
        assert_eq!(arb2.in_use(), 400);
        assert_eq!(arb2.log()[0], TenantRequest::Redeclare { bytes: 300 });
    }

    #[test]
    fn outage_past_the_bound_fails() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("none.sock");
        let s = session(&sock, TOKEN, policy(300, false));
        let t = Instant::now();
        assert_eq!(s.reserve(1), Err(SessionError::Unavailable));
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(2), "{waited:?}");
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
        assert!(t.elapsed() < Duration::from_millis(500), "{:?}", t.elapsed());
    }

    #[test]
    fn token_without_socket_refuses_everything() {
        let s: &'static Session = Box::leak(Box::new(Session::new(None, TOKEN.into(), policy(3000, false))));
        let t = Instant::now();
        assert_eq!(s.reserve(1), Err(SessionError::Unavailable));
        assert!(t.elapsed() < Duration::from_millis(500));
        assert_eq!(s.limit(), None);
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
        assert_eq!(arb2.connections(), 1);
        assert!(s.connected());
        // Known use survives; a new reservation is counted on top.
        assert_eq!(s.reserve(300), Ok(1000));
        assert_eq!(s.reserve(1), Err(SessionError::Denied { limit: 1000, in_use: 1000 }));
    }

    #[test]
    fn deferred_release_rides_along_or_is_flushed_within_the_delay() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        let s = session(&sock, TOKEN, policy(3000, true));
        s.reserve(600).unwrap();
        // Give the watcher its first round so it is armed.
        std::thread::sleep(Duration::from_millis(20));
        // A free followed at once by an allocation: the Release rides in front of the Reserve.
        s.release(600);
        assert_eq!(s.reserve(700), Ok(700));
        let log = arb.log();
        assert_eq!(
            &log[log.len() - 2..],
            &[TenantRequest::Release { bytes: 600 }, TenantRequest::Reserve { bytes: 700 }]
        );
        // A free with nothing after it reaches the arbiter within a few milliseconds.
        let t = Instant::now();
        s.release(700);
        arb.wait_for("flushed release", |a| a.in_use() == 0);
        assert!(t.elapsed() < Duration::from_millis(200), "flushed after {:?}", t.elapsed());
        assert_eq!(s.held(), 0);
    }

    #[test]
    fn concurrent_frees_and_reserves_stay_exact() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1 << 40);
        let s = session(&sock, TOKEN, policy(3000, true));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        s.reserve(10).unwrap();
                        s.release(10);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(s.held(), 0);
        arb.wait_for("all releases", |a| a.in_use() == 0);
        // Netted frees never reach the arbiter, but what it was told balances exactly.
        let (mut reserved, mut released) = (0u64, 0u64);
        for r in arb.log() {
            match r {
                TenantRequest::Reserve { bytes } => reserved += bytes,
                TenantRequest::Release { bytes } => released += bytes,
                _ => {}
            }
        }
        assert_eq!(reserved, released);
        assert!(reserved <= 8 * 500 * 10, "more reserved at the arbiter than allocated: {reserved}");
    }

    fn count(log: &[TenantRequest], f: impl Fn(&TenantRequest) -> bool) -> usize {
        log.iter().filter(|r| f(r)).count()
    }

    fn is_reserve(r: &TenantRequest) -> bool {
        matches!(r, TenantRequest::Reserve { .. })
    }

    #[test]
    fn free_then_alloc_of_no_more_is_netted_without_a_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        // A long release delay: the watcher does not flush between the free and the alloc.
        let s = session(&sock, TOKEN, Policy { release_delay: Duration::from_secs(5), ..policy(3000, true) });
        assert_eq!(s.reserve(600), Ok(600));
        assert_eq!(arb.log().len(), 1);
        // Free then allocate the same size: no request at all, the arbiter still counts 600.
        s.release(600);
        assert_eq!(s.held(), 0);
        assert_eq!(s.reserve(600), Ok(600));
        assert_eq!(s.held(), 600);
        assert_eq!(arb.log().len(), 1, "netted reservation reached the arbiter: {:?}", arb.log());
        assert_eq!(arb.in_use(), 600);
        // A smaller allocation is netted too; the rest stays pending.
        s.release(600);
        assert_eq!(s.reserve(400), Ok(600));
        assert_eq!(s.held(), 400);
        assert_eq!(arb.log().len(), 1);
        // Larger than what is pending (200): one round trip, the release riding in front.
        assert_eq!(s.reserve(300), Ok(700));
        assert_eq!(s.held(), 700);
        let log = arb.log();
        assert_eq!(log.len(), 3);
        assert_eq!(&log[1..], &[TenantRequest::Release { bytes: 200 }, TenantRequest::Reserve { bytes: 300 }]);
        assert_eq!(arb.in_use(), 700);
        // Netting never grants past the limit: the arbiter's count covers the netted bytes.
        s.release(300);
        assert_eq!(s.reserve(300), Ok(700));
        assert_eq!(s.reserve(301), Err(SessionError::Denied { limit: 1000, in_use: 700 }));
        assert_eq!(s.held(), 700);
    }

    #[test]
    fn mem_info_after_netting_is_exact() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        let s = session(&sock, TOKEN, Policy { release_delay: Duration::from_secs(5), ..policy(3000, true) });
        s.reserve(500).unwrap();
        s.reserve(300).unwrap();
        s.release(500);
        s.reserve(200).unwrap(); // netted: 300 still pending
        assert_eq!(count(&arb.log(), is_reserve), 2);
        // The query sends what is pending first, so the answer is what is live.
        assert_eq!(s.mem_info(), Some((1000, 500)));
        assert_eq!(arb.in_use(), 500);
        assert_eq!(s.held(), 500);
        assert_eq!(arb.log().last(), Some(&TenantRequest::MemInfo));
    }

    #[test]
    fn watcher_flush_after_netting_leaves_the_ledger_equal_to_held() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        // Long enough that the alloc right after the free is netted, short enough to wait for.
        let s = session(&sock, TOKEN, Policy { release_delay: Duration::from_millis(300), ..policy(3000, true) });
        s.reserve(500).unwrap();
        s.reserve(300).unwrap();
        s.release(500);
        s.reserve(200).unwrap();
        assert_eq!(count(&arb.log(), is_reserve), 2, "the 200 should have been netted");
        assert_eq!(s.held(), 500);
        // No further call: the watcher announces the remaining 300 on its own.
        arb.wait_for("watcher flush", |a| a.in_use() == 500);
        assert_eq!(arb.log().last(), Some(&TenantRequest::Release { bytes: 300 }));
        assert_eq!(s.held(), 500);
    }

    #[test]
    fn netted_bytes_are_redeclared_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let arb = MockArbiter::start(&sock, 1000);
        // The watcher, woken by the free, sleeps the release delay before it looks at the socket.
        let s = session(&sock, TOKEN, Policy { release_delay: Duration::from_millis(300), ..policy(3000, true) });
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
    }
}
