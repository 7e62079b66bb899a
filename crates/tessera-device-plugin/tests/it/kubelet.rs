//! End-to-end: a fake kubelet written here (a `Registration` server and a `PodResources`
//! server on temporary sockets) drives the real `tessera-device-plugin` binary the way the
//! kubelet would, with the real `tessera-arbiter` behind it and the simulated NVML
//! (`TESSERA_SIM_GPUS=2x80GiB`) on `LD_LIBRARY_PATH`.
//!
//! Needs the built artifacts next to the test executable (`<target>/debug/`): build with
//! `cargo build -p tessera-arbiter -p tessera-cli -p tessera-sim-nvml -p tessera-sim-cuda
//! -p tessera-interpose -p tessera-examples -p tessera-device-plugin`. The container test
//! needs root and `unshare` (as a container runtime does); it fails, never skips, without.
//! The metrics check needs `promtool` (Debian package `prometheus`; or `TESSERA_PROMTOOL`),
//! and fails without it too.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_device_plugin::proto::deviceplugin::device_plugin_client::DevicePluginClient;
use tessera_device_plugin::proto::deviceplugin::registration_server::{
    Registration, RegistrationServer,
};
use tessera_device_plugin::proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, Empty, ListAndWatchResponse, PreferredAllocationRequest,
    RegisterRequest,
};
use tessera_device_plugin::proto::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use tessera_device_plugin::proto::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use tessera_node::grpc::connect_unix;
use tessera_protocol::client::{AdminClient, TenantClient};
use tessera_protocol::{AllocationStatus, GpuInfo, LABEL_CONTAINER, LABEL_NAMESPACE, LABEL_POD};
use tessera_testkit::container::{self, Bind, Edits};
use tessera_testkit::{KillOnDrop, NodeOptions, PluginNode, artifact, target_dir, until, within};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

const RESOURCE: &str = "tessera.dev/gpu-shares";
const ENDPOINT: &str = "tessera.sock";
const GIB: u64 = 1 << 30;
const CONTAINER_LIB: &str = "/usr/lib/tessera/libtessera_interpose.so";

// ---- the fake kubelet ----

struct FakeRegistration {
    tx: mpsc::UnboundedSender<RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for FakeRegistration {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let _ = self.tx.send(req.into_inner());
        Ok(Response::new(Empty {}))
    }
}

/// A kubelet registration server on `<dir>/kubelet.sock`.
struct FakeKubelet {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    registrations: mpsc::UnboundedReceiver<RegisterRequest>,
}

impl FakeKubelet {
    fn start(dir: &Path) -> Self {
        let sock = dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = UnixListener::bind(&sock).unwrap();
        let (tx, registrations) = mpsc::unbounded_channel();
        let (stop, mut stop_rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(FakeRegistration { tx }))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                    let _ = stop_rx.wait_for(|s| *s).await;
                })
                .await;
        });
        Self {
            stop,
            task,
            registrations,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        let mut task = self.task;
        if tokio::time::timeout(Duration::from_secs(3), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }
}

/// The PodResources `List` answer, set by the test, and how many `List` calls it answered (the
/// positive signal that the plugin has polled since some point).
#[derive(Clone, Default)]
struct FakePodResources {
    pods: Arc<Mutex<Vec<PodResources>>>,
    lists: Arc<std::sync::atomic::AtomicU64>,
}

