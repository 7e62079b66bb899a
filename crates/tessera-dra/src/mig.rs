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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_sets_parse_and_modes_exclude_each_other() {
        let p = |v: &[&str]| GpuSet::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(p(&[]), Ok(GpuSet::None));
        assert_eq!(p(&["all"]), Ok(GpuSet::All));
        assert_eq!(p(&["0", " 3"]), Ok(GpuSet::Indices(BTreeSet::from([0, 3]))));
        assert!(p(&["all", "1"]).is_err());
        assert!(p(&["-1"]).is_err());
        let c = MigConfig {
            dynamic: p(&["0"]).unwrap(),
            fixed: p(&["1"]).unwrap(),
        };
        assert!(c.validate().is_ok());
        assert_eq!(
            (c.wanted(0), c.wanted(1), c.wanted(2)),
            (Wanted::Dynamic, Wanted::Static, Wanted::Off)
        );
        let both = MigConfig {
            dynamic: GpuSet::All,
            fixed: p(&["1"]).unwrap(),
        };
        assert!(both.validate().is_err());
        let both = MigConfig {
            dynamic: p(&["1", "2"]).unwrap(),
            fixed: p(&["2"]).unwrap(),
        };
        assert!(both.validate().is_err());
    }

    #[test]
    fn names_are_dns_labels_and_parse_back() {
        let n = mig_device_name(3, "1g.18gb", 5);
        assert_eq!(n, "gpu-3-mig-1g-18gb-5");
        assert!(n.len() <= 63);
        assert!(
            n.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        );
        assert_eq!(parse_mig_device_name(&n), Some((3, "1g-18gb".into(), 5)));
        assert_eq!(parse_mig_device_name("gpu-3"), None);
        assert_eq!(gpu_of_device(&n), Some(3));
        assert_eq!(gpu_of_device("gpu-12"), Some(12));
        assert_eq!(gpu_of_device("x-1"), None);
    }

    #[test]
    fn h200_geometry_has_seven_compute_and_eight_memory_slices() {
        let g = h200();
        assert_eq!((g.compute_slices, g.memory_slices), (7, 8));
        assert_eq!(partitions(&g).count(), 7 + 4 + 3 + 2 + 1 + 1);
        let set = counter_set(0, &g);
        assert_eq!(set.name, "gpu-0-counters");
        assert_eq!(set.counters.len(), 1 + 8);
        assert_eq!(set.counters[COUNTER_COMPUTE].value.0, "7");
        let w = whole_consumption(0, &g);
        assert_eq!(w.counters, set.counters, "the whole GPU takes everything");
    }

    fn h200_gpu(index: u32, mig: MigMode) -> crate::slices::GpuAttrs {
        crate::slices::GpuAttrs {
            index,
            uuid: format!("GPU-{index}"),
            product_name: "NVIDIA H200".into(),
            memory_total: 143771 << 20,
            compute_capability: (9, 0),
            driver_version: "570.124.06".into(),
            pci_bus_id: format!("0000:{index:02x}:00.0"),
            numa_node: None,
            pcie_root: None,
            unhealthy: None,
            mig,
        }
    }

    /// The scheduler's counter rule (k8s.io/dynamic-resource-allocation v0.36.3, incubating
    /// allocator, `checkAvailableCounters`): the distinct devices allocated (a shared device's
    /// counters taken once) consume no counter past its set's value.
    fn fits(pool: &[ResourceSlice], names: &[&str]) -> bool {
        let sets: BTreeMap<String, BTreeMap<String, u64>> = pool
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .map(|c| {
                let v = c
                    .counters
                    .iter()
                    .map(|(k, v)| (k.clone(), v.value.0.parse().unwrap()))
                    .collect();
                (c.name.clone(), v)
            })
            .collect();
        let devices: BTreeMap<&str, &Device> = pool
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| (d.name.as_str(), d))
            .collect();
        let distinct: BTreeSet<&str> = names.iter().copied().collect();
        let mut used: BTreeMap<(String, String), u64> = BTreeMap::new();
        for n in distinct {
            for c in devices[n].consumes_counters.iter().flatten() {
                for (k, v) in &c.counters {
                    *used.entry((c.counter_set.clone(), k.clone())).or_default() +=
                        v.value.0.parse::<u64>().unwrap();
                }
            }
        }
        used.iter().all(|((set, k), v)| *v <= sets[set][k])
    }

    #[test]
    fn counters_exclude_overlaps_and_whole_gpu_claims() {
        let pool = crate::slices::pool(
            "node-a",
            &[
                h200_gpu(0, MigMode::Dynamic(h200())),
                h200_gpu(1, MigMode::Dynamic(h200())),
            ],
            crate::slices::DEFAULT_MEMORY,
            1,
        );
        let m = |i: u32, p: &str, s: u32| mig_device_name(i, p, s);
        let (a, b, c) = (m(0, "1g.18gb", 0), m(0, "2g.35gb", 0), m(0, "1g.18gb", 1));
        // 1g@0 excludes 2g@0 (memory slice 0), not 1g@1.
        assert!(!fits(&pool, &[&a, &b]));
        assert!(fits(&pool, &[&a, &c]));
        // 4g + 3g fits; 3g + 3g + 1g does not (no memory slice left).
        assert!(fits(&pool, &[&m(0, "4g.71gb", 0), &m(0, "3g.71gb", 4)]));
        assert!(fits(&pool, &[&m(0, "3g.71gb", 0), &m(0, "3g.71gb", 4)]));
        for s in 0..7 {
            assert!(!fits(
                &pool,
                &[
                    &m(0, "3g.71gb", 0),
                    &m(0, "3g.71gb", 4),
                    &m(0, "1g.18gb", s)
                ]
            ));
        }
        // Seven 1g fill the compute slices; an eighth instance of any kind does not fit.
        let sevens: Vec<String> = (0..7).map(|s| m(0, "1g.18gb", s)).collect();
        let refs: Vec<&str> = sevens.iter().map(String::as_str).collect();
        assert!(fits(&pool, &refs));
        // The whole GPU (a fraction of it too: its counters go at its first allocation)
        // excludes every MIG device of its GPU, not of the other GPU.
        for (p, pl) in partitions(&h200()) {
            let d = m(0, &p.name, pl.start);
            assert!(!fits(&pool, &["gpu-0", &d]), "gpu-0 beside {d}");
            assert!(fits(&pool, &["gpu-1", &d]));
        }
        // Fractions of one instance: the same device twice takes its counters once.
        assert!(fits(&pool, &[&a, &a, &c]));
    }

    #[test]
    fn the_pool_is_device_slices_then_counter_slices_within_upstream_limits() {
        let gpus: Vec<_> = (0..9)
            .map(|i| h200_gpu(i, MigMode::Dynamic(h200())))
            .collect();
        let pool = crate::slices::pool("node-a", &gpus, crate::slices::DEFAULT_MEMORY, 7);
        let n = pool.len() as i64;
        let (mut devices, mut sets) = (0, 0);
        for s in &pool {
            assert_eq!(s.spec.pool.resource_slice_count, n);
            assert_eq!(s.spec.pool.generation, 7);
            // Devices or counters, never both.
            assert!(s.spec.devices.is_some() != s.spec.shared_counters.is_some());
            let d = s.spec.devices.as_ref().map_or(0, Vec::len);
            assert!(d <= MAX_COUNTER_DEVICES_PER_SLICE);
            let c = s.spec.shared_counters.as_ref().map_or(0, Vec::len);
            assert!(c <= MAX_COUNTER_SETS_PER_SLICE);
            (devices, sets) = (devices + d, sets + c);
        }
        assert_eq!((devices, sets), (9 * 19, 9));
        assert_eq!(
            pool[0].metadata.name.as_deref(),
            Some("node-a-gpu.tessera.dev")
        );
        // Every device's counter set exists in the pool, and every MIG device has the
        // attributes and capacities a class or claim selects by.
        let set_names: BTreeSet<&str> = pool
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .map(|c| c.name.as_str())
            .collect();
        for d in pool.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
            for c in d.consumes_counters.iter().flatten() {
                assert!(set_names.contains(c.counter_set.as_str()));
            }
            let a = d.attributes.as_ref().unwrap();
            let cap = d.capacity.as_ref().unwrap();
            assert_eq!(d.allow_multiple_allocations, Some(true));
            assert!(cap.contains_key("shares") && cap.contains_key("memory"));
            if parse_mig_device_name(&d.name).is_some() {
                assert_eq!(a["type"].string.as_deref(), Some(TYPE_MIG));
                assert!(a["profile"].string.is_some() && a["parentUUID"].string.is_some());
                assert!(
                    !a.contains_key("uuid"),
                    "a dynamic partition has no UUID yet"
                );
            } else {
                assert_eq!(a["type"].string.as_deref(), Some(TYPE_GPU));
            }
        }
        // A 1g.18gb partition offers its own 16 GiB, not the card's.
        let one = pool
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .find(|d| d.name == mig_device_name(0, "1g.18gb", 0))
            .unwrap();
        assert_eq!(one.capacity.as_ref().unwrap()["memory"].value.0, "16Gi");
        // Without MIG, one slice as before.
        let plain = crate::slices::pool(
            "node-a",
            &[h200_gpu(0, MigMode::Off)],
            crate::slices::DEFAULT_MEMORY,
            1,
        );
        assert_eq!(plain.len(), 1);
        assert!(plain[0].spec.shared_counters.is_none());
    }

    #[test]
    fn static_mode_publishes_the_existing_instances_each_shareable() {
        let inst = Instance {
            profile: "3g.71gb".into(),
            placement: Placement { start: 4, size: 4 },
            uuid: "MIG-abc".into(),
            memory: 71680 << 20,
        };
        let pool = crate::slices::pool(
            "node-a",
            &[h200_gpu(0, MigMode::Static(vec![inst]))],
            crate::slices::DEFAULT_MEMORY,
            1,
        );
        assert_eq!(pool.len(), 1, "no counters without partitionable devices");
        let ds = pool[0].spec.devices.as_ref().unwrap();
        assert_eq!(
            ds.len(),
            1,
            "the whole GPU is not published beside its instances"
        );
        assert_eq!(ds[0].name, "gpu-0-mig-3g-71gb-4");
        assert_eq!(ds[0].allow_multiple_allocations, Some(true));
        assert!(ds[0].consumes_counters.is_none());
        let a = ds[0].attributes.as_ref().unwrap();
        assert_eq!(a["uuid"].string.as_deref(), Some("MIG-abc"));
        assert_eq!(a["parentUUID"].string.as_deref(), Some("GPU-0"));
    }

    #[test]
    fn an_allocated_device_keeps_its_counters_until_released() {
        let was = crate::slices::pool(
            "node-a",
            &[
                h200_gpu(0, MigMode::Dynamic(h200())),
                h200_gpu(1, MigMode::Dynamic(h200())),
            ],
            crate::slices::DEFAULT_MEMORY,
            1,
        );
        // Both GPUs turned off MIG (a configuration change); a claim holds a 1g of GPU 0.
        let next = || {
            crate::slices::pool_parts(
                &[h200_gpu(0, MigMode::Off), h200_gpu(1, MigMode::Off)],
                crate::slices::DEFAULT_MEMORY,
            )
        };
        let held_name = mig_device_name(0, "1g.18gb", 3);
        let (mut devices, mut sets) = next();
        let held = hold_allocated(
            &mut devices,
            &mut sets,
            &was,
            &BTreeSet::from([held_name.clone()]),
        );
        assert_eq!(held, BTreeSet::from([0]));
        let want = crate::slices::layout("node-a", devices, sets, 2);
        let all: BTreeMap<&str, &Device> = want
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| (d.name.as_str(), d))
            .collect();
        let was_all: BTreeMap<&str, &Device> = was
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| (d.name.as_str(), d))
            .collect();
        // GPU 0 as published (its partitions, its whole device with counters, its set)...
        assert_eq!(all[held_name.as_str()], was_all[held_name.as_str()]);
        assert_eq!(all["gpu-0"], was_all["gpu-0"]);
        assert_eq!(all.len(), 19 + 1);
        assert!(
            want.iter()
                .flat_map(|s| s.spec.shared_counters.iter().flatten())
                .any(|c| c.name == counter_set_name(0))
        );
        // ...GPU 1 as asked: no MIG.
        assert!(all["gpu-1"].consumes_counters.is_none());
        assert!(!all.contains_key(mig_device_name(1, "1g.18gb", 0).as_str()));
        // Nothing held: the change goes through.
        let (mut devices, mut sets) = next();
        assert!(hold_allocated(&mut devices, &mut sets, &was, &BTreeSet::new()).is_empty());
        assert_eq!((devices, sets), next());
        // Held but unchanged (the same definition published again): nothing to hold.
        let (mut devices, mut sets) = crate::slices::pool_parts(
            &[
                h200_gpu(0, MigMode::Dynamic(h200())),
                h200_gpu(1, MigMode::Dynamic(h200())),
            ],
            crate::slices::DEFAULT_MEMORY,
        );
        let held = hold_allocated(&mut devices, &mut sets, &was, &BTreeSet::from([held_name]));
        assert!(held.is_empty());
    }

    #[test]
    fn a_claim_on_a_partition_is_planned_against_the_instance_not_the_card() {
        use k8s_openapi::api::resource::v1::{
            AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim,
            ResourceClaimStatus,
        };
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let gpus = [h200_gpu(0, MigMode::Dynamic(h200()))];
        let node = crate::slices::node_devices(&gpus);
        let claim = |device: &str, memory: &str| ResourceClaim {
            metadata: ObjectMeta {
                uid: Some("u1".into()),
                ..Default::default()
            },
            status: Some(ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(vec![DeviceRequestAllocationResult {
                            driver: crate::claim::DRIVER.into(),
                            pool: "node-a".into(),
                            device: device.into(),
                            request: "gpu".into(),
                            consumed_capacity: Some(BTreeMap::from([
                                ("shares".into(), Quantity("50".into())),
                                ("memory".into(), Quantity(memory.into())),
                            ])),
                            ..Default::default()
                        }]),
                        config: None,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let plan = |device: &str, memory: &str| {
            crate::claim::plan(
                &claim(device, memory),
                "u1",
                "node-a",
                &node,
                crate::slices::DEFAULT_MEMORY,
            )
        };
        let name = mig_device_name(0, "1g.18gb", 3);
        let p = plan(&name, "8Gi").unwrap().remove(0);
        assert_eq!((p.share, p.memory_limit, p.whole), (50, 8 << 30, false));
        match &p.kind {
            crate::claim::Kind::Partition(w) => {
                assert_eq!(w.parent, "GPU-0");
                assert_eq!((w.profile.as_str(), w.profile_id), ("1g.18gb", 19));
                assert_eq!(w.placement, Placement { start: 3, size: 1 });
            }
            k => panic!("{k:?}"),
        }
        // More memory than the instance has (16 GiB) is refused, though the card has 140.
        assert!(matches!(
            plan(&name, "20Gi"),
            Err(crate::claim::ClaimError::Memory { total, .. }) if total == 16 << 30
        ));
        // The whole device of a dynamic GPU turns MIG off at prepare.
        let p = plan("gpu-0", "8Gi").unwrap().remove(0);
        assert_eq!(p.kind, crate::claim::Kind::DynamicWhole);
        // A partition this GPU's geometry does not have is no device of the node.
        assert!(plan("gpu-0-mig-3g-71gb-2", "8Gi").is_err());
    }
}
