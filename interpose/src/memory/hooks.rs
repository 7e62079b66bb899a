//! The memory family's `extern "C"` shims: allocations, frees, VMM handles and mappings, CUDA
//! arrays, and the memory queries the tenant sees virtualised (`cuMemGetInfo_v2`,
//! `cuDeviceTotalMem_v2`, NVML's memory info). Each decodes its C arguments, runs in the
//! [`crate::shim`] frame, and hands over to the safe logic in [`super`].

#![allow(non_snake_case)]
#![allow(
    unsafe_code,
    reason = "the C boundary: raw pointers in, the real function called through its slot"
)]

use std::ffi::{c_int, c_uint, c_void};

use crate::driver;
use crate::ffi::*;
use crate::ledger::{ImportKey, Kind};
use crate::memory;
use crate::shim::{Outcome, Pass, cuda, on, run, written};
use crate::state::{self, Process};
use crate::table::HookId;

/// The state whose ledger counts VMM handle `handle` (a handle is mapped, retained and
/// released from any device's context, and stays counted on the device that holds it), else
/// `p`.
fn by_handle(p: &'static Process, handle: u64) -> &'static Process {
    state::holder(p, |l| {
        l.handle(handle).is_some() || l.imported_handle(handle).is_some()
    })
}

/// The state whose ledger has mappings in `[va, va + size)`, else `p`.
fn by_range(p: &'static Process, va: u64, size: usize) -> &'static Process {
    state::holder(p, |l| l.has_mappings_in(va, size as u64))
}
// ---- allocation ---------------------------------------------------------------------------

/// `cuMemAlloc_v2`: counted.
///
/// # Safety
/// C contract of `cuMemAlloc_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments are forwarded unchanged.
    unsafe {
        cuda::<cuMemAlloc_v2_t>(
            HookId::MemAlloc_v2,
            |real| real(dptr, bytesize),
            |real, p| {
                if dptr.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                memory::allocate(p, Kind::Ptr, bytesize as u64, || {
                    let r = real(dptr, bytesize);
                    (r, written(r, dptr))
                })
            },
        )
    }
}

/// `cuMemAllocManaged`: counted against the device.
///
/// # Safety
/// C contract of `cuMemAllocManaged`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    // SAFETY: as for cuMemAlloc_v2.
    unsafe {
        cuda::<cuMemAllocManaged_t>(
            HookId::MemAllocManaged,
            |real| real(dptr, bytesize, flags),
            |real, p| {
                if dptr.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                memory::allocate(p, Kind::Ptr, bytesize as u64, || {
                    let r = real(dptr, bytesize, flags);
                    (r, written(r, dptr))
                })
            },
        )
    }
}

/// `cuMemAllocPitch_v2`: an estimate is reserved, then corrected to `pitch * height`.
///
/// # Safety
/// C contract of `cuMemAllocPitch_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: c_uint,
) -> CUresult {
    // SAFETY: as for cuMemAlloc_v2; the undo frees what the driver just returned.
    unsafe {
        cuda::<cuMemAllocPitch_v2_t>(
            HookId::MemAllocPitch_v2,
            |real| real(dptr, pitch, width, height, elem),
            |real, p| {
                if dptr.is_null() || pitch.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                memory::allocate_pitch(
                    p,
                    width as u64,
                    height as u64,
                    || {
                        let r = real(dptr, pitch, width, height, elem);
                        (r, written(r, dptr), written(r, pitch) as u64)
                    },
                    |ptr| {
                        if let Some(free) = driver::real::<cuMemFree_v2_t>(HookId::MemFree_v2) {
                            let _ = free(ptr);
                        }
                    },
                )
            },
        )
    }
}

