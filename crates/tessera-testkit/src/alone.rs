//! A test run again in a process of its own, for the few that change what a process holds
//! once (the environment a library reads when it loads, a `dlopen`ed simulated NVML): the
//! integration tests of a crate share one binary (one link on CI, not one per file), so a
//! test may not assume it is alone in its process. Its body runs in a child: this test
//! binary, started again with `<name> --exact`, the environment given and [`ALONE_ENV`] set
//! to the name.

use std::ffi::OsStr;
use std::process::Command;

/// Set to a test's name in the process that runs it alone.
pub const ALONE_ENV: &str = "TESSERA_TEST_ALONE";

/// The test's name as libtest filters it: `module_path!()` without the crate (the test binary)
/// and the function's name, e.g. `sim_nvml::reads_devices`.
pub fn test_name(module_path: &str, function: &str) -> String {
    match module_path.split_once("::") {
        Some((_, inner)) => format!("{inner}::{function}"),
        None => function.to_owned(),
    }
}

/// True in the process of its own (run the body); in the test's first process, runs it there
/// with `env` added, panics with its output if it failed, and returns false (nothing more to
/// do).
#[track_caller]
pub fn alone(module_path: &str, function: &str, env: &[(&str, &OsStr)]) -> bool {
    let name = test_name(module_path, function);
    if std::env::var_os(ALONE_ENV).is_some_and(|v| v == name.as_str()) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(ALONE_ENV, &name)
        .envs(env.iter().copied())
        .output()
        .expect("the test binary runs again");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(
        out.status.success(),
        "{name}, run alone, failed ({}):\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    // A filter that matched nothing passes too: make sure the body ran.
    assert!(
        text(&out.stdout).contains("1 passed"),
        "{name} did not run alone (a wrong name?):\n{}",
        text(&out.stdout)
    );
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_the_path_inside_the_test_binary() {
        assert_eq!(test_name("it::sim_nvml", "reads"), "sim_nvml::reads");
        assert_eq!(test_name("it::a::b", "f"), "a::b::f");
        assert_eq!(test_name("frames", "f"), "f");
    }
}
