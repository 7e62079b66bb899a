//! Contexts count against the allocation's limit, as on a MIG slice: a context costs device
//! memory (NVML counts it for the process) that no allocation returned, so each context this
//! process makes reserves [`CONTEXT_RESERVE`] at the arbiter *before* the driver makes it, is
//! refused with `CUDA_ERROR_OUT_OF_MEMORY` when that does not fit, and gives it back when it
//! goes.
//!
//! Which calls make a context (CUDA driver API reference, "Primary Context Management" and
//! "Context Management"):
//! - `cuDevicePrimaryCtxRetain` makes the device's primary context only when it is not active:
//!   it is one per device per process, reference counted, shared with the runtime (which
//!   retains it on its first call that needs a device), and destroyed when
//!   `cuDevicePrimaryCtxRelease` drops the last reference or `cuDevicePrimaryCtxReset` is
//!   called. So one reservation is held per device while [`crate::context_book::Book`] counts
//!   references.
//! - `cuCtxCreate_v2/_v3/_v4` always make a new context with device state of its own; it goes
//!   with `cuCtxDestroy_v2`.
//! - `cuInit` makes none: the runtime's implicit context is the primary one, retained as above.
//!
//! - `cuGreenCtxCreate` (CUDA 12.4, "Green Contexts") makes a context with device state of its
//!   own from a resource descriptor; it goes with `cuGreenCtxDestroy`. Reserved like
//!   `cuCtxCreate`'s (the driver must export it; on an older one the hook answers what a
//!   missing entry point does).
//!
//! A context made through the 32-bit v1 `cuCtxCreate` is not reserved; the backstop still
//! counts its memory from NVML.
//!
//! The reserved figure is an estimate fixed at build time, never read from the tenant's
//! environment; the arbiter charges what NVML shows for the process beyond its reservations
//! (a context that costs more on the card), docs/interposer.md.

// The logic has no `unsafe`; only its C boundary, `hooks`, allows it (a `forbid` here would
// reach into that child too).
#![deny(unsafe_code)]

pub mod hooks;

use crate::context_book::Book;
use crate::ffi::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUresult};
use crate::shim::{Outcome, Pass};
use crate::state::Process;
use crate::tlog;

/// Device memory reserved per context: what the simulated driver charges
/// (`tessera_sim_state::MODELED_CONTEXT_MEMORY`) and the low end of what real cards cost
/// (300-600 MiB on recent ones, more with large modules loaded eagerly).
pub const CONTEXT_RESERVE: u64 = 300 << 20;

/// Reserves a context's cost, or answers `CUDA_ERROR_OUT_OF_MEMORY`.
fn reserve(p: &'static Process) -> Result<u64, CUresult> {
    match p.session.reserve(CONTEXT_RESERVE) {
        Ok(_) => Ok(CONTEXT_RESERVE),
        Err(e) => {
            tlog!(
                Debug,
                "context of {CONTEXT_RESERVE} bytes refused: {e} (contexts count against the limit)"
            );
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        }
    }
}

/// `cuDevicePrimaryCtxRetain`: reserves when the context is not active yet. The book stays
/// locked across the driver call, so two threads retaining at once reserve once.
pub fn primary_retain(
    p: &'static Process,
    dev: i32,
    driver: impl FnOnce() -> CUresult,
) -> Outcome<CUresult> {
    let mut book = p.contexts();
    let charged = if book.primary_inactive(dev) {
        match reserve(p) {
            Ok(b) => b,
            Err(r) => return Outcome::Handled(r),
        }
    } else {
        0
    };
    let r = driver();
    if r == CUDA_SUCCESS {
        book.primary_retained(dev, charged);
    } else {
        p.session.release(charged);
    }
    Outcome::Handled(r)
}

/// `cuDevicePrimaryCtxRelease(_v2)`: the last reference gives the context's cost back.
pub fn primary_release(
    p: &'static Process,
    dev: i32,
    driver: impl FnOnce() -> CUresult,
) -> Outcome<CUresult> {
    primary_let_go(p, dev, driver, Book::primary_released)
}

/// `cuDevicePrimaryCtxReset(_v2)`: the context goes, and its cost with it.
pub fn primary_reset(
    p: &'static Process,
    dev: i32,
    driver: impl FnOnce() -> CUresult,
) -> Outcome<CUresult> {
    primary_let_go(p, dev, driver, Book::primary_reset)
}

/// A call that may end device `dev`'s primary context: once the driver did it, `book_it`
/// updates the book and says what cost goes back. The book stays locked across the driver
/// call, as for a retain.
fn primary_let_go(
    p: &'static Process,
    dev: i32,
    driver: impl FnOnce() -> CUresult,
    book_it: fn(&mut Book, i32) -> u64,
) -> Outcome<CUresult> {
    let mut book = p.contexts();
    let r = driver();
    if r == CUDA_SUCCESS {
        p.session.release(book_it(&mut book, dev));
    }
    Outcome::Handled(r)
}

/// `cuCtxCreate_v2/_v3/_v4`: reserved before the driver makes it; `driver` answers its result
/// and the new context's handle.
pub fn create(p: &'static Process, driver: impl FnOnce() -> (CUresult, u64)) -> Outcome<CUresult> {
    let charged = match reserve(p) {
        Ok(b) => b,
        Err(r) => return Outcome::Handled(r),
    };
    let (r, ctx) = driver();
    if r != CUDA_SUCCESS {
        p.session.release(charged);
        return Outcome::Handled(r);
    }
    if let Some(old) = p.contexts().created(ctx, charged) {
        p.session.release(old);
    }
    Outcome::Handled(r)
}

/// `cuCtxDestroy_v2`: a context this process created gives its cost back once the driver
/// destroyed it; any other handle (a primary context, a stale one) passes through.
pub fn destroy(
    p: &'static Process,
    ctx: u64,
    driver: impl FnOnce() -> CUresult,
) -> Outcome<CUresult> {
    // A context is destroyed from any device's current context: look in every device's book.
    let found = std::iter::once(p)
        .chain(crate::state::all_states())
        .find_map(|s| s.contexts().destroy_begin(ctx).map(|c| (s, c)));
    let Some((p, charged)) = found else {
        return Outcome::PassThrough(Pass::NotCounted);
    };
    let r = driver();
    if r == CUDA_SUCCESS {
        p.session.release(charged);
    } else {
        let _ = p.contexts().created(ctx, charged);
    }
    Outcome::Handled(r)
}
