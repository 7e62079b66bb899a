//! The driver functions the launch gate uses (contexts, events, capture status) behind one
//! trait, [`Events`]: [`DriverEvents`] calls the real driver, and a fake (tests only) plays
//! streams whose work the test completes by hand.

use std::ffi::c_void;
use std::sync::OnceLock;

use crate::driver;
use crate::ffi::*;

/// What `cuEventQuery` said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Query {
    /// The work before the event completed.
    Done,
    /// Still in flight.
    NotReady,
    /// Any other answer (the event is no use any more).
    Failed,
}

/// The driver's context and event functions the lease manager needs.
///
/// Handles are the driver's; the `unsafe` methods pass them to it as they are.
pub trait Events {
    /// The calling thread's current context (`None`: none, or the call failed).
    fn current_context(&self) -> Option<CUcontext>;

    /// Makes `ctx` current on the calling thread.
    ///
    /// # Safety
    /// `ctx` is a live context (one a launching thread had current).
    unsafe fn set_context(&self, ctx: CUcontext) -> bool;

    /// A timing event in the current context.
    ///
    /// # Safety
    /// A context is current on the calling thread.
    unsafe fn create(&self) -> Option<CUevent>;

    /// Records `ev` on `stream`.
    ///
    /// # Safety
    /// `ev` is an event of ours and `stream` a live stream (or the legacy one) of its context.
    unsafe fn record(&self, ev: CUevent, stream: CUstream) -> bool;

    /// Whether the work before `ev` completed.
    ///
    /// # Safety
    /// `ev` is an event of ours.
    unsafe fn query(&self, ev: CUevent) -> Query;

    /// Milliseconds between two completed events.
    ///
    /// # Safety
    /// Both are completed events of ours.
    unsafe fn elapsed_ms(&self, from: CUevent, to: CUevent) -> Option<f32>;

    /// Destroys `ev`.
    ///
    /// # Safety
    /// `ev` is an event of ours, not used again.
    unsafe fn destroy(&self, ev: CUevent);

    /// Whether `stream` is capturing into a graph (false when the driver cannot tell).
    ///
    /// # Safety
    /// `stream` is the application's live stream.
    unsafe fn is_capturing(&self, stream: CUstream) -> bool;
}

/// Real driver functions (resolved from the driver, never hooked).
#[derive(Clone, Copy)]
pub struct DriverEvents {
    ctx_get: cuCtxGetCurrent_t,
    ctx_set: cuCtxSetCurrent_t,
    ev_create: cuEventCreate_t,
    ev_record: cuEventRecord_t,
    ev_query: cuEventQuery_t,
    ev_elapsed: cuEventElapsedTime_t,
    ev_destroy: cuEventDestroy_v2_t,
    is_capturing: Option<cuStreamIsCapturing_t>,
    capture_mode: Option<cuThreadExchangeStreamCaptureMode_t>,
}

impl std::fmt::Debug for DriverEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverEvents").finish_non_exhaustive()
    }
}

impl DriverEvents {
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
            capture_mode: sym!(
                c"cuThreadExchangeStreamCaptureMode",
                cuThreadExchangeStreamCaptureMode_t
            ),
        })
    }

    /// Puts the calling thread (the lease manager) in the relaxed capture mode, so that its
    /// event calls while an application thread captures a CUDA graph in the default global
    /// mode neither fail nor invalidate that capture: in the global mode a potentially unsafe
    /// call from any other thread ends the capture with `cudaErrorStreamCaptureInvalidated`
    /// (seen on an H200: PyTorch's `torch.cuda.graph` failed under Tessera in one run of two,
    /// "operation failed due to a previous error during capture"). PyTorch's own caching
    /// allocator does the same around `cudaMalloc`. Returns whether the driver took it.
    pub fn relax_capture_mode(&self) -> bool {
        let Some(f) = self.capture_mode else {
            return false;
        };
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: in-out pointer to a local `CUstreamCaptureMode`; affects the calling thread.
        unsafe { f(&mut mode) == CUDA_SUCCESS }
    }
}

#[cfg(test)]
impl DriverEvents {
    /// An event API that does nothing and succeeds: for gate tests whose fake manager never
    /// calls it, so the gate believes the driver can gate launches.
    pub(super) fn inert() -> Option<Self> {
        unsafe extern "C" fn ok1<T>(_: T) -> CUresult {
            CUDA_SUCCESS
        }
        unsafe extern "C" fn ok2<T, U>(_: T, _: U) -> CUresult {
            CUDA_SUCCESS
        }
        unsafe extern "C" fn ok3<T, U, V>(_: T, _: U, _: V) -> CUresult {
            CUDA_SUCCESS
        }
        Some(Self {
            ctx_get: ok1::<*mut CUcontext>,
            ctx_set: ok1::<CUcontext>,
            ev_create: ok2::<*mut CUevent, std::ffi::c_uint>,
            ev_record: ok2::<CUevent, CUstream>,
            ev_query: ok1::<CUevent>,
            ev_elapsed: ok3::<*mut f32, CUevent, CUevent>,
            ev_destroy: ok1::<CUevent>,
            is_capturing: None,
            capture_mode: None,
        })
    }
}

static DRIVER: OnceLock<Option<DriverEvents>> = OnceLock::new();

/// The real driver's functions, resolved once (`None`: a driver without the event API, where
/// launches cannot be gated).
pub fn driver_events() -> Option<DriverEvents> {
    *DRIVER.get_or_init(DriverEvents::load)
}

