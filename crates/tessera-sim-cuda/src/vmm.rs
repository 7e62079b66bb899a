//! Virtual memory management: `cuMemCreate`, address reservations, `cuMemMap`, access.
//!
//! A physical allocation is a sparse memfd charged to its device at `cuMemCreate`. Reservations
//! are `PROT_NONE` anonymous mappings; `cuMemMap` maps the memfd over part of one with
//! `MAP_FIXED` (so two mappings of one handle alias the same bytes) and `cuMemSetAccess` sets the
//! protection. As in the driver, `cuMemRelease` of a handle that is still mapped keeps the memory
//! (and its charge) until the last mapping goes, and `cuMemRetainAllocationHandle` hands out the
//! handle of a mapped address again as one more reference that needs its own `cuMemRelease`.
//! One lock serialises these calls so reference and map counts, the range table and the ledger
//! always agree.
//!
//! Shareable handles: `cuMemExportToShareableHandle` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`
//! hands out a duplicate of the memfd; `cuMemImportFromShareableHandle` in any process (the fd
//! passed over a Unix socket, or opened as `/proc/<pid>/fd/<n>`) makes a handle of the same
//! bytes.
//!
//! Lifetime, as the driver documents for `cuMemRelease`: the memory behind a handle is given
//! back only once every reference to it (the creating handle, retained ones, and the handles
//! other processes imported) is released and every mapping of it, in any process, is unmapped.
//! So the card's charge is not this process's: each allocation is a shared hold in the state
//! folder ([`tessera_sim_state::shared`]), keyed by the memfd's inode, that every process with
//! a live handle or mapping of it keeps; the card counts it once while any hold lives (a killed
//! process's hold goes with it). NVML's per-process figure shows it for every process holding
//! a handle or a mapping of it, creator and importers alike (see docs/simulator.md). Memory
//! kept alive only by an exported descriptor nobody imported is not counted.

use parking_lot::{Mutex, MutexGuard};
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use crate::ffi::*;
use crate::memory::{Alloc, Kind, allocs};
use crate::runtime::{Registry, Res, gpu, guard, next_handle, physical_gpu, put, rt};

/// A VMM physical allocation: a sparse memfd.
pub struct Physical {
    pub id: usize,
    pub fd: i32,
    pub size: usize,
    pub device: u32,
    /// The memfd's inode: the allocation's key in every process.
    key: u64,
    state: Mutex<PhysState>,
}

struct PhysState {
    /// Live `cuMemMap` mappings of this handle.
    maps: usize,
    /// References not yet released (`cuMemCreate`, each `cuMemRetainAllocationHandle`); the
    /// memory goes when both this and `maps` reach 0.
    refs: usize,
}

impl Drop for Physical {
    fn drop(&mut self) {
        // SAFETY: closing the memfd this object owns; mappings keep their own reference.
        unsafe { libc::close(self.fd) };
    }
}

/// Physical allocations not yet gone (released ones stay while mapped).
pub static PHYSICAL: Registry<Physical> = Registry::new();
/// VMM allocation granularity.
pub const GRANULARITY: usize = 2 << 20;

fn vmm_lock() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock()
}

fn reservations() -> MutexGuard<'static, BTreeMap<usize, usize>> {
    static R: OnceLock<Mutex<BTreeMap<usize, usize>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new())).lock()
}

fn state(p: &Physical) -> MutexGuard<'_, PhysState> {
    p.state.lock()
}

/// A handle the caller may still use (known and not released).
fn live(h: u64) -> Result<Arc<Physical>, CUresult> {
    PHYSICAL
        .get(h as usize)
        .filter(|p| state(p).refs > 0)
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// This process's hold of one shared allocation, summed over its handles (caller holds
/// the VMM lock).
struct Held {
    hold: tessera_sim_state::SharedHold,
    device: u32,
    size: u64,
    /// Unreleased references over all handles of the allocation here.
    refs: usize,
    /// Live mappings over all handles of the allocation here.
    maps: usize,
}

fn held() -> MutexGuard<'static, HashMap<u64, Held>> {
    static H: OnceLock<Mutex<HashMap<u64, Held>>> = OnceLock::new();
    H.get_or_init(|| Mutex::new(HashMap::new())).lock()
}

