//! `.ci/doc_commands.py`, which `.ci/test` runs over README.md and docs/*.md: every shell block
//! is run on the simulated GPU or marked with what it needs, and an unmarked one fails. Here the
//! checker itself runs on small pages in a temporary folder (each rule shown to fail), and over
//! the real pages with `--list` (every block marked; running them is `.ci/test`'s step).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs the checker on `page` (written as `<dir>/page.md`, run from `dir`).
fn check(dir: &Path, page: &str, extra: &[&str]) -> (Output, String) {
    let file = dir.join("page.md");
    std::fs::write(&file, page).unwrap();
    let out = Command::new(tessera_testkit::python::python())
        .arg(crate::repo().join(".ci/doc_commands.py"))
        .arg("--root")
        .arg(dir)
        .args(extra)
        .arg(&file)
        .output()
        .expect("run .ci/doc_commands.py");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

#[test]
fn every_block_of_the_real_pages_is_marked() {
    let out = Command::new(tessera_testkit::python::python())
        .arg(crate::repo().join(".ci/doc_commands.py"))
        .arg("--list")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("FAILED"), "{text}");
    // The Kubernetes story is marked as needing a cluster, not silently left out.
    assert!(
        text.contains("docs/install.md") && text.contains("needs a real cluster"),
        "{text}"
    );
}

#[test]
fn an_unmarked_block_fails() {
    let dir = tempfile::tempdir().unwrap();
    let (out, text) = check(
        dir.path(),
        "# Page\n\n```sh\necho hi\n```\n\n```bash\necho there\n```\n",
        &["--list"],
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("page.md:3: a ```sh block without"), "{text}");
    assert!(
        text.contains("page.md:7: a ```bash block without"),
        "{text}"
    );
}

#[test]
fn runnable_blocks_run_in_one_session_and_a_failure_fails() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Two blocks share the shell: the second sees what the first exported.
    let page = "<!-- runs: simulated -->\n```sh\nexport GREETING=hi\n```\n\n\
                <!-- runs: simulated -->\n```sh\necho \"$GREETING\" > out.txt\n```\n\n\
                <!-- needs: a real cluster -->\n```sh\ntouch not-run.txt\n```\n";
    let (out, text) = check(d, page, &[]);
    assert!(out.status.success(), "{text}");
    assert_eq!(std::fs::read_to_string(d.join("out.txt")).unwrap(), "hi\n");
    assert!(!d.join("not-run.txt").exists(), "a `needs` block ran");
    assert!(text.contains("2 blocks ran"), "{text}");
    assert!(
        text.contains("not run here: page.md:12: needs a real cluster"),
        "{text}"
    );

    // A command that fails, and the doc does not say so.
    let (out, text) = check(
        d,
        "<!-- runs: simulated -->\n```sh\ntrue\nfalse\n```\n",
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("page.md: a block failed"), "{text}");
}

#[test]
fn a_command_the_doc_says_fails_must_fail_with_that_code() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (out, text) = check(
        d,
        "<!-- runs: simulated -->\n```sh\nsh -c 'exit 3' \\\n    && true   # refused (exit 3)\necho after > after.txt\n```\n",
        &[],
    );
    assert!(out.status.success(), "{text}");
    assert!(d.join("after.txt").exists(), "the block stopped early");
    let (out, text) = check(
        d,
        "<!-- runs: simulated -->\n```sh\nsh -c 'exit 2'   # refused (exit 3)\n```\n",
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("exited 2, the doc says 3"), "{text}");
}

#[test]
fn what_a_block_leaves_running_is_stopped_with_its_page() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (out, text) = check(
        d,
        "<!-- runs: simulated -->\n```sh\nsleep 300 &\necho $! > pid\n```\n",
        &[],
    );
    assert!(out.status.success(), "{text}");
    let pid = std::fs::read_to_string(d.join("pid")).unwrap();
    let proc_dir = PathBuf::from(format!("/proc/{}", pid.trim()));
    // Stopped (gone, or a zombie of an exited parent being reaped).
    let alive = std::fs::read_to_string(proc_dir.join("stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false);
    assert!(!alive, "sleep {} still runs", pid.trim());
}
