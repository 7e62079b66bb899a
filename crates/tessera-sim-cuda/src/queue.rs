//! Streams, events and the hand-off of kernels to the shared device engine.
//!
//! Each stream has a FIFO of operations and, once used, one worker thread that runs them in
//! order; `cuLaunchKernel` only enqueues. A kernel operation holds the device's cross-process
//! engine (`tessera_sim_state::Engine`) for its duration. The legacy default stream
//! synchronises with the other blocking streams of its context through `WaitStream`
//! operations inserted at enqueue time.
//!
//! A stream sees the context that owns it only through [`StreamOwner`], and a capture only as
//! the node list it records into, so this module imports neither `context` nor `graph`; the
//! entry points, which resolve handles in the current context, are in `stream`.

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::VecDeque;
use std::sync::{Arc, Weak};

use tessera_sim_state::Engine;
use tessera_sim_state::clock::monotonic_ns;

use crate::ffi::*;
use crate::runtime::{Registry, next_handle, rt};

/// What a stream needs of the context that owns it (implemented by `context::Context`).
pub trait StreamOwner: Send + Sync {
    /// The context's handle.
    fn id(&self) -> usize;
    /// The context's legacy default stream.
    fn legacy(&self) -> &Arc<Stream>;
    /// The context's live streams other than the legacy one.
    fn other_streams(&self) -> Vec<Arc<Stream>>;
}

/// One node of a graph, and one recorded step of a captured stream.
#[derive(Clone, Copy)]
pub enum Node {
    /// A kernel occupying the engine this many ns.
    Kernel(u64),
    /// A host function and its argument.
    Host(HostFn, usize),
}

/// A graph's node list, shared with the capture that records into it.
pub type Nodes = Arc<Mutex<Vec<Node>>>;

/// A stream capture in progress: what the stream is given is appended to a graph instead of run.
pub struct Capture {
    /// The handle of the graph being recorded.
    pub graph: usize,
    nodes: Nodes,
    /// A potentially unsafe call broke it (see `capture_mode`): its launches and its end fail.
    invalidated: std::sync::atomic::AtomicBool,
}

