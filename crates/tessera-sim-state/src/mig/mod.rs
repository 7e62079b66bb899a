//! MIG (Multi-Instance GPU) on the simulated Hopper parts.
//!
//! - [`profiles`]: the H100 and H200 GPU-instance profile tables (pure data).
//! - [`layout`]: one GPU's MIG mode, GPU and compute instances, and the rules for changing
//!   them (pure).
//! - [`store`]: the machine's MIG state in `<state>/mig`, shared by every process.
//!
//! A compute instance is a MIG device: its UUID is `MIG-<uuid>`, it has its GPU instance's
//! memory (shared by the compute instances of that GPU instance) and its own SMs, and it runs
//! kernels on an engine of its own (`engine<N>.mig<GI>.<CI>`), so one instance's load never
//! slows another while contexts on one instance time-slice among themselves.

pub mod layout;
/// The profile tables live beside this module (`crate::profiles`: `spec` names models by them
/// and this module builds on `spec`).
pub use crate::profiles;
pub mod store;

pub use layout::{ComputeInstance, GpuInstance, GpuMig, MigError};
pub use profiles::{GiProfile, GpuModel};
pub use store::MigState;

use crate::spec::{GpuInfo, SimSpec};

/// One MIG device (a compute instance) as the drivers show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigDevice {
    /// The parent GPU's index.
    pub gpu: u32,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    pub ci: u32,
    /// Its GPU instance's profile.
    pub gi_profile: &'static GiProfile,
    /// `1g.18gb`, or `1c.3g.71gb` for a compute instance smaller than its GPU instance.
    pub profile_name: String,
    /// `NVIDIA H200 MIG 1g.18gb`.
    pub name: String,
    /// Its GPU instance's memory, bytes.
    pub memory_bytes: u64,
    /// Its SMs.
    pub sms: u32,
    pub uuid_bytes: [u8; 16],
    /// `MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
}

impl MigDevice {
    /// The tag a process record carries for memory in this device's GPU instance (never 0).
    pub fn tag(&self) -> u64 {
        tag(self.gi, self.ci)
    }
}

/// The record tag of compute instance `ci` of GPU instance `gi` (0 means no MIG device).
pub fn tag(gi: u32, ci: u32) -> u64 {
    (1 << 40) | (u64::from(gi) << 20) | u64::from(ci)
}

/// `(gi, ci)` of a record tag; `None` for 0 (the whole GPU).
pub fn untag(tag: u64) -> Option<(u32, u32)> {
    (tag >> 40 == 1).then_some((((tag >> 20) & 0xFFFFF) as u32, (tag & 0xFFFFF) as u32))
}

/// `MIG-` and the UUID bytes formatted.
pub fn format_mig_uuid(b: &[u8; 16]) -> String {
    let gpu = crate::spec::format_uuid(b);
    format!("MIG-{}", &gpu[4..])
}

impl MigState {
    /// Every MIG device of the machine, by GPU, GPU instance and compute instance.
    pub fn devices(&self, spec: &SimSpec) -> Vec<MigDevice> {
        spec.gpus.iter().flat_map(|g| self.devices_of(g)).collect()
    }

    /// The MIG devices of GPU `g` (none while MIG is off or on a model without MIG).
    pub fn devices_of(&self, g: &GpuInfo) -> Vec<MigDevice> {
        let (Some(model), Some(mig)) = (g.model, self.gpus.get(&g.index)) else {
            return Vec::new();
        };
        if !mig.enabled {
            return Vec::new();
        }
        let mut out = Vec::new();
        for gi in &mig.gis {
            let Some(p) = model.profile_by_id(gi.profile_id) else {
                continue;
            };
            for ci in &gi.cis {
                let profile_name = profiles::ci_name(p, ci.size);
                out.push(MigDevice {
                    gpu: g.index,
                    gi: gi.id,
                    ci: ci.id,
                    gi_profile: p,
                    name: format!("{} MIG {profile_name}", model.name()),
                    profile_name,
                    memory_bytes: p.memory_mib << 20,
                    sms: profiles::ci_sms(p, ci.size),
                    uuid_bytes: ci.uuid_bytes,
                    uuid: format_mig_uuid(&ci.uuid_bytes),
                });
            }
        }
        out
    }

