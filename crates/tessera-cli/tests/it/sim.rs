//! Integration tests of `tessera sim` with real, unmodified CUDA clients (NVIDIA's
//! `cuda-bindings`). Each test uses its own state folder so tests run in parallel.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_testkit::{FirstLine, KillOnDrop, python, spawn_first_line};

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(name)
}

fn sim(state: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.arg("sim").arg("--state-dir").arg(state);
    c
}

#[test]
fn cuda_bindings_client_runs_on_simulated_gpus() {
    let state = tempfile::tempdir().unwrap();
    let out = sim(state.path())
        .args(["--gpus", "2x80GiB", "--"])
        .arg(python())
        .arg(script("sim_client.py"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 2);
    assert_eq!(v["total"].as_u64().unwrap(), 80 << 30);
    assert_eq!(v["driver_version"].as_i64().unwrap(), 13000);
    let ms: Vec<f64> = v["kernel_ms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    // Launches return at once; the kernels' time shows on the events.
    assert!(v["submit_s"].as_f64().unwrap() < 0.1);
    assert!(
        (200.0..240.0).contains(&ms[2]),
        "alone, a 200 ms kernel measured {}",
        ms[2]
    );
}

struct Worker {
    child: KillOnDrop,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Worker {
    fn start(state: &Path, args: &[&str]) -> Worker {
        let mut child = sim(state)
            .arg("--")
            .arg(python())
            .arg(script("sim_worker.py"))
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Worker {
            child: KillOnDrop::new(child),
            lines: rx,
        }
    }

    fn expect(&self, prefix: &str) -> String {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("worker never printed {prefix}"));
        assert!(line.starts_with(prefix), "expected {prefix}, got {line}");
        line[prefix.len()..].trim().to_string()
    }
}

#[test]
fn two_processes_share_memory_and_serialise_kernels() {
    let state = tempfile::tempdir().unwrap();
    let gib = (1u64 << 30).to_string();
    let both = (2u64 << 30).to_string();
    let t0 = Instant::now();
    // Each allocates 1 GiB, waits until it sees 2 GiB in use (the other's too), then runs 1 s
    // of kernels (4 x 250 ms).
    let a = Worker::start(state.path(), &[&gib, "250000000", "4", &both]);
    let b = Worker::start(state.path(), &[&gib, "250000000", "4", &both]);
    a.expect("ready");
    b.expect("ready");
    a.expect("done");
    b.expect("done");
    let wall = t0.elapsed();
    for mut w in [a, b] {
        assert!(w.child.wait().unwrap().success());
    }
    assert!(
        wall >= Duration::from_millis(1800),
        "kernels overlapped: {wall:?}"
    );
    let busy = tessera_sim_state::device_busy_ns(state.path(), 0);
    assert!(
        (2_000_000_000..2_400_000_000).contains(&busy),
        "engine busy {busy} ns"
    );
    assert_eq!(
        tessera_sim_state::device_memory_used(state.path(), 0).unwrap(),
        0
    );
}

#[test]
fn sigkilled_process_leaves_no_memory_behind() {
    let state = tempfile::tempdir().unwrap();
    let five = (5u64 << 30).to_string();
    let mut w = Worker::start(state.path(), &[&five, "0", "0", "0", "hold"]);
    let pid: i32 = w.expect("ready").parse().unwrap();
    w.expect("done");
    // Plus its context: `tessera sim` models a real card's 300 MiB.
    assert_eq!(
        tessera_sim_state::device_memory_used(state.path(), 0).unwrap(),
        (5 << 30) + (300 << 20)
    );
    let procs = tessera_sim_state::read_processes(state.path()).unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, pid as u32);
    // SAFETY: kill(2) on the worker's pid, which we just read from it and which is alive.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let status = w.child.wait().unwrap();
    // `tessera sim` execs the command: the pid it printed is `tessera sim`'s own.
    assert_eq!(pid as u32, w.child.id(), "tessera sim execs its command");
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "the command's end is tessera sim's"
    );
    assert_eq!(
        tessera_sim_state::device_memory_used(state.path(), 0).unwrap(),
        0
    );
    assert!(
        tessera_sim_state::read_processes(state.path())
            .unwrap()
            .is_empty()
    );
}

