//! Device memory: the table of address ranges, allocations, pools and pointer attributes.
//!
//! Every device allocation is an anonymous `MAP_NORESERVE` mapping whose address is the device
//! pointer, so an 80 GiB card costs no host RAM until bytes are touched. Sizes are accounted in
//! the shared ledger (so other processes see them) before the mapping is made. VMM mappings
//! ([`crate::vmm`]) live in the same table so copies and attributes see them.

use parking_lot::{Mutex, MutexGuard};
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::{Arc, Once, OnceLock};

use crate::context::{self, current};
use crate::ffi::*;
use crate::queue::Op;
use crate::runtime::{Registry, Res, gpu, guard, next_handle, ordinal, physical_gpu, put, rt};
use crate::stream::resolve;

/// What kind of memory a range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Device,
    Managed,
    Host,
    /// From a memory pool (stream-ordered).
    Pool(usize),
    /// A VMM mapping of the physical allocation with this id (accounted by that handle).
    VmmMap(usize),
}

/// One known address range.
#[derive(Debug, Clone)]
pub struct Alloc {
    pub len: usize,
    /// Bytes charged to the ledger (0 for host memory and VMM mappings).
    pub charged: u64,
    pub device: u32,
    pub kind: Kind,
    pub ctx: usize,
    /// `PROT_*` bits the range may be accessed with (VMM mappings start with none).
    pub access: i32,
}

/// Access of ordinary allocations.
pub const RW: i32 = libc::PROT_READ | libc::PROT_WRITE;

pub(crate) fn allocs() -> MutexGuard<'static, BTreeMap<usize, Alloc>> {
    static A: OnceLock<Mutex<BTreeMap<usize, Alloc>>> = OnceLock::new();
    A.get_or_init(|| Mutex::new(BTreeMap::new())).lock()
}

fn page_round(n: usize) -> usize {
    n.div_ceil(4096).max(1) * 4096
}

fn map_anon(len: usize, noreserve: bool) -> Result<usize, CUresult> {
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if noreserve {
        flags |= libc::MAP_NORESERVE;
    }
    // SAFETY: a fresh anonymous mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page_round(len),
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    } else {
        Ok(p as usize)
    }
}

fn unmap(base: usize, len: usize) {
    // SAFETY: (base, len) is a mapping this module made and just removed from the table.
    unsafe { libc::munmap(base as *mut c_void, page_round(len)) };
}

/// Charges `bytes` on `device` and maps them; returns the device pointer.
pub fn alloc_device(device: u32, ctx: usize, bytes: usize, kind: Kind) -> Result<usize, CUresult> {
    if bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    static CLEANUP: Once = Once::new();
    context::on_destroy(&CLEANUP, free_all_of_ctx);
    let rt = rt()?;
    rt.ledger
        .try_alloc(device, bytes as u64)
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    let p = match map_anon(bytes, true) {
        Ok(p) => p,
        Err(e) => {
            rt.ledger.free(device, bytes as u64);
            return Err(e);
        }
    };
    allocs().insert(
        p,
        Alloc {
            len: bytes,
            charged: bytes as u64,
            device,
            kind,
            ctx,
            access: RW,
        },
    );
    Ok(p)
}

/// Frees a device allocation by its base pointer.
pub fn free_device(ptr: usize) -> Res {
    let a = {
        let mut t = allocs();
        match t.get(&ptr) {
            Some(a) if !matches!(a.kind, Kind::Host | Kind::VmmMap(_)) => t.remove(&ptr),
            _ => None,
        }
    }
    .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    unmap(ptr, a.len);
    rt()?.ledger.free(a.device, a.charged);
    Ok(())
}

/// Frees every device allocation of a context being destroyed.
pub fn free_all_of_ctx(ctx: usize) {
    let doomed: Vec<usize> = allocs()
        .iter()
        .filter(|(_, a)| a.ctx == ctx && !matches!(a.kind, Kind::Host | Kind::VmmMap(_)))
        .map(|(p, _)| *p)
        .collect();
    for p in doomed {
        let _ = free_device(p);
    }
}

