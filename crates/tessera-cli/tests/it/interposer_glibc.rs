//! The shipped interposer is built against glibc 2.17 (`deploy/build-interposer.sh`, which the
//! Dockerfile runs): it must need no symbol version newer than `GLIBC_2.17`, so the loader of an
//! old image (Ubuntu 20.04, Debian 11, UBI 8: glibc 2.28-2.31) does not skip it; and it must
//! still do its work. The tests build it with the script (cargo-zigbuild and zig, which
//! `.ci/test` installs into `.venv`), in a target folder of its own.
//!
//! Also: the examples report a CUDA error by its name and exit 1, without a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use crate::run_support::{Arbiter, interposer_in};
use tessera_testkit::artifact;

/// The interposer as shipped: built once per test run by `deploy/build-interposer.sh`.
fn interposer_2_17() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let target = tessera_testkit::target_dir()
            .parent()
            .expect("the profile folder lies in the target folder")
            .join("glibc-2.17");
        let out = Command::new("bash")
            .arg(root.join("deploy/build-interposer.sh"))
            .arg("--target-dir")
            .arg(&target)
            .output()
            .expect("bash runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "deploy/build-interposer.sh failed ({}): {stderr}",
            out.status
        );
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).lines().last().unwrap());
        assert!(path.exists(), "{} not built: {stderr}", path.display());
        path
    })
}

/// The `GLIBC_x.y[.z]` versions `lib` requires (its ELF version references, `.gnu.version_r`,
/// as `objdump -p` prints them), whichever glibc library each comes from.
fn glibc_versions_needed(lib: &Path) -> Vec<Vec<u32>> {
    let out = Command::new("objdump")
        .arg("-p")
        .arg(lib)
        .output()
        .expect("objdump (binutils) runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let refs = text
        .split_once("Version References:")
        .unwrap_or_else(|| panic!("no version references in {}:\n{text}", lib.display()))
        .1;
    refs.split_whitespace()
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(|v| v.split('.').map(|n| n.parse().unwrap()).collect())
        .collect()
}

#[test]
fn the_shipped_interposer_needs_glibc_2_17_at_most() {
    let lib = interposer_2_17();
    let versions = glibc_versions_needed(lib);
    let highest = versions.iter().max().expect("it links glibc");
    assert_eq!(
        highest,
        &vec![2, 17],
        "highest GLIBC_ version needed: {versions:?}"
    );
    // The references to libdl and libpthread are there (before glibc 2.34 dlopen, dlvsym and
    // pthread_create lived in those), at their old versions.
    let out = Command::new("objdump").arg("-T").arg(lib).output().unwrap();
    let symbols = String::from_utf8_lossy(&out.stdout);
    for name in ["dlvsym", "dlopen", "pthread_create"] {
        let line = symbols
            .lines()
            .find(|l| l.ends_with(&format!(" {name}")) && l.contains("*UND*"))
            .unwrap_or_else(|| panic!("{name} not imported:\n{symbols}"));
        assert!(line.contains("(GLIBC_2.2.5)"), "{line}");
    }
    // And it is the build the image ships.
    let dockerfile = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/Dockerfile"),
    )
    .unwrap();
    assert!(
        dockerfile.contains("lib=\"$(TESSERA_VENV=/opt/zig deploy/build-interposer.sh)\"")
            && dockerfile.contains("cp \"$lib\" /out/lib/libtessera_interpose.so"),
        "deploy/Dockerfile must ship the glibc 2.17 build"
    );
    // The check can fail: the build machine's own build needs newer versions than 2.17 (when
    // its glibc is newer; this machine's is 2.34 or later, as every supported build image).
    let host = glibc_versions_needed(&artifact("libtessera_interpose.so"));
    assert!(
        host.iter().max() > Some(&vec![2, 17]),
        "a host build needs only {host:?}: is the build machine's glibc older than 2.18?"
    );
}

/// `hello_gpu` (it allocates 40 GiB) under `tessera run --memory 1GiB` with `interposer`.
fn hello_gpu_under_a_1gib_limit(arb: &Arbiter, interposer: &Path) -> Output {
    let mut cmd = arb.tessera(&["run", "--memory", "1GiB", "--interposer"]);
    cmd.arg(interposer).arg("--").arg(artifact("hello_gpu"));
    arb.sim.apply(&mut cmd).output().unwrap()
}

fn assert_refused_by_name(out: &Output, what: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // It saw the limit as its card (the interposer's hooks ran), then its allocation was refused.
    assert!(
        stdout.contains("GPU 0: Tessera Sim GPU 80GiB, 1 GiB"),
        "{what}: {stdout}{stderr}"
    );
    assert!(
        stderr.contains("hello_gpu: cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)"),
        "{what}: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
}

#[test]
fn the_glibc_2_17_interposer_holds_a_process_to_its_limit() {
    let arb = Arbiter::start();
    let out = hello_gpu_under_a_1gib_limit(&arb, interposer_2_17());
    assert_refused_by_name(&out, "glibc 2.17 build");
    assert!(arb.admin().list().unwrap().is_empty(), "allocation deleted");
}

#[test]
fn hello_gpu_names_the_cuda_error_under_a_limit_too_small_and_does_not_panic() {
    let arb = Arbiter::start();
    let lib = interposer_in(arb.dir.path());
    let out = hello_gpu_under_a_1gib_limit(&arb, &lib);
    assert_refused_by_name(&out, "host build");
}
