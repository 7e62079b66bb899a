//! A node for the kubelet plugins' end-to-end tests (`tessera-device-plugin`'s and
//! `tessera-dra`'s `tests/kubelet.rs`): a temporary folder, the simulated GPUs, the real arbiter
//! on `run/admin.sock` and `run/tenant/tessera.sock` logging to `arbiter.log`, and a slot for
//! the plugin process under test (its log is `plugin.log`). On drop the plugin and then the
//! arbiter are stopped, and after a panic (or with `TESSERA_TEST_LOGS` set) both logs are
//! printed, complete. The stand-in kubelets stay in each test: they speak different APIs.
//!
//! Every await of those tests is bounded: [`within`] and [`until`].

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use crate::arbiter::{ArbiterSpec, RunningArbiter};
use crate::artifacts::artifact;
use crate::process::KillOnDrop;
use crate::sim::SimGpu;

/// How the node starts; `Default` is two 80 GiB GPUs and the arbiter's usual flags.
#[derive(Debug, Clone, Default)]
pub struct NodeOptions<'a> {
    /// The simulated GPUs (`TESSERA_SIM_GPUS` syntax); empty: `2x80GiB`.
    pub gpus: &'a str,
    /// Folders created in the node's folder besides `run/tenant`.
    pub dirs: &'a [&'a str],
    /// The simulated context memory ([`SimGpu::context_memory`]), if not the simulator's.
    pub context_memory: Option<&'a str>,
    /// Extra arbiter flags.
    pub arbiter_args: &'a [&'a str],
    /// How long to wait for the arbiter's sockets, if not [`crate::arbiter::READY_TIMEOUT`].
    pub ready_timeout: Option<Duration>,
}

/// The node: its folder, GPUs, arbiter and plugin (see the module docs).
#[derive(Debug)]
pub struct PluginNode {
    /// The node's folder.
    pub dir: tempfile::TempDir,
    /// The simulated GPUs (apply them to the plugin's command).
    pub sim: SimGpu,
    /// How the arbiter was started (its sockets).
    pub spec: ArbiterSpec,
    /// The arbiter.
    pub arbiter: RunningArbiter,
    /// The plugin under test, once the test started it.
    pub plugin: Option<KillOnDrop>,
}

impl PluginNode {
    /// Starts the simulated GPUs and the arbiter and waits for its sockets (blocking: from an
    /// async test, call it in `tokio::task::block_in_place`).
    #[track_caller]
    pub fn start(opts: NodeOptions<'_>) -> PluginNode {
        let dir = tempfile::tempdir().unwrap();
        let gpus = if opts.gpus.is_empty() {
            "2x80GiB"
        } else {
            opts.gpus
        };
        let mut sim = SimGpu::prepare(&dir.path().join("sim"), gpus);
        if let Some(c) = opts.context_memory {
            sim.context_memory = c.to_owned();
        }
        for sub in ["run/tenant"].iter().chain(opts.dirs) {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        let mut spec = ArbiterSpec::in_dir(artifact("tessera-arbiter"), dir.path(), sim.clone())
            .log_to(dir.path().join("arbiter.log"));
        spec.socket = dir.path().join("run/tenant/tessera.sock");
        spec.admin_socket = dir.path().join("run/admin.sock");
        if let Some(t) = opts.ready_timeout {
            spec.ready_timeout = t;
        }
        let mut cmd = spec.command();
        cmd.args(opts.arbiter_args);
        let arbiter = spec.start_command(cmd);
        PluginNode {
            dir,
            sim,
            spec,
            arbiter,
            plugin: None,
        }
    }

    /// `p` in the node's folder.
    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }
}

impl Drop for PluginNode {
    fn drop(&mut self) {
        // Both are stopped before their logs are read, so the logs are complete.
        self.plugin.take();
        self.arbiter.kill();
        if std::thread::panicking() || std::env::var_os("TESSERA_TEST_LOGS").is_some() {
            for name in ["arbiter.log", "plugin.log"] {
                let log = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
                eprintln!("---- {name} ----\n{log}");
            }
        }
    }
}

/// Awaits `fut` for at most `secs`; panics naming `what` after that, so a failure never
/// hangs CI.
pub async fn within<T>(secs: u64, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {secs}s: {what}"),
    }
}

/// Polls `f` every 20 ms until it is `Some`, for at most `secs`.
pub async fn until<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    within(secs, what, async {
        loop {
            if let Some(v) = f() {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}
