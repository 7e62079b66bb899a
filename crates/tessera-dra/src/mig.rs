//! Pure rules: a GPU's MIG partitions as partitionable devices (KEP-4815) that fractions share
//! by consumable capacity (KEP-5075).
//!
//! Two modes, per GPU ([`MigMode`]):
//! - **dynamic** (needs `DRAPartitionableDevices`, beta and on by default in Kubernetes 1.36):
//!   the GPU gets one counter set ([`counter_set_name`]) holding its compute slices
//!   ([`COUNTER_COMPUTE`], 7 on an H100/H200) and one counter per memory slice
//!   (`memory-slice-<n>`, value 1, 8 of them). Every GPU-instance profile at every placement
//!   NVML reports is a device ([`mig_device_name`]) that consumes its compute slices and the
//!   memory slices of its placement, so overlapping placements exclude each other (`1g@0` and
//!   `2g@0` both need memory slice 0) and so do combinations over the compute slices. The
//!   whole-GPU device consumes every counter: a whole or fractional claim on the card excludes
//!   every MIG device of it, and the reverse. This is upstream's model: kubernetes-sigs/
//!   dra-driver-nvidia-gpu `cmd/gpu-kubelet-plugin/partitions.go` (one counter set per full
//!   GPU, `memory-slice-%d` counters from the placement's start and size, the full device
//!   consuming everything).
//! - **static** (for clusters without partitionable devices): the instances that already
//!   exist on the GPU are published, each as a device of its own, and the whole GPU is not.
//!
//! Every MIG device has `allowMultipleAllocations` and the same `shares`/`memory` capacities
//! as a whole GPU, sized to the instance: fractions of one instance share it. The scheduler
//! takes a shared device's counters once, at its first allocation (k8s.io/dynamic-resource-
//! allocation v0.36.3 `structured/internal/incubating/allocator_incubating.go`: the counter
//! check is skipped while `deviceCapacityInUse`; committed shared allocations are counted when
//! counters are rebuilt, `internal.IsDeviceAllocated`, the fix of kubernetes #139034 by
//! #139040, in v1.36.3 through its cherry pick #139211).
//!
//! The counters of a device a claim holds are never changed ([`hold_allocated`]): the
//! scheduler does not re-check live allocations against new counters (kubernetes #140802).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCounterConsumption, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Counter of a GPU's compute slices in its counter set.
pub const COUNTER_COMPUTE: &str = "compute-slices";
/// The `type` attribute of a whole GPU.
pub const TYPE_GPU: &str = "gpu";
/// The `type` attribute of a MIG device.
pub const TYPE_MIG: &str = "mig";
/// The upstream limit of counter sets in one slice.
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// The upstream limit of devices in one slice when any consumes counters (or has taints).
pub const MAX_COUNTER_DEVICES_PER_SLICE: usize = 64;

/// One GPU-instance placement: its first memory slice and how many it spans
/// (`nvmlGpuInstancePlacement_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Placement {
    /// First memory slice.
    pub start: u32,
    /// Memory slices.
    pub size: u32,
}

/// A GPU-instance profile as NVML describes it (`nvmlGpuInstanceProfileInfo_v3_t` and
/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// NVML's profile id (`NVML_GPU_INSTANCE_PROFILE_*`), what creation names.
    pub id: u32,
    /// Its name without the `MIG ` prefix (`1g.18gb`).
    pub name: String,
    /// Compute slices (`sliceCount`).
    pub compute_slices: u32,
    /// Memory, bytes (`memorySizeMB` MiB).
    pub memory: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Where it can be created.
    pub placements: Vec<Placement>,
}

/// What NVML says of a MIG-capable GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    /// Compute slices of the GPU (the largest profile's).
    pub compute_slices: u32,
    /// Memory slices of the GPU (the end of the furthest placement).
    pub memory_slices: u32,
    /// Its GPU-instance profiles.
    pub profiles: Vec<Profile>,
}

