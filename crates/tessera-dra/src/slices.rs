//! Pure rules: this node's ResourceSlice from its GPUs.
//!
//! One slice, one pool (named after the node), one device per GPU (`gpu-<index>`), each with
//! `allowMultipleAllocations: true` and two consumable capacities (KEP-5075):
//! - `shares`: 100, requests 1..=100 in steps of 1, default [`DEFAULT_SHARES`] (10). The
//!   scheduler charges a request that does not name a capacity its `requestPolicy.default`
//!   (k8s.io/dynamic-resource-allocation v0.36.3
//!   `structured/internal/incubating/consumable_capacity.go`, `fillEmptyRequest`), so a claim
//!   that names only memory is a fraction of the card, and a whole GPU is `shares: 100`;
//! - `memory`: the card's bytes, requests in steps of [`MEMORY_STEP`] from one step up to the
//!   card (rounded down to a step), default [`DEFAULT_MEMORY`] unless configured.
//!
//! Attributes for CEL selectors: `uuid`, `productName`, `architecture`, `index`, `numaNode`,
//! `cudaComputeCapability` and `driverVersion` as semantic versions, and the standard
//! `resource.kubernetes.io/pciBusID` and (where sysfs shows one) `resource.kubernetes.io/pcieRoot`. An unhealthy GPU stays listed with a `NoSchedule`
//! taint, so the scheduler places nothing new on it.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, CounterSet, Device, DeviceAttribute,
    DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::claim::{
    CAPACITY_MEMORY, CAPACITY_SHARES, DEFAULT_SHARES, DRIVER, SHARES_PER_GPU, device_name,
};
use crate::mig::{self, MigMode};
use crate::quantity::format_bytes;

/// Granularity of memory requests.
pub const MEMORY_STEP: u64 = 256 << 20;
/// Memory of a fraction whose claim names none (1 GiB): small, so a claim that forgot its
/// memory cannot take a card's memory from its neighbours; it fails early and visibly.
pub const DEFAULT_MEMORY: u64 = 1 << 30;
/// Taint key of an unhealthy GPU.
pub const TAINT_UNHEALTHY: &str = "gpu.tessera.dev/unhealthy";
/// The standard attribute of the PCIe root complex (GPUs and NICs on one root share it).
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The upstream limit of devices in one slice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;

/// A GPU with what the slice says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuAttrs {
    /// NVML index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Product name (`NVIDIA H100 80GB HBM3`).
    pub product_name: String,
    /// Card memory, bytes.
    pub memory_total: u64,
    /// CUDA compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
    /// Driver version as NVML reports it (`570.124.06`).
    pub driver_version: String,
    /// PCI bus id, `dddd:bb:dd.f` lower case.
    pub pci_bus_id: String,
    /// NUMA node, if the platform has one.
    pub numa_node: Option<i64>,
    /// PCIe root complex (`pci0000:00`), if sysfs shows one.
    pub pcie_root: Option<String>,
    /// Why it is unhealthy, if it is.
    pub unhealthy: Option<String>,
    /// How its MIG partitions are published ([`crate::mig`]).
    pub mig: MigMode,
}

/// The architecture name of a compute capability (NVIDIA's CUDA GPU list).
pub fn architecture(cc: (u32, u32)) -> &'static str {
    match cc {
        (7, 0) | (7, 2) => "Volta",
        (7, 5) => "Turing",
        (8, 9) => "Ada Lovelace",
        (8, _) => "Ampere",
        (9, _) => "Hopper",
        (10, _) | (11, _) | (12, _) => "Blackwell",
        _ => "Unknown",
    }
}

/// `text` (dot-separated numbers, leading zeros allowed) as a semantic version `x.y.z`;
/// `None` if it is not numeric.
pub fn semver(text: &str) -> Option<String> {
    let parts: Vec<u64> = text
        .trim()
        .split('.')
        .map(|p| p.parse::<u64>().ok())
        .collect::<Option<_>>()?;
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let get = |i: usize| parts.get(i).copied().unwrap_or(0);
    Some(format!("{}.{}.{}", get(0), get(1), get(2)))
}

