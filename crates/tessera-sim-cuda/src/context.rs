//! Primary and explicit contexts and the per-thread current-context stack.

use parking_lot::Mutex;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Once, OnceLock, Weak};

use crate::ffi::*;
use crate::queue::{Stream, StreamKind, StreamOwner};
use crate::runtime::{Registry, Res, gpu, guard, next_handle, ordinal, put, rt};

/// One context: a device, its legacy default stream and the streams made in it.
pub struct Context {
    pub id: usize,
    pub device: u32,
    pub primary: bool,
    pub flags: AtomicU32,
    pub alive: AtomicBool,
    pub legacy: Arc<Stream>,
    pub streams: Mutex<Vec<Weak<Stream>>>,
}

impl Context {
    fn new(device: u32, primary: bool, flags: u32) -> Arc<Context> {
        let id = next_handle();
        Arc::new_cyclic(|weak| Context {
            id,
            device,
            primary,
            flags: AtomicU32::new(flags),
            alive: AtomicBool::new(true),
            legacy: Stream::new(
                weak.clone() as Weak<dyn StreamOwner>,
                device,
                StreamKind::Legacy,
                0,
                0,
            ),
            streams: Mutex::new(Vec::new()),
        })
    }

    /// Makes a stream in this context and remembers it for implicit synchronisation.
    pub fn new_stream(
        self: &Arc<Self>,
        kind: StreamKind,
        flags: u32,
        priority: i32,
    ) -> Arc<Stream> {
        let owner: Weak<dyn StreamOwner> = Arc::downgrade(self) as Weak<Context>;
        let s = Stream::new(owner, self.device, kind, flags, priority);
        let mut list = self.streams.lock();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&s));
        s
    }

    /// Live streams of this context other than the legacy one.
    pub fn other_streams(&self) -> Vec<Arc<Stream>> {
        self.streams
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// Waits for all work submitted in this context.
    pub fn synchronize(&self) {
        self.legacy.synchronize();
        for s in self.other_streams() {
            s.synchronize();
        }
    }

    fn close(&self) {
        self.alive.store(false, Ordering::SeqCst);
        self.synchronize();
        self.legacy.close();
        for s in self.other_streams() {
            crate::queue::forget_stream(s.id);
            s.close();
        }
        let cleanups = CLEANUPS.lock().clone();
        for f in cleanups {
            f(self.id);
        }
        if let Ok(rt) = rt() {
            let _ = rt.ledger.context_changed(self.device, false);
        }
    }
}

impl StreamOwner for Context {
    fn id(&self) -> usize {
        self.id
    }

    fn legacy(&self) -> &Arc<Stream> {
        &self.legacy
    }

    fn other_streams(&self) -> Vec<Arc<Stream>> {
        Context::other_streams(self)
    }
}

pub static CONTEXTS: Registry<Context> = Registry::new();

/// What other modules free when a context is destroyed (its memory, its arrays), each given
/// the context's handle. They register on first use, so this module names none of them.
static CLEANUPS: Mutex<Vec<fn(usize)>> = Mutex::new(Vec::new());

/// Runs `f(context handle)` whenever a context is destroyed from now on; `once` makes repeated
/// registration from a hot path a single atomic load.
pub fn on_destroy(once: &'static Once, f: fn(usize)) {
    once.call_once(|| {
        CLEANUPS.lock().push(f);
    });
}

struct Primary {
    ctx: Option<Arc<Context>>,
    refs: u32,
    flags: u32,
}

fn primaries() -> &'static Vec<Mutex<Primary>> {
    static P: OnceLock<Vec<Mutex<Primary>>> = OnceLock::new();
    P.get_or_init(|| {
        (0..tessera_sim_state::MAX_GPUS)
            .map(|_| {
                Mutex::new(Primary {
                    ctx: None,
                    refs: 0,
                    flags: 0,
                })
            })
            .collect()
    })
}

