//! Registration, list, preferred allocation, allocate and clean-up; health and kubelet restarts; flags and exit codes; GPUs left to another plugin (`--gpus`).

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_list_prefer_allocate_and_clean_up() {
    let mut node = Node::start().await;
    let mut kubelet = FakeKubelet::start(&node.kubelet_dir());
    let podres = FakePodResources::default();
    podres.serve(&node.podres());
    node.start_plugin();

    // Registration: version, bare endpoint, resource, options.
    let reg = within(15, "registration", kubelet.registrations.recv())
        .await
        .unwrap();
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(reg.endpoint, ENDPOINT);
    assert_eq!(reg.resource_name, RESOURCE);
    let opts = reg.options.unwrap();
    assert!(opts.get_preferred_allocation_available);
    assert!(!opts.pre_start_required);

    // The plugin's metrics: one registration, 200 healthy units, nothing else yet.
    // (The fake kubelet hears the registration just before the plugin hears the answer.)
    let maddr = node.metrics_addr().await;
    let m = wait_sample(&maddr, "tessera_plugin_registrations_total", 1.0).await;
    assert_eq!(
        sample(&m, "tessera_plugin_allocations_total"),
        Some(0.0),
        "{m}"
    );
    let m = wait_sample(&maddr, "tessera_plugin_units{state=\"healthy\"}", 200.0).await;
    assert_eq!(
        sample(&m, "tessera_plugin_units{state=\"unhealthy\"}"),
        Some(0.0),
        "{m}"
    );

    let mut client = node.plugin_client().await;
    let o = within(5, "options", client.get_device_plugin_options(Empty {}))
        .await
        .unwrap();
    assert!(o.into_inner().get_preferred_allocation_available);

    // Device list: two 80 GiB GPUs, 100 units each, all healthy, ids within 63 characters.
    let gpus = node.gpus();
    assert_eq!(gpus.len(), 2);
    let (g0, g1) = (gpus[0].uuid.clone(), gpus[1].uuid.clone());
    assert_eq!(gpus[0].memory_total, 80 * GIB);
    let mut stream = within(5, "ListAndWatch", client.list_and_watch(Empty {}))
        .await
        .unwrap()
        .into_inner();
    let list = next_list(&mut stream, "first device list").await;
    assert_eq!(list.devices.len(), 200);
    assert!(
        list.devices
            .iter()
            .all(|d| d.health == "Healthy" && d.id.len() <= 63)
    );
    let ids: Vec<&str> = list.devices.iter().map(|d| d.id.as_str()).collect();
    assert!(
        ids.contains(&format!("{g0}-0").as_str()) && ids.contains(&format!("{g1}-99").as_str())
    );

    // Preferred allocation: GPU 0 has 50 units in use, so 30 go on GPU 0 (best fit).
    let mut available = unit_ids(&g0, 50..100);
    available.extend(unit_ids(&g1, 0..100));
    let pick = preferred(&mut client, available.clone(), 30).await.unwrap();
    assert_eq!(pick, unit_ids(&g0, 50..80));
    let pick60 = preferred(&mut client, available.clone(), 60).await.unwrap();
    assert_eq!(
        pick60,
        unit_ids(&g1, 0..60),
        "60 does not fit GPU 0's 50 free units"
    );
    let err = preferred(&mut client, available, 150).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("whole GPUs"), "{}", err.message());

    // Allocate refuses a fraction spread over two GPUs, clearly.
    let mut spread = unit_ids(&g0, 0..20);
    spread.extend(unit_ids(&g1, 0..10));
    let err = allocate(&mut client, spread).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("spread over 2 GPUs"),
        "{}",
        err.message()
    );
    assert!(
        node.allocations().is_empty(),
        "a refused Allocate creates nothing"
    );
    let m = scrape(&maddr).await;
    assert_eq!(
        sample(
            &m,
            "tessera_plugin_allocation_refusals_total{reason=\"bad_units\"}"
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "tessera_plugin_allocations_total"),
        Some(0.0),
        "{m}"
    );

    // Allocate 30 units: an arbiter allocation of 30% of GPU 0, and the container wiring.
    // (The kubelet lists a container's devices from the moment it allocates them.)
    podres.set_holding("p1", &pick);
    let resp = allocate(&mut client, pick.clone()).await.unwrap();
    let token = resp.envs["TESSERA_TOKEN"].clone();
    assert!(token.len() >= 32, "token {token:?}");
    assert_eq!(resp.envs["TESSERA_SOCKET"], "/run/tessera/tessera.sock");
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], g0);
    // No CDI devices without --nvidia-cdi-kind (container_node's plugin has it).
    assert!(resp.cdi_devices.is_empty(), "{:?}", resp.cdi_devices);
    let mounts: HashMap<&str, _> = resp
        .mounts
        .iter()
        .map(|m| (m.container_path.as_str(), m))
        .collect();
    assert!(resp.mounts.iter().all(|m| m.read_only));
    let lib = mounts[CONTAINER_LIB];
    let lib_name = Path::new(&lib.host_path)
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        lib_name.starts_with(&format!(
            "libtessera_interpose-{}-",
            env!("CARGO_PKG_VERSION")
        )),
        "{lib_name}"
    );
    assert!(Path::new(&lib.host_path).starts_with(node.host_lib()));
    assert_eq!(
        std::fs::read(&lib.host_path).unwrap(),
        std::fs::read(artifact("libtessera_interpose.so")).unwrap()
    );
    let preload = mounts["/etc/ld.so.preload"];
    assert_eq!(
        std::fs::read_to_string(&preload.host_path).unwrap(),
        format!("{CONTAINER_LIB}\n")
    );
    assert_eq!(
        Path::new(&mounts["/run/tessera"].host_path),
        node.tenant().parent().unwrap()
    );

    // The token works: the tenant socket accepts it and reports the allocation's limits.
    let tenant = TenantClient::connect(&node.tenant(), &token).unwrap();
    let view = tenant.allocation().clone();
    assert_eq!(view.gpu_uuid, g0);
    assert_eq!(view.memory_limit, 24 * GIB);
    assert_eq!(view.share, 30);
    assert_eq!(view.id, resp.envs["TESSERA_ALLOCATION_ID"]);
    drop(tenant);
    let allocs = node.allocations();
    assert_eq!(allocs.len(), 1);
    assert_eq!(allocs[0].labels["tessera.dev/units"], "50-79");
    assert_eq!(allocs[0].labels["tessera.dev/owner"], "device-plugin");
    assert_eq!(
        sample(&scrape(&maddr).await, "tessera_plugin_allocations_total"),
        Some(1.0)
    );

    // PodResources names the pod holding the units: the plugin writes it onto the allocation.
    wait_allocations(&node, 10, "pod labels on the allocation", |a| {
        a.len() == 1
            && a[0].labels.get(LABEL_NAMESPACE).map(String::as_str) == Some("default")
            && a[0].labels.get(LABEL_POD).map(String::as_str) == Some("p1")
            && a[0].labels.get(LABEL_CONTAINER).map(String::as_str) == Some("main")
    })
    .await;
    // Written once: later polls (every 0.2 s) see nothing changed and write nothing.
    let since = podres.lists();
    podres
        .polled(since, 3, std::time::Instant::now(), Duration::ZERO)
        .await;
    let m = scrape(&maddr).await;
    assert_eq!(
        sample(&m, "tessera_plugin_pod_labels_total"),
        Some(1.0),
        "{m}"
    );
    tessera_testkit::prometheus::check_metrics(&m);
    // Every plugin metric docs/metrics.md documents is served.
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/metrics.md"),
    )
    .unwrap();
    let names = tessera_testkit::prometheus::documented_names(&doc, &["tessera_plugin_"]);
    assert!(names.len() >= 7, "{names:?}");
    for n in &names {
        assert!(
            tessera_testkit::prometheus::exposes(&m, n),
            "{n} is documented but not served:\n{m}"
        );
    }
    // ... and the operator sees it in `tessera status`.
    let status = Command::new(artifact("tessera"))
        .arg("status")
        .arg("--admin-socket")
        .arg(node.admin())
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success(),
        "{table}{}",
        String::from_utf8_lossy(&status.stderr)
    );
    assert!(
        table.contains(&view.id),
        "tessera status does not list {}:\n{table}",
        view.id
    );
    assert!(
        table.contains("default/p1/main"),
        "tessera status does not name the pod:\n{table}"
    );
    // ... and in the arbiter's metrics, so the series join with dcgm-exporter's.
    let arbiter_metrics = scrape(&node.metrics_addr_in("arbiter.log").await).await;
    let limit_line = arbiter_metrics
        .lines()
        .find(|l| {
            l.starts_with("tessera_allocation_memory_limit_bytes{")
                && l.contains(&format!("allocation=\"{}\"", view.id))
        })
        .unwrap_or_else(|| panic!("no limit series for {}:\n{arbiter_metrics}", view.id));
    for label in ["namespace=\"default\"", "pod=\"p1\"", "container=\"main\""] {
        assert!(limit_line.contains(label), "{label} missing: {limit_line}");
    }

    // Stale clean-up: kept while a container holds the units, through polls made well past
    // the 1 s grace ...
    let since = podres.lists();
    podres
        .polled(
            since,
            3,
            std::time::Instant::now(),
            Duration::from_millis(2500),
        )
        .await;
    assert_eq!(
        node.allocations().len(),
        1,
        "a held allocation must not be cleaned up"
    );
    // ... and deleted once none does.
    podres.set_holding("p1", &[]);
    wait_allocations(&node, 10, "stale allocation deleted", |a| a.is_empty()).await;
    wait_sample(&maddr, "tessera_plugin_stale_cleanups_total", 1.0).await;

    // Whole GPUs: 200 units = both GPUs, one full allocation each, no interposer.
    let mut all = unit_ids(&g0, 0..100);
    all.extend(unit_ids(&g1, 0..100));
    podres.set_holding("big", &all);
    let resp = allocate(&mut client, all.clone()).await.unwrap();
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], format!("{g0},{g1}"));
    assert!(!resp.envs.contains_key("TESSERA_TOKEN"));
    // No interposer and no socket: only the identity file, which tells the backstop the
    // container's processes own the cards.
    assert_eq!(resp.mounts.len(), 1, "{:?}", resp.mounts);
    assert_eq!(resp.mounts[0].container_path, "/etc/tessera/tenant");
    assert!(resp.mounts[0].read_only);
    let identity = std::fs::read_to_string(&resp.mounts[0].host_path).unwrap();
    assert!(
        identity.contains("token=") && !identity.contains("socket="),
        "{identity}"
    );
    let allocs = node.allocations();
    assert_eq!(allocs.len(), 2);
    assert!(
        allocs
            .iter()
            .all(|a| a.share == 100 && a.memory_limit == 80 * GIB)
    );

    // Units handed out again mean their old holder is gone: its allocation is replaced.
    podres.set_holding("big", &[]);
    let again = unit_ids(&g1, 0..10);
    podres.set_holding("p2", &again);
    let resp = allocate(&mut client, again).await.unwrap();
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], g1);
    let allocs = node.allocations();
    assert!(
        allocs.iter().all(|a| a.gpu_uuid != g1 || a.share == 10),
        "{allocs:?}"
    );
    // The GPU 0 whole allocation is orphaned and goes; the held one stays.
    wait_allocations(&node, 10, "orphaned whole-GPU allocation deleted", |a| {
        a.len() == 1 && a[0].gpu_uuid == g1
    })
    .await;

    kubelet.registrations.close();
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_health_and_kubelet_restart() {
    let mut node = Node::start().await;
    FakePodResources::default().serve(&node.podres());
    // The plugin starts before the kubelet is up: it waits for kubelet.sock (and says so).
    node.start_plugin();
    let log = node.dir.path().join("plugin.log");
    until(15, "the plugin waiting for kubelet.sock", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("waiting for").then_some(())
    })
    .await;
    let mut kubelet = FakeKubelet::start(&node.kubelet_dir());
    within(15, "registration", kubelet.registrations.recv())
        .await
        .unwrap();
    let gpus = node.gpus();
    let (g0, g1) = (gpus[0].uuid.clone(), gpus[1].uuid.clone());
    let mut client = node.plugin_client().await;
    let mut stream = within(5, "ListAndWatch", client.list_and_watch(Empty {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        next_list(&mut stream, "first list").await.devices.len(),
        200
    );

    // A running pod's allocation, which must survive the kubelet restart.
    let held = unit_ids(&g0, 0..10);
    let resp = allocate(&mut client, held).await.unwrap();
    let alloc_id = resp.envs["TESSERA_ALLOCATION_ID"].clone();

    // XID 13 (an application's fault) is ignored; XID 79 (fell off the bus) is not. The next
    // update must show GPU 0 healthy and GPU 1 unhealthy.
    tessera_sim_state::inject_xid(&node.sim.dir, 0, 13).unwrap();
    tessera_sim_state::inject_xid(&node.sim.dir, 1, 79).unwrap();
    let list = next_list(&mut stream, "update after XID 79").await;
    assert_eq!(list.devices.len(), 200);
    for d in &list.devices {
        let want = if d.id.starts_with(&g1) {
            "Unhealthy"
        } else {
            "Healthy"
        };
        assert_eq!(d.health, want, "{}", d.id);
    }
    let err = allocate(&mut client, unit_ids(&g1, 0..5))
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::FailedPrecondition,
        "{}",
        err.message()
    );
    let m = wait_sample(
        &node.metrics_addr().await,
        "tessera_plugin_units{state=\"unhealthy\"}",
        100.0,
    )
    .await;
    assert_eq!(
        sample(
            &m,
            "tessera_plugin_allocation_refusals_total{reason=\"unhealthy_gpu\"}"
        ),
        Some(1.0),
        "{m}"
    );

    // Kubelet restart: it stops, deletes every socket in the folder, and comes back.
    kubelet.stop().await;
    let restarted = Instant::now();
    for e in std::fs::read_dir(node.kubelet_dir()).unwrap().flatten() {
        std::fs::remove_file(e.path()).unwrap();
    }
    let mut kubelet = FakeKubelet::start(&node.kubelet_dir());
    let reg = within(10, "re-registration", kubelet.registrations.recv())
        .await
        .unwrap();
    eprintln!(
        "re-registration after kubelet restart took {:?}",
        restarted.elapsed()
    );
    assert_eq!(reg.endpoint, ENDPOINT);

    // The old stream ended with the old server; the new socket serves the same state.
    let ended = within(10, "old ListAndWatch stream ends", stream.message()).await;
    assert!(
        !matches!(ended, Ok(Some(_))),
        "old stream still delivering: {ended:?}"
    );
    let mut client = node.plugin_client().await;
    let mut stream = within(5, "ListAndWatch again", client.list_and_watch(Empty {}))
        .await
        .unwrap()
        .into_inner();
    let list = next_list(&mut stream, "list after restart").await;
    assert_eq!(
        list.devices
            .iter()
            .filter(|d| d.health == "Unhealthy")
            .count(),
        100
    );
    assert!(
        node.allocations().iter().any(|a| a.id == alloc_id),
        "allocation lost in the restart"
    );

    // A kubelet that only re-creates kubelet.sock (new inode, our socket left) is noticed too.
    kubelet.stop().await;
    std::fs::remove_file(node.kubelet_dir().join("kubelet.sock")).unwrap();
    let restarted = Instant::now();
    let mut kubelet = FakeKubelet::start(&node.kubelet_dir());
    within(
        10,
        "re-registration after kubelet.sock re-created",
        kubelet.registrations.recv(),
    )
    .await
    .unwrap();
    eprintln!(
        "re-registration after kubelet.sock re-created took {:?}",
        restarted.elapsed()
    );
    // One registration at start and one after each of the two restarts.
    wait_sample(
        &node.metrics_addr().await,
        "tessera_plugin_registrations_total",
        3.0,
    )
    .await;

    // SIGTERM: clean exit, socket removed.
    let mut plugin = node.plugin.take().unwrap();
    // SAFETY: kill has no memory preconditions; the pid is our own live child.
    unsafe { libc::kill(plugin.id() as i32, libc::SIGTERM) };
    let status = within(10, "plugin exit", async {
        loop {
            if let Some(st) = plugin.try_wait().unwrap() {
                return st;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(status.code(), Some(0));
    assert!(!node.kubelet_dir().join(ENDPOINT).exists());
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_left_to_another_plugin_are_neither_advertised_nor_allocated() {
    let mut node = Node::start().await;
    let mut kubelet = FakeKubelet::start(&node.kubelet_dir());
    FakePodResources::default().serve(&node.podres());
    let gpus = node.gpus();
    let (g0, g1) = (gpus[0].uuid.clone(), gpus[1].uuid.clone());
    // GPU 1 by its UUID (upper case: NVML writes lower), and a GPU the node does not have.
    node.start_plugin_with(&["--gpus", &format!("{},7", g1.to_uppercase())]);
    within(15, "registration", kubelet.registrations.recv())
        .await
        .unwrap();
    let mut client = node.plugin_client().await;
    let mut stream = within(5, "ListAndWatch", client.list_and_watch(Empty {}))
        .await
        .unwrap()
        .into_inner();
    let list = next_list(&mut stream, "first device list").await;
    assert_eq!(list.devices.len(), 100, "GPU 1's units alone");
    assert!(list.devices.iter().all(|d| d.id.starts_with(&g1)));
    let m = wait_sample(
        &node.metrics_addr().await,
        "tessera_plugin_units{state=\"healthy\"}",
        100.0,
    )
    .await;
    assert_eq!(
        sample(&m, "tessera_plugin_units{state=\"unhealthy\"}"),
        Some(0.0)
    );
    // Units of GPU 0 (the kubelet never had them) are refused, and nothing is made on it.
    let err = allocate(&mut client, unit_ids(&g0, 0..10))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("not on this node"),
        "{}",
        err.message()
    );
    let resp = allocate(&mut client, unit_ids(&g1, 0..10)).await.unwrap();
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], g1);
    let on: Vec<String> = node.allocations().into_iter().map(|a| a.gpu_uuid).collect();
    assert_eq!(on, [g1]);
    // An XID on GPU 0 is another plugin's business: the list stays as it is.
    tessera_sim_state::inject_xid(&node.sim.dir, 0, 79).unwrap();
    let quiet = tokio::time::timeout(Duration::from_secs(2), stream.message()).await;
    assert!(quiet.is_err(), "a list update after GPU 0's XID: {quiet:?}");
    let log = node.dir.path().join("plugin.log");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("--gpus names GPU 7, which this node does not have"),
        "{text}"
    );
    assert!(!text.contains(&g0), "GPU 0 is not the plugin's: {text}");

    // Nothing admitted (here from the environment): it still serves, with no unit, and says so.
    node.plugin.take();
    let log_file = std::fs::File::create(&log).unwrap();
    node.plugin = Some(KillOnDrop::new(
        node.plugin_command()
            .env(tessera_protocol::node::ENV_GPUS, "5")
            .stderr(log_file)
            .spawn()
            .unwrap(),
    ));
    within(15, "registration", kubelet.registrations.recv())
        .await
        .unwrap();
    let mut client = node.plugin_client().await;
    let mut stream = within(5, "ListAndWatch", client.list_and_watch(Empty {}))
        .await
        .unwrap()
        .into_inner();
    assert!(
        next_list(&mut stream, "empty list")
            .await
            .devices
            .is_empty()
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("ERROR") && text.contains("admits none of this node's 2 GPUs"),
        "{text}"
    );
    kubelet.stop().await;
}

#[tokio::test]
async fn bad_flags_and_missing_interposer_exit_with_documented_codes() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        Command::new(artifact("tessera-device-plugin"))
            .arg("--kubelet-dir")
            .arg(dir.path())
            .arg("--host-lib-dir")
            .arg(dir.path().join("lib"))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .unwrap()
    };
    let out = run(&["--shares-per-gpu", "0"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
    // A latency split that leaves the best-effort resource nothing, or names it twice.
    for bad in [
        &["--latency-shares", "100"][..],
        &[
            "--latency-shares",
            "10",
            "--latency-resource-name",
            RESOURCE,
        ],
        &["--latency-shares", "10", "--latency-endpoint", ENDPOINT],
    ] {
        let out = run(bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {err}");
        assert!(err.contains("--latency-"), "{bad:?}: {err}");
    }
    let out = run(&["--log-format", "yaml"]);
    assert_eq!(out.status.code(), Some(2));
    // A CDI kind that is not <vendor>/<class>.
    let out = run(&["--nvidia-cdi-kind", "nvidia.com"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--nvidia-cdi-kind") && err.contains("<vendor>/<class>"),
        "{err}"
    );
    // Logs as JSON lines on request: the interposer error is one object with its level.
    let out = run(&[
        "--log-format",
        "json",
        "--interposer",
        "/nonexistent/libtessera_interpose.so",
    ]);
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    let last: serde_json::Value = serde_json::from_str(err.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: not a JSON line: {err}"));
    assert_eq!(last["level"], "ERROR", "{err}");
    assert!(
        last["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("interposer")),
        "{err}"
    );
    let out = run(&["--interposer", "/nonexistent/libtessera_interpose.so"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("interposer"));
    // A file that does not load as the interposer is never installed for pods.
    let text = dir.path().join("libtessera_interpose.so");
    std::fs::write(&text, "not a library").unwrap();
    for bad in [Path::new("/bin/true"), text.as_path()] {
        let out = run(&["--install-only", "--interposer", bad.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{}: {err}", bad.display());
        assert!(
            err.contains("does not load as a shared library") && err.contains("refusing"),
            "{err}"
        );
        assert!(
            !dir.path().join("lib").exists()
                || std::fs::read_dir(dir.path().join("lib"))
                    .unwrap()
                    .next()
                    .is_none(),
            "nothing installed"
        );
    }
    // A CUDA driver library defines the CUDA hooks and finds dlsym in libc: refused too.
    let libcuda = tessera_testkit::artifact("libtessera_sim_cuda.so");
    let out = run(&["--install-only", "--interposer", libcuda.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("not the Tessera interposer"), "{err}");
    // --install-only installs and exits 0.
    let out = run(&["--install-only"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let names: Vec<String> = std::fs::read_dir(dir.path().join("lib"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names
            .iter()
            .any(|n| n.starts_with("libtessera_interpose-") && n.ends_with(".so"))
    );
    assert!(names.iter().any(|n| n.starts_with("ld.so.preload-")));

    // A metrics address that is not one is a bad flag; one already taken is a failure (1).
    let out = run(&["--metrics-addr", "localhost:9465"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--metrics-addr"), "{err}");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = run(&["--metrics-addr", &addr]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("cannot serve metrics on {addr}")),
        "{err}"
    );
}
