//! `tessera run` owns its process tree, and the allocation lives as long as its processes (the
//! real `tessera` CLI and arbiter on the simulated GPU): a process the command double-forks
//! away without `LD_PRELOAD` is held to the limit, a SIGKILLed `tessera run` leaves no
//! allocation once its command ends, and `tessera delete` refuses while processes live.
//! Truth: the simulated GPU's per-process memory, and the processes' own liveness.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tessera_testkit::{FirstLine, spawn_first_line};

fn tessera() -> PathBuf {
    artifact("tessera")
}

/// `tessera run --memory LIMIT` against the bed's arbiter, on the simulated GPU, with the
/// built interposer; `command` follows `--`.
fn tessera_run(bed: &Bed, limit: &str, command: &[&std::ffi::OsStr]) -> Command {
    let mut cmd = bed.sim_command(&tessera());
    cmd.args(["run", "--memory", limit, "--interposer"])
        .arg(interposer())
        .arg("--socket")
        .arg(&bed.socket)
        .arg("--admin-socket")
        .arg(&bed.admin_socket)
        .arg("--")
        .args(command);
    cmd
}

/// The only allocation the bed's arbiter holds (the one `tessera run` made).
fn only_allocation(bed: &Bed) -> Option<tessera_protocol::AllocationStatus> {
    let mut list = bed.admin().list().unwrap();
    assert!(list.len() <= 1, "{list:?}");
    list.pop()
}

#[test]
fn a_double_forked_grandchild_without_ld_preload_is_held_to_the_limit() {
    let bed = Bed::new();
    let out = bed.dir.path().join("grandchild.json");
    // The middle shell exits at once; the grandchild (reparented) drops LD_PRELOAD and takes
    // 4 GiB under a 1 GiB limit. Nothing of the allocation ever connects.
    let script = format!(
        "( sleep 5 | env -u LD_PRELOAD '{}' '{}' hold {} > '{}' & ); exit 0",
        python().display(),
        script("mem_client.py").display(),
        4 * GIB,
        out.display()
    );
    let run = tessera_run(
        &bed,
        "1GiB",
        &["sh".as_ref(), "-c".as_ref(), script.as_ref()],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    let mut run = tessera_testkit::KillOnDrop::new(run);
    let held = wait_until(Duration::from_secs(20), || {
        std::fs::read_to_string(&out).is_ok_and(|t| t.contains("held"))
    });
    held.unwrap_or_else(|| panic!("the grandchild never allocated\n{}", bed.arbiter_log()));
    let t = Instant::now();
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.contains("\"held\": 0"),
        "the driver refused it: {text}"
    );
    // Held to the limit: the card is back under limit + tolerance (how soon is printed).
    let back = wait_until(Duration::from_secs(30), || {
        bed.sim_used() <= GIB + 512 * MIB
    });
    let took = back.unwrap_or_else(|| {
        panic!(
            "the grandchild kept {} bytes\n{}",
            bed.sim_used(),
            bed.arbiter_log()
        )
    });
    eprintln!(
        "double-forked grandchild of 4 GiB under 1 GiB: gone {took:?} after its allocation ({:?} in all)",
        t.elapsed()
    );
    // The backstop logs its kill after sending the signal: wait for the line.
    let named = wait_until(Duration::from_secs(30), || {
        let log = bed.arbiter_log();
        log.contains("killed") && log.contains("never connected")
    });
    assert!(named.is_some(), "{}", bed.arbiter_log());
    // `tessera run` waits for what it left behind, then deletes the allocation.
    let status = run.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(only_allocation(&bed).is_none());
}

#[test]
fn a_command_run_with_env_u_ld_preload_is_held_to_the_limit() {
    let bed = Bed::new();
    let (py, client) = (python(), script("mem_client.py"));
    let bytes = (4 * GIB).to_string();
    let command: [&std::ffi::OsStr; 7] = [
        "env".as_ref(),
        "-u".as_ref(),
        "LD_PRELOAD".as_ref(),
        py.as_ref(),
        client.as_ref(),
        "hold".as_ref(),
        bytes.as_ref(),
    ];
    let FirstLine {
        child: mut run,
        stdin: _stdin,
        line: first,
    } = spawn_first_line(tessera_run(&bed, "1GiB", &command).stdin(Stdio::piped()));
    let t = Instant::now();
    assert!(
        first.contains("\"held\": 0"),
        "the driver refused it: {first:?}"
    );
    killed_by_the_backstop(&bed, &mut run, t);
}

