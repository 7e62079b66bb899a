//! End to end: a stand-in kubelet (written here, on the official `pluginregistration/v1` and
//! `dra/v1` protos) and a stand-in API server (`tessera_testkit::FakeApiServer`, real HTTP +
//! JSON) drive the real `tessera-dra` binary, with the real `tessera-arbiter` behind it on
//! the simulated GPUs (`2x80GiB`).
//!
//! Needs the built artifacts next to the test executable: `cargo build -p tessera-arbiter
//! -p tessera-cli -p tessera-sim-nvml -p tessera-sim-cuda -p tessera-interpose
//! -p tessera-examples -p tessera-dra`. The container tests need root and `unshare`, as the
//! device plugin's do; they fail, never skip, without.
//!
//! Modules: `prepare` (prepare and unprepare, refusals, the published slice), `containers`
//! (the CDI spec alone gives a container its limit; shares; claims of pods gone), `versions`
//! (a v1beta1 kubelet; a claim across two GPUs), `mig`. The stand-in node is here.

use std::collections::BTreeSet;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tessera_dra::proto::dra::dra_plugin_client::DraPluginClient;
use tessera_dra::proto::dra::{
    Claim, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest,
};
use tessera_dra::proto::registration::registration_client::RegistrationClient;
use tessera_dra::proto::registration::{InfoRequest, RegistrationStatus};
use tessera_dra::{CdiSpec as Spec, LABEL_CLAIM, LABEL_CLAIM_UID};
use tessera_node::grpc::connect_unix;
use tessera_protocol::AllocationStatus;
use tessera_protocol::client::AdminClient;
use tessera_protocol::identity::Identity;
use tessera_testkit::container::{Bind, Edits, container_command};
use tessera_testkit::{
    FakeApiServer, GIB, KillOnDrop, NodeOptions, PluginNode, artifact, target_dir, until, within,
};
use tonic::transport::Channel;

const NODE: &str = "node-a";
const DRIVER: &str = "gpu.tessera.dev";
/// The names the kubelet accepts in `supported_versions` (k8s.io/kubelet v0.36.3
/// `pkg/apis/dra/v1/types.go` and `v1beta1/types.go`, `DRAPluginService`), newest first as in
/// `servicesSupportedByKubelet` (k8s.io/kubernetes `pkg/kubelet/cm/dra/plugin/dra_plugin.go`).
const DRA_V1: &str = "v1.DRAPlugin";
const DRA_V1BETA1: &str = "v1beta1.DRAPlugin";

/// The shared node (simulated GPUs, arbiter, plugin, logs on failure) and the stand-in API
/// server.
struct Node {
    node: PluginNode,
    api: FakeApiServer,
}

impl Deref for Node {
    type Target = PluginNode;
    fn deref(&self) -> &PluginNode {
        &self.node
    }
}

impl DerefMut for Node {
    fn deref_mut(&mut self) -> &mut PluginNode {
        &mut self.node
    }
}

impl Node {
    fn start() -> Node {
        Self::start_with(false)
    }

    /// `container`: the emulated containers' setting (no context memory, so a limit is
    /// exactly the GiB a process gets; the arbiter's host mount namespace is this one's).
    fn start_with(container: bool) -> Node {
        let mut opts = NodeOptions {
            dirs: &["registry"],
            ..NodeOptions::default()
        };
        if container {
            opts.context_memory = Some("0");
            opts.arbiter_args = &["--host-mount-ns", "/proc/self/ns/mnt"];
        }
        Node {
            node: PluginNode::start(opts),
            api: FakeApiServer::start(),
        }
    }

    fn start_plugin(&mut self) {
        self.start_plugin_with(&[]);
    }

