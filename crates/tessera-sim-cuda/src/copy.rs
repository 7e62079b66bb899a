//! Copies and memsets: 1D (`cuMemcpy*`, `cuMemsetD*`) and 2D (`cuMemcpy2D*`, `cuMemsetD2D*`).
//!
//! Kernels never touch data, so stream-ordered ("Async") copies and memsets are done at once,
//! after the stream handle is checked. Every device-side range is checked first
//! ([`crate::memory::check_device`]), so a bad pointer is an error code, never a fault.

use std::ffi::c_void;

use crate::context::current;
use crate::ffi::*;
use crate::memory::{check_any, check_device, copy};
use crate::runtime::{Res, guard};
use crate::stream::resolve;

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
    if p == 0 {
        Err(CUDA_ERROR_INVALID_VALUE)
    } else {
        Ok(())
    }
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
        check_device(d, n, true)
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
        check_device(s, n, false)
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
        check_device(d, n, true)?;
        check_device(s, n, false)
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
        check_any(d, n, true)?;
        check_any(s, n, false)
    }
);

/// `cuMemcpyPeer`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyPeer(
    dst: CUdeviceptr,
    _dc: Handle,
    src: CUdeviceptr,
    _sc: Handle,
    n: usize,
) -> CUresult {
    cuMemcpyDtoD_v2(dst, src, n)
}

/// Resolves the stream of an async call, or checks for a context in a synchronous one.
fn stream_or_ctx(stream: Option<(Handle, bool)>) -> Res {
    match stream {
        Some((h, pt)) => resolve(h, pt).map(|_| ()),
        None => current().map(|_| ()),
    }
}

