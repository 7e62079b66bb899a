//! `tessera run` against the real arbiter.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::run_support::*;
use tessera_testkit::{FirstLine, spawn_first_line};

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn run_sets_env_passes_exit_code_and_deletes_the_allocation() {
    let arb = Arbiter::start();
    let fake = interposer_in(arb.dir.path());
    let script = r#"echo "token=$TESSERA_TOKEN"; echo "socket=$TESSERA_SOCKET"; echo "preload=$LD_PRELOAD"; echo "visible=$CUDA_VISIBLE_DEVICES"; echo "admin=${TESSERA_ADMIN_SOCKET-unset}"; "$TESSERA_BIN" status --json --admin-socket "$ADMIN"; exit 7"#;
    let out = arb
        .tessera(&[
            "run",
            "--memory",
            "1.5GiB",
            "--share",
            "20",
            "--cap",
            "--interposer",
        ])
        .arg(&fake)
        .args(["--", "sh", "-c", script])
        .env("TESSERA_BIN", tessera())
        .env("ADMIN", &arb.admin_socket)
        .env("CUDA_VISIBLE_DEVICES", "0,1")
        .env("LD_PRELOAD", "/nonexistent/libother.so")
        .output()
        .unwrap();
    let text = stdout(&out);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = text.lines().find_map(|l| l.strip_prefix("token=")).unwrap();
    assert_eq!(token.len(), 64, "{text}");
    assert!(
        text.contains(&format!("socket={}", arb.socket.display())),
        "{text}"
    );
    let preload = text
        .lines()
        .find_map(|l| l.strip_prefix("preload="))
        .unwrap();
    let fake = std::fs::canonicalize(&fake).unwrap();
    assert_eq!(
        preload,
        format!("{}:/nonexistent/libother.so", fake.display())
    );
    // The command sees exactly its allocation's GPU, and not the admin socket.
    assert!(
        text.contains(&format!("visible={}\n", gpu_uuid(0))),
        "{text}"
    );
    assert!(text.contains("admin=unset\n"), "{text}");
    // While the command ran, its allocation existed with the asked limits.
    let json_start = text.find('{').unwrap();
    let json_end = text.rfind('}').unwrap();
    let v: serde_json::Value = serde_json::from_str(&text[json_start..=json_end]).unwrap();
    let a = &v["gpus"][0]["allocations"][0];
    assert_eq!(a["memory_limit"], 3 * GIB / 2);
    assert_eq!(a["share"], 20);
    assert_eq!(a["cap"], 20);
    assert_eq!(a["labels"]["created-by"], "tessera run");
    // Afterwards it is gone.
    assert!(arb.admin().list().unwrap().is_empty());
}

#[test]
fn run_finds_the_interposer_next_to_the_executable() {
    let arb = Arbiter::start();
    let bin_dir = arb.dir.path().join("bin");
    std::fs::create_dir(&bin_dir).unwrap();
    let exe = bin_dir.join("tessera");
    std::fs::copy(tessera(), &exe).unwrap();
    // No interposer there: refused (the command would run unlimited), nothing created.
    let out = arb
        .tessera_at(&exe, &["run", "--memory", "64MiB", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("interposer") && err.contains("not found"),
        "{err}"
    );
    assert!(arb.admin().list().unwrap().is_empty());
    // With one there, it is preloaded; the share defaults to 10.
    let fake = interposer_in(&bin_dir);
    let script = "echo $LD_PRELOAD; $TB status --json --admin-socket $ADMIN";
    let out = arb
        .tessera_at(
            &exe,
            &["run", "--memory", "64MiB", "--", "sh", "-c", script],
        )
        .env("TB", tessera())
        .env("ADMIN", &arb.admin_socket)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    let fake = std::fs::canonicalize(&fake).unwrap();
    assert_eq!(text.lines().next().unwrap(), fake.display().to_string());
    assert!(text.contains("\"share\": 10"), "{text}");
}

#[test]
fn sigterm_is_forwarded_and_the_allocation_deleted() {
    let arb = Arbiter::start();
    let fake = interposer_in(arb.dir.path());
    let mut child = arb
        .tessera(&["run", "--memory", "256MiB", "--interposer"])
        .arg(&fake)
        .args(["--", "sleep", "30"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut admin = arb.admin();
    let start = Instant::now();
    while admin.list().unwrap().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "allocation never created"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Once the command runs (`sleep`, a child of `tessera run`), signal `tessera run` only (not its
    // process group).
    let children = format!("/proc/{0}/task/{0}/children", child.id());
    tessera_testkit::wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&children)
            .unwrap_or_default()
            .split_whitespace()
            .any(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|c| c.trim() == "sleep")
            })
    })
    .expect("the command never started");
    // SAFETY: kill has no memory preconditions; the pid is our unreaped child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "sleep was not terminated"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        status.code(),
        Some(128 + libc::SIGTERM),
        "killed command's code is 128+signal"
    );
    assert!(
        admin.list().unwrap().is_empty(),
        "allocation deleted after the signal"
    );
}

