//! Test bed for the interposer: a simulated GPU folder, the real `tessera-arbiter` binary
//! started against the simulated NVML, allocations made over its admin socket, and tenant
//! processes run with the built `libtessera_interpose.so`.

#![allow(dead_code, unused_imports)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::time::Duration;

use tessera_protocol::AllocationStatus;
use tessera_protocol::client::AdminClient;
use tessera_testkit::arbiter::read_log;
use tessera_testkit::{ArbiterSpec, KillOnDrop, RunningArbiter, SimGpu};

pub(crate) use tessera_testkit::{GIB, MIB, artifact, code, python, target_dir, wait_until};

/// What the interposer reserves per context (the primary one of each process, each created
/// one): contexts count against the limit.
pub(crate) const CONTEXT: u64 = tessera_interpose::contexts::CONTEXT_RESERVE;

/// The simulated card of these tests.
pub(crate) const SIM_GPUS: &str = "1x80GiB";

/// The interposer library.
pub(crate) fn interposer() -> PathBuf {
    artifact("libtessera_interpose.so")
}

/// A test script's path.
pub(crate) fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(name)
}

/// A simulated GPU and an arbiter serving it, all in one temp folder.
pub(crate) struct Bed {
    pub dir: tempfile::TempDir,
    pub sim_dir: PathBuf,
    pub lib_dir: PathBuf,
    pub socket: PathBuf,
    pub admin_socket: PathBuf,
    sim: SimGpu,
    arbiter: Option<RunningArbiter>,
    starts: u32,
    /// Extra arguments of every arbiter start.
    arbiter_args: Vec<String>,
}

impl Bed {
    /// Prepares the simulated GPU and starts the arbiter.
    pub(crate) fn new() -> Self {
        Self::with_arbiter_args(&[])
    }

    /// As [`Bed::new`], with extra arguments for the arbiter (e.g. `--enforce report`).
    pub(crate) fn with_arbiter_args(args: &[&str]) -> Self {
        Self::with_gpus(SIM_GPUS, args)
    }

    /// As [`Bed::with_arbiter_args`] on other simulated GPUs (e.g. `1x16GiB`, a card that a
    /// few allocations fill).
    pub(crate) fn with_gpus(gpus: &str, args: &[&str]) -> Self {
        Self::with_sim(gpus, None, args)
    }

    /// As [`Bed::with_arbiter_args`] on a simulated card whose contexts cost `context_memory`
    /// (e.g. `500MiB`, a context bigger than the interposer's estimate).
    pub(crate) fn with_context_memory(context_memory: &str, args: &[&str]) -> Self {
        Self::with_sim(SIM_GPUS, Some(context_memory), args)
    }

    fn with_sim(gpus: &str, context_memory: Option<&str>, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut sim = SimGpu::prepare(&dir.path().join("sim"), gpus);
        if let Some(m) = context_memory {
            sim.context_memory = m.to_owned();
        }
        let mut bed = Self {
            socket: dir.path().join("tessera.sock"),
            admin_socket: dir.path().join("admin.sock"),
            sim_dir: sim.dir.clone(),
            lib_dir: sim.lib_dir.clone(),
            sim,
            dir,
            arbiter: None,
            starts: 0,
            arbiter_args: args.iter().map(|a| a.to_string()).collect(),
        };
        bed.start_arbiter();
        bed
    }

    fn log_path(&self, n: u32) -> PathBuf {
        self.dir.path().join(format!("arbiter-{n}.log"))
    }

    /// Starts the arbiter (again, after [`Bed::kill_arbiter`]: allocations persist).
    pub(crate) fn start_arbiter(&mut self) {
        assert!(self.arbiter.is_none(), "already running");
        self.starts += 1;
        let spec = ArbiterSpec::in_dir(
            artifact("tessera-arbiter"),
            self.dir.path(),
            self.sim.clone(),
        )
        .log_to(self.log_path(self.starts));
        let mut cmd = spec.command();
        // A free port, so a test can read the backstop's poll count (a later
        // `--metrics-addr` in the bed's arguments wins).
        cmd.args(["--metrics-addr", "127.0.0.1:0"]);
        cmd.args(&self.arbiter_args);
        self.arbiter = Some(spec.start_command(cmd));
    }