/// Fills `rows` rows of `n` elements of `width` bytes, `pitch` bytes apart.
fn memset_rows(dst: u64, pitch: usize, value: u32, width: usize, n: usize, rows: usize) -> Res {
    // The driver requires D16/D32 destinations (and pitches) aligned to the element size.
    if !(dst as usize).is_multiple_of(width) || (rows > 1 && !pitch.is_multiple_of(width)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let row_bytes = n.checked_mul(width).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if n == 0 || rows == 0 {
        return check_device(dst, 0, true);
    }
    if rows > 1 && pitch < row_bytes {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let span = (rows - 1)
        .checked_mul(pitch)
        .and_then(|s| s.checked_add(row_bytes))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    check_device(dst, span, true)?;
    for r in 0..rows {
        let row = dst as usize + r * pitch;
        // SAFETY: every row lies inside [dst, dst+span), a writable device range (checked above),
        // and `row` is aligned to `width` (dst and pitch are).
        unsafe {
            match width {
                1 => std::ptr::write_bytes(row as *mut u8, value as u8, n),
                2 => std::slice::from_raw_parts_mut(row as *mut u16, n).fill(value as u16),
                _ => std::slice::from_raw_parts_mut(row as *mut u32, n).fill(value),
            }
        }
    }
    Ok(())
}

fn memset(
    dst: u64,
    value: u32,
    width: usize,
    n: usize,
    stream: Option<(Handle, bool)>,
) -> CUresult {
    guard(|| {
        stream_or_ctx(stream)?;
        memset_rows(dst, 0, value, width, n, 1)
    })
}

fn memset_2d(
    dst: u64,
    pitch: usize,
    value: u32,
    width: usize,
    n: usize,
    rows: usize,
    stream: Option<(Handle, bool)>,
) -> CUresult {
    guard(|| {
        stream_or_ctx(stream)?;
        memset_rows(dst, pitch, value, width, n, rows)
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

memset_fns!(
    1,
    u8,
    cuMemsetD8_v2,
    cuMemsetD8_v2_ptds,
    cuMemsetD8Async,
    cuMemsetD8Async_ptsz
);
memset_fns!(
    2,
    u16,
    cuMemsetD16_v2,
    cuMemsetD16_v2_ptds,
    cuMemsetD16Async,
    cuMemsetD16Async_ptsz
);
memset_fns!(
    4,
    u32,
    cuMemsetD32_v2,
    cuMemsetD32_v2_ptds,
    cuMemsetD32Async,
    cuMemsetD32Async_ptsz
);

macro_rules! memset_2d_fns {
    ($w:expr, $t:ty, $s:ident, $s_pt:ident, $a:ident, $a_pt:ident) => {
        #[doc = concat!("`", stringify!($s), "`: `width` elements in each of `height` rows, `pitch` bytes apart.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $s(dst: CUdeviceptr, pitch: usize, v: $t, width: usize, height: usize) -> CUresult {
            memset_2d(dst, pitch, v as u32, $w, width, height, None)
        }
        #[doc = concat!("`", stringify!($s_pt), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $s_pt(dst: CUdeviceptr, pitch: usize, v: $t, width: usize, height: usize) -> CUresult {
            memset_2d(dst, pitch, v as u32, $w, width, height, None)
        }
        #[doc = concat!("`", stringify!($a), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $a(dst: CUdeviceptr, pitch: usize, v: $t, width: usize, height: usize, h: Handle) -> CUresult {
            memset_2d(dst, pitch, v as u32, $w, width, height, Some((h, false)))
        }
        #[doc = concat!("`", stringify!($a_pt), "`.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $a_pt(dst: CUdeviceptr, pitch: usize, v: $t, width: usize, height: usize, h: Handle) -> CUresult {
            memset_2d(dst, pitch, v as u32, $w, width, height, Some((h, true)))
        }
    };
}

memset_2d_fns!(
    1,
    u8,
    cuMemsetD2D8_v2,
    cuMemsetD2D8_v2_ptds,
    cuMemsetD2D8Async,
    cuMemsetD2D8Async_ptsz
);
memset_2d_fns!(
    2,
    u16,
    cuMemsetD2D16_v2,
    cuMemsetD2D16_v2_ptds,
    cuMemsetD2D16Async,
    cuMemsetD2D16Async_ptsz
);
memset_2d_fns!(
    4,
    u32,
    cuMemsetD2D32_v2,
    cuMemsetD2D32_v2_ptds,
    cuMemsetD2D32Async,
    cuMemsetD2D32Async_ptsz
);

// ---- 2D copies ----

const CU_MEMORYTYPE_HOST: u32 = 1;
const CU_MEMORYTYPE_DEVICE: u32 = 2;
const CU_MEMORYTYPE_ARRAY: u32 = 3;
const CU_MEMORYTYPE_UNIFIED: u32 = 4;

/// One side of a 2D copy: the address of its first byte and how to check it.
fn side(
    kind: u32,
    host: usize,
    device: u64,
    x: usize,
    y: usize,
    pitch: usize,
) -> Result<(u64, u32), CUresult> {
    let base = match kind {
        CU_MEMORYTYPE_HOST => host as u64,
        CU_MEMORYTYPE_DEVICE | CU_MEMORYTYPE_UNIFIED => device,
        // Arrays hold no bytes in the simulator.
        CU_MEMORYTYPE_ARRAY => return Err(CUDA_ERROR_NOT_SUPPORTED),
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    if base == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let offset = y
        .checked_mul(pitch)
        .and_then(|o| o.checked_add(x))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let start = base
        .checked_add(offset as u64)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    Ok((start, kind))
}

fn check_side(start: u64, kind: u32, span: usize, write: bool) -> Res {
    match kind {
        CU_MEMORYTYPE_DEVICE => check_device(start, span, write),
        CU_MEMORYTYPE_UNIFIED => check_any(start, span, write),
        // Host memory is the caller's to vouch for, as with the driver.
        _ => Ok(()),
    }
}

/// Validates and performs a `CUDA_MEMCPY2D` copy.
///
/// # Safety
/// `p` must be null or point to a `CUDA_MEMCPY2D`; host pointers in it must be valid for the
/// rows the copy touches.
unsafe fn memcpy_2d(p: *const CUDA_MEMCPY2D, stream: Option<(Handle, bool)>) -> CUresult {
    guard(|| {
        stream_or_ctx(stream)?;
        if p.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null descriptor from the caller.
        let c = unsafe { &*p };
        let (w, rows) = (c.width_in_bytes, c.height);
        let (src, sk) = side(
            c.src_memory_type,
            c.src_host as usize,
            c.src_device,
            c.src_x_in_bytes,
            c.src_y,
            c.src_pitch,
        )?;
        let (dst, dk) = side(
            c.dst_memory_type,
            c.dst_host as usize,
            c.dst_device,
            c.dst_x_in_bytes,
            c.dst_y,
            c.dst_pitch,
        )?;
        // Rows may not overlap: a pitch must hold the row and its x offset.
        let pitch_ok =
            |x: usize, pitch: usize| rows <= 1 || x.checked_add(w).is_some_and(|e| e <= pitch);
        if !pitch_ok(c.src_x_in_bytes, c.src_pitch) || !pitch_ok(c.dst_x_in_bytes, c.dst_pitch) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if w == 0 || rows == 0 {
            return Ok(());
        }
        let span = |pitch: usize| (rows - 1).checked_mul(pitch).and_then(|s| s.checked_add(w));
        let (s_span, d_span) = (span(c.src_pitch), span(c.dst_pitch));
        let (Some(s_span), Some(d_span)) = (s_span, d_span) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        check_side(src, sk, s_span, false)?;
        check_side(dst, dk, d_span, true)?;
        for r in 0..rows {
            copy(
                dst + (r * c.dst_pitch) as u64,
                src + (r * c.src_pitch) as u64,
                w,
            );
        }
        Ok(())
    })
}

macro_rules! memcpy_2d_fns {
    (async $async_:ident, $ptds:expr) => {
        #[doc = concat!("`", stringify!($async_), "`: copied at once.")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $async_(p: *const CUDA_MEMCPY2D, h: Handle) -> CUresult {
            // SAFETY: the caller passes a CUDA_MEMCPY2D, as the API requires.
            unsafe { memcpy_2d(p, Some((h, $ptds))) }
        }
    };
    ($sync:ident) => {
        #[doc = concat!("`", stringify!($sync), "` (host, device and unified linear memory; arrays answer 801).")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $sync(p: *const CUDA_MEMCPY2D) -> CUresult {
            // SAFETY: the caller passes a CUDA_MEMCPY2D, as the API requires.
            unsafe { memcpy_2d(p, None) }
        }
    };
}