macro_rules! alloc_async {
    ($name:ident, $id:ident) => {
        /// `cuMemAllocAsync` (or its `_ptsz` twin): counted when enqueued.
        ///
        /// # Safety
        /// C contract of `cuMemAllocAsync`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CUdeviceptr,
            bytesize: usize,
            stream: CUstream,
        ) -> CUresult {
            // SAFETY: as for cuMemAlloc_v2.
            unsafe {
                cuda::<cuMemAllocAsync_t>(
                    HookId::$id,
                    |real| real(dptr, bytesize, stream),
                    |real, p| {
                        if dptr.is_null() {
                            return Outcome::PassThrough(Pass::NullArgument);
                        }
                        memory::allocate(p, Kind::Ptr, bytesize as u64, || {
                            let r = real(dptr, bytesize, stream);
                            (r, written(r, dptr))
                        })
                    },
                )
            }
        }
    };
}
alloc_async!(cuMemAllocAsync, MemAllocAsync);
alloc_async!(cuMemAllocAsync_ptsz, MemAllocAsync_ptsz);

macro_rules! alloc_pool {
    ($name:ident, $id:ident) => {
        /// `cuMemAllocFromPoolAsync` (or its `_ptsz` twin): counted when enqueued.
        ///
        /// # Safety
        /// C contract of `cuMemAllocFromPoolAsync`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CUdeviceptr,
            bytesize: usize,
            pool: CUmemoryPool,
            stream: CUstream,
        ) -> CUresult {
            // SAFETY: as for cuMemAlloc_v2.
            unsafe {
                cuda::<cuMemAllocFromPoolAsync_t>(
                    HookId::$id,
                    |real| real(dptr, bytesize, pool, stream),
                    |real, p| {
                        if dptr.is_null() {
                            return Outcome::PassThrough(Pass::NullArgument);
                        }
                        memory::allocate(p, Kind::Ptr, bytesize as u64, || {
                            let r = real(dptr, bytesize, pool, stream);
                            (r, written(r, dptr))
                        })
                    },
                )
            }
        }
    };
}
alloc_pool!(cuMemAllocFromPoolAsync, MemAllocFromPoolAsync);
alloc_pool!(cuMemAllocFromPoolAsync_ptsz, MemAllocFromPoolAsync_ptsz);

/// `cuMemCreate`: counted unless the memory is placed on the host.
///
/// # Safety
/// C contract of `cuMemCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    // SAFETY: as for cuMemAlloc_v2; `prop` is read only when non-null.
    unsafe {
        cuda::<cuMemCreate_t>(
            HookId::MemCreate,
            |real| real(handle, size, prop, flags),
            |real, p| {
                if handle.is_null() || prop.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                let location = (*prop).location.kind;
                if matches!(
                    location,
                    CU_MEM_LOCATION_TYPE_HOST
                        | CU_MEM_LOCATION_TYPE_HOST_NUMA
                        | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT
                ) {
                    return Outcome::PassThrough(Pass::HostMemory);
                }
                // Counted on the device that holds the memory, whichever is current.
                let p = if location == CU_MEM_LOCATION_TYPE_DEVICE {
                    on((*prop).location.id, p)
                } else {
                    p
                };
                memory::vmm_create(p, size as u64, || {
                    let r = real(handle, size, prop, flags);
                    (r, written(r, handle))
                })
            },
        )
    }
}

/// `cuArrayCreate_v2`: counted from the descriptor.
///
/// # Safety
/// C contract of `cuArrayCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    array: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    // SAFETY: as for cuMemAlloc_v2; `desc` is read only when non-null.
    unsafe {
        cuda::<cuArrayCreate_v2_t>(
            HookId::ArrayCreate_v2,
            |real| real(array, desc),
            |real, p| {
                if array.is_null() || desc.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                let d = *desc;
                let bytes = memory::array_bytes(
                    d.width as u64,
                    d.height as u64,
                    0,
                    d.format,
                    d.num_channels,
                );
                memory::allocate(p, Kind::Array, bytes, || {
                    let r = real(array, desc);
                    (r, written(r, array) as u64)
                })
            },
        )
    }
}

/// `cuArray3DCreate_v2`: counted from the descriptor.
///
/// # Safety
/// C contract of `cuArray3DCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    array: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    // SAFETY: as for cuArrayCreate_v2.
    unsafe {
        cuda::<cuArray3DCreate_v2_t>(
            HookId::Array3DCreate_v2,
            |real| real(array, desc),
            |real, p| {
                if array.is_null() || desc.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                let d = *desc;
                let bytes = memory::array_bytes(
                    d.width as u64,
                    d.height as u64,
                    d.depth as u64,
                    d.format,
                    d.num_channels,
                );
                memory::allocate(p, Kind::Array, bytes, || {
                    let r = real(array, desc);
                    (r, written(r, array) as u64)
                })
            },
        )
    }
}

