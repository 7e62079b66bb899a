//! Device queries and attributes (an H100-like compute capability 9.0 part).

use std::ffi::{CStr, c_char};

use crate::ffi::*;
use crate::runtime::{gpu, guard, ordinal, put, rt};

/// Copies `s` into a C buffer of `len` bytes, truncating and always NUL-terminating.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes of writes.
unsafe fn copy_c_string(s: &str, buf: *mut c_char, len: i32) -> Result<(), CUresult> {
    if buf.is_null() || len <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let n = s.len().min(len as usize - 1);
    // SAFETY: buf is valid for len bytes (caller); we write n + 1 <= len bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
    Ok(())
}

/// `cuDeviceGet`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: i32) -> CUresult {
    guard(|| {
        gpu(ordinal)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(dev, ordinal) }
    })
}

/// `cuDeviceGetCount`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut i32) -> CUresult {
    guard(|| {
        let n = rt()?.visible.len() as i32;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(count, n) }
    })
}

/// `cuDeviceGetName`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) -> CUresult {
    guard(|| {
        let g = gpu(dev)?;
        // SAFETY: caller passes a buffer of `len` bytes.
        unsafe { copy_c_string(&g.name, name, len) }
    })
}

/// `cuDeviceGetUuid` and `cuDeviceGetUuid_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    guard(|| {
        let g = gpu(dev)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe {
            put(
                uuid,
                CUuuid {
                    bytes: g.uuid_bytes,
                },
            )
        }
    })
}

/// `cuDeviceGetUuid_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    // SAFETY: same contract as cuDeviceGetUuid.
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

/// `cuDeviceTotalMem_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    guard(|| {
        let g = gpu(dev)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(bytes, g.total_bytes as usize) }
    })
}

/// Attribute values of the simulated part (unknown attributes answer 0, as for absent features).
fn attribute(attr: i32, dev: CUdevice) -> Result<i32, CUresult> {
    let g = gpu(dev)?;
    Ok(match attr {
        1 => 1024,
        2 | 3 => 1024,
        4 => 64,
        5 => i32::MAX,
        6 | 7 => 65535,
        8 => 49152,
        9 => 65536,
        10 => 32,
        11 => i32::MAX,
        12 => 65536,
        13 => 1_980_000,
        14 => 512,
        15 => 1,
        16 => g.sms as i32,
        17 | 18 => 0,
        19 => 1,
        20 => 0,
        30 => 512,
        31 => 1,
        32 => 1,
        33 => g.pci_bus as i32,
        34 => 0,
        35 => 0,
        36 => 2_619_000,
        37 => 5120,
        38 => 50 * 1024 * 1024,
        39 => 2048,
        40 => 3,
        41 => 1,
        50 => 0,
        75 => 9,
        76 => 0,
        78 => 1,
        79 | 80 => 1,
        81 => 233_472,
        82 => 65536,
        83 => 1,
        84 => 0,
        85 => dev,
        86 => 2,
        87 => 0,
        88 => 1,
        89 => 1,
        90 => 1,
        91 => 0,
        92 => 1,
        95 | 96 => 1,
        97 => 232_448,
        98 => 0,
        99 => 1,
        100 | 101 => 0,
        102 => 1,
        103 => 1,
        104 | 105 => 0,
        106 => 32,
        107 => 0,
        108 => 32 * 1024 * 1024,
        109 => 128 * 1024 * 1024,
        110 => 0,
        111 => 1024,
        112 | 113 => 1,
        114 => 0,
        115 => 1,
        116 => 0,
        117 | 118 => 0,
        119 => 1,
        120 => 1,
        121 => 0,
        a if (0..=200).contains(&a) => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

/// `cuDeviceGetAttribute`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(pi: *mut i32, attr: i32, dev: CUdevice) -> CUresult {
    guard(|| {
        let v = attribute(attr, dev)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(pi, v) }
    })
}

/// `cuDeviceComputeCapability` (deprecated but still exported).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceComputeCapability(
    major: *mut i32,
    minor: *mut i32,
    dev: CUdevice,
) -> CUresult {
    guard(|| {
        gpu(dev)?;
        // SAFETY: caller's out-pointers, null-checked by put.
        unsafe {
            put(major, 9)?;
            put(minor, 0)
        }
    })
}

/// `cuDeviceGetPCIBusId`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(
    buf: *mut c_char,
    len: i32,
    dev: CUdevice,
) -> CUresult {
    guard(|| {
        let g = gpu(dev)?;
        // SAFETY: caller passes a buffer of `len` bytes.
        unsafe { copy_c_string(&g.pci_bus_id_cuda(), buf, len) }
    })
}

/// `cuDeviceGetByPCIBusId` (accepts the CUDA or NVML spelling).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetByPCIBusId(dev: *mut CUdevice, id: *const c_char) -> CUresult {
    guard(|| {
        if id.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null C string from the caller.
        let s = unsafe { CStr::from_ptr(id) }
            .to_string_lossy()
            .to_ascii_uppercase();
        let g = rt()?
            .spec
            .gpus
            .iter()
            .find(|g| g.pci_bus_id_cuda() == s || g.pci_bus_id_nvml() == s)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // A GPU outside CUDA_VISIBLE_DEVICES has no ordinal here.
        let o = ordinal(g.index).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(dev, o) }
    })
}

/// `cuDeviceCanAccessPeer`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can: *mut i32,
    dev: CUdevice,
    peer: CUdevice,
) -> CUresult {
    guard(|| {
        gpu(dev)?;
        gpu(peer)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(can, i32::from(dev != peer)) }
    })
}

/// `cuDeviceGetLuid`: Windows only.
#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetLuid(_luid: *mut c_char, _mask: *mut u32, dev: CUdevice) -> CUresult {
    guard(|| {
        gpu(dev)?;
        Err(CUDA_ERROR_NOT_SUPPORTED)
    })
}