memcpy_2d_fns!(cuMemcpy2D_v2);
memcpy_2d_fns!(cuMemcpy2D_v2_ptds);
memcpy_2d_fns!(cuMemcpy2DUnaligned_v2);
memcpy_2d_fns!(cuMemcpy2DUnaligned_v2_ptds);
memcpy_2d_fns!(async cuMemcpy2DAsync_v2, false);
memcpy_2d_fns!(async cuMemcpy2DAsync_v2_ptsz, true);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_address_x_and_y() {
        assert_eq!(
            side(CU_MEMORYTYPE_HOST, 0x1000, 0, 3, 2, 100),
            Ok((0x1000 + 203, CU_MEMORYTYPE_HOST))
        );
        assert_eq!(
            side(CU_MEMORYTYPE_DEVICE, 0, 0x2000, 0, 1, 512),
            Ok((0x2200, CU_MEMORYTYPE_DEVICE))
        );
        assert_eq!(
            side(CU_MEMORYTYPE_ARRAY, 0, 0, 0, 0, 0),
            Err(CUDA_ERROR_NOT_SUPPORTED)
        );
        assert_eq!(
            side(CU_MEMORYTYPE_DEVICE, 0x1000, 0, 0, 0, 0),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(side(9, 1, 1, 0, 0, 0), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(
            side(CU_MEMORYTYPE_DEVICE, 0, 1, 0, usize::MAX, 2),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
    }
}
