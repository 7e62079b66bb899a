//! Benchmarks of Tessera's overheads and compute sharing (criterion benches in `benches/`,
//! benchmark programs in `src/bin/`). The library holds what both kinds share:
//! - [`exit_with_parent`]: a started arbiter goes when the benchmark does.
//! - [`tenant_field`]: a counter from the JSON line a `mem_tenant` prints.
//! - [`number_flag`]: the one optional `--FLAG N` of a benchmark program.
//! - [`Tenant`]: a `compute_tenant` started (bare or under `tessera run`), its pid and output.
//! - [`SimNode`]: a simulated GPU and the real `tessera-arbiter` serving it, in a temp folder,
//!   with the benchmark programs' artifacts found next to the running executable.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_protocol::client::AdminClient;
use tessera_protocol::node::{ENV_ADMIN_SOCKET, ENV_METRICS_ADDR, ENV_SOCKET};
use tessera_sim_state::{ENV_CONTEXT_MEMORY, ENV_DIR, ENV_GPUS, MODELED_CONTEXT_MEMORY};

/// Where the built artifacts are: the folder of this executable.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().expect("exe folder").to_path_buf()
}

/// The built artifact `name` next to this executable; exits 2 with a hint when it is missing
/// (`who` names the program in the message).
pub fn need(who: &str, name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    if !p.is_file() {
        eprintln!(
            "{who}: {} is missing; build the workspace first (`cargo build --release --workspace`)",
            p.display()
        );
        std::process::exit(2);
    }
    p
}

/// The value of `"key":N` in the JSON line a `mem_tenant` prints at its end (None when the line
/// has no such counter).
pub fn tenant_field(line: &str, key: &str) -> Option<u64> {
    let pat = format!("\"{key}\":");
    line.split(&pat)
        .nth(1)?
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Parses the program's arguments when its only flag is `--FLAG N` (N a positive number);
/// returns N, or `default` without the flag. Anything else: usage on stderr, exit 2.
pub fn number_flag(who: &str, flag: &str, default: f64) -> f64 {
    let mut value = default;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match (a == flag, it.next().and_then(|v| v.parse::<f64>().ok())) {
            (true, Some(v)) if v > 0.0 => value = v,
            _ => {
                eprintln!("usage: {who} [{flag} N]");
                std::process::exit(2);
            }
        }
    }
    value
}

/// A simulated node: GPUs in a temp folder and a running `tessera-arbiter` serving them. The
/// arbiter is killed when this is dropped, and when the benchmark dies.
pub struct SimNode {
    /// The temp folder everything lives in.
    pub dir: tempfile::TempDir,
    /// The simulated GPUs' shared state.
    pub sim_dir: PathBuf,
    /// Where the simulated `libcuda.so.1` and `libnvidia-ml.so.1` are.
    pub lib_dir: PathBuf,
    /// The arbiter's tenant socket.
    pub socket: PathBuf,
    /// The arbiter's admin socket.
    pub admin_socket: PathBuf,
    /// `TESSERA_SIM_GPUS` of the node.
    pub gpus: String,
    arbiter: Child,
}

impl SimNode {
    /// Prepares GPUs `gpus` (e.g. `1x80GiB`) and starts the arbiter; exits the program with a
    /// message naming `who` if that fails.
    pub fn start(who: &str, gpus: &str) -> Self {
        Self::start_with(who, gpus, &[])
    }

    /// As [`SimNode::start`], with extra arguments for the arbiter.
    pub fn start_with(who: &str, gpus: &str, args: &[&str]) -> Self {
        Self::start_prepared(who, gpus, args, |_| {})
    }

