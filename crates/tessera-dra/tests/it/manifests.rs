//! Every manifest in `deploy/dra/` is valid `resource.k8s.io/v1` (and core, apps, RBAC)
//! Kubernetes at the API level k8s-openapi's `v1_35` feature describes: each YAML document
//! is deserialised into its k8s-openapi type and serialised back, and must equal the input
//! exactly, so an unknown or misspelled field (which serde would drop) fails. Plus what a
//! schema cannot check: the classes the examples name exist, capacity requests are on the
//! steps the slice publishes, and the DaemonSet's flags point at the kubelet's folders.
//!
//! The same manifests, and the ResourceSlice the plugin publishes, are also checked against
//! the upstream OpenAPI schemas of Kubernetes 1.34 and 1.37 by `kubernetes-validate --strict`
//! (PyPI, in `.ci/requirements.txt`; run by the Python of `tessera_testkit::python`, and the
//! test fails, never skips, without it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceRequest, ResourceClaim, ResourceClaimTemplate,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tessera_dra::quantity;
use tessera_dra::slices::MEMORY_STEP;

fn dra_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/dra")
}

/// `doc` as `T`, which must serialise back to exactly `doc`.
fn typed<T: DeserializeOwned + Serialize>(doc: &Value, file: &str) -> T {
    let t: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{file}: {}: {e}", doc["kind"]));
    let back = serde_json::to_value(&t).unwrap();
    assert_eq!(
        &back, doc,
        "{file}: {} does not round-trip (unknown or misspelled field?)",
        doc["kind"]
    );
    t
}

#[derive(Default)]
struct All {
    classes: Vec<DeviceClass>,
    requests: Vec<DeviceRequest>,
    pods: Vec<Pod>,
    daemonsets: Vec<DaemonSet>,
    kinds: BTreeSet<String>,
}

fn load() -> All {
    let mut all = All::default();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dra_dir())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(f).unwrap();
        for de in serde_yaml_ng::Deserializer::from_str(&text) {
            let doc: Value = serde::Deserialize::deserialize(de).unwrap();
            let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
            match kind.as_str() {
                "DeviceClass" => all.classes.push(typed(&doc, &name)),
                "ResourceClaimTemplate" => {
                    let t: ResourceClaimTemplate = typed(&doc, &name);
                    all.requests
                        .extend(t.spec.spec.devices.unwrap().requests.unwrap());
                }
                "ResourceClaim" => {
                    let c: ResourceClaim = typed(&doc, &name);
                    all.requests
                        .extend(c.spec.devices.unwrap().requests.unwrap());
                }
                "Pod" => all.pods.push(typed(&doc, &name)),
                "DaemonSet" => all.daemonsets.push(typed(&doc, &name)),
                "ServiceAccount" => drop(typed::<ServiceAccount>(&doc, &name)),
                "ClusterRole" => drop(typed::<ClusterRole>(&doc, &name)),
                "ClusterRoleBinding" => drop(typed::<ClusterRoleBinding>(&doc, &name)),
                other => panic!("{name}: unexpected kind {other:?}"),
            }
            all.kinds.insert(kind);
        }
    }
    all
}

#[test]
fn dra_manifests_round_trip_and_name_what_exists() {
    let all = load();
    for k in [
        "DeviceClass",
        "ResourceClaimTemplate",
        "Pod",
        "DaemonSet",
        "ClusterRole",
    ] {
        assert!(all.kinds.contains(k), "no {k} in deploy/dra");
    }
    let classes: BTreeSet<String> = all
        .classes
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    assert!(classes.contains("gpu.tessera.dev"));
    for c in &all.classes {
        for s in c.spec.selectors.as_deref().unwrap_or_default() {
            let e = &s.cel.as_ref().unwrap().expression;
            assert!(e.contains("device.driver == \"gpu.tessera.dev\""), "{e}");
        }
    }
    assert!(all.requests.len() >= 4);
    for r in &all.requests {
        let ex = r.exactly.as_ref().expect("exact requests");
        assert!(
            classes.contains(&ex.device_class_name),
            "{}",
            ex.device_class_name
        );
        let Some(req) = ex.capacity.as_ref().and_then(|c| c.requests.as_ref()) else {
            continue;
        };
        // Either may be left out (the slice's default is charged then).
        if let Some(q) = req.get("shares") {
            let shares = quantity::parse(&q.0).unwrap();
            assert!((1..=100).contains(&shares), "{shares}");
        }
        if let Some(q) = req.get("memory") {
            let mem = quantity::parse(&q.0).unwrap();
            assert!(mem > 0 && mem.is_multiple_of(MEMORY_STEP), "{mem}");
        }
        assert!(
            req.keys().all(|k| k == "shares" || k == "memory"),
            "{req:?}"
        );
    }
    // The documented requests are there: memory only ("20 GiB of any GPU", a fraction at the
    // default share) and a whole GPU (all 100 shares).
    let asks: Vec<BTreeSet<(&str, &str)>> = all
        .requests
        .iter()
        .filter_map(|r| r.exactly.as_ref()?.capacity.as_ref()?.requests.as_ref())
        .map(|req| {
            req.iter()
                .map(|(k, v)| (k.as_str(), v.0.as_str()))
                .collect()
        })
        .collect();
    assert!(
        asks.contains(&BTreeSet::from([("memory", "20Gi")])),
        "{asks:?}"
    );
    assert!(
        asks.contains(&BTreeSet::from([("shares", "100")])),
        "{asks:?}"
    );
    // Each example pod's containers use the claims the pod declares.
    for p in &all.pods {
        let spec = p.spec.as_ref().unwrap();
        let declared: BTreeSet<&str> = spec
            .resource_claims
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        for c in &spec.containers {
            for used in c
                .resources
                .as_ref()
                .and_then(|r| r.claims.as_ref())
                .unwrap()
            {
                assert!(declared.contains(used.name.as_str()), "{}", used.name);
            }
        }
    }
    // The plugin's flags point where its volumes are mounted.
    let ds = &all.daemonsets[0];
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let plugin = pod
        .containers
        .iter()
        .find(|c| c.name == "dra-plugin")
        .unwrap();
    let cmd = plugin.command.as_ref().unwrap().join(" ");
    let mounts: Vec<&str> = plugin
        .volume_mounts
        .as_deref()
        .unwrap()
        .iter()
        .map(|m| m.mount_path.as_str())
        .collect();
    for (flag, path) in [
        ("--registry-dir=", "/var/lib/kubelet/plugins_registry"),
        ("--plugin-dir=", "/var/lib/kubelet/plugins/gpu.tessera.dev"),
        ("--cdi-dir=", "/var/run/cdi"),
    ] {
        assert!(cmd.contains(&format!("{flag}{path}")), "{cmd}");
        assert!(mounts.contains(&path), "{path} not mounted: {mounts:?}");
    }
}

