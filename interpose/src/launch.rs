//! Compute sharing: every kernel launch is gated on a time-slice lease from the arbiter
//! (contract in docs/arbiter.md and docs/interposer.md, "Compute sharing").
//!
//! - **Fast path**: a launch takes one credit (`fetch_sub` on one atomic) and notes its stream
//!   through a per-thread cache; no lock, no allocation, no round trip. Credits exist only while
//!   the process holds a lease, and are handed out so that the estimated GPU work in flight
//!   never exceeds the time left in the lease: launches are not GPU time (a stream buffers
//!   about a thousand of them), so counting them alone would not bound anything.
//! - **Slow path**: without a credit, the first such launcher asks for a lease on the process's
//!   dedicated arbiter connection (`LeaseAcquire`, once, however many threads wait; the others
//!   wait on a condition variable), receives the grant, hands out the first credits and
//!   launches: the grant wakes the thread that launches. It passes the lease to the process's
//!   manager thread, which samples every stream used with events while the lease lasts,
//!   estimates per-launch GPU time (an EWMA of event-measured durations per stream), and
//!   refills credits every tick.
//! - **Lease end** (deadline, noticed by the manager, never by an application thread): credits
//!   drop to zero, an event is recorded on every stream used during the lease, and once they
//!   completed `LeaseRelease` reports the real time the work occupied the GPU (from the grant
//!   to the completion of the last event: overrun included). The drain is polled with a bound,
//!   so a host callback waiting on a blocked launcher, or a thread blocked in
//!   `cuCtxSynchronize`, can delay the report but never deadlock it.
//! - **Early hand-back**: when the process launched nothing for [`IDLE`] and its streams have
//!   stayed drained (`cuEventQuery`) for [`DRAIN_IDLE`], the lease is returned early
//!   (`early = true`). Once launches stop the manager looks every [`DRAIN_TICK`], and a
//!   `cuStreamSynchronize` / `cuCtxSynchronize` / `cuEventSynchronize` returning meanwhile wakes
//!   it at once (the hooks only notify; they never wait on the lease). The last stretch before
//!   the hand-back is spun through rather than slept (see [`SPIN`]), so a waiting tenant starts
//!   well within 2 ms of the holder's last work completing; counting from the drain (not from
//!   the last launch) keeps a busy tenant that synchronises and launches again at once from
//!   looking idle.
//! - **Used-up lease**: when nothing is in flight and too little of the lease is left for one
//!   more launch, the lease ends then rather than at its deadline (the GPU would idle). In both
//!   cases, with every stream seen drained and no credit taken since, the report goes out at
//!   once: there is nothing to wait for.
//! - **Arbiter unreachable**: the manager grants itself local leases of [`LOCAL_LEASE`], so
//!   tenants keep running and the work in flight stays bounded exactly as under a real lease;
//!   each new lease first tries the arbiter again, and real leases resume as soon as it is back.
//!   (Only a driver without events, where nothing can be measured, is left ungated.)
//!
//! Per-thread default streams (`_ptsz` with stream 0, `CU_STREAM_PER_THREAD`) belong to the
//! launching thread and cannot be named from the manager thread: they are sampled through the
//! legacy default stream, which waits for all blocking streams of the context.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicI64, AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering,
};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_protocol::{TenantReply, TenantRequest};

use crate::conn::{Conn, ConnError};
use crate::driver;
use crate::ffi::*;
use crate::tlog;

/// Streams tracked per process (a launch on one more passes through untracked but gated).
pub const MAX_STREAMS: usize = 128;
/// Credits when launches cannot be gated at all (no manager thread, no event API).
const UNGATED: i64 = i64::MAX / 4;
/// Length of the leases the manager grants itself while the arbiter is unreachable.
pub const LOCAL_LEASE: Duration = Duration::from_millis(100);
/// Manager tick while a lease is held and launches go on.
const TICK: Duration = Duration::from_micros(500);
/// Manager tick while launches have stopped and work is still in flight: the drain is what
/// starts the idle clock, so it is looked for more often than the refill needs.
const DRAIN_TICK: Duration = Duration::from_micros(250);
/// No launch for this long (and nothing taken from the credits) before a lease can be handed
/// back early.
const IDLE: Duration = Duration::from_millis(1);
/// And the streams must have stayed drained, with no launch, for at least this long: a busy
/// tenant that synchronises and launches again at once must not look idle at the drain itself.
/// A tenant seen to launch again later than that after its drains gets a longer wait (see
/// [`RelaunchGap`]).
const DRAIN_IDLE: Duration = Duration::from_micros(250);
/// The longest drain wait [`RelaunchGap`] asks for.
const MAX_DRAIN_IDLE: Duration = Duration::from_millis(2);
/// An early hand-back this close is waited for by spinning (see [`Manager::spin`]).
const SPIN: Duration = Duration::from_micros(300);
/// Longest wait for a grant before the arbiter is considered wedged.
const GRANT_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest the lease-end drain waits for the streams before reporting anyway.
const DRAIN_BOUND: Duration = Duration::from_secs(2);
/// Most credits handed out at once.
const MAX_CREDITS: i64 = 4096;
/// Safety margin kept free at the end of a lease.
const MARGIN_NS: f64 = 300_000.0;

/// How a launch names its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StreamKind {
    /// An explicit stream handle.
    Explicit = 0,
    /// The legacy default stream (stream 0 without `_ptsz`, or `CU_STREAM_LEGACY`).
    Legacy = 1,
    /// The calling thread's per-thread default stream.
    PerThread = 2,
}

