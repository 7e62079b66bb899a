//! MIG on a simulated H200 (`1xH200`, the simulator's NVML MIG API): the plugin started with
//! `--mig-dynamic 0` publishes the partitions NVML reports and their counters.

use super::*;

fn h200_node() -> Node {
    Node {
        node: PluginNode::start(NodeOptions {
            gpus: "1xH200",
            dirs: &["registry", "state"],
            ..NodeOptions::default()
        }),
        api: FakeApiServer::start(),
    }
}

/// Starts the plugin with `--mig-dynamic 0` and returns the two slices it publishes (devices
/// and counters), checked against the upstream rules.
async fn published(node: &mut Node, args: &[&str]) -> Vec<Value> {
    node.start_plugin_with(args);
    let slices = {
        let api = &node.api;
        until(20, "the node's ResourceSlices", || {
            let s = api.slices();
            (s.len() == 2).then_some(s)
        })
        .await
    };
    for s in &slices {
        tessera_testkit::apiserver::validate_slice(s).unwrap();
    }
    slices
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partitions_nvml_reports_are_published_with_their_counters() {
    let mut node = h200_node();
    let state = node.path("state");
    let args = ["--mig-dynamic", "0", "--state-dir", state.to_str().unwrap()];
    let slices = published(&mut node, &args).await;
    let devices: Vec<&Value> = slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
        .collect();
    let one = devices
        .iter()
        .find(|d| d["name"] == "gpu-0-mig-1g-18gb-0")
        .expect("a 1g.18gb partition at placement 0");
    assert_eq!(one["attributes"]["type"]["string"], "mig");
    assert_eq!(one["attributes"]["profile"]["string"], "1g.18gb");
    assert_eq!(one["consumesCounters"][0]["counterSet"], "gpu-0-counters");
    let whole = devices.iter().find(|d| d["name"] == "gpu-0").unwrap();
    assert_eq!(whole["attributes"]["type"]["string"], "gpu");
    assert!(whole["consumesCounters"][0]["counters"]["memory-slice-7"].is_object());
    assert!(
        slices
            .iter()
            .any(|s| s["spec"]["sharedCounters"][0]["name"] == "gpu-0-counters")
    );

    // Every H200 profile at every placement beside the whole GPU: 1g.18gb and 1g.18gb+me at
    // 0-6, 1g.35gb at 0/2/4/6, 2g.35gb at 0/2/4, 3g.71gb at 0/4, 4g.71gb and 7g.141gb at 0.
    let names: Vec<&str> = devices.iter().filter_map(|d| d["name"].as_str()).collect();
    assert_eq!(devices.len(), 1 + 7 + 7 + 4 + 3 + 2 + 1 + 1, "{names:?}");
    assert!(names.contains(&"gpu-0-mig-1g-18gb-me-6") && names.contains(&"gpu-0-mig-1g-35gb-6"));
    // MIG was switched on only to read the profiles: off again, nothing made.
    let ck = state.join("mig.json");
    assert!(!ck.exists() || !std::fs::read_to_string(&ck).unwrap().contains("MIG-"));
}

/// The MIG devices of the node's simulated H200, as the simulator's state holds them.
fn instances(node: &Node) -> Vec<(String, String)> {
    let spec = tessera_sim_state::SimSpec::parse("1xH200").unwrap();
    tessera_sim_state::mig::store::load(&node.sim.dir)
        .unwrap()
        .devices(&spec)
        .into_iter()
        .map(|d| (d.profile_name, d.uuid))
        .collect()
}

/// Two 50-share claims on one `1g.18gb` partition: the first prepare makes the instance, the
/// arbiter (started before it existed) takes an allocation on its `MIG-` UUID for each claim,
/// each container is given that device; the last unprepare destroys it and turns MIG off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_fractions_of_one_partition_share_the_instance_prepare_makes() {
    let mut node = h200_node();
    let state = node.path("state");
    let (a, b) = ("uid-mmmmmmm1", "uid-mmmmmmm2");
    let part = "gpu-0-mig-1g-18gb-0";
    node.api
        .put_claim(claim("half-a", a, part, Some(("50", "6Gi"))));
    node.api
        .put_claim(claim("half-b", b, part, Some(("50", "8Gi"))));
    let args = ["--mig-dynamic", "0", "--state-dir", state.to_str().unwrap()];
    published(&mut node, &args).await;
    let mut k = node.kubelet_register().await;
    assert!(instances(&node).is_empty(), "an instance before any claim");

    let r = prepare(&mut k, &[kclaim("half-a", a)]).await;
    assert_eq!(r[a].error, "");
    let made = instances(&node);
    assert_eq!(made.len(), 1, "{made:?}");
    assert_eq!(made[0].0, "1g.18gb");
    let mig = made[0].1.clone();
    let r = prepare(&mut k, &[kclaim("half-b", b)]).await;
    assert_eq!(r[b].error, "");
    assert_eq!(
        instances(&node),
        made,
        "the second claim made another instance"
    );
    // Each claim's allocation is on the instance, with its own numbers; the arbiter lists
    // the instance as a device of the instance's size.
    for (uid, gib) in [(a, 6), (b, 8)] {
        let x = node.claim_allocations(uid);
        assert_eq!(x.len(), 1, "{uid}");
        assert_eq!(
            (x[0].gpu_uuid.as_str(), x[0].share, x[0].memory_limit),
            (mig.as_str(), 50, gib * GIB)
        );
        let env = read_spec(&node, uid).container_edits.env;
        assert!(
            env.contains(&format!("CUDA_VISIBLE_DEVICES={mig}")),
            "{uid}: {env:?}"
        );
    }
    let dev = node
        .admin()
        .gpus()
        .unwrap()
        .into_iter()
        .find(|g| g.uuid == mig)
        .expect("the arbiter lists the instance");
    assert_eq!(dev.name, "NVIDIA H200 MIG 1g.18gb");
    assert_eq!(dev.memory_total, 16 * GIB);

    // The first unprepare leaves the instance to the second claim; the last removes it.
    assert_eq!(unprepare(&mut k, &[kclaim("half-a", a)]).await, [""]);
    assert_eq!(instances(&node), made);
    assert!(node.claim_allocations(a).is_empty());
    assert_eq!(unprepare(&mut k, &[kclaim("half-b", b)]).await, [""]);
    assert!(instances(&node).is_empty(), "{:?}", instances(&node));
    assert!(node.claim_allocations(b).is_empty());
}