impl Capture {
    /// A capture into graph `graph`, whose nodes are `nodes`.
    pub fn new(graph: usize, nodes: Nodes) -> Self {
        Self {
            graph,
            nodes,
            invalidated: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Marks the capture as broken.
    pub fn invalidate(&self) {
        self.invalidated
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` once a potentially unsafe call broke it.
    pub fn check(&self) -> Result<(), CUresult> {
        if self.invalidated.load(std::sync::atomic::Ordering::Acquire) {
            Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        } else {
            Ok(())
        }
    }

    /// Records a kernel launch into the captured graph.
    pub fn add_kernel(&self, ns: u64) {
        lock(&self.nodes).push(Node::Kernel(ns));
    }

    /// Records a host function into the captured graph.
    pub fn add_host(&self, f: HostFn, data: usize) {
        lock(&self.nodes).push(Node::Host(f, data));
    }
}

/// Which of the kinds of stream this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    Legacy,
    PerThread,
    Normal,
}

/// One queued operation.
pub enum Op {
    /// Occupy the engine this many ns.
    Kernel(u64),
    /// Mark an event reached (generation).
    Record(Arc<Event>, u64),
    /// Wait until an event generation is reached.
    WaitEvent(Arc<Event>, u64),
    /// Wait until another stream has completed up to a sequence number.
    WaitStream(Arc<Stream>, u64),
    /// Run host code (cuLaunchHostFunc, stream-ordered frees).
    Host(Box<dyn FnOnce() + Send>),
}

struct Queue {
    ops: VecDeque<(u64, Op)>,
    submitted: u64,
    completed: u64,
    worker: bool,
    closing: bool,
    capture: Option<Arc<Capture>>,
}

/// A stream.
pub struct Stream {
    pub id: usize,
    pub device: u32,
    pub kind: StreamKind,
    pub flags: u32,
    pub priority: i32,
    pub ctx: Weak<dyn StreamOwner>,
    q: Mutex<Queue>,
    wake: Condvar,
    done: Condvar,
}

pub static STREAMS: Registry<Stream> = Registry::new();

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

impl Stream {
    pub fn new(
        ctx: Weak<dyn StreamOwner>,
        device: u32,
        kind: StreamKind,
        flags: u32,
        priority: i32,
    ) -> Arc<Stream> {
        Arc::new(Stream {
            id: next_handle(),
            device,
            kind,
            flags,
            priority,
            ctx,
            q: Mutex::new(Queue {
                ops: VecDeque::new(),
                submitted: 0,
                completed: 0,
                worker: false,
                closing: false,
                capture: None,
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
        })
    }

    fn blocking(&self) -> bool {
        self.flags & CU_STREAM_NON_BLOCKING == 0
    }

    /// (submitted, completed) sequence numbers.
    fn counts(&self) -> (u64, u64) {
        let q = lock(&self.q);
        (q.submitted, q.completed)
    }

    /// The capture this stream is recording into, if any.
    pub fn capture(&self) -> Option<Arc<Capture>> {
        lock(&self.q).capture.clone()
    }

    pub fn set_capture(&self, c: Option<Arc<Capture>>) {
        lock(&self.q).capture = c;
    }

    /// Enqueues `op` after the implicit waits the legacy default stream requires.
    pub fn enqueue(self: &Arc<Self>, op: Op) {
        let mut waits = Vec::new();
        if self.blocking()
            && let Some(ctx) = self.ctx.upgrade()
        {
            if self.kind == StreamKind::Legacy {
                for s in ctx.other_streams() {
                    if s.blocking() {
                        let (sub, comp) = s.counts();
                        if sub > comp {
                            waits.push(Op::WaitStream(s, sub));
                        }
                    }
                }
            } else {
                let (sub, comp) = ctx.legacy().counts();
                if sub > comp {
                    waits.push(Op::WaitStream(ctx.legacy().clone(), sub));
                }
            }
        }
        let mut q = lock(&self.q);
        for op in waits.into_iter().chain(std::iter::once(op)) {
            q.submitted += 1;
            let seq = q.submitted;
            q.ops.push_back((seq, op));
        }
        if !q.worker {
            q.worker = true;
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("tessera-sim-stream".into())
                .spawn(move || me.work());
            if spawned.is_err() {
                q.worker = false;
            }
        }
        drop(q);
        self.wake.notify_one();
    }

    fn work(self: Arc<Self>) {
        let mut engine: Option<Engine> = None;
        loop {
            let (seq, op) = {
                let mut q = lock(&self.q);
                loop {
                    if let Some(x) = q.ops.pop_front() {
                        break x;
                    }
                    if q.closing {
                        q.worker = false;
                        return;
                    }
                    self.wake.wait(&mut q);
                }
            };
            match op {
                Op::Kernel(ns) => self.run_kernel(&mut engine, ns),
                Op::Record(ev, gen_) => ev.complete(gen_),
                Op::WaitEvent(ev, gen_) => ev.wait_for(gen_),
                Op::WaitStream(s, target) => s.wait_seq(target),
                Op::Host(f) => {
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
                }
            }
            let mut q = lock(&self.q);
            q.completed = seq;
            drop(q);
            self.done.notify_all();
        }
    }

    fn run_kernel(&self, engine: &mut Option<Engine>, ns: u64) {
        if ns == 0 {
            return;
        }
        let Ok(rt) = rt() else { return };
        if engine.is_none() {
            *engine = rt
                .open_engine(self.device)
                .ok()
                .map(|e| e.with_timeslice(timeslice()));
        }
        match engine {
            Some(e) => {
                // The kernel's own length (see `Engine::run`), not the wall time it took.
                let (start, end) = e.run(ns);
                let _ = rt.ledger.add_busy(self.device, (end - start).min(ns));
            }
            // The state folder vanished: still take the time, unshared.
            None => std::thread::sleep(std::time::Duration::from_nanos(
                ns.min(tessera_sim_state::engine::MAX_KERNEL_NS),
            )),
        }
    }

    fn wait_seq(&self, target: u64) {
        let mut q = lock(&self.q);
        while q.completed < target {
            self.done.wait(&mut q);
        }
    }

    /// Waits for everything submitted so far.
    pub fn synchronize(&self) {
        let target = lock(&self.q).submitted;
        self.wait_seq(target);
    }

    /// Whether all submitted work is done.
    pub fn idle(&self) -> bool {
        let (s, c) = self.counts();
        s == c
    }

    /// Lets the worker exit once the queue drains.
    pub fn close(&self) {
        lock(&self.q).closing = true;
        self.wake.notify_all();
    }
}

/// Drops a stream handle from the registry.
pub fn forget_stream(id: usize) {
    STREAMS.remove(id);
}

/// An event.
pub struct Event {
    pub id: usize,
    pub flags: u32,
    pub(crate) st: Mutex<EventState>,
    pub(crate) cv: Condvar,
}

pub(crate) struct EventState {
    pub(crate) recorded: u64,
    pub(crate) done: u64,
    pub(crate) ts_ns: u64,
}

pub static EVENTS: Registry<Event> = Registry::new();

impl Event {
    fn complete(&self, gen_: u64) {
        let mut st = lock(&self.st);
        st.done = st.done.max(gen_);
        if gen_ == st.recorded {
            st.ts_ns = monotonic_ns();
        }
        drop(st);
        self.cv.notify_all();
    }

    pub(crate) fn wait_for(&self, gen_: u64) {
        let mut st = lock(&self.st);
        while st.done < gen_ {
            self.cv.wait(&mut st);
        }
    }

    /// Records this event on `s` (counted as a new generation).
    pub fn record(self: &Arc<Self>, s: &Arc<Stream>) {
        if s.capture().is_some() {
            return;
        }
        let gen_ = {
            let mut st = lock(&self.st);
            st.recorded += 1;
            st.recorded
        };
        s.enqueue(Op::Record(self.clone(), gen_));
    }

    /// The generation to wait for, if the event has been recorded and is not reached yet.
    pub fn pending(&self) -> Option<u64> {
        let st = lock(&self.st);
        (st.done < st.recorded).then_some(st.recorded)
    }
}

/// A `CUhostFn`.
pub type HostFn = CUhostFn;

/// The stream operation that calls `f(data)`.
pub fn host_op(f: HostFn, data: usize) -> Op {
    // SAFETY: the caller registered `f` to be called with `data` once the stream gets there.
    Op::Host(Box::new(move || unsafe {
        f(data as *mut std::ffi::c_void)
    }))
}

/// The time-slicing setting of this process (`TESSERA_SIM_TIMESLICE`, on unless `off`), read
/// once; a bad value is said once on stderr and leaves the default slices.
fn timeslice() -> Option<tessera_sim_state::timeslice::Params> {
    static SETTING: std::sync::OnceLock<Option<tessera_sim_state::timeslice::Params>> =
        std::sync::OnceLock::new();
    *SETTING.get_or_init(|| {
        let text = std::env::var(tessera_sim_state::ENV_TIMESLICE).unwrap_or_default();
        tessera_sim_state::timeslice::Params::parse(&text).unwrap_or_else(|e| {
            eprintln!(
                "tessera-sim: {}: {e}; the default time slices",
                tessera_sim_state::ENV_TIMESLICE
            );
            Some(tessera_sim_state::timeslice::Params::default())
        })
    })
}