/// Classifies a launch's stream argument. `ptsz`: the launch came through a `_ptsz` variant.
pub fn classify(stream: CUstream, ptsz: bool) -> (usize, StreamKind) {
    match stream as usize {
        0 if ptsz => (0, StreamKind::PerThread),
        0 | 1 => (0, StreamKind::Legacy),
        2 => (0, StreamKind::PerThread),
        h => (h, StreamKind::Explicit),
    }
}

/// One tracked stream.
#[derive(Debug)]
pub struct Slot {
    handle: AtomicUsize,
    kind: AtomicU8,
    ctx: AtomicPtr<c_void>,
    /// Launches that returned from the driver on this stream (ever).
    launches: AtomicU64,
    /// `launches` when the slot was given to its current stream.
    base: AtomicU64,
    /// Last lease epoch the stream was launched on.
    used_epoch: AtomicU64,
    in_use: AtomicBool,
    /// Bumped when the slot is given to another stream.
    generation: AtomicU64,
}

impl Slot {
    fn new() -> Self {
        Self {
            handle: AtomicUsize::new(0),
            kind: AtomicU8::new(0),
            ctx: AtomicPtr::new(std::ptr::null_mut()),
            launches: AtomicU64::new(0),
            base: AtomicU64::new(0),
            used_epoch: AtomicU64::new(0),
            in_use: AtomicBool::new(false),
            generation: AtomicU64::new(0),
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    /// Threads waiting for a credit.
    waiters: u32,
    /// An application thread returned from a synchronise since the manager last looked.
    synced: bool,
    /// A launcher is asking the arbiter for a lease.
    acquiring: bool,
    /// A lease a launcher received, not yet taken over by the manager.
    begun: Option<Begun>,
    /// The manager is running a lease (from taking it over until its release went out).
    leasing: bool,
    manager_started: bool,
}

/// Real driver functions the gate needs (resolved from the driver, never hooked).
#[derive(Clone, Copy)]
struct Api {
    ctx_get: cuCtxGetCurrent_t,
    ctx_set: cuCtxSetCurrent_t,
    ev_create: cuEventCreate_t,
    ev_record: cuEventRecord_t,
    ev_query: cuEventQuery_t,
    ev_elapsed: cuEventElapsedTime_t,
    ev_destroy: cuEventDestroy_v2_t,
    is_capturing: Option<cuStreamIsCapturing_t>,
}

impl Api {
    fn load() -> Option<Self> {
        macro_rules! sym {
            ($name:literal, $t:ty) => {{
                let p = driver::cuda_symbol($name);
                if p.is_null() {
                    None
                } else {
                    // SAFETY: the driver's symbol of that name has this C signature.
                    Some(unsafe { std::mem::transmute::<*mut c_void, $t>(p) })
                }
            }};
        }
        Some(Self {
            ctx_get: sym!(c"cuCtxGetCurrent", cuCtxGetCurrent_t)?,
            ctx_set: sym!(c"cuCtxSetCurrent", cuCtxSetCurrent_t)?,
            ev_create: sym!(c"cuEventCreate", cuEventCreate_t)?,
            ev_record: sym!(c"cuEventRecord", cuEventRecord_t)?,
            ev_query: sym!(c"cuEventQuery", cuEventQuery_t)?,
            ev_elapsed: sym!(c"cuEventElapsedTime", cuEventElapsedTime_t)?,
            ev_destroy: sym!(c"cuEventDestroy_v2", cuEventDestroy_v2_t)?,
            is_capturing: sym!(c"cuStreamIsCapturing", cuStreamIsCapturing_t),
        })
    }
}

/// Counters for tests and logs.
#[derive(Debug, Default)]
pub struct GateStats {
    /// Leases received.
    pub leases: AtomicU64,
    /// Leases handed back early.
    pub early: AtomicU64,
    /// Total busy ns reported.
    pub busy_ns: AtomicU64,
}

/// The process's launch gate.
pub struct Gate {
    credits: AtomicI64,
    epoch: AtomicU64,
    slots: Box<[Slot]>,
    table: Mutex<()>,
    shared: Mutex<Shared>,
    launchers: Condvar,
    manager: Condvar,
    /// The manager's state: lease connection, per-stream tracks. Locked by the launcher that
    /// asks for a lease, then by the manager thread for the lease's life.
    mgr: Mutex<Option<Manager>>,
    socket: Option<PathBuf>,
    token: String,
    /// The process cannot prove its allocation: every launch fails (see [`Gate::closed`]).
    closed: bool,
    /// The lease connection's fd (closed by hand in a forked child).
    lease_fd: AtomicI32,
    /// Set while the manager waits for work in flight to drain: a synchronise returning then
    /// wakes it, so the drain is seen at once rather than at its next timed look.
    watch: AtomicBool,
    /// Statistics.
    pub stats: GateStats,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("credits", &self.credits.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

thread_local! {
    // (gate address, stream handle, kind, slot index + 1, epoch): the last stream this thread
    // launched on. Const-initialised, no destructor.
    static CACHE: Cell<(usize, usize, u8, usize, u64)> = const { Cell::new((0, 0, 0, 0, 0)) };
}

impl Gate {
    /// A gate that will lease from the arbiter at `socket` with `token`.
    pub fn new(socket: Option<PathBuf>, token: String) -> Self {
        Self {
            credits: AtomicI64::new(0),
            epoch: AtomicU64::new(1),
            slots: (0..MAX_STREAMS).map(|_| Slot::new()).collect(),
            table: Mutex::new(()),
            shared: Mutex::new(Shared::default()),
            launchers: Condvar::new(),
            manager: Condvar::new(),
            mgr: Mutex::new(None),
            socket,
            token,
            closed: false,
            lease_fd: AtomicI32::new(-1),
            watch: AtomicBool::new(false),
            stats: GateStats::default(),
        }
    }

    /// A gate that never grants: every launch returns `CUDA_ERROR_NOT_PERMITTED` without
    /// running (a process that cannot prove its allocation must not use GPU time ungated).
    pub fn closed(mut self) -> Self {
        self.closed = true;
        self
    }

    fn lock_shared(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_table(&self) -> MutexGuard<'_, ()> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gates one launch: takes a credit (waiting for a lease if none), runs `launch`, and
    /// counts it on its stream.
    #[inline]
    pub fn launch(
        &'static self,
        stream: CUstream,
        ptsz: bool,
        launch: impl FnOnce() -> CUresult,
    ) -> CUresult {
        let (handle, kind) = classify(stream, ptsz);
        let slot = self.slot(handle, kind);
        if slot.is_some_and(|s| s.kind.load(Ordering::Relaxed) == u8::MAX) {
            // A capturing stream: the launch records into a graph, it runs nothing now.
            return launch();
        }
        let mut slot = slot;
        if self.credits.fetch_sub(1, Ordering::AcqRel) <= 0 {
            if self.closed {
                // No lease ever comes: credits stay at or below zero, so this is the slow path.
                self.credits.fetch_add(1, Ordering::AcqRel);
                return CUDA_ERROR_NOT_PERMITTED;
            }
            self.wait_for_credit();
            // Waiting may have spanned a new lease: mark the stream under its epoch.
            slot = self.slot(handle, kind);
        }
        let r = launch();
        if let Some(s) = slot {
            s.launches.fetch_add(1, Ordering::Release);
        }
        r
    }

    /// The slot of a stream: the thread's cached one when it is still this lease's, else a
    /// registration under the table lock.
    #[inline]
    fn slot(&'static self, handle: usize, kind: StreamKind) -> Option<&'static Slot> {
        let epoch = self.epoch.load(Ordering::Acquire);
        let me = self as *const Self as usize;
        let (g, h, k, idx, e) = CACHE.with(Cell::get);
        if g == me && h == handle && k == kind as u8 && e == epoch && idx > 0 {
            return Some(&self.slots[idx - 1]);
        }
        self.register(handle, kind, epoch)
    }

    #[cold]
    fn register(
        &'static self,
        handle: usize,
        kind: StreamKind,
        epoch: u64,
    ) -> Option<&'static Slot> {
        let api = api()?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the driver writes the calling thread's context.
        if unsafe { (api.ctx_get)(&mut ctx) } != CUDA_SUCCESS || ctx.is_null() {
            return None;
        }
        let capturing = kind == StreamKind::Explicit && is_capturing(api, handle);
        let me = self as *const Self as usize;
        let _t = self.lock_table();
        let found = self.slots.iter().position(|s| {
            s.in_use.load(Ordering::Acquire)
                && s.handle.load(Ordering::Relaxed) == handle
                && s.ctx.load(Ordering::Relaxed) == ctx
                && (s.kind.load(Ordering::Relaxed) == kind as u8
                    || s.kind.load(Ordering::Relaxed) == u8::MAX)
        });
        let idx = match found {
            Some(i) => i,
            None => {
                let i = self
                    .slots
                    .iter()
                    .position(|s| !s.in_use.load(Ordering::Acquire))?;
                let s = &self.slots[i];
                s.handle.store(handle, Ordering::Relaxed);
                s.ctx.store(ctx, Ordering::Relaxed);
                s.base
                    .store(s.launches.load(Ordering::Acquire), Ordering::Relaxed);
                s.generation.fetch_add(1, Ordering::AcqRel);
                s.in_use.store(true, Ordering::Release);
                i
            }
        };
        let s = &self.slots[idx];
        s.kind.store(
            if capturing { u8::MAX } else { kind as u8 },
            Ordering::Relaxed,
        );
        s.used_epoch.store(epoch, Ordering::Release);
        CACHE.with(|c| c.set((me, handle, kind as u8, idx + 1, epoch)));
        Some(s)
    }

    /// Forgets a stream the application destroys (called before the real destroy, with the
    /// table lock held across it so the manager never records on a dead stream).
    pub fn stream_destroyed(
        &'static self,
        stream: CUstream,
        destroy: impl FnOnce() -> CUresult,
    ) -> CUresult {
        let handle = stream as usize;
        let _t = self.lock_table();
        if handle > 2 {
            for s in self.slots.iter() {
                if s.in_use.load(Ordering::Acquire) && s.handle.load(Ordering::Relaxed) == handle {
                    s.in_use.store(false, Ordering::Release);
                    s.generation.fetch_add(1, Ordering::AcqRel);
                }
            }
            // Cached slots of other threads are stale now.
            self.epoch.fetch_add(1, Ordering::AcqRel);
        }
        destroy()
    }

    /// Without a credit: the first waiting launcher asks the arbiter for the lease itself and
    /// starts it (so the grant wakes the thread that launches, not a manager that would then
    /// have to wake it), then hands it to the manager thread to run; other launchers wait.
    #[cold]
    fn wait_for_credit(&'static self) {
        let asked = Instant::now();
        let mut sh = self.lock_shared();
        if !sh.manager_started {
            sh.manager_started = true;
            if api().is_none() {
                tlog!(
                    Warn,
                    "the driver lacks the event API: kernel launches are not gated"
                );
                self.credits.store(UNGATED, Ordering::Release);
                return;
            }
            let spawned = std::thread::Builder::new()
                .name("tessera-lease".into())
                .stack_size(256 * 1024)
                .spawn(move || self.manage());
            if spawned.is_err() {
                tlog!(
                    Warn,
                    "cannot start the lease manager; launches are not gated"
                );
                self.credits.store(UNGATED, Ordering::Release);
                return;
            }
        }
        loop {
            if self.credits.fetch_sub(1, Ordering::AcqRel) > 0 {
                return;
            }
            if !sh.acquiring && !sh.leasing && sh.begun.is_none() {
                sh.acquiring = true;
                drop(sh);
                let begun = self.acquire_and_begin(asked);
                sh = self.lock_shared();
                sh.acquiring = false;
                sh.begun = Some(begun);
                self.manager.notify_one();
                continue;
            }
            sh.waiters += 1;
            if sh.leasing {
                // The manager refills at once (work may have completed since its last look).
                self.manager.notify_one();
            }
            sh = self
                .launchers
                .wait_timeout(sh, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
            sh.waiters -= 1;
        }
    }

    fn lock_mgr(&self) -> MutexGuard<'_, Option<Manager>> {
        self.mgr.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gets a lease (from the arbiter, or a local one when it cannot be reached) and starts it:
    /// credits are out when this returns. `asked`: when the launch found no credit.
    fn acquire_and_begin(&'static self, asked: Instant) -> Begun {
        let mut guard = self.lock_mgr();
        let m = guard.get_or_insert_with(|| Manager::new(self));
        if let Some(drained) = m.handed_back.take() {
            // Asked again soon after handing back: the gap belongs to the work, not to idleness.
            m.gap.observe(asked.saturating_duration_since(drained));
        }
        match m.acquire() {
            Some((lease_id, duration_ns)) => {
                if m.local {
                    tlog!(Info, "arbiter back: leases come from it again");
                    m.local = false;
                }
                m.begin(Some(lease_id), duration_ns)
            }
            None => {
                if !m.local {
                    tlog!(
                        Warn,
                        "arbiter unreachable: local leases keep launches bounded until it is back"
                    );
                    m.local = true;
                }
                m.begin(None, LOCAL_LEASE.as_nanos() as u64)
            }
        }
    }

    /// An application thread returned from `cuStreamSynchronize`, `cuCtxSynchronize` or
    /// `cuEventSynchronize`: the work it waited for is done. When the manager is watching for a
    /// drain it is woken (one atomic load otherwise).
    pub fn synchronised(&self) {
        if self.watch.load(Ordering::Acquire) {
            let mut sh = self.lock_shared();
            sh.synced = true;
            self.manager.notify_one();
        }
    }

    /// Sets the credits (under the shared lock, so no waiter misses it) and wakes waiters.
    fn set_credits(&self, n: i64) -> i64 {
        let _sh = self.lock_shared();
        let old = self.credits.swap(n, Ordering::AcqRel);
        if n > 0 {
            self.launchers.notify_all();
        }
        old
    }

    fn waiters(&self) -> u32 {
        self.lock_shared().waiters
    }

    /// In a forked child: close the inherited lease connection without sending anything.
    pub fn abandon_in_child(&self) {
        let fd = self.lease_fd.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: the lease socket inherited through fork; the parent keeps its copy and
            // the `Conn` owning the number is leaked with the parent's state.
            unsafe { libc::close(fd) };
        }
    }

    // ---- the manager thread -------------------------------------------------------------

    fn manage(&'static self) {
        // The manager's short timed waits decide how soon an idle lease goes back: the default
        // 50 us timer slack would stretch each by up to that much. Only this thread changes.
        // SAFETY: PR_SET_TIMERSLACK takes an integer argument and affects the calling thread.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
        loop {
            // Wait until a launcher has begun a lease.
            let begun = {
                let mut sh = self.lock_shared();
                loop {
                    if let Some(b) = sh.begun.take() {
                        sh.leasing = true;
                        break b;
                    }
                    sh = self.manager.wait(sh).unwrap_or_else(|e| e.into_inner());
                }
            };
            {
                let mut guard = self.lock_mgr();
                let m = guard.get_or_insert_with(|| Manager::new(self));
                m.run_lease(begun);
            }
            // Threads still waiting: one of them asks for the next lease.
            let mut sh = self.lock_shared();
            sh.leasing = false;
            if sh.waiters > 0 {
                self.launchers.notify_all();
            }
        }
    }
}

/// How long this process takes to launch again after its streams drained (a synchronise, then
/// some host work, then the next launch), learnt from what it did: launches that came after a
/// drain the manager had seen, and requests for a lease that came soon after an early
/// hand-back (the hand-back was premature). The drain wait before an early hand-back is twice
/// the recent longest gap, within [`DRAIN_IDLE`]..[`MAX_DRAIN_IDLE`], so a training loop that
/// does a little host work between steps keeps its lease, while a process that really went
/// idle still hands back within 0.25 ms. One long gap is forgotten over a few dozen leases.
#[derive(Debug, Default, Clone, Copy)]
struct RelaunchGap {
    /// The recent longest gap, decayed, ns.
    ns: f64,
}

impl RelaunchGap {
    /// A launch came `gap` after a drain.
    fn observe(&mut self, gap: Duration) {
        if gap <= MAX_DRAIN_IDLE {
            self.ns = self.ns.max(gap.as_nanos() as f64);
        }
    }

    /// Once per lease.
    fn decay(&mut self) {
        self.ns *= 0.9;
    }

    /// How long the streams must stay drained before an early hand-back.
    fn drain_idle(&self) -> Duration {
        Duration::from_nanos((2.0 * self.ns) as u64).clamp(DRAIN_IDLE, MAX_DRAIN_IDLE)
    }
}

/// Whether a launch took a credit since `handed` were handed out, given the counter's value
/// `now`. With none handed out, a decrement is a launcher that found none and waits.
fn credit_taken(handed: i64, now: i64) -> bool {
    handed > 0 && now != handed
}

/// Whatever ended a lease (its deadline can fall on the drain of a burst that ran long), a
/// holder drained for long enough, that launched nothing for [`IDLE`] and has no thread
/// waiting, is idle: its release says so (`early`), so the arbiter passes the GPU on at once
/// rather than keep it for a re-request that will not come. A busy tenant at its deadline is
/// either not drained (work in flight, e.g. waiting in a synchronise), has a launcher waiting,
/// or is in a host-work gap it was seen to take after its drains: `drained_for` (`None`: not
/// seen drained) must reach `drain_idle` less the shortest drain wait.
fn idle_at_end(
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

fn is_capturing(api: Api, handle: usize) -> bool {
    let Some(f) = api.is_capturing else {
        return false;
    };
    let mut status: i32 = 0;
    // SAFETY: out-pointer to a local; `handle` is the application's live stream.
    let r = unsafe { f(handle as CUstream, &mut status) };
    r == CUDA_SUCCESS && status != 0
}

static API: std::sync::OnceLock<Option<Api>> = std::sync::OnceLock::new();

fn api() -> Option<Api> {
    *API.get_or_init(Api::load)
}

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
    first_seen: Option<Instant>,
    /// The stream's launch count when the current lease began.
    lease_start: u64,
}

/// A lease a launcher received and started, for the manager thread to run.
#[derive(Debug)]
struct Begun {
    /// `None`: a local lease (arbiter unreachable).
    lease_id: Option<u64>,
    duration_ns: u64,
    start: Instant,
    epoch: u64,
    /// Credits handed out at the start.
    first: i64,
}

struct Manager {
    gate: &'static Gate,
    /// Leases are local ones (the arbiter could not be reached).
    local: bool,
    /// How soon this process launches again after a drain.
    gap: RelaunchGap,
    /// When the streams drained before the last early hand-back (to learn whether it was
    /// premature).
    handed_back: Option<Instant>,
    api: Option<Api>,
    conn: Option<Conn>,
    tracks: Vec<Track>,
    pool: HashMap<usize, Vec<CUevent>>,
    current_ctx: CUcontext,
    /// Estimate for streams without one yet (the largest known).
    default_est: f64,
}

// SAFETY: driver handles (contexts, events) are process-wide and valid on any thread; the one
// thread-bound piece, `current_ctx` (the context current on the thread that set it), is only
// set and read by the manager thread (`set_ctx`); launchers holding the `mgr` lock only talk to
// the arbiter and hand out credits.
unsafe impl Send for Manager {}

impl Manager {
    fn new(gate: &'static Gate) -> Self {
        Self {
            gate,
            local: false,
            gap: RelaunchGap::default(),
            handed_back: None,
            api: api(),
            conn: None,
            tracks: (0..MAX_STREAMS).map(|_| Track::default()).collect(),
            pool: HashMap::new(),
            current_ctx: std::ptr::null_mut(),
            default_est: 0.0,
        }
    }

    fn connect(&mut self) -> bool {
        if self.conn.is_some() {
            return true;
        }
        let Some(path) = self.gate.socket.as_deref() else {
            return false;
        };
        match Conn::connect(path, &self.gate.token, Some(GRANT_TIMEOUT)) {
            Ok((c, _)) => {
                self.gate.lease_fd.store(c.fd(), Ordering::Release);
                self.conn = Some(c);
                true
            }
            Err(e) => {
                tlog!(Info, "lease connection: {e}");
                false
            }
        }
    }

    fn drop_conn(&mut self) {
        self.conn = None;
        self.gate.lease_fd.store(-1, Ordering::Release);
    }

    /// Asks for a lease; `None` when the arbiter cannot be reached (or refuses us).
    fn acquire(&mut self) -> Option<(u64, u64)> {
        for _attempt in 0..2 {
            if !self.connect() {
                return None;
            }
            let conn = self.conn.as_mut().expect("connected");
            match conn.call(&TenantRequest::LeaseAcquire) {
                Ok(TenantReply::LeaseGranted {
                    lease_id,
                    duration_ns,
                }) => return Some((lease_id, duration_ns)),
                Ok(other) => {
                    tlog!(Warn, "unexpected answer to LeaseAcquire: {other:?}");
                    self.drop_conn();
                    return None;
                }
                // A broken connection (arbiter restarted): one fresh attempt.
                Err(ConnError::Closed | ConnError::Io(_)) => self.drop_conn(),
                Err(e) => {
                    tlog!(Warn, "LeaseAcquire failed: {e}");
                    self.drop_conn();
                    return None;
                }
            }
        }
        None
    }

    fn set_ctx(&mut self, api: Api, ctx: CUcontext) -> bool {
        if self.current_ctx == ctx {
            return true;
        }
        // SAFETY: `ctx` is a context a launching thread had current.
        if unsafe { (api.ctx_set)(ctx) } != CUDA_SUCCESS {
            return false;
        }
        self.current_ctx = ctx;
        true
    }

    fn event(&mut self, api: Api, ctx: CUcontext) -> Option<CUevent> {
        if let Some(ev) = self.pool.get_mut(&(ctx as usize)).and_then(Vec::pop) {
            return Some(ev);
        }
        if !self.set_ctx(api, ctx) {
            return None;
        }
        let mut ev = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the context is current on this thread.
        (unsafe { (api.ev_create)(&mut ev, CU_EVENT_DEFAULT) } == CUDA_SUCCESS).then_some(ev)
    }

    fn recycle(&mut self, s: Sample) {
        self.pool.entry(s.ctx as usize).or_default().push(s.ev);
    }

    /// Records an event on slot `i`'s stream (the legacy stream for default streams).
    fn record(&mut self, api: Api, i: usize) -> Option<Sample> {
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
        if handle != 0 && is_capturing(api, handle) {
            return None;
        }
        let ev = self.event(api, ctx)?;
        if !self.set_ctx(api, ctx) {
            return None;
        }
        let launches = slot.launches.load(Ordering::Acquire);
        // SAFETY: our event, and a stream the table lock keeps alive (or the legacy stream).
        if unsafe { (api.ev_record)(ev, handle as CUstream) } != CUDA_SUCCESS {
            // SAFETY: our own event.
            unsafe { (api.ev_destroy)(ev) };
            return None;
        }
        Some(Sample {
            ev,
            ctx,
            launches,
            backlogged: false,
        })
    }

    /// Polls slot `i`'s samples; updates what is complete and the per-launch estimate.
    fn poll(&mut self, api: Api, i: usize, lease_start: Instant) {
        loop {
            let Some(front) = self.tracks[i].pending.front() else {
                return;
            };
            // SAFETY: our own recorded event.
            match unsafe { (api.ev_query)(front.ev) } {
                CUDA_SUCCESS => {}
                CUDA_ERROR_NOT_READY => return,
                _ => {
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
                    Some(prev) => {
                        let mut ms = 0f32;
                        // SAFETY: two completed events of our own on the same stream.
                        let r = unsafe { (api.ev_elapsed)(&mut ms, prev.ev, s.ev) };
                        (r == CUDA_SUCCESS).then(|| f64::from(ms.max(0.0)) * 1e6 / n as f64)
                    }
                    // First sample on this stream: the time since it was first seen bounds it.
                    None => Some(
                        t.first_seen.unwrap_or(lease_start).elapsed().as_nanos() as f64 / n as f64,
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
    fn used(&mut self, epoch: u64) -> Vec<usize> {
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
                self.tracks[i].first_seen = Some(Instant::now());
            }
            v.push(i);
        }
        v
    }

    /// Starts a lease (on the launcher that received it): `lease_id` from the arbiter, or `None`
    /// for a local one; a new epoch, and its first credits. No driver call: the context cache
    /// belongs to the manager thread.
    fn begin(&mut self, lease_id: Option<u64>, duration_ns: u64) -> Begun {
        let start = Instant::now();
        self.gate.stats.leases.fetch_add(1, Ordering::Relaxed);
        // A new epoch: streams re-register (fresh capture check, "used in this lease" mark).
        let epoch = self.gate.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        for (t, slot) in self.tracks.iter_mut().zip(self.gate.slots.iter()) {
            // Work of earlier leases was drained: start from what has been launched.
            t.sampled = t.sampled.max(t.completed);
            t.lease_start = slot.launches.load(Ordering::Acquire);
        }
        // First credits: with no estimate yet, one probe launch.
        let first = self.credits_for(Duration::from_nanos(duration_ns), 0.0, 0);
        self.gate.set_credits(first);
        Begun {
            lease_id,
            duration_ns,
            start,
            epoch,
            first,
        }
    }

    /// Runs a begun lease to its end (on the manager thread): refills, watches for the drain,
    /// reports.
    fn run_lease(&mut self, begun: Begun) {
        let Begun {
            lease_id,
            duration_ns,
            start,
            epoch,
            first,
        } = begun;
        self.gap.decay();
        let drain_idle = self.gap.drain_idle();
        let deadline = start + Duration::from_nanos(duration_ns);
        let mut last_total = u64::MAX;
        let mut last_change = Instant::now();
        // When the streams were first seen drained with no launch since (None: not drained).
        let mut drained_since: Option<Instant> = None;
        let mut early = false;
        let api = self.api;
        // Credits as last handed out: fewer now means a launch took one since.
        let mut handed = first;
        let mut tick = TICK;
        let mut spin = false;
        // Launches stopped with work in flight: a returning synchronise ends the wait.
        let mut watch = false;
        let mut sync_wakes = 0u64;
        loop {
            let wait = deadline.saturating_duration_since(Instant::now()).min(tick);
            if spin {
                self.spin(wait, handed);
            } else if !wait.is_zero() {
                let mut sh = self.gate.lock_shared();
                if watch && !sh.synced {
                    self.gate.watch.store(true, Ordering::Release);
                }
                if !sh.synced {
                    sh = self
                        .gate
                        .manager
                        .wait_timeout(sh, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                if sh.synced {
                    sync_wakes += 1;
                }
                sh.synced = false;
                self.gate.watch.store(false, Ordering::Release);
            }
            let now = Instant::now();
            let Some(api) = api else {
                if now >= deadline {
                    break;
                }
                continue;
            };
            // The look runs at the deadline too: a drain seen then still makes the release say
            // the holder is idle.
            let used = {
                let _t = self.gate.lock_table();
                let used = self.used(epoch);
                for &i in &used {
                    self.poll(api, i, start);
                    let l = self.gate.slots[i].launches.load(Ordering::Acquire);
                    if l > self.tracks[i].sampled
                        && self.tracks[i].pending.len() < 4
                        && let Some(mut smp) = self.record(api, i)
                    {
                        smp.backlogged = !self.tracks[i].pending.is_empty();
                        self.tracks[i].sampled = smp.launches;
                        self.tracks[i].pending.push_back(smp);
                        // A stream already idle completes it at once: the drain is seen now,
                        // not a tick later.
                        self.poll(api, i, start);
                    }
                }
                used
            };
            let total: u64 = used
                .iter()
                .map(|&i| self.gate.slots[i].launches.load(Ordering::Acquire))
                .sum();
            // A credit taken is a launch under way, even before the driver returned it.
            let took = credit_taken(handed, self.gate.credits.load(Ordering::Acquire));
            let mut launched = total != last_total || took;
            let drained = used.iter().all(|&i| {
                let t = &self.tracks[i];
                t.pending.is_empty()
                    && t.completed >= self.gate.slots[i].launches.load(Ordering::Acquire)
            });
            if last_total == u64::MAX && drained {
                // First look, and what the launcher did since the grant has already completed
                // (this thread may have taken the lease over late): those launches are not
                // recent, so the quiet counts from the lease's start.
                launched = false;
                last_total = total;
                last_change = start;
                // Credits taken so far are those launches; a later take shows against this.
                handed = self.gate.credits.load(Ordering::Acquire);
            } else if launched {
                last_total = total;
                last_change = now;
            }
            if launched && let Some(t) = drained_since {
                self.gap.observe(now.saturating_duration_since(t));
            }
            drained_since = match (drained && !launched, drained_since) {
                (false, _) => None,
                (true, Some(t)) => Some(t),
                (true, None) => Some(now),
            };
            if now >= deadline {
                break;
            }
            let waiters = self.gate.waiters();
            let quiet = waiters == 0 && now.duration_since(last_change) >= IDLE;
            if quiet && drained_since.is_some_and(|t| now.duration_since(t) >= drain_idle) {
                early = true;
                break;
            }
            if drained_since.is_some()
                && deadline.saturating_duration_since(now).as_nanos() as f64 <= MARGIN_NS
            {
                // Nothing in flight and too little time left to hand out a launch: the lease
                // is used up; holding it to the deadline would only leave the GPU idle.
                break;
            }
            // The next look: when the idle clocks run out, or at the drain. The last stretch
            // before an early hand-back is spun through, not slept: a timed wake-up of an idle
            // CPU is occasionally late by milliseconds, and a waiting tenant pays for it.
            (tick, spin) = match drained_since {
                Some(t) if waiters == 0 => {
                    let at = (t + drain_idle).max(last_change + IDLE);
                    let left = at.saturating_duration_since(now);
                    if left <= SPIN {
                        (left, true)
                    } else {
                        (left.clamp(Duration::from_micros(50), TICK), false)
                    }
                }
                None if !launched => (DRAIN_TICK, false),
                _ => (TICK, false),
            };
            watch = drained_since.is_none() && !launched;
            // Refill: what may still be launched so that the work in flight ends by the deadline.
            let max_est = used
                .iter()
                .map(|&i| self.tracks[i].est_ns)
                .fold(0.0, f64::max);
            if max_est > 0.0 {
                self.default_est = max_est;
            }
            let mut outstanding = 0.0;
            let mut unknown = 0u64;
            for &i in &used {
                let t = &self.tracks[i];
                let left = self.gate.slots[i]
                    .launches
                    .load(Ordering::Acquire)
                    .saturating_sub(t.completed);
                let est = if t.est_ns > 0.0 {
                    t.est_ns
                } else {
                    self.default_est
                };
                if est > 0.0 {
                    outstanding += left as f64 * est;
                } else {
                    unknown += left;
                }
            }
            let credits = self.credits_for(deadline - now, outstanding, unknown);
            if credit_taken(handed, self.gate.set_credits(credits)) {
                // Taken between the look above and the refill.
                last_change = now;
                drained_since = None;
            }
            handed = credits;
        }
        // Lease end: stop launching, drain, report.
        let untouched = !credit_taken(handed, self.gate.set_credits(0));
        let busy_ns = if drained_since.is_some() && untouched {
            // Every stream was seen drained and no launch took a credit since: nothing is in
            // flight, so there is nothing to wait for, and the lease was busy (and is charged)
            // until now.
            start.elapsed().as_nanos() as u64
        } else {
            self.drain(epoch, start)
        };
        let early = early
            || idle_at_end(
                drained_since.map(|t| t.elapsed()),
                drain_idle,
                untouched,
                self.gate.waiters(),
                last_change.elapsed(),
            );
        if early {
            self.gate.stats.early.fetch_add(1, Ordering::Relaxed);
            self.handed_back = drained_since;
        }
        self.gate
            .stats
            .busy_ns
            .fetch_add(busy_ns, Ordering::Relaxed);
        tlog!(
            Debug,
            "lease {lease_id:?}: {:.1} ms granted, busy {:.1} ms, early {early}, synchronise wakes {sync_wakes}, drain wait {} us",
            duration_ns as f64 / 1e6,
            busy_ns as f64 / 1e6,
            drain_idle.as_micros()
        );
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

    /// Spins for up to `wait` (at most [`SPIN`]), until then or until a launch takes a credit
    /// (or finds none: a waiter), whichever comes first. It never calls `sched_yield`: under
    /// CPU load that gives away a whole time slice (measured: hand-over p50 3.4 ms).
    fn spin(&self, wait: Duration, handed: i64) {
        let until = Instant::now() + wait;
        while Instant::now() < until && self.gate.credits.load(Ordering::Acquire) == handed {
            std::hint::spin_loop();
        }
    }

    /// Credits that keep the estimated work in flight within `left`. `unknown`: launches in
    /// flight whose cost nothing measured yet.
    fn credits_for(&self, left: Duration, outstanding: f64, unknown: u64) -> i64 {
        let per = self.default_est;
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

    /// Lets launches that took a credit before it dropped to zero return from the driver,
    /// records an end event on every stream of the lease, polls them (bounded), and returns
    /// the time from the grant to the completion of the last one.
    fn drain(&mut self, epoch: u64, start: Instant) -> u64 {
        let total = |m: &mut Self| -> u64 {
            let _t = m.gate.lock_table();
            let used = m.used(epoch);
            used.iter()
                .map(|&i| m.gate.slots[i].launches.load(Ordering::Acquire))
                .sum()
        };
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
        let Some(api) = self.api else {
            return start.elapsed().as_nanos() as u64;
        };
        let mut ends = Vec::new();
        {
            let _t = self.gate.lock_table();
            for i in self.used(epoch) {
                if let Some(s) = self.record(api, i) {
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
                .all(|(_, s)| unsafe { (api.ev_query)(s.ev) } != CUDA_ERROR_NOT_READY);
            if all || Instant::now() >= bound {
                break;
            }
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(Duration::from_micros(400));
        }
        let busy = start.elapsed().as_nanos() as u64;
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
        busy
    }
}

/// Resets the launch gate's thread-local cache after fork (the child builds a fresh gate).
pub fn reset_in_child() {
    CACHE.with(|c| c.set((0, 0, 0, 0, 0)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_classified_by_variant() {
        assert_eq!(
            classify(std::ptr::null_mut(), false),
            (0, StreamKind::Legacy)
        );
        assert_eq!(
            classify(std::ptr::null_mut(), true),
            (0, StreamKind::PerThread)
        );
        assert_eq!(classify(1usize as CUstream, true), (0, StreamKind::Legacy));
        assert_eq!(
            classify(2usize as CUstream, false),
            (0, StreamKind::PerThread)
        );
        assert_eq!(
            classify(0x5000usize as CUstream, false),
            (0x5000, StreamKind::Explicit)
        );
        assert_eq!(
            classify(0x5000usize as CUstream, true),
            (0x5000, StreamKind::Explicit)
        );
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
    fn a_closed_gate_fails_every_launch_without_running_it() {
        let gate: &'static Gate = Box::leak(Box::new(Gate::new(None, "t".into()).closed()));
        for _ in 0..3 {
            let r = gate.launch(std::ptr::null_mut(), false, || {
                panic!("a closed gate ran a launch")
            });
            assert_eq!(r, CUDA_ERROR_NOT_PERMITTED);
        }
        assert_eq!(gate.credits.load(Ordering::Relaxed), 0, "no credit leaked");
    }

    #[test]
    fn credits_bound_the_work_in_flight() {
        let gate: &'static Gate = Box::leak(Box::new(Gate::new(None, "t".into())));
        let mut m = Manager::new(gate);
        // Nothing known: one probe at a time.
        assert_eq!(m.credits_for(Duration::from_millis(20), 0.0, 0), 1);
        assert_eq!(m.credits_for(Duration::from_millis(20), 0.0, 1), 0);
        // 1 ms kernels, 20 ms left, 5 ms in flight: 14.7 ms of room = 14 launches.
        m.default_est = 1e6;
        assert_eq!(m.credits_for(Duration::from_millis(20), 5e6, 0), 14);
        // Launches of unknown cost count at the known pace.
        assert_eq!(m.credits_for(Duration::from_millis(20), 5e6, 2), 12);
        // No room left: none.
        assert_eq!(m.credits_for(Duration::from_millis(2), 5e6, 0), 0);
        // A kernel longer than the lease still gets one launch when nothing is in flight.
        m.default_est = 30e6;
        assert_eq!(m.credits_for(Duration::from_millis(20), 0.0, 0), 1);
        assert_eq!(m.credits_for(Duration::from_millis(20), 30e6, 0), 0);
        // Tiny kernels: capped.
        m.default_est = 10.0;
        assert_eq!(
            m.credits_for(Duration::from_millis(100), 0.0, 0),
            MAX_CREDITS
        );
    }
}
