//! `tessera-device-plugin`: the kubelet device plugin for Tessera GPU shares.
//!
//! Exit codes: 0 stopped by SIGTERM/SIGINT (or `--install-only` done, or `--check-config`
//! found the flags valid); 1 unexpected failure; 2 bad flags (or a bad `RUST_LOG`); 3 the interposer could not be found or installed; 4 the
//! kubelet refused the registration; 5 no way to list the GPUs (`--gpu-source nvml` and NVML
//! failed).

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use tessera_device_plugin::{Config, PluginError, SourceKind};
use tessera_node::NodeArgs;
use tessera_node::cdi::CdiKind;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Source {
    Auto,
    Nvml,
    Arbiter,
}

/// Kubernetes device plugin advertising Tessera GPU shares.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The kubelet's device-plugins folder (kubelet.sock and our socket).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    kubelet_dir: PathBuf,
    /// Our socket's file name in the kubelet folder.
    #[arg(long, value_name = "NAME", default_value = "tessera.sock")]
    endpoint: String,
    /// The kubelet's PodResources socket (pod names for allocations, stale clean-up).
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/var/lib/kubelet/pod-resources/kubelet.sock"
    )]
    pod_resources_socket: PathBuf,
    /// Turn stale allocation clean-up off (pods are still named).
    #[arg(long)]
    no_stale_cleanup: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (IP:PORT, port 0 picks one; `none`: off).
    #[arg(long, value_name = "ADDR|none", default_value = tessera_device_plugin::DEFAULT_METRICS_ADDR)]
    metrics_addr: String,
    /// The flags the DRA driver takes too (arbiter sockets, host and container paths, NVML,
    /// log format).
    #[command(flatten)]
    node: NodeArgs,
    /// Units each GPU is advertised as.
    #[arg(long, value_name = "N", default_value_t = 100)]
    shares_per_gpu: u32,
    /// Extended resource name.
    #[arg(long, value_name = "NAME", default_value = "tessera.dev/gpu-shares")]
    resource_name: String,
    /// Units of each GPU set apart for the latency resource (latency-tier allocations); the
    /// best-effort resource keeps the rest. 0: no latency resource.
    #[arg(long, value_name = "N", default_value_t = 0)]
    latency_shares: u32,
    /// The latency resource's name.
    #[arg(
        long,
        value_name = "NAME",
        default_value = "tessera.dev/gpu-latency-shares"
    )]
    latency_resource_name: String,
    /// The latency resource's socket file name in the kubelet folder.
    #[arg(long, value_name = "NAME", default_value = "tessera-latency.sock")]
    latency_endpoint: String,
    /// Also name each GPU of a container as the CDI device KIND=<GPU UUID> (e.g.
    /// `nvidia.com/gpu`: the node's NVIDIA CDI spec, `nvidia-ctk cdi generate
    /// --device-name-strategy=uuid`), for runtimes with CDI and without NVIDIA's runtime
    /// (containerd 2 with runc). Off: only NVIDIA_VISIBLE_DEVICES.
    #[arg(long, value_name = "KIND")]
    nvidia_cdi_kind: Option<CdiKind>,
    /// Where the GPU list and health come from (auto: NVML, else the arbiter).
    #[arg(
        long,
        value_name = "auto|nvml|arbiter",
        value_enum,
        default_value = "auto"
    )]
    gpu_source: Source,
    /// Seconds an allocation no container holds is kept before deletion.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    stale_grace: f64,
    /// Seconds between stale allocation checks.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    stale_interval: f64,
    /// Milliseconds between socket and GPU checks.
    #[arg(long, value_name = "MS", default_value_t = 500)]
    poll_ms: u64,
    /// Install the interposer into --host-lib-dir and exit (for an init container).
    #[arg(long)]
    install_only: bool,
    /// Parse and validate the flags (as at start-up), print `config ok` and exit 0 (exit 2 with
    /// the reason otherwise); no socket, no kubelet, nothing installed.
    #[arg(long)]
    check_config: bool,
}

fn secs(name: &str, v: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(v).map_err(|_| format!("--{name} must be a non-negative number"))
}

/// What `run` is asked to do besides serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Serve,
    InstallOnly,
    CheckConfig,
}

