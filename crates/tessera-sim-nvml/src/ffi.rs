//! NVML return codes and struct layouts, as in `nvml.h`.

#![allow(non_camel_case_types, dead_code)]

use std::ffi::c_void;

pub type nvmlReturn_t = u32;
pub type nvmlDevice_t = *mut c_void;
pub type nvmlEventSet_t = *mut c_void;

pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_TIMEOUT: nvmlReturn_t = 10;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

pub const NVML_EVENT_TYPE_XID_CRITICAL_ERROR: u64 = 0x8;

#[repr(C)]
pub struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
pub struct nvmlMemory_v2_t {
    pub version: u32,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `NVML_STRUCT_VERSION(Memory, 2)`.
pub const NVML_MEMORY_V2: u32 = (std::mem::size_of::<nvmlMemory_v2_t>() as u32) | (2 << 24);

#[repr(C)]
pub struct nvmlUtilization_t {
    pub gpu: u32,
    pub memory: u32,
}

/// `nvmlProcessInfo_t` (= `nvmlProcessInfo_v2_t`, used by the `_v2` and `_v3` queries).
#[repr(C)]
pub struct nvmlProcessInfo_t {
    pub pid: u32,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlProcessUtilizationSample_t {
    pub pid: u32,
    /// CPU timestamp in microseconds since the epoch.
    pub time_stamp: u64,
    pub sm_util: u32,
    pub mem_util: u32,
    pub enc_util: u32,
    pub dec_util: u32,
}

#[repr(C)]
pub struct nvmlPciInfo_t {
    pub bus_id_legacy: [u8; 16],
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
    pub pci_device_id: u32,
    pub pci_sub_system_id: u32,
    pub bus_id: [u8; 32],
}

#[repr(C)]
pub struct nvmlEventData_t {
    pub device: nvmlDevice_t,
    pub event_type: u64,
    pub event_data: u64,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}
