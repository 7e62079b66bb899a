//! NVML's MIG calls that nvml-wrapper 0.13 lacks (GPU-instance profiles and placements, GPU
//! and compute instance creation and destruction), as a small safe API over the raw symbols
//! nvml-wrapper has already loaded (`Nvml::lib()`). Mode changes and MIG device handles go
//! through nvml-wrapper's own safe calls.
//!
//! Signatures and semantics are NVML's (`nvml.h`, "Multi Instance GPU Management"): profile
//! ids come from `nvmlDeviceGetGpuInstanceProfileInfo` (the `profile` argument is the
//! `NVML_GPU_INSTANCE_PROFILE_*` index, the returned `id` what other calls take); placements
//! from `nvmlDeviceGetGpuInstancePossiblePlacements_v2` (count first with a NULL array); a GPU
//! instance is created at an exact placement with `nvmlDeviceCreateGpuInstanceWithPlacement`
//! and filled by one compute instance of the profile with the same slice count
//! (`nvmlGpuInstanceCreateComputeInstance`); destruction takes the compute instances first
//! (`NVML_ERROR_IN_USE` otherwise). A symbol the loaded library lacks is an error here, never
//! a panic (the generated bindings' wrappers would panic).

use std::ffi::CStr;
use std::path::Path;
use std::ptr;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::{NvmlError, nvml_try};
use nvml_wrapper_sys::bindings as sys;

/// The raw symbol `$name` of the loaded library, or [`MigNvmlError::Missing`] naming it:
/// nvml-wrapper's generated bindings keep a `Result` per symbol, and calling one that is
/// missing through their wrappers would panic.
macro_rules! symbol {
    ($lib:expr, $name:ident) => {
        *$lib
            .$name
            .as_ref()
            .map_err(|_| MigNvmlError::Missing(stringify!($name)))?
    };
}

mod instances;

/// Errors of the MIG calls.
#[derive(Debug, thiserror::Error)]
pub enum MigNvmlError {
    /// An NVML call failed.
    #[error("{call}: {source}")]
    Nvml {
        /// The call.
        call: &'static str,
        /// NVML's error.
        source: NvmlError,
    },
    /// The loaded library does not export the call.
    #[error("the NVML library lacks {0}")]
    Missing(&'static str),
    /// No MIG device of the GPU instance was found after creating it.
    #[error("GPU instance {0} has no MIG device")]
    NoMigDevice(u32),
}

fn call(name: &'static str, code: sys::nvmlReturn_t) -> Result<(), MigNvmlError> {
    nvml_try(code).map_err(|source| MigNvmlError::Nvml { call: name, source })
}

fn wrap(name: &'static str) -> impl Fn(NvmlError) -> MigNvmlError {
    move |source| MigNvmlError::Nvml { call: name, source }
}

/// A GPU-instance profile of a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileInfo {
    /// Its name without the `MIG ` prefix (`1g.18gb`).
    pub name: String,
    /// The id creation takes.
    pub id: u32,
    /// Compute slices.
    pub slice_count: u32,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Multiprocessors.
    pub multiprocessors: u32,
    /// Possible placements `(start, size)` in memory slices.
    pub placements: Vec<(u32, u32)>,
}

/// A GPU instance on a GPU, with the UUID of its MIG device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceInfo {
    /// GPU instance id.
    pub id: u32,
    /// Its profile id.
    pub profile_id: u32,
    /// Placement `(start, size)`.
    pub placement: (u32, u32),
    /// The MIG device's UUID (`MIG-...`), once a compute instance exists.
    pub uuid: Option<String>,
}

/// NVML opened for MIG control.
pub struct MigNvml {
    nvml: Nvml,
}

impl MigNvml {
    /// Loads and initialises NVML from `lib`.
    pub fn open(lib: &Path) -> Result<Self, MigNvmlError> {
        let nvml = Nvml::builder()
            .lib_path(lib.as_os_str())
            .init()
            .map_err(wrap("nvmlInit"))?;
        Ok(Self { nvml })
    }

