//! The CUDA driver API: handles, `CUresult` codes, flags, struct layouts (checked against
//! `cuda.h`, CUDA 13, 64-bit Linux) and the function-pointer types Tessera resolves.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};

// ---- handles and scalars -----------------------------------------------------------------

/// `CUresult`: a C enum without negative values, so `unsigned int` in the C ABI.
pub type CUresult = u32;
/// `CUdevice` (`int`).
pub type CUdevice = c_int;
/// `CUdeviceptr` (64-bit on 64-bit hosts).
pub type CUdeviceptr = u64;
/// `CUcontext`.
pub type CUcontext = *mut c_void;
/// `CUmodule`.
pub type CUmodule = *mut c_void;
/// `CUfunction`.
pub type CUfunction = *mut c_void;
/// `CUstream`.
pub type CUstream = *mut c_void;
/// `CUevent`.
pub type CUevent = *mut c_void;
/// `CUgraphExec`.
pub type CUgraphExec = *mut c_void;
/// `CUmemoryPool`.
pub type CUmemoryPool = *mut c_void;
/// `CUarray`.
pub type CUarray = *mut c_void;
/// `CUmipmappedArray`.
pub type CUmipmappedArray = *mut c_void;
/// `CUmemGenericAllocationHandle`.
pub type CUmemGenericAllocationHandle = u64;
/// `CUhostFn`.
pub type CUhostFn = unsafe extern "C" fn(*mut c_void);

// ---- CUresult codes ----------------------------------------------------------------------

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_IMAGE: CUresult = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_FILE_NOT_FOUND: CUresult = 301;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
pub const CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
pub const CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: CUresult = 903;
pub const CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

// ---- flags and special values ------------------------------------------------------------

/// `CU_STREAM_LEGACY`: the legacy default stream handle, as an address.
pub const CU_STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`: the per-thread default stream handle, as an address.
pub const CU_STREAM_PER_THREAD: usize = 0x2;
/// `CU_STREAM_NON_BLOCKING`.
pub const CU_STREAM_NON_BLOCKING: c_uint = 0x1;

/// `CU_EVENT_DEFAULT` (timing enabled).
pub const CU_EVENT_DEFAULT: c_uint = 0x0;
/// `CU_EVENT_DISABLE_TIMING`.
pub const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;

/// `cuGetProcAddress` flag: resolve the per-thread default stream (`_ptsz`) variant.
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 0x2;
/// `CUdriverProcAddressQueryResult` values.
pub const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: c_int = 2;

/// `cuLaunchKernel` `extra` keys (pointer-sized markers).
pub const CU_LAUNCH_PARAM_END: usize = 0x00;
pub const CU_LAUNCH_PARAM_BUFFER_POINTER: usize = 0x01;
pub const CU_LAUNCH_PARAM_BUFFER_SIZE: usize = 0x02;

/// `CUmemLocationType` values.
pub const CU_MEM_LOCATION_TYPE_DEVICE: u32 = 1;
/// Host memory (not counted against the GPU), and its NUMA-placed forms.
pub const CU_MEM_LOCATION_TYPE_HOST: u32 = 2;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: u32 = 3;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: u32 = 4;
/// `CU_MEM_ALLOCATION_TYPE_PINNED` (`CUmemAllocationType`).
pub const CU_MEM_ALLOCATION_TYPE_PINNED: u32 = 1;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` (`CUmemAllocationHandleType`): the shareable
/// handle is an `int` file descriptor.
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE` (`CUmemAccess_flags`).
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: u32 = 3;

// ---- structs -----------------------------------------------------------------------------

/// `CUuuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}
layout!(CUuuid, size 16, align 1, bytes @ 0);

/// `CUmemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUmemLocation {
    /// `CUmemLocationType` (`type` in C).
    pub kind: u32,
    pub id: c_int,
}
layout!(CUmemLocation, size 8, align 4, kind @ 0, id @ 4);

/// The anonymous `allocFlags` struct of `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUmemAllocFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}
layout!(CUmemAllocFlags, size 8, align 2, compression_type @ 0, gpu_direct_rdma_capable @ 1,
    usage @ 2, reserved @ 4);

/// `CUmemAllocationProp` (v1).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAllocationProp {
    /// `CUmemAllocationType` (`type` in C).
    pub kind: u32,
    pub requested_handle_types: u32,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: CUmemAllocFlags,
}
layout!(CUmemAllocationProp, size 32, align 8, kind @ 0, requested_handle_types @ 4,
    location @ 8, win32_handle_meta_data @ 16, alloc_flags @ 24);

/// `CUmemAccessDesc` (v1).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    /// `CUmemAccess_flags`.
    pub flags: u32,
}
layout!(CUmemAccessDesc, size 12, align 4, location @ 0, flags @ 8);

/// `CUmemPoolProps` (v1).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemPoolProps {
    pub alloc_type: u32,
    pub handle_types: u32,
    pub location: CUmemLocation,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}
layout!(CUmemPoolProps, size 88, align 8, alloc_type @ 0, handle_types @ 4, location @ 8,
    win32_security_attributes @ 16, max_size @ 24, usage @ 32, reserved @ 34);

