//! How programs reach the driver: direct links, `dlsym` on the driver's handle, and
//! `cuGetProcAddress` (with per-thread variants), plus `dlsym(RTLD_NEXT)` staying exact for other
//! libraries. Small C programs are compiled with the system `cc`.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

fn c_source(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(name)
}

fn cc(args: &[&std::ffi::OsStr]) {
    let out = Command::new("cc")
        .args(args)
        .output()
        .expect("a C compiler (cc) is needed for these tests");
    assert!(
        out.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn parse(stdout: &str) -> HashMap<String, String> {
    stdout
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[test]
fn rtld_next_lookups_stay_relative_to_their_caller() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libnext.so");
    let exe = dir.path().join("next_main");
    cc(&[
        "-shared".as_ref(),
        "-fPIC".as_ref(),
        "-o".as_ref(),
        lib.as_os_str(),
        c_source("next_lib.c").as_os_str(),
        "-ldl".as_ref(),
    ]);
    let rpath = format!("-Wl,-rpath,{}", dir.path().display());
    let ldir = format!("-L{}", dir.path().display());
    cc(&[
        "-o".as_ref(),
        exe.as_os_str(),
        c_source("next_main.c").as_os_str(),
        ldir.as_ref(),
        "-lnext".as_ref(),
        rpath.as_ref(),
    ]);
    for token in [None, Some("some-token")] {
        let mut cmd = Command::new(&exe);
        cmd.env("LD_PRELOAD", interposer());
        match token {
            Some(t) => cmd.env("TESSERA_TOKEN", t),
            None => cmd.env_remove("TESSERA_TOKEN"),
        };
        let (st, out, err) = run(&mut cmd);
        assert!(st.success(), "{out}\n{err}");
        let kv = parse(&out);
        assert_eq!(
            kv["wrapped"], kv["real"],
            "RTLD_NEXT answered relative to the interposer: {out}"
        );
    }
}

/// `linked.c` built in the bed's folder against its `libcuda.so` (and `libdl`).
fn build_linked(bed: &Bed) -> std::path::PathBuf {
    let exe = bed.dir.path().join("linked");
    let ldir = format!("-L{}", bed.lib_dir.display());
    cc(&[
        "-o".as_ref(),
        exe.as_os_str(),
        c_source("linked.c").as_os_str(),
        ldir.as_ref(),
        "-lcuda".as_ref(),
        "-ldl".as_ref(),
    ]);
    exe
}

#[test]
fn linked_programs_dlsym_and_cu_get_proc_address_are_all_hooked() {
    let bed = Bed::new();
    let (token, id) = bed.create(GIB);
    let exe = build_linked(&bed);

    let (st, out, err) = run(&mut bed.tenant_command(&exe, &token));
    assert!(st.success(), "{out}\n{err}");
    let kv = parse(&out);
    let get = |k: &str| {
        kv.get(k)
            .unwrap_or_else(|| panic!("{k} missing in:\n{out}\n{err}"))
            .as_str()
    };
    assert_eq!(get("direct_first"), "0");
    assert_eq!(
        get("direct_second"),
        "2",
        "an exported cuMemAlloc_v2 is counted"
    );
    assert_eq!(
        get("direct_null_out"),
        "1",
        "a null out-pointer is the driver's INVALID_VALUE"
    );
    assert_eq!(get("dlsym_free"), "interposer");
    assert_eq!(
        get("dlsym_unhooked"),
        "driver",
        "unhooked names resolve to the driver"
    );
    assert_eq!(get("dlsym_missing"), "null");
    assert_eq!(get("gpa_async"), "0,interposer");
    assert_eq!(
        get("gpa_async_name"),
        "cuMemAllocAsync_ptsz",
        "flag 2 selects the _ptsz wrapper"
    );
    assert_eq!(
        get("gpa_legacy_name"),
        "cuMemAllocAsync",
        "flag 1 selects the legacy wrapper"
    );
    assert_eq!(get("gpa_async_over_limit"), "2");
    assert_eq!(
        get("gpa_self"),
        "interposer",
        "cuGetProcAddress itself is wrapped"
    );
    assert_eq!(
        get("gpa_via_wrapper"),
        "interposer",
        "look-ups through the wrapper stay hooked"
    );
    assert_eq!(get("free_first"), "0");
    assert_eq!(get("gpa_async_after_free"), "0");
    assert_eq!(get("free_async"), "0");
    assert_eq!(get("via_wrapper_first"), "0");
    assert_eq!(
        get("via_wrapper_second"),
        "2",
        "cuMemAlloc_v2 resolved through the wrapper is counted"
    );
    assert_eq!(get("via_wrapper_free"), "0");
    // The arbiter sees the exit as its socket closing, a moment after `wait` returns.
    wait_until(Duration::from_secs(30), || bed.used(&id) == 0)
        .expect("ledger back to zero after exit");

    // Without a token: dlsym hands out the real functions and nothing is counted. (The
    // simulated driver's own cuGetProcAddress table may point at our exports, because a
    // preloaded library interposes its internal references; those pass straight through.)
    let mut cmd = bed.sim_command(&exe);
    cmd.env("LD_PRELOAD", interposer());
    let (st, out, err) = run(&mut cmd);
    assert!(st.success(), "{out}\n{err}");
    let kv = parse(&out);
    assert_eq!(kv["direct_second"], "0");
    assert_eq!(kv["dlsym_free"], "driver");
    assert_eq!(kv["gpa_async_over_limit"], "0");
    assert_eq!(kv["via_wrapper_second"], "0");
}

#[test]
fn the_interposer_is_never_taken_for_the_real_driver() {
    // TESSERA_REAL_LIBCUDA pointing at the interposer must not make hooks call themselves.
    let bed = Bed::new();
    let (token, _) = bed.create(GIB);
    let exe = build_linked(&bed);
    let mut cmd = bed.tenant_command(&exe, &token);
    cmd.env("TESSERA_REAL_LIBCUDA", interposer());
    let (st, out, err) = run(&mut cmd);
    // cuInit itself is the driver's (not hooked); cuDevicePrimaryCtxRetain is hooked (contexts
    // count against the limit), so it finds no real driver and fails cleanly
    // (CUDA_ERROR_NOT_INITIALIZED) instead of recursing: the program reports a failed set-up.
    assert!(err.contains("resolves to the interposer itself"), "{err}");
    let kv = parse(&out);
    assert_eq!(
        kv.get("setup").map(String::as_str),
        Some("failed"),
        "{out}\n{err} ({st})"
    );
    assert_eq!(st.code(), Some(1), "a clean exit, no crash: {st}");
}