    /// The MIG device with UUID `uuid` (`MIG-...`, any case).
    pub fn device_by_uuid(&self, spec: &SimSpec, uuid: &str) -> Option<MigDevice> {
        self.devices(spec)
            .into_iter()
            .find(|d| d.uuid.eq_ignore_ascii_case(uuid.trim()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_carry_the_instance_size_name_and_uuid() {
        let spec = SimSpec::parse("2xH200").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let m = GpuModel::H200;
        store::update(dir.path(), |st| {
            st.gpu_mut(1).set_mode(true, false)?;
            let gi = st
                .gpu_mut(1)
                .create_gi(m, m.profile_by_name("1g.18gb").unwrap(), None)?;
            let u = st.fresh_uuid(&spec.gpus[1].uuid_bytes);
            st.gpu_mut(1).create_ci(m, gi, 0, u)?;
            let gi = st
                .gpu_mut(1)
                .create_gi(m, m.profile_by_name("3g.71gb").unwrap(), None)?;
            let u = st.fresh_uuid(&spec.gpus[1].uuid_bytes);
            st.gpu_mut(1).create_ci(m, gi, 0, u)
        })
        .unwrap();
        let st = store::load(dir.path()).unwrap();
        let devs = st.devices(&spec);
        assert_eq!(devs.len(), 2);
        assert_eq!(devs[0].name, "NVIDIA H200 MIG 1g.18gb");
        assert_eq!((devs[0].memory_bytes, devs[0].sms), (16 << 30, 16));
        assert_eq!(devs[1].name, "NVIDIA H200 MIG 1c.3g.71gb");
        assert_eq!(devs[1].sms, 16);
        assert!(devs[0].uuid.starts_with("MIG-") && devs[0].uuid.len() == 40);
        let found = st.device_by_uuid(&spec, &devs[1].uuid.to_uppercase());
        assert_eq!(found.as_ref(), Some(&devs[1]));
        assert_eq!(untag(devs[1].tag()), Some((devs[1].gi, 0)));
        assert_eq!(untag(0), None);
    }

    #[test]
    fn memory_on_a_mig_device_is_held_to_its_gpu_instance() {
        let spec = SimSpec::parse("1xH200").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let m = GpuModel::H200;
        store::update(dir.path(), |st| {
            st.gpu_mut(0).set_mode(true, false)?;
            let gi = st
                .gpu_mut(0)
                .create_gi(m, m.profile_by_name("1g.18gb").unwrap(), None)?;
            let u = st.fresh_uuid(&spec.gpus[0].uuid_bytes);
            st.gpu_mut(0).create_ci(m, gi, 0, u)
        })
        .unwrap();
        let dev = store::load(dir.path()).unwrap().devices(&spec).remove(0);
        let ledger = crate::Ledger::open(dir.path(), vec![spec.gpus[0].total_bytes])
            .unwrap()
            .with_mig(&dev);
        ledger.try_alloc(0, 10 << 30).unwrap();
        let err = ledger.try_alloc(0, 7 << 30).unwrap_err();
        assert!(
            matches!(err, crate::LedgerError::OutOfMemory { free, .. } if free == 6 << 30),
            "{err}"
        );
        ledger.try_alloc(0, 6 << 30).unwrap();
        let procs = crate::read_processes(dir.path()).unwrap();
        assert_eq!(procs[0].mig_tag[0], dev.tag());
        assert_eq!(
            crate::instance_memory_used(dir.path(), 0, dev.tag()).unwrap(),
            16 << 30
        );
        // Another GPU instance of the same card holds none of it.
        assert_eq!(
            crate::instance_memory_used(dir.path(), 0, tag(dev.gi + 1, 0)).unwrap(),
            0
        );
    }

    #[test]
    fn compute_instances_run_kernels_on_engines_of_their_own() {
        let dir = tempfile::tempdir().unwrap();
        // Two threads each run a 300 ms kernel at once: on two instances' engines the kernels
        // overlap; on one instance's engine they take turns.
        let run_pair = |tags: [u64; 2]| {
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
            let handles: Vec<_> = tags
                .into_iter()
                .map(|t| {
                    let (dir, barrier) = (dir.path().to_owned(), barrier.clone());
                    std::thread::spawn(move || {
                        let e = crate::Engine::open_mig(&dir, 0, t).unwrap();
                        barrier.wait();
                        e.run(300_000_000)
                    })
                })
                .collect();
            let spans: Vec<(u64, u64)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            spans[0].0 < spans[1].1 && spans[1].0 < spans[0].1
        };
        assert!(
            run_pair([tag(1, 0), tag(2, 0)]),
            "two instances run at once"
        );
        assert!(
            !run_pair([tag(1, 0), tag(1, 0)]),
            "one instance runs one kernel at a time"
        );
    }
}