/// The allocation containing `ptr`, with its base.
pub fn find(ptr: usize) -> Option<(usize, Alloc)> {
    let t = allocs();
    let (base, a) = t.range(..=ptr).next_back()?;
    (ptr < base + a.len.max(1)).then(|| (*base, a.clone()))
}

/// Checks that [ptr, ptr+len) is device memory the caller may access (`write`: to store into):
/// inside one allocation, or across VMM mappings laid end to end, each with the access needed.
/// Checking here matters: an unmapped or `PROT_NONE` range would fault the host process.
pub(crate) fn check_device(ptr: u64, len: usize, write: bool) -> Res {
    let p = ptr as usize;
    let end = p.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let need = if write {
        libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    let t = allocs();
    let (mut base, mut a) = t
        .range(..=p)
        .next_back()
        .filter(|(b, a)| p < **b + a.len.max(1))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    loop {
        if a.access & need == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let a_end = *base + a.len;
        if end <= a_end {
            return Ok(());
        }
        // Only VMM mappings may continue into the next range (they are made to be contiguous).
        match t.get_key_value(&a_end) {
            Some((b, n))
                if matches!(a.kind, Kind::VmmMap(_)) && matches!(n.kind, Kind::VmmMap(_)) =>
            {
                (base, a) = (b, n);
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
}

/// For unified copies: a pointer inside a known range must fit in it; others count as host.
pub(crate) fn check_any(ptr: u64, len: usize, write: bool) -> Res {
    if ptr == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match find(ptr as usize) {
        Some(_) => check_device(ptr, len, write),
        None => Ok(()),
    }
}

/// Copies `n` bytes between ranges the caller has checked.
pub(crate) fn copy(dst: u64, src: u64, n: usize) {
    if n > 0 {
        // SAFETY: both ranges were checked against known allocations, or are host memory the
        // caller vouches for, as with the real driver; `copy` tolerates overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
    }
}

// ---- allocation entry points ----

/// `cuMemAlloc_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    guard(|| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let c = current()?;
        let p = alloc_device(c.device, c.id, bytes, Kind::Device)?;
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(dptr, p as u64) }
    })
}

/// `cuMemAllocManaged` (charged as device memory).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    flags: u32,
) -> CUresult {
    guard(|| {
        if dptr.is_null() || !(flags == 1 || flags == 2) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let c = current()?;
        let p = alloc_device(c.device, c.id, bytes, Kind::Managed)?;
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(dptr, p as u64) }
    })
}

/// `cuMemAllocPitch_v2`: rows padded to 512 bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: u32,
) -> CUresult {
    guard(|| {
        if dptr.is_null()
            || pitch.is_null()
            || width == 0
            || height == 0
            || ![4, 8, 16].contains(&elem)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let c = current()?;
        let p_bytes = width.div_ceil(512) * 512;
        let total = p_bytes
            .checked_mul(height)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let p = alloc_device(c.device, c.id, total, Kind::Device)?;
        // SAFETY: non-null out-pointers from the caller.
        unsafe {
            put(dptr, p as u64)?;
            put(pitch, p_bytes)
        }
    })
}

/// `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    guard(|| {
        rt()?;
        if dptr == 0 {
            return Ok(());
        }
        free_device(dptr as usize)
    })
}

/// `cuMemGetInfo_v2`: free and total of the current device, all processes counted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard(|| {
        if free.is_null() || total.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let c = current()?;
        let rt = rt()?;
        let t = physical_gpu(c.device)?.total_bytes;
        let used = rt
            .memory_used(c.device)
            .map_err(|_| CUDA_ERROR_OPERATING_SYSTEM)?;
        // SAFETY: non-null out-pointers from the caller.
        unsafe {
            put(free, t.saturating_sub(used) as usize)?;
            put(total, t as usize)
        }
    })
}