thread_local! {
    static STACK: RefCell<Vec<Arc<Context>>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's current context, or `CUDA_ERROR_INVALID_CONTEXT`.
pub fn current() -> Result<Arc<Context>, CUresult> {
    rt()?;
    STACK
        .with(|s| s.borrow().last().cloned())
        .filter(|c| c.alive.load(Ordering::Relaxed))
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

fn lookup(h: Handle) -> Result<Arc<Context>, CUresult> {
    rt()?;
    CONTEXTS
        .get(h as usize)
        .filter(|c| c.alive.load(Ordering::Relaxed))
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

/// A context handle argument, or the current context when null.
pub fn ctx_or_current(h: Handle) -> Result<Arc<Context>, CUresult> {
    if h.is_null() { current() } else { lookup(h) }
}

/// The driver's answer to a failed context charge: `CUDA_ERROR_OUT_OF_MEMORY` when the card has
/// no room for the context's memory.
fn ledger_error(e: tessera_sim_state::LedgerError) -> CUresult {
    match e {
        tessera_sim_state::LedgerError::OutOfMemory { .. } => CUDA_ERROR_OUT_OF_MEMORY,
        _ => CUDA_ERROR_OPERATING_SYSTEM,
    }
}

fn primary_retain(dev: CUdevice) -> Result<Arc<Context>, CUresult> {
    let g = gpu(dev)?;
    let mut p = primaries()[g.index as usize].lock();
    // Charged before anything is made, so a card without room for the context leaves no trace.
    if p.refs == 0 {
        rt()?
            .ledger
            .context_changed(g.index, true)
            .map_err(ledger_error)?;
    }
    let ctx = match &p.ctx {
        Some(c) if c.alive.load(Ordering::Relaxed) => c.clone(),
        _ => {
            let c = Context::new(g.index, true, p.flags);
            CONTEXTS.insert(c.id, c.clone());
            p.ctx = Some(c.clone());
            c
        }
    };
    p.refs += 1;
    Ok(ctx)
}

fn primary_release(dev: CUdevice, all: bool) -> Res {
    let g = gpu(dev)?;
    let mut p = primaries()[g.index as usize].lock();
    if all {
        if let Some(c) = p.ctx.take() {
            CONTEXTS.remove(c.id);
            if p.refs > 0 {
                c.close();
            } else {
                c.alive.store(false, Ordering::SeqCst);
            }
        }
        p.refs = 0;
        return Ok(());
    }
    if p.refs == 0 {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    p.refs -= 1;
    if p.refs == 0
        && let Some(c) = p.ctx.take()
    {
        CONTEXTS.remove(c.id);
        c.close();
    }
    Ok(())
}

/// `cuDevicePrimaryCtxRetain`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut Handle, dev: CUdevice) -> CUresult {
    guard(|| {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let c = primary_retain(dev)?;
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(pctx, c.id as Handle) }
    })
}

/// `cuDevicePrimaryCtxRelease` (and `_v2`).
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    guard(|| primary_release(dev, false))
}

/// `cuDevicePrimaryCtxReset` (and `_v2`): destroys the primary context and its allocations.
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    guard(|| primary_release(dev, true))
}

/// `cuDevicePrimaryCtxGetState`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut u32,
    active: *mut i32,
) -> CUresult {
    guard(|| {
        let g = gpu(dev)?;
        let p = primaries()[g.index as usize].lock();
        // SAFETY: caller's out-pointers, null-checked by put.
        unsafe {
            put(flags, p.flags)?;
            put(active, i32::from(p.refs > 0))
        }
    })
}

/// `cuDevicePrimaryCtxSetFlags` (and `_v2`).
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: u32) -> CUresult {
    guard(|| {
        let g = gpu(dev)?;
        let mut p = primaries()[g.index as usize].lock();
        p.flags = flags;
        if let Some(c) = &p.ctx {
            c.flags.store(flags, Ordering::Relaxed);
        }
        Ok(())
    })
}

/// A new (non-primary) context on `dev`, charged to this process's memory on the card like
/// every context, and registered; `current`: pushed on the calling thread's stack.
fn new_context(pctx: *mut Handle, flags: u32, dev: CUdevice, current: bool) -> Res {
    if pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let g = gpu(dev)?;
    rt()?
        .ledger
        .context_changed(g.index, true)
        .map_err(ledger_error)?;
    let c = Context::new(g.index, false, flags);
    CONTEXTS.insert(c.id, c.clone());
    if current {
        STACK.with(|s| s.borrow_mut().push(c.clone()));
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { put(pctx, c.id as Handle) }
}

fn create(pctx: *mut Handle, flags: u32, dev: CUdevice) -> Res {
    new_context(pctx, flags, dev, true)
}

/// `cuCtxCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut Handle, flags: u32, dev: CUdevice) -> CUresult {
    guard(|| create(pctx, flags, dev))
}