#[test]
fn exit_codes_and_bad_arguments() {
    let state = tempfile::tempdir().unwrap();
    let st = sim(state.path())
        .args(["--", "sh", "-c", "exit 7"])
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(7));
    let out = sim(state.path())
        .args([
            "--",
            "sh",
            "-c",
            "echo $TESSERA_SIM_GPUS $TESSERA_SIM_DIR; ls $(echo $LD_LIBRARY_PATH | cut -d: -f1)",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with(&format!("1x80GiB {}", state.path().display())),
        "{text}"
    );
    assert!(
        text.contains("libcuda.so.1") && text.contains("libnvidia-ml.so.1"),
        "{text}"
    );
    let bad = sim(state.path())
        .args(["--gpus", "2xlots", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid GPU spec"));
    let none = sim(state.path()).output().unwrap();
    assert_eq!(none.status.code(), Some(2));
    let xid = sim(state.path())
        .args(["--inject-xid", "3:79"])
        .output()
        .unwrap();
    assert_eq!(
        xid.status.code(),
        Some(2),
        "GPU 3 does not exist on 1x80GiB"
    );
    let xid = sim(state.path())
        .args(["--inject-xid", "0:79"])
        .status()
        .unwrap();
    assert!(xid.success());
    let (events, _) = tessera_sim_state::read_xid_events(state.path(), 0);
    assert_eq!(
        events,
        vec![tessera_sim_state::XidEvent { gpu: 0, code: 79 }]
    );
}

#[test]
fn context_memory_flags_set_what_the_first_and_each_further_context_cost() {
    let state = tempfile::tempdir().unwrap();
    // The primary context, then two created ones: 200 + 2 x 50 MiB out of the card.
    let client = "from cuda.bindings import driver as cu\n\
        cu.cuInit(0)\n\
        _, dev = cu.cuDeviceGet(0)\n\
        _, p = cu.cuDevicePrimaryCtxRetain(dev)\n\
        cu.cuCtxSetCurrent(p)\n\
        _, c1 = cu.cuCtxCreate(None, 0, dev)\n\
        _, c2 = cu.cuCtxCreate(None, 0, dev)\n\
        _, free, total = cu.cuMemGetInfo()\n\
        print((total - free) >> 20)\n";
    let out = sim(state.path())
        .args([
            "--gpus",
            "1x16GiB",
            "--context-memory",
            "200MiB",
            "--further-context-memory",
            "50MiB",
            "--",
        ])
        .arg(python())
        .args(["-c", client])
        .env_remove("TESSERA_SIM_CONTEXT_MEMORY")
        .env_remove("TESSERA_SIM_FURTHER_CONTEXT_MEMORY")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.trim(), "300", "MiB in use: 200 + 2 x 50");
    // A bad size is a usage error (exit 2) before anything runs.
    let bad = sim(state.path())
        .args(["--further-context-memory", "lots", "--", "/bin/true"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--further-context-memory"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

/// What `sim_visible.py` (a cuda-bindings client) counts on the machine of `state`, run by
/// `tessera sim` with `args` before the `--`.
fn gpus_seen(state: &Path, args: &[&str]) -> (u64, u64) {
    let out = sim(state)
        .env_remove("TESSERA_SIM_GPUS")
        .args(args)
        .arg("--")
        .arg(python())
        .arg(script("sim_visible.py"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    (
        v["count"].as_u64().unwrap(),
        v["nvml_count"].as_u64().unwrap(),
    )
}

#[test]
fn later_commands_join_the_running_machine_and_a_different_spec_is_refused() {
    let state = tempfile::tempdir().unwrap();
    // A long-running first command (as an arbiter would be) holds the machine while it lives.
    let mut cmd = sim(state.path());
    cmd.env_remove("TESSERA_SIM_GPUS")
        .args([
            "--gpus",
            "2x80GiB",
            "--",
            "sh",
            "-c",
            "echo up; read _ || true",
        ])
        .stdin(Stdio::piped());
    let FirstLine {
        child: mut first,
        stdin,
        line,
    } = spawn_first_line(&mut cmd);
    assert_eq!(line.trim(), "up");

    // Without --gpus: the running machine's two GPUs, for CUDA and NVML alike.
    assert_eq!(gpus_seen(state.path(), &[]), (2, 2));
    assert_eq!(gpus_seen(state.path(), &["--gpus", "80GiB,80GiB"]), (2, 2));
    // Another spec, by flag or by the environment: refused before anything runs.
    let marker = state.path().join("ran");
    for (flag, env) in [(Some("1x80GiB"), None), (None, Some("1x80GiB"))] {
        let mut cmd = sim(state.path());
        cmd.env_remove("TESSERA_SIM_GPUS");
        if let Some(f) = flag {
            cmd.args(["--gpus", f]);
        }
        if let Some(e) = env {
            cmd.env("TESSERA_SIM_GPUS", e);
        }
        let out = cmd.arg("--").arg("touch").arg(&marker).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        let from = if flag.is_some() {
            "--gpus 1x80GiB"
        } else {
            "TESSERA_SIM_GPUS 1x80GiB"
        };
        assert!(
            err.contains("is running with GPUs 2x80GiB")
                && err.contains(&format!("{from} differs")),
            "{err}"
        );
        assert!(!marker.exists(), "nothing ran");
    }

    // Once the machine's last process is gone, a new spec may start another.
    drop(stdin);
    assert!(first.wait().unwrap().success());
    assert_eq!(gpus_seen(state.path(), &["--gpus", "1x80GiB"]), (1, 1));
}