#[test]
fn manifests_and_the_published_slice_pass_the_upstream_schemas_of_1_34_and_1_37() {
    use tessera_dra::slices::{self, GpuAttrs};
    let python = tessera_testkit::python();
    let has = std::process::Command::new(&python)
        .args(["-c", "import kubernetes_validate"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        has,
        "{} lacks kubernetes-validate: pip install -r .ci/requirements.txt",
        python.display()
    );
    let gpu = |index: u32, unhealthy: Option<&str>| GpuAttrs {
        index,
        uuid: format!("GPU-{index}0000000-0000-0000-0000-000000000000"),
        product_name: "NVIDIA H100 80GB HBM3".into(),
        memory_total: 81559 << 20,
        compute_capability: (9, 0),
        driver_version: "570.124.06".into(),
        pci_bus_id: format!("0000:{:02x}:00.0", index + 1),
        numa_node: Some(0),
        pcie_root: Some("pci0000:00".into()),
        unhealthy: unhealthy.map(str::to_owned),
        mig: tessera_dra::mig::MigMode::Off,
    };
    let slice = slices::slice(
        "node-a",
        &[gpu(0, None), gpu(1, Some("XID 79"))],
        1 << 30,
        3,
    );
    let tmp = tempfile::tempdir().unwrap();
    let slice_file = tmp.path().join("slice.json");
    std::fs::write(&slice_file, serde_json::to_vec(&slice).unwrap()).unwrap();
    // A MIG pool: a dynamic GPU (its counter slice apart) and a static one.
    use tessera_dra::mig::{Geometry, Instance, MigMode, Placement, Profile};
    let profile = |id, name: &str, c, mib: u64, size, starts: &[u32]| Profile {
        id,
        name: name.into(),
        compute_slices: c,
        memory: mib << 20,
        multiprocessors: 16 * c,
        placements: starts
            .iter()
            .map(|&start| Placement { start, size })
            .collect(),
    };
    let geo = Geometry::of(vec![
        profile(19, "1g.18gb", 1, 16384, 1, &[0, 1, 2, 3, 4, 5, 6]),
        profile(0, "7g.141gb", 7, 143360, 8, &[0]),
    ])
    .unwrap();
    let mut dynamic = gpu(2, None);
    dynamic.mig = MigMode::Dynamic(geo);
    let mut fixed = gpu(3, None);
    fixed.mig = MigMode::Static(vec![Instance {
        profile: "1g.18gb".into(),
        placement: Placement { start: 6, size: 1 },
        uuid: "MIG-00000000-0000-0000-0000-000000000000".into(),
        memory: 16384 << 20,
    }]);
    let pool = slices::pool("node-b", &[dynamic, fixed], 1 << 30, 1);
    assert_eq!(pool.len(), 2);
    let mut pool_files = Vec::new();
    for (k, s) in pool.iter().enumerate() {
        let f = tmp.path().join(format!("pool-{k}.json"));
        std::fs::write(&f, serde_json::to_vec(s).unwrap()).unwrap();
        pool_files.push(f);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dra_dir())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("yaml"))
        .collect();
    files.sort();
    files.push(slice_file);
    files.extend(pool_files);
    for version in ["1.34.0", "1.37.0"] {
        let out = std::process::Command::new(&python)
            .args(["-m", "kubernetes_validate", "--strict", "-k", version])
            .args(&files)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "kubernetes-validate {version}:\n{text}"
        );
        for name in [
            "node-a-gpu.tessera.dev",
            "node-b-gpu.tessera.dev",
            "node-b-gpu.tessera.dev-counters-0",
        ] {
            assert!(text.contains(&format!("resourceslice/{name}")), "{text}");
        }
        assert!(
            !text.contains("ERROR") && !text.contains("WARN"),
            "{version}:\n{text}"
        );
    }
}