/// NVML's bus id (`00000000:3B:00.0`) in the form the standard attribute and sysfs use
/// (`0000:3b:00.0`).
pub fn normalize_bus_id(nvml: &str) -> String {
    let lower = nvml.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

fn q(v: impl Into<String>) -> Quantity {
    Quantity(v.into())
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

fn attr_version(v: String) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v),
        ..Default::default()
    }
}

/// The `shares` and `memory` capacities of a device of `memory_total` bytes (a whole GPU or
/// a MIG instance): 100 shares, memory in steps of [`MEMORY_STEP`] up to the device.
pub fn capacities(memory_total: u64, default_memory: u64) -> BTreeMap<String, DeviceCapacity> {
    let max_memory = (memory_total / MEMORY_STEP).max(1) * MEMORY_STEP;
    BTreeMap::from([
        (
            CAPACITY_SHARES.to_owned(),
            DeviceCapacity {
                value: q(SHARES_PER_GPU.to_string()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(q(DEFAULT_SHARES.to_string())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: q("1"),
                        max: Some(q(SHARES_PER_GPU.to_string())),
                        step: Some(q("1")),
                    }),
                    valid_values: None,
                }),
            },
        ),
        (
            CAPACITY_MEMORY.to_owned(),
            DeviceCapacity {
                value: q(format_bytes(memory_total)),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(q(format_bytes(default_memory.min(max_memory)))),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: q(format_bytes(MEMORY_STEP)),
                        max: Some(q(format_bytes(max_memory))),
                        step: Some(q(format_bytes(MEMORY_STEP))),
                    }),
                    valid_values: None,
                }),
            },
        ),
    ])
}

/// The slice's device for `g`.
pub fn device(g: &GpuAttrs, default_memory: u64) -> Device {
    let mut attributes = BTreeMap::from([
        ("uuid".to_owned(), attr_string(&g.uuid)),
        ("productName".to_owned(), attr_string(&g.product_name)),
        (
            "architecture".to_owned(),
            attr_string(architecture(g.compute_capability)),
        ),
        ("index".to_owned(), attr_int(i64::from(g.index))),
        (
            "cudaComputeCapability".to_owned(),
            attr_version(format!(
                "{}.{}.0",
                g.compute_capability.0, g.compute_capability.1
            )),
        ),
        (
            "resource.kubernetes.io/pciBusID".to_owned(),
            attr_string(&g.pci_bus_id),
        ),
    ]);
    if let Some(v) = semver(&g.driver_version) {
        attributes.insert("driverVersion".to_owned(), attr_version(v));
    }
    if let Some(n) = g.numa_node {
        attributes.insert("numaNode".to_owned(), attr_int(n));
    }
    if let Some(r) = &g.pcie_root {
        attributes.insert(PCIE_ROOT.to_owned(), attr_string(r));
    }
    attributes.insert("type".to_owned(), attr_string(mig::TYPE_GPU));
    let capacity = capacities(g.memory_total, default_memory);
    Device {
        name: device_name(g.index),
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(capacity),
        taints: g.unhealthy.as_ref().map(|_| {
            vec![DeviceTaint {
                key: TAINT_UNHEALTHY.to_owned(),
                effect: "NoSchedule".to_owned(),
                value: None,
                time_added: None,
            }]
        }),
        ..Default::default()
    }
}

/// The name of `node`'s slice (the node name is a DNS subdomain, so this is one too).
pub fn slice_name(node: &str) -> String {
    format!("{node}-gpu.tessera.dev")
}

