//! The context family's `extern "C"` shims: primary contexts, `cuCtxCreate`/`cuCtxDestroy`, and
//! green contexts. Each decodes its C arguments, runs in the [`crate::shim`] frame, and hands
//! over to the safe logic in [`super`].

#![allow(non_snake_case)]
#![allow(
    unsafe_code,
    reason = "the C boundary: raw pointers in, the real function called through its slot"
)]

use std::ffi::{c_int, c_uint, c_void};

use crate::contexts;
use crate::ffi::*;
use crate::shim::{Outcome, Pass, cuda, on, written};
use crate::table::HookId;

// ---- contexts (their device memory counts against the limit) ----------------------------

/// `cuDevicePrimaryCtxRetain`: reserves the context's cost when it is not active yet.
///
/// # Safety
/// C contract of `cuDevicePrimaryCtxRetain`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments are forwarded unchanged.
    unsafe {
        cuda::<cuDevicePrimaryCtxRetain_t>(
            HookId::DevicePrimaryCtxRetain,
            |real| real(pctx, dev),
            |real, p| {
                if pctx.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                contexts::primary_retain(on(dev, p), dev, || real(pctx, dev))
            },
        )
    }
}

macro_rules! primary_end {
    ($name:ident, $id:ident, $logic:path, $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The C contract of the same entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dev: CUdevice) -> CUresult {
            // SAFETY: the type is this entry point's signature; arguments forwarded unchanged.
            unsafe {
                cuda::<cuDevicePrimaryCtxRelease_v2_t>(
                    HookId::$id,
                    |real| real(dev),
                    |real, p| $logic(on(dev, p), dev, || real(dev)),
                )
            }
        }
    };
}
primary_end!(
    cuDevicePrimaryCtxRelease,
    DevicePrimaryCtxRelease,
    contexts::primary_release,
    "`cuDevicePrimaryCtxRelease`: the last reference gives the context's cost back."
);
primary_end!(
    cuDevicePrimaryCtxRelease_v2,
    DevicePrimaryCtxRelease_v2,
    contexts::primary_release,
    "`cuDevicePrimaryCtxRelease_v2`: as `cuDevicePrimaryCtxRelease`."
);
primary_end!(
    cuDevicePrimaryCtxReset,
    DevicePrimaryCtxReset,
    contexts::primary_reset,
    "`cuDevicePrimaryCtxReset`: the context and its cost go."
);
primary_end!(
    cuDevicePrimaryCtxReset_v2,
    DevicePrimaryCtxReset_v2,
    contexts::primary_reset,
    "`cuDevicePrimaryCtxReset_v2`: as `cuDevicePrimaryCtxReset`."
);

/// `cuCtxCreate_v2`: a new context, its cost reserved first.
///
/// # Safety
/// C contract of `cuCtxCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: the type is this entry point's signature; `pctx` is read only after the driver
    // succeeded, and only when non-null.
    unsafe {
        cuda::<cuCtxCreate_v2_t>(
            HookId::CtxCreate_v2,
            |real| real(pctx, flags, dev),
            |real, p| {
                if pctx.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                contexts::create(on(dev, p), || {
                    let r = real(pctx, flags, dev);
                    (r, written(r, pctx) as u64)
                })
            },
        )
    }
}

/// `cuCtxCreate_v3` (CUDA 11.4, execution affinity): as `cuCtxCreate_v2`.
///
/// # Safety
/// C contract of `cuCtxCreate_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    params: *mut c_void,
    num_params: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: as for cuCtxCreate_v2.
    unsafe {
        cuda::<cuCtxCreate_v3_t>(
            HookId::CtxCreate_v3,
            |real| real(pctx, params, num_params, flags, dev),
            |real, p| {
                if pctx.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                contexts::create(on(dev, p), || {
                    let r = real(pctx, params, num_params, flags, dev);
                    (r, written(r, pctx) as u64)
                })
            },
        )
    }
}

/// `cuCtxCreate_v4` (CUDA 12.5, create-params): as `cuCtxCreate_v2`.
///
/// # Safety
/// C contract of `cuCtxCreate_v4`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    params: *mut c_void,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: as for cuCtxCreate_v2.
    unsafe {
        cuda::<cuCtxCreate_v4_t>(
            HookId::CtxCreate_v4,
            |real| real(pctx, params, flags, dev),
            |real, p| {
                if pctx.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                contexts::create(on(dev, p), || {
                    let r = real(pctx, params, flags, dev);
                    (r, written(r, pctx) as u64)
                })
            },
        )
    }
}

/// `cuCtxDestroy_v2`: a context made here gives its cost back.
///
/// # Safety
/// C contract of `cuCtxDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments forwarded unchanged.
    unsafe {
        cuda::<cuCtxDestroy_v2_t>(
            HookId::CtxDestroy_v2,
            |real| real(ctx),
            |real, p| contexts::destroy(p, ctx as u64, || real(ctx)),
        )
    }
}

/// `cuGreenCtxCreate` (CUDA 12.4): a green context has device state of its own, so it is
/// reserved like `cuCtxCreate_v2`'s.
///
/// # Safety
/// C contract of `cuGreenCtxCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGreenCtxCreate(
    pctx: *mut *mut c_void,
    desc: *mut c_void,
    dev: CUdevice,
    flags: c_uint,
) -> CUresult {
    // SAFETY: as for cuCtxCreate_v2.
    unsafe {
        cuda::<cuGreenCtxCreate_t>(
            HookId::GreenCtxCreate,
            |real| real(pctx, desc, dev, flags),
            |real, p| {
                if pctx.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                contexts::create(on(dev, p), || {
                    let r = real(pctx, desc, dev, flags);
                    (r, written(r, pctx) as u64)
                })
            },
        )
    }
}

/// `cuGreenCtxDestroy`: a green context made here gives its cost back.
///
/// # Safety
/// C contract of `cuGreenCtxDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGreenCtxDestroy(ctx: *mut c_void) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments forwarded unchanged.
    unsafe {
        cuda::<cuGreenCtxDestroy_t>(
            HookId::GreenCtxDestroy,
            |real| real(ctx),
            |real, p| contexts::destroy(p, ctx as u64, || real(ctx)),
        )
    }
}