/// `CUDA_ARRAY_DESCRIPTOR` (v2).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    /// `CUarray_format`.
    pub format: u32,
    pub num_channels: c_uint,
}
layout!(CUDA_ARRAY_DESCRIPTOR, size 24, align 8, width @ 0, height @ 8, format @ 16,
    num_channels @ 20);

/// `CUDA_ARRAY3D_DESCRIPTOR` (v2).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    /// `CUarray_format`.
    pub format: u32,
    pub num_channels: c_uint,
    pub flags: c_uint,
}
layout!(CUDA_ARRAY3D_DESCRIPTOR, size 40, align 8, width @ 0, height @ 8, depth @ 16,
    format @ 24, num_channels @ 28, flags @ 32);

/// The launch shape `CUlaunchConfig` and `CUDA_KERNEL_NODE_PARAMS` both spell out as seven
/// `unsigned int` fields (`gridDimX..Z`, `blockDimX..Z`, `sharedMemBytes`). As a nested struct
/// of 4-byte alignment it keeps the C offsets of both (checked below).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUlaunchShape {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
}
layout!(CUlaunchShape, size 28, align 4, grid @ 0, block @ 12, shared_mem_bytes @ 24);

/// `CUlaunchConfig` (v1).
#[repr(C)]
#[derive(Debug)]
pub struct CUlaunchConfig {
    /// `gridDimX` at offset 0 through `sharedMemBytes` at 24.
    pub shape: CUlaunchShape,
    pub h_stream: CUstream,
    /// `CUlaunchAttribute *`.
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}
layout!(CUlaunchConfig, size 56, align 8, shape @ 0, h_stream @ 32, attrs @ 40,
    num_attrs @ 48);

/// `CUDA_KERNEL_NODE_PARAMS` (v1; v2 extends it with two handles after `extra`).
#[repr(C)]
#[derive(Debug)]
pub struct CUDA_KERNEL_NODE_PARAMS {
    pub func: CUfunction,
    /// `gridDimX` at offset 8 through `sharedMemBytes` at 32.
    pub shape: CUlaunchShape,
    pub kernel_params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
}
layout!(CUDA_KERNEL_NODE_PARAMS, size 56, align 8, func @ 0, shape @ 8, kernel_params @ 40,
    extra @ 48);

/// `CUDA_MEMCPY2D` (v2).
#[repr(C)]
#[derive(Debug)]
pub struct CUDA_MEMCPY2D {
    pub src_x_in_bytes: usize,
    pub src_y: usize,
    /// `CUmemorytype`.
    pub src_memory_type: u32,
    pub src_host: *const c_void,
    pub src_device: CUdeviceptr,
    pub src_array: CUarray,
    pub src_pitch: usize,
    pub dst_x_in_bytes: usize,
    pub dst_y: usize,
    /// `CUmemorytype`.
    pub dst_memory_type: u32,
    pub dst_host: *mut c_void,
    pub dst_device: CUdeviceptr,
    pub dst_array: CUarray,
    pub dst_pitch: usize,
    pub width_in_bytes: usize,
    pub height: usize,
}
layout!(CUDA_MEMCPY2D, size 128, align 8, src_x_in_bytes @ 0, src_y @ 8, src_memory_type @ 16,
    src_host @ 24, src_device @ 32, src_array @ 40, src_pitch @ 48, dst_x_in_bytes @ 56,
    dst_y @ 64, dst_memory_type @ 72, dst_host @ 80, dst_device @ 88, dst_array @ 96,
    dst_pitch @ 104, width_in_bytes @ 112, height @ 120);

// ---- function-pointer types --------------------------------------------------------------
// One per entry point Tessera resolves, named after the exact exported variant. The `_ptsz`
// variants share the signature of their plain twin.

pub type cuInit_t = unsafe extern "C" fn(c_uint) -> CUresult;
pub type cuDriverGetVersion_t = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub type cuDeviceGet_t = unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult;
pub type cuDeviceGetCount_t = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub type cuDeviceGetName_t = unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult;
pub type cuDeviceGetUuid_t = unsafe extern "C" fn(*mut CUuuid, CUdevice) -> CUresult;
pub type cuDeviceTotalMem_v2_t = unsafe extern "C" fn(*mut usize, CUdevice) -> CUresult;
pub type cuDevicePrimaryCtxRetain_t = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
pub type cuDevicePrimaryCtxRelease_v2_t = unsafe extern "C" fn(CUdevice) -> CUresult;
pub type cuDevicePrimaryCtxReset_v2_t = unsafe extern "C" fn(CUdevice) -> CUresult;
pub type cuCtxCreate_v2_t = unsafe extern "C" fn(*mut CUcontext, c_uint, CUdevice) -> CUresult;
/// `cuCtxCreate_v3` (CUDA 11.4): `(pctx, CUexecAffinityParam *params, numParams, flags, dev)`.
pub type cuCtxCreate_v3_t =
    unsafe extern "C" fn(*mut CUcontext, *mut c_void, c_int, c_uint, CUdevice) -> CUresult;