impl FakePodResources {
    fn lists(&self) -> u64 {
        self.lists.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until the plugin has made `n` more `List` calls than `since` and at least `at_least`
    /// has passed since `from`: what it did after those polls is what it does.
    async fn polled(&self, since: u64, n: u64, from: std::time::Instant, at_least: Duration) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self.lists() < since + n || from.elapsed() < at_least {
            assert!(
                std::time::Instant::now() < deadline,
                "the plugin made {} PodResources List calls, {n} expected",
                self.lists() - since
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn set_holding(&self, pod: &str, ids: &[String]) {
        self.set_holding_of(pod, &[(RESOURCE, ids)]);
    }

    /// Pod `pod`'s one container holds these ids of each resource (none: the pod is gone).
    fn set_holding_of(&self, pod: &str, held: &[(&str, &[String])]) {
        let mut pods = self.pods.lock().unwrap();
        pods.retain(|p| p.name != pod);
        let devices: Vec<ContainerDevices> = held
            .iter()
            .filter(|(_, ids)| !ids.is_empty())
            .map(|(resource, ids)| ContainerDevices {
                resource_name: (*resource).into(),
                device_ids: ids.to_vec(),
                topology: None,
            })
            .collect();
        if !devices.is_empty() {
            pods.push(PodResources {
                name: pod.into(),
                namespace: "default".into(),
                containers: vec![ContainerResources {
                    name: "main".into(),
                    devices,
                    ..Default::default()
                }],
            });
        }
    }

    fn serve(&self, sock: &Path) {
        let listener = UnixListener::bind(sock).unwrap();
        let svc = self.clone();
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(svc))
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
    }
}

#[tonic::async_trait]
impl PodResourcesLister for FakePodResources {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let pod_resources = self.pods.lock().unwrap().clone();
        self.lists.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not used by the plugin"))
    }

    async fn get(
        &self,
        _: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not used by the plugin"))
    }
}

// ---- the node: simulated GPUs, arbiter, plugin ----

/// The shared node (simulated GPUs, arbiter, plugin, logs on failure) with this plugin's
/// paths in it.
struct Node(PluginNode);

impl Deref for Node {
    type Target = PluginNode;
    fn deref(&self) -> &PluginNode {
        &self.0
    }
}

impl DerefMut for Node {
    fn deref_mut(&mut self) -> &mut PluginNode {
        &mut self.0
    }
}

impl Node {
    fn kubelet_dir(&self) -> PathBuf {
        self.dir.path().join("device-plugins")
    }
    fn admin(&self) -> PathBuf {
        self.dir.path().join("run/admin.sock")
    }
    fn tenant(&self) -> PathBuf {
        self.dir.path().join("run/tenant/tessera.sock")
    }
    fn podres(&self) -> PathBuf {
        self.dir.path().join("pod-resources/kubelet.sock")
    }
    fn host_lib(&self) -> PathBuf {
        self.dir.path().join("host-lib")
    }

    /// Starts the simulated machine and the arbiter; waits for its sockets.
    async fn start() -> Node {
        let opts = NodeOptions {
            dirs: &["device-plugins", "pod-resources", "state"],
            // The emulated containers run in private mount namespaces of this one, which
            // stands for the host's (pid 1's may not be readable here). Its metrics on a free
            // port (the test kit turns them off by default).
            arbiter_args: &[
                "--host-mount-ns",
                "/proc/self/ns/mnt",
                "--metrics-addr",
                "127.0.0.1:0",
            ],
            ready_timeout: Some(Duration::from_secs(15)),
            ..NodeOptions::default()
        };
        // The wait blocks (bounded by ready_timeout); nothing else runs on the runtime yet.
        Node(tokio::task::block_in_place(|| PluginNode::start(opts)))
    }

