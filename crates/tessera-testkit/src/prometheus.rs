//! The Prometheus tools the metrics tests use (Debian's `prometheus` package). They are
//! required: a test that needs one fails with the install hint rather than skipping.

#![forbid(unsafe_code)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// How to get the tools on a fresh machine (`.ci/run` does it).
pub const INSTALL_HINT: &str =
    "install Debian's `prometheus` package (apt-get install prometheus), as .ci/run does";

/// `name` (`prometheus`, `promtool`) from `PATH` or `/usr/bin`; `TESSERA_PROMTOOL` overrides
/// promtool. Panics with [`INSTALL_HINT`] when it is missing.
pub fn tool(name: &str) -> PathBuf {
    if name == "promtool"
        && let Some(p) = std::env::var_os("TESSERA_PROMTOOL")
    {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "TESSERA_PROMTOOL={}: no such file",
            p.display()
        );
        return p;
    }
    let dirs = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&dirs)
        .chain([PathBuf::from("/usr/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("`{name}` not found: {INSTALL_HINT}"))
}

/// `promtool check metrics` on an exposition: panics unless it exits 0 and says nothing.
pub fn check_metrics(text: &str) {
    let promtool = tool("promtool");
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", promtool.display()));
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(text.as_bytes())
        .expect("promtool reads its input");
    let out = child.wait_with_output().expect("promtool ran");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}\n{text}"
    );
}
