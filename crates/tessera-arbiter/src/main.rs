//! `tessera-arbiter`: the per-node daemon (see the library for everything it does).
//!
//! Exit codes:
//! - 0: stopped by SIGTERM or SIGINT after removing its sockets and persisting its state;
//! - 1: any other error; 2: bad usage (from clap, or a bad `RUST_LOG`);
//! - 3: GPUs could not be discovered (NVML missing or failing);
//! - 4: a socket could not be created (or another arbiter is serving on it), or the metrics
//!   address could not be bound;
//! - 5: the state directory or state file is unusable (a corrupt file is left untouched);
//! - 6: another arbiter holds the state directory (one arbiter per `--state-dir`).

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tessera_arbiter::backstop;
use tessera_arbiter::config::Config;
use tessera_arbiter::gpus::{GpuDiscovery, GpusError, NvmlDiscovery};
use tessera_arbiter::scheduler::SchedulerParams;
use tessera_arbiter::server::{Server, ServerError};
use tessera_arbiter::state::StateError;
use tessera_arbiter::store::StoreError;
use tessera_protocol::GpuInfo;
use tokio::signal::unix::{SignalKind, signal};

/// Everything that ends the daemon with an error, each with its exit code.
#[derive(Debug, thiserror::Error)]
enum MainError {
    #[error(transparent)]
    Log(#[from] tessera_log::LogError),
    #[error("cannot discover GPUs: {0}")]
    Gpus(#[source] GpusError),
    #[error("cannot start the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("cannot start the backstop: {0}")]
    Backstop(#[source] GpusError),
    #[error("cannot start the backstop thread: {0}")]
    BackstopThread(#[source] std::io::Error),
}

impl MainError {
    /// The documented exit code (see the module docs).
    fn exit_code(&self) -> u8 {
        match self {
            MainError::Log(_) => 2,
            MainError::Gpus(_) => 3,
            MainError::Server(
                ServerError::Socket { .. }
                | ServerError::InUse(_)
                | ServerError::NotASocket(_)
                | ServerError::Metrics(_),
            ) => 4,
            MainError::Server(ServerError::State(StateError::Store(StoreError::Locked {
                ..
            }))) => 6,
            MainError::Server(ServerError::State(_)) => 5,
            MainError::Runtime(_)
            | MainError::Signals(_)
            | MainError::Backstop(_)
            | MainError::BackstopThread(_) => 1,
        }
    }
}

fn main() -> ExitCode {
    let config = Config::parse();
    match run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The subscriber may be missing (a bad RUST_LOG): say it on stderr as well.
            if matches!(e, MainError::Log(_)) {
                eprintln!("tessera-arbiter: {e}");
            } else {
                tracing::error!("{e}");
            }
            ExitCode::from(e.exit_code())
        }
    }
}

fn run(config: Config) -> Result<(), MainError> {
    tessera_log::init(config.log_format)?;
    let gpus = NvmlDiscovery {
        lib: Some(config.nvml_lib.clone().into()),
    }
    .discover()
    .map_err(MainError::Gpus)?;
    if gpus.is_empty() {
        tracing::warn!("NVML reports no GPU; every Create will be refused");
    }
    for g in &gpus {
        tracing::info!(
            "GPU {} {} {} ({})",
            g.index,
            g.uuid,
            g.name,
            tessera_protocol::size::human(g.memory_total)
        );
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(MainError::Runtime)?
        .block_on(serve(config, gpus))
}

async fn serve(config: Config, gpus: Vec<GpuInfo>) -> Result<(), MainError> {
    let mut term = signal(SignalKind::terminate()).map_err(MainError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(MainError::Signals)?;
    let server = Server::start(&config, gpus, SchedulerParams::default()).await?;
    if config.backstop_interval_ms > 0 {
        let policy = backstop::Policy {
            interval: Duration::from_millis(config.backstop_interval_ms),
            memory_tolerance: backstop::Tolerance {
                per_allocation: config.backstop_slack_mib.saturating_mul(1 << 20),
                per_process: config.backstop_tolerance_mib.saturating_mul(1 << 20),
            },
            enforce: config.enforce,
            unknown: config.unknown_processes,
            compute_threshold: Duration::from_millis(config.compute_bypass_ms),
            compute_slack: (config.compute_slack_percent / 100.0).clamp(0.0, 1.0),
        };
        let b = backstop::Backstop::new(
            Arc::clone(server.arbiter()),
            policy,
            Some(config.nvml_lib.as_os_str()),
            &config.host_mount_ns,
        )
        .map_err(MainError::Backstop)?;
        std::thread::Builder::new()
            .name("backstop".into())
            .spawn(move || b.run())
            .map_err(MainError::BackstopThread)?;
    }
    tracing::info!(
        "serving tenants on {} and admin on {} (state in {})",
        config.socket.display(),
        config.admin_socket.display(),
        config.state_dir.display()
    );
    let sig = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!("{sig}: shutting down");
    server.shutdown().await?;
    Ok(())
}