    fn handle(&self, uuid: &str) -> Result<sys::nvmlDevice_t, MigNvmlError> {
        let dev = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(wrap("nvmlDeviceGetHandleByUUID"))?;
        // SAFETY: the handle stays valid while `self.nvml` is initialised (NVML handles live
        // until nvmlShutdown), and every use below is within `&self`.
        Ok(unsafe { dev.handle() })
    }

    /// Whether MIG mode is on now (the current mode, not a pending one).
    pub fn mig_enabled(&self, uuid: &str) -> Result<bool, MigNvmlError> {
        let dev = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(wrap("nvmlDeviceGetHandleByUUID"))?;
        let mode = dev.mig_mode().map_err(wrap("nvmlDeviceGetMigMode"))?;
        Ok(mode.current == sys::NVML_DEVICE_MIG_ENABLE)
    }

    /// Turns MIG mode on or off (Hopper and later switch at once; `IN_USE` while contexts exist).
    pub fn set_mig(&self, uuid: &str, on: bool) -> Result<(), MigNvmlError> {
        let dev = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(wrap("nvmlDeviceGetHandleByUUID"))?;
        let status = dev.set_mig_mode(on).map_err(wrap("nvmlDeviceSetMigMode"))?;
        call("nvmlDeviceSetMigMode (activation)", status)
    }

