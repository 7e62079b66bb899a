//! `tessera-arbiter`: the per-node daemon (see the library for everything it does).
//!
//! Exit codes:
//! - 0: stopped by SIGTERM or SIGINT after removing its sockets and persisting its state;
//! - 1: any other error; 2: bad usage (from clap);
//! - 3: GPUs could not be discovered (NVML missing or failing);
//! - 4: a socket could not be created (or another arbiter is serving on it);
//! - 5: the state directory or state file is unusable (a corrupt file is left untouched).

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use tessera_arbiter::backstop;
use tessera_arbiter::config::Config;
use tessera_arbiter::gpus::{GpuDiscovery, NvmlDiscovery};
use tessera_arbiter::scheduler::SchedulerParams;
use tessera_arbiter::server::{Server, ServerError};
use tokio::signal::unix::{SignalKind, signal};

fn main() -> ExitCode {
    let config = Config::parse();
    let gpus = match (NvmlDiscovery {
        lib: config.nvml_lib.clone().map(Into::into),
    })
    .discover()
    {
        Ok(g) => g,
        Err(e) => {
            eprintln!("tessera-arbiter: cannot discover GPUs: {e}");
            return ExitCode::from(3);
        }
    };
    if gpus.is_empty() {
        eprintln!("tessera-arbiter: NVML reports no GPU; every Create will be refused");
    }
    for g in &gpus {
        eprintln!(
            "tessera-arbiter: GPU {} {} {} ({} bytes)",
            g.index, g.uuid, g.name, g.memory_total
        );
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tessera-arbiter: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(config, gpus)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera-arbiter: {}", one_message(&e));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// The error and its causes on one line, each cause only once: most of our errors already
/// print their source (`"state file X: {source}"`), which `{:#}` would repeat.
fn one_message(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !msg.contains(&cause) {
            msg.push_str(": ");
            msg.push_str(&cause);
        }
    }
    msg
}

fn exit_code(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<ServerError>() {
        Some(ServerError::Socket { .. } | ServerError::InUse(_) | ServerError::NotASocket(_)) => 4,
        Some(ServerError::State(_)) => 5,
        None => 1,
    }
}

async fn run(config: Config, gpus: Vec<tessera_protocol::GpuInfo>) -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let server = Server::start(&config, gpus, SchedulerParams::default()).await?;
    if config.backstop_interval_ms > 0 {
        let policy = backstop::Policy {
            interval: std::time::Duration::from_millis(config.backstop_interval_ms),
            per_process_tolerance: config.backstop_tolerance_mib.saturating_mul(1 << 20),
            enforce: config.enforce,
            unknown: config.unknown_processes,
            compute_threshold: std::time::Duration::from_millis(config.compute_bypass_ms),
            compute_slack: (config.compute_slack_percent / 100.0).clamp(0.0, 1.0),
        };
        let b = backstop::Backstop::new(
            std::sync::Arc::clone(server.arbiter()),
            policy,
            config.nvml_lib.as_deref().map(std::path::Path::as_os_str),
            &config.host_mount_ns,
        )?;
        std::thread::Builder::new()
            .name("backstop".into())
            .spawn(move || b.run())?;
    }
    eprintln!(
        "tessera-arbiter: serving tenants on {} and admin on {} (state in {})",
        config.socket.display(),
        config.admin_socket.display(),
        config.state_dir.display()
    );
    let sig = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    eprintln!("tessera-arbiter: {sig}: shutting down");
    server.shutdown().await?;
    Ok(())
}
