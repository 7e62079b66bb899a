//! Processes in PID namespaces of their own, as in containers, are known on the simulated
//! machine by their host pids, as a real driver knows them: NVML on the host reports host pids
//! (NVIDIA's driver does not support PID namespaces; `nvidia-smi` in a container shows host
//! pids). `tessera sim` serves `<state>/driver.sock`, from which each asks its host pid.
//!
//! The namespaced processes are this test binary run again (`unshare --pid --fork
//! --mount-proc`, each pid 1 inside) with [`CHILD`] set: they load the simulated
//! `libcuda.so.1`, allocate, run a kernel, say `ready <their own pid>` and wait for their
//! input to close. The test runs alone in a process of its own (`crate::nvml_alone`): NVML
//! reads its state folder from the environment. Needs root and util-linux's `unshare`, as a
//! container runtime does; fails, never skips, without.

use std::ffi::c_void;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nvml_wrapper::enums::device::UsedGpuMemory;
use tessera_cuda_abi::*;
use tessera_testkit::{KillOnDrop, wait_until};

/// Set in a namespaced child: `<MiB to allocate>[,fork=<MiB the fork child allocates>]`.
const CHILD: &str = "TESSERA_TEST_PIDNS_CHILD";
const TEST: &str = "processes_in_their_own_pid_namespaces_are_known_by_their_host_pids";
const MIB: u64 = 1 << 20;
const CONTEXT: u64 = 300 * MIB;
const KERNEL_NS: u64 = 200_000_000;
const PTX: &std::ffi::CStr =
    c".version 8.0\n.target sm_90\n.visible .entry spin(.param .u64 ns) { ret; }\n";

#[test]
fn processes_in_their_own_pid_namespaces_are_known_by_their_host_pids() {
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec);
    }
    let Some(state) = crate::nvml_alone(module_path!(), TEST, "1x16GiB") else {
        return;
    };
    let socket = state.join("driver.sock");
    // What a killed server leaves: a socket file nobody listens on. It is replaced.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());

    // The machine, held as a node would (`tessera sim --gpus ... -- sleep infinity`).
    let mut holder = sim(state.as_path())
        .args(["--", "sh", "-c", "echo up; read _ || true"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let holder_in = holder.stdin.take();
    let mut up = String::new();
    BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut up)
        .unwrap();
    let mut holder = KillOnDrop::new(holder);
    assert_eq!(up.trim(), "up");
    assert_eq!(
        tessera_sim_state::driver::ask(state.as_path(), Duration::from_secs(1)).unwrap(),
        std::process::id(),
        "the driver answers"
    );
    let served = std::fs::metadata(&socket).unwrap().ino();

    // Two "containers": one process each (pid 1 inside); the second forks a second process.
    let (a, a_lines) = namespaced(state.as_path(), "1024");
    let (b, b_lines) = namespaced(state.as_path(), "2048,fork=512");
    let ready = |lines: &mpsc::Receiver<String>| {
        lines
            .recv_timeout(Duration::from_secs(60))
            .expect("a namespaced process said it is ready")
    };
    assert_eq!(ready(&a_lines), "ready 1");
    // The fork child's pid inside: the next free one (threads take pids too).
    let mut b_said: Vec<u32> = [ready(&b_lines), ready(&b_lines)]
        .iter()
        .map(|l| l.strip_prefix("ready ").unwrap().parse().unwrap())
        .collect();
    b_said.sort();
    assert!(b_said[0] == 1 && b_said[1] > 1, "pids inside: {b_said:?}");

    // Their host pids, as the host's kernel knows them.
    let a_pid = only(children(a.child_pid()));
    let b_pid = only(children(b.child_pid()));
    let b_fork = only(children(b_pid));
    assert_eq!(ns_pids(a_pid), [a_pid, 1]);
    assert_eq!(ns_pids(b_pid), [b_pid, 1]);
    assert_eq!(ns_pids(b_fork), [b_fork, b_said[1]]);

    // The machine's records: host pids, each with its own memory and kernel time.
    let procs = tessera_sim_state::read_processes(state.as_path()).unwrap();
    let found: Vec<(u32, u64)> = procs.iter().map(|p| (p.pid, p.mem_bytes[0])).collect();
    let mut expected = vec![
        (a_pid, 1024 * MIB + CONTEXT),
        (b_pid, 2048 * MIB + CONTEXT),
        (b_fork, 512 * MIB),
    ];
    expected.sort();
    assert_eq!(found, expected, "records by host pid");
    let (_, busy) = tessera_sim_state::process_busy_ns(state.as_path(), 0);
    for pid in [a_pid, b_pid] {
        let ns = busy.iter().find(|&&(p, _)| p == pid).map(|&(_, ns)| ns);
        assert!(
            ns.is_some_and(|ns| ns >= KERNEL_NS),
            "{pid}'s kernel time: {busy:?}"
        );
    }

    // NVML on the host says the same.
    let nvml = crate::sim_nvml();
    let mut seen: Vec<(u32, u64)> = nvml
        .device_by_index(0)
        .unwrap()
        .running_compute_processes()
        .unwrap()
        .into_iter()
        .map(|p| match p.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => (p.pid, bytes),
            UsedGpuMemory::Unavailable => (p.pid, 0),
        })
        .collect();
    seen.sort();
    assert_eq!(seen, expected, "NVML's compute processes");

    // Joining the machine kept its driver; their end leaves nothing charged.
    assert_eq!(std::fs::metadata(&socket).unwrap().ino(), served);
    for (mut c, lines) in [(a, a_lines), (b, b_lines)] {
        drop(c.stdin.take());
        let st = c.wait();
        assert!(st.success(), "{st:?}");
        drop(lines);
    }
    assert!(
        tessera_sim_state::read_processes(state.as_path())
            .unwrap()
            .is_empty()
    );

    // The machine stops: its driver goes with it.
    drop(holder_in);
    let st = holder.take().unwrap().wait().unwrap();
    assert!(st.success(), "{st:?}");
    assert!(
        wait_until(Duration::from_secs(5), || !socket.exists()).is_some(),
        "the driver's socket outlived the machine"
    );
}