/// The devices of GPU `g` ([`crate::mig`]): the whole GPU (unless static MIG publishes only its
/// instances), then its MIG devices; with dynamic MIG every one of them consumes counters.
pub fn gpu_devices(g: &GpuAttrs, default_memory: u64) -> Vec<Device> {
    let whole = device(g, default_memory);
    let cap = |memory: u64| capacities(memory, default_memory);
    match &g.mig {
        MigMode::Off => vec![whole],
        MigMode::Dynamic(geo) => {
            let mut out = Vec::with_capacity(1 + mig::partitions(geo).count());
            for (p, pl) in mig::partitions(geo) {
                let mut d = mig::mig_device(
                    &whole,
                    mig::mig_device_name(g.index, &p.name, pl.start),
                    &p.name,
                    pl,
                    &g.uuid,
                    cap,
                    p.memory,
                );
                d.consumes_counters = Some(vec![mig::consumption(g.index, p.compute_slices, pl)]);
                out.push(d);
            }
            let mut whole = whole;
            whole.consumes_counters = Some(vec![mig::whole_consumption(g.index, geo)]);
            out.insert(0, whole);
            out
        }
        MigMode::Static(instances) => instances
            .iter()
            .map(|i| {
                let mut d = mig::mig_device(
                    &whole,
                    mig::mig_device_name(g.index, &i.profile, i.placement.start),
                    &i.profile,
                    i.placement,
                    &g.uuid,
                    cap,
                    i.memory,
                );
                let attrs = d.attributes.get_or_insert_with(BTreeMap::new);
                attrs.insert("uuid".to_owned(), attr_string(&i.uuid));
                d
            })
            .collect(),
    }
}

/// Every device of `gpus` as claims name it, with what preparing it involves: a whole GPU,
/// a dynamic MIG partition (its instance made at prepare) or a static instance (by its UUID).
pub fn node_devices(gpus: &[GpuAttrs]) -> Vec<crate::claim::NodeGpu> {
    use crate::claim::{Kind, NodeGpu};
    let mut out = Vec::new();
    for g in gpus {
        let whole = |kind| NodeGpu {
            device: device_name(g.index),
            uuid: g.uuid.clone(),
            memory_total: g.memory_total,
            unhealthy: g.unhealthy.clone(),
            kind,
        };
        match &g.mig {
            MigMode::Off => out.push(whole(Kind::Plain)),
            MigMode::Dynamic(geo) => {
                out.push(whole(Kind::DynamicWhole));
                for (p, pl) in mig::partitions(geo) {
                    out.push(NodeGpu {
                        device: mig::mig_device_name(g.index, &p.name, pl.start),
                        uuid: g.uuid.clone(),
                        memory_total: p.memory,
                        unhealthy: g.unhealthy.clone(),
                        kind: Kind::Partition(crate::instances::Want {
                            parent: g.uuid.clone(),
                            profile: p.name.clone(),
                            profile_id: p.id,
                            placement: pl,
                        }),
                    });
                }
            }
            MigMode::Static(instances) => {
                for i in instances {
                    out.push(NodeGpu {
                        device: mig::mig_device_name(g.index, &i.profile, i.placement.start),
                        uuid: i.uuid.clone(),
                        memory_total: i.memory,
                        unhealthy: g.unhealthy.clone(),
                        kind: Kind::Plain,
                    });
                }
            }
        }
    }
    out
}

/// The name of `node`'s `k`th device slice (the first is [`slice_name`]).
pub fn device_slice_name(node: &str, k: usize) -> String {
    match k {
        0 => slice_name(node),
        _ => format!("{}-{k}", slice_name(node)),
    }
}

/// The name of `node`'s `k`th counter slice.
pub fn counter_slice_name(node: &str, k: usize) -> String {
    format!("{}-counters-{k}", slice_name(node))
}

fn pool_slice(node: &str, name: String, generation: i64) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool {
                name: node.to_owned(),
                generation,
                resource_slice_count: 1,
            },
            ..Default::default()
        },
    }
}

/// What `node`'s pool publishes: every GPU's devices ([`gpu_devices`], in GPU order) and the
/// dynamic MIG GPUs' counter sets.
pub fn pool_parts(gpus: &[GpuAttrs], default_memory: u64) -> (Vec<Device>, Vec<CounterSet>) {
    let devices = gpus
        .iter()
        .flat_map(|g| gpu_devices(g, default_memory))
        .collect();
    let sets = gpus
        .iter()
        .filter_map(|g| match &g.mig {
            MigMode::Dynamic(geo) => Some(mig::counter_set(g.index, geo)),
            _ => None,
        })
        .collect();
    (devices, sets)
}