/// A new handle of allocation `key` here: joins this process's hold, or takes one (charging
/// the card if no process holds the allocation yet) and shows it in this process's NVML
/// figure.
fn join(key: u64, device: u32, size: u64) -> Res {
    let mut t = held();
    if let Some(h) = t.get_mut(&key) {
        h.refs += 1;
        return Ok(());
    }
    let rt = rt()?;
    let hold = rt
        .ledger
        .hold_shared(device, key, size)
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    if rt.ledger.show_shared(device, size, true).is_err() {
        rt.ledger.release_shared(hold);
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let h = Held {
        hold,
        device,
        size,
        refs: 1,
        maps: 0,
    };
    t.insert(key, h);
    Ok(())
}

/// A handle's references or mappings changed by `refs` / `maps`: updates this process's hold,
/// and gives it up (and stops showing it) when no reference and no mapping is left here.
fn adjust(p: &Physical, refs: isize, maps: isize) {
    let mut t = held();
    let Some(h) = t.get_mut(&p.key) else { return };
    h.refs = h.refs.saturating_add_signed(refs);
    h.maps = h.maps.saturating_add_signed(maps);
    if h.refs == 0
        && h.maps == 0
        && let Some(h) = t.remove(&p.key)
        && let Ok(rt) = rt()
    {
        let _ = rt.ledger.show_shared(h.device, h.size, false);
        rt.ledger.release_shared(h.hold);
    }
}

/// Forgets a handle once it is released and unmapped (its memory goes with the last hold).
fn settle(p: &Physical, st: &PhysState) {
    if st.refs == 0 && st.maps == 0 {
        PHYSICAL.remove(p.id);
    }
}

/// The inode and size of a memfd.
fn inode_and_size(fd: i32) -> Result<(u64, usize), CUresult> {
    // SAFETY: fstat into a zeroed stat buffer on a descriptor the caller holds.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok((st.st_ino, st.st_size as usize))
    }
}

/// The VMM mappings overlapping [ptr, ptr+size): (base, len, physical id).
fn mappings_in(ptr: usize, size: usize) -> Vec<(usize, usize, usize)> {
    let end = ptr.saturating_add(size);
    let t = allocs();
    // A mapping starting before `ptr` may still reach into the range.
    let first = t.range(..ptr).next_back().map_or(ptr, |(b, _)| *b);
    t.range(first..end)
        .filter_map(|(b, a)| match a.kind {
            Kind::VmmMap(id) if b + a.len > ptr => Some((*b, a.len, id)),
            _ => None,
        })
        .collect()
}

/// Unmaps the given mappings: back to inaccessible reservation, counts dropped.
fn drop_mappings(maps: &[(usize, usize, usize)]) {
    for &(base, len, id) in maps {
        // SAFETY: [base, base+len) is a mapping this module made inside a reservation it owns;
        // MAP_FIXED replaces only that range.
        unsafe {
            libc::mmap(
                base as *mut c_void,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        allocs().remove(&base);
        if let Some(p) = PHYSICAL.get(id) {
            let mut st = state(&p);
            st.maps = st.maps.saturating_sub(1);
            adjust(&p, 0, -1);
            settle(&p, &st);
        }
    }
}

fn aligned(v: usize) -> bool {
    v.is_multiple_of(GRANULARITY)
}

/// `cuMemGetAllocationGranularity`: 2 MiB.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    g: *mut usize,
    prop: *const CUmemAllocationProp,
    _opt: u32,
) -> CUresult {
    guard(|| {
        rt()?;
        if prop.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(g, GRANULARITY) }
    })
}