/// `cuMipmappedArrayCreate`: counted over all levels.
///
/// # Safety
/// C contract of `cuMipmappedArrayCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    array: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: c_uint,
) -> CUresult {
    // SAFETY: as for cuArrayCreate_v2.
    unsafe {
        cuda::<cuMipmappedArrayCreate_t>(
            HookId::MipmappedArrayCreate,
            |real| real(array, desc, levels),
            |real, p| {
                if array.is_null() || desc.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                let d = *desc;
                let bytes = memory::mipmap_bytes(
                    d.width as u64,
                    d.height as u64,
                    d.depth as u64,
                    d.format,
                    d.num_channels,
                    d.flags,
                    levels,
                );
                memory::allocate(p, Kind::Mipmap, bytes, || {
                    let r = real(array, desc, levels);
                    (r, written(r, array) as u64)
                })
            },
        )
    }
}

// ---- frees ------------------------------------------------------------------------------

/// `cuMemFree_v2`: releases what was counted.
///
/// # Safety
/// C contract of `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments are forwarded unchanged.
    unsafe {
        cuda::<cuMemFree_v2_t>(
            HookId::MemFree_v2,
            |real| real(dptr),
            |real, p| memory::free(p, Kind::Ptr, dptr, || real(dptr)),
        )
    }
}

macro_rules! free_async {
    ($name:ident, $id:ident) => {
        /// `cuMemFreeAsync` (or its `_ptsz` twin): released once the free is enqueued.
        ///
        /// # Safety
        /// C contract of `cuMemFreeAsync`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
            // SAFETY: as for cuMemFree_v2.
            unsafe {
                cuda::<cuMemFreeAsync_t>(
                    HookId::$id,
                    |real| real(dptr, stream),
                    |real, p| memory::free(p, Kind::Ptr, dptr, || real(dptr, stream)),
                )
            }
        }
    };
}
free_async!(cuMemFreeAsync, MemFreeAsync);
free_async!(cuMemFreeAsync_ptsz, MemFreeAsync_ptsz);

/// `cuMemRelease`: one reference of a counted `cuMemCreate` handle goes; its bytes are
/// released with the last reference once no mapping of it is left.
///
/// # Safety
/// C contract of `cuMemRelease`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    // SAFETY: as for cuMemFree_v2.
    unsafe {
        cuda::<cuMemRelease_t>(
            HookId::MemRelease,
            |real| real(handle),
            |real, p| memory::vmm_release(by_handle(p, handle), handle, || real(handle)),
        )
    }
}

/// `cuMemMap`: a mapping keeps its handle's memory counted until it is unmapped.
///
/// # Safety
/// C contract of `cuMemMap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments are forwarded unchanged.
    unsafe {
        cuda::<cuMemMap_t>(
            HookId::MemMap,
            |real| real(ptr, size, offset, handle, flags),
            |real, p| {
                memory::vmm_map(by_handle(p, handle), ptr, size as u64, handle, || {
                    real(ptr, size, offset, handle, flags)
                })
            },
        )
    }
}

/// `cuMemUnmap`: the mappings in the range go; released handles left unmapped are released.
///
/// # Safety
/// C contract of `cuMemUnmap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments are forwarded unchanged.
    unsafe {
        cuda::<cuMemUnmap_t>(
            HookId::MemUnmap,
            |real| real(ptr, size),
            |real, p| {
                memory::vmm_unmap(by_range(p, ptr, size), ptr, size as u64, || real(ptr, size))
            },
        )
    }
}

/// `cuMemAddressFree`: whatever is still mapped in the range is unmapped with it.
///
/// # Safety
/// C contract of `cuMemAddressFree`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments are forwarded unchanged.
    unsafe {
        cuda::<cuMemAddressFree_t>(
            HookId::MemAddressFree,
            |real| real(ptr, size),
            |real, p| {
                memory::vmm_unmap(by_range(p, ptr, size), ptr, size as u64, || real(ptr, size))
            },
        )
    }
}

