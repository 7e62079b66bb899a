//! The table of hooked entry points: one row per exact variant (`cuMemAllocAsync` and
//! `cuMemAllocAsync_ptsz` are two rows), with the base name and CUDA version range under which
//! `cuGetProcAddress` hands it out, and the slot holding the real function.
//!
//! Our wrapper of each row is not here: the shims are defined above this module (they call
//! through the real-function slots), so the rows they produce live on their side, in
//! [`crate::dlsym`], and the dependency runs one way.
//!
//! Version thresholds mirror `cuda.h` / `cudaTypedefs.h` (CUDA 13): e.g. `cuMemAlloc` at
//! version >= 3020 is `cuMemAlloc_v2`; `cuGetProcAddress` at >= 12000 is `cuGetProcAddress_v2`.

use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::ffi::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;

/// Which library a hooked symbol belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lib {
    /// `libcuda.so.1`.
    Cuda,
    /// `libnvidia-ml.so.1`.
    Nvml,
}

/// One hooked variant.
#[derive(Debug)]
pub struct Hook {
    /// This row's index.
    pub id: HookId,
    /// Exact exported name, e.g. `cuMemAllocAsync_ptsz`.
    pub name: &'static CStr,
    /// Name callers pass to `cuGetProcAddress`, e.g. `cuMemAllocAsync`.
    pub base: &'static str,
    /// First CUDA version (`cudaVersion` argument) that resolves `base` to this variant.
    pub since: i32,
    /// First version that resolves `base` to a newer variant (`i32::MAX`: none).
    pub until: i32,
    /// True for the per-thread default stream variant (`_ptsz`), chosen by flag 2.
    pub per_thread: bool,
    /// Owning library.
    pub lib: Lib,
    /// The real function, once known.
    pub real: AtomicPtr<c_void>,
}

impl Hook {
    /// The real function pointer, or null.
    #[inline]
    pub fn real_ptr(&self) -> *mut c_void {
        self.real.load(Ordering::Acquire)
    }

