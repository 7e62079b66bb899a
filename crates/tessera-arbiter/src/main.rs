//! `tessera-arbiter`: the per-node daemon (see the library for everything it does).
//!
//! Exit codes:
//! - 0: stopped by SIGTERM or SIGINT after removing its sockets and persisting its state;
//!   with `--check-config`, the flags are valid (`config ok`; nothing was opened);
//! - 1: any other error; 2: bad usage (from clap, flags that do not go together, or a bad
//!   `RUST_LOG`);
//! - 3: GPUs could not be discovered (NVML missing or failing);
//! - 4: a socket could not be created (or another arbiter is serving on it), or the metrics
//!   address could not be bound;
//! - 5: the state directory or state file is unusable (a corrupt file is left untouched);
//! - 6: another arbiter holds the state directory (one arbiter per `--state-dir`).

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use tessera_arbiter::StateError;
use tessera_arbiter::StoreError;
use tessera_arbiter::{Config, ConfigError};
use tessera_arbiter::{GpuDiscovery, GpusError, NvmlDiscovery};
use tessera_arbiter::{Server, ServerError};
use tessera_protocol::GpuInfo;
use tokio::signal::unix::{SignalKind, signal};

/// Everything that ends the daemon with an error, each with its exit code.
#[derive(Debug, thiserror::Error)]
enum MainError {
    #[error(transparent)]
    Config(#[from] ConfigError),
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
}

impl MainError {
    /// The documented exit code (see the module docs).
    fn exit_code(&self) -> u8 {
        match self {
            MainError::Config(_) | MainError::Log(_) => 2,
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
            | MainError::Server(ServerError::Backstop(_) | ServerError::BackstopThread(_)) => 1,
        }
    }
}

fn main() -> ExitCode {
    let config = Config::parse();
    match run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The subscriber may be missing (bad flags, a bad RUST_LOG): say it on stderr.
            if matches!(e, MainError::Config(_) | MainError::Log(_)) {
                eprintln!("tessera-arbiter: {e}");
            } else {
                tracing::error!("{e}");
            }
            ExitCode::from(e.exit_code())
        }
    }
}

fn run(config: Config) -> Result<(), MainError> {
    config.validate()?;
    if config.check_config {
        // Before the subscriber: a check prints one line and touches nothing.
        println!("config ok");
        return Ok(());
    }
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
    let server = Server::start(&config, gpus, config.scheduler_params()).await?;
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
