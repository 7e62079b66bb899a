//! The arbiter's memory backstop, from a tenant that goes around the interposer: a child of a
//! connected process started without `LD_PRELOAD` (and without the token) takes device memory
//! on its own, or a connected process that reaches the real driver around the hooks (glibc's
//! own `dlsym`, a library loaded with `RTLD_DEEPBIND`, a second driver in a `dlmopen`
//! namespace; C clients in `tests/c/`). Truth is the simulated GPU's per-process memory (what
//! NVML reports), not the ledger.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tessera_testkit::trap::at_pid;

#[test]
fn a_child_that_goes_around_the_interposer_is_killed() {
    let bed = Bed::new();
    let (token, id) = bed.create(GIB);
    let mut parent = Served::start(bed.tenant_command(&python(), &token));
    // The parent connects (its first allocation) and stays honest.
    assert_eq!(parent.ask(&format!("alloc {}", 100 * MIB))["alloc"], 0);
    let spawned = parent.ask(&format!("spawn_bare {}", 4 * GIB));
    assert_eq!(
        spawned["child_alloc"], 0,
        "the bare child got its memory from the driver: {spawned}"
    );
    let child = spawned["child"].as_u64().unwrap() as u32;
    let t = Instant::now();
    // The card holds the bypass (unless the backstop was quicker than this look).
    assert!(
        bed.sim_used() >= 4 * GIB || !alive(child),
        "the card does not hold the bypass"
    );
    // How soon is a figure (the backstop polls every 250 ms), printed here, not bounded: a
    // loaded machine delays the poll, not the outcome.
    let killed = wait_until(Duration::from_secs(30), || !alive(child));
    let took = killed
        .unwrap_or_else(|| panic!("the bypassing child was not killed\n{}", bed.arbiter_log()));
    eprintln!(
        "bypass of 4 GiB under a 1 GiB limit: killed {took:?} after its allocation returned ({:?} in all)",
        t.elapsed()
    );
    wait_until(Duration::from_secs(30), || bed.sim_used() <= GIB)
        .expect("the card back under the limit");
    // The log line and the count follow the kill.
    let line = format!("pid {child} of allocation");
    wait_until(Duration::from_secs(30), || {
        bed.arbiter_log().contains(&line)
    })
    .unwrap_or_else(|| panic!("no log line\n{}", bed.arbiter_log()));
    let log = bed.arbiter_log();
    assert!(
        log.contains("killed") && log.contains("never connected"),
        "{log}"
    );
    wait_until(Duration::from_secs(30), || bed.status(&id).enforced == 1)
        .expect("counted for `tessera status`");
    // The honest parent is untouched and keeps working.
    assert_eq!(parent.ask(&format!("alloc {}", 100 * MIB))["alloc"], 0);
    assert!(parent.exit().success());
}

#[test]
fn in_report_mode_the_bypass_is_logged_and_left_running() {
    let bed = Bed::with_arbiter_args(&["--enforce", "report", "--backstop-interval-ms", "100"]);
    let (token, _id) = bed.create(GIB);
    let mut parent = Served::start(bed.tenant_command(&python(), &token));
    assert_eq!(parent.ask(&format!("alloc {}", 100 * MIB))["alloc"], 0);
    let spawned = parent.ask(&format!("spawn_bare {}", 2 * GIB));
    let child = spawned["child"].as_u64().unwrap() as u32;
    // Reported at every poll while the breach lasts: a second report means the backstop acted
    // on it again, and in report mode that leaves it running (no fixed wait for a kill that
    // may or may not come).
    let reported = wait_until(Duration::from_secs(30), || {
        bed.arbiter_log().matches("reported").count() >= 2
    });
    assert!(
        reported.is_some(),
        "not reported twice\n{}",
        bed.arbiter_log()
    );
    assert!(alive(child), "report mode must not kill");
    assert!(parent.exit().success());
}