fn sim(state: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.args(["sim", "--gpus", "1x16GiB", "--state-dir"])
        .arg(state);
    c
}

/// A namespaced child, and the lines it prints.
struct Namespaced {
    child: KillOnDrop,
    stdin: Option<std::process::ChildStdin>,
}

impl Namespaced {
    /// The pid of `unshare`, whose child is the namespace's pid 1.
    fn child_pid(&self) -> u32 {
        self.child.id()
    }

    fn wait(&mut self) -> std::process::ExitStatus {
        let mut c: Child = self.child.take().unwrap();
        c.wait().unwrap()
    }
}

/// Runs this test as a namespaced child (see the module notes) under `tessera sim`.
fn namespaced(state: &Path, spec: &str) -> (Namespaced, mpsc::Receiver<String>) {
    let mut child = sim(state)
        .args([
            "--",
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
        ])
        .arg(std::env::current_exe().unwrap())
        .arg(tessera_testkit::alone::test_name(module_path!(), TEST))
        .args(["--exact", "--nocapture", "--test-threads=1", "-q"])
        .env(CHILD, spec)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("unshare (util-linux) runs");
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("ready ") && tx.send(line).is_err() {
                break;
            }
        }
    });
    let stdin = child.stdin.take();
    (
        Namespaced {
            child: KillOnDrop::new(child),
            stdin,
        },
        rx,
    )
}

/// The children of every thread of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        out.extend(text.split_whitespace().map(|p| p.parse::<u32>().unwrap()));
    }
    out
}

fn only(pids: Vec<u32>) -> u32 {
    assert_eq!(pids.len(), 1, "{pids:?}");
    pids[0]
}

/// `pid`'s pids from the host's namespace inwards (`NSpid` of its status).
fn ns_pids(pid: u32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

/// The namespaced child: allocates `spec`'s MiB, forks if asked (the fork child allocates its
/// own), runs one kernel, says `ready <pid>` and waits for its input to close.
fn child(spec: &str) {
    let (mib, fork) = match spec.split_once(",fork=") {
        Some((m, f)) => (m, Some(f.parse::<u64>().unwrap())),
        None => (spec, None),
    };
    let mib: u64 = mib.parse().unwrap();
    // SAFETY: the simulated driver `tessera sim` put first on LD_LIBRARY_PATH; its
    // initialisers only set up empty registries.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }.unwrap();
    let ok = |what: &str, rc: CUresult| assert_eq!(rc, CUDA_SUCCESS, "{what}");
    // SAFETY: each type is the entry point's C signature; out-pointers are live locals; the
    // kernel's one parameter is a live u64.
    unsafe {
        let f = |name: &str| *lib.get::<*const c_void>(name.as_bytes()).unwrap();
        macro_rules! sym {
            ($t:ty, $name:literal) => {
                std::mem::transmute::<*const c_void, $t>(f($name))
            };
        }
        ok("cuInit", sym!(cuInit_t, "cuInit")(0));
        let mut ctx: CUcontext = std::ptr::null_mut();
        let retain = sym!(cuDevicePrimaryCtxRetain_t, "cuDevicePrimaryCtxRetain");
        ok("retain", retain(&mut ctx, 0));
        ok("set", sym!(cuCtxSetCurrent_t, "cuCtxSetCurrent")(ctx));
        let alloc = sym!(cuMemAlloc_v2_t, "cuMemAlloc_v2");
        let mut p: CUdeviceptr = 0;
        ok("alloc", alloc(&mut p, (mib * MIB) as usize));
        // The fork child is a process of its own: the driver asks again who it is.
        if let Some(more) = fork
            && libc::fork() == 0
        {
            ok(
                "alloc in the fork child",
                alloc(&mut p, (more * MIB) as usize),
            );
            println!("ready {}", std::process::id());
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            libc::_exit(0);
        }
        let mut module: CUmodule = std::ptr::null_mut();
        let load = sym!(cuModuleLoadData_t, "cuModuleLoadData");
        ok("load", load(&mut module, PTX.as_ptr().cast()));
        let mut func: CUfunction = std::ptr::null_mut();
        let get = sym!(cuModuleGetFunction_t, "cuModuleGetFunction");
        ok("function", get(&mut func, module, c"spin".as_ptr()));
        let mut ns = KERNEL_NS;
        let mut params = [(&raw mut ns).cast::<c_void>()];
        let launch = sym!(cuLaunchKernel_t, "cuLaunchKernel");
        let stream: CUstream = std::ptr::null_mut();
        ok(
            "launch",
            launch(
                func,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
        );
        ok("sync", sym!(cuCtxSynchronize_t, "cuCtxSynchronize")());
    }
    println!("ready {}", std::process::id());
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}
