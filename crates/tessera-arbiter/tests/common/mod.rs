//! Starts the real `tessera-arbiter` binary in a temp folder with the simulated NVML.

#![allow(dead_code)]

use std::fs;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tessera_protocol::client::{AdminClient, TenantClient};

/// GPUs the simulated NVML reports in these tests.
pub const SIM_GPUS: &str = "2x80GiB";
pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

/// `<target>/debug`, where cargo put the binaries and cdylibs.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// The folder to put on `LD_LIBRARY_PATH` so `libnvidia-ml.so.1` is the simulated one.
pub fn sim_lib_dir(sim_dir: &Path) -> PathBuf {
    let built = tessera_sim_state::find_built_lib_dir(Some(&target_dir())).unwrap_or_else(|e| {
        panic!("{e}: run `cargo build --workspace` (the simulated NVML is needed) first")
    });
    tessera_sim_state::prepare_lib_dir(sim_dir, &built).unwrap()
}

/// A running arbiter in its own temp folder.
pub struct Arbiter {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub admin_socket: PathBuf,
    pub state_dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
}

pub fn arbiter_command(dir: &Path) -> Command {
    let sim_dir = dir.join("sim");
    let lib = sim_lib_dir(&sim_dir);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera-arbiter"));
    cmd.arg("--socket")
        .arg(dir.join("tessera.sock"))
        .arg("--admin-socket")
        .arg(dir.join("admin.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("LD_LIBRARY_PATH", lib)
        .env("TESSERA_SIM_DIR", &sim_dir)
        .env("TESSERA_SIM_GPUS", SIM_GPUS)
        .env_remove("TESSERA_SOCKET")
        .env_remove("TESSERA_ADMIN_SOCKET")
        .stdin(Stdio::null());
    cmd
}

impl Arbiter {
    pub fn start() -> Self {
        Self::start_in(tempfile::tempdir().unwrap())
    }

    /// Starts (or restarts) an arbiter whose files live in `dir`.
    pub fn start_in(dir: tempfile::TempDir) -> Self {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        let log = dir.path().join(format!("arbiter-{}.log", stamp.as_nanos()));
        let logf = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = arbiter_command(dir.path())
            .stdout(logf.try_clone().unwrap())
            .stderr(logf)
            .spawn()
            .unwrap();
        let mut a = Self {
            socket: dir.path().join("tessera.sock"),
            admin_socket: dir.path().join("admin.sock"),
            state_dir: dir.path().join("state"),
            dir,
            child: Some(child),
            log,
        };
        a.wait_ready();
        a
    }

    fn wait_ready(&mut self) {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20) {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("arbiter exited early with {status}: {}", self.log_text());
            }
            if AdminClient::connect(&self.admin_socket).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("arbiter did not come up: {}", self.log_text());
    }

    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    pub fn admin(&self) -> AdminClient {
        AdminClient::connect(&self.admin_socket).unwrap()
    }

    pub fn tenant(&self, token: &str) -> TenantClient {
        TenantClient::connect(&self.socket, token).unwrap()
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill has no memory preconditions; the pid is our own child, not yet reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return s;
            }
            if start.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                panic!("arbiter ignored SIGTERM: {}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops the arbiter and hands back its folder for a restart.
    pub fn stop_keep_dir(mut self) -> (ExitStatus, tempfile::TempDir) {
        let status = self.stop();
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        (status, dir)
    }
}

impl Drop for Arbiter {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Exit code of a status, or 128 + signal.
pub fn code(s: ExitStatus) -> i32 {
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}

/// Polls `f` until it returns true or `timeout` passes; returns the time it took.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    None
}