impl Geometry {
    /// The geometry of `profiles`; `None` if there is none (no MIG on this GPU).
    pub fn of(profiles: Vec<Profile>) -> Option<Self> {
        let compute_slices = profiles.iter().map(|p| p.compute_slices).max()?;
        let memory_slices = profiles
            .iter()
            .flat_map(|p| &p.placements)
            .map(|pl| pl.start + pl.size)
            .max()?;
        Some(Self {
            compute_slices,
            memory_slices,
            profiles,
        })
    }

    /// The profile named `name`.
    pub fn profile(&self, name: &str) -> Option<&Profile> {
        self.profiles.iter().find(|p| p.name == name)
    }
}

/// A MIG instance that exists on a GPU (static mode publishes these).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// Its profile's name.
    pub profile: String,
    /// Its placement.
    pub placement: Placement,
    /// The MIG device's UUID (`MIG-...`).
    pub uuid: String,
    /// Its memory, bytes.
    pub memory: u64,
}

/// How a GPU is published.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum MigMode {
    /// A whole GPU that fractions share; no MIG.
    #[default]
    Off,
    /// Partitionable: counters, the whole GPU and one device per profile and placement.
    Dynamic(Geometry),
    /// The existing instances, each a shareable device; the whole GPU is not published.
    Static(Vec<Instance>),
}

/// A set of the node's GPUs named on the command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum GpuSet {
    /// None.
    #[default]
    None,
    /// Every GPU.
    All,
    /// These NVML indices.
    Indices(BTreeSet<u32>),
}

impl GpuSet {
    /// `all`, or NVML indices (`0,3`); empty is none.
    pub fn parse(items: &[String]) -> Result<Self, String> {
        let items: Vec<&str> = items
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .collect();
        match items.as_slice() {
            [] => Ok(Self::None),
            ["all"] => Ok(Self::All),
            _ => items
                .iter()
                .map(|i| {
                    i.parse::<u32>()
                        .map_err(|_| format!("{i:?} is not a GPU index (or `all` alone)"))
                })
                .collect::<Result<BTreeSet<_>, _>>()
                .map(Self::Indices),
        }
    }

    /// Whether GPU `index` is in the set.
    pub fn contains(&self, index: u32) -> bool {
        match self {
            Self::None => false,
            Self::All => true,
            Self::Indices(s) => s.contains(&index),
        }
    }
}

/// Which GPUs are published with MIG, and how (`--mig-dynamic`, `--mig-static`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigConfig {
    /// Partitionable: instances made at prepare.
    pub dynamic: GpuSet,
    /// The existing instances, for clusters without partitionable devices.
    pub fixed: GpuSet,
}

/// How a GPU is to be published, before NVML is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wanted {
    /// No MIG.
    Off,
    /// [`MigMode::Dynamic`].
    Dynamic,
    /// [`MigMode::Static`].
    Static,
}

impl MigConfig {
    /// Checks that no GPU is asked for in both modes.
    pub fn validate(&self) -> Result<(), String> {
        let both = match (&self.dynamic, &self.fixed) {
            (GpuSet::None, _) | (_, GpuSet::None) => false,
            (GpuSet::Indices(a), GpuSet::Indices(b)) => a.intersection(b).next().is_some(),
            _ => true,
        };
        if both {
            return Err("a GPU cannot be in both --mig-dynamic and --mig-static".into());
        }
        Ok(())
    }

    /// The GPUs the two flags name by index, each with its flag (`all` names none).
    pub fn named(&self) -> Vec<(&'static str, u32)> {
        let mut out = Vec::new();
        for (flag, set) in [
            ("--mig-dynamic", &self.dynamic),
            ("--mig-static", &self.fixed),
        ] {
            if let GpuSet::Indices(s) = set {
                out.extend(s.iter().map(|i| (flag, *i)));
            }
        }
        out
    }

    /// GPU `index`'s mode.
    pub fn wanted(&self, index: u32) -> Wanted {
        if self.dynamic.contains(index) {
            Wanted::Dynamic
        } else if self.fixed.contains(index) {
            Wanted::Static
        } else {
            Wanted::Off
        }
    }
}

