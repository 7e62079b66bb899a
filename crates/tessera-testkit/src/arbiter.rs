//! The real `tessera-arbiter` on a simulated GPU, in a test's temp folder.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tessera_protocol::client::{AdminClient, TenantClient};
use tessera_protocol::{CreateAllocation, GpuSelector};

use crate::process::{KillOnDrop, wait_exit};
use crate::sim::SimGpu;
use tessera_protocol::node::{ENV_ADMIN_SOCKET, ENV_METRICS_ADDR, ENV_SOCKET};

/// How long an arbiter may take to serve before the test fails (a loaded CI machine is slow).
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How to start one arbiter: its binary, sockets, state folder, simulated GPU and log.
#[derive(Debug, Clone)]
pub struct ArbiterSpec {
    pub binary: PathBuf,
    pub socket: PathBuf,
    pub admin_socket: PathBuf,
    pub state_dir: PathBuf,
    pub sim: SimGpu,
    /// The file that gets the arbiter's stdout and stderr (appended); `None` discards them.
    pub log: Option<PathBuf>,
    /// How long [`ArbiterSpec::start`] waits for the sockets.
    pub ready_timeout: Duration,
}

impl ArbiterSpec {
    /// The usual layout: `<dir>/tessera.sock`, `<dir>/admin.sock`, `<dir>/state`; no log.
    pub fn in_dir(binary: impl Into<PathBuf>, dir: &Path, sim: SimGpu) -> Self {
        Self {
            binary: binary.into(),
            socket: dir.join("tessera.sock"),
            admin_socket: dir.join("admin.sock"),
            state_dir: dir.join("state"),
            sim,
            log: None,
            ready_timeout: READY_TIMEOUT,
        }
    }

    /// Sends stdout and stderr to `path`.
    pub fn log_to(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = Some(path.into());
        self
    }

    /// The arbiter's command line and environment, without its output redirected (so
    /// `.output()` captures it): the caller's own Tessera variables and preloads removed.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--tenant-socket")
            .arg(&self.socket)
            .arg("--admin-socket")
            .arg(&self.admin_socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .env_remove(ENV_SOCKET)
            .env_remove(ENV_ADMIN_SOCKET)
            // Tests run side by side: none binds the default metrics port (a test that wants
            // the endpoint passes `--metrics-addr`, which wins over the variable).
            .env(ENV_METRICS_ADDR, "none")
            .env_remove("LD_PRELOAD")
            .stdin(Stdio::null());
        self.sim.apply(&mut cmd);
        cmd
    }

    /// Starts [`ArbiterSpec::command`] and waits until it serves.
    #[track_caller]
    pub fn start(&self) -> RunningArbiter {
        self.start_command(self.command())
    }

    /// Starts `cmd` (built from [`ArbiterSpec::command`], e.g. with a `pre_exec` added), its
    /// output sent to the log, and waits until both sockets serve. Panics with the log when the
    /// arbiter exits early or does not come up in time.
    #[track_caller]
    pub fn start_command(&self, mut cmd: Command) -> RunningArbiter {
        match &self.log {
            Some(path) => {
                let log = fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
                let out = log.try_clone().unwrap();
                cmd.stdout(out).stderr(log);
            }
            None => {
                cmd.stdout(Stdio::null()).stderr(Stdio::null());
            }
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.binary.display()));
        let mut arbiter = RunningArbiter {
            socket: self.socket.clone(),
            admin_socket: self.admin_socket.clone(),
            child: KillOnDrop::new(child),
            log: self.log.clone(),
        };
        arbiter.wait_ready(self.ready_timeout);
        arbiter
    }
}

/// A started arbiter, killed when dropped.
#[derive(Debug)]
pub struct RunningArbiter {
    pub socket: PathBuf,
    pub admin_socket: PathBuf,
    child: KillOnDrop,
    log: Option<PathBuf>,
}

