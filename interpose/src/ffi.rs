//! Raw C declarations: the dynamic loader, `pthread_atfork`, `pthread_setcancelstate`, socket
//! flags, and the CUDA driver
//! and NVML types the hooks touch. Layouts follow `cuda.h` / `nvml.h` (CUDA 13) on 64-bit Linux.

#![allow(non_camel_case_types, non_snake_case, dead_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};

// ---- dynamic loader ----------------------------------------------------------------------

/// `RTLD_NEXT` is `((void *) -1)` in glibc.
pub const RTLD_NEXT: *mut c_void = usize::MAX as *mut c_void;
pub const RTLD_LAZY: c_int = 0x0001;
pub const RTLD_NOW: c_int = 0x0002;
pub const RTLD_NOLOAD: c_int = 0x0004;
pub const RTLD_LOCAL: c_int = 0;

/// `Dl_info` from `<dlfcn.h>`.
#[repr(C)]
pub struct Dl_info {
    pub dli_fname: *const c_char,
    pub dli_fbase: *mut c_void,
    pub dli_sname: *const c_char,
    pub dli_saddr: *mut c_void,
}

/// Signature of `dlsym`.
pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

unsafe extern "C" {
    pub fn dlvsym(
        handle: *mut c_void,
        symbol: *const c_char,
        version: *const c_char,
    ) -> *mut c_void;
    pub fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    pub fn dladdr(addr: *const c_void, info: *mut Dl_info) -> c_int;
    pub fn pthread_atfork(
        prepare: Option<unsafe extern "C" fn()>,
        parent: Option<unsafe extern "C" fn()>,
        child: Option<unsafe extern "C" fn()>,
    ) -> c_int;
    pub fn pthread_setcancelstate(state: c_int, oldstate: *mut c_int) -> c_int;
}

/// `PTHREAD_CANCEL_DISABLE` (glibc and musl).
pub const PTHREAD_CANCEL_DISABLE: c_int = 1;

// ---- CUDA driver -------------------------------------------------------------------------

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUcontext = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// `CUmemLocationType` values that place memory on the host (not counted against the GPU).
pub const CU_MEM_LOCATION_TYPE_HOST: c_int = 2;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: c_int = 3;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: c_int = 4;

/// `CU_EVENT_DEFAULT` (timing enabled).
pub const CU_EVENT_DEFAULT: c_uint = 0;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemLocation {
    pub type_: c_int,
    pub id: c_int,
}

/// `CUmemAllocationProp` (only `location` is read).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requestedHandleTypes: c_int,
    pub location: CUmemLocation,
    pub win32HandleMetaData: *mut c_void,
    pub compressionType: u8,
    pub gpuDirectRDMACapable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUDA_ARRAY_DESCRIPTOR` (v2).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Format: c_uint,
    pub NumChannels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (v2).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Depth: usize,
    pub Format: c_uint,
    pub NumChannels: c_uint,
    pub Flags: c_uint,
}

/// `CUlaunchConfig` (only `hStream` is read).
#[repr(C)]
pub struct CUlaunchConfig {
    pub gridDimX: c_uint,
    pub gridDimY: c_uint,
    pub gridDimZ: c_uint,
    pub blockDimX: c_uint,
    pub blockDimY: c_uint,
    pub blockDimZ: c_uint,
    pub sharedMemBytes: c_uint,
    pub hStream: CUstream,
    pub attrs: *mut c_void,
    pub numAttrs: c_uint,
}

// Signatures of the hooked driver entry points (identical for `_ptsz` variants).
pub type cuMemAlloc_v2_t = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
pub type cuMemAllocPitch_v2_t =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult;
pub type cuMemAllocManaged_t = unsafe extern "C" fn(*mut CUdeviceptr, usize, c_uint) -> CUresult;
pub type cuMemAllocAsync_t = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
pub type cuMemAllocFromPoolAsync_t =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult;
pub type cuMemCreate_t = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    u64,
) -> CUresult;
pub type cuMemRelease_t = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult;
pub type cuMemMap_t =
    unsafe extern "C" fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64) -> CUresult;
pub type cuMemUnmap_t = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
pub type cuMemAddressFree_t = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
pub type cuMemRetainAllocationHandle_t =
    unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *mut c_void) -> CUresult;
pub type cuMemImportFromShareableHandle_t =
    unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *mut c_void, c_int) -> CUresult;
pub type cuArrayCreate_v2_t =
    unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR) -> CUresult;
pub type cuArray3DCreate_v2_t =
    unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult;
pub type cuMipmappedArrayCreate_t =
    unsafe extern "C" fn(*mut CUmipmappedArray, *const CUDA_ARRAY3D_DESCRIPTOR, c_uint) -> CUresult;
pub type cuMemFree_v2_t = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
pub type cuMemFreeAsync_t = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
pub type cuArrayDestroy_t = unsafe extern "C" fn(CUarray) -> CUresult;
pub type cuMipmappedArrayDestroy_t = unsafe extern "C" fn(CUmipmappedArray) -> CUresult;
pub type cuMemGetInfo_v2_t = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
pub type cuDeviceTotalMem_v2_t = unsafe extern "C" fn(*mut usize, CUdevice) -> CUresult;
pub type cuGetProcAddress_t =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
pub type cuGetProcAddress_v2_t =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;
pub type cuLaunchKernel_t = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
pub type cuLaunchKernelEx_t = unsafe extern "C" fn(
    *const CUlaunchConfig,
    CUfunction,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
pub type cuLaunchCooperativeKernel_t = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
) -> CUresult;
pub type cuGraphLaunch_t = unsafe extern "C" fn(CUgraphExec, CUstream) -> CUresult;

// Used by launch gating to measure GPU time (resolved from the real driver, never hooked).
pub type cuEventCreate_t = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
pub type cuEventRecord_t = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
pub type cuEventQuery_t = unsafe extern "C" fn(CUevent) -> CUresult;
pub type cuEventElapsedTime_t = unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> CUresult;
pub type cuEventDestroy_v2_t = unsafe extern "C" fn(CUevent) -> CUresult;
pub type cuCtxGetCurrent_t = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
pub type cuCtxSetCurrent_t = unsafe extern "C" fn(CUcontext) -> CUresult;
pub type cuStreamIsCapturing_t = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;
pub type cuStreamDestroy_v2_t = unsafe extern "C" fn(CUstream) -> CUresult;
// Hooked so the launch gate hears of a drain the moment the application waits one out.
pub type cuStreamSynchronize_t = unsafe extern "C" fn(CUstream) -> CUresult;
pub type cuCtxSynchronize_t = unsafe extern "C" fn() -> CUresult;
pub type cuCtxSynchronize_v2_t = unsafe extern "C" fn(CUcontext) -> CUresult;
pub type cuEventSynchronize_t = unsafe extern "C" fn(CUevent) -> CUresult;

// ---- NVML --------------------------------------------------------------------------------

pub type nvmlReturn_t = c_int;
pub type nvmlDevice_t = *mut c_void;

pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

/// `nvmlMemory_t`.
#[repr(C)]
pub struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

pub type nvmlDeviceGetMemoryInfo_t =
    unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;
pub type nvmlDeviceGetMemoryInfo_v2_t =
    unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_v2_t) -> nvmlReturn_t;