/// `cuCtxCreate_v4` (CUDA 12.5): `(pctx, CUctxCreateParams *params, flags, dev)`.
pub type cuCtxCreate_v4_t =
    unsafe extern "C" fn(*mut CUcontext, *mut c_void, c_uint, CUdevice) -> CUresult;
pub type cuCtxDestroy_v2_t = unsafe extern "C" fn(CUcontext) -> CUresult;
/// `cuGreenCtxCreate` (CUDA 12.4): `(phCtx, CUdevResourceDesc desc, dev, flags)`; both handles
/// are opaque pointers.
pub type cuGreenCtxCreate_t =
    unsafe extern "C" fn(*mut *mut c_void, *mut c_void, CUdevice, c_uint) -> CUresult;
/// `cuGreenCtxDestroy` (CUDA 12.4).
pub type cuGreenCtxDestroy_t = unsafe extern "C" fn(*mut c_void) -> CUresult;
pub type cuCtxGetCurrent_t = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
pub type cuCtxSetCurrent_t = unsafe extern "C" fn(CUcontext) -> CUresult;
pub type cuCtxSynchronize_t = unsafe extern "C" fn() -> CUresult;
pub type cuCtxSynchronize_v2_t = unsafe extern "C" fn(CUcontext) -> CUresult;

pub type cuGetProcAddress_t =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
pub type cuGetProcAddress_v2_t =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

pub type cuMemAlloc_v2_t = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
pub type cuMemAllocPitch_v2_t =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult;
pub type cuMemAllocManaged_t = unsafe extern "C" fn(*mut CUdeviceptr, usize, c_uint) -> CUresult;
pub type cuMemAllocAsync_t = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
pub type cuMemAllocFromPoolAsync_t =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult;
pub type cuMemFree_v2_t = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
pub type cuMemFreeAsync_t = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
pub type cuMemGetInfo_v2_t = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
pub type cuMemcpyHtoD_v2_t = unsafe extern "C" fn(CUdeviceptr, *const c_void, usize) -> CUresult;
pub type cuMemcpyDtoH_v2_t = unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize) -> CUresult;

pub type cuMemCreate_t = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    u64,
) -> CUresult;
pub type cuMemRelease_t = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult;
pub type cuMemAddressReserve_t =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64) -> CUresult;
pub type cuMemAddressFree_t = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
pub type cuMemMap_t =
    unsafe extern "C" fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64) -> CUresult;
pub type cuMemUnmap_t = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
pub type cuMemSetAccess_t =
    unsafe extern "C" fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize) -> CUresult;
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
pub type cuArrayDestroy_t = unsafe extern "C" fn(CUarray) -> CUresult;
pub type cuMipmappedArrayDestroy_t = unsafe extern "C" fn(CUmipmappedArray) -> CUresult;

pub type cuModuleLoadData_t = unsafe extern "C" fn(*mut CUmodule, *const c_void) -> CUresult;
pub type cuModuleGetFunction_t =
    unsafe extern "C" fn(*mut CUfunction, CUmodule, *const c_char) -> CUresult;
/// `cuLaunchKernel(f, grid xyz, block xyz, sharedMemBytes, stream, kernelParams, extra)`.
#[rustfmt::skip]
pub type cuLaunchKernel_t = unsafe extern "C" fn(
    CUfunction,
    c_uint, c_uint, c_uint,
    c_uint, c_uint, c_uint,
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
/// `cuLaunchCooperativeKernel`: the arguments of `cuLaunchKernel` but `extra`.
#[rustfmt::skip]
pub type cuLaunchCooperativeKernel_t = unsafe extern "C" fn(CUfunction, c_uint, c_uint, c_uint,
    c_uint, c_uint, c_uint, c_uint, CUstream, *mut *mut c_void) -> CUresult;
pub type cuGraphLaunch_t = unsafe extern "C" fn(CUgraphExec, CUstream) -> CUresult;

pub type cuStreamCreate_t = unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult;
pub type cuStreamDestroy_v2_t = unsafe extern "C" fn(CUstream) -> CUresult;
pub type cuStreamSynchronize_t = unsafe extern "C" fn(CUstream) -> CUresult;
pub type cuStreamIsCapturing_t = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;
/// `cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)`: sets the calling thread's
/// capture interaction mode, returning the previous one in `*mode`.
pub type cuThreadExchangeStreamCaptureMode_t = unsafe extern "C" fn(*mut c_int) -> CUresult;
/// `CU_STREAM_CAPTURE_MODE_RELAXED` (`CUstreamCaptureMode`, cuda.h: GLOBAL 0, THREAD_LOCAL
/// 1, RELAXED 2): the thread may make potentially unsafe calls while other threads capture.
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;

pub type cuEventCreate_t = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
pub type cuEventRecord_t = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
pub type cuEventQuery_t = unsafe extern "C" fn(CUevent) -> CUresult;
pub type cuEventSynchronize_t = unsafe extern "C" fn(CUevent) -> CUresult;
pub type cuEventElapsedTime_t = unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> CUresult;
pub type cuEventDestroy_v2_t = unsafe extern "C" fn(CUevent) -> CUresult;