/// `cuMemCreate`: charged to the card at once, as a shared hold of this process.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    h: *mut u64,
    size: usize,
    prop: *const CUmemAllocationProp,
    _flags: u64,
) -> CUresult {
    guard(|| {
        rt()?;
        if h.is_null() || prop.is_null() || size == 0 || !aligned(size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null prop struct from the caller.
        let (kind, loc) = unsafe { ((*prop).kind, (*prop).location) };
        if kind != CU_MEM_ALLOCATION_TYPE_PINNED || loc.kind != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = gpu(loc.id)?;
        let _l = vmm_lock();
        // The name carries the device, for an importer to find it.
        let name = std::ffi::CString::new(format!("{MEMFD_PREFIX}{}", g.index))
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: memfd_create with a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: fd is our fresh memfd (checked >= 0 first).
        if fd < 0 || unsafe { libc::ftruncate(fd, size as i64) } != 0 {
            if fd >= 0 {
                // SAFETY: closing our own fresh memfd.
                unsafe { libc::close(fd) };
            }
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let joined = inode_and_size(fd).and_then(|(key, _)| {
            join(key, g.index, size as u64)?;
            Ok(key)
        });
        let key = match joined {
            Ok(key) => key,
            Err(e) => {
                // SAFETY: closing our own fresh memfd.
                unsafe { libc::close(fd) };
                return Err(e);
            }
        };
        let p = Arc::new(Physical {
            id: next_handle(),
            fd,
            size,
            device: g.index,
            key,
            state: Mutex::new(PhysState { maps: 0, refs: 1 }),
        });
        PHYSICAL.insert(p.id, p.clone());
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(h, p.id as u64) }
    })
}

/// `cuMemRelease`: one reference goes; the memory goes (and is uncharged) once no reference
/// and no mapping of it is left.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(h: u64) -> CUresult {
    guard(|| {
        rt()?;
        let _l = vmm_lock();
        let p = live(h)?;
        let mut st = state(&p);
        st.refs -= 1;
        adjust(&p, -1, 0);
        settle(&p, &st);
        Ok(())
    })
}

/// `cuMemRetainAllocationHandle`: the handle mapped at `addr` (anywhere inside a mapping), as
/// one more reference, even when the handle itself was released already.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(h: *mut u64, addr: *mut c_void) -> CUresult {
    guard(|| {
        rt()?;
        let _l = vmm_lock();
        if h.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = mappings_in(addr as usize, 1)
            .first()
            .map(|&(_, _, id)| id)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let p = PHYSICAL.get(id).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        state(&p).refs += 1;
        adjust(&p, 1, 0);
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(h, p.id as u64) }
    })
}

/// Name of a handle's memfd, followed by its device index.
const MEMFD_PREFIX: &str = "tessera-sim-vmm-";

/// `cuMemExportToShareableHandle`: for `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, a new file
/// descriptor of the handle's memory (the caller owns it); other types are not supported.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    out: *mut c_void,
    h: u64,
    kind: i32,
    _flags: u64,
) -> CUresult {
    guard(|| {
        rt()?;
        let _l = vmm_lock();
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let p = live(h)?;
        // SAFETY: duplicating the memfd this handle owns.
        let fd = unsafe { libc::fcntl(p.fd, libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: non-null out-pointer to an int, as the POSIX fd handle type prescribes.
        unsafe { put(out as *mut i32, fd) }
    })
}

/// The device of a memfd made by `cuMemCreate` (in any process), from its name.
fn exported_device(fd: i32) -> Option<u32> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    let name = link
        .to_str()?
        .strip_prefix("/memfd:")?
        .strip_prefix(MEMFD_PREFIX)?;
    name.split(' ').next()?.parse().ok()
}

/// `cuMemImportFromShareableHandle`: a handle of the memory behind a POSIX file descriptor
/// exported by `cuMemExportToShareableHandle` (the descriptor stays the caller's). The
/// allocation joins this process's holds: it stays on the card while this handle or a mapping
/// of it lives, even after its creator let go.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    h: *mut u64,
    os_handle: *mut c_void,
    kind: i32,
) -> CUresult {
    guard(|| {
        rt()?;
        if h.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let fd = i32::try_from(os_handle as usize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let device = exported_device(fd).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        physical_gpu(device)?;
        let (key, size) = inode_and_size(fd)?;
        let _l = vmm_lock();
        // SAFETY: duplicating the caller's descriptor; the handle owns the copy.
        let own = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if own < 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Err(e) = join(key, device, size as u64) {
            // SAFETY: closing the copy made just above.
            unsafe { libc::close(own) };
            return Err(e);
        }
        let p = Arc::new(Physical {
            id: next_handle(),
            fd: own,
            size,
            device,
            key,
            state: Mutex::new(PhysState { maps: 0, refs: 1 }),
        });
        PHYSICAL.insert(p.id, p.clone());
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(h, p.id as u64) }
    })
}

