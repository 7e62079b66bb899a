//! Raw C declarations of the CUDA driver and NVML entry points `tessera doctor` calls, and a
//! small `dlopen` wrapper to reach them. Layouts follow `cuda.h` / `nvml.h` on 64-bit Linux.
//!
//! The CLI never links against either library: a host without a driver must still get a
//! checklist that says so, not a loader error.

#![allow(non_camel_case_types)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

/// `CUresult`.
pub type CUresult = c_uint;
/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CUresult = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
/// `nvmlReturn_t`.
pub type nvmlReturn_t = c_int;
/// `NVML_SUCCESS`.
pub const NVML_SUCCESS: nvmlReturn_t = 0;
/// `nvmlDevice_t`.
pub type nvmlDevice_t = *mut c_void;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct nvmlMemory_t {
    /// Bytes.
    pub total: u64,
    /// Bytes.
    pub free: u64,
    /// Bytes.
    pub used: u64,
}

/// `cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus)`.
pub type cuGetProcAddress_v2_t =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;
/// `cuInit`.
pub type cuInit_t = unsafe extern "C" fn(c_uint) -> CUresult;
/// `cuDriverGetVersion`.
pub type cuDriverGetVersion_t = unsafe extern "C" fn(*mut c_int) -> CUresult;
/// `cuDeviceGetCount`.
pub type cuDeviceGetCount_t = unsafe extern "C" fn(*mut c_int) -> CUresult;
/// `cuDeviceGetUuid` (`CUuuid` is 16 bytes).
pub type cuDeviceGetUuid_t = unsafe extern "C" fn(*mut [u8; 16], c_int) -> CUresult;
/// `cuDevicePrimaryCtxRetain`.
pub type cuDevicePrimaryCtxRetain_t = unsafe extern "C" fn(*mut *mut c_void, c_int) -> CUresult;
/// `cuCtxSetCurrent`.
pub type cuCtxSetCurrent_t = unsafe extern "C" fn(*mut c_void) -> CUresult;
/// `cuMemAlloc_v2`.
pub type cuMemAlloc_t = unsafe extern "C" fn(*mut u64, usize) -> CUresult;
/// `cuMemFree_v2`.
pub type cuMemFree_t = unsafe extern "C" fn(u64) -> CUresult;
/// `cuMemGetInfo_v2`.
pub type cuMemGetInfo_t = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
/// `cuModuleLoadData`.
pub type cuModuleLoadData_t = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> CUresult;
/// `cuModuleGetFunction`.
pub type cuModuleGetFunction_t =
    unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> CUresult;
/// `cuStreamCreate`.
pub type cuStreamCreate_t = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CUresult;
/// `cuStreamSynchronize`.
pub type cuStreamSynchronize_t = unsafe extern "C" fn(*mut c_void) -> CUresult;
/// `cuLaunchKernel`.
pub type cuLaunchKernel_t = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;

/// `nvmlInit_v2`.
pub type nvmlInit_t = unsafe extern "C" fn() -> nvmlReturn_t;
/// `nvmlSystemGetDriverVersion`.
pub type nvmlSystemGetDriverVersion_t = unsafe extern "C" fn(*mut c_char, c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetCount_v2`.
pub type nvmlDeviceGetCount_t = unsafe extern "C" fn(*mut c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetHandleByIndex_v2`.
pub type nvmlDeviceGetHandleByIndex_t =
    unsafe extern "C" fn(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
/// `nvmlDeviceGetHandleByUUID`.
pub type nvmlDeviceGetHandleByUUID_t =
    unsafe extern "C" fn(*const c_char, *mut nvmlDevice_t) -> nvmlReturn_t;
/// `nvmlDeviceGetName` / `nvmlDeviceGetUUID`.
pub type nvmlDeviceGetString_t =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;
/// `nvmlDeviceGetMemoryInfo`.
pub type nvmlDeviceGetMemoryInfo_t =
    unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;

/// A library opened with `dlopen`, never closed: the driver does not support being unloaded.
#[derive(Debug)]
pub struct Lib(*mut c_void);

impl Lib {
    /// Opens `name` (searched like the CUDA runtime searches it); `Err` carries `dlerror()`.
    pub fn open(name: &CStr) -> Result<Self, String> {
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
    pub unsafe fn sym<F: Copy>(&self, name: &CStr) -> Result<F, String> {
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