/// The most devices a slice holding `ds` may have (upstream: 128, or 64 when any consumes
/// counters or has a taint).
fn device_limit<'a>(mut ds: impl Iterator<Item = &'a Device>) -> usize {
    if ds.any(|d| d.consumes_counters.is_some() || d.taints.is_some()) {
        mig::MAX_COUNTER_DEVICES_PER_SLICE
    } else {
        MAX_DEVICES_PER_SLICE
    }
}

/// Appends one GPU's `group` of devices to the last of `slices`, or to a new one when it does
/// not fit whole (a group larger than a slice is split).
fn place(slices: &mut Vec<Vec<Device>>, group: Vec<Device>) {
    let cur = slices.last().expect("never empty");
    if !cur.is_empty() && cur.len() + group.len() > device_limit(cur.iter().chain(&group)) {
        slices.push(Vec::new());
    }
    for d in group {
        let cur = slices.last().expect("never empty");
        if cur.len() >= device_limit(cur.iter().chain([&d])) {
            slices.push(Vec::new());
        }
        slices.last_mut().expect("never empty").push(d);
    }
}

/// `devices` and `sets` as `node`'s pool at `generation`: device slices (each GPU's devices
/// together; at most [`MAX_DEVICES_PER_SLICE`] devices, [`mig::MAX_COUNTER_DEVICES_PER_SLICE`]
/// where any consumes counters or has a taint), then counter slices (at most
/// [`mig::MAX_COUNTER_SETS_PER_SLICE`] sets a slice: upstream allows devices or counters in one
/// slice, not both). Without counter sets and with few GPUs this is one slice, as before MIG.
pub fn layout(
    node: &str,
    devices: Vec<Device>,
    sets: Vec<CounterSet>,
    generation: i64,
) -> Vec<ResourceSlice> {
    let mut device_slices: Vec<Vec<Device>> = vec![Vec::new()];
    let mut group: Vec<Device> = Vec::new();
    for d in devices {
        if group
            .last()
            .is_some_and(|g| mig::gpu_of_device(&g.name) != mig::gpu_of_device(&d.name))
        {
            place(&mut device_slices, std::mem::take(&mut group));
        }
        group.push(d);
    }
    place(&mut device_slices, group);
    let mut out: Vec<ResourceSlice> = device_slices
        .into_iter()
        .enumerate()
        .map(|(k, devices)| {
            let mut s = pool_slice(node, device_slice_name(node, k), generation);
            s.spec.devices = Some(devices);
            s
        })
        .collect();
    for (k, chunk) in sets.chunks(mig::MAX_COUNTER_SETS_PER_SLICE).enumerate() {
        let mut s = pool_slice(node, counter_slice_name(node, k), generation);
        s.spec.shared_counters = Some(chunk.to_vec());
        out.push(s);
    }
    let count = i64::try_from(out.len()).unwrap_or(i64::MAX);
    for s in &mut out {
        s.spec.pool.resource_slice_count = count;
    }
    out
}

/// `node`'s pool at `generation` ([`pool_parts`] laid out by [`layout`]).
pub fn pool(
    node: &str,
    gpus: &[GpuAttrs],
    default_memory: u64,
    generation: i64,
) -> Vec<ResourceSlice> {
    let (devices, sets) = pool_parts(gpus, default_memory);
    layout(node, devices, sets, generation)
}

