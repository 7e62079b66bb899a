//! `deploy/systemd/tessera-arbiter.service` (the unit `tessera doctor` suggests starting):
//! systemd itself accepts it (`systemd-analyze verify`, with `ExecStart` aimed at the built
//! arbiter), the real arbiter accepts every flag it passes, and its paths are the defaults
//! `tessera run` and `tessera status` use, so they work against it without flags.

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_arbiter::{DEFAULT_ADMIN_SOCKET, DEFAULT_SOCKET, DEFAULT_STATE_DIR};

fn unit() -> (PathBuf, String) {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/systemd/tessera-arbiter.service");
    let text = std::fs::read_to_string(&p).unwrap();
    (p, text)
}

/// `ExecStart`'s words, its continuation lines joined.
fn exec_start(text: &str) -> Vec<String> {
    let joined = text.replace("\\\n", " ");
    let line = joined
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("an ExecStart line");
    line.split_whitespace().map(str::to_owned).collect()
}

#[test]
fn the_arbiter_accepts_every_flag_of_the_unit_and_its_paths_are_the_defaults() {
    let (_, text) = unit();
    let words = exec_start(&text);
    assert_eq!(words[0], "/usr/local/bin/tessera-arbiter");
    let flags = &words[1..];
    for (flag, want) in [
        ("--tenant-socket=", DEFAULT_SOCKET),
        ("--admin-socket=", DEFAULT_ADMIN_SOCKET),
        ("--state-dir=", DEFAULT_STATE_DIR),
    ] {
        assert!(
            flags.iter().any(|f| f.strip_prefix(flag) == Some(want)),
            "{flag}{want} in {flags:?}"
        );
    }
    // RuntimeDirectory/StateDirectory create exactly the folders those paths live in.
    assert!(
        text.contains("RuntimeDirectory=tessera\n") && DEFAULT_SOCKET.starts_with("/run/tessera/")
    );
    assert!(text.contains("StateDirectory=tessera\n") && DEFAULT_STATE_DIR == "/var/lib/tessera");
    // Clap parses (and checks the value of) each flag before it acts on --help: a misspelled
    // flag or a bad value exits 2 instead of 0.
    let out = Command::new(tessera_testkit::artifact("tessera-arbiter"))
        .args(flags)
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(tessera_testkit::artifact("tessera-arbiter"))
        .args(flags)
        .args(["--unknown-processes=maybe", "--help"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "a bad value is caught the same way"
    );
    // Unknown container processes are only reported unless the operator edits the unit.
    assert!(
        flags.contains(&"--unknown-processes=report".to_owned()),
        "{flags:?}"
    );
}

#[test]
fn systemd_accepts_the_unit() {
    let (_, text) = unit();
    let dir = tempfile::tempdir().unwrap();
    let arbiter = tessera_testkit::artifact("tessera-arbiter");
    let copy = dir.path().join("tessera-arbiter.service");
    std::fs::write(
        &copy,
        text.replace("/usr/local/bin/tessera-arbiter", arbiter.to_str().unwrap()),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .expect("systemd-analyze (package systemd; .ci/run installs it)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // verify exits 0 on some warnings: none may name the unit.
    assert!(!err.contains("tessera-arbiter.service:"), "{err}");
    // And it does fail on a broken unit (a misspelled directive), so the check can fail.
    std::fs::write(&copy, text.replace("ExecStart=", "ExecStartt=")).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() || err.contains("ExecStartt"),
        "a misspelled directive must be reported: {err}"
    );
}