    /// As [`SimNode::start_with`], with `prepare` run on the simulated GPUs' state folder
    /// before the arbiter starts (e.g. a MIG layout, which the arbiter reads at start).
    pub fn start_prepared(
        who: &str,
        gpus: &str,
        args: &[&str],
        prepare: impl FnOnce(&Path),
    ) -> Self {
        let arbiter_bin = need(who, "tessera-arbiter");
        let dir = tempfile::tempdir().expect("tempdir");
        let sim_dir = dir.path().join("sim");
        std::fs::create_dir_all(&sim_dir).expect("sim dir");
        prepare(&sim_dir);
        let built = tessera_sim_state::find_built_lib_dir(Some(&bin_dir())).unwrap_or_else(|e| {
            eprintln!("{who}: {e}");
            std::process::exit(2);
        });
        let lib_dir = tessera_sim_state::prepare_lib_dir(&sim_dir, &built).expect("lib dir");
        let socket = dir.path().join("tessera.sock");
        let admin_socket = dir.path().join("admin.sock");
        let mut arbiter = Command::new(arbiter_bin);
        // `process::exit` in a benchmark skips the `Drop` that kills it.
        exit_with_parent(&mut arbiter);
        let arbiter = arbiter
            .arg("--tenant-socket")
            .arg(&socket)
            .arg("--admin-socket")
            .arg(&admin_socket)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(args)
            .env("LD_LIBRARY_PATH", &lib_dir)
            .env(ENV_DIR, &sim_dir)
            .env(ENV_GPUS, gpus)
            .env(ENV_CONTEXT_MEMORY, MODELED_CONTEXT_MEMORY)
            // No metrics port unless `args` asks for one (benchmarks may run side by side).
            .env(ENV_METRICS_ADDR, "none")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tessera-arbiter");
        let started = Instant::now();
        while AdminClient::connect(&admin_socket).is_err() {
            if started.elapsed() > Duration::from_secs(20) {
                eprintln!("{who}: the arbiter did not come up");
                std::process::exit(1);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Self {
            dir,
            sim_dir,
            lib_dir,
            socket,
            admin_socket,
            gpus: gpus.to_owned(),
            arbiter,
        }
    }

    /// `program` with the node's simulated GPUs and sockets in its environment (and no
    /// inherited `LD_PRELOAD`): what `tessera run` and a bare client both need.
    pub fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("LD_LIBRARY_PATH", &self.lib_dir)
            .env(ENV_DIR, &self.sim_dir)
            .env(ENV_GPUS, &self.gpus)
            // Contexts cost memory as on a real card (a caller's `.env` overrides it).
            .env(ENV_CONTEXT_MEMORY, MODELED_CONTEXT_MEMORY)
            .env(ENV_ADMIN_SOCKET, &self.admin_socket)
            .env(ENV_SOCKET, &self.socket)
            .env_remove("LD_PRELOAD");
        cmd
    }

    /// The arbiter's pid.
    pub fn arbiter_pid(&self) -> u32 {
        self.arbiter.id()
    }

    /// SIGKILLs every process that uses the node's simulated GPUs (what `tessera run` started
    /// lives on in its shells' children when the shells are killed).
    pub fn kill_gpu_processes(&self) {
        if let Ok(list) = tessera_sim_state::read_processes(&self.sim_dir) {
            for p in list {
                // SAFETY: kill(2) on a pid the simulator lists as using its GPU (a benchmark's
                // tenant).
                unsafe { libc::kill(p.pid as i32, libc::SIGKILL) };
            }
        }
    }

    /// An admin connection to the arbiter.
    pub fn admin(&self) -> AdminClient {
        AdminClient::connect(&self.admin_socket).expect("admin socket")
    }
}

impl Drop for SimNode {
    fn drop(&mut self) {
        let _ = self.arbiter.kill();
        let _ = self.arbiter.wait();
    }
}

/// Makes the child started by `cmd` receive SIGTERM when this process dies, however it ends:
/// an aborted run (`process::exit`, a signal) would otherwise leave the arbiter it started
/// running, holding every inherited descriptor (a `flock` on a benchmark lock included).
pub fn exit_with_parent(cmd: &mut Command) {
    // SAFETY: pre_exec runs in the forked child before exec; prctl is async-signal-safe. The
    // signal is tied to the thread that forks, so callers start children from their main thread.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGTERM as libc::c_ulong,
                0,
                0,
                0,
            );
            Ok(())
        });
    }
}

/// A running `compute_tenant`: its real pid (the tenant process, not `tessera run`) and the
/// lines it printed after its `pid` line.
pub struct Tenant {
    child: Child,
    /// The tenant process's pid (what the simulated engine counts its busy time under).
    pub pid: u32,
    lines: std::sync::Arc<parking_lot::Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Tenant {
    /// Starts `cmd` (stdout piped, stdin closed) and reads the `pid N` line it prints first.
    pub fn spawn(mut cmd: Command) -> Self {
        use std::io::{BufRead, BufReader};
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("start a tenant");
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut first = String::new();
        out.read_line(&mut first).expect("tenant output");
        let pid = first
            .trim()
            .strip_prefix("pid ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("tenant did not start: {first:?}"));
        let lines = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let sink = std::sync::Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                sink.lock().push(line);
            }
        });
        Self {
            child,
            pid,
            lines,
            reader: Some(reader),
        }
    }

    /// Waits for it to exit; the lines it printed after its pid.
    pub fn wait(mut self) -> Vec<String> {
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        std::mem::take(&mut *self.lines.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_from_a_tenant_line() {
        let l = r#"{"pid":12,"grants":3456,"refusals":7,"first_try_refusals":2}"#;
        assert_eq!(tenant_field(l, "grants"), Some(3456));
        assert_eq!(tenant_field(l, "refusals"), Some(7));
        assert_eq!(tenant_field(l, "first_try_refusals"), Some(2));
        assert_eq!(tenant_field(l, "launches"), None);
        assert_eq!(tenant_field("pid 12", "grants"), None);
    }
}