    /// SIGKILLs the arbiter (no clean-up on its side).
    pub(crate) fn kill_arbiter(&mut self) {
        self.arbiter.take().expect("running").kill();
    }

    /// Every arbiter log so far.
    pub(crate) fn arbiter_log(&self) -> String {
        (1..=self.starts)
            .map(|n| read_log(&self.log_path(n)))
            .collect()
    }

    /// Waits until the running arbiter's backstop has polled `more` times after this call: it
    /// looked at the card, so what it left alone it chose to leave.
    #[track_caller]
    pub(crate) fn wait_backstop_polls(&self, more: u64) {
        let a = self.arbiter.as_ref().expect("running");
        a.wait_backstop_polls(
            a.metrics_addr(Duration::from_secs(10)),
            more,
            Duration::from_secs(30),
        );
    }

    pub(crate) fn admin(&self) -> AdminClient {
        AdminClient::connect(&self.admin_socket).unwrap()
    }

    /// Creates an allocation on GPU 0; returns (token, id).
    pub(crate) fn create(&self, memory: u64) -> (String, String) {
        self.create_with(memory, 50, None)
    }

    /// Creates an allocation with a compute share and cap.
    pub(crate) fn create_with(
        &self,
        memory: u64,
        share: u32,
        cap: Option<u32>,
    ) -> (String, String) {
        let (token, status) = self
            .admin()
            .create(tessera_testkit::allocation(0, memory, share, cap))
            .unwrap();
        (token, status.id)
    }

    /// The arbiter's view of an allocation.
    pub(crate) fn status(&self, id: &str) -> AllocationStatus {
        self.admin()
            .list()
            .unwrap()
            .into_iter()
            .find(|a| a.id == id)
            .expect("allocation listed")
    }

    /// Bytes the arbiter counts for an allocation.
    pub(crate) fn used(&self, id: &str) -> u64 {
        self.status(id).memory_used
    }

    /// A command on the simulated GPU, without the interposer.
    pub(crate) fn sim_command(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        self.sim
            .apply(&mut cmd)
            .env_remove("LD_PRELOAD")
            .env_remove("TESSERA_TOKEN")
            .env_remove("TESSERA_SOCKET")
            .env_remove("TESSERA_REAL_LIBCUDA");
        cmd
    }

    /// A command on the simulated GPU under the interposer with `token` (what `tessera run`
    /// sets up, done by hand so a test controls every variable).
    pub(crate) fn tenant_command(&self, program: &Path, token: &str) -> Command {
        let mut cmd = self.sim_command(program);
        cmd.env("LD_PRELOAD", interposer())
            .env("TESSERA_SOCKET", &self.socket)
            .env("TESSERA_TOKEN", token);
        cmd
    }

    /// The Python client under the interposer.
    pub(crate) fn py_tenant(&self, token: &str, args: &[&str]) -> Command {
        let mut cmd = self.tenant_command(&python(), token);
        cmd.arg(script("mem_client.py")).args(args);
        cmd
    }

    /// Device memory each process's context costs on the bed's simulated GPU.
    pub(crate) fn context_bytes(&self) -> u64 {
        self.sim.context_bytes()
    }

    /// Bytes the simulated GPU 0 really has in use (all processes, contexts included).
    pub(crate) fn sim_used(&self) -> u64 {
        tessera_sim_state::device_memory_used(&self.sim_dir, 0).unwrap()
    }

