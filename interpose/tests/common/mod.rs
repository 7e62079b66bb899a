//! Test bed for the interposer: a simulated GPU folder, the real `tessera-arbiter` binary
//! started against the simulated NVML, allocations made over its admin socket, and tenant
//! processes run with the built `libtessera_interpose.so`.

#![allow(dead_code)]

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tessera_protocol::client::AdminClient;
use tessera_protocol::{AllocationStatus, CreateAllocation, GpuSelector};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
/// The simulated card of these tests.
pub const SIM_GPUS: &str = "1x80GiB";

/// `<target>/debug`, where cargo put the binaries and cdylibs.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// A built artifact, with a clear message when it is missing.
pub fn artifact(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(p.exists(), "{} is missing: run `cargo build --workspace` first", p.display());
    p
}

/// The interposer library.
pub fn interposer() -> PathBuf {
    artifact("libtessera_interpose.so")
}

/// Python with `cuda-bindings`: `$TESSERA_PYTHON`, else `<workspace>/.venv/bin/python`.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("TESSERA_PYTHON") {
        return PathBuf::from(p);
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        p.exists(),
        "Python with cuda-bindings not found at {} (set TESSERA_PYTHON or create the venv: \
         python3 -m venv .venv && .venv/bin/pip install 'cuda-bindings==13.*')",
        p.display()
    );
    p
}

/// A test script's path.
pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python").join(name)
}

/// A simulated GPU and an arbiter serving it, all in one temp folder.
pub struct Bed {
    pub dir: tempfile::TempDir,
    pub sim_dir: PathBuf,
    pub lib_dir: PathBuf,
    pub socket: PathBuf,
    pub admin_socket: PathBuf,
    arbiter: Option<Child>,
    starts: u32,
}

