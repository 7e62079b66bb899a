//! CUDA arrays and mipmapped arrays: charged to the device as width x height x depth x element
//! size (every level for mipmapped arrays), never backed by host memory.

use std::sync::{Arc, Once};

use crate::context::{self, current};
use crate::ffi::*;
use crate::runtime::{Registry, Res, guard, next_handle, put, rt};

/// A CUDA array or mipmapped array.
pub struct ArrayObj {
    pub id: usize,
    pub bytes: u64,
    pub device: u32,
    /// The context that made it (destroyed with it).
    pub ctx: usize,
    pub mipmapped: bool,
}

pub static ARRAYS: Registry<ArrayObj> = Registry::new();

const CUDA_ARRAY3D_LAYERED: u32 = 0x01;
const CUDA_ARRAY3D_CUBEMAP: u32 = 0x04;

/// Bytes of one channel of a `CUarray_format`.
fn format_bytes(format: u32) -> Result<u64, CUresult> {
    Ok(match format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 => 2,
        0x03 | 0x0a | 0x20 => 4,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

/// Checks a descriptor against the documented array shapes.
fn validate(d: &CUDA_ARRAY3D_DESCRIPTOR) -> Res {
    let layered = d.flags & CUDA_ARRAY3D_LAYERED != 0;
    let cubemap = d.flags & CUDA_ARRAY3D_CUBEMAP != 0;
    let shape_ok = d.width > 0
        && (d.height > 0 || d.depth == 0 || (layered && !cubemap))
        && (!cubemap
            || (d.width == d.height
                && d.depth > 0
                && d.depth.is_multiple_of(6)
                && (layered || d.depth == 6)));
    if !shape_ok || ![1, 2, 4].contains(&d.num_channels) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    format_bytes(d.format).map(|_| ())
}

/// Bytes of mip level `level` (0 is the full size). Layers and cube faces do not shrink.
fn level_bytes(d: &CUDA_ARRAY3D_DESCRIPTOR, level: u32) -> Result<u64, CUresult> {
    let shrink = |x: usize| ((x >> level).max(1)) as u64;
    let w = shrink(d.width);
    let h = if d.height == 0 { 1 } else { shrink(d.height) };
    let layers = d.flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
    let depth = match d.depth {
        0 => 1,
        n if layers => n as u64,
        n => shrink(n),
    };
    [
        w,
        h,
        depth,
        u64::from(d.num_channels),
        format_bytes(d.format)?,
    ]
    .into_iter()
    .try_fold(1u64, u64::checked_mul)
    .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// Mip levels actually made: clamped to [1, 1 + floor(log2(largest extent))] as documented.
fn clamp_levels(d: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> u32 {
    let layers = d.flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
    let depth = if layers { 0 } else { d.depth };
    let largest = d.width.max(d.height).max(depth).max(1);
    levels.clamp(1, 1 + largest.ilog2())
}

fn create(h: *mut Handle, bytes: u64, mipmapped: bool) -> Res {
    let c = current()?;
    static CLEANUP: Once = Once::new();
    context::on_destroy(&CLEANUP, destroy_all_of_ctx);
    if h.is_null() {
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
        ctx: c.id,
        mipmapped,
    });
    ARRAYS.insert(a.id, a.clone());
    // SAFETY: non-null out-pointer from the caller.
    unsafe { put(h, a.id as Handle) }
}

/// `cuArrayCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    h: *mut Handle,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    guard(|| {
        if h.is_null() || desc.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null descriptor from the caller.
        let d = unsafe { &*desc };
        let d3 = CUDA_ARRAY3D_DESCRIPTOR {
            width: d.width,
            height: d.height,
            depth: 0,
            format: d.format,
            num_channels: d.num_channels,
            flags: 0,
        };
        validate(&d3)?;
        create(h, level_bytes(&d3, 0)?, false)
    })
}

/// `cuArray3DCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    h: *mut Handle,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    guard(|| {
        if h.is_null() || desc.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null descriptor from the caller.
        let d = unsafe { &*desc };
        validate(d)?;
        create(h, level_bytes(d, 0)?, false)
    })
}

