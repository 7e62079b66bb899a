//! The checklist: one verdict per check, the report, and its text form.

use super::*;

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Status {
    /// Passed.
    Ok,
    /// Failed: `fix` says what to do.
    Fail,
    /// Not applicable here, or its prerequisite failed.
    Skip,
}

/// One line of the checklist.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Check {
    /// Short stable name (`driver`, `arbiter`, ...).
    pub name: &'static str,
    /// Verdict.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about a failure.
    pub fix: Option<String>,
}

impl Check {
    pub(super) fn ok(name: &'static str, detail: impl Into<String>) -> Self {
        Self {
            name,
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }
    pub(super) fn fail(
        name: &'static str,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self {
            name,
            status: Status::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
    pub(super) fn skip(name: &'static str, detail: impl Into<String>) -> Self {
        Self {
            name,
            status: Status::Skip,
            detail: detail.into(),
            fix: None,
        }
    }
}

/// The whole report (`--json`).
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    /// True when no check failed.
    pub ok: bool,
    /// Every check, in order.
    pub checks: Vec<Check>,
}

/// The checklist for people.
pub(crate) fn render(r: &Report) -> String {
    let mut out = String::new();
    for c in &r.checks {
        let verdict = match c.status {
            Status::Ok => "ok",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        };
        out.push_str(&format!("{verdict:<5} {:<12} {}\n", c.name, c.detail));
        if let Some(fix) = &c.fix {
            out.push_str(&format!("{:<18} fix: {fix}\n", ""));
        }
    }
    let count = |s| r.checks.iter().filter(|c| c.status == s).count();
    out.push_str(&format!(
        "{} ok, {} failed, {} skipped\n",
        count(Status::Ok),
        count(Status::Fail),
        count(Status::Skip)
    ));
    out
}
