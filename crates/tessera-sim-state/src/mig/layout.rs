//! The MIG layout of one GPU and the rules for changing it (pure: the store persists it).
//!
//! What NVML's reference says these calls do, and the simulator does:
//! - `nvmlDeviceSetMigMode`: on Hopper the change applies at once (no GPU reset pending);
//!   `NVML_ERROR_IN_USE` while any process holds a context on the GPU. Turning MIG off with
//!   GPU instances left is refused (`IN_USE`) as well.
//! - `nvmlDeviceCreateGpuInstanceWithPlacement`: `INSUFFICIENT_RESOURCES` when the placement
//!   overlaps a live instance or the profile's instance count is used up; `INVALID_ARGUMENT`
//!   for a placement the profile does not list.
//! - `nvmlGpuInstanceDestroy`: `IN_USE` while the instance has compute instances.
//! - `nvmlComputeInstanceDestroy`: `IN_USE` while a process runs on it.
//!
//! Every compute instance gets a fresh UUID at creation (from the store's serial), so an
//! instance re-created at the same placement is a different device, as on a card.

use super::profiles::{COMPUTE_SLICES, GiProfile, GpuModel, MEMORY_SLICES, ci_profile_slices};

/// Errors of MIG operations (each maps to one `nvmlReturn_t`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigError {
    #[error("this simulated GPU has no MIG (name a model, e.g. TESSERA_SIM_GPUS=1xH200)")]
    NotSupported,
    #[error("MIG mode is off on this GPU")]
    MigOff,
    #[error("in use: {0}")]
    InUse(&'static str),
    #[error("not enough free slices or instances for this profile")]
    InsufficientResources,
    #[error("no such profile, placement or instance")]
    InvalidArgument,
    #[error("no such instance")]
    NotFound,
    #[error("MIG state file {path}: {why}")]
    Io { path: String, why: String },
}