/// The counter set of GPU `index`.
pub fn counter_set_name(index: u32) -> String {
    format!("gpu-{index}-counters")
}

/// The counter of memory slice `n`.
pub fn memory_slice_counter(n: u32) -> String {
    format!("memory-slice-{n}")
}

/// The device of `profile` at `start` on GPU `index`: `gpu-0-mig-1g-18gb-0` (a DNS label: the
/// profile's dots become dashes).
pub fn mig_device_name(index: u32, profile: &str, start: u32) -> String {
    let p: String = profile
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    format!("gpu-{index}-mig-{p}-{start}")
}

fn one() -> Counter {
    Counter {
        value: Quantity("1".into()),
    }
}

/// GPU `index`'s counter set under `g`.
pub fn counter_set(index: u32, g: &Geometry) -> CounterSet {
    let mut counters = BTreeMap::from([(
        COUNTER_COMPUTE.to_owned(),
        Counter {
            value: Quantity(g.compute_slices.to_string()),
        },
    )]);
    for n in 0..g.memory_slices {
        counters.insert(memory_slice_counter(n), one());
    }
    CounterSet {
        name: counter_set_name(index),
        counters,
    }
}

/// What a device of `compute` slices at `placement` takes from GPU `index`'s set.
pub fn consumption(index: u32, compute: u32, placement: Placement) -> DeviceCounterConsumption {
    let mut counters = BTreeMap::from([(
        COUNTER_COMPUTE.to_owned(),
        Counter {
            value: Quantity(compute.to_string()),
        },
    )]);
    for n in placement.start..placement.start + placement.size {
        counters.insert(memory_slice_counter(n), one());
    }
    DeviceCounterConsumption {
        counter_set: counter_set_name(index),
        counters,
    }
}

/// What the whole GPU takes: everything.
pub fn whole_consumption(index: u32, g: &Geometry) -> DeviceCounterConsumption {
    consumption(
        index,
        g.compute_slices,
        Placement {
            start: 0,
            size: g.memory_slices,
        },
    )
}

fn attr_string(v: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(v.to_owned()),
        ..Default::default()
    }
}

fn attr_int(v: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(v),
        ..Default::default()
    }
}

/// A MIG device: `base` (the whole GPU's device: its attributes and capacity policies, whose
/// memory is then the instance's) renamed and re-attributed. `memory_capacity` builds the
/// `shares`/`memory` capacities for `memory` bytes.
pub fn mig_device(
    base: &Device,
    name: String,
    profile: &str,
    placement: Placement,
    parent_uuid: &str,
    memory_capacity: impl Fn(u64) -> BTreeMap<String, k8s_openapi::api::resource::v1::DeviceCapacity>,
    memory: u64,
) -> Device {
    let mut attributes = base.attributes.clone().unwrap_or_default();
    // The instance has its own UUID only once it exists (static mode sets it); the parent's
    // stays reachable as parentUUID.
    attributes.remove("uuid");
    attributes.insert("type".into(), attr_string(TYPE_MIG));
    attributes.insert("profile".into(), attr_string(profile));
    attributes.insert("parentUUID".into(), attr_string(parent_uuid));
    attributes.insert(
        "placementStart".into(),
        attr_int(i64::from(placement.start)),
    );
    Device {
        name,
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(memory_capacity(memory)),
        taints: base.taints.clone(),
        ..Default::default()
    }
}

/// Every (profile, placement) of a dynamic GPU, in NVML's order.
pub fn partitions(g: &Geometry) -> impl Iterator<Item = (&Profile, Placement)> {
    g.profiles
        .iter()
        .flat_map(|p| p.placements.iter().map(move |pl| (p, *pl)))
}

/// A MIG device name's parts `(gpu index, profile as in the name, start)`; `None` for a
/// whole-GPU name or anything else.
pub fn parse_mig_device_name(name: &str) -> Option<(u32, String, u32)> {
    let rest = name.strip_prefix("gpu-")?;
    let (index, rest) = rest.split_once("-mig-")?;
    let (profile, start) = rest.rsplit_once('-')?;
    Some((index.parse().ok()?, profile.to_owned(), start.parse().ok()?))
}

