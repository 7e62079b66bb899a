//! Starts the real `tessera-arbiter` binary in a temp folder with the simulated NVML (through
//! `tessera-testkit`), one log file per start.

#![allow(dead_code, unused_imports)]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use tessera_protocol::client::{AdminClient, TenantClient};
use tessera_testkit::{ArbiterSpec, RunningArbiter, SimGpu};

pub(crate) use tessera_testkit::{GIB, MIB, code, wait_until};

/// GPUs the simulated NVML reports in these tests.
pub(crate) const SIM_GPUS: &str = "2x80GiB";

/// The arbiter of `dir`: sockets and state in it, its simulated GPU in `<dir>/sim`.
pub(crate) fn spec(dir: &Path) -> ArbiterSpec {
    let sim = SimGpu::prepare(&dir.join("sim"), SIM_GPUS);
    ArbiterSpec::in_dir(env!("CARGO_BIN_EXE_tessera-arbiter"), dir, sim)
}

/// The arbiter's command for `dir`, for runs expected to fail (output not redirected).
pub(crate) fn arbiter_command(dir: &Path) -> Command {
    spec(dir).command()
}

/// A running arbiter in its own temp folder.
pub(crate) struct Arbiter {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub admin_socket: PathBuf,
    pub state_dir: PathBuf,
    process: RunningArbiter,
}

impl Arbiter {
    pub(crate) fn start() -> Self {
        Self::start_in(tempfile::tempdir().unwrap())
    }

    /// Starts an arbiter with extra command-line flags.
    pub(crate) fn start_with_args(args: &[&str]) -> Self {
        Self::start_in_with_args(tempfile::tempdir().unwrap(), args)
    }

    /// Starts (or restarts) an arbiter whose files live in `dir`.
    pub(crate) fn start_in(dir: tempfile::TempDir) -> Self {
        Self::start_in_with_args(dir, &[])
    }

    /// Starts an arbiter whose files live in `dir`, with extra flags.
    pub(crate) fn start_in_with_args(dir: tempfile::TempDir, args: &[&str]) -> Self {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        let spec =
            spec(dir.path()).log_to(dir.path().join(format!("arbiter-{}.log", stamp.as_nanos())));
        let mut cmd = spec.command();
        cmd.args(args);
        let process = spec.start_command(cmd);
        Self {
            socket: spec.socket,
            admin_socket: spec.admin_socket,
            state_dir: spec.state_dir,
            dir,
            process,
        }
    }

    pub(crate) fn log_text(&self) -> String {
        self.process.log_text()
    }

    pub(crate) fn pid(&self) -> i32 {
        self.process.pid()
    }

    pub(crate) fn admin(&self) -> AdminClient {
        self.process.admin()
    }

    pub(crate) fn tenant(&self, token: &str) -> TenantClient {
        self.process.tenant(token)
    }

    /// Sends SIGTERM and waits for the exit.
    pub(crate) fn stop(&mut self) -> ExitStatus {
        self.process.stop(Duration::from_secs(10))
    }

    /// Stops the arbiter and hands back its folder for a restart.
    pub(crate) fn stop_keep_dir(mut self) -> (ExitStatus, tempfile::TempDir) {
        let status = self.stop();
        (status, self.dir)
    }
}
