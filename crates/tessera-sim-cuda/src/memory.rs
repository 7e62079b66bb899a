//! Device memory: allocations, copies, memsets, pools, VMM, arrays and pointer attributes.
//!
//! Every device allocation is an anonymous `MAP_NORESERVE` mapping whose address is the device
//! pointer, so an 80 GiB card costs no host RAM until bytes are touched. Sizes are accounted in
//! the shared ledger (so other processes see them) before the mapping is made. VMM physical
//! handles are sparse memfds mapped with `MAP_FIXED` into `PROT_NONE` reservations.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::context::current;
use crate::ffi::*;
use crate::runtime::{Registry, Res, gpu, guard, next_handle, put, rt};
use crate::stream::{Op, resolve};

/// What kind of memory a range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Device,
    Managed,
    Host,
    /// From a memory pool (stream-ordered).
    Pool(usize),
    /// A VMM mapping (accounted by its physical handle).
    VmmMap,
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
}

fn allocs() -> MutexGuard<'static, BTreeMap<usize, Alloc>> {
    static A: OnceLock<Mutex<BTreeMap<usize, Alloc>>> = OnceLock::new();
    A.get_or_init(|| Mutex::new(BTreeMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
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
        },
    );
    Ok(p)
}

/// Frees a device allocation by its base pointer.
pub fn free_device(ptr: usize) -> Res {
    let a = {
        let mut t = allocs();
        match t.get(&ptr) {
            Some(a) if !matches!(a.kind, Kind::Host | Kind::VmmMap) => t.remove(&ptr),
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
        .filter(|(_, a)| a.ctx == ctx && !matches!(a.kind, Kind::Host | Kind::VmmMap))
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

/// Checks that [ptr, ptr+len) lies inside one known allocation (device-side argument).
fn check_device(ptr: u64, len: usize) -> Res {
    let p = ptr as usize;
    match find(p) {
        Some((base, a)) if p.checked_add(len).is_some_and(|e| e <= base + a.len) => Ok(()),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// For unified copies: a pointer inside a known range must fit in it; others count as host.
fn check_any(ptr: u64, len: usize) -> Res {
    if ptr == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match find(ptr as usize) {
        Some(_) => check_device(ptr, len),
        None => Ok(()),
    }
}

fn copy(dst: u64, src: u64, n: usize) {
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
pub unsafe extern "C" fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytes: usize, flags: u32) -> CUresult {
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
        if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 || ![4, 8, 16].contains(&elem) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let c = current()?;
        let p_bytes = width.div_ceil(512) * 512;
        let total = p_bytes.checked_mul(height).ok_or(CUDA_ERROR_INVALID_VALUE)?;
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
        let t = gpu(c.device as i32)?.total_bytes;
        let used = tessera_sim_state::device_memory_used(&rt.dir, c.device)
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
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, _flags: u32) -> CUresult {
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
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(dptr: *mut CUdeviceptr, p: *mut c_void, _flags: u32) -> CUresult {
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
pub unsafe extern "C" fn cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr) -> CUresult {
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
    let mut m = D
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
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

fn alloc_async(dptr: *mut CUdeviceptr, bytes: usize, pool: Option<Handle>, h: Handle, ptds: bool) -> CUresult {
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
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytes: usize, h: Handle) -> CUresult {
    alloc_async(dptr, bytes, None, h, false)
}

/// `cuMemAllocAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, bytes: usize, h: Handle) -> CUresult {
    alloc_async(dptr, bytes, None, h, true)
}

/// `cuMemAllocFromPoolAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, bytes: usize, pool: Handle, h: Handle) -> CUresult {
    alloc_async(dptr, bytes, Some(pool), h, false)
}

/// `cuMemAllocFromPoolAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, bytes: usize, pool: Handle, h: Handle) -> CUresult {
    alloc_async(dptr, bytes, Some(pool), h, true)
}

fn free_async(dptr: CUdeviceptr, h: Handle, ptds: bool) -> CUresult {
    guard(|| {
        let s = resolve(h, ptds)?;
        match find(dptr as usize) {
            Some((b, a)) if b == dptr as usize && !matches!(a.kind, Kind::Host | Kind::VmmMap) => {}
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
pub unsafe extern "C" fn cuMemPoolCreate(pool: *mut Handle, props: *const CUmemPoolProps) -> CUresult {
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
pub unsafe extern "C" fn cuMemPoolGetAttribute(pool: Handle, attr: u32, value: *mut c_void) -> CUresult {
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

// ---- copies and memsets ----

macro_rules! memcpy_fns {
    ($sync:ident, $sync_pt:ident, $async_:ident, $async_pt:ident, $d:ty, $s:ty, $check:expr) => {
        #[doc = concat!("`", stringify!($sync), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $sync(dst: $d, src: $s, n: usize) -> CUresult {
            guard(|| {
                current()?;
                let check: fn(u64, u64, usize) -> Res = $check;
                check(dst as u64, src as u64, n)?;
                copy(dst as u64, src as u64, n);
                Ok(())
            })
        }
        #[doc = concat!("`", stringify!($sync_pt), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $sync_pt(dst: $d, src: $s, n: usize) -> CUresult {
            $sync(dst, src, n)
        }
        #[doc = concat!("`", stringify!($async_), "`: copied at once (kernels never touch data).")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $async_(dst: $d, src: $s, n: usize, h: Handle) -> CUresult {
            guard(|| {
                resolve(h, false)?;
                let check: fn(u64, u64, usize) -> Res = $check;
                check(dst as u64, src as u64, n)?;
                copy(dst as u64, src as u64, n);
                Ok(())
            })
        }
        #[doc = concat!("`", stringify!($async_pt), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $async_pt(dst: $d, src: $s, n: usize, h: Handle) -> CUresult {
            guard(|| {
                resolve(h, true)?;
                let check: fn(u64, u64, usize) -> Res = $check;
                check(dst as u64, src as u64, n)?;
                copy(dst as u64, src as u64, n);
                Ok(())
            })
        }
    };
}

fn host_ok(p: u64) -> Res {
    if p == 0 { Err(CUDA_ERROR_INVALID_VALUE) } else { Ok(()) }
}

memcpy_fns!(
    cuMemcpyHtoD_v2,
    cuMemcpyHtoD_v2_ptds,
    cuMemcpyHtoDAsync_v2,
    cuMemcpyHtoDAsync_v2_ptsz,
    CUdeviceptr,
    *const c_void,
    |d, s, n| {
        host_ok(s)?;
        check_device(d, n)
    }
);
memcpy_fns!(
    cuMemcpyDtoH_v2,
    cuMemcpyDtoH_v2_ptds,
    cuMemcpyDtoHAsync_v2,
    cuMemcpyDtoHAsync_v2_ptsz,
    *mut c_void,
    CUdeviceptr,
    |d, s, n| {
        host_ok(d)?;
        check_device(s, n)
    }
);
memcpy_fns!(
    cuMemcpyDtoD_v2,
    cuMemcpyDtoD_v2_ptds,
    cuMemcpyDtoDAsync_v2,
    cuMemcpyDtoDAsync_v2_ptsz,
    CUdeviceptr,
    CUdeviceptr,
    |d, s, n| {
        check_device(d, n)?;
        check_device(s, n)
    }
);
memcpy_fns!(
    cuMemcpy,
    cuMemcpy_ptds,
    cuMemcpyAsync,
    cuMemcpyAsync_ptsz,
    CUdeviceptr,
    CUdeviceptr,
    |d, s, n| {
        check_any(d, n)?;
        check_any(s, n)
    }
);

/// `cuMemcpyPeer`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyPeer(dst: CUdeviceptr, _dc: Handle, src: CUdeviceptr, _sc: Handle, n: usize) -> CUresult {
    cuMemcpyDtoD_v2(dst, src, n)
}

fn memset(dst: u64, value: u32, width: usize, n: usize, stream: Option<(Handle, bool)>) -> CUresult {
    guard(|| {
        match stream {
            Some((h, pt)) => {
                resolve(h, pt)?;
            }
            None => {
                current()?;
            }
        }
        let bytes = n.checked_mul(width).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        check_device(dst, bytes)?;
        // SAFETY: [dst, dst+bytes) lies inside a live device allocation (checked above).
        unsafe {
            match width {
                1 => std::ptr::write_bytes(dst as *mut u8, value as u8, n),
                2 => std::slice::from_raw_parts_mut(dst as *mut u16, n).fill(value as u16),
                _ => std::slice::from_raw_parts_mut(dst as *mut u32, n).fill(value),
            }
        }
        Ok(())
    })
}

macro_rules! memset_fns {
    ($w:expr, $t:ty, $s:ident, $s_pt:ident, $a:ident, $a_pt:ident) => {
        #[doc = concat!("`", stringify!($s), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $s(dst: CUdeviceptr, v: $t, n: usize) -> CUresult {
            memset(dst, v as u32, $w, n, None)
        }
        #[doc = concat!("`", stringify!($s_pt), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $s_pt(dst: CUdeviceptr, v: $t, n: usize) -> CUresult {
            memset(dst, v as u32, $w, n, None)
        }
        #[doc = concat!("`", stringify!($a), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $a(dst: CUdeviceptr, v: $t, n: usize, h: Handle) -> CUresult {
            memset(dst, v as u32, $w, n, Some((h, false)))
        }
        #[doc = concat!("`", stringify!($a_pt), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $a_pt(dst: CUdeviceptr, v: $t, n: usize, h: Handle) -> CUresult {
            memset(dst, v as u32, $w, n, Some((h, true)))
        }
    };
}

memset_fns!(1, u8, cuMemsetD8_v2, cuMemsetD8_v2_ptds, cuMemsetD8Async, cuMemsetD8Async_ptsz);
memset_fns!(2, u16, cuMemsetD16_v2, cuMemsetD16_v2_ptds, cuMemsetD16Async, cuMemsetD16Async_ptsz);
memset_fns!(4, u32, cuMemsetD32_v2, cuMemsetD32_v2_ptds, cuMemsetD32Async, cuMemsetD32Async_ptsz);

// ---- pointer attributes ----

/// `cuPointerGetAttribute`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(data: *mut c_void, attr: u32, ptr: CUdeviceptr) -> CUresult {
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
                9 => put(data as *mut i32, a.device as i32),
                11 => put(data as *mut u64, base as u64),
                12 => put(data as *mut usize, a.len),
                13 => put(data as *mut u32, 1),
                _ => Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
    })
}

