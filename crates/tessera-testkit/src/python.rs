//! The Python that runs the real `cuda-bindings` clients.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

/// Names the interpreter explicitly, ahead of the workspace's virtual environment.
pub const ENV_PYTHON: &str = "TESSERA_PYTHON";

/// `$TESSERA_PYTHON`, else `<workspace>/.venv/bin/python`. Panics (the test fails, it is never
/// skipped) with how to create the environment when neither exists.
#[track_caller]
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os(ENV_PYTHON) {
        return PathBuf::from(p);
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    assert!(
        p.exists(),
        "Python with cuda-bindings not found at {} (set {ENV_PYTHON} or create the venv: \
         python3 -m venv .venv && .venv/bin/pip install 'cuda-bindings==13.*')",
        p.display()
    );
    p
}