    fn plugin_command(&self) -> Command {
        let mut cmd = Command::new(artifact("tessera-device-plugin"));
        cmd.arg("--kubelet-dir")
            .arg(self.kubelet_dir())
            .arg("--pod-resources-socket")
            .arg(self.podres())
            .arg("--admin-socket")
            .arg(self.admin())
            .arg("--tenant-socket")
            .arg(self.tenant())
            .arg("--host-lib-dir")
            .arg(self.host_lib())
            .arg("--host-identity-dir")
            .arg(self.dir.path().join("identity"))
            .args([
                "--gpu-source",
                "nvml",
                "--stale-grace",
                "1",
                "--stale-interval",
                "0.2",
                // Tests run side by side: each plugin takes a free port.
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .stdout(Stdio::null());
        self.sim.apply(&mut cmd);
        cmd
    }

    /// Starts the plugin; the interposer is found next to the binary (no --interposer).
    fn start_plugin(&mut self) {
        self.start_plugin_with(&[]);
    }

    fn start_plugin_with(&mut self, extra: &[&str]) {
        let log = std::fs::File::create(self.dir.path().join("plugin.log")).unwrap();
        self.plugin = Some(KillOnDrop::new(
            self.plugin_command()
                .args(extra)
                .stderr(log)
                .spawn()
                .unwrap(),
        ));
    }

    fn admin_client(&self) -> AdminClient {
        AdminClient::connect(&self.admin()).unwrap()
    }

    fn gpus(&self) -> Vec<GpuInfo> {
        self.admin_client().gpus().unwrap()
    }

    fn allocations(&self) -> Vec<AllocationStatus> {
        self.admin_client().list().unwrap()
    }

    /// The plugin's metrics address, from its log line `metrics on http://ADDR/metrics`.
    async fn metrics_addr(&self) -> String {
        self.metrics_addr_in("plugin.log").await
    }

    /// The metrics address a daemon logged in `log_name` (`plugin.log`, `arbiter.log`).
    async fn metrics_addr_in(&self, log_name: &str) -> String {
        within(15, "metrics address in the log", async {
            loop {
                let log =
                    std::fs::read_to_string(self.dir.path().join(log_name)).unwrap_or_default();
                if let Some(rest) = log.split("metrics on http://").nth(1)
                    && let Some(addr) = rest.split("/metrics").next()
                {
                    return addr.to_owned();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
    }

    async fn plugin_client(&self) -> DevicePluginClient<Channel> {
        self.plugin_client_at(ENDPOINT).await
    }

    /// A client of the plugin's resource served on socket `endpoint`.
    async fn plugin_client_at(&self, endpoint: &str) -> DevicePluginClient<Channel> {
        let ch = connect_unix(&self.kubelet_dir().join(endpoint), Duration::from_secs(5))
            .await
            .unwrap();
        DevicePluginClient::new(ch)
    }
}

/// One scrape of `http://addr/metrics`: the body, after checking the status and type.
async fn scrape(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let raw = within(10, "scrape", async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.unwrap();
        String::from_utf8(buf).unwrap()
    })
    .await;
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    body.to_owned()
}

/// The value of one series (`name` or `name{labels}`, exactly as exposed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Waits (bounded) until a series has `value`; returns that scrape.
async fn wait_sample(addr: &str, series: &str, value: f64) -> String {
    within(10, series, async {
        loop {
            let m = scrape(addr).await;
            if sample(&m, series) == Some(value) {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
}

fn unit_ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| format!("{uuid}-{n}")).collect()
}

async fn next_list(
    stream: &mut Streaming<ListAndWatchResponse>,
    what: &str,
) -> ListAndWatchResponse {
    within(10, what, stream.message())
        .await
        .unwrap()
        .expect("stream open")
}

async fn allocate(
    client: &mut DevicePluginClient<Channel>,
    ids: Vec<String>,
) -> Result<ContainerAllocateResponse, Status> {
    let req = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
    };
    let resp = within(15, "Allocate", client.allocate(req)).await?;
    Ok(resp
        .into_inner()
        .container_responses
        .into_iter()
        .next()
        .expect("one container"))
}

async fn preferred(
    client: &mut DevicePluginClient<Channel>,
    available: Vec<String>,
    size: i32,
) -> Result<Vec<String>, Status> {
    let req = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: vec![],
            allocation_size: size,
        }],
    };
    let resp = within(
        10,
        "GetPreferredAllocation",
        client.get_preferred_allocation(req),
    )
    .await?;
    Ok(resp.into_inner().container_responses.remove(0).device_i_ds)
}

/// Waits (bounded) until `cond` holds on the arbiter's allocation list.
async fn wait_allocations(
    node: &Node,
    secs: u64,
    what: &str,
    cond: impl Fn(&[AllocationStatus]) -> bool,
) {
    within(secs, what, async {
        loop {
            if cond(&node.allocations()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
}

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

/// An `Allocate` answer as the container edits a runtime applies.
fn edits(resp: &ContainerAllocateResponse) -> Edits {
    Edits {
        mounts: resp
            .mounts
            .iter()
            .map(|m| Bind {
                host: m.host_path.clone().into(),
                container: m.container_path.clone().into(),
                read_only: m.read_only,
            })
            .collect(),
        env: resp
            .envs
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }
}

/// [`tessera_testkit::container::run_in_container`] for an `Allocate` answer.
fn run_in_container(
    resp: &ContainerAllocateResponse,
    root: &Path,
    shared: &[&Path],
    env: &[(&str, String)],
    program: &Path,
) -> std::process::Output {
    container::run_in_container(&edits(resp), root, shared, env, program)
}

/// [`tessera_testkit::container::container_command`] for an `Allocate` answer.
fn container_command(
    resp: &ContainerAllocateResponse,
    root: &Path,
    shared: &[&Path],
    env: &[(&str, String)],
    program: &Path,
    args: &[&str],
) -> Command {
    container::container_command(&edits(resp), root, shared, env, program, args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_gets_the_interposer_and_its_limit() {
    let (node, kubelet, podres) = container_node().await;
    let g0 = node.gpus()[0].uuid.clone();
    let mut client = node.plugin_client().await;
    let units = unit_ids(&g0, 0..30);
    podres.set_holding("p", &units);
    let resp = allocate(&mut client, units).await.unwrap();
    // The card's device of the node's NVIDIA CDI spec, for a runtime without NVIDIA's.
    let cdi: Vec<&str> = resp.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(cdi, [format!("nvidia.com/gpu={g0}")]);

    let hello = artifact("hello_gpu");
    let target = target_dir();
    let sim_env = node.sim.var_strings();
    let root = tempfile::tempdir().unwrap();
    let out = tokio::task::block_in_place(|| {
        run_in_container(
            &resp,
            root.path(),
            &[&target, node.dir.path()],
            &sim_env,
            &hello,
        )
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let shown = format!("container stdout:\n{stdout}\ncontainer stderr:\n{stderr}");
    // Preloaded through /etc/ld.so.preload (no LD_PRELOAD in the environment), the interposer
    // reached the arbiter with the token: the card shows the allocation's 24 GiB, and the
    // program's 40 GiB allocation is refused with CUDA_ERROR_OUT_OF_MEMORY (2).
    assert!(
        stdout.contains("GPU 0: Tessera Sim GPU 80GiB, 24 GiB"),
        "{shown}"
    );
    assert!(
        stderr.contains("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
            && !stderr.contains("panicked"),
        "{shown}"
    );
    assert!(!out.status.success(), "{shown}");

    // Control: the same container without the preload file sees the whole card.
    let mut bare = resp.clone();
    bare.mounts
        .retain(|m| m.container_path != "/etc/ld.so.preload");
    let root = tempfile::tempdir().unwrap();
    let out = tokio::task::block_in_place(|| {
        run_in_container(
            &bare,
            root.path(),
            &[&target, node.dir.path()],
            &sim_env,
            &hello,
        )
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let shown = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("GPU 0: Tessera Sim GPU 80GiB, 80 GiB"),
        "{shown}"
    );
    assert!(stdout.contains("allocated 40 GiB"), "{shown}");
    kubelet.stop().await;
}

/// A node whose plugin puts the interposer under /opt (the emulated containers share the
/// host's /usr) and names the GPUs' NVIDIA CDI devices (the emulated runtime ignores them),
/// registered with a fake kubelet that serves PodResources.
async fn container_node() -> (Node, FakeKubelet, FakePodResources) {
    let mut node = Node::start().await;
    let mut kubelet = FakeKubelet::start(&node.kubelet_dir());
    let podres = FakePodResources::default();
    podres.serve(&node.podres());
    node.start_plugin_with(&[
        "--container-lib-path",
        "/opt/tessera/libtessera_interpose.so",
        "--nvidia-cdi-kind",
        "nvidia.com/gpu",
    ]);
    within(15, "registration", kubelet.registrations.recv())
        .await
        .unwrap();
    (node, kubelet, podres)
}

/// The arbiter's log once it contains `needle` (a backstop action is logged just after its
/// kill, so a test that saw the process die may be a moment early); panics after 30 s.
fn arbiter_log_with(node: &Node, needle: &str) -> String {
    let t = Instant::now();
    loop {
        let log = std::fs::read_to_string(node.dir.path().join("arbiter.log")).unwrap_or_default();
        if log.contains(needle) {
            return log;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no {needle:?} in the arbiter log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The simulated machine's variables as strings, for a container's environment.
fn sim_env(node: &Node) -> Vec<(&'static str, String)> {
    node.sim.var_strings()
}

/// Allocates `n` units of GPU 0 for pod `pod` through the plugin.
async fn allocate_units(
    node: &Node,
    podres: &FakePodResources,
    range: std::ops::Range<u32>,
    pod: &str,
) -> ContainerAllocateResponse {
    let g0 = node.gpus()[0].uuid.clone();
    let mut client = node.plugin_client().await;
    let units = unit_ids(&g0, range);
    podres.set_holding(pod, &units);
    allocate(&mut client, units).await.unwrap()
}

/// Runs the `tenant` example in an emulated container until it exits, and returns its
/// stdout, stderr, exit status and how long it lived after its memory was taken (the line
/// "holds N GiB" on stdout).
fn run_tenant(
    node: &Node,
    resp: &ContainerAllocateResponse,
    env: &[(&str, String)],
    args: &[&str],
) -> (String, String, std::process::ExitStatus, Option<Duration>) {
    use std::io::BufRead;
    let root = tempfile::tempdir().unwrap();
    let target = target_dir();
    let mut child = container_command(
        resp,
        root.path(),
        &[&target, node.dir.path()],
        env,
        &artifact("tenant"),
        args,
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("unshare (util-linux) is needed to emulate a container");
    let err = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
    let mut out = String::new();
    let mut held_at = None;
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap_or_default();
        if held_at.is_none() && line.contains(" holds ") {
            held_at = Some(Instant::now());
        }
        out.push_str(&line);
        out.push('\n');
    }
    let status = child.wait().unwrap();
    (
        out,
        err.join().unwrap(),
        status,
        held_at.map(|t| t.elapsed()),
    )
}

fn killed(status: &std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() == Some(libc::SIGKILL)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_that_unsets_its_token_or_fakes_its_socket_still_gets_its_limit() {
    let (node, kubelet, podres) = container_node().await;
    let resp = allocate_units(&node, &podres, 0..30, "p").await;
    let mut no_token = resp.clone();
    no_token.envs.remove("TESSERA_TOKEN");
    let mut fake_socket = resp.clone();
    fake_socket
        .envs
        .insert("TESSERA_SOCKET".into(), "/tmp/fake-arbiter.sock".into());
    fake_socket
        .envs
        .insert("TESSERA_TOKEN".into(), "forged".into());
    for (what, r) in [
        ("token unset", &no_token),
        ("socket and token forged", &fake_socket),
    ] {
        let (out, err, status, _) = tokio::task::block_in_place(|| {
            run_tenant(
                &node,
                r,
                &sim_env(&node),
                &["--grab-gib", "40", "--seconds", "0.2"],
            )
        });
        let shown = format!("{what}\nstdout:\n{out}\nstderr:\n{err}");
        // The interposer took token and socket from the read-only identity file: it reached
        // the real arbiter (the card shows the allocation's 24 GiB) and, its context taking
        // 300 MiB of the limit, the 24th GiB was refused with CUDA_ERROR_OUT_OF_MEMORY.
        assert!(out.contains("with 24.0 GiB"), "{shown}");
        assert!(
            out.contains("holds 23 GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY"),
            "{shown}"
        );
        assert!(status.success(), "{shown}\n{status:?}");
    }
    // The card never held more than the limit, and nobody was killed.
    let log = std::fs::read_to_string(node.dir.path().join("arbiter.log")).unwrap();
    assert!(!log.contains("backstop: pid"), "{log}");
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_process_that_never_connects_is_attributed_by_its_identity_and_killed() {
    let (node, kubelet, podres) = container_node().await;
    let resp = allocate_units(&node, &podres, 0..30, "p").await;
    // A copy of ld.so that ignores /etc/ld.so.preload, or a static binary: the interposer is
    // never loaded and nothing ever connects to the arbiter.
    let mut bare = resp.clone();
    bare.mounts
        .retain(|m| m.container_path != "/etc/ld.so.preload");
    let (out, err, status, after) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &bare,
            &sim_env(&node),
            &["--grab-gib", "40", "--seconds", "10"],
        )
    });
    let shown = format!("stdout:\n{out}\nstderr:\n{err}");
    assert!(killed(&status), "{status:?}\n{shown}");
    // The backstop may kill it while it is still allocating (a poll can land anywhere in
    // the 40 allocations), so what it held comes from the kill line, not from its stdout.
    let id = &resp.envs["TESSERA_ALLOCATION_ID"];
    let log = arbiter_log_with(&node, &format!("of allocation {id} killed"));
    let line = log
        .lines()
        .find(|l| l.contains(&format!("of allocation {id} killed")))
        .unwrap();
    assert!(line.contains("never connected"), "{line}");
    // No interposer: the driver gave it more than the 24 GiB limit, and only then was it
    // killed.
    let held = tessera_testkit::backstop_held_bytes(line, "killed")
        .unwrap_or_else(|| panic!("no held figure in {line:?}"))
        / GIB as f64;
    assert!(
        held > 24.0,
        "it was over its limit when killed: {line}\n{shown}"
    );
    eprintln!(
        "a container process over its limit that never connected: killed holding {held} GiB, {}",
        after.map_or("before it finished allocating".to_owned(), |a| format!(
            "{a:?} after it held all 40"
        ))
    );
    let used = tessera_sim_state::device_memory_used(&node.sim.dir, 0).unwrap();
    assert!(used < 24 << 30, "the card gave the memory back: {used}");
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_without_shares_that_reaches_the_gpu_is_killed_and_whole_gpus_are_left_alone() {
    let (node, kubelet, podres) = container_node().await;
    // A pod that asked for no shares but reached the device anyway (a privileged pod, or
    // NVIDIA_VISIBLE_DEVICES=all): no mount, no identity.
    let none = ContainerAllocateResponse::default();
    let (out, err, status, _) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &none,
            &sim_env(&node),
            &["--grab-gib", "1", "--seconds", "10"],
        )
    });
    assert!(killed(&status), "{status:?}\n{out}\n{err}");
    let log = arbiter_log_with(&node, "unknown container process");
    assert!(log.contains("killed"), "{log}");

    // A pod holding both whole GPUs runs without the interposer and uses its cards freely:
    // memory and GPU time outside any lease; it is attributed (identity file) and untouched.
    let gpus = node.gpus();
    let mut client = node.plugin_client().await;
    let mut units = unit_ids(&gpus[0].uuid, 0..100);
    units.extend(unit_ids(&gpus[1].uuid, 0..100));
    podres.set_holding("whole", &units);
    let whole = allocate(&mut client, units).await.unwrap();
    assert_eq!(whole.mounts.len(), 1, "only the identity file: {whole:?}");
    assert_eq!(whole.mounts[0].container_path, "/etc/tessera/tenant");
    let cdi: Vec<&str> = whole.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    let each: Vec<String> = whole.envs["NVIDIA_VISIBLE_DEVICES"]
        .split(',')
        .map(|u| format!("nvidia.com/gpu={u}"))
        .collect();
    assert_eq!(cdi, each);
    assert_eq!(cdi.len(), 2, "{cdi:?}");
    let env = sim_env(&node);
    let (out, err, status, _) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &whole,
            &env,
            &["--grab-gib", "60", "--seconds", "1.5"],
        )
    });
    assert!(status.success(), "{status:?}\n{out}\n{err}");
    assert!(out.contains("holds 60 GiB"), "{out}");
    // Its second card too: attributed to its first allocation (the identity's), it holds
    // the other card through their group, so it is not policed there either.
    // (The emulated runtime does not map NVIDIA_VISIBLE_DEVICES; the simulator honours
    // CUDA_VISIBLE_DEVICES, which is what the runtime's cards look like to CUDA.)
    let (_, other) = whole.envs["NVIDIA_VISIBLE_DEVICES"]
        .split_once(',')
        .expect("two cards");
    let mut env2 = env.clone();
    env2.push(("CUDA_VISIBLE_DEVICES", other.to_owned()));
    let (out, err, status, _) = tokio::task::block_in_place(|| {
        run_tenant(
            &node,
            &whole,
            &env2,
            &["--grab-gib", "60", "--seconds", "1.5"],
        )
    });
    assert!(status.success(), "{status:?}\n{out}\n{err}");
    assert!(out.contains("holds 60 GiB"), "{out}");
    let log = std::fs::read_to_string(node.dir.path().join("arbiter.log")).unwrap();
    assert_eq!(
        log.matches("killed").count(),
        1,
        "only the pod without shares: {log}"
    );
    kubelet.stop().await;
}

/// Issue 20, the pid-reuse trap aimed at a whole-GPU pod: tenant A (1 GiB on GPU 0) keeps a
/// connection open whose process exited; a process of a pod holding GPU 1 wholly then gets
/// that pid and takes 60 GiB of its card. Its own identity file wins: it is the pod's, on the
/// pod's card, and nobody is killed or counted against A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_gpu_pods_process_on_a_trap_pid_stays_its_pods() {
    let (node, kubelet, podres) = container_node().await;
    let gpus = node.gpus();
    let (token_a, a) = node
        .admin_client()
        .create(tessera_testkit::allocation(0, 1 << 30, 10, None))
        .unwrap();
    let trap = tessera_testkit::trap::set(Command::new("python3"), &node.tenant(), &token_a);
    assert!(trap.answer > 0, "the arbiter answered the hello");
    let mut client = node.plugin_client().await;
    let units = unit_ids(&gpus[1].uuid, 0..100);
    podres.set_holding("whole", &units);
    let whole = allocate(&mut client, units).await.unwrap();
    // What the runtime's NVIDIA_VISIBLE_DEVICES does on a node (the emulation does not map it).
    let mut env = sim_env(&node);
    env.push(("CUDA_VISIBLE_DEVICES", gpus[1].uuid.clone()));
    let target = target_dir();
    let (out, status) = tokio::task::block_in_place(|| {
        let (mut child, _root) = tessera_testkit::trap::at_pid(trap.pid, || {
            // A fresh root each try: the emulation's script builds it once.
            let root = tempfile::tempdir().unwrap();
            let c = container_command(
                &whole,
                root.path(),
                &[&target, node.dir.path()],
                &env,
                &artifact("tenant"),
                &["--grab-gib", "60", "--seconds", "1.5"],
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("unshare (util-linux) is needed to emulate a container");
            let pid = c.id() as i32;
            ((KillOnDrop::new(c), root), pid)
        });
        let out = std::io::read_to_string(child.stdout.take().unwrap()).unwrap();
        (out, child.wait().unwrap())
    });
    let log = std::fs::read_to_string(node.dir.path().join("arbiter.log")).unwrap();
    assert!(status.success(), "{status:?}\n{out}\n{log}");
    assert!(out.contains("holds 60 GiB"), "{out}");
    assert!(!log.contains("killed"), "{log}");
    let a_now = node
        .admin_client()
        .list()
        .unwrap()
        .into_iter()
        .find(|x| x.id == a.id)
        .unwrap();
    assert_eq!((a_now.enforced, a_now.gpu_time_total_ns), (0, 0), "{log}");
    trap.release();
    kubelet.stop().await;
}

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
