//! Stream-capture interaction modes (`CUstreamCaptureMode`), as the driver enforces them.
//!
//! While a capture begun in the global mode is in progress, a potentially unsafe call from a
//! thread in the global mode fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates
//! the capture: its further launches and its end fail with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`
//! (CUDA Runtime API: `cudaStreamBeginCapture`, `cudaThreadExchangeStreamCaptureMode`). A thread
//! in the relaxed mode is never prohibited; one in the thread-local mode only by its own
//! captures (not modelled: it is treated as relaxed). The calls treated as unsafe here are the
//! ones that ask about or wait for work: event query and synchronise, stream query and
//! synchronise, context synchronise.
//!
//! Why the simulator has it: on an H200 (driver 580) the interposer's lease manager, querying its
//! events while PyTorch captured a CUDA graph in the default global mode, ended the capture
//! ("operation failed due to a previous error during capture"); PyTorch itself relaxes its
//! allocator's `cudaMalloc` and its NCCL watchdog's event queries for the same reason.

use parking_lot::Mutex;
use std::cell::Cell;
use std::sync::{Arc, Weak};

use crate::ffi::*;
use crate::queue::Capture;
use crate::runtime::{guard, put};

const GLOBAL: u32 = 0;
const THREAD_LOCAL: u32 = 1;
const RELAXED: u32 = 2;

thread_local! {
    /// This thread's mode (`cuThreadExchangeStreamCaptureMode`), global by default.
    static MODE: Cell<u32> = const { Cell::new(GLOBAL) };
}

/// The captures in progress that were begun in the global mode.
static GLOBAL_CAPTURES: Mutex<Vec<Weak<Capture>>> = Mutex::new(Vec::new());

/// A capture begun in `mode`: one in the global mode restricts every thread until it ends.
pub fn begun(c: &Arc<Capture>, mode: u32) {
    if mode == GLOBAL {
        GLOBAL_CAPTURES.lock().push(Arc::downgrade(c));
    }
}

/// A capture ended (invalidated or not).
pub fn ended(c: &Arc<Capture>) {
    GLOBAL_CAPTURES
        .lock()
        .retain(|w| w.upgrade().is_some_and(|x| !Arc::ptr_eq(&x, c)));
}

/// A potentially unsafe call by the calling thread: refused, and every global capture in
/// progress invalidated, unless the thread is relaxed or no such capture is in progress.
pub fn unsafe_call() -> Result<(), CUresult> {
    if MODE.with(Cell::get) != GLOBAL {
        return Ok(());
    }
    let mut captures = GLOBAL_CAPTURES.lock();
    captures.retain(|w| w.strong_count() > 0);
    if captures.is_empty() {
        return Ok(());
    }
    for c in captures.iter().filter_map(Weak::upgrade) {
        c.invalidate();
    }
    Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
}

/// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's mode from `*mode` and
/// returns the previous one there.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut u32) -> CUresult {
    guard(|| {
        if mode.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null pointer to the caller's `CUstreamCaptureMode`.
        let new = unsafe { mode.read() };
        if ![GLOBAL, THREAD_LOCAL, RELAXED].contains(&new) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let old = MODE.with(|m| m.replace(new));
        // SAFETY: as above.
        unsafe { put(mode, old) }
    })
}
