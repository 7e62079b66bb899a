//! NVML's MIG API: handles, constants and struct layouts (`nvml.h`, 64-bit Linux; the same
//! layouts as NVIDIA/go-nvml's `nvml.h` and the `nvml-wrapper-sys` bindings).

use std::ffi::{c_char, c_uint, c_void};

use crate::nvml::{nvmlDevice_t, nvmlReturn_t};

/// `nvmlGpuInstance_t`.
pub type nvmlGpuInstance_t = *mut c_void;
/// `nvmlComputeInstance_t`.
pub type nvmlComputeInstance_t = *mut c_void;

/// The caller lacks the privilege the call needs.
pub const NVML_ERROR_NO_PERMISSION: nvmlReturn_t = 4;
/// The object is in use (contexts on a GPU whose MIG mode changes, compute instances in a GPU
/// instance being destroyed, processes on a compute instance being destroyed).
pub const NVML_ERROR_IN_USE: nvmlReturn_t = 19;
/// No free slices or instances left for the profile.
pub const NVML_ERROR_INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;

pub const NVML_DEVICE_MIG_DISABLE: c_uint = 0;
pub const NVML_DEVICE_MIG_ENABLE: c_uint = 1;

pub const NVML_GPU_INSTANCE_PROFILE_1_SLICE: c_uint = 0;
pub const NVML_GPU_INSTANCE_PROFILE_2_SLICE: c_uint = 1;
pub const NVML_GPU_INSTANCE_PROFILE_3_SLICE: c_uint = 2;
pub const NVML_GPU_INSTANCE_PROFILE_4_SLICE: c_uint = 3;
pub const NVML_GPU_INSTANCE_PROFILE_7_SLICE: c_uint = 4;
pub const NVML_GPU_INSTANCE_PROFILE_8_SLICE: c_uint = 5;
pub const NVML_GPU_INSTANCE_PROFILE_6_SLICE: c_uint = 6;
/// One slice with media extensions (`1g.10gb+me`).
pub const NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: c_uint = 7;
pub const NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: c_uint = 8;
/// One slice with twice the memory (`1g.20gb` on an H100 80GB, `1g.35gb` on an H200).
pub const NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: c_uint = 9;

pub const NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: c_uint = 0;
pub const NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: c_uint = 1;
pub const NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: c_uint = 2;
pub const NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE: c_uint = 3;
pub const NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: c_uint = 4;
pub const NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED: c_uint = 0;

/// `nvmlGpuInstancePlacement_t` (memory slices).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlGpuInstancePlacement_t {
    pub start: c_uint,
    pub size: c_uint,
}
layout!(nvmlGpuInstancePlacement_t, size 8, align 4, start @ 0, size @ 4);

/// `nvmlComputeInstancePlacement_t` (compute slices inside the GPU instance).
pub type nvmlComputeInstancePlacement_t = nvmlGpuInstancePlacement_t;

/// `nvmlGpuInstanceProfileInfo_t` (v1).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlGpuInstanceProfileInfo_t {
    pub id: c_uint,
    pub is_p2p_supported: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub copy_engine_count: c_uint,
    pub decoder_count: c_uint,
    pub encoder_count: c_uint,
    pub jpeg_count: c_uint,
    pub ofa_count: c_uint,
    pub memory_size_mb: u64,
}
layout!(nvmlGpuInstanceProfileInfo_t, size 48, align 8, id @ 0, slice_count @ 8,
    memory_size_mb @ 40);

/// `nvmlGpuInstanceProfileInfo_v2_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlGpuInstanceProfileInfo_v2_t {
    /// [`NVML_GPU_INSTANCE_PROFILE_INFO_V2`].
    pub version: c_uint,
    pub id: c_uint,
    pub is_p2p_supported: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub copy_engine_count: c_uint,
    pub decoder_count: c_uint,
    pub encoder_count: c_uint,
    pub jpeg_count: c_uint,
    pub ofa_count: c_uint,
    pub memory_size_mb: u64,
    /// `NVML_DEVICE_NAME_V2_BUFFER_SIZE` (96) bytes, NUL-terminated.
    pub name: [c_char; 96],
}
layout!(nvmlGpuInstanceProfileInfo_v2_t, size 152, align 8, version @ 0, id @ 4,
    memory_size_mb @ 48, name @ 56);

