//! `tessera doctor` on the simulated GPU against the real arbiter: a healthy setup, then one
//! test per failure it reports, each checking the verdict line, the fix and exit code 1.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::run_support::*;
use tessera_testkit::{KillOnDrop, allocation, artifact, wait_until};

/// `tessera doctor ARGS` on the arbiter's simulated GPUs, with nothing inherited that would
/// change what it checks (no token, every GPU visible, and as the preload list the file
/// `ld.so.preload` in the test's folder instead of this host's: absent unless a test writes it).
fn doctor(arb: &Arbiter, args: &[&str]) -> Command {
    let mut c = arb.tessera(&["doctor"]);
    c.arg("--ld-so-preload")
        .arg(arb.dir.path().join("ld.so.preload"))
        .args(args)
        .env_remove("TESSERA_TOKEN")
        .env_remove("CUDA_VISIBLE_DEVICES");
    arb.sim.apply(&mut c);
    c
}

fn run(c: &mut Command) -> (Option<i32>, String) {
    let out: Output = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// The checklist line of check `name`, with the fix line under it when there is one.
fn verdict<'t>(text: &'t str, name: &str) -> (&'t str, Option<&'t str>) {
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        if l.split_whitespace().nth(1) == Some(name) {
            let fix = lines
                .next()
                .map(str::trim)
                .filter(|f| f.starts_with("fix: "));
            return (l, fix);
        }
    }
    panic!("no {name} line in:\n{text}");
}

/// Asserts check `name` failed with a detail and fix containing the given texts.
fn assert_fails(text: &str, name: &str, detail: &str, fix: &str) {
    let (line, fix_line) = verdict(text, name);
    assert!(line.starts_with("FAIL"), "{name} should fail:\n{text}");
    assert!(
        line.contains(detail),
        "{name} detail lacks {detail:?}:\n{text}"
    );
    let fix_line = fix_line.unwrap_or_else(|| panic!("no fix under {name}:\n{text}"));
    assert!(fix_line.contains(fix), "{name} fix lacks {fix:?}:\n{text}");
}

fn token_on(arb: &Arbiter, gpu: u32, limit: u64) -> String {
    arb.admin()
        .create(allocation(gpu, limit, 30, None))
        .unwrap()
        .0
}

#[test]
fn healthy_container_passes_every_check() {
    let arb = Arbiter::start();
    let interposer = interposer_in(arb.dir.path());
    let token = token_on(&arb, 0, 4 * GIB);
    // The container's view, as the device plugin mounts it: the identity file names the token
    // and socket, ld.so.preload names the interposer.
    let identity = arb.dir.path().join("tenant");
    std::fs::write(
        &identity,
        format!("token={token}\nsocket={}\n", arb.socket.display()),
    )
    .unwrap();
    let preload = arb.dir.path().join("ld.so.preload");
    std::fs::write(&preload, format!("{}\n", interposer.display())).unwrap();
    let (code, text) = run(doctor(&arb, &["--identity-file"])
        .arg(&identity)
        .env("TESSERA_SOCKET", "/nonexistent/the-identity-file-wins.sock")
        .env("CUDA_VISIBLE_DEVICES", gpu_uuid(0)));
    assert_eq!(code, Some(0), "{text}");
    for name in [
        "driver",
        "nvml",
        "arbiter",
        "admin",
        "interposer",
        "preload",
        "token",
        "gpu",
        "limit",
        "memory-info",
        "kernel",
    ] {
        assert!(verdict(&text, name).0.starts_with("ok"), "{name}:\n{text}");
    }
    // The probe's context (300 MiB) comes out of the limit: three 1 GiB blocks fit, not four.
    assert!(
        verdict(&text, "limit")
            .0
            .contains("at 3.00 GiB held of the 4.00 GiB limit"),
        "{text}"
    );
    assert!(text.ends_with("11 ok, 0 failed, 0 skipped\n"), "{text}");
    // The probe's memory went with the probe.
    let freed = wait_until(Duration::from_secs(10), || {
        arb.admin().list().unwrap()[0].memory_used == 0
    });
    assert!(freed.is_some(), "{:?}", arb.admin().list());
}