    /// Bytes the processes' allocations hold on the simulated GPU 0, without their contexts
    /// (what a limit on allocations bounds, however many processes come and go).
    pub(crate) fn sim_allocated(&self) -> u64 {
        tessera_sim_state::read_processes(&self.sim_dir)
            .unwrap()
            .iter()
            .map(|p| p.mem_bytes[0] - p.context_bytes[0])
            .sum()
    }
}

/// Builds `tests/c/NAME.c` against the simulated driver (C clients reach what cuda-bindings
/// never asks for, such as per-thread variants, `pthread_cancel` or glibc's own `dlsym`).
pub(crate) fn build_c(bed: &Bed, name: &str) -> PathBuf {
    cc(bed, name, name, &[])
}

/// Builds `tests/c/NAME.c` as `libNAME.so`, linked against the simulated driver (a library that
/// calls the driver itself, e.g. one loaded with `RTLD_DEEPBIND`).
pub(crate) fn build_c_lib(bed: &Bed, name: &str) -> PathBuf {
    cc(bed, name, &format!("lib{name}.so"), &["-shared", "-fPIC"])
}

fn cc(bed: &Bed, name: &str, output: &str, flags: &[&str]) -> PathBuf {
    let out_path = bed.dir.path().join(output);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let out = Command::new("cc")
        .args(flags)
        .arg("-o")
        .arg(&out_path)
        .arg(&src)
        .arg(format!("-L{}", bed.lib_dir.display()))
        .args(["-lcuda", "-ldl", "-lpthread"])
        .output()
        .expect("a C compiler (cc) is needed");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out_path
}

/// True while `pid` exists and is not a zombie.
pub(crate) fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Runs a command to completion; returns (status, stdout, stderr).
pub(crate) fn run(cmd: &mut Command) -> (ExitStatus, String, String) {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The last JSON line of a program's output.
pub(crate) fn last_json(stdout: &str, stderr: &str) -> serde_json::Value {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON output; stdout: {stdout}\nstderr: {stderr}"));
    serde_json::from_str(line).unwrap()
}

/// A long-running `mem_client.py serve` process driven line by line.
pub(crate) struct Served {
    /// Killed if the test ends without [`Served::exit`].
    pub child: KillOnDrop,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub pid: i32,
}

impl Served {
    pub(crate) fn start(cmd: Command) -> Self {
        Self::start_script(cmd, "mem_client.py", &["serve"])
    }

    /// Starts another client script that answers `{"ready": PID}` first, then one JSON line a
    /// command.
    pub(crate) fn start_script(mut cmd: Command, name: &str, args: &[&str]) -> Self {
        let mut child = cmd
            .arg(script(name))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut s = Self {
            child: KillOnDrop::new(child),
            stdin,
            stdout,
            pid: 0,
        };
        let ready = s.read();
        s.pid = ready["ready"].as_i64().expect("ready line") as i32;
        s
    }

    /// Reads one JSON answer.
    pub(crate) fn read(&mut self) -> serde_json::Value {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).unwrap();
        assert!(
            n > 0,
            "the served process ended (status {:?})",
            self.child.try_wait()
        );
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"))
    }

    /// Sends a command and reads its answer.
    pub(crate) fn ask(&mut self, cmd: &str) -> serde_json::Value {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.read()
    }

    /// Sends `fork_child BYTES`: returns the parent's answer (`forked`, `release_fd`) and the
    /// child's (`child_alloc`, `child_pid`). The two processes print at the same time, so the
    /// lines are told apart by what they say, not by their order.
    pub(crate) fn fork_child(&mut self, bytes: u64) -> (serde_json::Value, serde_json::Value) {
        let first = self.ask(&format!("fork_child {bytes}"));
        let second = self.read();
        if first.get("forked").is_some() {
            (first, second)
        } else {
            (second, first)
        }
    }

    /// Sends `exit` and waits.
    pub(crate) fn exit(mut self) -> ExitStatus {
        let _ = writeln!(self.stdin, "exit");
        let _ = self.stdin.flush();
        self.child.wait().unwrap()
    }
}