/// A compute instance: one MIG device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeInstance {
    /// Its id inside the GPU instance (from 0).
    pub id: u32,
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*` (index = id).
    pub profile: u32,
    /// First compute slice inside the GPU instance.
    pub start: u32,
    /// Compute slices.
    pub size: u32,
    /// The 16 raw UUID bytes; the MIG device's UUID is `MIG-` and them formatted.
    pub uuid_bytes: [u8; 16],
}

/// A GPU instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInstance {
    /// Its id on the GPU (from 1).
    pub id: u32,
    /// The profile id (`nvmlGpuInstanceProfileInfo_t.id`).
    pub profile_id: u32,
    /// First memory slice.
    pub start: u32,
    /// Memory slices.
    pub size: u32,
    pub cis: Vec<ComputeInstance>,
}

/// The MIG state of one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuMig {
    pub enabled: bool,
    pub gis: Vec<GpuInstance>,
}

impl GpuMig {
    /// Sets MIG mode; `busy`: a process holds a context on the GPU.
    pub fn set_mode(&mut self, enable: bool, busy: bool) -> Result<(), MigError> {
        if self.enabled == enable {
            return Ok(());
        }
        if busy {
            return Err(MigError::InUse("a process holds a context on the GPU"));
        }
        if !enable && !self.gis.is_empty() {
            return Err(MigError::InUse("GPU instances exist"));
        }
        self.enabled = enable;
        Ok(())
    }

    fn gi_profile(model: GpuModel, gi: &GpuInstance) -> &'static GiProfile {
        model
            .profile_by_id(gi.profile_id)
            .expect("a stored instance has a known profile")
    }

    /// The placement starts where a new instance of `profile` fits now.
    pub fn free_placements(&self, model: GpuModel, profile: &GiProfile) -> Vec<u32> {
        let count = self
            .gis
            .iter()
            .filter(|g| g.profile_id == profile.id)
            .count() as u32;
        if !self.enabled || count >= profile.instance_count {
            return Vec::new();
        }
        let used_compute: u32 = self
            .gis
            .iter()
            .map(|g| Self::gi_profile(model, g).compute_slices)
            .sum();
        if used_compute + profile.compute_slices > COMPUTE_SLICES {
            return Vec::new();
        }
        // A `+me` profile takes the GPU's one set of media extensions.
        let me_taken =
            profile.ofas > 0 && self.gis.iter().any(|g| Self::gi_profile(model, g).ofas > 0);
        if me_taken {
            return Vec::new();
        }
        profile
            .placements
            .iter()
            .copied()
            .filter(|&s| {
                let end = s + profile.memory_slices;
                end <= MEMORY_SLICES
                    && self
                        .gis
                        .iter()
                        .all(|g| end <= g.start || g.start + g.size <= s)
            })
            .collect()
    }

    /// Creates a GPU instance of `profile` at `start` (`None`: the first free placement).
    pub fn create_gi(
        &mut self,
        model: GpuModel,
        profile: &GiProfile,
        start: Option<u32>,
    ) -> Result<u32, MigError> {
        if !self.enabled {
            return Err(MigError::MigOff);
        }
        if let Some(s) = start
            && !profile.placements.contains(&s)
        {
            return Err(MigError::InvalidArgument);
        }
        let free = self.free_placements(model, profile);
        let start = match start {
            Some(s) if free.contains(&s) => s,
            Some(_) => return Err(MigError::InsufficientResources),
            None => *free.first().ok_or(MigError::InsufficientResources)?,
        };
        let id = (1..)
            .find(|i| self.gis.iter().all(|g| g.id != *i))
            .expect("ids are unbounded");
        self.gis.push(GpuInstance {
            id,
            profile_id: profile.id,
            start,
            size: profile.memory_slices,
            cis: Vec::new(),
        });
        self.gis.sort_by_key(|g| g.id);
        Ok(id)
    }

    /// Destroys GPU instance `id` (refused while it has compute instances).
    pub fn destroy_gi(&mut self, id: u32) -> Result<(), MigError> {
        let pos = self
            .gis
            .iter()
            .position(|g| g.id == id)
            .ok_or(MigError::NotFound)?;
        if !self.gis[pos].cis.is_empty() {
            return Err(MigError::InUse("the GPU instance has compute instances"));
        }
        self.gis.remove(pos);
        Ok(())
    }

    /// GPU instance `id`.
    pub fn gi(&self, id: u32) -> Option<&GpuInstance> {
        self.gis.iter().find(|g| g.id == id)
    }

    /// Compute slices of GPU instance `gi` where a compute instance of `ci_profile` fits now.
    pub fn free_ci_placements(&self, model: GpuModel, gi: u32, ci_profile: u32) -> Vec<u32> {
        let (Some(g), Some(size)) = (self.gi(gi), ci_profile_slices(ci_profile)) else {
            return Vec::new();
        };
        let slices = Self::gi_profile(model, g).compute_slices;
        if size > slices {
            return Vec::new();
        }
        (0..=slices - size)
            .filter(|s| s % size == 0 || size == slices)
            .filter(|&s| {
                g.cis
                    .iter()
                    .all(|c| s + size <= c.start || c.start + c.size <= s)
            })
            .collect()
    }

    /// Creates a compute instance of `ci_profile` in GPU instance `gi` with UUID bytes `uuid`.
    pub fn create_ci(
        &mut self,
        model: GpuModel,
        gi: u32,
        ci_profile: u32,
        uuid_bytes: [u8; 16],
    ) -> Result<u32, MigError> {
        let size = ci_profile_slices(ci_profile).ok_or(MigError::InvalidArgument)?;
        let g = self.gi(gi).ok_or(MigError::NotFound)?;
        if size > Self::gi_profile(model, g).compute_slices {
            return Err(MigError::InvalidArgument);
        }
        let start = *self
            .free_ci_placements(model, gi, ci_profile)
            .first()
            .ok_or(MigError::InsufficientResources)?;
        let g = self
            .gis
            .iter_mut()
            .find(|g| g.id == gi)
            .expect("looked up above");
        let id = (0..)
            .find(|i| g.cis.iter().all(|c| c.id != *i))
            .expect("ids are unbounded");
        g.cis.push(ComputeInstance {
            id,
            profile: ci_profile,
            start,
            size,
            uuid_bytes,
        });
        g.cis.sort_by_key(|c| c.id);
        Ok(id)
    }

    /// Destroys compute instance `ci` of GPU instance `gi`; `busy`: a process runs on it.
    pub fn destroy_ci(&mut self, gi: u32, ci: u32, busy: bool) -> Result<(), MigError> {
        let g = self
            .gis
            .iter_mut()
            .find(|g| g.id == gi)
            .ok_or(MigError::NotFound)?;
        let pos = g
            .cis
            .iter()
            .position(|c| c.id == ci)
            .ok_or(MigError::NotFound)?;
        if busy {
            return Err(MigError::InUse("a process runs on the compute instance"));
        }
        g.cis.remove(pos);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> GpuMig {
        GpuMig {
            enabled: true,
            gis: Vec::new(),
        }
    }

    fn prof(name: &str) -> &'static GiProfile {
        GpuModel::H200.profile_by_name(name).unwrap()
    }

    const M: GpuModel = GpuModel::H200;

    #[test]
    fn mode_changes_are_refused_while_contexts_or_instances_exist() {
        let mut g = GpuMig::default();
        assert!(matches!(g.set_mode(true, true), Err(MigError::InUse(_))));
        g.set_mode(true, false).unwrap();
        assert!(g.enabled);
        g.create_gi(M, prof("1g.18gb"), Some(0)).unwrap();
        assert!(matches!(g.set_mode(false, false), Err(MigError::InUse(_))));
        let mut off = GpuMig::default();
        assert_eq!(
            off.create_gi(M, prof("1g.18gb"), None),
            Err(MigError::MigOff)
        );
    }

    #[test]
    fn overlaps_are_refused_and_the_documented_mixes_fit_or_not() {
        // 1g@0 excludes 2g@0.
        let mut g = on();
        g.create_gi(M, prof("1g.18gb"), Some(0)).unwrap();
        assert_eq!(
            g.create_gi(M, prof("2g.35gb"), Some(0)),
            Err(MigError::InsufficientResources)
        );
        assert!(g.create_gi(M, prof("2g.35gb"), Some(2)).is_ok());
        // 4g + 3g fits.
        let mut g = on();
        g.create_gi(M, prof("4g.71gb"), Some(0)).unwrap();
        g.create_gi(M, prof("3g.71gb"), Some(4)).unwrap();
        // 3g + 3g + 1g does not.
        let mut g = on();
        g.create_gi(M, prof("3g.71gb"), Some(0)).unwrap();
        g.create_gi(M, prof("3g.71gb"), Some(4)).unwrap();
        assert_eq!(
            g.create_gi(M, prof("1g.18gb"), None),
            Err(MigError::InsufficientResources)
        );
        // Seven 1g, and no eighth; a placement the profile does not list is a bad argument.
        let mut g = on();
        for _ in 0..7 {
            g.create_gi(M, prof("1g.18gb"), None).unwrap();
        }
        assert_eq!(
            g.create_gi(M, prof("1g.18gb"), None),
            Err(MigError::InsufficientResources)
        );
        assert_eq!(
            on().create_gi(M, prof("2g.35gb"), Some(1)),
            Err(MigError::InvalidArgument)
        );
        // One +me at most.
        let mut g = on();
        g.create_gi(M, prof("1g.18gb+me"), None).unwrap();
        assert_eq!(
            g.create_gi(M, prof("1g.18gb+me"), None),
            Err(MigError::InsufficientResources)
        );
    }

    #[test]
    fn compute_instances_live_inside_their_gpu_instance() {
        let mut g = on();
        let gi = g.create_gi(M, prof("3g.71gb"), Some(0)).unwrap();
        assert_eq!(
            g.create_ci(M, gi, 4, [1; 16]),
            Err(MigError::InvalidArgument)
        );
        let a = g.create_ci(M, gi, 0, [1; 16]).unwrap();
        let b = g.create_ci(M, gi, 0, [2; 16]).unwrap();
        assert_eq!((a, b), (0, 1));
        assert_eq!(g.gi(gi).unwrap().cis[1].start, 1);
        // A whole-GI compute instance no longer fits.
        assert_eq!(
            g.create_ci(M, gi, 2, [3; 16]),
            Err(MigError::InsufficientResources)
        );
        assert!(matches!(g.destroy_gi(gi), Err(MigError::InUse(_))));
        assert!(matches!(g.destroy_ci(gi, a, true), Err(MigError::InUse(_))));
        g.destroy_ci(gi, a, false).unwrap();
        g.destroy_ci(gi, b, false).unwrap();
        assert_eq!(g.destroy_ci(gi, b, false), Err(MigError::NotFound));
        g.destroy_gi(gi).unwrap();
        assert!(g.gis.is_empty());
    }
}