#[test]
fn honest_processes_of_an_allocation_at_its_limit_are_never_touched() {
    // The default allowance: the limit plus one 64 MiB slack for the allocation, however many
    // processes it has. The contexts are inside the limit (the bed models a real card's 300 MiB
    // per context, which the interposer reserves).
    let bed = Bed::with_arbiter_args(&["--backstop-interval-ms", "50"]);
    assert_eq!(bed.context_bytes(), CONTEXT);
    let (token, id) = bed.create(GIB);
    // Two processes and a forked child fill the limit exactly, contexts included; the backstop
    // polls 20 times a second.
    let mut a = Served::start(bed.tenant_command(&python(), &token));
    let mut b = Served::start(bed.tenant_command(&python(), &token));
    assert_eq!(a.ask(&format!("alloc {}", 200 * MIB))["alloc"], 0);
    assert_eq!(b.ask(&format!("alloc {}", 200 * MIB))["alloc"], 0);
    let (forked, child) = a.fork_child(24 * MIB);
    assert_eq!(child["child_alloc"], 0, "{child}");
    assert_eq!(
        a.ask(&format!("alloc {}", MIB))["alloc"],
        2,
        "the limit is full"
    );
    // Three polls of the backstop at the full limit (a positive signal that it looked).
    bed.wait_backstop_polls(3);
    // The limit's allocations and the two contexts (the forked child uses its parent's): the
    // card holds exactly the limit.
    assert_eq!(bed.sim_used(), GIB);
    let done = a.ask(&format!(
        "release_child {} {}",
        forked["release_fd"], forked["forked"]
    ));
    assert_eq!(done["child_status"], 0, "the honest child was touched");
    assert!(a.exit().success());
    assert!(b.exit().success());
    assert!(
        !bed.arbiter_log().contains("backstop: pid"),
        "{}",
        bed.arbiter_log()
    );
    wait_until(Duration::from_secs(5), || bed.used(&id) == 0).expect("ledger back to zero");
}

/// Device memory the arbiter lets an allocation hold beyond its limit (its default
/// `--backstop-slack-mib`), whatever its number of processes.
const TOLERANCE: u64 = 64 * MIB;

/// Runs a C client of `tests/c/` that connects with a hooked 64 MiB allocation ("hooked 0") and
/// then takes memory around the interposer ("escaped 0") past a 1 GiB limit; asserts that the
/// backstop kills it within a second of the escape, that the card is back under the limit plus
/// the tolerance by then, and that the kill is logged and counted. `how` names the route.
fn an_escape_is_killed(bed: &Bed, id: &str, mut cmd: std::process::Command, how: &str) {
    let mut c = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let pid = c.id();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(c.stdout.take().unwrap()));
    let mut c = tessera_testkit::KillOnDrop::new(c);
    let mut line = || lines.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(line(), "hooked 0", "the hooked allocation connects it");
    assert_eq!(line(), "escaped 0", "the real driver gave it 4 GiB");
    let t = Instant::now();
    let status = c.wait().unwrap();
    let took = t.elapsed();
    eprintln!("escape through {how}: killed {took:?} after its allocation");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "{status:?}\n{}",
        bed.arbiter_log()
    );
    // NVML's truth once it is dead: a dead process's record is dead at once (how soon is
    // printed, not bounded).
    let back = wait_until(Duration::from_secs(30), || {
        bed.sim_used() <= GIB + TOLERANCE
    });
    back.expect("the card back under the limit plus the tolerance");
    eprintln!(
        "escape through {how}: killed and the card back {:?} after",
        t.elapsed()
    );
    wait_until(Duration::from_secs(30), || bed.status(id).enforced == 1).expect("counted");
    // The count comes before the kill, the log line after it: wait for the line.
    let line = format!("backstop: pid {pid} of allocation {id} killed");
    wait_until(Duration::from_secs(30), || {
        bed.arbiter_log().contains(&line)
    })
    .unwrap_or_else(|| panic!("no log line for the kill\n{}", bed.arbiter_log()));
    assert!(
        bed.arbiter_log().contains("it connected"),
        "{}",
        bed.arbiter_log()
    );
}

#[test]
fn a_connected_process_that_reaches_the_real_driver_through_glibc_dlsym_is_killed() {
    let bed = Bed::new();
    let (token, id) = bed.create(GIB);
    let exe = build_c(&bed, "escape");
    let mut cmd = bed.tenant_command(&exe, &token);
    cmd.arg("4096");
    an_escape_is_killed(&bed, &id, cmd, "glibc's dlsym");
}

#[test]
fn a_connected_process_that_makes_contexts_around_the_interposer_is_killed() {
    // Three unreserved contexts (900 MiB on the card) on top of its reserved one and 64 MiB:
    // 1.23 GiB, within the old 512 MiB-per-process tolerance, past the limit plus the slack.
    let bed = Bed::new();
    let (token, id) = bed.create(GIB);
    let exe = build_c(&bed, "ctx_escape");
    let mut cmd = bed.tenant_command(&exe, &token);
    cmd.arg("3");
    an_escape_is_killed(&bed, &id, cmd, "cuCtxCreate_v2 through glibc's dlsym");
}