/// `node`'s first device slice at pool `generation` (all of the pool when no GPU has MIG).
pub fn slice(node: &str, gpus: &[GpuAttrs], default_memory: u64, generation: i64) -> ResourceSlice {
    pool(node, gpus, default_memory, generation).remove(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn h100(index: u32) -> GpuAttrs {
        GpuAttrs {
            index,
            uuid: format!("GPU-{index}"),
            product_name: "NVIDIA H100 80GB HBM3".into(),
            memory_total: 81559 << 20,
            compute_capability: (9, 0),
            driver_version: "570.124.06".into(),
            pci_bus_id: normalize_bus_id("00000000:3B:00.0"),
            numa_node: Some(0),
            pcie_root: Some("pci0000:3a".into()),
            unhealthy: None,
            mig: MigMode::Off,
        }
    }

    #[test]
    fn versions_bus_ids_and_architectures_normalize() {
        assert_eq!(semver("570.124.06").as_deref(), Some("570.124.6"));
        assert_eq!(semver("550.54").as_deref(), Some("550.54.0"));
        assert_eq!(semver("r570"), None);
        assert_eq!(normalize_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id("0000:3b:00.0"), "0000:3b:00.0");
        assert_eq!(architecture((9, 0)), "Hopper");
        assert_eq!(architecture((8, 9)), "Ada Lovelace");
        assert_eq!(architecture((8, 0)), "Ampere");
    }

    #[test]
    fn device_has_consistent_capacity_policies_and_attributes() {
        let d = device(&h100(3), DEFAULT_MEMORY);
        assert_eq!(d.name, "gpu-3");
        assert_eq!(d.allow_multiple_allocations, Some(true));
        let cap = d.capacity.as_ref().unwrap();
        let mem = &cap["memory"];
        assert_eq!(mem.value.0, format_bytes(81559 << 20));
        let p = mem.request_policy.as_ref().unwrap();
        let r = p.valid_range.as_ref().unwrap();
        let parse = |x: &Quantity| crate::quantity::parse(&x.0).unwrap();
        let (min, max, step, def) = (
            parse(&r.min),
            parse(r.max.as_ref().unwrap()),
            parse(r.step.as_ref().unwrap()),
            parse(p.default.as_ref().unwrap()),
        );
        // Upstream validation: default inside the range and on a step from min.
        assert!(min <= def && def <= max && (def - min).is_multiple_of(step));
        assert!((max - min).is_multiple_of(step) && max <= 81559 << 20);
        let shares = &cap["shares"];
        assert_eq!(shares.value.0, "100");
        assert_eq!(
            shares
                .request_policy
                .as_ref()
                .unwrap()
                .default
                .as_ref()
                .unwrap()
                .0,
            "10"
        );
        let a = d.attributes.as_ref().unwrap();
        assert_eq!(a["driverVersion"].version.as_deref(), Some("570.124.6"));
        assert_eq!(a["cudaComputeCapability"].version.as_deref(), Some("9.0.0"));
        assert_eq!(
            a["resource.kubernetes.io/pciBusID"].string.as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(a[PCIE_ROOT].string.as_deref(), Some("pci0000:3a"));
        assert_eq!(a["architecture"].string.as_deref(), Some("Hopper"));
        assert!(d.taints.is_none());
        let mut no_root = h100(0);
        no_root.pcie_root = None;
        let d = device(&no_root, DEFAULT_MEMORY);
        assert!(!d.attributes.unwrap().contains_key(PCIE_ROOT));
        let mut bad = h100(0);
        bad.unhealthy = Some("XID 79".into());
        let t = device(&bad, DEFAULT_MEMORY).taints.unwrap();
        assert_eq!(
            (t[0].key.as_str(), t[0].effect.as_str()),
            (TAINT_UNHEALTHY, "NoSchedule")
        );
    }

    #[test]
    fn slice_is_one_pool_on_the_node() {
        let s = slice("node-a", &[h100(0), h100(1)], DEFAULT_MEMORY, 4);
        assert_eq!(s.metadata.name.as_deref(), Some("node-a-gpu.tessera.dev"));
        assert_eq!(s.spec.driver, DRIVER);
        assert_eq!(s.spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(
            (s.spec.pool.name.as_str(), s.spec.pool.generation),
            ("node-a", 4)
        );
        assert_eq!(s.spec.devices.as_ref().unwrap().len(), 2);
    }

    /// What the scheduler writes into a result's `consumedCapacity` for a request on `d`
    /// (k8s.io/dynamic-resource-allocation v0.36.3
    /// `structured/internal/incubating/consumable_capacity.go`, `GetConsumedCapacityFromRequest`
    /// and `calculateConsumedCapacity`): every capacity of the device; a named one rounded up
    /// onto its `validRange` (min, then steps from min); an unnamed one at its
    /// `requestPolicy.default`, or the whole value without one.
    fn scheduler_consumes(d: &Device, requests: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        let parse = |x: &Quantity| crate::quantity::parse(&x.0).unwrap();
        d.capacity
            .as_ref()
            .unwrap()
            .iter()
            .map(|(name, cap)| {
                let policy = cap.request_policy.as_ref();
                let v = match requests.iter().find(|(n, _)| n == name) {
                    None => policy
                        .and_then(|p| p.default.as_ref())
                        .map_or_else(|| parse(&cap.value), parse),
                    Some((_, asked)) => {
                        let asked = crate::quantity::parse(asked).unwrap();
                        match policy.and_then(|p| p.valid_range.as_ref()) {
                            None => asked,
                            Some(r) => {
                                let (min, step) = (parse(&r.min), r.step.as_ref().map(parse));
                                match step {
                                    _ if asked < min => min,
                                    None => asked,
                                    Some(step) => min + (asked - min).div_ceil(step) * step,
                                }
                            }
                        }
                    }
                };
                (name.clone(), q(format_bytes(v)))
            })
            .collect()
    }

    /// The plan of one result on `d` (GPU `g`) with `consumed`.
    fn planned(g: &GpuAttrs, consumed: BTreeMap<String, Quantity>) -> crate::claim::Planned {
        use k8s_openapi::api::resource::v1::{
            AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim,
            ResourceClaimStatus,
        };
        let claim = ResourceClaim {
            metadata: ObjectMeta {
                uid: Some("u1".into()),
                ..Default::default()
            },
            status: Some(ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(vec![DeviceRequestAllocationResult {
                            driver: DRIVER.into(),
                            pool: "node-a".into(),
                            device: device_name(g.index),
                            request: "gpu".into(),
                            consumed_capacity: Some(consumed),
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
        let node = [crate::claim::NodeGpu {
            device: device_name(g.index),
            uuid: g.uuid.clone(),
            memory_total: g.memory_total,
            unhealthy: None,
            kind: crate::claim::Kind::Plain,
        }];
        let mut p = crate::claim::plan(&claim, "u1", "node-a", &node, DEFAULT_MEMORY).unwrap();
        p.remove(0)
    }

    #[test]
    fn a_claim_naming_only_memory_is_charged_and_given_a_fraction_not_the_card() {
        const GIB: u64 = 1 << 30;
        let g = h100(0);
        let d = device(&g, DEFAULT_MEMORY);
        let parse = |x: &Quantity| crate::quantity::parse(&x.0).unwrap();

        // "20 GiB of any GPU": the scheduler charges the default share, not all 100.
        let consumed = scheduler_consumes(&d, &[("memory", "20Gi")]);
        assert_eq!(parse(&consumed["shares"]), DEFAULT_SHARES);
        assert_eq!(parse(&consumed["memory"]), 20 * GIB);
        let p = planned(&g, consumed.clone());
        assert_eq!(
            (u64::from(p.share), p.memory_limit, p.whole),
            (DEFAULT_SHARES, 20 * GIB, false)
        );
        // The card stays open: two more such claims fit beside it, by shares and by memory
        // (with a default of 100 shares not even one more would).
        let (shares, memory) = (
            3 * parse(&consumed["shares"]),
            3 * parse(&consumed["memory"]),
        );
        assert!(shares <= parse(&d.capacity.as_ref().unwrap()["shares"].value));
        assert!(memory <= g.memory_total);

        // A memory that is not on a step is rounded up onto one, and enforced as charged.
        let consumed = scheduler_consumes(&d, &[("memory", "20G")]);
        let p = planned(&g, consumed);
        assert!(p.memory_limit >= 20_000_000_000 && p.memory_limit.is_multiple_of(MEMORY_STEP));

        // A claim that names nothing is the small default fraction; a whole GPU is 100 shares.
        let p = planned(&g, scheduler_consumes(&d, &[]));
        assert_eq!(
            (u64::from(p.share), p.memory_limit, p.whole),
            (DEFAULT_SHARES, DEFAULT_MEMORY, false)
        );
        let p = planned(&g, scheduler_consumes(&d, &[("shares", "100")]));
        assert_eq!(
            (p.share, p.memory_limit, p.whole),
            (100, g.memory_total, true)
        );
    }
}
