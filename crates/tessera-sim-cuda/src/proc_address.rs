//! `cuGetProcAddress(_v2)`: one table maps (base name, version, per-thread flag) to entry points.
//!
//! Callers (the CUDA runtime, `cuda-bindings`) ask for a base name with the CUDA version whose
//! ABI they were built against; the newest variant introduced at or before that version is
//! returned, and with the per-thread flag the `_ptsz`/`_ptds` variant when one exists. Entries
//! with no function mark newer ABIs this simulator does not provide, so an old variant is never
//! handed out for a newer signature.

use std::ffi::{CStr, c_char, c_void};
use std::sync::OnceLock;

use crate::array::*;
use crate::capture_mode::*;
use crate::context::*;
use crate::copy::*;
use crate::device::*;
use crate::errors::*;
use crate::ffi::*;
use crate::graph::*;
use crate::memory::*;
use crate::module::*;
use crate::runtime::*;
use crate::stream::*;
use crate::vmm::*;

/// One table row.
struct Entry {
    base: &'static str,
    version: u32,
    per_thread: bool,
    name: &'static str,
    func: usize,
}

macro_rules! e {
    ($base:literal, $ver:literal, none) => {
        Entry {
            base: $base,
            version: $ver,
            per_thread: false,
            name: "",
            func: 0,
        }
    };
    ($base:literal, $ver:literal, $f:ident) => {
        Entry {
            base: $base,
            version: $ver,
            per_thread: false,
            name: stringify!($f),
            func: $f as *const () as usize,
        }
    };
    ($base:literal, $ver:literal, pt $f:ident) => {
        Entry {
            base: $base,
            version: $ver,
            per_thread: true,
            name: stringify!($f),
            func: $f as *const () as usize,
        }
    };
}