#[test]
fn a_connected_process_whose_deepbind_library_calls_the_driver_is_killed() {
    let bed = Bed::new();
    let (token, id) = bed.create(GIB);
    let lib = build_c_lib(&bed, "deepbind_lib");
    let exe = build_c(&bed, "deepbind");
    let mut cmd = bed.tenant_command(&exe, &token);
    cmd.arg("4096").arg(&lib);
    an_escape_is_killed(&bed, &id, cmd, "a library loaded with RTLD_DEEPBIND");
}

#[test]
fn a_connected_process_with_a_second_driver_in_a_dlmopen_namespace_is_killed() {
    let bed = Bed::new();
    let (token, id) = bed.create(GIB);
    let exe = build_c(&bed, "dlmopen");
    let mut cmd = bed.tenant_command(&exe, &token);
    cmd.arg("4096");
    an_escape_is_killed(&bed, &id, cmd, "dlmopen(LM_ID_NEWLM)");
}

/// The pid-reuse trap (issue 20): a process of A connects with A's token, hands the connected
/// socket to its parent and exits; the connection stays open. Whatever process gets its pid
/// next must not be A's for the backstop: a host job holding 2 GiB, a host job running kernels,
/// and a neighbour B's honest process, each landing on the trap pid, are left alone (NVML and
/// their own survival as truth, nothing counted or charged to A), while a process A really
/// started is still A's (its bypass is killed).
#[test]
fn a_pid_kept_by_a_connection_whose_process_exited_attributes_nobody() {
    let bed = Bed::new();
    let (token_a, a) = bed.create(GIB);
    let (token_b, b) = bed.create(8 * GIB);
    // The trap, set by a process of A (its environment; it never uses CUDA itself).
    let trapper = tessera_testkit::trap::set(
        bed.tenant_command(&python(), &token_a),
        &bed.socket,
        &token_a,
    );
    assert!(trapper.answer > 0, "the arbiter answered the hello");
    let trap = trapper.pid;
    assert!(!alive(trap as u32), "the connecting child exited");
    assert_eq!(
        bed.status(&a).processes,
        1,
        "the handshake was admitted and its connection is still open"
    );

    // A host job outside Tessera gets the pid and takes 2 GiB.
    let mut host = at_pid(trap, || {
        let s = Served::start(bed.sim_command(&python()));
        let pid = s.pid;
        (s, pid)
    });
    assert_eq!(host.ask(&format!("alloc {}", 2 * GIB))["alloc"], 0);
    assert!(
        bed.sim_used() >= 2 * GIB,
        "the card holds the host job's memory"
    );
    // The backstop sees it for what it is (an unknown host process, reported after its grace
    // period, polls later) and leaves it running.
    let seen = format!("unknown host process {trap} reported");
    wait_until(Duration::from_secs(5), || bed.arbiter_log().contains(&seen))
        .unwrap_or_else(|| panic!("not seen as a host process\n{}", bed.arbiter_log()));
    assert!(
        alive(trap as u32),
        "the host job was killed\n{}",
        bed.arbiter_log()
    );
    assert_eq!(
        host.ask("info")["device_total"].as_u64().map(|t| t > 0),
        Some(true)
    );
    assert!(host.exit().success());
    assert_eq!(bed.status(&a).enforced, 0, "{}", bed.arbiter_log());

    // A host job running only kernels gets the pid: nothing of its GPU time is A's.
    let mut compute = at_pid(trap, || {
        let mut c = bed.sim_command(&python());
        c.arg(script("compute_client.py"))
            .args(["sync", "2", "20"])
            .stdout(std::process::Stdio::piped());
        let child = tessera_testkit::KillOnDrop::new(c.spawn().unwrap());
        let pid = child.id() as i32;
        (child, pid)
    });
    let status = tessera_testkit::process::wait_exit(&mut compute, Duration::from_secs(60))
        .expect("the kernel job ends");
    assert!(status.success(), "{status:?}\n{}", bed.arbiter_log());
    let a_now = bed.status(&a);
    assert_eq!(
        (a_now.enforced, a_now.gpu_time_total_ns),
        (0, 0),
        "A was charged for the host job's kernels\n{}",
        bed.arbiter_log()
    );
    // It ran 1 s of kernels or more (20 ms each) over 2 s, eight polls and more: past the
    // compute rule's threshold (500 ms of unleased time) had it been A's.
    let mut out = String::new();
    std::io::Read::read_to_string(&mut compute.stdout.take().unwrap(), &mut out).unwrap();
    let launches = last_json(&out, "")["launches"].as_u64().unwrap();
    assert!(launches >= 50, "{out}");

    // B's honest process gets the pid and takes 2 GiB of its 8: it is B's, and nobody's killed.
    let mut honest = at_pid(trap, || {
        let s = Served::start(bed.tenant_command(&python(), &token_b));
        let pid = s.pid;
        (s, pid)
    });
    assert_eq!(honest.ask(&format!("alloc {}", 2 * GIB))["alloc"], 0);
    assert!(bed.used(&b) >= 2 * GIB);
    // Polls later (a host process started now is reported only after a second of them), B's
    // process is alive and untouched.
    let mut marker = Served::start(bed.sim_command(&python()));
    assert_eq!(marker.ask(&format!("alloc {}", 10 * MIB))["alloc"], 0);
    let marked = format!("unknown host process {} reported", marker.pid);
    wait_until(Duration::from_secs(5), || {
        bed.arbiter_log().contains(&marked)
    })
    .unwrap_or_else(|| panic!("the marker was never seen\n{}", bed.arbiter_log()));
    assert_eq!(honest.ask(&format!("alloc {}", 10 * MIB))["alloc"], 0);
    assert_eq!((bed.status(&a).enforced, bed.status(&b).enforced), (0, 0));
    assert!(honest.exit().success());
    assert!(marker.exit().success());

    // A's own process, with the trap still set, is A's: its bypass is killed.
    let mut parent = Served::start(bed.tenant_command(&python(), &token_a));
    assert_eq!(parent.ask(&format!("alloc {}", 100 * MIB))["alloc"], 0);
    let child = parent.ask(&format!("spawn_bare {}", 4 * GIB))["child"]
        .as_u64()
        .unwrap() as u32;
    wait_until(Duration::from_secs(3), || !alive(child))
        .unwrap_or_else(|| panic!("A's bypass was not killed\n{}", bed.arbiter_log()));
    assert_eq!(bed.status(&a).enforced, 1);
    assert!(parent.exit().success());
    trapper.release();
}