/// The GPU index a device name of this driver belongs to (`gpu-3`, `gpu-3-mig-...`).
pub fn gpu_of_device(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("gpu-")?;
    let index = rest.split('-').next()?;
    index.parse().ok()
}

/// Keeps the counters of devices claims hold (kubernetes #140802): for every GPU with a device
/// in `allocated` whose published definition (in `cur`) differs in its counters from the one
/// in `devices`, or that `devices` no longer has, that GPU's devices and counter set stay as
/// published in `cur` (a mode or geometry change of that GPU waits until nothing holds it).
/// `devices` and `sets` are what [`crate::slices::pool_parts`] wants published. Returns the
/// GPUs held.
pub fn hold_allocated(
    devices: &mut Vec<Device>,
    sets: &mut Vec<CounterSet>,
    cur: &[ResourceSlice],
    allocated: &BTreeSet<String>,
) -> BTreeSet<u32> {
    let now: BTreeMap<&str, &Device> = cur
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| (d.name.as_str(), d))
        .collect();
    let changed = |d: &Device| match devices.iter().find(|n| n.name == d.name) {
        None => true,
        Some(n) => n.consumes_counters != d.consumes_counters,
    };
    let held: BTreeSet<u32> = allocated
        .iter()
        .filter_map(|name| now.get(name.as_str()))
        .filter(|d| changed(d))
        .filter_map(|d| gpu_of_device(&d.name))
        .collect();
    if held.is_empty() {
        return held;
    }
    let of_held = |name: &str| gpu_of_device(name).is_some_and(|i| held.contains(&i));
    let held_sets: BTreeSet<String> = held.iter().map(|i| counter_set_name(*i)).collect();
    devices.retain(|d| !of_held(&d.name));
    devices.extend(
        now.values()
            .filter(|d| of_held(&d.name))
            .map(|d| (*d).clone()),
    );
    // Each GPU's devices together, in GPU order (stable: a GPU's own order stays).
    devices.sort_by_key(|d| gpu_of_device(&d.name));
    sets.retain(|c| !held_sets.contains(&c.name));
    sets.extend(
        cur.iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .filter(|c| held_sets.contains(&c.name))
            .cloned(),
    );
    sets.sort_by_key(|c| gpu_of_device(&c.name));
    held
}

/// The H100/H200 GPU-instance profiles (NVIDIA's MIG user guide, "Supported MIG Profiles":
/// 7 compute and 8 memory slices; `1g` at 0-6, `1g` with double memory at 0/2/4/6, `2g` at
/// 0/2/4, `3g` at 0/4, `4g` at 0, `7g` at 0), with H200 sizes. For tests and the fakes.
#[cfg(test)]
pub(crate) fn h200() -> Geometry {
    const MIB: u64 = 1 << 20;
    let p = |id: u32, name: &str, c: u32, mib: u64, sms: u32, size: u32, starts: &[u32]| Profile {
        id,
        name: name.into(),
        compute_slices: c,
        memory: mib * MIB,
        multiprocessors: sms,
        placements: starts
            .iter()
            .map(|&start| Placement { start, size })
            .collect(),
    };
    Geometry::of(vec![
        p(19, "1g.18gb", 1, 16384, 16, 1, &[0, 1, 2, 3, 4, 5, 6]),
        p(15, "1g.35gb", 1, 32768, 16, 2, &[0, 2, 4, 6]),
        p(14, "2g.35gb", 2, 32768, 32, 2, &[0, 2, 4]),
        p(9, "3g.71gb", 3, 71680, 60, 4, &[0, 4]),
        p(5, "4g.71gb", 4, 71680, 64, 4, &[0]),
        p(0, "7g.141gb", 7, 143360, 132, 8, &[0]),
    ])
    .unwrap()
}