fn table() -> &'static [Entry] {
    static T: OnceLock<Vec<Entry>> = OnceLock::new();
    T.get_or_init(|| {
        vec![
            e!("cuGetErrorString", 6000, cuGetErrorString),
            e!("cuGetErrorName", 6000, cuGetErrorName),
            e!("cuInit", 2000, cuInit),
            e!("cuDriverGetVersion", 2020, cuDriverGetVersion),
            e!("cuGetProcAddress", 11030, cuGetProcAddress),
            e!("cuGetProcAddress", 12000, cuGetProcAddress_v2),
            e!("cuDeviceGet", 2000, cuDeviceGet),
            e!("cuDeviceGetCount", 2000, cuDeviceGetCount),
            e!("cuDeviceGetName", 2000, cuDeviceGetName),
            e!("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
            e!("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
            e!("cuDeviceGetLuid", 10000, cuDeviceGetLuid),
            e!("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
            e!("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
            e!("cuDeviceComputeCapability", 2000, cuDeviceComputeCapability),
            e!("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId),
            e!("cuDeviceGetByPCIBusId", 4010, cuDeviceGetByPCIBusId),
            e!("cuDeviceCanAccessPeer", 4000, cuDeviceCanAccessPeer),
            e!(
                "cuDeviceGetDefaultMemPool",
                11020,
                cuDeviceGetDefaultMemPool
            ),
            e!("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool),
            e!("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
            e!(
                "cuDevicePrimaryCtxRelease",
                7000,
                cuDevicePrimaryCtxRelease_v2
            ),
            e!(
                "cuDevicePrimaryCtxRelease",
                11000,
                cuDevicePrimaryCtxRelease_v2
            ),
            e!("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset_v2),
            e!("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2),
            e!(
                "cuDevicePrimaryCtxSetFlags",
                7000,
                cuDevicePrimaryCtxSetFlags_v2
            ),
            e!(
                "cuDevicePrimaryCtxSetFlags",
                11000,
                cuDevicePrimaryCtxSetFlags_v2
            ),
            e!(
                "cuDevicePrimaryCtxGetState",
                7000,
                cuDevicePrimaryCtxGetState
            ),
            e!("cuCtxCreate", 3020, cuCtxCreate_v2),
            e!("cuCtxCreate", 11040, none),
            e!("cuCtxCreate", 12050, cuCtxCreate_v4),
            e!("cuDeviceGetDevResource", 12040, cuDeviceGetDevResource),
            e!(
                "cuDevResourceGenerateDesc",
                12040,
                cuDevResourceGenerateDesc
            ),
            e!("cuGreenCtxCreate", 12040, cuGreenCtxCreate),
            e!("cuGreenCtxDestroy", 12040, cuGreenCtxDestroy),
            e!("cuCtxFromGreenCtx", 12040, cuCtxFromGreenCtx),
            e!("cuCtxDestroy", 4000, cuCtxDestroy_v2),
            e!("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
            e!("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
            e!("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
            e!("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
            e!("cuCtxGetDevice", 2000, cuCtxGetDevice),
            e!("cuCtxGetDevice", 13000, cuCtxGetDevice_v2),
            e!("cuCtxSynchronize", 2000, cuCtxSynchronize),
            e!("cuCtxSynchronize", 13000, cuCtxSynchronize_v2),
            e!("cuCtxGetFlags", 7000, cuCtxGetFlags),
            e!("cuCtxSetFlags", 12010, cuCtxSetFlags),
            e!("cuCtxGetApiVersion", 3020, cuCtxGetApiVersion),
            e!("cuCtxGetId", 12000, cuCtxGetId),
            e!(
                "cuCtxGetStreamPriorityRange",
                5050,
                cuCtxGetStreamPriorityRange
            ),
            e!("cuCtxGetLimit", 3010, cuCtxGetLimit),
            e!("cuCtxSetLimit", 3010, cuCtxSetLimit),
            e!("cuCtxGetCacheConfig", 3020, cuCtxGetCacheConfig),
            e!("cuCtxSetCacheConfig", 3020, cuCtxSetCacheConfig),
            e!("cuStreamCreate", 2000, cuStreamCreate),
            e!(
                "cuStreamCreateWithPriority",
                5050,
                cuStreamCreateWithPriority
            ),
            e!("cuStreamDestroy", 4000, cuStreamDestroy_v2),
            e!("cuStreamSynchronize", 2000, cuStreamSynchronize),
            e!("cuStreamSynchronize", 7000, pt cuStreamSynchronize_ptsz),
            e!("cuStreamQuery", 2000, cuStreamQuery),
            e!("cuStreamQuery", 7000, pt cuStreamQuery_ptsz),
            e!("cuStreamWaitEvent", 3020, cuStreamWaitEvent),
            e!("cuStreamWaitEvent", 7000, pt cuStreamWaitEvent_ptsz),
            e!("cuStreamGetPriority", 5050, cuStreamGetPriority),
            e!("cuStreamGetPriority", 7000, pt cuStreamGetPriority_ptsz),
            e!("cuStreamGetFlags", 5050, cuStreamGetFlags),
            e!("cuStreamGetFlags", 7000, pt cuStreamGetFlags_ptsz),
            e!("cuStreamGetId", 12000, cuStreamGetId),
            e!("cuStreamGetId", 12000, pt cuStreamGetId_ptsz),
            e!("cuStreamGetCtx", 9020, cuStreamGetCtx),
            e!("cuStreamGetCtx", 9020, pt cuStreamGetCtx_ptsz),
            e!("cuStreamGetCtx", 12050, none),
            e!("cuLaunchHostFunc", 10000, cuLaunchHostFunc),
            e!("cuLaunchHostFunc", 10000, pt cuLaunchHostFunc_ptsz),
            e!("cuLaunchHostFunc", 13020, cuLaunchHostFunc_v2),
            e!("cuLaunchHostFunc", 13020, pt cuLaunchHostFunc_v2_ptsz),
            e!("cuEventCreate", 2000, cuEventCreate),
            e!("cuEventDestroy", 4000, cuEventDestroy_v2),
            e!("cuEventRecord", 2000, cuEventRecord),
            e!("cuEventRecord", 7000, pt cuEventRecord_ptsz),
            e!("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags),
            e!("cuEventRecordWithFlags", 11010, pt cuEventRecordWithFlags_ptsz),
            e!("cuEventQuery", 2000, cuEventQuery),
            e!("cuEventSynchronize", 2000, cuEventSynchronize),
            e!("cuEventElapsedTime", 2000, cuEventElapsedTime),
            e!("cuEventElapsedTime", 12080, cuEventElapsedTime_v2),
            e!("cuMemAlloc", 3020, cuMemAlloc_v2),
            e!("cuMemFree", 3020, cuMemFree_v2),
            e!("cuMemGetInfo", 3020, cuMemGetInfo_v2),
            e!("cuMemAllocPitch", 3020, cuMemAllocPitch_v2),
            e!("cuMemAllocManaged", 6000, cuMemAllocManaged),
            e!("cuMemAllocHost", 3020, cuMemAllocHost_v2),
            e!("cuMemHostAlloc", 2020, cuMemHostAlloc),
            e!("cuMemFreeHost", 2000, cuMemFreeHost),
            e!(
                "cuMemHostGetDevicePointer",
                3020,
                cuMemHostGetDevicePointer_v2
            ),
            e!("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2),
            e!("cuMemAllocAsync", 11020, cuMemAllocAsync),
            e!("cuMemAllocAsync", 11020, pt cuMemAllocAsync_ptsz),
            e!("cuMemFreeAsync", 11020, cuMemFreeAsync),
            e!("cuMemFreeAsync", 11020, pt cuMemFreeAsync_ptsz),
            e!("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync),
            e!("cuMemAllocFromPoolAsync", 11020, pt cuMemAllocFromPoolAsync_ptsz),
            e!("cuMemPoolCreate", 11020, cuMemPoolCreate),
            e!("cuMemPoolDestroy", 11020, cuMemPoolDestroy),
            e!("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo),
            e!("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute),
            e!("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute),
            e!("cuPointerGetAttribute", 4000, cuPointerGetAttribute),
            e!("cuMemcpy", 4000, cuMemcpy),
            e!("cuMemcpy", 7000, pt cuMemcpy_ptds),
            e!("cuMemcpyAsync", 4000, cuMemcpyAsync),
            e!("cuMemcpyAsync", 7000, pt cuMemcpyAsync_ptsz),
            e!("cuMemcpyPeer", 4000, cuMemcpyPeer),
            e!("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
            e!("cuMemcpyHtoD", 7000, pt cuMemcpyHtoD_v2_ptds),
            e!("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
            e!("cuMemcpyDtoH", 7000, pt cuMemcpyDtoH_v2_ptds),
            e!("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2),
            e!("cuMemcpyDtoD", 7000, pt cuMemcpyDtoD_v2_ptds),
            e!("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2),
            e!("cuMemcpyHtoDAsync", 7000, pt cuMemcpyHtoDAsync_v2_ptsz),
            e!("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
            e!("cuMemcpyDtoHAsync", 7000, pt cuMemcpyDtoHAsync_v2_ptsz),
            e!("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2),
            e!("cuMemcpyDtoDAsync", 7000, pt cuMemcpyDtoDAsync_v2_ptsz),
            e!("cuMemsetD8", 3020, cuMemsetD8_v2),
            e!("cuMemsetD8", 7000, pt cuMemsetD8_v2_ptds),
            e!("cuMemsetD16", 3020, cuMemsetD16_v2),
            e!("cuMemsetD16", 7000, pt cuMemsetD16_v2_ptds),
            e!("cuMemsetD32", 3020, cuMemsetD32_v2),
            e!("cuMemsetD32", 7000, pt cuMemsetD32_v2_ptds),
            e!("cuMemsetD8Async", 3020, cuMemsetD8Async),
            e!("cuMemsetD8Async", 7000, pt cuMemsetD8Async_ptsz),
            e!("cuMemsetD16Async", 3020, cuMemsetD16Async),
            e!("cuMemsetD16Async", 7000, pt cuMemsetD16Async_ptsz),
            e!("cuMemsetD32Async", 3020, cuMemsetD32Async),
            e!("cuMemsetD32Async", 7000, pt cuMemsetD32Async_ptsz),
            e!("cuMemsetD2D8", 3020, cuMemsetD2D8_v2),
            e!("cuMemsetD2D8", 7000, pt cuMemsetD2D8_v2_ptds),
            e!("cuMemsetD2D16", 3020, cuMemsetD2D16_v2),
            e!("cuMemsetD2D16", 7000, pt cuMemsetD2D16_v2_ptds),
            e!("cuMemsetD2D32", 3020, cuMemsetD2D32_v2),
            e!("cuMemsetD2D32", 7000, pt cuMemsetD2D32_v2_ptds),
            e!("cuMemsetD2D8Async", 3020, cuMemsetD2D8Async),
            e!("cuMemsetD2D8Async", 7000, pt cuMemsetD2D8Async_ptsz),
            e!("cuMemsetD2D16Async", 3020, cuMemsetD2D16Async),
            e!("cuMemsetD2D16Async", 7000, pt cuMemsetD2D16Async_ptsz),
            e!("cuMemsetD2D32Async", 3020, cuMemsetD2D32Async),
            e!("cuMemsetD2D32Async", 7000, pt cuMemsetD2D32Async_ptsz),
            e!("cuMemcpy2D", 3020, cuMemcpy2D_v2),
            e!("cuMemcpy2D", 7000, pt cuMemcpy2D_v2_ptds),
            e!("cuMemcpy2DUnaligned", 3020, cuMemcpy2DUnaligned_v2),
            e!("cuMemcpy2DUnaligned", 7000, pt cuMemcpy2DUnaligned_v2_ptds),
            e!("cuMemcpy2DAsync", 3020, cuMemcpy2DAsync_v2),
            e!("cuMemcpy2DAsync", 7000, pt cuMemcpy2DAsync_v2_ptsz),
            e!("cuMemCreate", 10020, cuMemCreate),
            e!("cuMemRelease", 10020, cuMemRelease),
            e!("cuMemAddressReserve", 10020, cuMemAddressReserve),
            e!("cuMemAddressFree", 10020, cuMemAddressFree),
            e!("cuMemMap", 10020, cuMemMap),
            e!("cuMemUnmap", 10020, cuMemUnmap),
            e!(
                "cuMemRetainAllocationHandle",
                11000,
                cuMemRetainAllocationHandle
            ),
            e!(
                "cuMemExportToShareableHandle",
                10020,
                cuMemExportToShareableHandle
            ),
            e!(
                "cuMemImportFromShareableHandle",
                10020,
                cuMemImportFromShareableHandle
            ),
            e!("cuMemSetAccess", 10020, cuMemSetAccess),
            e!(
                "cuMemGetAllocationGranularity",
                10020,
                cuMemGetAllocationGranularity
            ),
            e!("cuArrayCreate", 3020, cuArrayCreate_v2),
            e!("cuArray3DCreate", 3020, cuArray3DCreate_v2),
            e!("cuArrayDestroy", 2000, cuArrayDestroy),
            e!("cuMipmappedArrayCreate", 5000, cuMipmappedArrayCreate),
            e!("cuMipmappedArrayDestroy", 5000, cuMipmappedArrayDestroy),
            e!("cuModuleLoad", 2000, cuModuleLoad),
            e!("cuModuleLoadData", 2000, cuModuleLoadData),
            e!("cuModuleLoadDataEx", 2010, cuModuleLoadDataEx),
            e!("cuModuleUnload", 2000, cuModuleUnload),
            e!("cuModuleGetFunction", 2000, cuModuleGetFunction),
            e!("cuModuleGetGlobal", 3020, cuModuleGetGlobal_v2),
            e!("cuFuncGetAttribute", 2020, cuFuncGetAttribute),
            e!("cuFuncSetAttribute", 9000, cuFuncSetAttribute),
            e!("cuFuncSetCacheConfig", 3000, cuFuncSetCacheConfig),
            e!("cuFuncGetName", 12030, cuFuncGetName),
            e!("cuLaunchKernel", 4000, cuLaunchKernel),
            e!("cuLaunchKernel", 7000, pt cuLaunchKernel_ptsz),
            e!("cuLaunchKernelEx", 11060, cuLaunchKernelEx),
            e!("cuLaunchKernelEx", 11060, pt cuLaunchKernelEx_ptsz),
            e!("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel),
            e!("cuLaunchCooperativeKernel", 9000, pt cuLaunchCooperativeKernel_ptsz),
            e!("cuGraphCreate", 10000, cuGraphCreate),
            e!("cuGraphDestroy", 10000, cuGraphDestroy),
            e!("cuGraphAddKernelNode", 10000, cuGraphAddKernelNode_v2),
            e!("cuGraphAddKernelNode", 12000, cuGraphAddKernelNode_v2),
            e!(
                "cuGraphInstantiateWithFlags",
                11040,
                cuGraphInstantiateWithFlags
            ),
            e!("cuGraphExecDestroy", 10000, cuGraphExecDestroy),
            e!("cuGraphLaunch", 10000, cuGraphLaunch),
            e!("cuGraphLaunch", 10000, pt cuGraphLaunch_ptsz),
            e!("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2),
            e!("cuStreamBeginCapture", 10010, pt cuStreamBeginCapture_v2_ptsz),
            e!("cuStreamEndCapture", 10000, cuStreamEndCapture),
            e!("cuStreamEndCapture", 10000, pt cuStreamEndCapture_ptsz),
            e!("cuStreamIsCapturing", 10000, cuStreamIsCapturing),
            e!("cuStreamIsCapturing", 10000, pt cuStreamIsCapturing_ptsz),
            e!(
                "cuThreadExchangeStreamCaptureMode",
                10010,
                cuThreadExchangeStreamCaptureMode
            ),
        ]
    })
}

/// Resolves `symbol` for `version` and `flags`: Ok(function) or Err(symbol status).
fn resolve_symbol(symbol: &str, version: i32, flags: u64) -> Result<usize, i32> {
    let t = table();
    let version = version.max(0) as u32;
    let per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let mut rows: Vec<&Entry> = t.iter().filter(|e| e.base == symbol).collect();
    if rows.is_empty() {
        // Lenient: a full versioned name (e.g. `cuMemAlloc_v2`) names exactly that function.
        return t
            .iter()
            .find(|e| e.name == symbol && e.func != 0)
            .map(|e| e.func)
            .ok_or(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    }
    rows.retain(|e| e.version <= version);
    let best = rows
        .iter()
        .filter(|e| !e.per_thread)
        .max_by_key(|e| e.version);
    let Some(best) = best else {
        return Err(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    };
    // A per-thread variant serves only if it is of the newest ABI (not older than `best`).
    let pt = rows
        .iter()
        .filter(|e| e.per_thread && e.version >= best.version)
        .max_by_key(|e| e.version);
    let pick = match pt {
        Some(e) if per_thread => e,
        _ => best,
    };
    if pick.func != 0 {
        Ok(pick.func)
    } else {
        Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
    }
}

fn get_proc(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut i32,
) -> CUresult {
    guard(|| {
        if symbol.is_null() || pfn.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null C string from the caller.
        let name = unsafe { CStr::from_ptr(symbol) }.to_string_lossy();
        let found = resolve_symbol(&name, version, flags);
        if std::env::var_os("TESSERA_SIM_TRACE").is_some() {
            eprintln!(
                "tessera-sim: cuGetProcAddress({name}, {version}, {flags}) -> {}",
                found.is_ok()
            );
        }
        let (ptr, st) = match found {
            Ok(f) => (f as *mut c_void, CU_GET_PROC_ADDRESS_SUCCESS),
            Err(st) => (std::ptr::null_mut(), st),
        };
        // SAFETY: non-null out-pointer from the caller; `status` is optional.
        unsafe {
            put(pfn, ptr)?;
            if !status.is_null() {
                put(status, st)?;
            }
        }
        if found.is_err() {
            return Err(CUDA_ERROR_NOT_FOUND);
        }
        Ok(())
    })
}

/// `cuGetProcAddress_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut i32,
) -> CUresult {
    get_proc(symbol, pfn, version, flags, status)
}

/// `cuGetProcAddress` (CUDA 11.3 signature, no status).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
) -> CUresult {
    get_proc(symbol, pfn, version, flags, std::ptr::null_mut())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_versions_and_per_thread_variants() {
        assert_eq!(
            resolve_symbol("cuMemAlloc", 3020, 0),
            Ok(cuMemAlloc_v2 as *const () as usize)
        );
        assert_eq!(
            resolve_symbol("cuMemAlloc", 2000, 0),
            Err(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
        );
        assert_eq!(
            resolve_symbol("cuLaunchKernel", 13000, 2),
            Ok(cuLaunchKernel_ptsz as *const () as usize)
        );
        assert_eq!(
            resolve_symbol("cuLaunchKernel", 13000, 0),
            Ok(cuLaunchKernel as *const () as usize)
        );
        assert_eq!(
            resolve_symbol("cuMemcpyHtoD", 12000, 2),
            Ok(cuMemcpyHtoD_v2_ptds as *const () as usize)
        );
        assert_eq!(
            resolve_symbol("cuMemAlloc", 12000, 2),
            Ok(cuMemAlloc_v2 as *const () as usize)
        );
        assert_eq!(
            resolve_symbol("cuCtxCreate", 12000, 0),
            Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
        );
        assert_eq!(
            resolve_symbol("cuCtxCreate", 12080, 0),
            Ok(cuCtxCreate_v4 as *const () as usize)
        );
        assert_eq!(
            resolve_symbol("cuCtxGetDevice", 12000, 0),
            Ok(cuCtxGetDevice as *const () as usize)
        );
        assert_eq!(
            resolve_symbol("cuCtxGetDevice", 13000, 0),
            Ok(cuCtxGetDevice_v2 as *const () as usize)
        );
        assert_eq!(
            resolve_symbol("cuStreamGetCtx", 13000, 2),
            Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
        );
        assert_eq!(
            resolve_symbol("cuStreamGetCtx", 9020, 2),
            Ok(cuStreamGetCtx_ptsz as *const () as usize)
        );
        assert_eq!(
            resolve_symbol("cuNoSuchThing", 13000, 0),
            Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
        );
    }
}
