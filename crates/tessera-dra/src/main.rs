//! `tessera-dra`: the DRA kubelet plugin for driver `gpu.tessera.dev`.
//!
//! Exit codes: 0 stopped by SIGTERM/SIGINT (the node's ResourceSlice is kept unless
//! `--remove-slices-on-exit`), or `--check-config` found the flags valid; 1 unexpected
//! failure; 2 bad flags; 3 the
//! interposer could not be found or installed; 5 the GPUs could not be read through NVML.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tessera_dra::{Config, Connection, PluginError};
use tessera_node::NodeArgs;
use tessera_node::cdi::CdiKind;

/// DRA kubelet plugin for gpu.tessera.dev: enforced GPU fractions.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// This node's name (the downward API's spec.nodeName).
    #[arg(long, value_name = "NAME", env = "NODE_NAME")]
    node_name: String,
    /// The kubelet's plugin registration folder.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    registry_dir: PathBuf,
    /// Folder of this plugin's socket.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/plugins/gpu.tessera.dev"
    )]
    plugin_dir: PathBuf,
    /// Folder of CDI specs the container runtime reads.
    #[arg(long, value_name = "DIR", default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// API server URL (`https://...` or `http://...`) instead of the pod's service account.
    #[arg(long, value_name = "URL", conflicts_with = "kubeconfig")]
    api_server: Option<String>,
    /// Bearer token file sent to `--api-server` (whitespace around the token trimmed, re-read
    /// every minute, as client-go does).
    #[arg(long, value_name = "PATH", requires = "api_server")]
    token_file: Option<PathBuf>,
    /// Kubeconfig file (its current context) instead of the pod's service account.
    #[arg(long, value_name = "PATH")]
    kubeconfig: Option<PathBuf>,
    /// The flags the device plugin takes too (arbiter sockets, host and container paths,
    /// NVML, log format).
    #[command(flatten)]
    node: NodeArgs,
    /// sysfs root (NUMA nodes of the GPUs).
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    sysfs: PathBuf,
    /// Memory limit, MiB, of a fraction whose claim names no memory (a multiple of 256).
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    default_memory_mib: u64,
    /// CDI kind of the node's NVIDIA spec (`nvidia-ctk cdi generate
    /// --device-name-strategy=uuid`).
    #[arg(long, value_name = "KIND", default_value = "nvidia.com/gpu")]
    nvidia_cdi_kind: CdiKind,
    /// Milliseconds between GPU health checks.
    #[arg(long, value_name = "MS", default_value_t = 500)]
    poll_ms: u64,
    /// Seconds between ResourceSlice re-checks.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    resync: f64,
    /// Seconds between checks of the prepared claims: a claim deleted, re-created or reserved
    /// by no pod is unprepared (also checked at start).
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    claim_check: f64,
    /// On SIGTERM/SIGINT also delete this node's ResourceSlice (an uninstall). Without it the
    /// slice is kept for the next start, and the kubelet deletes it 30 s after the plugin is
    /// gone for good.
    #[arg(long)]
    remove_slices_on_exit: bool,
    /// GPUs (NVML indices, comma-separated, or `all`) published as partitionable MIG devices:
    /// one device per MIG profile and placement, instances made at prepare. Needs Kubernetes
    /// with `DRAPartitionableDevices` (on by default from 1.36; 1.36.3 or later for the fix of
    /// kubernetes #139034).
    #[arg(long, value_name = "GPUS", value_delimiter = ',')]
    mig_dynamic: Vec<String>,
    /// GPUs (NVML indices, comma-separated, or `all`) whose existing MIG instances are
    /// published, each shareable, for clusters without partitionable devices.
    #[arg(long, value_name = "GPUS", value_delimiter = ',')]
    mig_static: Vec<String>,
    /// The plugin's state folder (the MIG instances' checkpoint); keep it across restarts.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/tessera/dra")]
    state_dir: PathBuf,
    /// Parse and validate the flags (as at start-up), print `config ok` and exit 0 (exit 2 with
    /// the reason otherwise); no API server, no socket, nothing installed.
    #[arg(long)]
    check_config: bool,
}

fn seconds(v: f64, flag: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(v)
        .map(|d| d.max(Duration::from_millis(100)))
        .map_err(|_| format!("{flag} must be a non-negative number"))
}

