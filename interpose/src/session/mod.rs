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
//! byte. A pressed process keeps no credit for a while ([`PRESSED_FOR`]), except during its
//! *turn* ([`TURN`], from a grant to a churner, see [`CHURN_GAP`]): then it keeps what its
//! frees make, answers a `Pressure` with nothing, and gives it all back when the turn ends (a
//! process that frees and allocates in a loop at a full allocation hands its chunk over once a
//! turn, not at every allocation; the arbiter gives the chunk to the waiter, see
//! `tessera_ledger`); an idle one returns its credit after a quiet tick; the watcher returns
//! credit above [`Session::keep`] after the release delay.

//!
//! Modules (one `impl Session` block each, over the fields declared here):
//! - [`clock`]: the time and timed waits behind a trait, with a fake for the tests.
//! - [`credit`]: credit arithmetic: the granule, what is kept, reserve and release, giving
//!   credit back above a bound.
//! - [`link`]: the link state machine: lazy connection, backoff, refusal, reconnection with
//!   `Redeclare`, and the request loop that waits out an arbiter that is down.
//! - [`channel`]: the pressure channel: opening it, answering `Pressure`, giving credit back
//!   on it without waiting.
//! - [`watcher`]: the background thread: deferred releases, the idle tick, noticing a closed
//!   socket, and the fail-safe when it panics.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tessera_protocol::{TenantReply, TenantRequest};

use crate::conn::Conn;
use crate::tlog;

mod channel;
mod clock;
mod credit;
mod link;
mod watcher;

pub use clock::{Clock, SystemClock};
pub use credit::granule;
use link::Link;

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
    /// How long after a grant a pressed process keeps its frees' credit ([`TURN`]; zero: a
    /// pressed process gives every free back at once).
    pub turn: Duration,
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
            turn: TURN,
        }
    }
}

/// How long after a `Pressure` the process asks for no credit and keeps none: its siblings
/// need the room. Part of the protocol: the arbiter presses it again only after this.
pub const PRESSED_FOR: Duration = tessera_protocol::PRESSED_FOR;

/// How long after a grant a pressed process keeps the credit its frees make (its turn; the
/// protocol's, see [`tessera_protocol::TURN`]).
pub const TURN: Duration = tessera_protocol::TURN;

/// A reservation that comes this soon after the process's last free (while pressed) is a
/// churner's: it frees and allocates in a loop, and its grant starts a turn. A process that
/// hands its memory to a sibling and waits for it back (its next allocation comes after the
/// sibling's round trip and two context switches, well over this) gets no turn: its frees go
/// back at once, as a pressed process's do.
pub const CHURN_GAP: Duration = Duration::from_micros(20);

/// The `seq` of a `Relinquish` that answers no `Pressure` (credit given back on the process's
/// own initiative).
pub const UNASKED: u64 = 0;

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
    /// Set by a new memory connection: the watcher opens its channel next.
    channel_wanted: AtomicBool,
    /// When the last `Pressure` came, ms since `origin` (0: never).
    pressed_ms: AtomicU64,
    /// When this process's turn ends, ms since `origin` (0: none yet): a grant to a process
    /// that churns starts one ([`Policy::turn`]).
    turn_end_ms: AtomicU64,
    /// When a free last made credit while the process was pressed, us since `origin` (0:
    /// never): a reservation that comes within [`CHURN_GAP`] of it is a churner's.
    last_free_us: AtomicU64,
    /// Set when an answer on the channel may or may not have reached the arbiter: the watcher
    /// then drops the memory connection, so the reconnection's `Redeclare` is exact.
    reset_memory_conn: AtomicBool,
    /// `Relinquish` frames sent on the current pressure channel.
    given_back: AtomicU64,
    /// The allocation's GPU (UUID, lower case), from the first `Welcome`: an allocation's GPU
    /// never changes.
    gpu_uuid: std::sync::OnceLock<String>,
    /// Where the session reads the time and waits (the machine's, but for tests).
    clock: &'static dyn Clock,
    origin: Instant,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// A session that will connect to `socket` with `token` on first use.
    pub fn new(socket: Option<PathBuf>, token: String, policy: Policy) -> Self {
        Self::with_clock(socket, token, policy, &SystemClock)
    }

    /// [`Session::new`] on another clock (a test's fake one).
    pub fn with_clock(
        socket: Option<PathBuf>,
        token: String,
        policy: Policy,
        clock: &'static dyn Clock,
    ) -> Self {
        let now = clock.now();
        Self {
            socket,
            token,
            policy,
            link: Mutex::new(Link {
                conn: None,
                next_attempt: now,
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
            channel_wanted: AtomicBool::new(false),
            pressed_ms: AtomicU64::new(0),
            turn_end_ms: AtomicU64::new(0),
            last_free_us: AtomicU64::new(0),
            reset_memory_conn: AtomicBool::new(false),
            given_back: AtomicU64::new(0),
            gpu_uuid: std::sync::OnceLock::new(),
            clock,
            origin: now,
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

    /// The allocation's GPU (UUID, lower case), from this session's own `Welcome`; connects
    /// now if it never did (one attempt, no waiting: `None` while the arbiter is unreachable or
    /// refuses the token). Why not a connection of its own: each costs the process a connect
    /// and a handshake round trip, and the arbiter a thread, at start-up (issue 36).
    pub fn allocation_gpu(&'static self) -> Option<&'static str> {
        if let Some(u) = self.gpu_uuid.get() {
            return Some(u);
        }
        let _ = self.request(false, |_, _| Some(()));
        self.gpu_uuid.get().map(String::as_str)
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

    /// The allocation's `(limit, in_use)`, exact: this process's credit is given back first
    /// and the arbiter takes back the other processes' before it answers. Asks the arbiter
    /// when connected; otherwise answers from the last known values without waiting; waits
    /// only while no limit is known yet.
    pub fn mem_info(&'static self) -> Option<(u64, u64)> {
        let asked = self.request(false, |s, conn| {
            let release = s.drop_credit();
            // The credit given back on the channel just before (the watcher's) counts too.
            let given_back = s.given_back.load(Ordering::Acquire);
            match conn.call_after_release(release, &TenantRequest::MemInfoAfter { given_back }) {
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

    /// True when the arbiter refused this session's token (or it has none to prove): it gets
    /// nothing, as opposed to an arbiter not reachable yet.
    pub fn refused(&self) -> bool {
        self.link.lock().refused
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
        self.request(false, |_, conn| match conn.call(&TenantRequest::Ticket) {
            Ok(TenantReply::Ticket { ticket }) => Some(Some(ticket)),
            Ok(_) => Some(None),
            Err(_) => None,
        })
        .ok()
        .flatten()
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

#[cfg(test)]
mod tests;
