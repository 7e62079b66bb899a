//! Example CUDA driver clients for Tessera, shared pieces.
//!
//! The binaries in `src/bin/` load the driver exactly as the CUDA runtime does, so they run
//! unchanged on a real driver, on the simulated one (`tessera sim`) and under the interposer
//! (`tessera run`):
//! - `hello_gpu`: devices, memory, copies, timed kernels on two streams.
//! - `tenant`: what a tenant sees under a Tessera allocation (its card size, its memory limit,
//!   the GPU time it gets); the main demo (`examples/demo.sh`) runs two of them.
//!
//! This library holds the one piece both need: [`Driver`], `dlopen("libcuda.so.1")` followed by
//! `cuGetProcAddress_v2` for every entry point.

use std::ffi::{CStr, c_char, c_void};

/// The CUDA driver ABI (`tessera-cuda-abi`): the function-pointer type of every entry point the
/// examples resolve.
pub use tessera_cuda_abi as abi;

use abi::{
    CUDA_SUCCESS, CUdevice, CUresult, cuCtxSetCurrent_t, cuDevicePrimaryCtxRetain_t,
    cuGetProcAddress_v2_t as GetProc, cuInit_t,
};

/// A PTX module with one kernel, `spin`, whose only parameter is its duration in ns on the
/// simulated GPU (the simulator's convention; on a real GPU it is an empty kernel).
pub const SPIN_PTX: &CStr =
    c".version 8.0\n.target sm_90\n.visible .entry spin(.param .u64 ns) { ret; }\n";

/// The CUDA driver, loaded the way the CUDA runtime loads it.
#[derive(Debug)]
pub struct Driver {
    _lib: libloading::Library,
    get_proc: GetProc,
}

impl Driver {
    /// Loads `libcuda.so.1` and its `cuGetProcAddress_v2`.
    pub fn load() -> Result<Self, String> {
        // SAFETY: loading the driver library runs its initialisers, which is what any CUDA
        // program does; nothing of ours is borrowed across it.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| {
            format!("libcuda.so.1 not found ({e}): run me under `tessera sim -- ...`")
        })?;
        // SAFETY: cuGetProcAddress_v2 has the GetProc signature in every driver since 12.0.
        let get_proc = unsafe { lib.get::<GetProc>(b"cuGetProcAddress_v2\0") }
            .map(|s| *s)
            .map_err(|e| format!("cuGetProcAddress_v2 missing: {e}"))?;
        Ok(Self {
            _lib: lib,
            get_proc,
        })
    }

    /// Resolves `name` at ABI `version` and casts it to the function type `F`.
    ///
    /// # Safety
    /// `F` must be the C function pointer type of `name` at `version`.
    pub unsafe fn sym<F: Copy>(&self, name: &CStr, version: i32) -> F {
        assert_eq!(
            size_of::<F>(),
            size_of::<*mut c_void>(),
            "F must be a function pointer"
        );
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid NUL-terminated name and out-pointer; a null status is allowed.
        let rc =
            unsafe { (self.get_proc)(name.as_ptr(), &mut p, version, 0, std::ptr::null_mut()) };
        if rc != CUDA_SUCCESS || p.is_null() {
            let name = name.to_string_lossy();
            fail(&format!("cannot resolve {name}: {}", self.error_text(rc)));
        }
        // SAFETY: F is a function pointer of the same size (asserted) and, by the caller's
        // contract, of the right signature.
        unsafe { std::mem::transmute_copy(&p) }
    }
}

impl Driver {
    /// `cuInit(0)`, then `device`'s primary context made current on this thread: how every
    /// program here starts. `Err` names the call that failed and its `CUresult`.
    pub fn init_primary_context(&self, device: CUdevice) -> Result<(), String> {
        // SAFETY: each type is the documented C signature of the entry point at that version.
        let (init, retain, set_current) = unsafe {
            (
                self.sym::<cuInit_t>(c"cuInit", 2000),
                self.sym::<cuDevicePrimaryCtxRetain_t>(c"cuDevicePrimaryCtxRetain", 7000),
                self.sym::<cuCtxSetCurrent_t>(c"cuCtxSetCurrent", 4000),
            )
        };
        let fail =
            |what: &str, rc: CUresult| Err(format!("{what} failed: {}", self.error_text(rc)));
        // SAFETY: plain flags; the out-pointer is a live local; `ctx` was just retained.
        unsafe {
            let rc = init(0);
            if rc != CUDA_SUCCESS {
                return fail("cuInit", rc);
            }
            let mut ctx = std::ptr::null_mut();
            let rc = retain(&mut ctx, device);
            if rc != CUDA_SUCCESS {
                return fail("cuDevicePrimaryCtxRetain", rc);
            }
            let rc = set_current(ctx);
            if rc != CUDA_SUCCESS {
                return fail("cuCtxSetCurrent", rc);
            }
        }
        Ok(())
    }
}

/// `cuGetErrorName`'s C signature.
type GetErrorName = unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult;

impl Driver {
    /// The driver's name for `rc` and the number, e.g. `CUDA_ERROR_OUT_OF_MEMORY (2)`; just
    /// the number when the driver does not know it.
    pub fn error_text(&self, rc: CUresult) -> String {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid NUL-terminated name and out-pointer; a null status is allowed.
        let found = unsafe {
            (self.get_proc)(
                c"cuGetErrorName".as_ptr(),
                &mut p,
                6000,
                0,
                std::ptr::null_mut(),
            )
        };
        if found != CUDA_SUCCESS || p.is_null() {
            return format!("CUresult {rc}");
        }
        // SAFETY: cuGetErrorName has this signature since CUDA 6.0 (the version asked for).
        let get_name: GetErrorName = unsafe { std::mem::transmute_copy(&p) };
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: a live out-pointer; on success the driver points it at a static string.
        if unsafe { get_name(rc, &mut name) } != CUDA_SUCCESS || name.is_null() {
            return format!("CUresult {rc}");
        }
        // SAFETY: non-null, NUL-terminated and static (the driver's own table).
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        format!("{name} ({rc})")
    }

    /// Unless `rc` is `CUDA_SUCCESS`: prints `PROGRAM: WHAT failed: NAME (CODE)` on stderr and
    /// exits with status 1. A CUDA error is an answer to report (under a Tessera limit
    /// `CUDA_ERROR_OUT_OF_MEMORY` is the expected one), not a bug to panic on.
    pub fn check(&self, what: &str, rc: CUresult) {
        if rc != CUDA_SUCCESS {
            fail(&format!("{what} failed: {}", self.error_text(rc)));
        }
    }
}

/// Prints `PROGRAM: message` on stderr and exits with status 1.
pub fn fail(message: &str) -> ! {
    let program = std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "example".into());
    eprintln!("{program}: {message}");
    std::process::exit(1)
}