#[test]
fn a_dlmopen_first_process_under_tessera_run_is_held_to_the_limit() {
    let bed = Bed::new();
    let exe = build_c(&bed, "dlmopen");
    let FirstLine {
        child: mut run,
        line: first,
        ..
    } = spawn_first_line(
        tessera_run(&bed, "1GiB", &[exe.as_os_str(), "4096".as_ref()])
            .env("DLMOPEN_FIRST", "1")
            .stdin(Stdio::null()),
    );
    let t = Instant::now();
    assert_eq!(first.trim(), "escaped 0", "the second driver gave it 4 GiB");
    assert!(
        only_allocation(&bed).is_some_and(|a| a.processes == 0),
        "it never connected"
    );
    killed_by_the_backstop(&bed, &mut run, t);
}

/// The command under `run`, which got memory past the interposer, is killed by the backstop:
/// its memory goes back to the card, `tessera run` passes 128 + SIGKILL through, and the
/// allocation is gone. How long the kill took after `since` is printed, not bounded (a loaded
/// machine makes it slow; the backstop's interval, 250 ms, is what sets it).
fn killed_by_the_backstop(bed: &Bed, run: &mut tessera_testkit::KillOnDrop, since: Instant) {
    let back = wait_until(Duration::from_secs(30), || {
        bed.sim_used() <= GIB + 512 * MIB
    });
    back.unwrap_or_else(|| panic!("it kept {} bytes\n{}", bed.sim_used(), bed.arbiter_log()));
    eprintln!("killed and its memory back {:?} after", since.elapsed());
    assert_eq!(run.wait().unwrap().code(), Some(128 + 9));
    assert!(only_allocation(bed).is_none());
}

#[test]
fn a_sigkilled_tessera_run_leaves_no_allocation_once_its_command_ends() {
    let bed = Bed::new();
    let cmd = tessera_run(&bed, "1GiB", &[python().as_os_str()]);
    let mut tenant = Served::start(cmd);
    assert_eq!(tenant.ask(&format!("alloc {}", 100 * MIB))["alloc"], 0);
    let a = only_allocation(&bed).expect("tessera run's allocation");
    assert_eq!((a.processes, a.orphaned), (1, false));
    let owner = a.owner.expect("owned by tessera run");
    assert_eq!(owner.pid as u32, tenant.child.id());
    // SIGKILL: `tessera run` cleans nothing up itself.
    tenant.child.kill().unwrap();
    tenant.child.wait().unwrap();
    // Its command lives on (connected): the allocation stays, shown as orphaned.
    let orphaned = wait_until(Duration::from_secs(3), || {
        only_allocation(&bed).is_some_and(|a| a.orphaned)
    });
    orphaned.expect("never shown as orphaned");
    assert!(alive(tenant.pid as u32));
    let shown = Command::new(tessera())
        .args(["status", "--admin-socket"])
        .arg(&bed.admin_socket)
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(shown.contains(&format!("ORPHANED {}", a.id)), "{shown}");
    assert_eq!(tenant.ask(&format!("alloc {}", 100 * MIB))["alloc"], 0);
    // (Reserved: the two allocations, and the credit the interposer holds on top.)
    assert!(bed.used(&a.id) >= 200 * MIB);
    // The command ends: the allocation goes with it.
    let pid = tenant.pid as u32;
    tenant.exit();
    wait_until(Duration::from_secs(5), || !alive(pid)).expect("the command never ended");
    let gone = wait_until(Duration::from_secs(3), || only_allocation(&bed).is_none());
    gone.unwrap_or_else(|| panic!("the allocation was left behind\n{}", bed.arbiter_log()));
    // The reaper logs why once the delete is done: the line may follow the list by a moment.
    let said = wait_until(Duration::from_secs(3), || {
        bed.arbiter_log().contains("its owner (pid")
    });
    said.unwrap_or_else(|| panic!("the reaper did not say why\n{}", bed.arbiter_log()));
}

#[test]
fn tessera_delete_refuses_while_processes_live_unless_forced() {
    let bed = Bed::new();
    let (token, id) = bed.create(GIB);
    let mut tenant = Served::start(bed.tenant_command(&python(), &token));
    assert_eq!(tenant.ask(&format!("alloc {}", 10 * MIB))["alloc"], 0);
    let delete = |force: bool| {
        let mut c = Command::new(tessera());
        c.args(["delete", &id, "--admin-socket"])
            .arg(&bed.admin_socket);
        if force {
            c.arg("--force");
        }
        run(&mut c)
    };
    let (status, _, err) = delete(false);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("1 connected process"), "{err}");
    assert_eq!(bed.status(&id).processes, 1, "still there");
    let (status, out, err) = delete(true);
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(out.contains(&format!("deleted allocation {id}")), "{out}");
    assert!(bed.admin().list().unwrap().is_empty());
    // A deleted allocation refuses more memory (beyond the credit the process holds).
    assert_eq!(tenant.ask(&format!("alloc {}", 512 * MIB))["alloc"], 2);
    assert!(tenant.exit().success());
    let (status, _, err) = delete(false);
    assert_eq!(status.code(), Some(1));
    assert!(err.contains("no allocation"), "{err}");
}
