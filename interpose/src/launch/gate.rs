//! The credit fast path and the stream slots: what every gated launch touches, and the slow
//! path of a launch that finds no credit (it asks for a lease and hands it to the manager).

use std::cell::Cell;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicI64, AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering,
};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::events::{DriverEvents, Events, driver_events};
use super::lease::Started;
use crate::ffi::*;
use crate::tlog;

/// Streams tracked per process (a launch on one more passes through untracked but gated).
pub const MAX_STREAMS: usize = 128;
/// Credits when launches cannot be gated at all (no manager thread, no event API).
const UNGATED: i64 = i64::MAX / 4;

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
    pub(super) handle: AtomicUsize,
    /// A [`StreamKind`], or `u8::MAX` for a capturing stream.
    pub(super) kind: AtomicU8,
    pub(super) ctx: AtomicPtr<c_void>,
    /// Launches that returned from the driver on this stream (ever).
    pub(super) launches: AtomicU64,
    /// `launches` when the slot was given to its current stream.
    pub(super) base: AtomicU64,
    /// Last lease epoch the stream was launched on.
    pub(super) used_epoch: AtomicU64,
    pub(super) in_use: AtomicBool,
    /// Bumped when the slot is given to another stream.
    pub(super) generation: AtomicU64,
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

/// A lease a launcher received and started, for the manager thread to run.
#[derive(Debug)]
pub(super) struct Begun {
    pub(super) started: Started,
    /// The epoch it started.
    pub(super) epoch: u64,
}

/// The lease manager as the gate sees it. The manager (module `manager`) depends on the gate,
/// not the other way round: the gate gets one from the constructor it was made with.
pub(super) trait Manage: Send {
    /// On the launcher that found no credit at `asked`: gets a lease (from the arbiter, or a
    /// local one when it cannot be reached) and starts it: credits are out when this returns.
    fn acquire_and_begin(&mut self, asked: u64) -> Begun;
    /// On the manager thread: runs a begun lease to its end and reports it.
    fn run_lease(&mut self, begun: Begun);
}