fn config(a: Args) -> Result<(Config, Mode, tessera_log::LogFormat), String> {
    let node = a.node;
    let log_format = node.log_format;
    let mode = if a.check_config {
        Mode::CheckConfig
    } else if a.install_only {
        Mode::InstallOnly
    } else {
        Mode::Serve
    };
    let cfg = Config {
        kubelet_dir: a.kubelet_dir,
        endpoint: a.endpoint,
        pod_resources_socket: Some(a.pod_resources_socket),
        stale_cleanup: !a.no_stale_cleanup,
        metrics_addr: tessera_device_plugin::parse_metrics_addr(&a.metrics_addr)
            .map_err(|e| e.to_string())?,
        admin_socket: node.admin_socket,
        tenant_socket: node.tenant_socket,
        container_socket_dir: node.container_socket_dir,
        host_lib_dir: node.host_lib_dir,
        interposer: node.interposer,
        container_lib_path: node.container_lib_path,
        host_identity_dir: node.host_identity_dir,
        shares_per_gpu: a.shares_per_gpu,
        resource_name: a.resource_name,
        latency_shares: a.latency_shares,
        latency_resource_name: a.latency_resource_name,
        latency_endpoint: a.latency_endpoint,
        nvidia_cdi_kind: a.nvidia_cdi_kind,
        gpu_source: match a.gpu_source {
            Source::Auto => SourceKind::Auto,
            Source::Nvml => SourceKind::Nvml,
            Source::Arbiter => SourceKind::Arbiter,
        },
        nvml_lib: node.nvml_lib,
        gpus: node.gpus,
        stale_grace: secs("stale-grace", a.stale_grace)?,
        stale_interval: secs("stale-interval", a.stale_interval)?.max(Duration::from_millis(50)),
        poll: Duration::from_millis(a.poll_ms.clamp(10, 10_000)),
    };
    Ok((cfg, mode, log_format))
}

/// Everything that ends the plugin with an error, each with its exit code.
#[derive(Debug, thiserror::Error)]
enum MainError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Log(#[from] tessera_log::LogError),
    #[error("cannot start the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("cannot watch SIGTERM and SIGINT: {0}")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Plugin(#[from] PluginError),
}

impl MainError {
    /// The documented exit code (see the module docs).
    fn exit_code(&self) -> u8 {
        match self {
            MainError::Usage(_) | MainError::Log(_) => 2,
            MainError::Runtime(_) | MainError::Signals(_) => 1,
            MainError::Plugin(e) => match e {
                PluginError::Config(_) => 2,
                PluginError::Install(_) => 3,
                PluginError::Registration(_) => 4,
                PluginError::Gpus(_) => 5,
                PluginError::Bind { .. } | PluginError::Metrics(_) => 1,
            },
        }
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Before the subscriber is up (bad flags, bad RUST_LOG) only stderr can say it.
            if matches!(e, MainError::Usage(_) | MainError::Log(_)) {
                eprintln!("tessera-device-plugin: {e}");
            } else {
                tracing::error!("{e}");
            }
            ExitCode::from(e.exit_code())
        }
    }
}

fn run(args: Args) -> Result<(), MainError> {
    let (cfg, mode, log_format) = config(args).map_err(MainError::Usage)?;
    if mode == Mode::CheckConfig {
        // The same checks `run` makes before it opens anything; a refusal is exit 2.
        cfg.validate()
            .map_err(|e| MainError::Usage(e.to_string()))?;
        println!("config ok");
        return Ok(());
    }
    tessera_log::init(log_format)?;
    if mode == Mode::InstallOnly {
        cfg.validate()?;
        tessera_device_plugin::install_interposer(&cfg)?;
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(MainError::Runtime)?;
    // Watched before `run` binds anything, so a SIGTERM during start-up is an orderly stop.
    let shutdown = {
        let _in = rt.enter();
        tessera_node::shutdown::watch().map_err(MainError::Signals)?
    };
    rt.block_on(tessera_device_plugin::run(cfg, shutdown))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(args: &[&str]) -> Result<(), MainError> {
        let all = ["tessera-device-plugin", "--check-config"]
            .into_iter()
            .chain(args.iter().copied());
        run(Args::try_parse_from(all).unwrap())
    }

    #[test]
    fn check_config_accepts_valid_flags_and_refuses_what_start_up_refuses() {
        check(&[]).unwrap();
        check(&["--shares-per-gpu=1000", "--latency-shares=300"]).unwrap();
        for (args, why) in [
            (
                &["--shares-per-gpu=5000"][..],
                "--shares-per-gpu must be 1..=1000",
            ),
            (&["--latency-shares=100"][..], "--latency-shares 100"),
            (&["--metrics-addr=nowhere"][..], "nowhere"),
            (&["--stale-grace=-1"][..], "--stale-grace"),
        ] {
            let e = check(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{args:?}: {e}");
            assert!(e.to_string().contains(why), "{args:?}: {e}");
        }
    }
}