    /// Records `p` as the real function unless one is already known. Callers never pass one
    /// of our own wrappers (it would make the hook call itself).
    pub fn adopt(&self, p: *mut c_void) {
        if p.is_null() {
            return;
        }
        let _ = self.real.compare_exchange(
            std::ptr::null_mut(),
            p,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

const MAX: i32 = i32::MAX;

macro_rules! hook_table {
    ($( $id:ident: $lib:ident $name:literal, $base:literal, $since:expr, $until:expr, $pt:expr; )*) => {
        /// Index of each hooked variant in [`HOOKS`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(usize)]
        #[allow(non_camel_case_types)]
        pub enum HookId { $($id),* }

        /// Every hooked variant.
        pub static HOOKS: [Hook; [$(stringify!($id)),*].len()] = [$(
            Hook {
                id: HookId::$id,
                name: $name,
                base: $base,
                since: $since,
                until: $until,
                per_thread: $pt,
                lib: Lib::$lib,
                real: AtomicPtr::new(std::ptr::null_mut()),
            }
        ),*];
    };
}

hook_table! {
    GetProcAddress: Cuda c"cuGetProcAddress", "cuGetProcAddress", 11030, 12000, false;
    GetProcAddress_v2: Cuda c"cuGetProcAddress_v2", "cuGetProcAddress", 12000, MAX, false;
    MemAlloc_v2: Cuda c"cuMemAlloc_v2", "cuMemAlloc", 3020, MAX, false;
    MemAllocPitch_v2: Cuda c"cuMemAllocPitch_v2", "cuMemAllocPitch", 3020, MAX, false;
    MemAllocManaged: Cuda c"cuMemAllocManaged", "cuMemAllocManaged", 6000, MAX, false;
    MemAllocAsync: Cuda c"cuMemAllocAsync", "cuMemAllocAsync", 11020, MAX, false;
    MemAllocAsync_ptsz: Cuda c"cuMemAllocAsync_ptsz", "cuMemAllocAsync", 11020, MAX, true;
    MemAllocFromPoolAsync: Cuda c"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", 11020, MAX, false;
    MemAllocFromPoolAsync_ptsz: Cuda c"cuMemAllocFromPoolAsync_ptsz", "cuMemAllocFromPoolAsync", 11020, MAX, true;
    MemCreate: Cuda c"cuMemCreate", "cuMemCreate", 10020, MAX, false;
    MemRelease: Cuda c"cuMemRelease", "cuMemRelease", 10020, MAX, false;
    MemMap: Cuda c"cuMemMap", "cuMemMap", 10020, MAX, false;
    MemUnmap: Cuda c"cuMemUnmap", "cuMemUnmap", 10020, MAX, false;
    MemAddressFree: Cuda c"cuMemAddressFree", "cuMemAddressFree", 10020, MAX, false;
    MemRetainAllocationHandle: Cuda c"cuMemRetainAllocationHandle", "cuMemRetainAllocationHandle", 11000, MAX, false;
    MemImportFromShareableHandle: Cuda c"cuMemImportFromShareableHandle", "cuMemImportFromShareableHandle", 10020, MAX, false;
    ArrayCreate_v2: Cuda c"cuArrayCreate_v2", "cuArrayCreate", 3020, MAX, false;
    Array3DCreate_v2: Cuda c"cuArray3DCreate_v2", "cuArray3DCreate", 3020, MAX, false;
    MipmappedArrayCreate: Cuda c"cuMipmappedArrayCreate", "cuMipmappedArrayCreate", 5000, MAX, false;
    MemFree_v2: Cuda c"cuMemFree_v2", "cuMemFree", 3020, MAX, false;
    MemFreeAsync: Cuda c"cuMemFreeAsync", "cuMemFreeAsync", 11020, MAX, false;
    MemFreeAsync_ptsz: Cuda c"cuMemFreeAsync_ptsz", "cuMemFreeAsync", 11020, MAX, true;
    ArrayDestroy: Cuda c"cuArrayDestroy", "cuArrayDestroy", 2000, MAX, false;
    MipmappedArrayDestroy: Cuda c"cuMipmappedArrayDestroy", "cuMipmappedArrayDestroy", 5000, MAX, false;
    MemGetInfo_v2: Cuda c"cuMemGetInfo_v2", "cuMemGetInfo", 3020, MAX, false;
    DeviceTotalMem_v2: Cuda c"cuDeviceTotalMem_v2", "cuDeviceTotalMem", 3020, MAX, false;
    LaunchKernel: Cuda c"cuLaunchKernel", "cuLaunchKernel", 4000, MAX, false;
    LaunchKernel_ptsz: Cuda c"cuLaunchKernel_ptsz", "cuLaunchKernel", 4000, MAX, true;
    LaunchKernelEx: Cuda c"cuLaunchKernelEx", "cuLaunchKernelEx", 11060, MAX, false;
    LaunchKernelEx_ptsz: Cuda c"cuLaunchKernelEx_ptsz", "cuLaunchKernelEx", 11060, MAX, true;
    LaunchCooperativeKernel: Cuda c"cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel", 9000, MAX, false;
    LaunchCooperativeKernel_ptsz: Cuda c"cuLaunchCooperativeKernel_ptsz", "cuLaunchCooperativeKernel", 9000, MAX, true;
    GraphLaunch: Cuda c"cuGraphLaunch", "cuGraphLaunch", 10000, MAX, false;
    GraphLaunch_ptsz: Cuda c"cuGraphLaunch_ptsz", "cuGraphLaunch", 10000, MAX, true;
    StreamDestroy_v2: Cuda c"cuStreamDestroy_v2", "cuStreamDestroy", 4000, MAX, false;
    StreamSynchronize: Cuda c"cuStreamSynchronize", "cuStreamSynchronize", 2000, MAX, false;
    StreamSynchronize_ptsz: Cuda c"cuStreamSynchronize_ptsz", "cuStreamSynchronize", 7000, MAX, true;
    CtxSynchronize: Cuda c"cuCtxSynchronize", "cuCtxSynchronize", 2000, 13000, false;
    CtxSynchronize_v2: Cuda c"cuCtxSynchronize_v2", "cuCtxSynchronize", 13000, MAX, false;
    EventSynchronize: Cuda c"cuEventSynchronize", "cuEventSynchronize", 2000, MAX, false;
    DevicePrimaryCtxRetain: Cuda c"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", 7000, MAX, false;
    DevicePrimaryCtxRelease: Cuda c"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease", 7000, 11000, false;
    DevicePrimaryCtxRelease_v2: Cuda c"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease", 11000, MAX, false;
    DevicePrimaryCtxReset: Cuda c"cuDevicePrimaryCtxReset", "cuDevicePrimaryCtxReset", 7000, 11000, false;
    DevicePrimaryCtxReset_v2: Cuda c"cuDevicePrimaryCtxReset_v2", "cuDevicePrimaryCtxReset", 11000, MAX, false;
    CtxCreate_v2: Cuda c"cuCtxCreate_v2", "cuCtxCreate", 3020, 11040, false;
    CtxCreate_v3: Cuda c"cuCtxCreate_v3", "cuCtxCreate", 11040, 12050, false;
    CtxCreate_v4: Cuda c"cuCtxCreate_v4", "cuCtxCreate", 12050, MAX, false;
    CtxDestroy_v2: Cuda c"cuCtxDestroy_v2", "cuCtxDestroy", 4000, MAX, false;
    GreenCtxCreate: Cuda c"cuGreenCtxCreate", "cuGreenCtxCreate", 12040, MAX, false;
    GreenCtxDestroy: Cuda c"cuGreenCtxDestroy", "cuGreenCtxDestroy", 12040, MAX, false;
    NvmlMemoryInfo: Nvml c"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo", 0, MAX, false;
    NvmlMemoryInfo_v2: Nvml c"nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo_v2", 0, MAX, false;
}

impl HookId {
    /// The row of this id.
    #[inline]
    pub fn hook(self) -> &'static Hook {
        &HOOKS[self as usize]
    }
}

/// The hook exported under exactly `name`, if any.
pub fn by_name(name: &[u8]) -> Option<&'static Hook> {
    // Cheap reject first: every hooked name starts with "cu" or "nvml".
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        return None;
    }
    HOOKS.iter().find(|h| h.name.to_bytes() == name)
}