// ---- virtual memory management ----

/// A VMM physical allocation: a sparse memfd.
pub struct Physical {
    pub id: usize,
    pub fd: i32,
    pub size: usize,
    pub device: u32,
}

impl Drop for Physical {
    fn drop(&mut self) {
        // SAFETY: closing the memfd this object owns; mappings keep their own reference.
        unsafe { libc::close(self.fd) };
    }
}

pub static PHYSICAL: Registry<Physical> = Registry::new();
/// VMM allocation granularity.
pub const GRANULARITY: usize = 2 << 20;

fn reservations() -> MutexGuard<'static, BTreeMap<usize, usize>> {
    static R: OnceLock<Mutex<BTreeMap<usize, usize>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// `cuMemGetAllocationGranularity`: 2 MiB.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, _opt: u32) -> CUresult {
    guard(|| {
        rt()?;
        if prop.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(g, GRANULARITY) }
    })
}

/// `cuMemCreate`: charged to the device at once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(h: *mut u64, size: usize, prop: *const CUmemAllocationProp, _flags: u64) -> CUresult {
    guard(|| {
        rt()?;
        if h.is_null() || prop.is_null() || size == 0 || size % GRANULARITY != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null prop struct from the caller.
        let (kind, loc) = unsafe { ((*prop).kind, (*prop).location) };
        if kind != CU_MEM_ALLOCATION_TYPE_PINNED || loc.kind != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = gpu(loc.id)?;
        let rt = rt()?;
        rt.ledger
            .try_alloc(g.index, size as u64)
            .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: memfd_create with a static NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"tessera-sim-vmm".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: fd is our fresh memfd (checked >= 0 first).
        if fd < 0 || unsafe { libc::ftruncate(fd, size as i64) } != 0 {
            if fd >= 0 {
                // SAFETY: closing our own fresh memfd.
                unsafe { libc::close(fd) };
            }
            rt.ledger.free(g.index, size as u64);
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let p = Arc::new(Physical {
            id: next_handle(),
            fd,
            size,
            device: g.index,
        });
        PHYSICAL.insert(p.id, p.clone());
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(h, p.id as u64) }
    })
}