impl RunningArbiter {
    #[track_caller]
    fn wait_ready(&mut self, timeout: Duration) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("arbiter exited early with {status}: {}", self.log_text());
            }
            if AdminClient::connect(&self.admin_socket).is_ok() && self.socket.exists() {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "arbiter did not come up within {timeout:?}: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Whether it has not been stopped or killed through this handle.
    pub fn is_running(&self) -> bool {
        self.child.is_held()
    }

    /// A new admin connection.
    pub fn admin(&self) -> AdminClient {
        AdminClient::connect(&self.admin_socket).unwrap()
    }

    /// A new tenant connection with `token`.
    pub fn tenant(&self, token: &str) -> TenantClient {
        TenantClient::connect(&self.socket, token).unwrap()
    }

    /// What it wrote to its log so far (empty without one).
    pub fn log_text(&self) -> String {
        self.log.as_deref().map(read_log).unwrap_or_default()
    }

    /// The address its metrics endpoint listens on, read from its log (started with
    /// `--metrics-addr 127.0.0.1:0`, it says which port it got); panics after `timeout`.
    #[track_caller]
    pub fn metrics_addr(&self, timeout: Duration) -> std::net::SocketAddr {
        let mut addr = None;
        crate::wait_until(timeout, || {
            addr = self.log_text().lines().find_map(|l| {
                l.split("metrics on http://")
                    .nth(1)?
                    .split('/')
                    .next()?
                    .parse()
                    .ok()
            });
            addr.is_some()
        });
        addr.unwrap_or_else(|| panic!("no metrics address in the log: {}", self.log_text()))
    }

    /// NVML polls its backstop has done so far (`tessera_arbiter_backstop_polls_total`, served
    /// at `metrics`).
    #[track_caller]
    pub fn backstop_polls(&self, metrics: std::net::SocketAddr) -> u64 {
        let (status, body) = crate::http::get(metrics, "/metrics");
        assert_eq!(status, 200, "{body}");
        crate::http::sample(&body, "tessera_arbiter_backstop_polls_total")
            .unwrap_or_else(|| panic!("no backstop poll count (backstop off?):\n{body}"))
            as u64
    }

    /// Waits until its backstop has polled `more` times after this call (a positive signal
    /// that it looked, before a test says it left something alone); panics with the log after
    /// `timeout`.
    #[track_caller]
    pub fn wait_backstop_polls(&self, metrics: std::net::SocketAddr, more: u64, timeout: Duration) {
        let from = self.backstop_polls(metrics);
        let done = crate::wait_until(timeout, || self.backstop_polls(metrics) >= from + more);
        assert!(
            done.is_some(),
            "the backstop did not poll {more} times within {timeout:?}: {}",
            self.log_text()
        );
    }

    /// SIGTERMs it and waits up to `timeout` for the exit; panics with the log (after a
    /// SIGKILL) when it ignores the signal.
    #[track_caller]
    pub fn stop(&mut self, timeout: Duration) -> ExitStatus {
        // SAFETY: kill has no memory preconditions; the pid is our own child, not yet reaped
        // (the handle still holds it).
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        match wait_exit(&mut self.child, timeout) {
            Some(status) => {
                self.child.take();
                status
            }
            None => {
                self.child.kill_and_reap();
                panic!("arbiter ignored SIGTERM: {}", self.log_text());
            }
        }
    }

    /// SIGKILLs it (no clean-up on its side) and reaps it.
    pub fn kill(&mut self) {
        self.child.kill_and_reap();
    }
}

/// A log file's text, empty when it cannot be read (the log only adds context to a failure).
pub fn read_log(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_default()
}

/// An allocation request on GPU `gpu` with no labels.
pub fn allocation(gpu: u32, memory_limit: u64, share: u32, cap: Option<u32>) -> CreateAllocation {
    CreateAllocation {
        gpu: GpuSelector::Index(gpu),
        memory_limit,
        share,
        cap,
        labels: Default::default(),
    }
}

/// What a process held, in bytes (to the log's two decimals), by the backstop's line about it
/// in `log`: the first line naming `backstop: pid` and `needle` (an allocation id, a pid), with
/// `it held 25.29 GiB` in it. `None` when there is no such line or no figure in it.
pub fn backstop_held_bytes(log: &str, needle: &str) -> Option<f64> {
    let line = log
        .lines()
        .find(|l| l.contains("backstop: pid") && l.contains(needle))?;
    let mut figure = line.split("it held ").nth(1)?.split_whitespace();
    let value: f64 = figure.next()?.parse().ok()?;
    let unit = match figure.next()?.trim_end_matches(',') {
        "B" => 1u64,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        _ => return None,
    };
    Some(value * unit as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_held_figure_is_read_from_the_backstops_line_with_its_unit() {
        let log = "x INFO other line\n\
            y WARN tessera_arbiter::backstop: backstop: pid 7 of allocation 1ac8 killed: it held \
            25.29 GiB, its allocation's processes 25.29 GiB, allowed 24.06 GiB\n\
            z WARN tessera_arbiter::backstop: backstop: pid 9 of allocation 2bd9 killed: it held \
            512 MiB, its allocation's processes 1 GiB\n";
        assert_eq!(
            backstop_held_bytes(log, "1ac8"),
            Some(25.29 * (1u64 << 30) as f64)
        );
        assert_eq!(
            backstop_held_bytes(log, "pid 9 "),
            Some(512.0 * (1u64 << 20) as f64)
        );
        assert_eq!(backstop_held_bytes(log, "3ce0"), None);
        assert_eq!(
            backstop_held_bytes("backstop: pid 1 it held lots", "pid 1"),
            None
        );
    }
}