#[test]
fn unreachable_arbiter_exits_3_and_refusals_exit_4() {
    let arb = Arbiter::start();
    let fake = interposer_in(arb.dir.path());
    let out = arb
        .tessera(&["run", "--memory", "1GiB", "--interposer"])
        .arg(&fake)
        .args(["--admin-socket", "/nonexistent/admin.sock", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is tessera-arbiter running"));

    // More memory than the GPU has.
    let out = arb
        .tessera(&["run", "--memory", "81GiB", "--interposer"])
        .arg(&fake)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("exceeds"));
    // Shares exhausted.
    let (_, _) = arb
        .admin()
        .create(tessera_protocol::CreateAllocation {
            gpu: tessera_protocol::GpuSelector::Index(1),
            memory_limit: GIB,
            share: 95,
            cap: None,
            labels: Default::default(),
        })
        .unwrap();
    let out = arb
        .tessera(&["run", "--gpu", "1", "--memory", "1GiB", "--interposer"])
        .arg(&fake)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("5 of 100 shares left"));
    // Bad sizes are usage errors.
    let out = arb
        .tessera(&["run", "--memory", "4XB", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown unit"));
    // So is a GPU number that is no index.
    let out = arb
        .tessera(&["run", "--gpu", "-1", "--memory", "1GiB", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("-1 is not a GPU index") && !err.contains("UUID -1"),
        "{err}"
    );
}

#[test]
fn a_file_that_is_not_the_interposer_is_refused_and_nothing_runs() {
    let arb = Arbiter::start();
    let marker = arb.dir.path().join("ran");
    let touch = format!("touch {}", marker.display());
    // A program, a text file, a library without the hooks: none of them would enforce anything
    // (the loader would skip the first two with a warning and run the command unlimited).
    let text = arb.dir.path().join("libtessera_interpose.so");
    std::fs::write(&text, "not a library").unwrap();
    let libc_so = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/lib64/libc.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("libc.so.6");
    // The simulated CUDA driver defines cuMemAlloc_v2 and cuLaunchKernel itself and "exports"
    // dlsym through libc: only the marker and dladdr tell it apart from the interposer.
    let libcuda = tessera_testkit::artifact("libtessera_sim_cuda.so");
    let cases = [
        ("/bin/true".to_owned(), "does not load"),
        (text.display().to_string(), "does not load"),
        (libc_so.to_owned(), "not the Tessera interposer"),
        (
            libcuda.display().to_string(),
            "not the Tessera interposer: its dlsym is defined by",
        ),
    ];
    for (file, why) in cases {
        let out = arb
            .tessera(&[
                "run",
                "--memory",
                "64MiB",
                "--interposer",
                &file,
                "--",
                "sh",
                "-c",
                &touch,
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{file}: {err}");
        assert!(
            err.contains(why) && err.contains("limits would not be enforced"),
            "{file}: {err}"
        );
        assert!(!marker.exists(), "{file}: the command must not run");
        assert!(
            arb.admin().list().unwrap().is_empty(),
            "{file}: no allocation left behind"
        );
    }
}

#[test]
fn the_command_sees_only_its_gpu_and_not_the_admin_socket() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let script =
        r#"echo "visible=$CUDA_VISIBLE_DEVICES"; echo "admin=${TESSERA_ADMIN_SOCKET-unset}""#;
    let out = arb
        .tessera(&["run", "--gpu", "1", "--memory", "64MiB", "--interposer"])
        .arg(&lib)
        .args(["--", "sh", "-c", script])
        .env("CUDA_VISIBLE_DEVICES", "0")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    assert_eq!(text, format!("visible={}\nadmin=unset\n", gpu_uuid(1)));
    // Set by flag rather than inherited: still not passed on.
    let out = arb
        .tessera(&["run", "--gpu", "1", "--memory", "64MiB", "--interposer"])
        .arg(&lib)
        .arg("--admin-socket")
        .arg(&arb.admin_socket)
        .args(["--", "sh", "-c", script])
        .env_remove("TESSERA_ADMIN_SOCKET")
        .output()
        .unwrap();
    assert_eq!(
        stdout(&out),
        format!("visible={}\nadmin=unset\n", gpu_uuid(1))
    );
}

#[test]
fn a_cuda_command_sees_and_uses_only_its_allocations_gpu() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sim_visible.py");
    let mut cmd = arb.tessera(&["run", "--gpu", "1", "--memory", "1GiB", "--interposer"]);
    cmd.arg(&lib)
        .arg("--")
        .arg(tessera_testkit::python())
        .arg(&script)
        .args(["256", "1000000"]);
    let FirstLine {
        mut child,
        stdin,
        line,
    } = spawn_first_line(arb.sim.apply(&mut cmd).stdin(Stdio::piped()));
    let v: serde_json::Value =
        serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    assert_eq!(v["count"], 1, "one GPU visible: {v}");
    assert_eq!(v["devices"][0]["uuid"], gpu_uuid(1));
    assert_eq!(
        v["devices"][0]["total"], GIB,
        "the card is as large as the limit"
    );
    assert_eq!(v["nvml_count"], 2, "NVML still lists the node's GPUs");
    let used = |g| tessera_sim_state::device_memory_used(&arb.sim.dir, g).unwrap();
    // Plus the client's context, on GPU 1 too.
    let context = arb.sim.context_bytes();
    assert_eq!(
        (used(0), used(1)),
        (0, 256 * MIB + context),
        "the memory is on GPU 1"
    );
    let a = arb.admin().list().unwrap();
    assert_eq!(
        (a.len(), a[0].gpu_index, a[0].memory_used),
        (1, 1, 256 * MIB + context),
        "and counted there, its context included (the interposer reserves what the card charges)"
    );
    drop(stdin);
    assert_eq!(child.wait().unwrap().code(), Some(0));
    assert!(arb.admin().list().unwrap().is_empty());
}

/// `tessera run --gpu 1 --share 100` of `sim_visible.py 512 1000000` under `env ENV...
/// CUDA_VISIBLE_DEVICES=0`: a whole-card allocation whose command turns to GPU 0, a card it
/// does not own, and takes 512 MiB there.
fn whole_card_turning_to_gpu0(arb: &Arbiter, env: &[&str]) -> std::process::Command {
    let lib = interposer_in(arb.dir.path());
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sim_visible.py");
    let mut cmd = arb.tessera(&[
        "run",
        "--gpu",
        "1",
        "--share",
        "100",
        "--memory",
        "1GiB",
        "--interposer",
    ]);
    cmd.arg(&lib)
        .args(["--", "env"])
        .args(env)
        .arg("CUDA_VISIBLE_DEVICES=0")
        .arg(tessera_testkit::python())
        .arg(&script)
        .args(["512", "1000000"]);
    cmd
}

/// Issue 20: a whole-card allocation is policed on the cards it does not own. `tessera run
/// --gpu 1 --share 100` whose command turns to GPU 0 (`env CUDA_VISIBLE_DEVICES=0`) and
/// allocates there is killed; NVML (the simulated GPU's record) is the truth.
#[test]
fn a_whole_card_allocation_that_uses_another_card_is_killed_there() {
    let arb = Arbiter::start();
    // Without the interposer (it refuses a context on a card not its own: see
    // `a_whole_card_allocation_gets_no_context_on_another_card`): the backstop's case.
    let mut cmd = whole_card_turning_to_gpu0(&arb, &["-u", "LD_PRELOAD"]);
    let FirstLine {
        mut child,
        stdin: _stdin,
        line,
    } = spawn_first_line(arb.sim.apply(&mut cmd).stdin(Stdio::piped()));
    // The script prints after its allocation and kernel, so the backstop may kill it before
    // it can say anything: an empty line is that race, and the log below still names the kill.
    if !line.trim().is_empty() {
        let v: serde_json::Value =
            serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        assert_eq!(
            v["devices"][0]["uuid"],
            gpu_uuid(0),
            "it turned to GPU 0: {v}"
        );
    }
    let used = |g| tessera_sim_state::device_memory_used(&arb.sim.dir, g).unwrap();
    let took = Instant::now();
    // Its 512 MiB on GPU 0 (within the limit, but on a card it does not own) go within a
    // second: the backstop kills the process.
    tessera_testkit::wait_until(Duration::from_secs(3), || used(0) == 0)
        .unwrap_or_else(|| panic!("GPU 0 still holds {} bytes\n{}", used(0), arb.process_log()));
    eprintln!(
        "whole-card allocation on a foreign card: gone {:?} after",
        took.elapsed()
    );
    let status = tessera_testkit::process::wait_exit(&mut child, Duration::from_secs(10))
        .expect("tessera run ends once its command is killed");
    assert_eq!(status.code(), Some(128 + libc::SIGKILL), "{status:?}");
    let log = arb.process_log();
    assert!(
        log.contains("killed") && log.contains("allowed 0"),
        "the kill names the card's limit of 0\n{log}"
    );
}

/// Runs `tessera <args>` (aimed at `arb`) whose command would create `marker`; returns the exit
/// code and stderr, after checking the command did not run and nothing was allocated.
fn refused_usage(arb: &Arbiter, args: &[&str], marker: &std::path::Path) -> (Option<i32>, String) {
    let out = arb.tessera(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !marker.exists(),
        "{args:?}: the command must not run\n{err}"
    );
    assert!(
        arb.admin().list().unwrap().is_empty(),
        "{args:?}: nothing allocated"
    );
    (out.status.code(), err)
}

#[test]
fn flags_after_the_command_need_the_double_dash_and_unknown_flags_exit_2() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let lib = lib.to_str().unwrap();
    let marker = arb.dir.path().join("ran");
    let m = marker.to_str().unwrap();
    // A misspelled flag (`--shares` for `--share`) is clap's error naming it, not the command.
    let (code, err) = refused_usage(
        &arb,
        &[
            "run",
            "--memory",
            "1GiB",
            "--shares",
            "30",
            "--interposer",
            lib,
            "--",
            "touch",
            m,
        ],
        &marker,
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("unexpected argument '--shares'"), "{err}");
    // A command without `--` is refused too: its words could be taken for flags.
    let (code, err) = refused_usage(
        &arb,
        &["run", "--memory", "1GiB", "--interposer", lib, "touch", m],
        &marker,
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("unexpected argument 'touch'"), "{err}");
    // `tessera sim` the same way.
    let (code, err) = refused_usage(&arb, &["sim", "--gpu", "1x4GiB", "--", "touch", m], &marker);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("unexpected argument '--gpu'"), "{err}");
    // With `--`, everything after it is the command, flags included.
    let out = arb
        .tessera(&[
            "run",
            "--memory",
            "1GiB",
            "--interposer",
            lib,
            "--",
            "sh",
            "-c",
        ])
        .arg(format!("touch {m}; echo \"$@\"", m = m))
        .args(["sh", "--shares", "30"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout(&out).trim(), "--shares 30");
    assert!(marker.exists());
}

#[test]
fn a_size_split_by_a_space_is_a_clear_error() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let marker = arb.dir.path().join("ran");
    let m = marker.to_str().unwrap();
    let (code, err) = refused_usage(
        &arb,
        &[
            "run",
            "--memory",
            "4",
            "GiB",
            "--interposer",
            lib.to_str().unwrap(),
            "--",
            "touch",
            m,
        ],
        &marker,
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("a size is one word, without a space: --memory 4GiB"),
        "{err}"
    );
    let (code, err) = refused_usage(
        &arb,
        &["sim", "--gpus", "1x4", "Gi", "--", "touch", m],
        &marker,
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--gpus 1x4Gi"), "{err}");
}

#[test]
fn sim_reads_sizes_as_run_does() {
    let dir = tempfile::tempdir().unwrap();
    let lib_dir = tessera_testkit::artifact("libtessera_sim_cuda.so")
        .parent()
        .unwrap()
        .to_owned();
    // `--gpus 1x4Gi` is accepted like `--memory 4Gi` (that both read 4 GiB is the
    // `sizes_read_as_tessera_run_reads_them` unit test of tessera-sim-state).
    let out = std::process::Command::new(tessera())
        .args(["sim", "--gpus", "1x4Gi", "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--lib-dir")
        .arg(&lib_dir)
        .args(["--", "sh", "-c", "echo \"$TESSERA_SIM_GPUS\""])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout(&out).trim(), "1x4Gi");
    let out = std::process::Command::new(tessera())
        .args(["sim", "--gpus", "1x4Zi", "--", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown unit \"Zi\""), "{err}");
}

#[test]
fn refusals_speak_human_units() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let out = arb
        .tessera(&["run", "--memory", "100TiB", "--interposer"])
        .arg(&lib)
        .args(["--", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(
        err.contains("memory limit 100 TiB exceeds GPU 0's 80 GiB"),
        "{err}"
    );
    // And the arbiter's log says it so too: the GPU as people name it, sizes in units.
    let line =
        "refused to create an allocation on GPU 0: memory limit 100 TiB exceeds GPU 0's 80 GiB";
    let logged = tessera_testkit::wait_until(std::time::Duration::from_secs(5), || {
        arb.process_log().contains(line)
    });
    let log = arb.process_log();
    assert!(logged.is_some(), "{log}");
    assert!(!log.contains("Index(") && !log.contains(" bytes"), "{log}");
}

/// A group of GPUs has no tier: `--tier latency` on two GPUs is refused before anything is
/// created, never run best-effort behind the operator's back.
#[test]
fn a_latency_tier_on_several_gpus_is_refused() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let marker = arb.dir.path().join("ran");
    let m = marker.to_str().unwrap();
    let (code, err) = refused_usage(
        &arb,
        &[
            "run",
            "--gpu",
            "0,1",
            "--memory",
            "1GiB",
            "--tier",
            "latency",
            "--interposer",
            lib.to_str().unwrap(),
            "--",
            "touch",
            m,
        ],
        &marker,
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--tier latency takes one GPU"), "{err}");
}

/// A process the backstop kills is explained on `tessera run`'s stderr, in the arbiter's
/// words: a command that drops the interposer (`env -u LD_PRELOAD`) takes 2 GiB under a 1 GiB
/// limit straight from the (simulated) driver; the backstop kills it and `tessera run` says
/// so, not just exit 137.
#[test]
fn a_backstop_kill_is_explained_on_stderr() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sim_visible.py");
    let mut cmd = arb.tessera(&["run", "--memory", "1GiB", "--interposer"]);
    cmd.arg(&lib)
        .args(["--", "env", "-u", "LD_PRELOAD"])
        .arg(tessera_testkit::python())
        .arg(&script)
        .args(["2048", "1000000"]);
    arb.sim.apply(&mut cmd);
    // Its stdin stays open: the script holds its memory until it closes.
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _stdin = child.stdin.take();
    let status = tessera_testkit::process::wait_exit(&mut child, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("not killed\n{}", arb.process_log()));
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGKILL), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("tessera: the backstop killed pid "))
        .unwrap_or_else(|| panic!("no reason on stderr: {err}\n{}", arb.process_log()));
    assert!(
        line.contains(" on GPU 0, allowed 1.") && line.contains("held 2."),
        "{line}"
    );
}