/// `cuMemRetainAllocationHandle`: a counted handle gains a reference (its own `cuMemRelease`).
///
/// # Safety
/// C contract of `cuMemRetainAllocationHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CUresult {
    // SAFETY: the type is this entry point's signature; `handle` is read only after the driver
    // succeeded, and only when non-null.
    unsafe {
        cuda::<cuMemRetainAllocationHandle_t>(
            HookId::MemRetainAllocationHandle,
            |real| real(handle, addr),
            |real, p| {
                if handle.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                memory::vmm_retain(by_range(p, addr as u64, 1), addr as u64, || {
                    let r = real(handle, addr);
                    (r, written(r, handle))
                })
            },
        )
    }
}

/// `cuMemImportFromShareableHandle`: the handle is booked as imported memory, charged to this
/// process from the import (from its first mapping when its size is unknown) to its last
/// release and unmap here (an import answered with this process's own counted handle is one
/// more reference of it). The memory is known by the shareable descriptor's file identity
/// when it has one (see [`import_key`]).
///
/// # Safety
/// C contract of `cuMemImportFromShareableHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    kind: c_int,
) -> CUresult {
    // SAFETY: as for cuMemRetainAllocationHandle.
    unsafe {
        cuda::<cuMemImportFromShareableHandle_t>(
            HookId::MemImportFromShareableHandle,
            |real| real(handle, os_handle, kind),
            |real, p| {
                if handle.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                memory::vmm_import(p, import_key(os_handle, kind), || {
                    let r = real(handle, os_handle, kind);
                    (r, written(r, handle))
                })
            },
        )
    }
}

/// What identifies the memory behind a shareable handle, and its size: a POSIX descriptor
/// that is a sized file (a memfd, say) names the same object in every process, so two imports
/// of it are one memory of `st_size` bytes. `None` for anything else (other handle types, a
/// descriptor that tells no size): the imported handle alone, charged what is mapped of it.
fn import_key(os_handle: *mut c_void, kind: c_int) -> Option<(ImportKey, u64)> {
    if kind == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        && let Ok(fd) = c_int::try_from(os_handle as usize)
    {
        // SAFETY: fstat writes into a zeroed local stat buffer; a bad descriptor only fails.
        let st = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            (libc::fstat(fd, &mut st) == 0).then_some(st)
        };
        if let Some(st) = st.filter(|st| st.st_size > 0) {
            let key = ImportKey::File {
                dev: st.st_dev,
                ino: st.st_ino,
            };
            return Some((key, st.st_size as u64));
        }
    }
    None
}

/// `cuArrayDestroy`.
///
/// # Safety
/// C contract of `cuArrayDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(array: CUarray) -> CUresult {
    // SAFETY: as for cuMemFree_v2.
    unsafe {
        cuda::<cuArrayDestroy_t>(
            HookId::ArrayDestroy,
            |real| real(array),
            |real, p| memory::free(p, Kind::Array, array as u64, || real(array)),
        )
    }
}

/// `cuMipmappedArrayDestroy`.
///
/// # Safety
/// C contract of `cuMipmappedArrayDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(array: CUmipmappedArray) -> CUresult {
    // SAFETY: as for cuMemFree_v2.
    unsafe {
        cuda::<cuMipmappedArrayDestroy_t>(
            HookId::MipmappedArrayDestroy,
            |real| real(array),
            |real, p| memory::free(p, Kind::Mipmap, array as u64, || real(array)),
        )
    }
}
// ---- virtualised queries ------------------------------------------------------------------