/// `cuCtxCreate_v4` (CUDA 12.5+): the create-params are accepted and ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut Handle,
    _params: *mut std::ffi::c_void,
    flags: u32,
    dev: CUdevice,
) -> CUresult {
    guard(|| create(pctx, flags, dev))
}

// ---- green contexts (CUDA 12.4) ------------------------------------------------------------
//
// CUDA driver API reference, "Green Contexts": `cuDeviceGetDevResource` describes a device's
// resources (here its SMs), `cuDevResourceGenerateDesc` turns resources into a descriptor,
// `cuGreenCtxCreate(phCtx, desc, dev, flags)` makes a green context from it (`flags` must be
// `CU_GREEN_CTX_DEFAULT_STREAM`; the new context is not made current) and `cuGreenCtxDestroy`
// destroys it; `cuCtxFromGreenCtx` gives the `CUcontext` that stands for it. A green context
// has device state of its own like any context, so the simulator charges it like one.

/// `CU_DEV_RESOURCE_TYPE_SM`.
pub const CU_DEV_RESOURCE_TYPE_SM: i32 = 1;
/// `CU_GREEN_CTX_DEFAULT_STREAM`.
pub const CU_GREEN_CTX_DEFAULT_STREAM: u32 = 1;
/// `CUdevResource` (144 bytes: the type, 92 bytes of padding, then a 48-byte union whose SM
/// member is `{ unsigned int smCount; }`).
#[repr(C)]
pub struct CUdevResource {
    pub kind: i32,
    pub internal_padding: [u8; 92],
    pub sm_count: u32,
    pub oversize: [u8; 44],
}

/// `cuDeviceGetDevResource`: the device's SMs (the only resource type simulated).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetDevResource(
    dev: CUdevice,
    resource: *mut CUdevResource,
    kind: i32,
) -> CUresult {
    guard(|| {
        let sms = gpu(dev)?.sms;
        if resource.is_null() || kind != CU_DEV_RESOURCE_TYPE_SM {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null out-pointer to a CUdevResource from the caller.
        unsafe {
            resource.write(CUdevResource {
                kind,
                internal_padding: [0; 92],
                sm_count: sms,
                oversize: [0; 44],
            });
        }
        Ok(())
    })
}

/// `cuDevResourceGenerateDesc`: any non-empty set of SM resources makes a descriptor (an
/// opaque handle; the simulator does not partition its engine).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevResourceGenerateDesc(
    desc: *mut Handle,
    resources: *const CUdevResource,
    count: u32,
) -> CUresult {
    guard(|| {
        if desc.is_null() || resources.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(desc, next_handle() as Handle) }
    })
}

/// `cuGreenCtxCreate`: a context charged like `cuCtxCreate`'s, not made current.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGreenCtxCreate(
    pctx: *mut Handle,
    desc: Handle,
    dev: CUdevice,
    flags: u32,
) -> CUresult {
    guard(|| {
        if desc == 0 as Handle || flags != CU_GREEN_CTX_DEFAULT_STREAM {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        new_context(pctx, 0, dev, false)
    })
}

/// `cuGreenCtxDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuGreenCtxDestroy(ctx: Handle) -> CUresult {
    cuCtxDestroy_v2(ctx)
}

/// `cuCtxFromGreenCtx`: the green context's `CUcontext` (the same handle here).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxFromGreenCtx(pctx: *mut Handle, ctx: Handle) -> CUresult {
    guard(|| {
        let c = lookup(ctx)?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(pctx, c.id as Handle) }
    })
}

/// `cuCtxDestroy_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> CUresult {
    guard(|| {
        let c = lookup(ctx)?;
        if c.primary {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        CONTEXTS.remove(c.id);
        STACK.with(|s| s.borrow_mut().retain(|x| x.id != c.id));
        c.close();
        Ok(())
    })
}