/// `nvmlGpuInstanceProfileInfo_v3_t` (no `isP2pSupported`; `capabilities` at the end).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlGpuInstanceProfileInfo_v3_t {
    /// [`NVML_GPU_INSTANCE_PROFILE_INFO_V3`].
    pub version: c_uint,
    pub id: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub copy_engine_count: c_uint,
    pub decoder_count: c_uint,
    pub encoder_count: c_uint,
    pub jpeg_count: c_uint,
    pub ofa_count: c_uint,
    pub memory_size_mb: u64,
    pub name: [c_char; 96],
    pub capabilities: c_uint,
}
layout!(nvmlGpuInstanceProfileInfo_v3_t, size 152, align 8, version @ 0, id @ 4,
    memory_size_mb @ 40, name @ 48, capabilities @ 144);

/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)`.
pub const NVML_GPU_INSTANCE_PROFILE_INFO_V2: c_uint =
    (size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as c_uint) | (2 << 24);
/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 3)`.
pub const NVML_GPU_INSTANCE_PROFILE_INFO_V3: c_uint =
    (size_of::<nvmlGpuInstanceProfileInfo_v3_t>() as c_uint) | (3 << 24);

/// `nvmlGpuInstanceInfo_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlGpuInstanceInfo_t {
    /// The parent device.
    pub device: nvmlDevice_t,
    pub id: c_uint,
    pub profile_id: c_uint,
    pub placement: nvmlGpuInstancePlacement_t,
}
layout!(nvmlGpuInstanceInfo_t, size 24, align 8, device @ 0, id @ 8, profile_id @ 12,
    placement @ 16);

/// `nvmlComputeInstanceProfileInfo_t` (v1).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlComputeInstanceProfileInfo_t {
    pub id: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub shared_copy_engine_count: c_uint,
    pub shared_decoder_count: c_uint,
    pub shared_encoder_count: c_uint,
    pub shared_jpeg_count: c_uint,
    pub shared_ofa_count: c_uint,
}
layout!(nvmlComputeInstanceProfileInfo_t, size 36, align 4, id @ 0, multiprocessor_count @ 12);

/// `nvmlComputeInstanceProfileInfo_v2_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nvmlComputeInstanceProfileInfo_v2_t {
    /// [`NVML_COMPUTE_INSTANCE_PROFILE_INFO_V2`].
    pub version: c_uint,
    pub id: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub shared_copy_engine_count: c_uint,
    pub shared_decoder_count: c_uint,
    pub shared_encoder_count: c_uint,
    pub shared_jpeg_count: c_uint,
    pub shared_ofa_count: c_uint,
    pub name: [c_char; 96],
}
layout!(nvmlComputeInstanceProfileInfo_v2_t, size 136, align 4, version @ 0, id @ 4,
    name @ 40);

/// `NVML_STRUCT_VERSION(ComputeInstanceProfileInfo, 2)`.
pub const NVML_COMPUTE_INSTANCE_PROFILE_INFO_V2: c_uint =
    (size_of::<nvmlComputeInstanceProfileInfo_v2_t>() as c_uint) | (2 << 24);

/// `nvmlComputeInstanceInfo_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nvmlComputeInstanceInfo_t {
    pub device: nvmlDevice_t,
    pub gpu_instance: nvmlGpuInstance_t,
    pub id: c_uint,
    pub profile_id: c_uint,
    pub placement: nvmlComputeInstancePlacement_t,
}
layout!(nvmlComputeInstanceInfo_t, size 32, align 8, device @ 0, gpu_instance @ 8, id @ 16,
    profile_id @ 20, placement @ 24);

/// `nvmlDeviceAttributes_t` (`nvmlDeviceGetAttributes_v2`; meaningful on MIG devices).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nvmlDeviceAttributes_t {
    pub multiprocessor_count: c_uint,
    pub shared_copy_engine_count: c_uint,
    pub shared_decoder_count: c_uint,
    pub shared_encoder_count: c_uint,
    pub shared_jpeg_count: c_uint,
    pub shared_ofa_count: c_uint,
    pub gpu_instance_slice_count: c_uint,
    pub compute_instance_slice_count: c_uint,
    pub memory_size_mb: u64,
}
layout!(nvmlDeviceAttributes_t, size 40, align 8, multiprocessor_count @ 0,
    gpu_instance_slice_count @ 24, memory_size_mb @ 32);
