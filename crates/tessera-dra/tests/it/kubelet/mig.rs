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