/// `cuMemGetInfo_v2`: total = the allocation's limit, free = what is left of it.
///
/// # Safety
/// C contract of `cuMemGetInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    // SAFETY: the driver validates the context and writes the out-parameters first; we only
    // overwrite the non-null ones after it succeeded.
    unsafe {
        cuda::<cuMemGetInfo_v2_t>(
            HookId::MemGetInfo_v2,
            |real| real(free, total),
            |real, p| {
                if free.is_null() || total.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                let (mut f, mut t) = (0usize, 0usize);
                let r = real(&mut f, &mut t);
                if r != CUDA_SUCCESS {
                    return Outcome::Handled(r);
                }
                let Some((vf, vt)) = memory::virtual_mem_info(p, f as u64) else {
                    return Outcome::Handled(CUDA_ERROR_OPERATING_SYSTEM);
                };
                *free = vf as usize;
                *total = vt as usize;
                Outcome::Handled(CUDA_SUCCESS)
            },
        )
    }
}

/// `cuDeviceTotalMem_v2`: the allocation's limit.
///
/// # Safety
/// C contract of `cuDeviceTotalMem_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    // SAFETY: as for cuMemGetInfo_v2.
    unsafe {
        cuda::<cuDeviceTotalMem_v2_t>(
            HookId::DeviceTotalMem_v2,
            |real| real(bytes, dev),
            |real, p| {
                if bytes.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                let r = real(bytes, dev);
                if r != CUDA_SUCCESS {
                    return Outcome::Handled(r);
                }
                let session = &on(dev, p).session;
                match session.limit() {
                    Some(limit) => {
                        *bytes = limit as usize;
                        Outcome::Handled(CUDA_SUCCESS)
                    }
                    // A card this process may hold nothing on (not its allocation's, or a token
                    // the arbiter refused): 0 bytes, so a program listing every device it sees
                    // goes on; anything it asks for there is refused.
                    None if session.refused() => {
                        *bytes = 0;
                        Outcome::Handled(CUDA_SUCCESS)
                    }
                    None => Outcome::Handled(CUDA_ERROR_OPERATING_SYSTEM),
                }
            },
        )
    }
}

/// `nvmlDeviceGetMemoryInfo`: total = limit, used = the allocation's use.
///
/// # Safety
/// C contract of `nvmlDeviceGetMemoryInfo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    // SAFETY: the type is this entry point's signature; `memory` is written by the real call
    // and then overwritten only on success.
    unsafe {
        run::<nvmlDeviceGetMemoryInfo_t>(
            HookId::NvmlMemoryInfo,
            NVML_ERROR_UNINITIALIZED,
            NVML_ERROR_UNKNOWN,
            |real| real(device, memory),
            |real, p| {
                if memory.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                let r = real(device, memory);
                if r != NVML_SUCCESS {
                    return Outcome::Handled(r);
                }
                // SAFETY: `device` is the caller's own NVML handle, passed on unchanged.
                let p = state::process_for_nvml(p, device);
                let Some((free, total)) = memory::virtual_mem_info(p, (*memory).free) else {
                    return Outcome::Handled(NVML_ERROR_UNKNOWN);
                };
                (*memory).total = total;
                (*memory).free = free;
                (*memory).used = total - free;
                Outcome::Handled(NVML_SUCCESS)
            },
        )
    }
}

/// `nvmlDeviceGetMemoryInfo_v2`: as v1; `reserved` is reported as 0.
///
/// # Safety
/// C contract of `nvmlDeviceGetMemoryInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    // SAFETY: as for nvmlDeviceGetMemoryInfo.
    unsafe {
        run::<nvmlDeviceGetMemoryInfo_v2_t>(
            HookId::NvmlMemoryInfo_v2,
            NVML_ERROR_UNINITIALIZED,
            NVML_ERROR_UNKNOWN,
            |real| real(device, memory),
            |real, p| {
                if memory.is_null() {
                    return Outcome::PassThrough(Pass::NullArgument);
                }
                let r = real(device, memory);
                if r != NVML_SUCCESS {
                    return Outcome::Handled(r);
                }
                // SAFETY: `device` is the caller's own NVML handle, passed on unchanged.
                let p = state::process_for_nvml(p, device);
                let Some((free, total)) = memory::virtual_mem_info(p, (*memory).free) else {
                    return Outcome::Handled(NVML_ERROR_UNKNOWN);
                };
                (*memory).total = total;
                (*memory).free = free;
                (*memory).reserved = 0;
                (*memory).used = total - free;
                Outcome::Handled(NVML_SUCCESS)
            },
        )
    }
}