    fn start_plugin_with(&mut self, extra: &[&str]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("plugin.log"))
            .unwrap();
        let mut cmd = Command::new(artifact("tessera-dra"));
        cmd.args(["--node-name", NODE, "--resync", "0.2"])
            .arg("--registry-dir")
            .arg(self.path("registry"))
            .arg("--plugin-dir")
            .arg(self.path("plugins/gpu.tessera.dev"))
            .arg("--cdi-dir")
            .arg(self.path("cdi"))
            .arg("--api-server")
            .arg(self.api.url())
            .arg("--admin-socket")
            .arg(&self.spec.admin_socket)
            .arg("--tenant-socket")
            .arg(&self.spec.socket)
            .arg("--host-lib-dir")
            .arg(self.path("host-lib"))
            .arg("--host-identity-dir")
            .arg(self.path("identity"))
            .arg("--interposer")
            .arg(artifact("libtessera_interpose.so"))
            .arg("--sysfs")
            .arg(self.path("sys"))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log);
        self.sim.apply(&mut cmd);
        self.plugin = Some(KillOnDrop::new(cmd.spawn().unwrap()));
    }

    /// SIGTERMs the plugin and waits for its exit.
    async fn stop_plugin(&mut self) {
        let mut p = self.plugin.take().expect("plugin running");
        // SAFETY: kill has no memory preconditions; the pid is our unreaped child.
        unsafe { libc::kill(p.id() as i32, libc::SIGTERM) };
        let status = until(15, "plugin exit after SIGTERM", || p.try_wait().unwrap()).await;
        assert!(status.success(), "plugin exit: {status}");
        p.take();
    }

    fn registration_socket(&self) -> PathBuf {
        self.path("registry/gpu.tessera.dev-reg.sock")
    }

    /// Registers like the kubelet's plugin watcher and returns a client on the endpoint.
    async fn kubelet_register(&self) -> DraPluginClient<Channel> {
        let reg = self.registration_socket();
        // The file appears at bind, a moment before the listen: retry as the kubelet's plugin
        // watcher does (its reconciler tries again every second).
        let ch = within(20, "registration socket answering", async {
            loop {
                if let Ok(ch) = connect_unix(&reg, Duration::from_secs(5)).await {
                    return ch;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        let mut client = RegistrationClient::new(ch);
        let info = within(10, "GetInfo", client.get_info(InfoRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, DRIVER);
        assert_eq!(
            Path::new(&info.endpoint),
            self.path("plugins/gpu.tessera.dev/dra.sock")
        );
        // As the kubelet's validateSupportedServices: the first of the plugin's entries the
        // kubelet speaks, else the registration is refused.
        let chosen = info
            .supported_versions
            .iter()
            .find(|v| [DRA_V1, DRA_V1BETA1].contains(&v.as_str()));
        assert_eq!(chosen.map(String::as_str), Some(DRA_V1), "{info:?}");
        within(
            10,
            "NotifyRegistrationStatus",
            client.notify_registration_status(RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            }),
        )
        .await
        .unwrap();
        // The kubelet dials unix sockets with authority `localhost` (connect_unix does too).
        let ch = connect_unix(Path::new(&info.endpoint), Duration::from_secs(5))
            .await
            .unwrap();
        DraPluginClient::new(ch)
    }

    fn admin(&self) -> AdminClient {
        AdminClient::connect(&self.spec.admin_socket).unwrap()
    }

    fn claim_allocations(&self, uid: &str) -> Vec<AllocationStatus> {
        let mut v: Vec<AllocationStatus> = self
            .admin()
            .list()
            .unwrap()
            .into_iter()
            .filter(|a| a.labels.get(LABEL_CLAIM_UID).map(String::as_str) == Some(uid))
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    fn files(&self, sub: &str) -> BTreeSet<String> {
        std::fs::read_dir(self.path(sub))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn gpu_uuid(&self, index: u32) -> String {
        self.admin().gpus().unwrap()[index as usize].uuid.clone()
    }
}

/// A claim as the scheduler leaves it: one request, one result on `device` (with
/// consumedCapacity and a shareID for a fraction; neither for a whole GPU), reserved for one
/// pod.
fn claim(name: &str, uid: &str, device: &str, capacity: Option<(&str, &str)>) -> Value {
    let mut result = json!({
        "request": "gpu", "driver": DRIVER, "pool": NODE, "device": device,
    });
    let mut exactly =
        json!({"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 1});
    if let Some((shares, memory)) = capacity {
        let cap = json!({"shares": shares, "memory": memory});
        result["consumedCapacity"] = cap.clone();
        result["shareID"] = json!(format!(
            "{:0>8}-0000-4000-8000-000000000000",
            &uid[..uid.len().min(8)]
        ));
        exactly["capacity"] = json!({"requests": cap});
    }
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        "status": {
            "allocation": {
                "devices": {"results": [result]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}
            },
            "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"),
                             "uid": format!("pod-{uid}")}]
        }
    })
}

fn kclaim(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: "team-a".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

async fn prepare(
    c: &mut DraPluginClient<Channel>,
    claims: &[Claim],
) -> std::collections::HashMap<String, NodePrepareResourceResponse> {
    within(
        20,
        "NodePrepareResources",
        c.node_prepare_resources(NodePrepareResourcesRequest {
            claims: claims.to_vec(),
        }),
    )
    .await
    .unwrap()
    .into_inner()
    .claims
}

async fn unprepare(c: &mut DraPluginClient<Channel>, claims: &[Claim]) -> Vec<String> {
    let r = within(
        20,
        "NodeUnprepareResources",
        c.node_unprepare_resources(NodeUnprepareResourcesRequest {
            claims: claims.to_vec(),
        }),
    )
    .await
    .unwrap()
    .into_inner()
    .claims;
    claims.iter().map(|c| r[&c.uid].error.clone()).collect()
}

fn read_spec(node: &Node, uid: &str) -> Spec {
    let p = node.path(&format!("cdi/tessera.dev-claim_{uid}.json"));
    serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
}

mod containers;
mod mig;
mod prepare;
mod versions;