/// A command that is not there exits 127, one that cannot be run 126, as in a shell; the
/// allocation is deleted either way.
#[test]
fn a_missing_command_exits_127_and_one_not_executable_126() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let not_exec = arb.dir.path().join("not-executable");
    std::fs::write(&not_exec, "#!/bin/sh\n").unwrap();
    for (cmd, code, words) in [
        ("/nonexistent/no-such-command", 127, "command not found"),
        (not_exec.to_str().unwrap(), 126, "permission denied"),
    ] {
        let out = arb
            .tessera(&["run", "--memory", "64MiB", "--interposer"])
            .arg(&lib)
            .args(["--", cmd])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{err}");
        assert!(err.contains(words), "{err}");
        assert!(arb.admin().list().unwrap().is_empty());
    }
    let out = std::process::Command::new(tessera())
        .args(["sim", "--", "/nonexistent/no-such-command"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(127),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_whole_card_allocation_gets_no_context_on_another_card() {
    // The interposer's half: a share-100 allocation of GPU 1 whose command turns to GPU 0 gets
    // nothing there: its session on that card is refused (the card's memory total reads 0 and
    // the context is CUDA_ERROR_OUT_OF_MEMORY), so the card never holds anything of it and
    // nothing needs killing.
    let arb = Arbiter::start();
    let mut cmd = whole_card_turning_to_gpu0(&arb, &[]);
    let out = arb.sim.apply(&mut cmd).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("arbiter refused this process") && err.contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{err}"
    );
    assert_eq!(
        tessera_sim_state::device_memory_used(&arb.sim.dir, 0).unwrap(),
        0
    );
    assert!(
        !arb.process_log().contains("backstop: pid"),
        "{}",
        arb.process_log()
    );
}
