//! Memory accounting logic, free of raw pointers: the `extern "C"` shims in [`hooks`] decode the
//! arguments, and these functions decide, reserve, call the driver through a closure, and book.
//!
//! Every allocation reserves at the arbiter *before* the driver call (one round trip) and
//! releases if the driver fails; every free of a known object releases after the driver
//! succeeds (one-way, no round trip). A refused reservation is `CUDA_ERROR_OUT_OF_MEMORY`.

// The logic has no `unsafe`; only its C boundary, `hooks`, allows it (a `forbid` here would
// reach into that child too).
#![deny(unsafe_code)]

pub mod hooks;

use crate::ffi::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUresult};
use crate::ledger::{ImportKey, Kind, Release};
use crate::shim::{Outcome, Pass};
use crate::state::Process;
use crate::tlog;

/// Assumed pitch alignment when estimating a pitched allocation before the driver answers.
/// Real GPUs align rows to 512 bytes or less; a larger real pitch is corrected afterwards.
pub const PITCH_ALIGN: u64 = 512;

/// Reserves `bytes`, runs `driver` (which returns its result and the new object's key), and
/// books the object. `bytes == 0` is left to the driver (which rejects it) untracked.
pub fn allocate(
    p: &'static Process,
    kind: Kind,
    bytes: u64,
    driver: impl FnOnce() -> (CUresult, u64),
) -> Outcome<CUresult> {
    reserve_then(p, bytes, driver, |key| book(p, kind, key, bytes))
}