fn config(a: Args) -> Result<(Config, tessera_log::LogFormat, bool), String> {
    let check_config = a.check_config;
    let node = a.node;
    let resync = seconds(a.resync, "--resync")?;
    let claim_check = seconds(a.claim_check, "--claim-check")?;
    let api = match (a.api_server, a.kubeconfig) {
        (Some(url), _) => Connection::Url {
            url,
            token_file: a.token_file,
        },
        (None, Some(path)) => Connection::Kubeconfig(path),
        (None, None) => Connection::InCluster,
    };
    let default_memory = a
        .default_memory_mib
        .checked_mul(1 << 20)
        .ok_or("--default-memory-mib is too large")?;
    Ok((
        Config {
            node_name: a.node_name,
            registry_dir: a.registry_dir,
            plugin_dir: a.plugin_dir,
            cdi_dir: a.cdi_dir,
            api,
            admin_socket: node.admin_socket,
            tenant_socket: node.tenant_socket,
            container_socket_dir: node.container_socket_dir,
            host_lib_dir: node.host_lib_dir,
            interposer: node.interposer,
            container_lib_path: node.container_lib_path,
            host_identity_dir: node.host_identity_dir,
            nvml_lib: node.nvml_lib,
            sysfs: a.sysfs,
            default_memory,
            nvidia_kind: a.nvidia_cdi_kind.as_str().to_owned(),
            poll: Duration::from_millis(a.poll_ms.clamp(10, 10_000)),
            resync,
            claim_check,
            remove_slices_on_exit: a.remove_slices_on_exit,
            gpus: node.gpus,
            mig: tessera_dra::mig::MigConfig {
                dynamic: tessera_dra::mig::GpuSet::parse(&a.mig_dynamic)
                    .map_err(|e| format!("--mig-dynamic: {e}"))?,
                fixed: tessera_dra::mig::GpuSet::parse(&a.mig_static)
                    .map_err(|e| format!("--mig-static: {e}"))?,
            },
            state_dir: a.state_dir,
        },
        node.log_format,
        check_config,
    ))
}

/// `--check-config`: the validation `tessera_dra::run` starts with, and nothing else.
fn check_config(cfg: &Config) -> Result<(), String> {
    cfg.validate().map_err(|e| e.to_string())
}

fn exit_code(e: &PluginError) -> u8 {
    match e {
        PluginError::Config(_) | PluginError::Api(_) => 2,
        PluginError::Install(_) => 3,
        PluginError::Inventory(_) => 5,
        PluginError::Bind { .. } | PluginError::Serve(_) => 1,
    }
}

fn main() -> ExitCode {
    let (cfg, format) = match config(Args::parse()) {
        Ok((cfg, _, true)) => {
            return match check_config(&cfg) {
                Ok(()) => {
                    println!("config ok");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("tessera-dra: {e}");
                    ExitCode::from(2)
                }
            };
        }
        Ok((cfg, format, false)) => (cfg, format),
        Err(e) => {
            eprintln!("tessera-dra: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = tessera_log::init(format) {
        eprintln!("tessera-dra: {e}");
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    // Watched before `run` binds anything, so a SIGTERM during start-up is an orderly stop.
    let shutdown = {
        let _in = rt.enter();
        tessera_node::shutdown::watch()
    };
    let shutdown = match shutdown {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot watch SIGTERM and SIGINT: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(tessera_dra::run(cfg, shutdown)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::from(exit_code(&e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(args: &[&str]) -> Result<(), String> {
        let all = ["tessera-dra", "--node-name=node-a", "--check-config"]
            .into_iter()
            .chain(args.iter().copied());
        let (cfg, _, check) = config(Args::try_parse_from(all).map_err(|e| e.to_string())?)?;
        assert!(check);
        check_config(&cfg)
    }

    #[test]
    fn check_config_accepts_valid_flags_and_refuses_what_start_up_refuses() {
        check(&[]).unwrap();
        check(&[
            "--default-memory-mib=2048",
            "--nvidia-cdi-kind=example.com/gpu",
        ])
        .unwrap();
        // MIG on offered GPUs; a UUID in the list may be any GPU's (checked at start).
        check(&["--gpus=0,1", "--mig-dynamic=1", "--mig-static=0"]).unwrap();
        check(&["--gpus=GPU-1234", "--mig-dynamic=0"]).unwrap();
        for (args, why) in [
            (&["--default-memory-mib=1000"][..], "multiple of 256"),
            (&["--default-memory-mib=0"][..], "multiple of 256"),
            (&["--nvidia-cdi-kind=gpu"][..], "not a CDI kind"),
            (&["--resync=-3"][..], "--resync"),
            // MIG on a GPU `--gpus` leaves out (an index list tells before the GPUs are read).
            (
                &["--gpus=1,2", "--mig-dynamic=0"][..],
                "--mig-dynamic names GPU 0, which --gpus 1,2 does not offer",
            ),
            (
                &["--gpus=1", "--mig-static=1,3"][..],
                "--mig-static names GPU 3",
            ),
        ] {
            let e = check(args).unwrap_err();
            assert!(e.contains(why), "{args:?}: {e}");
        }
    }
}
