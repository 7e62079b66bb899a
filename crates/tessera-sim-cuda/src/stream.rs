//! The stream and event entry points (`cuStream*`, `cuEvent*`, `cuLaunchHostFunc*`) and the
//! resolution of a stream handle in the calling thread's current context.

use parking_lot::{Condvar, Mutex};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use crate::capture_mode;
use crate::context::current;
use crate::ffi::*;
use crate::queue::{
    EVENTS, Event, EventState, HostFn, Op, STREAMS, Stream, StreamKind, host_op, lock,
};
use crate::runtime::{Res, guard, next_handle, put, rt};

struct PerThread(HashMap<usize, Arc<Stream>>);

impl Drop for PerThread {
    fn drop(&mut self) {
        for s in self.0.values() {
            s.close();
        }
    }
}

thread_local! {
    static PER_THREAD: RefCell<PerThread> = RefCell::new(PerThread(HashMap::new()));
}

fn per_thread_stream() -> Result<Arc<Stream>, CUresult> {
    let ctx = current()?;
    Ok(PER_THREAD.with(|m| {
        m.borrow_mut()
            .0
            .entry(ctx.id)
            .or_insert_with(|| ctx.new_stream(StreamKind::PerThread, 0, 0))
            .clone()
    }))
}

/// Resolves a stream handle: 0 is the legacy default stream (per-thread in `_ptsz` entry
/// points, `ptds`), `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` are the special handles.
pub fn resolve(h: Handle, ptds: bool) -> Result<Arc<Stream>, CUresult> {
    match h as usize {
        0 if ptds => per_thread_stream(),
        0 | CU_STREAM_LEGACY => Ok(current()?.legacy.clone()),
        CU_STREAM_PER_THREAD => per_thread_stream(),
        id => {
            rt()?;
            STREAMS.get(id).ok_or(CUDA_ERROR_INVALID_HANDLE)
        }
    }
}

fn event(h: Handle) -> Result<Arc<Event>, CUresult> {
    rt()?;
    EVENTS.get(h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)
}

fn create_stream(ph: *mut Handle, flags: u32, priority: i32) -> Res {
    if ph.is_null() || flags > CU_STREAM_NON_BLOCKING {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = current()?;
    let s = ctx.new_stream(StreamKind::Normal, flags, priority.clamp(-5, 0));
    STREAMS.insert(s.id, s.clone());
    // SAFETY: non-null out-pointer from the caller.
    unsafe { put(ph, s.id as Handle) }
}

/// `cuStreamCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(ph: *mut Handle, flags: u32) -> CUresult {
    guard(|| create_stream(ph, flags, 0))
}

/// `cuStreamCreateWithPriority`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    ph: *mut Handle,
    flags: u32,
    priority: i32,
) -> CUresult {
    guard(|| create_stream(ph, flags, priority))
}

/// `cuStreamDestroy_v2`: returns at once; queued work still completes.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(h: Handle) -> CUresult {
    guard(|| {
        rt()?;
        let s = STREAMS
            .remove(h as usize)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        s.close();
        Ok(())
    })
}

fn stream_sync(h: Handle, ptds: bool) -> CUresult {
    guard(|| {
        capture_mode::unsafe_call()?;
        resolve(h, ptds)?.synchronize();
        Ok(())
    })
}

fn stream_query(h: Handle, ptds: bool) -> CUresult {
    guard(|| {
        capture_mode::unsafe_call()?;
        if resolve(h, ptds)?.idle() {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    })
}

/// `cuStreamSynchronize`.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(h: Handle) -> CUresult {
    stream_sync(h, false)
}

/// `cuStreamSynchronize_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize_ptsz(h: Handle) -> CUresult {
    stream_sync(h, true)
}

/// `cuStreamQuery`.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(h: Handle) -> CUresult {
    stream_query(h, false)
}

/// `cuStreamQuery_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery_ptsz(h: Handle) -> CUresult {
    stream_query(h, true)
}

fn stream_wait_event(h: Handle, ev: Handle, ptds: bool) -> CUresult {
    guard(|| {
        let s = resolve(h, ptds)?;
        let e = event(ev)?;
        if s.capture().is_some() {
            return Ok(());
        }
        if let Some(gen_) = e.pending() {
            s.enqueue(Op::WaitEvent(e, gen_));
        }
        Ok(())
    })
}

/// `cuStreamWaitEvent`.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(h: Handle, ev: Handle, _flags: u32) -> CUresult {
    stream_wait_event(h, ev, false)
}

/// `cuStreamWaitEvent_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent_ptsz(h: Handle, ev: Handle, _flags: u32) -> CUresult {
    stream_wait_event(h, ev, true)
}

fn stream_get(h: Handle, ptds: bool, f: impl FnOnce(&Arc<Stream>) -> Res) -> CUresult {
    guard(|| f(&resolve(h, ptds)?))
}

macro_rules! stream_getter {
    ($name:ident, $ptsz:ident, $t:ty, |$s:ident| $val:expr) => {
        #[doc = concat!("`", stringify!($name), "`.")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(h: Handle, out: *mut $t) -> CUresult {
            // SAFETY: caller's out-pointer, null-checked by put.
            stream_get(h, false, |$s| unsafe { put(out, $val) })
        }
        #[doc = concat!("`", stringify!($ptsz), "`.")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $ptsz(h: Handle, out: *mut $t) -> CUresult {
            // SAFETY: caller's out-pointer, null-checked by put.
            stream_get(h, true, |$s| unsafe { put(out, $val) })
        }
    };
}

stream_getter!(cuStreamGetPriority, cuStreamGetPriority_ptsz, i32, |s| s
    .priority);