/// `cuMemRelease`: uncharges the device (mappings stay valid until unmapped).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(h: u64) -> CUresult {
    guard(|| {
        let rt = rt()?;
        let p = PHYSICAL
            .remove(h as usize)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        rt.ledger.free(p.device, p.size as u64);
        Ok(())
    })
}

/// `cuMemAddressReserve`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, align: usize, _addr: CUdeviceptr, _flags: u64) -> CUresult {
    guard(|| {
        rt()?;
        if ptr.is_null() || size == 0 || size % GRANULARITY != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let align = align.max(GRANULARITY);
        if !align.is_power_of_two() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let span = size + align;
        // SAFETY: a fresh inaccessible reservation; no existing memory affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let raw = p as usize;
        let start = raw.next_multiple_of(align);
        // SAFETY: trimming the unaligned head and tail of the reservation just made.
        unsafe {
            if start > raw {
                libc::munmap(raw as *mut c_void, start - raw);
            }
            let tail = raw + span - (start + size);
            if tail > 0 {
                libc::munmap((start + size) as *mut c_void, tail);
            }
        }
        reservations().insert(start, size);
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(ptr, start as u64) }
    })
}

/// `cuMemAddressFree`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    guard(|| {
        rt()?;
        let mut r = reservations();
        match r.get(&(ptr as usize)) {
            Some(&s) if s == size => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        r.remove(&(ptr as usize));
        drop(r);
        allocs().retain(|b, a| !(a.kind == Kind::VmmMap && *b >= ptr as usize && *b < ptr as usize + size));
        // SAFETY: removing a reservation this module made (and its mappings).
        unsafe { libc::munmap(ptr as *mut c_void, size) };
        Ok(())
    })
}

