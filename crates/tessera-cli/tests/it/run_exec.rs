//! `tessera run --exec`: the command becomes the allocation's owner (no wrapper process), and
//! the arbiter deletes the allocation once the command and its processes have ended.

use std::time::{Duration, Instant};

use crate::run_support::*;

/// Waits up to 10 s for the arbiter to list no allocation; false when one is still there.
fn all_deleted(arb: &Arbiter) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if arb.admin().list().unwrap().is_empty() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn exec_becomes_the_command_and_its_allocation_ends_with_it() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    // The shell prints its own pid and its parent's: with --exec it is the process this test
    // started (no `tessera` in between), and the allocation's owner.
    let script = r#"echo "pid=$$"; echo "ppid=$PPID"; echo "token=$TESSERA_TOKEN"; echo "admin=${TESSERA_ADMIN_SOCKET-unset}"; "$TESSERA_BIN" status --json --admin-socket "$ADMIN"; exit 7"#;
    let child = arb
        .tessera(&["run", "--exec", "--memory", "1GiB", "--interposer"])
        .arg(&lib)
        .args(["--", "sh", "-c", script])
        .env("TESSERA_BIN", tessera())
        .env("ADMIN", &arb.admin_socket)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = child.id();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{text}\n{err}");
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
            .to_owned()
    };
    assert_eq!(field("pid"), started.to_string(), "{text}");
    assert_eq!(field("ppid"), std::process::id().to_string(), "{text}");
    assert_eq!(field("token").len(), 64, "{text}");
    assert_eq!(field("admin"), "unset", "{text}");
    let json = &text[text.find('{').unwrap()..=text.rfind('}').unwrap()];
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    let a = &v["gpus"][0]["allocations"][0];
    assert_eq!(a["memory_limit"], GIB);
    assert_eq!(a["labels"]["pid"], started.to_string());
    // Nobody sent a Delete: the arbiter saw its owner go.
    assert!(all_deleted(&arb), "{:?}", arb.admin().list());
}

#[test]
fn exec_of_a_killed_command_and_of_a_missing_one_leaves_nothing() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let mut child = arb
        .tessera(&["run", "--exec", "--memory", "64MiB", "--interposer"])
        .arg(&lib)
        .args(["--", "sleep", "30"])
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while arb.admin().list().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "no allocation was created");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(all_deleted(&arb), "{:?}", arb.admin().list());

    // A command that cannot start: `tessera run` is still itself and deletes at once.
    let out = arb
        .tessera(&["run", "--exec", "--memory", "64MiB", "--interposer"])
        .arg(&lib)
        .args(["--", "/nonexistent/no-such-command"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(127), "{err}");
    assert!(err.contains("command not found"), "{err}");
    assert!(arb.admin().list().unwrap().is_empty());
}

/// Commands of `tessera run --exec` started one after another, each the moment the last one
/// exited, each asking for most of the GPU: every one finds the room the last one left. The
/// first is left unwaited (a zombie: exited, still in `/proc`), which must not keep its
/// allocation (it did, until its parent waited); the rest are waited for at once, and the next
/// create comes before the reaper's own task has run (a create refused for room looks at the
/// exited owners first: it was refused in 193 of 200 such runs).
#[test]
fn exec_commands_back_to_back_each_find_the_room_the_last_one_left() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let run = || {
        let mut c = arb.tessera(&["run", "--exec", "--memory", "60GiB", "--interposer"]);
        c.arg(&lib).args(["--", "true"]);
        c
    };
    let first = run().spawn().unwrap();
    let pid = first.id() as libc::pid_t;
    // SAFETY: a zeroed siginfo_t is a valid out-parameter; WNOWAIT leaves the child a zombie
    // (`first` still owns the wait).
    let rc = unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT,
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    for i in 0..20 {
        let out = run().output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "run {i} after the first: {err}\narbiter log:\n{}",
            arb.process_log()
        );
    }
    let mut first = first;
    assert!(first.wait().unwrap().success());
    assert!(all_deleted(&arb), "{:?}", arb.admin().list());
}
