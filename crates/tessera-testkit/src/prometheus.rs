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

/// The metric names `docs/metrics.md` documents (every `` `tessera_...` `` in it) that start
/// with one of `prefixes`.
pub fn documented_names(doc: &str, prefixes: &[&str]) -> std::collections::BTreeSet<String> {
    doc.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                && prefixes.iter().any(|p| s.starts_with(p))
        })
        .map(str::to_owned)
        .collect()
}

/// True when the exposition `text` has a sample of metric `name` (for a histogram, of its
/// `_bucket`, `_sum` or `_count` series).
pub fn exposes(text: &str, name: &str) -> bool {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .any(|series| {
            series == name
                || ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| series.strip_suffix(s) == Some(name))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_names_and_exposed_series() {
        let doc =
            "| `tessera_a_total` | x `tessera_b_seconds` `other_c` `tessera_a_total{x=\"1\"}`";
        let names = documented_names(doc, &["tessera_"]);
        assert_eq!(
            names.into_iter().collect::<Vec<_>>(),
            ["tessera_a_total", "tessera_b_seconds"]
        );
        let text = "# TYPE tessera_a_total counter\ntessera_a_total 3\n\
                    tessera_b_seconds_bucket{le=\"1\"} 1\n";
        assert!(exposes(text, "tessera_a_total"));
        assert!(exposes(text, "tessera_b_seconds"));
        assert!(!exposes(text, "tessera_a"));
        assert!(!exposes(text, "tessera_c"));
    }
}