impl Bed {
    /// Prepares the simulated GPU and starts the arbiter.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sim_dir = dir.path().join("sim");
        let built = tessera_sim_state::find_built_lib_dir(Some(&target_dir()))
            .unwrap_or_else(|e| panic!("{e}: run `cargo build --workspace` first"));
        let lib_dir = tessera_sim_state::prepare_lib_dir(&sim_dir, &built).unwrap();
        let mut bed = Self {
            socket: dir.path().join("tessera.sock"),
            admin_socket: dir.path().join("admin.sock"),
            sim_dir,
            lib_dir,
            dir,
            arbiter: None,
            starts: 0,
        };
        bed.start_arbiter();
        bed
    }

    fn log_path(&self, n: u32) -> PathBuf {
        self.dir.path().join(format!("arbiter-{n}.log"))
    }

    /// Starts the arbiter (again, after [`Bed::kill_arbiter`]: allocations persist).
    pub fn start_arbiter(&mut self) {
        assert!(self.arbiter.is_none(), "already running");
        self.starts += 1;
        let log = fs::File::create(self.log_path(self.starts)).unwrap();
        let child = Command::new(artifact("tessera-arbiter"))
            .arg("--socket")
            .arg(&self.socket)
            .arg("--admin-socket")
            .arg(&self.admin_socket)
            .arg("--state-dir")
            .arg(self.dir.path().join("state"))
            .env("LD_LIBRARY_PATH", &self.lib_dir)
            .env("TESSERA_SIM_DIR", &self.sim_dir)
            .env("TESSERA_SIM_GPUS", SIM_GPUS)
            .env_remove("TESSERA_SOCKET")
            .env_remove("TESSERA_ADMIN_SOCKET")
            .env_remove("LD_PRELOAD")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.arbiter = Some(child);
        let start = Instant::now();
        loop {
            if let Some(status) = self.arbiter.as_mut().unwrap().try_wait().unwrap() {
                panic!("arbiter exited early with {status}: {}", self.arbiter_log());
            }
            if AdminClient::connect(&self.admin_socket).is_ok() && self.socket.exists() {
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(20), "arbiter did not come up: {}", self.arbiter_log());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILLs the arbiter (no clean-up on its side).
    pub fn kill_arbiter(&mut self) {
        let mut c = self.arbiter.take().expect("running");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// Every arbiter log so far.
    pub fn arbiter_log(&self) -> String {
        let mut s = String::new();
        for n in 1..=self.starts {
            if let Ok(mut f) = fs::File::open(self.log_path(n)) {
                let _ = f.read_to_string(&mut s);
            }
        }
        s
    }

    pub fn admin(&self) -> AdminClient {
        AdminClient::connect(&self.admin_socket).unwrap()
    }

    /// Creates an allocation on GPU 0; returns (token, id).
    pub fn create(&self, memory: u64) -> (String, String) {
        self.create_with(memory, 50, None)
    }

    /// Creates an allocation with a compute share and cap.
    pub fn create_with(&self, memory: u64, share: u32, cap: Option<u32>) -> (String, String) {
        let (token, status) = self
            .admin()
            .create(CreateAllocation {
                gpu: GpuSelector::Index(0),
                memory_limit: memory,
                share,
                cap,
                labels: Default::default(),
            })
            .unwrap();
        (token, status.id)
    }

    /// The arbiter's view of an allocation.
    pub fn status(&self, id: &str) -> AllocationStatus {
        self.admin().list().unwrap().into_iter().find(|a| a.id == id).expect("allocation listed")
    }

    /// Bytes the arbiter counts for an allocation.
    pub fn used(&self, id: &str) -> u64 {
        self.status(id).memory_used
    }

    /// A command on the simulated GPU, without the interposer.
    pub fn sim_command(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("LD_LIBRARY_PATH", &self.lib_dir)
            .env("TESSERA_SIM_DIR", &self.sim_dir)
            .env("TESSERA_SIM_GPUS", SIM_GPUS)
            .env_remove("LD_PRELOAD")
            .env_remove("TESSERA_TOKEN")
            .env_remove("TESSERA_SOCKET")
            .env_remove("TESSERA_REAL_LIBCUDA");
        cmd
    }

    /// A command on the simulated GPU under the interposer with `token` (what `tessera run`
    /// sets up, done by hand so a test controls every variable).
    pub fn tenant_command(&self, program: &Path, token: &str) -> Command {
        let mut cmd = self.sim_command(program);
        cmd.env("LD_PRELOAD", interposer())
            .env("TESSERA_SOCKET", &self.socket)
            .env("TESSERA_TOKEN", token);
        cmd
    }

    /// The Python client under the interposer.
    pub fn py_tenant(&self, token: &str, args: &[&str]) -> Command {
        let mut cmd = self.tenant_command(&python(), token);
        cmd.arg(script("mem_client.py")).args(args);
        cmd
    }

    /// Bytes the simulated GPU 0 really has allocated (all processes).
    pub fn sim_used(&self) -> u64 {
        tessera_sim_state::device_memory_used(&self.sim_dir, 0).unwrap()
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        if let Some(mut c) = self.arbiter.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs a command to completion; returns (status, stdout, stderr).
pub fn run(cmd: &mut Command) -> (ExitStatus, String, String) {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The last JSON line of a program's output.
pub fn last_json(stdout: &str, stderr: &str) -> serde_json::Value {
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).unwrap_or_else(|| {
        panic!("no JSON output; stdout: {stdout}\nstderr: {stderr}")
    });
    serde_json::from_str(line).unwrap()
}

/// A long-running `mem_client.py serve` process driven line by line.
pub struct Served {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub pid: i32,
}

impl Served {
    pub fn start(mut cmd: Command) -> Self {
        let mut child = cmd
            .arg(script("mem_client.py"))
            .arg("serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut s = Self { child, stdin, stdout, pid: 0 };
        let ready = s.read();
        s.pid = ready["ready"].as_i64().expect("ready line") as i32;
        s
    }

    /// Reads one JSON answer.
    pub fn read(&mut self) -> serde_json::Value {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).unwrap();
        assert!(n > 0, "the served process ended (status {:?})", self.child.try_wait());
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"))
    }

    /// Sends a command and reads its answer.
    pub fn ask(&mut self, cmd: &str) -> serde_json::Value {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.read()
    }

    /// Sends `exit` and waits.
    pub fn exit(mut self) -> ExitStatus {
        let _ = writeln!(self.stdin, "exit");
        let _ = self.stdin.flush();
        self.child.wait().unwrap()
    }
}

/// Polls `f` until true or `timeout`; returns how long it took.
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

/// Exit code, or 128 + signal.
pub fn code(s: ExitStatus) -> i32 {
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}