#[test]
fn an_mps_server_that_belongs_to_no_allocation_is_left_alone_where_unknown_processes_die() {
    // Issue 35: NVIDIA's MPS server holds GPU memory and belongs to no allocation; killing it
    // stops every MPS client on its GPU. Two processes outside any allocation, each in a mount
    // namespace of its own (a container, to the backstop) holding 2 GiB, under
    // `--unknown-processes kill`: `hold` is killed, the same program as
    // `nvidia-cuda-mps-server` is left alone and logged as an MPS daemon.
    let bed = Bed::with_arbiter_args(&[
        "--unknown-processes",
        "kill",
        "--host-mount-ns",
        "/proc/self/ns/mnt",
    ]);
    let hold = build_c(&bed, "hold");
    let server = bed.dir.path().join("nvidia-cuda-mps-server");
    std::fs::copy(&hold, &server).unwrap();
    let start = |exe: &std::path::Path| {
        let mut cmd = bed.sim_command(std::path::Path::new("unshare"));
        cmd.arg("-m")
            .arg(exe)
            .args(["2048", "60"])
            .stdout(std::process::Stdio::piped());
        let mut c = cmd.spawn().expect("unshare (util-linux) runs as root here");
        let mut out = std::io::BufReader::new(c.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line.trim(), "holding 0", "{}", exe.display());
        tessera_testkit::KillOnDrop::new(c)
    };
    let mut mps = start(&server);
    let mut other = start(&hold);
    let killed = wait_until(Duration::from_secs(30), || {
        other.try_wait().unwrap().is_some()
    });
    killed.unwrap_or_else(|| panic!("the unknown process lives\n{}", bed.arbiter_log()));
    // Polls after that one looked at the server too, and left it.
    bed.wait_backstop_polls(4);
    assert!(
        mps.try_wait().unwrap().is_none(),
        "the MPS server was stopped\n{}",
        bed.arbiter_log()
    );
    let log = bed.arbiter_log();
    assert!(log.contains("is an MPS daemon"), "{log}");
}