impl Events for DriverEvents {
    fn current_context(&self) -> Option<CUcontext> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the driver writes the calling thread's context.
        let r = unsafe { (self.ctx_get)(&mut ctx) };
        (r == CUDA_SUCCESS && !ctx.is_null()).then_some(ctx)
    }

    unsafe fn set_context(&self, ctx: CUcontext) -> bool {
        // SAFETY: the caller passes a live context.
        unsafe { (self.ctx_set)(ctx) == CUDA_SUCCESS }
    }

    unsafe fn create(&self) -> Option<CUevent> {
        let mut ev = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the caller made a context current.
        (unsafe { (self.ev_create)(&mut ev, CU_EVENT_DEFAULT) } == CUDA_SUCCESS).then_some(ev)
    }

    unsafe fn record(&self, ev: CUevent, stream: CUstream) -> bool {
        // SAFETY: the caller passes our event and a live stream of its context.
        unsafe { (self.ev_record)(ev, stream) == CUDA_SUCCESS }
    }

    unsafe fn query(&self, ev: CUevent) -> Query {
        // SAFETY: the caller passes our own event.
        match unsafe { (self.ev_query)(ev) } {
            CUDA_SUCCESS => Query::Done,
            CUDA_ERROR_NOT_READY => Query::NotReady,
            _ => Query::Failed,
        }
    }

    unsafe fn elapsed_ms(&self, from: CUevent, to: CUevent) -> Option<f32> {
        let mut ms = 0f32;
        // SAFETY: out-pointer to a local; the caller passes two completed events of ours.
        let r = unsafe { (self.ev_elapsed)(&mut ms, from, to) };
        (r == CUDA_SUCCESS).then_some(ms)
    }

    unsafe fn destroy(&self, ev: CUevent) {
        // SAFETY: the caller passes our own event, not used again.
        unsafe { (self.ev_destroy)(ev) };
    }

    unsafe fn is_capturing(&self, stream: CUstream) -> bool {
        let Some(f) = self.is_capturing else {
            return false;
        };
        let mut status: i32 = 0;
        // SAFETY: out-pointer to a local; the caller passes the application's live stream.
        let r = unsafe { f(stream, &mut status) };
        r == CUDA_SUCCESS && status != 0
    }
}

/// A driver without a GPU for tests: streams are handles, each with launches submitted and
/// completed by the test ([`FakeEvents::submit`], [`FakeEvents::complete`]) on a fake GPU
/// clock; an event completes when its stream completed what was submitted before it.
#[cfg(test)]
#[derive(Debug, Default)]
pub struct FakeEvents {
    inner: std::cell::RefCell<Fake>,
}

#[cfg(test)]
#[derive(Debug, Default)]
struct Fake {
    /// Per stream handle: (submitted, completed).
    streams: std::collections::HashMap<usize, (u64, u64)>,
    /// Per live event: (stream, launches before it, completion time in ms once complete).
    events: std::collections::HashMap<usize, (usize, u64, Option<f32>)>,
    next_event: usize,
    current: usize,
    gpu_ms: f32,
    created: u64,
    destroyed: u64,
    records: u64,
}

#[cfg(test)]
impl FakeEvents {
    /// `n` more launches on `stream` (the gate's slot counts them separately).
    pub fn submit(&self, stream: usize, n: u64) {
        self.inner.borrow_mut().streams.entry(stream).or_default().0 += n;
    }

    /// Launches up to `upto` on `stream` completed at GPU time `at_ms`.
    pub fn complete(&self, stream: usize, upto: u64, at_ms: f32) {
        let mut f = self.inner.borrow_mut();
        f.gpu_ms = at_ms;
        let s = f.streams.entry(stream).or_default();
        s.1 = s.1.max(upto);
        let done = s.1;
        for e in f.events.values_mut() {
            if e.0 == stream && e.2.is_none() && e.1 <= done {
                e.2 = Some(at_ms);
            }
        }
    }

    /// Events created, destroyed, and recorded so far.
    pub fn counts(&self) -> (u64, u64, u64) {
        let f = self.inner.borrow();
        (f.created, f.destroyed, f.records)
    }
}

#[cfg(test)]
impl Events for FakeEvents {
    fn current_context(&self) -> Option<CUcontext> {
        let c = self.inner.borrow().current;
        (c != 0).then_some(c as CUcontext)
    }

    unsafe fn set_context(&self, ctx: CUcontext) -> bool {
        self.inner.borrow_mut().current = ctx as usize;
        true
    }

    unsafe fn create(&self) -> Option<CUevent> {
        let mut f = self.inner.borrow_mut();
        f.next_event += 1;
        f.created += 1;
        Some((0x10_000 + f.next_event * 16) as CUevent)
    }

    unsafe fn record(&self, ev: CUevent, stream: CUstream) -> bool {
        let mut f = self.inner.borrow_mut();
        let (submitted, completed) = *f.streams.entry(stream as usize).or_default();
        let at = (completed >= submitted).then_some(f.gpu_ms);
        f.events
            .insert(ev as usize, (stream as usize, submitted, at));
        f.records += 1;
        true
    }

    unsafe fn query(&self, ev: CUevent) -> Query {
        match self.inner.borrow().events.get(&(ev as usize)) {
            Some((_, _, Some(_))) => Query::Done,
            Some(_) => Query::NotReady,
            None => Query::Failed,
        }
    }

    unsafe fn elapsed_ms(&self, from: CUevent, to: CUevent) -> Option<f32> {
        let f = self.inner.borrow();
        let a = f.events.get(&(from as usize))?.2?;
        let b = f.events.get(&(to as usize))?.2?;
        Some(b - a)
    }

    unsafe fn destroy(&self, ev: CUevent) {
        let mut f = self.inner.borrow_mut();
        f.events.remove(&(ev as usize));
        f.destroyed += 1;
    }

    unsafe fn is_capturing(&self, _stream: CUstream) -> bool {
        false
    }
}
