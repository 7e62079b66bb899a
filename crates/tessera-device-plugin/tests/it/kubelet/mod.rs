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

//!
//! Modules: `plugin` (registration, list, preferred allocation, allocate and clean-up, health,
//! kubelet restarts, flags and exit codes), `containers` (what a container gets and what it
//! cannot get around, run in real namespaces), `latency` (the latency tier's second resource).
//! The fake kubelet and pod-resources servers and the node fixture are here.

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

mod containers;
mod latency;
mod plugin;