/// `cuMemAddressReserve`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    align: usize,
    _addr: CUdeviceptr,
    _flags: u64,
) -> CUresult {
    guard(|| {
        rt()?;
        if ptr.is_null() || size == 0 || !aligned(size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let align = align.max(GRANULARITY);
        if !align.is_power_of_two() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let span = size.checked_add(align).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
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

/// `cuMemAddressFree`: mappings still inside the range are unmapped first.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    guard(|| {
        rt()?;
        let _l = vmm_lock();
        let ptr = ptr as usize;
        if reservations().get(&ptr) != Some(&size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        drop_mappings(&mappings_in(ptr, size));
        reservations().remove(&ptr);
        // SAFETY: removing a reservation this module made (its mappings are gone).
        unsafe { libc::munmap(ptr as *mut c_void, size) };
        Ok(())
    })
}

fn in_reservation(ptr: usize, size: usize) -> bool {
    let r = reservations();
    r.range(..=ptr)
        .next_back()
        .is_some_and(|(b, s)| ptr.checked_add(size).is_some_and(|e| e <= b + s))
}

/// `cuMemMap`: only onto reserved, not yet mapped, granularity-aligned ranges.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    h: u64,
    _flags: u64,
) -> CUresult {
    guard(|| {
        rt()?;
        let _l = vmm_lock();
        let p = live(h)?;
        let ptr = ptr as usize;
        if size == 0
            || !aligned(ptr)
            || !aligned(size)
            || !aligned(offset)
            || offset.checked_add(size).is_none_or(|e| e > p.size)
            || !in_reservation(ptr, size)
            || !mappings_in(ptr, size).is_empty()
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: [ptr, ptr+size) lies inside a reservation we own and holds no mapping;
        // MAP_FIXED replaces only it.
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
            ptr,
            Alloc {
                len: size,
                charged: 0,
                device: p.device,
                kind: Kind::VmmMap(p.id),
                ctx: 0,
                access: libc::PROT_NONE,
            },
        );
        state(&p).maps += 1;
        adjust(&p, 0, 1);
        Ok(())
    })
}

/// `cuMemUnmap`: the range must cover whole mappings.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    guard(|| {
        rt()?;
        let _l = vmm_lock();
        let (ptr, end) = (ptr as usize, (ptr as usize).saturating_add(size));
        let maps = mappings_in(ptr, size);
        if maps.is_empty() || maps.iter().any(|&(b, l, _)| b < ptr || b + l > end) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        drop_mappings(&maps);
        Ok(())
    })
}

/// `cuMemSetAccess`: the range must be fully mapped.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    guard(|| {
        rt()?;
        let _l = vmm_lock();
        let ptr = ptr as usize;
        if desc.is_null() || count == 0 || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let maps = mappings_in(ptr, size);
        let covered: usize = maps
            .iter()
            .map(|&(b, l, _)| (b + l).min(ptr + size) - b.max(ptr))
            .sum();
        if covered != size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes `count` descriptors.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        if descs
            .iter()
            .any(|d| d.location.kind != CU_MEM_LOCATION_TYPE_DEVICE || d.flags > 3)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for d in descs {
            gpu(d.location.id)?;
        }
        let prot = match descs.iter().map(|d| d.flags).max().unwrap_or(0) {
            0 => libc::PROT_NONE,
            1 => libc::PROT_READ,
            _ => libc::PROT_READ | libc::PROT_WRITE,
        };
        // SAFETY: changing protection of mapped ranges inside our reservation.
        if unsafe { libc::mprotect(ptr as *mut c_void, size, prot) } != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // Whole mappings take the new access; a partial update keeps the safer of the two.
        let mut t = allocs();
        for (b, l, _) in maps {
            if let Some(a) = t.get_mut(&b) {
                a.access = if b >= ptr && b + l <= ptr + size {
                    prot
                } else {
                    a.access & prot
                };
            }
        }
        Ok(())
    })
}
