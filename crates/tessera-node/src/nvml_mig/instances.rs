//! Making and taking down GPU instances (and the compute instance filling each).

use std::ptr;

use nvml_wrapper_sys::bindings as sys;

use super::{InstanceInfo, MigNvml, MigNvmlError, call};

impl MigNvml {
    /// Creates a GPU instance of `profile_id` at `(start, size)` and one compute instance
    /// filling it; returns it with its MIG UUID. A compute instance that cannot be made
    /// takes the GPU instance back with it.
    pub fn create(
        &self,
        uuid: &str,
        profile_id: u32,
        start: u32,
        size: u32,
    ) -> Result<InstanceInfo, MigNvmlError> {
        let dev = self.handle(uuid)?;
        let lib = self.nvml.lib();
        let create_fn = symbol!(lib, nvmlDeviceCreateGpuInstanceWithPlacement);
        let info_fn = symbol!(lib, nvmlGpuInstanceGetInfo);
        let destroy_fn = symbol!(lib, nvmlGpuInstanceDestroy);
        let placement = sys::nvmlGpuInstancePlacement_t { start, size };
        let mut gi: sys::nvmlGpuInstance_t = ptr::null_mut();
        // SAFETY: `dev` is live; `placement` is read, `gi` written by NVML.
        call("nvmlDeviceCreateGpuInstanceWithPlacement", unsafe {
            create_fn(dev, profile_id, &placement, &mut gi)
        })?;
        let made = self.fill(gi);
        if let Err(e) = made {
            // SAFETY: `gi` is the instance just created, with no compute instance.
            let _ = unsafe { destroy_fn(gi) };
            return Err(e);
        }
        let mut info = sys::nvmlGpuInstanceInfo_t {
            device: ptr::null_mut(),
            id: 0,
            profileId: 0,
            placement: sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 },
        };
        // SAFETY: `gi` is live; `info` is writable.
        call("nvmlGpuInstanceGetInfo", unsafe { info_fn(gi, &mut info) })?;
        let mig = self
            .mig_uuids(uuid)?
            .into_iter()
            .find(|(g, _)| *g == info.id)
            .map(|(_, u)| u)
            .ok_or(MigNvmlError::NoMigDevice(info.id))?;
        Ok(InstanceInfo {
            id: info.id,
            profile_id: info.profileId,
            placement: (info.placement.start, info.placement.size),
            uuid: Some(mig),
        })
    }

    /// One compute instance spanning GPU instance `gi`: the compute profile with the most
    /// slices it offers (the shared-engine profile).
    fn fill(&self, gi: sys::nvmlGpuInstance_t) -> Result<(), MigNvmlError> {
        let lib = self.nvml.lib();
        let info_fn = symbol!(lib, nvmlGpuInstanceGetComputeInstanceProfileInfo);
        let create_fn = symbol!(lib, nvmlGpuInstanceCreateComputeInstance);
        let mut best: Option<(u32, u32)> = None;
        for p in 0..sys::NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            let mut info = sys::nvmlComputeInstanceProfileInfo_t {
                id: 0,
                sliceCount: 0,
                instanceCount: 0,
                multiprocessorCount: 0,
                sharedCopyEngineCount: 0,
                sharedDecoderCount: 0,
                sharedEncoderCount: 0,
                sharedJpegCount: 0,
                sharedOfaCount: 0,
            };
            // SAFETY: `gi` is live; `info` is a writable struct of the v1 layout.
            let rc = unsafe {
                info_fn(
                    gi,
                    p,
                    sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    &mut info,
                )
            };
            if rc != sys::nvmlReturn_enum_NVML_SUCCESS {
                continue;
            }
            if best.is_none_or(|(_, s)| info.sliceCount > s) {
                best = Some((info.id, info.sliceCount));
            }
        }
        let (id, _) = best.ok_or(MigNvmlError::Missing("a compute instance profile"))?;
        let mut ci: sys::nvmlComputeInstance_t = ptr::null_mut();
        // SAFETY: `gi` is live; `ci` is written by NVML.
        call("nvmlGpuInstanceCreateComputeInstance", unsafe {
            create_fn(gi, id, &mut ci)
        })
    }

    /// Destroys GPU instance `id`'s compute instances, then it.
    pub fn destroy(&self, uuid: &str, id: u32) -> Result<(), MigNvmlError> {
        let dev = self.handle(uuid)?;
        let lib = self.nvml.lib();
        let by_id = symbol!(lib, nvmlDeviceGetGpuInstanceById);
        let list_ci = symbol!(lib, nvmlGpuInstanceGetComputeInstances);
        let destroy_ci = symbol!(lib, nvmlComputeInstanceDestroy);
        let destroy_gi = symbol!(lib, nvmlGpuInstanceDestroy);
        let mut gi: sys::nvmlGpuInstance_t = ptr::null_mut();
        // SAFETY: `dev` is live; `gi` is written by NVML.
        call("nvmlDeviceGetGpuInstanceById", unsafe {
            by_id(dev, id, &mut gi)
        })?;
        for p in 0..sys::NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            let mut cis: Vec<sys::nvmlComputeInstance_t> = vec![ptr::null_mut(); 8];
            let mut count: u32 = 0;
            // SAFETY: `cis` has room for 8 handles (a GPU instance has at most 7 compute
            // slices); NVML writes the count it filled.
            let rc = unsafe { list_ci(gi, p, cis.as_mut_ptr(), &mut count) };
            if rc != sys::nvmlReturn_enum_NVML_SUCCESS {
                continue;
            }
            for ci in cis.into_iter().take(count as usize) {
                // SAFETY: `ci` was just listed by NVML for this GPU instance.
                call("nvmlComputeInstanceDestroy", unsafe { destroy_ci(ci) })?;
            }
        }
        // SAFETY: `gi` is live and has no compute instance left.
        call("nvmlGpuInstanceDestroy", unsafe { destroy_gi(gi) })
    }
}
