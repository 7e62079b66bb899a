//! A small `dlopen` wrapper to reach the CUDA driver and NVML entry points `tessera doctor`
//! calls; their C types come from `tessera-cuda-abi`, re-exported here.
//!
//! The CLI never links against either library: a host without a driver must still get a
//! checklist that says so, not a loader error.

use std::ffi::{CStr, c_void};

pub(crate) use tessera_cuda_abi::*;

/// A library opened with `dlopen`, never closed: the driver does not support being unloaded.
#[derive(Debug)]
pub(crate) struct Lib(*mut c_void);

impl Lib {
    /// Opens `name` (searched like the CUDA runtime searches it); `Err` carries `dlerror()`.
    pub(crate) fn open(name: &CStr) -> Result<Self, String> {
        // SAFETY: `name` is NUL-terminated; loading runs the library's initialisers, which is
        // what any CUDA program does.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror returns null or a NUL-terminated string, copied at once.
            let e = unsafe { libc::dlerror() };
            let reason = if e.is_null() {
                "unknown error".to_owned()
            } else {
                // SAFETY: non-null, NUL-terminated (above).
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            return Err(reason);
        }
        Ok(Self(h))
    }

    /// The symbol `name` as the function pointer type `F`.
    ///
    /// # Safety
    /// `F` must be the C function pointer type of `name`.
    pub(crate) unsafe fn sym<F: Copy>(&self, name: &CStr) -> Result<F, String> {
        assert_eq!(
            size_of::<F>(),
            size_of::<*mut c_void>(),
            "F must be a function pointer"
        );
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.0, name.as_ptr()) };
        if p.is_null() {
            return Err(format!("{} not exported", name.to_string_lossy()));
        }
        // SAFETY: same size (asserted) and, by the caller's contract, the right signature.
        Ok(unsafe { std::mem::transmute_copy(&p) })
    }
}