/// The frame of every allocation: reserve, call the driver, release on failure, `book` the
/// new object's key on success.
fn reserve_then(
    p: &'static Process,
    bytes: u64,
    driver: impl FnOnce() -> (CUresult, u64),
    book: impl FnOnce(u64),
) -> Outcome<CUresult> {
    if bytes == 0 {
        return Outcome::PassThrough(Pass::ZeroSize);
    }
    if let Err(e) = p.session.reserve(bytes) {
        tlog!(Debug, "allocation of {bytes} bytes refused: {e}");
        return Outcome::Handled(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let (r, key) = driver();
    if r != CUDA_SUCCESS {
        p.session.release(bytes);
        return Outcome::Handled(r);
    }
    book(key);
    Outcome::Handled(r)
}

// ---- VMM: cuMemCreate handles live until released and unmapped ---------------------------

/// `cuMemCreate` on the device: reserved like any allocation, booked as a handle with one
/// reference and no mapping.
pub fn vmm_create(
    p: &'static Process,
    bytes: u64,
    driver: impl FnOnce() -> (CUresult, u64),
) -> Outcome<CUresult> {
    reserve_then(p, bytes, driver, |handle| {
        let replaced = p.ledger().create_handle(handle, bytes);
        if let Some(old) = replaced {
            p.session.release(old);
        }
    })
}

/// `cuMemRelease`: one reference goes; the bytes are released only with the last reference
/// of a handle no longer mapped (for imported memory: its last import here, nothing of it
/// mapped here). Handles not counted here pass through.
pub fn vmm_release(
    p: &'static Process,
    handle: u64,
    driver: impl FnOnce() -> CUresult,
) -> Outcome<CUresult> {
    let _serial = p
        .ledger()
        .imported_handle(handle)
        .is_some()
        .then(|| IMPORTED.lock());
    let Some(taken) = p.ledger().release_begin(handle) else {
        return Outcome::PassThrough(Pass::NotCounted);
    };
    let r = driver();
    if r != CUDA_SUCCESS {
        p.ledger().release_undo(handle, taken);
    } else {
        let freed = match taken {
            Release::Last(e) => e.bytes,
            Release::Import { freed, .. } => freed,
            Release::NotLast => 0,
        };
        if freed > 0 {
            p.session.release(freed);
        }
    }
    Outcome::Handled(r)
}

/// Serialises the imports, mappings, unmappings and releases of imported memory, so that what
/// is reserved before a driver call is what the call adds when booked (two threads importing
/// or mapping the same memory at once would otherwise both reserve it, or neither).
static IMPORTED: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// `cuMemMap`: a mapping of a counted handle is recorded by its address (and keeps the
/// handle's memory counted until it is unmapped). The first mapping here of imported memory
/// reserves its size before the driver maps it, and is refused with
/// `CUDA_ERROR_OUT_OF_MEMORY` when that does not fit.
pub fn vmm_map(
    p: &'static Process,
    va: u64,
    size: u64,
    handle: u64,
    driver: impl FnOnce() -> CUresult,
) -> Outcome<CUresult> {
    let _serial = p
        .ledger()
        .imported_handle(handle)
        .is_some()
        .then(|| IMPORTED.lock());
    let cost = p.ledger().map_cost(handle, size);
    if cost > 0
        && let Err(e) = p.session.reserve(cost)
    {
        tlog!(
            Debug,
            "mapping of {cost} bytes of imported memory refused: {e}"
        );
        return Outcome::Handled(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let r = driver();
    if r != CUDA_SUCCESS {
        if cost > 0 {
            p.session.release(cost);
        }
        return Outcome::Handled(r);
    }
    let (stale, added) = p.ledger().map_handle(va, size, handle);
    // Equal under the lock; a difference can only be over-reserved, returned here.
    let back = stale + cost.saturating_sub(added);
    if back > 0 {
        p.session.release(back);
    }
    Outcome::Handled(r)
}

/// `cuMemImportFromShareableHandle` of the memory `known` (its key and size, when the
/// shareable handle tells them): reserved before the driver imports it unless this process
/// holds it already, refused with `CUDA_ERROR_OUT_OF_MEMORY` when that does not fit. Memory of
/// unknown size is booked under its handle and charged what is mapped of it.
pub fn vmm_import(
    p: &'static Process,
    known: Option<(ImportKey, u64)>,
    driver: impl FnOnce() -> (CUresult, u64),
) -> Outcome<CUresult> {
    let _serial = IMPORTED.lock();
    let cost = known.map_or(0, |(key, bytes)| p.ledger().import_cost(key, bytes));
    if cost > 0
        && let Err(e) = p.session.reserve(cost)
    {
        tlog!(Debug, "import of {cost} bytes refused: {e}");
        return Outcome::Handled(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let (r, handle) = driver();
    let added = if r == CUDA_SUCCESS {
        let (key, bytes) = known.unwrap_or((ImportKey::Handle(handle), 0));
        p.ledger().import(handle, key, bytes)
    } else {
        0
    };
    // Equal under the lock, unless the driver failed or answered a handle created here.
    if cost > added {
        p.session.release(cost - added);
    }
    Outcome::Handled(r)
}

/// `cuMemUnmap` (and `cuMemAddressFree`, which unmaps what is left): every recorded mapping
/// starting in the range goes; a handle left with no reference and no mapping is released.
/// A range with no recorded mapping passes through.
pub fn vmm_unmap(
    p: &'static Process,
    va: u64,
    size: u64,
    driver: impl FnOnce() -> CUresult,
) -> Outcome<CUresult> {
    let _serial = IMPORTED.lock();
    let taken = {
        let mut l = p.ledger();
        if !l.has_mappings_in(va, size) {
            return Outcome::PassThrough(Pass::NotCounted);
        }
        l.unmap_begin(va, size)
    };
    let r = driver();
    if r == CUDA_SUCCESS {
        let bytes = taken.bytes();
        if bytes > 0 {
            p.session.release(bytes);
        }
    } else {
        p.ledger().unmap_undo(taken);
    }
    Outcome::Handled(r)
}

/// `cuMemRetainAllocationHandle` of `addr`: the handle the driver answers gains a reference
/// when it is counted here (a created or imported one).
pub fn vmm_retain(
    p: &'static Process,
    addr: u64,
    driver: impl FnOnce() -> (CUresult, u64),
) -> Outcome<CUresult> {
    let _serial = IMPORTED.lock();
    let (r, handle) = driver();
    if r == CUDA_SUCCESS {
        let mut l = p.ledger();
        // The handle of imported memory is one more import of it, whatever value it has (the
        // memory is mapped here, so already charged: nothing is added).
        match l.import_at(addr) {
            Some((key, bytes)) => {
                let _ = l.import(handle, key, bytes);
            }
            None => {
                let _ = l.retain_handle(handle);
            }
        }
    }
    Outcome::Handled(r)
}

/// Books a live object; an entry it replaces was freed behind our back and is released.
fn book(p: &'static Process, kind: Kind, key: u64, bytes: u64) {
    let replaced = p.ledger().insert(kind, key, bytes);
    if let Some(old) = replaced {
        p.session.release(old);
    }
}

/// A pitched allocation: reserves an estimate, then corrects it to `pitch * height` once the
/// driver has chosen the pitch. If the real size needs more than the limit allows, the
/// allocation is undone with `undo` and refused.
pub fn allocate_pitch(
    p: &'static Process,
    width: u64,
    height: u64,
    driver: impl FnOnce() -> (CUresult, u64, u64),
    undo: impl FnOnce(u64),
) -> Outcome<CUresult> {
    let estimate = pitch_estimate(width, height);
    if estimate == 0 {
        return Outcome::PassThrough(Pass::ZeroSize);
    }
    if let Err(e) = p.session.reserve(estimate) {
        tlog!(
            Debug,
            "pitched allocation of ~{estimate} bytes refused: {e}"
        );
        return Outcome::Handled(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let (r, ptr, pitch) = driver();
    if r != CUDA_SUCCESS {
        p.session.release(estimate);
        return Outcome::Handled(r);
    }
    let actual = pitch.saturating_mul(height);
    if actual > estimate {
        if let Err(e) = p.session.reserve(actual - estimate) {
            tlog!(
                Debug,
                "pitched allocation of {actual} bytes refused after the fact: {e}"
            );
            undo(ptr);
            p.session.release(estimate);
            return Outcome::Handled(CUDA_ERROR_OUT_OF_MEMORY);
        }
    } else {
        p.session.release(estimate - actual);
    }
    book(p, Kind::Ptr, ptr, actual);
    Outcome::Handled(r)
}

/// Conservative size of a pitched allocation before the driver answers.
pub fn pitch_estimate(width: u64, height: u64) -> u64 {
    width
        .div_ceil(PITCH_ALIGN)
        .saturating_mul(PITCH_ALIGN)
        .saturating_mul(height)
}

/// Frees a known object: forgets it, calls the driver, releases on success (restores the
/// entry if the driver failed). Unknown objects pass through untouched.
pub fn free(
    p: &'static Process,
    kind: Kind,
    key: u64,
    driver: impl FnOnce() -> CUresult,
) -> Outcome<CUresult> {
    // Memory is freed from any device's current context (unified addressing): the object is
    // released to the device that holds it, wherever its free is called.
    let found = std::iter::once(p)
        .chain(crate::state::all_states())
        .find_map(|s| s.ledger().remove(kind, key).map(|b| (s, b)));
    let Some((p, bytes)) = found else {
        return Outcome::PassThrough(Pass::NotCounted);
    };
    let r = driver();
    if r == CUDA_SUCCESS {
        p.session.release(bytes);
    } else {
        book(p, kind, key, bytes);
    }
    Outcome::Handled(r)
}

/// The virtual `(free, total)` of the device: total = the allocation's limit, free = what is
/// left of it (never more than the card really has free). `None`: no arbiter answer and no
/// limit known.
pub fn virtual_mem_info(p: &'static Process, real_free: u64) -> Option<(u64, u64)> {
    let (limit, in_use) = p.session.mem_info()?;
    Some((limit.saturating_sub(in_use).min(real_free), limit))
}

/// Bytes per element of a `CUarray_format` times `channels`; unknown formats count 16 bytes
/// per element (the widest), so nothing is under-counted.
pub fn element_bytes(format: u32, channels: u32) -> u64 {
    let per_channel: u64 = match format {
        0x01 | 0x08 => 1,               // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2,        // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4,        // (UN)SIGNED_INT32, FLOAT
        0xb0 => 2,                      // NV12 (1.5 bytes per pixel, rounded up)
        0xc0 | 0xc6 => 1,               // UNORM/SNORM_INT8X1
        0xc1 | 0xc7 | 0xc3 | 0xc9 => 2, // INT8X2, INT16X1
        0xc2 | 0xc8 | 0xc4 | 0xca => 4, // INT8X4, INT16X2
        0xc5 | 0xcb => 8,               // INT16X4
        _ => 16,
    };
    // Packed formats (0xc0..) carry their channel count in the format; the descriptor says 1.
    per_channel.saturating_mul(u64::from(channels.max(1)))
}

/// Bytes of a (layered, 3D or 2D) CUDA array.
pub fn array_bytes(width: u64, height: u64, depth: u64, format: u32, channels: u32) -> u64 {
    width
        .max(1)
        .saturating_mul(height.max(1))
        .saturating_mul(depth.max(1))
        .saturating_mul(element_bytes(format, channels))
}

/// Bytes of a mipmapped array: the sum of its levels, each halving every non-zero extent.
/// Layered arrays (flag bit 0) and cubemaps (bit 2) keep their depth at every level.
pub fn mipmap_bytes(
    width: u64,
    height: u64,
    depth: u64,
    format: u32,
    channels: u32,
    flags: u32,
    levels: u32,
) -> u64 {
    const LAYERED: u32 = 0x01;
    const CUBEMAP: u32 = 0x04;
    let keep_depth = flags & (LAYERED | CUBEMAP) != 0;
    let (mut w, mut h, mut d) = (width.max(1), height, depth);
    let mut total = 0u64;
    for _ in 0..levels.clamp(1, 64) {
        total = total.saturating_add(array_bytes(w, h, d, format, channels));
        w = (w / 2).max(1);
        if h > 0 {
            h = (h / 2).max(1);
        }
        if d > 0 && !keep_depth {
            d = (d / 2).max(1);
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pitch_estimate_rounds_rows_up() {
        assert_eq!(pitch_estimate(1, 1), 512);
        assert_eq!(pitch_estimate(512, 10), 5120);
        assert_eq!(pitch_estimate(513, 2), 2048);
        assert_eq!(pitch_estimate(0, 100), 0);
        assert_eq!(
            pitch_estimate(u64::MAX, 2),
            u64::MAX,
            "saturates, never wraps"
        );
    }

    #[test]
    fn array_sizes() {
        // 1024x1024 float4 = 16 MiB.
        assert_eq!(array_bytes(1024, 1024, 0, 0x20, 4), 16 << 20);
        // 1D array: height 0 counts as 1.
        assert_eq!(array_bytes(100, 0, 0, 0x01, 1), 100);
        // 3D 64^3 half2.
        assert_eq!(array_bytes(64, 64, 64, 0x10, 2), 64 * 64 * 64 * 4);
        // Unknown format: 16 bytes per element.
        assert_eq!(array_bytes(10, 1, 1, 0x77, 1), 160);
        assert_eq!(array_bytes(u64::MAX, 2, 2, 0x20, 4), u64::MAX);
    }

    #[test]
    fn mipmap_sizes() {
        // 4x4 RGBA8: 64 + 16 + 4 = 84 bytes over three levels.
        assert_eq!(mipmap_bytes(4, 4, 0, 0x01, 4, 0, 3), 64 + 16 + 4);
        // Extra levels past 1x1 stay at 1x1.
        assert_eq!(mipmap_bytes(2, 2, 0, 0x01, 1, 0, 4), 4 + 1 + 1 + 1);
        // Layered: depth (layers) kept at every level.
        assert_eq!(mipmap_bytes(4, 4, 3, 0x01, 1, 0x01, 2), 48 + 12);
        // 3D: depth halves too.
        assert_eq!(mipmap_bytes(4, 4, 4, 0x01, 1, 0, 2), 64 + 8);
        // Zero levels counts one.
        assert_eq!(mipmap_bytes(4, 4, 0, 0x01, 1, 0, 0), 16);
    }
}