fn host_alloc(pp: *mut *mut c_void, bytes: usize) -> Res {
    if pp.is_null() || bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let c = current()?;
    let p = map_anon(bytes, false)?;
    allocs().insert(
        p,
        Alloc {
            len: bytes,
            charged: 0,
            device: c.device,
            kind: Kind::Host,
            ctx: c.id,
            access: RW,
        },
    );
    // SAFETY: non-null out-pointer from the caller.
    unsafe { put(pp, p as *mut c_void) }
}

/// `cuMemAllocHost_v2`: page-locked host memory (host RAM, not device memory).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    guard(|| host_alloc(pp, bytes))
}

/// `cuMemHostAlloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytes: usize,
    _flags: u32,
) -> CUresult {
    guard(|| host_alloc(pp, bytes))
}

/// `cuMemFreeHost`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    guard(|| {
        rt()?;
        let a = {
            let mut t = allocs();
            match t.get(&(p as usize)) {
                Some(a) if a.kind == Kind::Host => t.remove(&(p as usize)),
                _ => None,
            }
        }
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        unmap(p as usize, a.len);
        Ok(())
    })
}

/// `cuMemHostGetDevicePointer_v2`: host memory is addressed at the same pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    dptr: *mut CUdeviceptr,
    p: *mut c_void,
    _flags: u32,
) -> CUresult {
    guard(|| {
        rt()?;
        match find(p as usize) {
            Some((_, a)) if a.kind == Kind::Host => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(dptr, p as u64) }
    })
}

/// `cuMemGetAddressRange_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut CUdeviceptr,
    size: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    guard(|| {
        rt()?;
        let (b, a) = find(dptr as usize).ok_or(CUDA_ERROR_NOT_FOUND)?;
        // SAFETY: optional out-pointers from the caller, checked for null.
        unsafe {
            if !base.is_null() {
                put(base, b as u64)?;
            }
            if !size.is_null() {
                put(size, a.len)?;
            }
        }
        Ok(())
    })
}

// ---- stream-ordered allocation and pools ----

/// A memory pool (allocations are not cached: the pool only names a device).
pub struct Pool {
    pub id: usize,
    pub device: u32,
}

pub static POOLS: Registry<Pool> = Registry::new();

fn default_pool(device: u32) -> Arc<Pool> {
    static D: OnceLock<Mutex<HashMap<u32, Arc<Pool>>>> = OnceLock::new();
    let mut m = D.get_or_init(|| Mutex::new(HashMap::new())).lock();
    m.entry(device)
        .or_insert_with(|| {
            let p = Arc::new(Pool {
                id: next_handle(),
                device,
            });
            POOLS.insert(p.id, p.clone());
            p
        })
        .clone()
}

fn alloc_async(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: Option<Handle>,
    h: Handle,
    ptds: bool,
) -> CUresult {
    guard(|| {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = resolve(h, ptds)?;
        let c = current()?;
        let pool = match pool {
            Some(ph) => POOLS.get(ph as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?,
            None => default_pool(s.device),
        };
        let p = alloc_device(pool.device, c.id, bytes, Kind::Pool(pool.id))?;
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(dptr, p as u64) }
    })
}

/// `cuMemAllocAsync`: memory is reserved at once (usable in stream order, as documented).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    h: Handle,
) -> CUresult {
    alloc_async(dptr, bytes, None, h, false)
}

/// `cuMemAllocAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    h: Handle,
) -> CUresult {
    alloc_async(dptr, bytes, None, h, true)
}

/// `cuMemAllocFromPoolAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: Handle,
    h: Handle,
) -> CUresult {
    alloc_async(dptr, bytes, Some(pool), h, false)
}

/// `cuMemAllocFromPoolAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: Handle,
    h: Handle,
) -> CUresult {
    alloc_async(dptr, bytes, Some(pool), h, true)
}

fn free_async(dptr: CUdeviceptr, h: Handle, ptds: bool) -> CUresult {
    guard(|| {
        let s = resolve(h, ptds)?;
        match find(dptr as usize) {
            Some((b, a))
                if b == dptr as usize && !matches!(a.kind, Kind::Host | Kind::VmmMap(_)) => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        let p = dptr as usize;
        s.enqueue(Op::Host(Box::new(move || {
            let _ = free_device(p);
        })));
        Ok(())
    })
}

/// `cuMemFreeAsync`: freed when the stream reaches it.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, h: Handle) -> CUresult {
    free_async(dptr, h, false)
}