/// The variant `cuGetProcAddress(base, .., version, flags)` resolves to, if it is hooked.
pub fn by_base(base: &[u8], version: i32, flags: u64) -> Option<&'static Hook> {
    let per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let mut legacy = None;
    for h in HOOKS
        .iter()
        .filter(|h| h.lib == Lib::Cuda && h.base.as_bytes() == base)
    {
        if version < h.since || version >= h.until {
            continue;
        }
        if h.per_thread == per_thread {
            return Some(h);
        }
        if !h.per_thread {
            legacy = Some(h);
        }
    }
    // Functions without a `_ptsz` twin resolve to the plain variant under flag 2 too.
    legacy
}

/// The hook whose real function is `p` (catches aliases and names we do not map by version).
pub fn by_real(p: *mut c_void) -> Option<&'static Hook> {
    if p.is_null() {
        return None;
    }
    HOOKS.iter().find(|h| h.real_ptr() == p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_consistent() {
        for (i, a) in HOOKS.iter().enumerate() {
            for b in &HOOKS[i + 1..] {
                assert_ne!(a.name, b.name);
            }
            let name = a.name.to_str().unwrap();
            assert!(
                name.starts_with(a.base),
                "{name} does not extend {}",
                a.base
            );
            assert_eq!(a.per_thread, name.ends_with("_ptsz"), "{name}");
            assert!(a.since < a.until);
            assert!(std::ptr::eq(a.id.hook(), a), "{name} is not at its index");
        }
        assert_eq!(HookId::MemAlloc_v2.hook().name, c"cuMemAlloc_v2");
        assert_eq!(
            HookId::NvmlMemoryInfo_v2.hook().name,
            c"nvmlDeviceGetMemoryInfo_v2"
        );
    }

    #[test]
    fn exact_names_resolve() {
        assert_eq!(by_name(b"cuMemAlloc_v2").unwrap().name, c"cuMemAlloc_v2");
        assert_eq!(
            by_name(b"cuLaunchKernel_ptsz").unwrap().name,
            c"cuLaunchKernel_ptsz"
        );
        assert_eq!(
            by_name(b"nvmlDeviceGetMemoryInfo").unwrap().name,
            c"nvmlDeviceGetMemoryInfo"
        );
        assert!(
            by_name(b"cuMemAlloc").is_none(),
            "the 32-bit v1 entry point is not this hook"
        );
        assert_eq!(by_name(b"cuCtxCreate_v2").unwrap().name, c"cuCtxCreate_v2");
        assert!(
            by_name(b"cuCtxCreate").is_none(),
            "the v1 entry point is not hooked"
        );
        assert!(by_name(b"malloc").is_none());
        assert!(by_name(b"").is_none());
    }

    #[test]
    fn versions_select_variants() {
        let name = |b: &[u8], v, f| by_base(b, v, f).map(|h| h.name.to_str().unwrap());
        assert_eq!(name(b"cuMemAlloc", 13000, 0), Some("cuMemAlloc_v2"));
        assert_eq!(name(b"cuMemAlloc", 3020, 0), Some("cuMemAlloc_v2"));
        assert_eq!(name(b"cuMemAlloc", 2000, 0), None, "v1 is not hooked");
        // Flag 2 = per-thread default stream.
        assert_eq!(
            name(b"cuMemAllocAsync", 12000, 2),
            Some("cuMemAllocAsync_ptsz")
        );
        assert_eq!(name(b"cuMemAllocAsync", 12000, 1), Some("cuMemAllocAsync"));
        assert_eq!(name(b"cuMemAllocAsync", 12000, 0), Some("cuMemAllocAsync"));
        assert_eq!(
            name(b"cuLaunchKernel", 12000, 2),
            Some("cuLaunchKernel_ptsz")
        );
        assert_eq!(name(b"cuGraphLaunch", 10000, 2), Some("cuGraphLaunch_ptsz"));
        // No _ptsz twin: flag 2 still gets the plain variant.
        assert_eq!(name(b"cuMemAlloc", 12000, 2), Some("cuMemAlloc_v2"));
        assert_eq!(name(b"cuMemCreate", 10020, 2), Some("cuMemCreate"));
        // VMM: every call that changes how long a handle's memory lives.
        assert_eq!(name(b"cuMemMap", 12000, 0), Some("cuMemMap"));
        assert_eq!(name(b"cuMemUnmap", 13000, 2), Some("cuMemUnmap"));
        assert_eq!(
            name(b"cuMemAddressFree", 12000, 0),
            Some("cuMemAddressFree")
        );
        assert_eq!(
            name(b"cuMemRetainAllocationHandle", 11000, 0),
            Some("cuMemRetainAllocationHandle")
        );
        assert_eq!(
            name(b"cuMemRetainAllocationHandle", 10020, 0),
            None,
            "before the API existed"
        );
        assert_eq!(
            name(b"cuMemImportFromShareableHandle", 12000, 0),
            Some("cuMemImportFromShareableHandle")
        );
        // cuGetProcAddress itself changed signature at 12000.
        assert_eq!(
            name(b"cuGetProcAddress", 11080, 0),
            Some("cuGetProcAddress")
        );
        assert_eq!(
            name(b"cuGetProcAddress", 12000, 0),
            Some("cuGetProcAddress_v2")
        );
        assert_eq!(
            name(b"cuGetProcAddress", 13000, 2),
            Some("cuGetProcAddress_v2")
        );
        assert_eq!(
            name(b"cuMemAllocAsync", 11000, 0),
            None,
            "before the API existed"
        );
        // Synchronisation: the launch gate hears of drains through every variant.
        assert_eq!(
            name(b"cuStreamSynchronize", 12000, 0),
            Some("cuStreamSynchronize")
        );
        assert_eq!(
            name(b"cuStreamSynchronize", 12000, 2),
            Some("cuStreamSynchronize_ptsz")
        );
        assert_eq!(
            name(b"cuCtxSynchronize", 12080, 0),
            Some("cuCtxSynchronize")
        );
        assert_eq!(
            name(b"cuCtxSynchronize", 13000, 0),
            Some("cuCtxSynchronize_v2")
        );
        assert_eq!(
            name(b"cuEventSynchronize", 13000, 2),
            Some("cuEventSynchronize")
        );
        // Contexts: every call that makes or ends one.
        assert_eq!(
            name(b"cuDevicePrimaryCtxRetain", 12000, 2),
            Some("cuDevicePrimaryCtxRetain")
        );
        assert_eq!(
            name(b"cuDevicePrimaryCtxRelease", 10000, 0),
            Some("cuDevicePrimaryCtxRelease")
        );
        assert_eq!(
            name(b"cuDevicePrimaryCtxRelease", 11000, 0),
            Some("cuDevicePrimaryCtxRelease_v2")
        );
        assert_eq!(
            name(b"cuDevicePrimaryCtxReset", 13000, 0),
            Some("cuDevicePrimaryCtxReset_v2")
        );
        assert_eq!(name(b"cuCtxCreate", 11000, 0), Some("cuCtxCreate_v2"));
        assert_eq!(name(b"cuCtxCreate", 12000, 0), Some("cuCtxCreate_v3"));
        assert_eq!(name(b"cuCtxCreate", 13000, 2), Some("cuCtxCreate_v4"));
        assert_eq!(name(b"cuCtxDestroy", 12000, 0), Some("cuCtxDestroy_v2"));
        // NVML is never resolved through cuGetProcAddress.
        assert_eq!(name(b"nvmlDeviceGetMemoryInfo", 13000, 0), None);
    }
}