stream_getter!(cuStreamGetFlags, cuStreamGetFlags_ptsz, u32, |s| s.flags);
stream_getter!(cuStreamGetId, cuStreamGetId_ptsz, u64, |s| s.id as u64);
stream_getter!(cuStreamGetCtx, cuStreamGetCtx_ptsz, Handle, |s| s
    .ctx
    .upgrade()
    .map_or(std::ptr::null_mut(), |c| c.id() as Handle));

fn launch_host_func(
    h: Handle,
    f: Option<HostFn>,
    data: *mut std::ffi::c_void,
    ptds: bool,
) -> CUresult {
    guard(|| {
        let f = f.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let s = resolve(h, ptds)?;
        match s.capture() {
            Some(c) => {
                c.check()?;
                c.add_host(f, data as usize);
            }
            None => s.enqueue(host_op(f, data as usize)),
        }
        Ok(())
    })
}

/// `cuLaunchHostFunc`.
#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchHostFunc(
    h: Handle,
    f: Option<HostFn>,
    data: *mut std::ffi::c_void,
) -> CUresult {
    launch_host_func(h, f, data, false)
}

/// `cuLaunchHostFunc_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchHostFunc_ptsz(
    h: Handle,
    f: Option<HostFn>,
    data: *mut std::ffi::c_void,
) -> CUresult {
    launch_host_func(h, f, data, true)
}

/// `CU_HOST_TASK_BLOCKING` and `CU_HOST_TASK_SPINWAIT`: how the stream waits for the function;
/// both run it the same way here.
const HOST_TASK_SYNC_MODES: u32 = 2;

/// `cuLaunchHostFunc_v2` (CUDA 13.2): adds a sync mode.
#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchHostFunc_v2(
    h: Handle,
    f: Option<HostFn>,
    data: *mut std::ffi::c_void,
    sync_mode: u32,
) -> CUresult {
    launch_host_func_v2(h, f, data, sync_mode, false)
}

/// `cuLaunchHostFunc_v2_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchHostFunc_v2_ptsz(
    h: Handle,
    f: Option<HostFn>,
    data: *mut std::ffi::c_void,
    sync_mode: u32,
) -> CUresult {
    launch_host_func_v2(h, f, data, sync_mode, true)
}

/// The `_v2` entry points: a sync mode the driver knows, then as `cuLaunchHostFunc`.
fn launch_host_func_v2(
    h: Handle,
    f: Option<HostFn>,
    data: *mut std::ffi::c_void,
    sync_mode: u32,
    ptds: bool,
) -> CUresult {
    if sync_mode >= HOST_TASK_SYNC_MODES {
        return CUDA_ERROR_INVALID_VALUE;
    }
    launch_host_func(h, f, data, ptds)
}

/// `cuEventCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(ph: *mut Handle, flags: u32) -> CUresult {
    guard(|| {
        if ph.is_null() || flags > 0xF {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        current()?;
        let e = Arc::new(Event {
            id: next_handle(),
            flags,
            st: Mutex::new(EventState {
                recorded: 0,
                done: 0,
                ts_ns: 0,
            }),
            cv: Condvar::new(),
        });
        EVENTS.insert(e.id, e.clone());
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(ph, e.id as Handle) }
    })
}

/// `cuEventDestroy_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(h: Handle) -> CUresult {
    guard(|| {
        rt()?;
        EVENTS
            .remove(h as usize)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

fn event_record(ev: Handle, h: Handle, ptds: bool) -> CUresult {
    guard(|| {
        let e = event(ev)?;
        let s = resolve(h, ptds)?;
        e.record(&s);
        Ok(())
    })
}

/// `cuEventRecord`.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(ev: Handle, h: Handle) -> CUresult {
    event_record(ev, h, false)
}

/// `cuEventRecord_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord_ptsz(ev: Handle, h: Handle) -> CUresult {
    event_record(ev, h, true)
}

/// `cuEventRecordWithFlags`.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecordWithFlags(ev: Handle, h: Handle, _flags: u32) -> CUresult {
    event_record(ev, h, false)
}

/// `cuEventRecordWithFlags_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecordWithFlags_ptsz(ev: Handle, h: Handle, _flags: u32) -> CUresult {
    event_record(ev, h, true)
}

/// `cuEventQuery`.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(ev: Handle) -> CUresult {
    guard(|| {
        capture_mode::unsafe_call()?;
        match event(ev)?.pending() {
            Some(_) => Err(CUDA_ERROR_NOT_READY),
            None => Ok(()),
        }
    })
}

/// `cuEventSynchronize`.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(ev: Handle) -> CUresult {
    guard(|| {
        capture_mode::unsafe_call()?;
        let e = event(ev)?;
        if let Some(gen_) = e.pending() {
            e.wait_for(gen_);
        }
        Ok(())
    })
}

/// `cuEventElapsedTime` (and `_v2`): milliseconds between the two events' completions.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    guard(|| {
        if ms.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (a, b) = (event(start)?, event(end)?);
        if (a.flags | b.flags) & CU_EVENT_DISABLE_TIMING != 0 {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let (sa, sb) = (lock(&a.st), lock(&b.st));
        if sa.recorded == 0 || sb.recorded == 0 {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        if sa.done < sa.recorded || sb.done < sb.recorded {
            return Err(CUDA_ERROR_NOT_READY);
        }
        let diff = sb.ts_ns as i128 - sa.ts_ns as i128;
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(ms, (diff as f64 / 1e6) as f32) }
    })
}

/// `cuEventElapsedTime_v2` (CUDA 12.8+, same contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: Handle,
    end: Handle,
) -> CUresult {
    // SAFETY: same contract as cuEventElapsedTime.
    unsafe { cuEventElapsedTime(ms, start, end) }
}