/// Makes the process's lease manager (once, on the first launch that finds no credit).
pub(super) type NewManager = fn(&'static Gate, DriverEvents) -> Box<dyn Manage>;

#[derive(Debug, Default)]
pub(super) struct Shared {
    /// Threads waiting for a credit.
    pub(super) waiters: u32,
    /// An application thread returned from a synchronise since the manager last looked.
    pub(super) synced: bool,
    /// A launcher is asking the arbiter for a lease.
    acquiring: bool,
    /// A lease a launcher received, not yet taken over by the manager.
    begun: Option<Begun>,
    /// The manager is running a lease (from taking it over until its release went out).
    leasing: bool,
    manager_started: bool,
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
    pub(super) credits: AtomicI64,
    /// Launchers holding a credit whose launch is not counted on its stream yet: the manager
    /// sees no drain (and ends no lease) while one is there, however long the launcher is
    /// descheduled between the credit and the count (a CPU hog showed kernels enqueued after
    /// their lease was reported drained, run outside any lease).
    pub(super) launching: AtomicI64,
    pub(super) epoch: AtomicU64,
    pub(super) slots: Box<[Slot]>,
    table: Mutex<()>,
    shared: Mutex<Shared>,
    launchers: Condvar,
    pub(super) manager: Condvar,
    /// The manager's state: lease connection, per-stream tracks. Locked by the launcher that
    /// asks for a lease, then by the manager thread for the lease's life.
    mgr: Mutex<Option<Box<dyn Manage>>>,
    new_manager: NewManager,
    pub(super) socket: Option<PathBuf>,
    pub(super) token: String,
    /// Where the lease connection gets a companion ticket from the process's admitted memory
    /// connection (wired by the process state, [`Gate::with_companion`]; none by default).
    pub(super) companion: fn() -> Option<u64>,
    /// The process cannot prove its allocation: every launch fails (see [`Gate::closed`]).
    closed: bool,
    /// The lease manager panicked (in a launcher asking for a lease, or on its thread): the
    /// gate is closed from then on, every launch fails instead of waiting for a lease that
    /// never comes (see [`Gate::fail`]).
    failed: AtomicBool,
    /// Where the driver's event API comes from ([`driver_events`]; a fake in unit tests).
    events: fn() -> Option<DriverEvents>,
    /// The lease connection's fd (closed by hand in a forked child).
    pub(super) lease_fd: AtomicI32,
    /// Set while the manager waits for work in flight to drain: a synchronise returning then
    /// wakes it, so the drain is seen at once rather than at its next timed look.
    pub(super) watch: AtomicBool,
    /// The origin of the lease clock ([`Gate::now_ns`]).
    origin: Instant,
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
    /// A gate that will lease from the arbiter at `socket` with `token`, through the manager
    /// `new_manager` makes.
    pub(super) fn with_manager(
        socket: Option<PathBuf>,
        token: String,
        new_manager: NewManager,
    ) -> Self {
        Self {
            credits: AtomicI64::new(0),
            launching: AtomicI64::new(0),
            epoch: AtomicU64::new(1),
            slots: (0..MAX_STREAMS).map(|_| Slot::new()).collect(),
            table: Mutex::new(()),
            shared: Mutex::new(Shared::default()),
            launchers: Condvar::new(),
            manager: Condvar::new(),
            mgr: Mutex::new(None),
            new_manager,
            socket,
            token,
            companion: || None,
            closed: false,
            failed: AtomicBool::new(false),
            events: driver_events,
            lease_fd: AtomicI32::new(-1),
            watch: AtomicBool::new(false),
            origin: Instant::now(),
            stats: GateStats::default(),
        }
    }

    /// The same gate, whose lease connection asks `ticket` for a companion ticket (the memory
    /// connection lives above this module, so it is passed in rather than imported).
    pub fn with_companion(mut self, ticket: fn() -> Option<u64>) -> Self {
        self.companion = ticket;
        self
    }

    /// The same gate with another source of the driver's event API (unit tests).
    #[cfg(test)]
    pub(super) fn with_events(mut self, events: fn() -> Option<DriverEvents>) -> Self {
        self.events = events;
        self
    }

    /// A gate that never grants: every launch returns `CUDA_ERROR_NOT_PERMITTED` without
    /// running (a process that cannot prove its allocation must not use GPU time ungated).
    pub fn closed(mut self) -> Self {
        self.closed = true;
        self
    }

    /// The lease clock: nanoseconds since the gate was made.
    pub(super) fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    pub(super) fn lock_shared(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock_table(&self) -> MutexGuard<'_, ()> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// ---- the fast path: a credit per launch, and each stream's slot ---------------------------

impl Gate {
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
        if !self.take_credit() {
            if self.closed || !self.wait_for_credit() {
                // No lease ever comes: credits stay at or below zero, so this is the slow path.
                self.credits.fetch_add(1, Ordering::AcqRel);
                return CUDA_ERROR_NOT_PERMITTED;
            }
            // Waiting may have spanned a new lease: mark the stream under its epoch.
            slot = self.slot(handle, kind);
        }
        let r = launch();
        if let Some(s) = slot {
            s.launches.fetch_add(1, Ordering::Release);
        }
        // After the count: a manager that sees no launcher here sees the launch counted.
        self.launching.fetch_sub(1, Ordering::Release);
        r
    }

    /// Takes one credit (true), marking the caller as launching until its launch is counted;
    /// false, unmarked, when there was none (the credits are then one lower, as every taker
    /// leaves them).
    #[inline]
    fn take_credit(&self) -> bool {
        self.launching.fetch_add(1, Ordering::AcqRel);
        if self.credits.fetch_sub(1, Ordering::AcqRel) > 0 {
            return true;
        }
        self.launching.fetch_sub(1, Ordering::AcqRel);
        false
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
        let ev = driver_events()?;
        let ctx = ev.current_context()?;
        let capturing = kind == StreamKind::Explicit
            // SAFETY: the application launches on `handle` now: a live stream.
            && unsafe { ev.is_capturing(handle as CUstream) };
        let idx = self.assign(handle, kind, ctx, capturing, epoch)?;
        let me = self as *const Self as usize;
        CACHE.with(|c| c.set((me, handle, kind as u8, idx + 1, epoch)));
        Some(&self.slots[idx])
    }

    /// Gives stream `handle` of `ctx` a slot (its own if it has one), marked used in `epoch`.
    fn assign(
        &self,
        handle: usize,
        kind: StreamKind,
        ctx: CUcontext,
        capturing: bool,
        epoch: u64,
    ) -> Option<usize> {
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
        Some(idx)
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
}

// ---- the slow path to a lease, and what the manager thread and the hooks tell the gate ----

impl Gate {
    /// Without a credit: the first waiting launcher asks the arbiter for the lease itself and
    /// starts it (so the grant wakes the thread that launches, not a manager that would then
    /// have to wake it), then hands it to the manager thread to run; other launchers wait.
    /// False when the gate has failed ([`Gate::fail`]): the launch must not run.
    #[cold]
    fn wait_for_credit(&'static self) -> bool {
        let asked = self.now_ns();
        let mut sh = self.lock_shared();
        if !sh.manager_started {
            sh.manager_started = true;
            if (self.events)().is_none() {
                tlog!(
                    Warn,
                    "the driver lacks the event API: kernel launches are not gated"
                );
                self.credits.store(UNGATED, Ordering::Release);
                self.launching.fetch_add(1, Ordering::AcqRel);
                return true;
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
                self.launching.fetch_add(1, Ordering::AcqRel);
                return true;
            }
        }
        loop {
            if self.failed.load(Ordering::Acquire) {
                return false;
            }
            if self.take_credit() {
                return true;
            }
            if !sh.acquiring && !sh.leasing && sh.begun.is_none() {
                sh.acquiring = true;
                drop(sh);
                let begun = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.acquire_and_begin(asked)
                }));
                let begun = match begun {
                    Ok(b) => b,
                    Err(_) => {
                        // The manager's state is unknown: drop it (its lease connection with
                        // it, so the arbiter ends the lease) and close the gate.
                        *self.lock_mgr() = None;
                        self.fail("asking for a lease");
                        return false;
                    }
                };
                sh = self.lock_shared();
                sh.acquiring = false;
                sh.begun = begun;
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

    /// The lease manager panicked while `what`: no lease will be run or reported again, so the
    /// gate closes for good rather than leave launchers waiting for one. It logs once, takes
    /// every credit away and wakes every waiter; their launches (and all later ones) fail with
    /// `CUDA_ERROR_NOT_PERMITTED`, so the application sees an error instead of a hang, and it
    /// never runs GPU work outside a lease.
    fn fail(&self, what: &str) {
        let mut sh = self.lock_shared();
        if !self.failed.swap(true, Ordering::AcqRel) {
            tlog!(
                Error,
                "the lease manager failed while {what}: kernel launches now fail with CUDA_ERROR_NOT_PERMITTED"
            );
        }
        self.credits.store(i64::MIN / 2, Ordering::Release);
        sh.acquiring = false;
        sh.leasing = false;
        sh.begun = None;
        self.launchers.notify_all();
    }

    fn lock_mgr(&self) -> MutexGuard<'_, Option<Box<dyn Manage>>> {
        self.mgr.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gets a lease (from the arbiter, or a local one when it cannot be reached) and starts it:
    /// credits are out when this returns. `asked`: when the launch found no credit.
    fn acquire_and_begin(&'static self, asked: u64) -> Option<Begun> {
        let mut guard = self.lock_mgr();
        if guard.is_none() {
            let Some(events) = (self.events)() else {
                // Unreachable: the manager starts only with the event API.
                self.set_credits(UNGATED);
                return None;
            };
            *guard = Some((self.new_manager)(self, events));
        }
        let m = guard.as_mut()?;
        Some(m.acquire_and_begin(asked))
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
    pub(super) fn set_credits(&self, n: i64) -> i64 {
        let _sh = self.lock_shared();
        let old = self.credits.swap(n, Ordering::AcqRel);
        if n > 0 {
            self.launchers.notify_all();
        }
        old
    }

    pub(super) fn waiters(&self) -> u32 {
        self.lock_shared().waiters
    }

    /// The manager thread: runs each lease a launcher began.
    fn manage(&'static self) {
        // The manager's short timed waits decide how soon an idle lease goes back: the default
        // 50 us timer slack would stretch each by up to that much. Only this thread changes.
        // SAFETY: PR_SET_TIMERSLACK takes an integer argument and affects the calling thread.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
        // Its event calls must not break an application's graph capture (see
        // `DriverEvents::relax_capture_mode`).
        if let Some(ev) = (self.events)()
            && !ev.relax_capture_mode()
        {
            tlog!(
                Debug,
                "cuThreadExchangeStreamCaptureMode unavailable: the lease manager keeps the global capture mode"
            );
        }
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
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    if let Some(m) = guard.as_mut() {
                        m.run_lease(begun);
                    }
                }));
                if ran.is_err() {
                    // As in `wait_for_credit`: the lease connection goes with the manager.
                    *guard = None;
                    drop(guard);
                    self.fail("running a lease");
                    continue;
                }
            }
            // Threads still waiting: one of them asks for the next lease.
            let mut sh = self.lock_shared();
            sh.leasing = false;
            if sh.waiters > 0 {
                self.launchers.notify_all();
            }
        }
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

    /// Test set-up: gives slot-less stream `handle` of `ctx` a slot under `epoch`, as a launch
    /// on it would.
    #[cfg(test)]
    pub(super) fn use_stream(&self, handle: usize, ctx: CUcontext, epoch: u64) -> usize {
        self.assign(handle, StreamKind::Explicit, ctx, false, epoch)
            .expect("a free slot")
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
    fn a_stream_keeps_its_slot_until_destroyed() {
        let gate: &'static Gate = Box::leak(Box::new(Gate::new(None, "t".into())));
        let ctx = 0x77usize as CUcontext;
        let a = gate.use_stream(0x5000, ctx, 2);
        assert_eq!(gate.use_stream(0x5000, ctx, 3), a, "same stream, same slot");
        assert_eq!(gate.slots[a].used_epoch.load(Ordering::Relaxed), 3);
        let b = gate.use_stream(0x6000, ctx, 3);
        assert_ne!(a, b);
        let generation = gate.slots[a].generation.load(Ordering::Relaxed);
        let r = gate.stream_destroyed(0x5000usize as CUstream, || CUDA_SUCCESS);
        assert_eq!(r, CUDA_SUCCESS);
        assert!(!gate.slots[a].in_use.load(Ordering::Relaxed));
        assert_eq!(
            gate.slots[a].generation.load(Ordering::Relaxed),
            generation + 1,
            "the manager sees a new stream in the slot"
        );
        assert_eq!(gate.use_stream(0x7000, ctx, 4), a, "the slot is reused");
    }

    /// A lease manager that grants one credit per lease and panics where told to.
    struct Panicky {
        gate: &'static Gate,
        panic_acquiring: bool,
    }

    impl Manage for Panicky {
        fn acquire_and_begin(&mut self, asked: u64) -> Begun {
            assert!(
                !self.panic_acquiring,
                "injected: a panic asking for a lease"
            );
            self.gate.set_credits(1);
            Begun {
                started: Started {
                    id: Some(1),
                    duration_ns: 1_000_000,
                    start: asked,
                    first: 1,
                    max_inflight_ns: None,
                    latency: false,
                },
                epoch: 1,
            }
        }

        fn run_lease(&mut self, _: Begun) {
            panic!("injected: a panic running a lease");
        }
    }

    fn panicky_gate(panic_acquiring: bool) -> &'static Gate {
        fn running(gate: &'static Gate, _: DriverEvents) -> Box<dyn Manage> {
            Box::new(Panicky {
                gate,
                panic_acquiring: false,
            })
        }
        fn asking(gate: &'static Gate, _: DriverEvents) -> Box<dyn Manage> {
            Box::new(Panicky {
                gate,
                panic_acquiring: true,
            })
        }
        let make: NewManager = if panic_acquiring { asking } else { running };
        Box::leak(Box::new(
            Gate::with_manager(None, "t".into(), make).with_events(DriverEvents::inert),
        ))
    }

    /// Launches from `threads` threads `per_thread` times each; every launch must return, and
    /// the codes are counted (success, not permitted).
    fn launch_from_threads(gate: &'static Gate, threads: usize, per_thread: usize) -> (u32, u32) {
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..threads {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for _ in 0..per_thread {
                    let r = gate.launch(std::ptr::null_mut(), false, || CUDA_SUCCESS);
                    tx.send(r).unwrap();
                }
            });
        }
        drop(tx);
        let (mut ok, mut refused) = (0, 0);
        for _ in 0..threads * per_thread {
            // A hang is the failure this guards against: every launch answers well within this.
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(CUDA_SUCCESS) => ok += 1,
                Ok(CUDA_ERROR_NOT_PERMITTED) => refused += 1,
                Ok(other) => panic!("launch returned {other}"),
                Err(e) => panic!("a launch never returned ({e}): the tenant hangs"),
            }
        }
        (ok, refused)
    }

    #[test]
    fn a_lease_manager_that_panics_running_a_lease_fails_launches_instead_of_hanging() {
        let gate = panicky_gate(false);
        let (ok, refused) = launch_from_threads(gate, 4, 50);
        // The first lease's one credit may be used before the manager panics; nothing after.
        assert!(ok <= 1, "{ok} launches ran after the lease manager died");
        assert_eq!(ok + refused, 200);
        assert!(gate.failed.load(Ordering::Relaxed));
        assert!(gate.lock_mgr().is_none(), "the broken manager was kept");
    }

    #[test]
    fn a_launcher_that_panics_asking_for_a_lease_fails_launches_instead_of_hanging() {
        let gate = panicky_gate(true);
        let (ok, refused) = launch_from_threads(gate, 4, 50);
        assert_eq!((ok, refused), (0, 200));
        assert!(gate.failed.load(Ordering::Relaxed));
        let sh = gate.lock_shared();
        assert!(!sh.acquiring && !sh.leasing, "left the gate mid-lease");
    }
}
