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
//!   called. So one reservation is held per device while [`Book`] counts references.
//! - `cuCtxCreate_v2/_v3/_v4` always make a new context with device state of its own; it goes
//!   with `cuCtxDestroy_v2`.
//! - `cuInit` makes none: the runtime's implicit context is the primary one, retained as above.
//!
//! Green contexts (`cuGreenCtxCreate`, CUDA 12.4) are not hooked: neither the simulated driver
//! nor `tessera-cuda-abi` has them. A context made there (or through the 32-bit v1
//! `cuCtxCreate`) is not reserved; the backstop still counts its memory from NVML.
//!
//! The reserved figure is an estimate fixed at build time, never read from the tenant's
//! environment: the arbiter does not yet correct it to what NVML reports for the process
//! (docs/interposer.md says what that means on cards whose contexts cost more).

#![forbid(unsafe_code)]

use std::collections::HashMap;

use crate::ffi::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUresult};
use crate::memory::Outcome;
use crate::state::Process;
use crate::tlog;

/// Device memory reserved per context: what the simulated driver charges
/// (`tessera_sim_state::MODELED_CONTEXT_MEMORY`) and the low end of what real cards cost
/// (300-600 MiB on recent ones, more with large modules loaded eagerly).
pub const CONTEXT_RESERVE: u64 = 300 << 20;

/// The primary context of one device, as far as this process's calls made it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Primary {
    /// Successful retains not yet released.
    refs: u32,
    /// Bytes reserved for it (0 while it is not active).
    charged: u64,
}

/// What this process reserved for its contexts.
#[derive(Debug, Default)]
pub struct Book {
    primary: HashMap<i32, Primary>,
    created: HashMap<u64, u64>,
}

impl Book {
    /// True when a retain of `dev`'s primary context will make it (no reference is held).
    pub fn primary_inactive(&self, dev: i32) -> bool {
        self.primary.get(&dev).is_none_or(|p| p.refs == 0)
    }

    /// A retain of `dev`'s primary context succeeded; `charged` is what was reserved for it
    /// (0 when it was already active).
    pub fn primary_retained(&mut self, dev: i32, charged: u64) {
        let p = self.primary.entry(dev).or_default();
        p.refs = p.refs.saturating_add(1);
        p.charged = p.charged.saturating_add(charged);
    }

    /// A release of `dev`'s primary context succeeded: the bytes to give back when it was the
    /// last reference (the driver destroyed the context).
    pub fn primary_released(&mut self, dev: i32) -> u64 {
        let Some(p) = self.primary.get_mut(&dev) else {
            return 0;
        };
        p.refs = p.refs.saturating_sub(1);
        if p.refs > 0 {
            return 0;
        }
        self.primary.remove(&dev).map_or(0, |p| p.charged)
    }

    /// `dev`'s primary context was reset (destroyed whatever its references): the bytes to
    /// give back.
    pub fn primary_reset(&mut self, dev: i32) -> u64 {
        self.primary.remove(&dev).map_or(0, |p| p.charged)
    }

    /// A context `cuCtxCreate*` made; returns the bytes of an entry it replaced (a handle
    /// the driver reused, so the old context went behind our back), to give back.
    pub fn created(&mut self, ctx: u64, charged: u64) -> Option<u64> {
        self.created.insert(ctx, charged)
    }

    /// Forgets a created context before `cuCtxDestroy` reaches the driver; its bytes, if it
    /// is one.
    pub fn destroy_begin(&mut self, ctx: u64) -> Option<u64> {
        self.created.remove(&ctx)
    }

    /// Bytes reserved for all live contexts.
    pub fn total(&self) -> u64 {
        self.primary.values().map(|p| p.charged).sum::<u64>() + self.created.values().sum::<u64>()
    }
}

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
    let mut book = p.contexts();
    let r = driver();
    if r == CUDA_SUCCESS {
        p.session.release(book.primary_released(dev));
    }
    Outcome::Handled(r)
}

/// `cuDevicePrimaryCtxReset(_v2)`: the context goes, and its cost with it.
pub fn primary_reset(
    p: &'static Process,
    dev: i32,
    driver: impl FnOnce() -> CUresult,
) -> Outcome<CUresult> {
    let mut book = p.contexts();
    let r = driver();
    if r == CUDA_SUCCESS {
        p.session.release(book.primary_reset(dev));
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
    let Some(charged) = p.contexts().destroy_begin(ctx) else {
        return Outcome::PassThrough;
    };
    let r = driver();
    if r == CUDA_SUCCESS {
        p.session.release(charged);
    } else {
        let _ = p.contexts().created(ctx, charged);
    }
    Outcome::Handled(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_primary_context_is_charged_once_per_device_until_its_last_reference() {
        let mut b = Book::default();
        assert!(b.primary_inactive(0));
        b.primary_retained(0, CONTEXT_RESERVE);
        assert!(!b.primary_inactive(0), "a second retain shares it");
        b.primary_retained(0, 0);
        assert!(b.primary_inactive(1), "each device has its own");
        b.primary_retained(1, CONTEXT_RESERVE);
        assert_eq!(b.total(), 2 * CONTEXT_RESERVE);
        assert_eq!(b.primary_released(0), 0, "one reference is left");
        assert_eq!(b.primary_released(0), CONTEXT_RESERVE, "the last one");
        assert!(b.primary_inactive(0));
        assert_eq!(
            b.primary_released(0),
            0,
            "an extra release gives nothing twice"
        );
        assert_eq!(b.primary_reset(1), CONTEXT_RESERVE);
        assert_eq!(b.primary_reset(1), 0);
        assert_eq!(b.total(), 0);
    }

    #[test]
    fn created_contexts_are_charged_each() {
        let mut b = Book::default();
        for ctx in 1..=64 {
            assert_eq!(b.created(ctx, CONTEXT_RESERVE), None);
        }
        assert_eq!(b.total(), 64 * CONTEXT_RESERVE);
        assert_eq!(b.destroy_begin(7), Some(CONTEXT_RESERVE));
        assert_eq!(b.destroy_begin(7), None, "destroyed once");
        assert_eq!(
            b.created(8, CONTEXT_RESERVE),
            Some(CONTEXT_RESERVE),
            "a reused handle: the old context went behind our back"
        );
        assert_eq!(b.total(), 63 * CONTEXT_RESERVE);
    }
}