#[test]
fn json_has_every_check_and_no_allocation_skips_the_probe() {
    let arb = Arbiter::start();
    let interposer = interposer_in(arb.dir.path());
    let out = doctor(&arb, &["--json", "--interposer"])
        .arg(&interposer)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], true);
    let checks = v["checks"].as_array().unwrap();
    assert_eq!(checks.len(), 11, "{v}");
    for c in checks {
        assert!(c["name"].is_string() && c["detail"].is_string(), "{c}");
        assert!(c["fix"].is_null(), "{c}");
    }
    let status = |n: &str| checks.iter().find(|c| c["name"] == n).unwrap()["status"].clone();
    assert_eq!(status("arbiter"), "ok");
    assert_eq!(status("token"), "skip");
    assert_eq!(status("limit"), "skip");
    // The check is no failed handshake: after one admin hello on the tenant socket (what the
    // check used to send, a failure), the arbiter's report counts exactly that one.
    let mut s = std::os::unix::net::UnixStream::connect(&arb.socket).unwrap();
    tessera_protocol::frame::write_frame(
        &mut s,
        &tessera_protocol::Hello::new(tessera_protocol::Role::Admin),
    )
    .unwrap();
    let reported = tessera_testkit::wait_until(std::time::Duration::from_secs(20), || {
        arb.process_log().contains("admission on the tenant socket")
    });
    let log = arb.process_log();
    assert!(reported.is_some(), "{log}");
    assert!(
        log.contains("failed 1;"),
        "the doctor's probe counted as a failure\n{log}"
    );
}

#[test]
fn arbiter_down() {
    let arb = Arbiter::start();
    let interposer = interposer_in(arb.dir.path());
    let gone = arb.dir.path().join("gone.sock");
    let (code, text) = run(doctor(&arb, &["--token", "t", "--socket"])
        .arg(&gone)
        .arg("--interposer")
        .arg(&interposer));
    assert_eq!(code, Some(1), "{text}");
    assert_fails(
        &text,
        "arbiter",
        "cannot connect to",
        "start tessera-arbiter",
    );
    assert!(verdict(&text, "token").0.starts_with("skip"), "{text}");
}

#[test]
fn interposer_not_loadable() {
    let arb = Arbiter::start();
    let token = token_on(&arb, 0, 2 * GIB);
    let (code, text) = run(&mut doctor(
        &arb,
        &["--token", &token, "--interposer", "/bin/true"],
    ));
    assert_eq!(code, Some(1), "{text}");
    assert_fails(
        &text,
        "interposer",
        "/bin/true does not load as a shared library",
        "point --interposer (or TESSERA_INTERPOSER) at libtessera_interpose.so",
    );
    assert!(verdict(&text, "limit").0.starts_with("skip"), "{text}");
}

#[test]
fn a_cuda_driver_library_or_libc_is_not_the_interposer() {
    let arb = Arbiter::start();
    let token = token_on(&arb, 0, 2 * GIB);
    let libc_so = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("libc.so.6");
    let libcuda = artifact("libtessera_sim_cuda.so");
    for (file, why) in [
        (libcuda.display().to_string(), "its dlsym is defined by"),
        (libc_so.to_owned(), "it does not export cuMemAlloc_v2"),
    ] {
        let (code, text) = run(&mut doctor(
            &arb,
            &["--token", &token, "--interposer", &file],
        ));
        assert_eq!(code, Some(1), "{file}: {text}");
        assert_fails(
            &text,
            "interposer",
            &format!("is not the Tessera interposer: {why}"),
            "point --interposer (or TESSERA_INTERPOSER) at libtessera_interpose.so",
        );
        assert!(!text.contains("exports its hooks"), "{text}");
    }
    // The real one passes, and says why.
    let interposer = interposer_in(arb.dir.path());
    let (_, text) = run(doctor(&arb, &["--token", &token, "--interposer"]).arg(&interposer));
    assert!(verdict(&text, "interposer").0.starts_with("ok"), "{text}");
    assert!(
        text.contains("defines its hooks and the Tessera marker"),
        "{text}"
    );
}

