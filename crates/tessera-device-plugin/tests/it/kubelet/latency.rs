//! The latency tier through a second resource.

use super::containers::{run_tenant, sim_env};
use super::*;

// ---- the latency tier through a second resource ----

const LATENCY_RESOURCE: &str = "tessera.dev/gpu-latency-shares";
const LATENCY_ENDPOINT: &str = "tessera-latency.sock";

/// The allocation `id` in `tessera status --json`.
fn status_json_allocation(node: &Node, id: &str) -> serde_json::Value {
    let out = Command::new(artifact("tessera"))
        .args(["status", "--json", "--admin-socket"])
        .arg(node.admin())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["allocations"].as_array().unwrap().iter())
        .find(|a| a["id"] == id)
        .unwrap_or_else(|| panic!("{id} not in tessera status --json:\n{text}"))
        .clone()
}

/// The value of the arbiter's `tessera_allocation_latency_tier` series of allocation `id`.
fn latency_tier_sample(metrics: &str, id: &str) -> f64 {
    let line = metrics
        .lines()
        .find(|l| {
            l.starts_with("tessera_allocation_latency_tier{")
                && l.contains(&format!("allocation=\"{id}\""))
        })
        .unwrap_or_else(|| panic!("no tier series for {id}:\n{metrics}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// A node whose plugin sets 30 of each GPU's 100 units apart for the latency resource, with
/// both registrations received.
async fn split_node() -> (Node, FakeKubelet, FakePodResources, Vec<RegisterRequest>) {
    let mut node = Node::start().await;
    let mut kubelet = FakeKubelet::start(&node.kubelet_dir());
    let podres = FakePodResources::default();
    podres.serve(&node.podres());
    node.start_plugin_with(&[
        "--latency-shares",
        "30",
        "--container-lib-path",
        "/opt/tessera/libtessera_interpose.so",
    ]);
    let mut regs = Vec::new();
    for _ in 0..2 {
        regs.push(
            within(15, "registration", kubelet.registrations.recv())
                .await
                .unwrap(),
        );
    }
    regs.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
    (node, kubelet, podres, regs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_latency_resource_makes_latency_allocations_from_its_own_part_of_each_gpu() {
    let (node, kubelet, podres, regs) = split_node().await;
    // Two registrations, one per resource, each on its own socket.
    let pairs: Vec<(&str, &str)> = regs
        .iter()
        .map(|r| (r.endpoint.as_str(), r.resource_name.as_str()))
        .collect();
    assert_eq!(
        pairs,
        [(LATENCY_ENDPOINT, LATENCY_RESOURCE), (ENDPOINT, RESOURCE)]
    );
    let gpus = node.gpus();
    let (g0, g1) = (gpus[0].uuid.clone(), gpus[1].uuid.clone());
    let mut be = node.plugin_client().await;
    let mut lat = node.plugin_client_at(LATENCY_ENDPOINT).await;

    // Each resource lists its own units of each GPU: 70 best-effort, 30 latency, disjoint.
    let ids_of = |list: ListAndWatchResponse| -> Vec<String> {
        let mut v: Vec<String> = list.devices.into_iter().map(|d| d.id).collect();
        v.sort();
        v
    };
    let mut s = within(5, "ListAndWatch", be.list_and_watch(Empty {}))
        .await
        .unwrap()
        .into_inner();
    let be_ids = ids_of(next_list(&mut s, "best-effort list").await);
    let mut s = within(5, "ListAndWatch", lat.list_and_watch(Empty {}))
        .await
        .unwrap()
        .into_inner();
    let lat_ids = ids_of(next_list(&mut s, "latency list").await);
    let mut want_be = unit_ids(&g0, 0..70);
    want_be.extend(unit_ids(&g1, 0..70));
    want_be.sort();
    let mut want_lat = unit_ids(&g0, 70..100);
    want_lat.extend(unit_ids(&g1, 70..100));
    want_lat.sort();
    assert_eq!(be_ids, want_be);
    assert_eq!(lat_ids, want_lat);

    // A latency request: a latency-tier allocation of 10% of GPU 0.
    let lat_units = unit_ids(&g0, 70..80);
    let be_units = unit_ids(&g0, 0..50);
    podres.set_holding_of("svc", &[(LATENCY_RESOURCE, &lat_units)]);
    podres.set_holding_of("train", &[(RESOURCE, &be_units)]);
    let lat_resp = allocate(&mut lat, lat_units.clone()).await.unwrap();
    let be_resp = allocate(&mut be, be_units.clone()).await.unwrap();
    let (lat_id, be_id) = (
        lat_resp.envs["TESSERA_ALLOCATION_ID"].clone(),
        be_resp.envs["TESSERA_ALLOCATION_ID"].clone(),
    );
    let view = |id: &str| {
        node.allocations()
            .into_iter()
            .find(|a| a.id == id)
            .unwrap_or_else(|| panic!("no allocation {id}"))
    };
    let (l, b) = (view(&lat_id), view(&be_id));
    assert_eq!(
        (l.tier, l.share, l.memory_limit),
        (tessera_protocol::Tier::Latency, 10, 8 * GIB)
    );
    assert_eq!(
        (b.tier, b.share, b.memory_limit),
        (tessera_protocol::Tier::BestEffort, 50, 40 * GIB)
    );
    assert_eq!(l.labels["tessera.dev/resource"], LATENCY_RESOURCE);
    // The operator sees the tiers in `tessera status --json` and the arbiter's metrics.
    assert_eq!(status_json_allocation(&node, &lat_id)["tier"], "latency");
    assert_eq!(status_json_allocation(&node, &be_id)["tier"], "best-effort");
    let m = scrape(&node.metrics_addr_in("arbiter.log").await).await;
    assert_eq!(latency_tier_sample(&m, &lat_id), 1.0);
    assert_eq!(latency_tier_sample(&m, &be_id), 0.0);

    // The split holds: the latency pool has 20 units left on GPU 0 and 30 on GPU 1, so 31
    // latency units fit nowhere, whatever the best-effort side has free.
    let mut lat_free = unit_ids(&g0, 80..100);
    lat_free.extend(unit_ids(&g1, 70..100));
    let err = preferred(&mut lat, lat_free, 31).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("no single GPU has 31 free units"),
        "{}",
        err.message()
    );
    // ... nor can a 31-unit latency request be made of units spread over the GPUs,
    let mut spread = unit_ids(&g0, 80..100);
    spread.extend(unit_ids(&g1, 70..81));
    let err = allocate(&mut lat, spread).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // ... or of best-effort units handed to the latency resource (or the other way round).
    for (client, units) in [
        (&mut lat, unit_ids(&g1, 60..80)),
        (&mut be, unit_ids(&g1, 65..75)),
    ] {
        let err = allocate(client, units).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(
            err.message().contains("not one of this resource's units"),
            "{}",
            err.message()
        );
    }
    // ... and a best-effort request cannot reach into the latency part of a GPU either.
    let err = preferred(&mut be, unit_ids(&g1, 0..70), 71)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert_eq!(node.allocations().len(), 2, "refusals create nothing");
    // Every unit of GPU 0 handed out: the shares add up to the card, not past it.
    let rest_be = unit_ids(&g0, 50..70);
    let rest_lat = unit_ids(&g0, 80..100);
    podres.set_holding_of("train2", &[(RESOURCE, &rest_be)]);
    podres.set_holding_of("svc2", &[(LATENCY_RESOURCE, &rest_lat)]);
    allocate(&mut be, rest_be).await.unwrap();
    allocate(&mut lat, rest_lat).await.unwrap();
    let on_g0: u32 = node
        .allocations()
        .iter()
        .filter(|a| a.gpu_uuid == g0)
        .map(|a| a.share)
        .sum();
    assert_eq!(on_g0, 100);

    // The stale clean-up knows each resource's allocations: the latency pod ends, and only
    // its allocation goes.
    podres.set_holding_of("svc", &[]);
    wait_allocations(
        &node,
        15,
        "the ended latency pod's allocation deleted",
        |a| !a.iter().any(|x| x.id == lat_id) && a.iter().any(|x| x.id == be_id),
    )
    .await;
    assert_eq!(node.allocations().len(), 3);

    // A kubelet restart (every socket deleted): both resources are served and registered
    // again, and the latency socket lists the latency units.
    let maddr = node.metrics_addr().await;
    wait_sample(&maddr, "tessera_plugin_registrations_total", 2.0).await;
    kubelet.stop().await;
    for e in std::fs::read_dir(node.kubelet_dir()).unwrap().flatten() {
        std::fs::remove_file(e.path()).unwrap();
    }
    let mut kubelet = FakeKubelet::start(&node.kubelet_dir());
    let mut again = Vec::new();
    for _ in 0..2 {
        let r = within(10, "re-registration", kubelet.registrations.recv())
            .await
            .unwrap();
        again.push((r.endpoint, r.resource_name));
    }
    again.sort();
    assert_eq!(
        again,
        [
            (LATENCY_ENDPOINT.to_owned(), LATENCY_RESOURCE.to_owned()),
            (ENDPOINT.to_owned(), RESOURCE.to_owned())
        ]
    );
    wait_sample(&maddr, "tessera_plugin_registrations_total", 4.0).await;
    let mut lat = node.plugin_client_at(LATENCY_ENDPOINT).await;
    let mut s = within(5, "ListAndWatch again", lat.list_and_watch(Empty {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        ids_of(next_list(&mut s, "latency list again").await),
        want_lat
    );
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_cannot_make_itself_latency_by_its_environment_or_files() {
    let (node, kubelet, podres, _) = split_node().await;
    let g0 = node.gpus()[0].uuid.clone();
    let mut be = node.plugin_client().await;
    let mut lat = node.plugin_client_at(LATENCY_ENDPOINT).await;
    let be_units = unit_ids(&g0, 0..50);
    let lat_units = unit_ids(&g0, 70..80);
    podres.set_holding_of("train", &[(RESOURCE, &be_units)]);
    podres.set_holding_of("svc", &[(LATENCY_RESOURCE, &lat_units)]);
    let be_resp = allocate(&mut be, be_units).await.unwrap();
    let lat_resp = allocate(&mut lat, lat_units).await.unwrap();
    let be_id = be_resp.envs["TESSERA_ALLOCATION_ID"].clone();
    let lat_id = lat_resp.envs["TESSERA_ALLOCATION_ID"].clone();

    // The best-effort container claims the neighbour's latency allocation every way it
    // controls: its id, a tier variable, a guessed token, and a forged identity file of its
    // own in a folder it can write (one the emulated container sees), named by the
    // variables it sets.
    let forged_dir = node.dir.path().join("forged");
    std::fs::create_dir_all(&forged_dir).unwrap();
    let forged = forged_dir.join("identity");
    std::fs::write(
        &forged,
        format!("token=forged\nallocation={lat_id}\ntier=latency\n"),
    )
    .unwrap();
    let mut env = sim_env(&node);
    for (k, v) in [
        ("TESSERA_ALLOCATION_ID", lat_id.clone()),
        ("TESSERA_TIER", "latency".into()),
        ("TESSERA_TOKEN", "forged".into()),
        ("TESSERA_IDENTITY", forged.display().to_string()),
        ("TESSERA_IDENTITY_FILE", forged.display().to_string()),
    ] {
        env.push((k, v));
    }
    let mut attacker = be_resp.clone();
    for (k, v) in &env {
        attacker.envs.insert((*k).to_owned(), v.clone());
    }
    let (out, err, status, _) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &attacker,
            &env,
            &["--seconds", "0.5", "--kernel-us", "1000"],
        )
    });
    let shown = format!("stdout:\n{out}\nstderr:\n{err}");
    assert!(status.success(), "{shown}\n{status:?}");
    // It ran under its own best-effort allocation (40 GiB of the card), leasing through it;
    // the latency allocation saw none of its work and both kept their tiers.
    assert!(out.contains("with 40.0 GiB"), "{shown}");
    let view = |id: &str| node.allocations().into_iter().find(|a| a.id == id).unwrap();
    let (b, l) = (view(&be_id), view(&lat_id));
    assert!(
        b.leases > 0,
        "the tenant leased through its own allocation: {b:?}\n{shown}"
    );
    assert_eq!(
        l.leases, 0,
        "nothing ran as the latency allocation: {l:?}\n{shown}"
    );
    assert_eq!(b.tier, tessera_protocol::Tier::BestEffort);
    assert_eq!(l.tier, tessera_protocol::Tier::Latency);
    assert_eq!(status_json_allocation(&node, &be_id)["tier"], "best-effort");
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_asking_for_both_resources_gets_neither() {
    let (node, kubelet, podres, _) = split_node().await;
    let g0 = node.gpus()[0].uuid.clone();
    let mut be = node.plugin_client().await;
    let mut lat = node.plugin_client_at(LATENCY_ENDPOINT).await;
    // The kubelet calls Allocate once per resource, without the pod: each call alone is fine.
    let be_units = unit_ids(&g0, 0..20);
    let lat_units = unit_ids(&g0, 70..80);
    let be_resp = allocate(&mut be, be_units.clone()).await.unwrap();
    allocate(&mut lat, lat_units.clone()).await.unwrap();
    // A neighbour with one resource only is not touched.
    let ok_units = unit_ids(&g0, 20..30);
    podres.set_holding_of("ok", &[(RESOURCE, &ok_units)]);
    let ok_id = allocate(&mut be, ok_units).await.unwrap().envs["TESSERA_ALLOCATION_ID"].clone();
    // Then PodResources shows one container holding both: neither allocation stays.
    podres.set_holding_of(
        "mix",
        &[(RESOURCE, &be_units), (LATENCY_RESOURCE, &lat_units)],
    );
    wait_allocations(
        &node,
        15,
        "the mixed container's allocations deleted",
        |a| a.len() == 1 && a[0].id == ok_id,
    )
    .await;
    let maddr = node.metrics_addr().await;
    wait_sample(&maddr, "tessera_plugin_mixed_tier_deletions_total", 2.0).await;
    // Its process, under either identity, gets no GPU memory at all (fail closed).
    let (out, err, status, _) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &be_resp,
            &sim_env(&node),
            &["--grab-gib", "1", "--seconds", "0.2"],
        )
    });
    let shown = format!("stdout:\n{out}\nstderr:\n{err}\n{status:?}");
    assert!(!out.contains("holds 1 GiB"), "{shown}");
    assert!(err.contains("unknown allocation token"), "{shown}");
    assert!(!status.success(), "{shown}");
    kubelet.stop().await;
}
