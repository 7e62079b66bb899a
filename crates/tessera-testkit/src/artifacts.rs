//! Built artifacts next to the test executable.

#![forbid(unsafe_code)]

use std::path::PathBuf;

/// What to run when an artifact is missing (CI builds everything before testing).
pub const BUILD_HINT: &str = "run `cargo build --workspace --all-targets` first";

/// The profile folder cargo built into (`<target>/debug`, or `<target>/release` under `cargo
/// bench`): the running executable is `<profile>/deps/<name>-<hash>`.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running test executable's path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("the test executable lies in <profile>/deps/")
        .to_path_buf()
}

/// A built binary or library in [`target_dir`]; panics with [`BUILD_HINT`] when missing.
#[track_caller]
pub fn artifact(name: &str) -> PathBuf {
    artifact_with_hint(name, BUILD_HINT)
}

/// [`artifact`] with another hint (e.g. the release build a benchmark needs).
#[track_caller]
pub fn artifact_with_hint(name: &str, hint: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(p.exists(), "{} is missing: {hint}", p.display());
    p
}