/// `cuCtxPushCurrent_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: Handle) -> CUresult {
    guard(|| {
        let c = lookup(ctx)?;
        STACK.with(|s| s.borrow_mut().push(c));
        Ok(())
    })
}

/// `cuCtxPopCurrent_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut Handle) -> CUresult {
    guard(|| {
        rt()?;
        let c = STACK
            .with(|s| s.borrow_mut().pop())
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            // SAFETY: non-null out-pointer from the caller.
            unsafe { put(pctx, c.id as Handle) }?;
        }
        Ok(())
    })
}

/// `cuCtxSetCurrent`: replaces the top of the stack; null unbinds it.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    guard(|| {
        rt()?;
        if ctx.is_null() {
            STACK.with(|s| s.borrow_mut().pop());
            return Ok(());
        }
        let c = lookup(ctx)?;
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            s.pop();
            s.push(c);
        });
        Ok(())
    })
}

/// `cuCtxGetCurrent`: null when no context is bound.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut Handle) -> CUresult {
    guard(|| {
        rt()?;
        let h = STACK.with(|s| s.borrow().last().map(|c| c.id)).unwrap_or(0);
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(pctx, h as Handle) }
    })
}

/// `cuCtxGetDevice`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    guard(|| {
        let c = current()?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(dev, ordinal(c.device)?) }
    })
}

/// `cuCtxGetDevice_v2` (CUDA 13): the device of `ctx`, or of the current context when null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice_v2(dev: *mut CUdevice, ctx: Handle) -> CUresult {
    guard(|| {
        let c = ctx_or_current(ctx)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(dev, ordinal(c.device)?) }
    })
}

/// `cuCtxSynchronize`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    guard(|| {
        crate::capture_mode::unsafe_call()?;
        current()?.synchronize();
        Ok(())
    })
}

/// `cuCtxSynchronize_v2` (CUDA 13).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize_v2(ctx: Handle) -> CUresult {
    guard(|| {
        crate::capture_mode::unsafe_call()?;
        ctx_or_current(ctx)?.synchronize();
        Ok(())
    })
}

/// `cuCtxGetFlags`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetFlags(flags: *mut u32) -> CUresult {
    guard(|| {
        let c = current()?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(flags, c.flags.load(Ordering::Relaxed)) }
    })
}

/// `cuCtxSetFlags`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetFlags(flags: u32) -> CUresult {
    guard(|| {
        current()?.flags.store(flags, Ordering::Relaxed);
        Ok(())
    })
}

/// `cuCtxGetApiVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetApiVersion(ctx: Handle, version: *mut u32) -> CUresult {
    guard(|| {
        ctx_or_current(ctx)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(version, 3020) }
    })
}

/// `cuCtxGetId`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetId(ctx: Handle, id: *mut u64) -> CUresult {
    guard(|| {
        let c = ctx_or_current(ctx)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(id, c.id as u64) }
    })
}

/// `cuCtxGetStreamPriorityRange`: priorities 0 (least) to -5 (greatest), as on Hopper.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut i32,
    greatest: *mut i32,
) -> CUresult {
    guard(|| {
        current()?;
        // SAFETY: optional out-pointers from the caller, checked for null.
        unsafe {
            if !least.is_null() {
                put(least, 0)?;
            }
            if !greatest.is_null() {
                put(greatest, -5)?;
            }
        }
        Ok(())
    })
}

/// `cuCtxGetLimit`: fixed defaults of the simulated part.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetLimit(value: *mut usize, limit: u32) -> CUresult {
    guard(|| {
        current()?;
        let v = match limit {
            0 => 1024,
            1 => 1 << 20,
            2 => 8 << 20,
            3 => 2,
            4 => 2048,
            5 => 32,
            6 => 0,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(value, v) }
    })
}

/// `cuCtxSetLimit`: accepted (nothing to size in the simulation).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetLimit(limit: u32, _value: usize) -> CUresult {
    guard(|| {
        current()?;
        if limit > 6 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    })
}

/// `cuCtxGetCacheConfig`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCacheConfig(cfg: *mut u32) -> CUresult {
    guard(|| {
        current()?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(cfg, 0) }
    })
}

/// `cuCtxSetCacheConfig`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCacheConfig(_cfg: u32) -> CUresult {
    guard(|| current().map(|_| ()))
}
