//! The launch family's `extern "C"` shims: kernel and graph launches gated on the compute lease,
//! stream destruction, and the synchronisations that tell the gate work has drained. Each
//! decodes its C arguments, runs in the [`crate::shim`] frame, and hands over to the process's
//! [`crate::launch::Gate`].
//!
//! They sit beside `launch/`, not inside it: the gate lives in the per-process state
//! ([`crate::state::Process`]), which imports `launch`, so code that reaches the state from
//! inside `launch/` would close an import circle (`tessera-testkit`'s `import_cycles` test).

#![allow(non_snake_case)]

use std::ffi::{c_uint, c_void};

use crate::ffi::*;
use crate::shim::{Outcome, Pass, cuda};
use crate::table::HookId;

// ---- launches (gated by `launch`) ---------------------------------------------------------

macro_rules! launch_kernel {
    ($name:ident, $id:ident, $ptsz:expr) => {
        /// `cuLaunchKernel` (or its `_ptsz` twin).
        ///
        /// # Safety
        /// C contract of `cuLaunchKernel`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: CUfunction,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            shared: c_uint,
            stream: CUstream,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CUresult {
            // SAFETY: the type is this entry point's signature; arguments forwarded unchanged.
            unsafe {
                cuda::<cuLaunchKernel_t>(
                    HookId::$id,
                    |real| real(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra),
                    |real, p| {
                        Outcome::Handled(p.gate.launch(stream, $ptsz, || {
                            real(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
                        }))
                    },
                )
            }
        }
    };
}
launch_kernel!(cuLaunchKernel, LaunchKernel, false);
launch_kernel!(cuLaunchKernel_ptsz, LaunchKernel_ptsz, true);

macro_rules! launch_kernel_ex {
    ($name:ident, $id:ident, $ptsz:expr) => {
        /// `cuLaunchKernelEx` (or its `_ptsz` twin).
        ///
        /// # Safety
        /// C contract of `cuLaunchKernelEx`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            config: *const CUlaunchConfig,
            f: CUfunction,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CUresult {
            // SAFETY: as for cuLaunchKernel.
            unsafe {
                cuda::<cuLaunchKernelEx_t>(
                    HookId::$id,
                    |real| real(config, f, params, extra),
                    |real, p| {
                        if config.is_null() {
                            return Outcome::PassThrough(Pass::NullArgument);
                        }
                        let stream = (*config).h_stream;
                        Outcome::Handled(
                            p.gate
                                .launch(stream, $ptsz, || real(config, f, params, extra)),
                        )
                    },
                )
            }
        }
    };
}
launch_kernel_ex!(cuLaunchKernelEx, LaunchKernelEx, false);
launch_kernel_ex!(cuLaunchKernelEx_ptsz, LaunchKernelEx_ptsz, true);

macro_rules! launch_coop {
    ($name:ident, $id:ident, $ptsz:expr) => {
        /// `cuLaunchCooperativeKernel` (or its `_ptsz` twin).
        ///
        /// # Safety
        /// C contract of `cuLaunchCooperativeKernel`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: CUfunction,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            shared: c_uint,
            stream: CUstream,
            params: *mut *mut c_void,
        ) -> CUresult {
            // SAFETY: as for cuLaunchKernel.
            unsafe {
                cuda::<cuLaunchCooperativeKernel_t>(
                    HookId::$id,
                    |real| real(f, gx, gy, gz, bx, by, bz, shared, stream, params),
                    |real, p| {
                        Outcome::Handled(p.gate.launch(stream, $ptsz, || {
                            real(f, gx, gy, gz, bx, by, bz, shared, stream, params)
                        }))
                    },
                )
            }
        }
    };
}
launch_coop!(cuLaunchCooperativeKernel, LaunchCooperativeKernel, false);
launch_coop!(
    cuLaunchCooperativeKernel_ptsz,
    LaunchCooperativeKernel_ptsz,
    true
);

macro_rules! graph_launch {
    ($name:ident, $id:ident, $ptsz:expr) => {
        /// `cuGraphLaunch` (or its `_ptsz` twin).
        ///
        /// # Safety
        /// C contract of `cuGraphLaunch`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(exec: CUgraphExec, stream: CUstream) -> CUresult {
            // SAFETY: as for cuLaunchKernel.
            unsafe {
                cuda::<cuGraphLaunch_t>(
                    HookId::$id,
                    |real| real(exec, stream),
                    |real, p| Outcome::Handled(p.gate.launch(stream, $ptsz, || real(exec, stream))),
                )
            }
        }
    };
}
graph_launch!(cuGraphLaunch, GraphLaunch, false);
graph_launch!(cuGraphLaunch_ptsz, GraphLaunch_ptsz, true);

/// `cuStreamDestroy_v2`: the launch gate forgets the stream first.
///
/// # Safety
/// C contract of `cuStreamDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: CUstream) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments forwarded unchanged.
    unsafe {
        cuda::<cuStreamDestroy_v2_t>(
            HookId::StreamDestroy_v2,
            |real| real(stream),
            |real, p| Outcome::Handled(p.gate.stream_destroyed(stream, || real(stream))),
        )
    }
}

// ---- synchronisation (tells the launch gate; never delayed by it) --------------------------

macro_rules! synchronise {
    ($name:ident, $id:ident, $t:ty, $doc:literal, ($($arg:ident: $ty:ty),*)) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The C contract of the same entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            // SAFETY: the type is this entry point's signature; arguments forwarded unchanged.
            unsafe {
                cuda::<$t>(HookId::$id, |real| real($($arg),*), |real, p| {
                    let r = real($($arg),*);
                    if r == CUDA_SUCCESS {
                        p.gate.synchronised();
                    }
                    Outcome::Handled(r)
                })
            }
        }
    };
}
synchronise!(cuStreamSynchronize, StreamSynchronize, cuStreamSynchronize_t,
    "`cuStreamSynchronize`: once it returns, the launch gate looks for a drain.", (stream: CUstream));
synchronise!(cuStreamSynchronize_ptsz, StreamSynchronize_ptsz, cuStreamSynchronize_t,
    "`cuStreamSynchronize_ptsz`: as `cuStreamSynchronize`.", (stream: CUstream));
synchronise!(
    cuCtxSynchronize,
    CtxSynchronize,
    cuCtxSynchronize_t,
    "`cuCtxSynchronize`: as `cuStreamSynchronize`.",
    ()
);
synchronise!(cuCtxSynchronize_v2, CtxSynchronize_v2, cuCtxSynchronize_v2_t,
    "`cuCtxSynchronize_v2` (CUDA 13): as `cuStreamSynchronize`.", (ctx: CUcontext));
synchronise!(cuEventSynchronize, EventSynchronize, cuEventSynchronize_t,
    "`cuEventSynchronize`: as `cuStreamSynchronize`.", (event: CUevent));