fn in_reservation(ptr: usize, size: usize) -> bool {
    let r = reservations();
    r.range(..=ptr)
        .next_back()
        .is_some_and(|(b, s)| ptr + size <= b + s)
}

/// `cuMemMap`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, h: u64, _flags: u64) -> CUresult {
    guard(|| {
        rt()?;
        let p = PHYSICAL.get(h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if size == 0 || offset + size > p.size || !in_reservation(ptr as usize, size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: [ptr, ptr+size) lies inside a reservation we own; MAP_FIXED replaces only it.
        let m = unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                p.fd,
                offset as i64,
            )
        };
        if m == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        allocs().insert(
            ptr as usize,
            Alloc {
                len: size,
                charged: 0,
                device: p.device,
                kind: Kind::VmmMap,
                ctx: 0,
            },
        );
        Ok(())
    })
}

/// `cuMemUnmap`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    guard(|| {
        rt()?;
        if !in_reservation(ptr as usize, size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: back to an inaccessible reservation over a range we own.
        unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        allocs().retain(|b, a| !(a.kind == Kind::VmmMap && *b >= ptr as usize && *b < ptr as usize + size));
        Ok(())
    })
}

/// `cuMemSetAccess`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) -> CUresult {
    guard(|| {
        rt()?;
        if desc.is_null() || count == 0 || !in_reservation(ptr as usize, size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes `count` descriptors.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        let flags = descs.iter().map(|d| d.flags).max().unwrap_or(0);
        let prot = match flags {
            0 => libc::PROT_NONE,
            1 => libc::PROT_READ,
            _ => libc::PROT_READ | libc::PROT_WRITE,
        };
        // SAFETY: changing protection of a range inside our reservation.
        if unsafe { libc::mprotect(ptr as *mut c_void, size, prot) } != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    })
}

