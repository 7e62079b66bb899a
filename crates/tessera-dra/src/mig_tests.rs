//! Tests of the MIG rules ([`crate::mig`]) together with the ResourceSlice pool built on them
//! ([`crate::slices`]): a module of its own, since `slices` builds on `mig` and not the other way.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::mig::*;

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
    assert_eq!(c.named(), [("--mig-dynamic", 0), ("--mig-static", 1)]);
    let both = MigConfig {
        dynamic: GpuSet::All,
        fixed: p(&["1"]).unwrap(),
    };
    assert!(both.validate().is_err());
    assert_eq!(
        both.named(),
        [("--mig-static", 1)],
        "`all` names no GPU by index"
    );
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

fn mig_h200_gpu(index: u32) -> crate::slices::GpuAttrs {
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
        mig: crate::mig::MigMode::Dynamic(crate::mig::h200()),
    }
}

/// A claim on a MIG partition is planned against the instance (the claim rules on the
/// published MIG devices).
#[test]
fn a_claim_on_a_partition_is_planned_against_the_instance_not_the_card() {
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim,
        ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let gpus = [mig_h200_gpu(0)];
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
    let name = crate::mig::mig_device_name(0, "1g.18gb", 3);
    let p = plan(&name, "8Gi").unwrap().remove(0);
    assert_eq!((p.share, p.memory_limit, p.whole), (50, 8 << 30, false));
    match &p.kind {
        crate::claim::Kind::Partition(w) => {
            assert_eq!(w.parent, "GPU-0");
            assert_eq!((w.profile.as_str(), w.profile_id), ("1g.18gb", 19));
            assert_eq!(w.placement, crate::mig::Placement { start: 3, size: 1 });
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