/// `cuMemFreeAsync_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, h: Handle) -> CUresult {
    free_async(dptr, h, true)
}

/// `cuDeviceGetDefaultMemPool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut Handle, dev: CUdevice) -> CUresult {
    guard(|| {
        let g = gpu(dev)?;
        let p = default_pool(g.index);
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(pool, p.id as Handle) }
    })
}

/// `cuDeviceGetMemPool` (the current pool is always the default one here).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut Handle, dev: CUdevice) -> CUresult {
    // SAFETY: same contract as cuDeviceGetDefaultMemPool.
    unsafe { cuDeviceGetDefaultMemPool(pool, dev) }
}

/// `cuMemPoolCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut Handle,
    props: *const CUmemPoolProps,
) -> CUresult {
    guard(|| {
        if pool.is_null() || props.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null props struct from the caller.
        let loc = unsafe { (*props).location };
        if loc.kind != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = gpu(loc.id)?;
        let p = Arc::new(Pool {
            id: next_handle(),
            device: g.index,
        });
        POOLS.insert(p.id, p.clone());
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(pool, p.id as Handle) }
    })
}

/// `cuMemPoolDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolDestroy(pool: Handle) -> CUresult {
    guard(|| {
        rt()?;
        POOLS
            .remove(pool as usize)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

/// `cuMemPoolTrimTo`: nothing is cached, so nothing to trim.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolTrimTo(pool: Handle, _keep: usize) -> CUresult {
    guard(|| {
        rt()?;
        POOLS
            .get(pool as usize)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

/// `cuMemPoolSetAttribute`: accepted.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolSetAttribute(pool: Handle, _attr: u32, value: *mut c_void) -> CUresult {
    guard(|| {
        rt()?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        POOLS
            .get(pool as usize)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

/// `cuMemPoolGetAttribute`: memory attributes report the pool's live allocations.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: Handle,
    attr: u32,
    value: *mut c_void,
) -> CUresult {
    guard(|| {
        rt()?;
        let p = POOLS.get(pool as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let in_use: u64 = allocs()
            .values()
            .filter(|a| a.kind == Kind::Pool(p.id))
            .map(|a| a.charged)
            .sum();
        match attr {
            // reuse flags (int)
            1..=3 => unsafe_put_i32(value, 1),
            // release threshold, reserved/used current/high (u64)
            4 => unsafe_put_u64(value, 0),
            5..=8 => unsafe_put_u64(value, in_use),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })
}

fn unsafe_put_i32(p: *mut c_void, v: i32) -> Res {
    // SAFETY: the caller's attribute buffer is at least as large as the attribute's type.
    unsafe { put(p as *mut i32, v) }
}

fn unsafe_put_u64(p: *mut c_void, v: u64) -> Res {
    // SAFETY: the caller's attribute buffer is at least as large as the attribute's type.
    unsafe { put(p as *mut u64, v) }
}

// ---- pointer attributes ----

/// `cuPointerGetAttribute`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attr: u32,
    ptr: CUdeviceptr,
) -> CUresult {
    guard(|| {
        rt()?;
        if data.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (base, a) = find(ptr as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: `data` is the caller's buffer sized for the attribute's type.
        unsafe {
            match attr {
                1 => put(data as *mut Handle, a.ctx as Handle),
                2 => put(data as *mut u32, if a.kind == Kind::Host { 1 } else { 2 }),
                3 | 4 => put(data as *mut u64, ptr),
                7 => put(data as *mut u64, base as u64),
                8 => put(data as *mut u32, u32::from(a.kind == Kind::Managed)),
                9 => put(data as *mut i32, ordinal(a.device)?),
                11 => put(data as *mut u64, base as u64),
                12 => put(data as *mut usize, a.len),
                13 => put(data as *mut u32, 1),
                _ => Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
    })
}
