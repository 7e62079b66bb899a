//! NVML: handles, `nvmlReturn_t` codes, struct layouts (checked against `nvml.h`, 64-bit
//! Linux) and the function-pointer types Tessera resolves.

use std::ffi::{c_char, c_uint, c_void};

/// `nvmlReturn_t`: a C enum without negative values, so `unsigned int` in the C ABI.
pub type nvmlReturn_t = u32;
/// `nvmlDevice_t`.
pub type nvmlDevice_t = *mut c_void;
/// `nvmlEventSet_t`.
pub type nvmlEventSet_t = *mut c_void;

pub const NVML_SUCCESS: nvmlReturn_t = 0;
/// `nvmlInit` has not been called.
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
/// A null pointer or an out-of-range argument.
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
/// The device cannot do this.
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
/// No such device or object.
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
/// The caller's buffer is too small; the count needed was written back.
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
/// Nothing happened within the time asked for (event waits).
pub const NVML_ERROR_TIMEOUT: nvmlReturn_t = 10;
/// A versioned struct carries a version this library does not know.
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

/// `nvmlEventTypeXidCriticalError`.
pub const NVML_EVENT_TYPE_XID_CRITICAL_ERROR: u64 = 0x8;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlMemory_t {
    /// Bytes.
    pub total: u64,
    /// Bytes.
    pub free: u64,
    /// Bytes.
    pub used: u64,
}
layout!(nvmlMemory_t, size 24, align 8, total @ 0, free @ 8, used @ 16);

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlMemory_v2_t {
    /// [`NVML_MEMORY_V2`].
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}
layout!(nvmlMemory_v2_t, size 40, align 8, version @ 0, total @ 8, reserved @ 16, free @ 24,
    used @ 32);

/// `nvmlMemory_v2` (`NVML_STRUCT_VERSION(Memory, 2)`): the struct size with 2 in the top byte.
pub const NVML_MEMORY_V2: c_uint = (size_of::<nvmlMemory_v2_t>() as c_uint) | (2 << 24);

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlUtilization_t {
    pub gpu: c_uint,
    pub memory: c_uint,
}
layout!(nvmlUtilization_t, size 8, align 4, gpu @ 0, memory @ 4);

/// `nvmlProcessInfo_t` (= `nvmlProcessInfo_v2_t`, filled by the `_v2` and `_v3` queries).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlProcessInfo_t {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}
layout!(nvmlProcessInfo_t, size 24, align 8, pid @ 0, used_gpu_memory @ 8,
    gpu_instance_id @ 16, compute_instance_id @ 20);

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlProcessUtilizationSample_t {
    pub pid: c_uint,
    /// CPU timestamp in microseconds since the epoch.
    pub time_stamp: u64,
    pub sm_util: c_uint,
    pub mem_util: c_uint,
    pub enc_util: c_uint,
    pub dec_util: c_uint,
}
layout!(nvmlProcessUtilizationSample_t, size 32, align 8, pid @ 0, time_stamp @ 8,
    sm_util @ 16, mem_util @ 20, enc_util @ 24, dec_util @ 28);

/// `nvmlPciInfo_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlPciInfo_t {
    pub bus_id_legacy: [u8; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pci_device_id: c_uint,
    pub pci_sub_system_id: c_uint,
    pub bus_id: [u8; 32],
}
layout!(nvmlPciInfo_t, size 68, align 4, bus_id_legacy @ 0, domain @ 16, bus @ 20,
    device @ 24, pci_device_id @ 28, pci_sub_system_id @ 32, bus_id @ 36);

/// `nvmlEventData_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlEventData_t {
    pub device: nvmlDevice_t,
    pub event_type: u64,
    pub event_data: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}
layout!(nvmlEventData_t, size 32, align 8, device @ 0, event_type @ 8, event_data @ 16,
    gpu_instance_id @ 24, compute_instance_id @ 28);

// ---- function-pointer types --------------------------------------------------------------

pub type nvmlInit_v2_t = unsafe extern "C" fn() -> nvmlReturn_t;
pub type nvmlSystemGetDriverVersion_t = unsafe extern "C" fn(*mut c_char, c_uint) -> nvmlReturn_t;
pub type nvmlDeviceGetCount_v2_t = unsafe extern "C" fn(*mut c_uint) -> nvmlReturn_t;
pub type nvmlDeviceGetHandleByIndex_v2_t =
    unsafe extern "C" fn(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
pub type nvmlDeviceGetHandleByUUID_t =
    unsafe extern "C" fn(*const c_char, *mut nvmlDevice_t) -> nvmlReturn_t;
/// `nvmlDeviceGetName` and `nvmlDeviceGetUUID` (a string into a caller's buffer).
pub type nvmlDeviceGetString_t =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;
pub type nvmlDeviceGetMemoryInfo_t =
    unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;
pub type nvmlDeviceGetMemoryInfo_v2_t =
    unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_v2_t) -> nvmlReturn_t;