#[test]
fn wrong_gpu_visible() {
    let arb = Arbiter::start();
    let interposer = interposer_in(arb.dir.path());
    let token = token_on(&arb, 1, 2 * GIB);
    let (code, text) = run(doctor(&arb, &["--token", &token, "--interposer"])
        .arg(&interposer)
        .env("CUDA_VISIBLE_DEVICES", "0"));
    assert_eq!(code, Some(1), "{text}");
    assert_fails(
        &text,
        "gpu",
        &format!(
            "CUDA device 0 is {}, but the allocation is on {}",
            gpu_uuid(0),
            gpu_uuid(1)
        ),
        &format!("CUDA_VISIBLE_DEVICES={}", gpu_uuid(1)),
    );
}

#[test]
fn token_refused() {
    let arb = Arbiter::start();
    let interposer = interposer_in(arb.dir.path());
    token_on(&arb, 0, 2 * GIB);
    let forged = "0".repeat(64);
    let (code, text) = run(doctor(&arb, &["--token", &forged, "--interposer"]).arg(&interposer));
    assert_eq!(code, Some(1), "{text}");
    assert_fails(
        &text,
        "token",
        "refused by the arbiter (unknown_token): unknown allocation token",
        "the allocation is gone or the token is wrong",
    );
    assert!(verdict(&text, "limit").0.starts_with("skip"), "{text}");
}

/// The limit is not what stops allocations when the card has less free memory than the
/// arbiter promised: here a process outside Tessera (no interposer, no token, so the arbiter
/// does not know it) holds 76 of GPU 0's 80 GiB, and an 8 GiB allocation is refused by the
/// card at 3 GiB. A program sized by its 8 GiB (which cuMemGetInfo still reports) fails; the
/// doctor says the limit is not in effect and where the memory went.
#[test]
fn limit_not_in_effect_when_the_card_runs_out_first() {
    let arb = Arbiter::start();
    let interposer = interposer_in(arb.dir.path());
    let mut outsider = Command::new(artifact("tenant"));
    outsider
        .args(["--name", "outsider", "--grab-gib", "76", "--seconds", "120"])
        .env("CUDA_VISIBLE_DEVICES", "0")
        .env_remove("LD_PRELOAD")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    arb.sim.apply(&mut outsider);
    let mut child = outsider.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut outsider = KillOnDrop::new(child);
    let held = lines
        .find(|l| l.as_ref().is_ok_and(|l| l.contains("holds")))
        .unwrap()
        .unwrap();
    assert!(held.contains("holds 76 GiB"), "{held}");

    let token = token_on(&arb, 0, 8 * GIB);
    let (code, text) = run(doctor(&arb, &["--token", &token, "--interposer"]).arg(&interposer));
    outsider.kill_and_reap();
    assert_eq!(code, Some(1), "{text}");
    assert_fails(
        &text,
        "limit",
        "below the 8.00 GiB limit: the card ran out before the limit",
        "find what holds it outside Tessera",
    );
    // Everything else about the allocation is fine.
    for name in ["token", "gpu", "memory-info", "kernel"] {
        assert!(verdict(&text, name).0.starts_with("ok"), "{name}:\n{text}");
    }
}

#[test]
fn bad_usage_is_exit_2() {
    let arb = Arbiter::start();
    let missing = arb.dir.path().join("no-such-identity");
    let (code, text) = run(doctor(&arb, &["--identity-file"]).arg(&missing));
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("no such file"), "{text}");
    let (code, _) = run(&mut doctor(&arb, &["--no-such-flag"]));
    assert_eq!(code, Some(2));
    assert!(!Path::new(&missing).exists());
}