    /// The GPU-instance profiles the GPU supports, with their placements.
    pub fn profiles(&self, uuid: &str) -> Result<Vec<ProfileInfo>, MigNvmlError> {
        let dev = self.handle(uuid)?;
        let lib = self.nvml.lib();
        let info_fn = symbol!(lib, nvmlDeviceGetGpuInstanceProfileInfoV);
        let place_fn = symbol!(lib, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
        let mut out = Vec::new();
        for p in 0..sys::NVML_GPU_INSTANCE_PROFILE_COUNT {
            let mut info = sys::nvmlGpuInstanceProfileInfo_v2_t {
                // nvml.h: nvmlGpuInstanceProfileInfo_v2 = NVML_STRUCT_VERSION(..., 2), the
                // struct's size with the version in the top byte.
                version: PROFILE_INFO_V2,
                id: 0,
                isP2pSupported: 0,
                sliceCount: 0,
                instanceCount: 0,
                multiprocessorCount: 0,
                copyEngineCount: 0,
                decoderCount: 0,
                encoderCount: 0,
                jpegCount: 0,
                ofaCount: 0,
                memorySizeMB: 0,
                name: [0; 96],
            };
            // SAFETY: `dev` is a live handle; `info` is a writable struct of the v2 layout its
            // `version` names.
            let rc = unsafe { info_fn(dev, p, &mut info) };
            // A profile index this GPU does not have answers NOT_SUPPORTED or INVALID_ARGUMENT.
            if rc == sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
                || rc == sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
            {
                continue;
            }
            call("nvmlDeviceGetGpuInstanceProfileInfo", rc)?;
            let mut count: u32 = 0;
            // SAFETY: a NULL array asks for the count only (documented), written to `count`.
            call("nvmlDeviceGetGpuInstancePossiblePlacements_v2", unsafe {
                place_fn(dev, info.id, ptr::null_mut(), &mut count)
            })?;
            let mut places =
                vec![sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
            // SAFETY: `places` has room for `count` placements; NVML writes at most that many
            // and the count it wrote back.
            call("nvmlDeviceGetGpuInstancePossiblePlacements_v2", unsafe {
                place_fn(dev, info.id, places.as_mut_ptr(), &mut count)
            })?;
            places.truncate(count as usize);
            // The last byte forced to NUL, whatever NVML wrote.
            info.name[95] = 0;
            // SAFETY: `info.name` is a NUL-terminated array (its last byte is NUL), so the read
            // stays inside it.
            let name = unsafe { CStr::from_ptr(info.name.as_ptr()) };
            out.push(ProfileInfo {
                name: profile_name(name),
                id: info.id,
                slice_count: info.sliceCount,
                memory_mib: info.memorySizeMB,
                multiprocessors: info.multiprocessorCount,
                placements: places.iter().map(|p| (p.start, p.size)).collect(),
            });
        }
        Ok(out)
    }

    /// The GPU instances on the GPU (none while MIG mode is off: NVML then answers the
    /// instance calls with errors, not an empty list).
    pub fn instances(&self, uuid: &str) -> Result<Vec<InstanceInfo>, MigNvmlError> {
        if !self.mig_enabled(uuid)? {
            return Ok(Vec::new());
        }
        let dev = self.handle(uuid)?;
        let lib = self.nvml.lib();
        let list_fn = symbol!(lib, nvmlDeviceGetGpuInstances);
        let info_fn = symbol!(lib, nvmlGpuInstanceGetInfo);
        let uuids = self.mig_uuids(uuid)?;
        let mut out = Vec::new();
        for p in self.profiles(uuid)? {
            // At most one instance per compute slice of the largest GPU.
            let mut handles: Vec<sys::nvmlGpuInstance_t> = vec![ptr::null_mut(); 8];
            let mut count: u32 = 0;
            // SAFETY: `handles` has room for 8 handles, as many as any GPU has instances of one
            // profile (7 compute slices, 8 memory slices); NVML writes the count it filled.
            call("nvmlDeviceGetGpuInstances", unsafe {
                list_fn(dev, p.id, handles.as_mut_ptr(), &mut count)
            })?;
            for gi in handles.into_iter().take(count as usize) {
                let mut info = sys::nvmlGpuInstanceInfo_t {
                    device: ptr::null_mut(),
                    id: 0,
                    profileId: 0,
                    placement: sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 },
                };
                // SAFETY: `gi` was just returned by NVML for this device; `info` is writable.
                call("nvmlGpuInstanceGetInfo", unsafe { info_fn(gi, &mut info) })?;
                out.push(InstanceInfo {
                    id: info.id,
                    profile_id: info.profileId,
                    placement: (info.placement.start, info.placement.size),
                    uuid: uuids
                        .iter()
                        .find(|(g, _)| *g == info.id)
                        .map(|(_, u)| u.clone()),
                });
            }
        }
        Ok(out)
    }

    /// `(GPU instance id, MIG UUID)` of every MIG device of the GPU.
    fn mig_uuids(&self, uuid: &str) -> Result<Vec<(u32, String)>, MigNvmlError> {
        let dev = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(wrap("nvmlDeviceGetHandleByUUID"))?;
        let gi_fn = symbol!(self.nvml.lib(), nvmlDeviceGetGpuInstanceId);
        let max = dev
            .mig_device_count()
            .map_err(wrap("nvmlDeviceGetMaxMigDeviceCount"))?;
        let mut out = Vec::new();
        for i in 0..max {
            let mig = match dev.mig_device_by_index(i) {
                Ok(m) => m,
                // Indices without a MIG device answer NOT_FOUND.
                Err(NvmlError::NotFound) => continue,
                Err(e) => return Err(wrap("nvmlDeviceGetMigDeviceHandleByIndex")(e)),
            };
            let mut gi: u32 = 0;
            // SAFETY: `mig` is a live MIG device handle of this NVML; `gi` is writable.
            call("nvmlDeviceGetGpuInstanceId", unsafe {
                gi_fn(mig.handle(), &mut gi)
            })?;
            let u = mig.uuid().map_err(wrap("nvmlDeviceGetUUID"))?;
            out.push((gi, u));
        }
        Ok(out)
    }
}

/// `nvmlGpuInstanceProfileInfo_v2`: the struct's size, version 2 in the top byte.
const PROFILE_INFO_V2: u32 =
    std::mem::size_of::<sys::nvmlGpuInstanceProfileInfo_v2_t>() as u32 | (2 << 24);

/// A profile name as NVML writes it (`MIG 1g.18gb`) without its prefix.
fn profile_name(raw: &CStr) -> String {
    let s = raw.to_string_lossy();
    s.strip_prefix("MIG ").unwrap_or(&s).to_owned()
}