/// `cuMipmappedArrayCreate`: the sum of all levels.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    h: *mut Handle,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> CUresult {
    guard(|| {
        if h.is_null() || desc.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null descriptor from the caller.
        let d = unsafe { &*desc };
        validate(d)?;
        let mut bytes = 0u64;
        for l in 0..clamp_levels(d, levels) {
            bytes = bytes
                .checked_add(level_bytes(d, l)?)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        }
        create(h, bytes, true)
    })
}

fn destroy(h: Handle, mipmapped: bool) -> Res {
    let rt = rt()?;
    // Check the kind before removing so a wrong-kind call loses nothing.
    ARRAYS
        .get(h as usize)
        .filter(|a| a.mipmapped == mipmapped)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let a = ARRAYS.remove(h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    rt.ledger.free(a.device, a.bytes);
    Ok(())
}

/// Destroys every array of a context being destroyed.
pub fn destroy_all_of_ctx(ctx: usize) {
    for a in ARRAYS.values().into_iter().filter(|a| a.ctx == ctx) {
        let _ = destroy(a.id as Handle, a.mipmapped);
    }
}

/// `cuArrayDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuArrayDestroy(h: Handle) -> CUresult {
    guard(|| destroy(h, false))
}

/// `cuMipmappedArrayDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMipmappedArrayDestroy(h: Handle) -> CUresult {
    guard(|| destroy(h, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(width: usize, height: usize, depth: usize, flags: u32) -> CUDA_ARRAY3D_DESCRIPTOR {
        CUDA_ARRAY3D_DESCRIPTOR {
            width,
            height,
            depth,
            format: 0x20,
            num_channels: 1,
            flags,
        }
    }

    #[test]
    fn shapes_follow_the_documented_rules() {
        assert!(validate(&desc(16, 0, 0, 0)).is_ok(), "1D");
        assert!(validate(&desc(16, 8, 0, 0)).is_ok(), "2D");
        assert!(validate(&desc(16, 8, 4, 0)).is_ok(), "3D");
        assert!(
            validate(&desc(16, 0, 4, CUDA_ARRAY3D_LAYERED)).is_ok(),
            "1D layered"
        );
        assert!(
            validate(&desc(16, 0, 4, 0)).is_err(),
            "depth without height"
        );
        assert!(
            validate(&desc(16, 16, 6, CUDA_ARRAY3D_CUBEMAP)).is_ok(),
            "cubemap"
        );
        assert!(
            validate(&desc(16, 8, 6, CUDA_ARRAY3D_CUBEMAP)).is_err(),
            "non-square cubemap"
        );
        assert!(
            validate(&desc(16, 16, 12, CUDA_ARRAY3D_CUBEMAP)).is_err(),
            "12 faces, not layered"
        );
        assert!(
            validate(&desc(
                16,
                16,
                12,
                CUDA_ARRAY3D_CUBEMAP | CUDA_ARRAY3D_LAYERED
            ))
            .is_ok()
        );
        let mut three = desc(16, 16, 0, 0);
        three.num_channels = 3;
        assert!(validate(&three).is_err(), "3 channels");
    }

    #[test]
    fn mip_levels_shrink_extents_not_layers() {
        let d = desc(256, 256, 0, 0);
        assert_eq!(level_bytes(&d, 0), Ok(256 * 256 * 4));
        assert_eq!(level_bytes(&d, 8), Ok(4));
        assert_eq!(clamp_levels(&d, 0), 1);
        assert_eq!(clamp_levels(&d, 100), 9);
        let layered = desc(64, 64, 10, CUDA_ARRAY3D_LAYERED);
        assert_eq!(level_bytes(&layered, 1), Ok(32 * 32 * 10 * 4));
        assert_eq!(clamp_levels(&layered, 100), 7);
        let cube = desc(32, 32, 6, CUDA_ARRAY3D_CUBEMAP);
        assert_eq!(level_bytes(&cube, 5), Ok(6 * 4));
        let huge = desc(usize::MAX, usize::MAX, 0, 0);
        assert_eq!(level_bytes(&huge, 0), Err(CUDA_ERROR_INVALID_VALUE));
    }
}