// ---- arrays ----

/// A CUDA array: charged, never backed by host memory.
pub struct ArrayObj {
    pub id: usize,
    pub bytes: u64,
    pub device: u32,
}

pub static ARRAYS: Registry<ArrayObj> = Registry::new();

fn format_bytes(format: u32) -> Result<u64, CUresult> {
    Ok(match format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 => 2,
        0x03 | 0x0a | 0x20 => 4,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

fn array_create(h: *mut Handle, bytes: u64) -> Res {
    let c = current()?;
    if h.is_null() || bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    rt()?
        .ledger
        .try_alloc(c.device, bytes)
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    let a = Arc::new(ArrayObj {
        id: next_handle(),
        bytes,
        device: c.device,
    });
    ARRAYS.insert(a.id, a.clone());
    // SAFETY: non-null out-pointer from the caller.
    unsafe { put(h, a.id as Handle) }
}

fn dims3(d: &CudaArray3dDescriptor, level: u32) -> Result<u64, CUresult> {
    let shrink = |x: usize| ((x >> level).max(1)) as u64;
    let w = shrink(d.width);
    let h = if d.height == 0 { 1 } else { shrink(d.height) };
    // Layered arrays (flag 1) keep their layer count across levels.
    let depth = if d.depth == 0 {
        1
    } else if d.flags & 1 != 0 {
        d.depth as u64
    } else {
        shrink(d.depth)
    };
    if d.width == 0 || !(1..=4).contains(&d.num_channels) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(w * h * depth * u64::from(d.num_channels) * format_bytes(d.format)?)
}

/// `cuArrayCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(h: *mut Handle, desc: *const CudaArrayDescriptor) -> CUresult {
    guard(|| {
        if desc.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null descriptor from the caller.
        let d = unsafe { &*desc };
        let d3 = CudaArray3dDescriptor {
            width: d.width,
            height: d.height,
            depth: 0,
            format: d.format,
            num_channels: d.num_channels,
            flags: 0,
        };
        array_create(h, dims3(&d3, 0)?)
    })
}

/// `cuArray3DCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(h: *mut Handle, desc: *const CudaArray3dDescriptor) -> CUresult {
    guard(|| {
        if desc.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null descriptor from the caller.
        let bytes = dims3(unsafe { &*desc }, 0)?;
        array_create(h, bytes)
    })
}

/// `cuMipmappedArrayCreate`: the sum of all levels.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(h: *mut Handle, desc: *const CudaArray3dDescriptor, levels: u32) -> CUresult {
    guard(|| {
        if desc.is_null() || levels == 0 || levels > 32 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null descriptor from the caller.
        let d = unsafe { &*desc };
        let mut bytes = 0;
        for l in 0..levels {
            bytes += dims3(d, l)?;
        }
        array_create(h, bytes)
    })
}

fn array_destroy(h: Handle) -> Res {
    let rt = rt()?;
    let a = ARRAYS.remove(h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    rt.ledger.free(a.device, a.bytes);
    Ok(())
}

/// `cuArrayDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuArrayDestroy(h: Handle) -> CUresult {
    guard(|| array_destroy(h))
}

/// `cuMipmappedArrayDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMipmappedArrayDestroy(h: Handle) -> CUresult {
    guard(|| array_destroy(h))
}
