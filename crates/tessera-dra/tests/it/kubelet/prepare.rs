//! Prepare and unprepare: fractions and whole GPUs, idempotent and restart-safe; refusals per claim; the published slice; GPUs left to another plugin (`--gpus`).

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_fractions_share_a_gpu_a_whole_gpu_and_idempotent_restart_safe_prepare() {
    let mut node = Node::start();
    let (a, b, w) = ("uid-aaaaaaaa", "uid-bbbbbbbb", "uid-wwwwwwww");
    node.api
        .put_claim(claim("train-a", a, "gpu-0", Some(("30", "20Gi"))));
    node.api
        .put_claim(claim("train-b", b, "gpu-0", Some(("70", "40Gi"))));
    node.api.put_claim(claim("whole", w, "gpu-1", None));
    node.start_plugin();
    let mut k = node.kubelet_register().await;
    let (gpu0, gpu1) = (node.gpu_uuid(0), node.gpu_uuid(1));

    let claims = [
        kclaim("train-a", a),
        kclaim("train-b", b),
        kclaim("whole", w),
    ];
    let r = prepare(&mut k, &claims).await;
    for c in &claims {
        assert_eq!(r[&c.uid].error, "", "{}", c.name);
    }
    let dev = &r[a].devices[0];
    assert_eq!(
        (dev.pool_name.as_str(), dev.device_name.as_str()),
        (NODE, "gpu-0")
    );
    assert_eq!(dev.request_names, ["gpu"]);
    assert!(dev.share_id.is_some());
    assert_eq!(
        dev.cdi_device_ids,
        [
            format!("tessera.dev/claim={a}-0"),
            format!("nvidia.com/gpu={gpu0}")
        ]
    );
    assert_eq!(
        r[w].devices[0].cdi_device_ids[1],
        format!("nvidia.com/gpu={gpu1}")
    );

    // Exactly the scheduler's numbers, on the GPU it chose.
    let limits = |uid: &str| -> Vec<(String, u32, u64)> {
        node.claim_allocations(uid)
            .into_iter()
            .map(|x| (x.gpu_uuid, x.share, x.memory_limit))
            .collect()
    };
    assert_eq!(limits(a), [(gpu0.clone(), 30, 20 * GIB)]);
    assert_eq!(limits(b), [(gpu0.clone(), 70, 40 * GIB)]);
    assert_eq!(limits(w), [(gpu1.clone(), 100, 80 * GIB)]);
    assert_eq!(
        node.claim_allocations(a)[0].labels[LABEL_CLAIM],
        "team-a/train-a"
    );
    // `tessera status` names the claim each allocation serves.
    let out = Command::new(artifact("tessera"))
        .args(["status", "--json", "--admin-socket"])
        .arg(&node.spec.admin_socket)
        .output()
        .unwrap();
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    let named: BTreeSet<&str> = status["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["allocations"].as_array().unwrap())
        .filter_map(|x| x["claim"].as_str())
        .collect();
    assert_eq!(
        named,
        BTreeSet::from(["team-a/train-a", "team-a/train-b", "team-a/whole"])
    );

    // The fraction's CDI spec: preload and interposer read-only, the identity file with the
    // allocation's token, the GPU made visible; no token in the spec itself.
    let spec = read_spec(&node, a);
    assert_eq!(spec.kind, "tessera.dev/claim");
    assert_eq!(spec.devices[0].name, format!("{a}-0"));
    let env = &spec.container_edits.env;
    assert!(
        env.contains(&format!("CUDA_VISIBLE_DEVICES={gpu0}")),
        "{env:?}"
    );
    assert!(
        env.contains(&format!("NVIDIA_VISIBLE_DEVICES={gpu0}")),
        "{env:?}"
    );
    assert!(!env.iter().any(|e| e.starts_with("TESSERA_TOKEN")));
    let mount = |container: &str| {
        spec.container_edits
            .mounts
            .iter()
            .find(|m| m.container_path == container)
            .unwrap_or_else(|| panic!("no mount at {container}: {spec:?}"))
            .clone()
    };
    let preload = mount("/etc/ld.so.preload");
    assert_eq!(preload.options[0], "ro");
    assert_eq!(
        std::fs::read_to_string(&preload.host_path).unwrap().trim(),
        "/usr/lib/tessera/libtessera_interpose.so"
    );
    let lib = mount("/usr/lib/tessera/libtessera_interpose.so");
    assert_eq!(lib.options[0], "ro");
    assert_eq!(
        std::fs::read(&lib.host_path).unwrap(),
        std::fs::read(artifact("libtessera_interpose.so")).unwrap()
    );
    let sock = mount("/run/tessera");
    assert_eq!(
        Path::new(&sock.host_path),
        node.spec.socket.parent().unwrap()
    );
    assert_eq!(sock.options[0], "ro");
    let ident = mount("/etc/tessera/tenant");
    assert_eq!(ident.options[0], "ro");
    let id = Identity::parse(&std::fs::read_to_string(&ident.host_path).unwrap()).unwrap();
    assert_eq!(
        id.allocation.as_deref(),
        Some(node.claim_allocations(a)[0].id.as_str())
    );
    assert_eq!(
        id.socket.as_deref(),
        Some(Path::new("/run/tessera/tessera.sock"))
    );
    // The token is the allocation's: the arbiter takes it.
    node.arbiter.tenant(&id.token);
    // The whole GPU: identity only, no interposer.
    let whole = read_spec(&node, w);
    assert_eq!(whole.container_edits.mounts.len(), 1, "{whole:?}");
    assert!(
        whole
            .container_edits
            .env
            .contains(&format!("CUDA_VISIBLE_DEVICES={gpu1}"))
    );

    // Prepare again: the same answer, nothing new.
    let before = (
        node.admin().list().unwrap().len(),
        node.files("identity"),
        node.files("cdi"),
    );
    assert_eq!(before.0, 3);
    assert_eq!(before.1.len(), 3);
    assert_eq!(before.2.len(), 3);
    let again = prepare(&mut k, &claims).await;
    assert_eq!(again, r);
    let ids_a = node.claim_allocations(a);
    assert_eq!(
        (
            node.admin().list().unwrap().len(),
            node.files("identity"),
            node.files("cdi")
        ),
        before
    );

    // A plugin restart between prepare and unprepare loses nothing.
    node.stop_plugin().await;
    node.start_plugin();
    let mut k = node.kubelet_register().await;
    assert_eq!(prepare(&mut k, &claims[..1]).await[a], r[a]);
    assert_eq!(node.claim_allocations(a), ids_a);

    // An arbiter restart too: its state folder is the checkpoint.
    node.arbiter.kill();
    node.arbiter = node.spec.start();
    assert_eq!(prepare(&mut k, &claims).await, r);
    let after = (
        node.admin().list().unwrap().len(),
        node.files("identity"),
        node.files("cdi"),
    );
    eprintln!(
        "before the restarts: {} allocations, {} identity files, {} CDI specs; after the plugin \
         and the arbiter restarted: {}, {}, {}",
        before.0,
        before.1.len(),
        before.2.len(),
        after.0,
        after.1.len(),
        after.2.len()
    );
    assert_eq!(after, before);

    // Unprepare: allocations, identity files and specs go; twice is fine.
    assert_eq!(unprepare(&mut k, &claims[..2]).await, ["", ""]);
    assert!(node.claim_allocations(a).is_empty() && node.claim_allocations(b).is_empty());
    assert_eq!(
        node.files("cdi"),
        BTreeSet::from([format!("tessera.dev-claim_{w}.json")])
    );
    assert_eq!(node.files("identity").len(), 1);
    assert!(!Path::new(&ident.host_path).exists());
    assert_eq!(unprepare(&mut k, &claims).await, ["", "", ""]);
    eprintln!(
        "after unprepare: {} allocations, {} identity files, {} CDI specs",
        node.admin().list().unwrap().len(),
        node.files("identity").len(),
        node.files("cdi").len()
    );
    assert!(node.admin().list().unwrap().is_empty());
    assert!(node.files("cdi").is_empty() && node.files("identity").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_per_claim_and_create_nothing() {
    let mut node = Node::start();
    let good = "uid-good0000";
    node.api
        .put_claim(claim("good", good, "gpu-0", Some(("30", "20Gi"))));
    // Re-created under the same name: the API server's uid is not the kubelet's.
    node.api.put_claim(claim(
        "recreated",
        "uid-new00000",
        "gpu-0",
        Some(("10", "1Gi")),
    ));
    node.api.put_claim(claim(
        "too-big",
        "uid-big00000",
        "gpu-1",
        Some(("10", "81Gi")),
    ));
    node.api.put_claim(claim(
        "not-here",
        "uid-gpu90000",
        "gpu-9",
        Some(("10", "1Gi")),
    ));
    let mut other_pool = claim("elsewhere", "uid-pool0000", "gpu-0", Some(("10", "1Gi")));
    other_pool["status"]["allocation"]["devices"]["results"][0]["pool"] = json!("node-b");
    node.api.put_claim(other_pool);
    node.start_plugin();
    let mut k = node.kubelet_register().await;
    let claims = [
        kclaim("good", good),
        kclaim("recreated", "uid-old00000"),
        kclaim("too-big", "uid-big00000"),
        kclaim("not-here", "uid-gpu90000"),
        kclaim("elsewhere", "uid-pool0000"),
        kclaim("missing", "uid-none0000"),
        // A uid that would name a file outside the CDI folder.
        kclaim("evil", "../../etc/x"),
    ];
    let r = prepare(&mut k, &claims).await;
    assert_eq!(r[good].error, "");
    let err = |uid: &str| r[uid].error.clone();
    assert!(
        err("uid-old00000").contains("uid-new00000"),
        "{}",
        err("uid-old00000")
    );
    assert!(
        err("uid-big00000").contains("consumedCapacity.memory"),
        "{}",
        err("uid-big00000")
    );
    assert!(
        err("uid-gpu90000").contains("gpu-9"),
        "{}",
        err("uid-gpu90000")
    );
    assert!(
        err("uid-pool0000").contains("node-b"),
        "{}",
        err("uid-pool0000")
    );
    assert!(
        err("uid-none0000").contains("not found"),
        "{}",
        err("uid-none0000")
    );
    assert!(claims[1..].iter().all(|c| r[&c.uid].devices.is_empty()));
    let all = node.admin().list().unwrap();
    assert_eq!(all.len(), 1, "only the good claim's allocation: {all:?}");
    assert_eq!(node.files("cdi").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_a_valid_slice_with_one_device_per_gpu_and_keeps_it_across_restarts() {
    let mut node = Node::start();
    // A stand-in sysfs for the first simulated card (bus 01) laid out as Linux does: the
    // device under its root bridge with a NUMA node, and the bus folder's link to it. The
    // second card has none (as the simulator, which has no sysfs).
    let dev = node.path("sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0");
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(dev.join("numa_node"), "1\n").unwrap();
    std::fs::create_dir_all(node.path("sys/bus/pci/devices")).unwrap();
    std::os::unix::fs::symlink(
        "../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0",
        node.path("sys/bus/pci/devices/0000:01:00.0"),
    )
    .unwrap();
    node.start_plugin();
    let slice = {
        let api = &node.api;
        until(20, "the node's ResourceSlice", || {
            api.slices().into_iter().next()
        })
        .await
    };
    assert!(
        node.api.state().rejected.is_empty(),
        "{:?}",
        node.api.state().rejected
    );
    assert_eq!(slice["metadata"]["name"], "node-a-gpu.tessera.dev");
    let spec = &slice["spec"];
    assert_eq!(
        (spec["driver"].as_str(), spec["nodeName"].as_str()),
        (Some(DRIVER), Some(NODE))
    );
    assert_eq!(spec["pool"]["name"], NODE);
    assert_eq!(spec["pool"]["resourceSliceCount"], 1);
    let devices = spec["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    let gpus = node.admin().gpus().unwrap();
    for (d, g) in devices.iter().zip(&gpus) {
        assert_eq!(d["name"], format!("gpu-{}", g.index));
        assert_eq!(d["allowMultipleAllocations"], true);
        assert_eq!(d["attributes"]["uuid"]["string"], g.uuid.as_str());
        assert_eq!(d["attributes"]["index"]["int"], g.index);
        assert_eq!(
            d["attributes"]["productName"]["string"],
            "Tessera Sim GPU 80GiB"
        );
        assert_eq!(
            d["attributes"]["resource.kubernetes.io/pciBusID"]["string"],
            format!("0000:{:02x}:00.0", g.index + 1)
        );
        assert!(d["attributes"]["cudaComputeCapability"]["version"].is_string());
        assert_eq!(d["capacity"]["shares"]["value"], "100");
        // A claim that names no shares (memory only) is charged 10, not the whole card.
        assert_eq!(d["capacity"]["shares"]["requestPolicy"]["default"], "10");
        assert_eq!(d["capacity"]["memory"]["value"], "80Gi");
        assert_eq!(
            d["capacity"]["memory"]["requestPolicy"]["validRange"]["step"],
            "256Mi"
        );
    }

    assert_eq!(devices[0]["attributes"]["numaNode"]["int"], 1);
    assert!(devices[1]["attributes"].get("numaNode").is_none());
    assert_eq!(
        devices[0]["attributes"]["resource.kubernetes.io/pcieRoot"]["string"],
        "pci0000:00"
    );
    assert!(
        devices[1]["attributes"]
            .get("resource.kubernetes.io/pcieRoot")
            .is_none()
    );

    assert_eq!(spec["pool"]["generation"], 1);
    assert!(devices.iter().all(|d| d.get("taints").is_none()));

    // A restart (SIGTERM, as a rolling update sends) keeps the slice, and the next start finds
    // it equal and leaves it as it is: same object, same generation, no write at all.
    node.stop_plugin().await;
    assert_eq!(
        node.api.slices(),
        std::slice::from_ref(&slice),
        "slice kept on SIGTERM"
    );
    let seen = node.api.state().requests.len();
    node.start_plugin();
    until(
        20,
        "three ResourceSlice re-checks after the restart",
        || {
            let st = node.api.state();
            let lists = st.requests[seen..]
                .iter()
                .filter(|r| r.starts_with("GET /apis/resource.k8s.io/v1/resourceslices"))
                .count();
            (lists >= 3).then_some(())
        },
    )
    .await;
    let writes: Vec<String> = node.api.state().requests[seen..]
        .iter()
        .filter(|r| r.contains("resourceslices") && !r.starts_with("GET "))
        .cloned()
        .collect();
    assert!(writes.is_empty(), "{writes:?}");
    assert_eq!(node.api.slices(), std::slice::from_ref(&slice));

    // A fatal XID on the second card: it stays listed, tainted, in the next generation; an
    // application's XID (13) on the first changes nothing.
    tessera_sim_state::inject_xid(&node.sim.dir, 0, 13).unwrap();
    tessera_sim_state::inject_xid(&node.sim.dir, 1, 79).unwrap();
    let tainted = until(20, "the slice with the unhealthy GPU tainted", || {
        node.api
            .slices()
            .into_iter()
            .find(|s| s["spec"]["pool"]["generation"] == 2)
    })
    .await;
    let devices = tainted["spec"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    assert!(devices[0].get("taints").is_none(), "{:?}", devices[0]);
    assert_eq!(
        devices[1]["taints"],
        json!([{"key": "gpu.tessera.dev/unhealthy", "effect": "NoSchedule"}])
    );
    assert!(node.api.state().rejected.is_empty());

    // Deleted by someone else: it comes back at the next re-check.
    node.api.state().slices.clear();
    until(20, "the slice re-created", || {
        node.api.slices().into_iter().next()
    })
    .await;

    node.stop_plugin().await;
    assert_eq!(node.api.slices().len(), 1, "slice kept on shutdown");
    assert!(!node.registration_socket().exists());
    // Removing it is an explicit choice (an uninstall).
    node.start_plugin_with(&["--remove-slices-on-exit"]);
    until(20, "the plugin serving again", || {
        node.registration_socket().exists().then_some(())
    })
    .await;
    node.stop_plugin().await;
    assert!(
        node.api.slices().is_empty(),
        "slice removed with --remove-slices-on-exit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_left_to_another_plugin_are_neither_published_nor_prepared() {
    let mut node = Node::start();
    let (gpu0, gpu1) = (node.gpu_uuid(0), node.gpu_uuid(1));
    // MIG on a GPU the list leaves out, named by UUID (so known only once the GPUs are read):
    // a start-up error, exit 2, before anything is published.
    let only1 = format!("{},9", gpu1.to_uppercase());
    node.start_plugin_with(&["--gpus", &only1, "--mig-dynamic", "0"]);
    let status = {
        let p = node.plugin.as_mut().unwrap();
        until(20, "the plugin refusing MIG on GPU 0", || {
            p.try_wait().unwrap()
        })
        .await
    };
    node.plugin.take();
    let log = std::fs::read_to_string(node.path("plugin.log")).unwrap();
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(
        log.contains(&format!(
            "--mig-dynamic names GPU 0 ({gpu0}), which --gpus {gpu1},9 does not offer"
        )),
        "{log}"
    );
    assert!(node.api.slices().is_empty());

    // GPU 1 alone (by its UUID, any case): one device in the slice, no GPU 0 to prepare.
    node.api
        .put_claim(claim("on-0", "uid-zero0000", "gpu-0", Some(("10", "1Gi"))));
    node.api
        .put_claim(claim("on-1", "uid-one00000", "gpu-1", Some(("10", "1Gi"))));
    node.start_plugin_with(&["--gpus", &only1]);
    let mut k = node.kubelet_register().await;
    let slice = {
        let api = &node.api;
        until(20, "the node's ResourceSlice", || {
            api.slices().into_iter().next()
        })
        .await
    };
    tessera_testkit::apiserver::validate_slice(&slice).unwrap();
    let devices = slice["spec"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert_eq!(devices[0]["name"], "gpu-1");
    assert_eq!(devices[0]["attributes"]["uuid"]["string"], gpu1.as_str());
    assert!(slice["spec"].get("sharedCounters").is_none());
    let r = prepare(
        &mut k,
        &[
            kclaim("on-0", "uid-zero0000"),
            kclaim("on-1", "uid-one00000"),
        ],
    )
    .await;
    let err = &r["uid-zero0000"].error;
    assert!(
        err.contains("gpu-0") && err.contains("not a GPU of this node"),
        "{err}"
    );
    assert_eq!(r["uid-one00000"].error, "");
    let on: Vec<String> = node
        .admin()
        .list()
        .unwrap()
        .into_iter()
        .map(|a| a.gpu_uuid)
        .collect();
    assert_eq!(on, [gpu1]);
    let log = std::fs::read_to_string(node.path("plugin.log")).unwrap();
    assert!(
        log.contains("--gpus names GPU 9, which this node does not have"),
        "{log}"
    );
    assert!(
        log.contains("1 of the 2 GPUs of node node-a offered"),
        "{log}"
    );
    assert_eq!(
        unprepare(&mut k, &[kclaim("on-1", "uid-one00000")]).await,
        [""]
    );
}
