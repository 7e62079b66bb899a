//! The simulated driver's wider API surface through a real, unmodified client: NVIDIA's
//! `cuda-bindings` runs `tests/python/sim_surface.py SECTION` under the real `tessera sim`
//! binary, one section per test, each in its own state folder. The script checks each call's
//! result, bytes and memory accounting (exiting non-zero with the reason when one is wrong) and
//! prints measurements that the tests check again here, together with the shared state.

use std::path::Path;
use std::process::Command;

use tessera_testkit::python;

/// Runs one section on `gpus`; returns its JSON and the state folder (for the shared counters).
fn run(section: &str, gpus: &str) -> (serde_json::Value, tempfile::TempDir) {
    let state = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sim_surface.py");
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .arg("sim")
        .arg("--state-dir")
        .arg(state.path())
        .args(["--gpus", gpus, "--", "timeout", "60"])
        .arg(python())
        .arg(script)
        .arg(section)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "section {section} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("section {section} printed no JSON ({e}): {stdout}"));
    assert_eq!(v["section"], section);
    // Every section returns what it took: nothing stays charged once its process is gone.
    assert_eq!(
        tessera_sim_state::device_memory_used(state.path(), 0).unwrap(),
        0
    );
    (v, state)
}

fn f64_of(v: &serde_json::Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn vmm_maps_copies_and_accounts_through_create_and_release() {
    let (v, _state) = run("vmm", "1x80GiB");
    let gran = v["granularity"].as_u64().unwrap();
    assert_eq!(gran, 2 << 20);
    // Another process's cuMemGetInfo_v2 saw the handle's memory at cuMemCreate and its return.
    assert_eq!(
        v["seen_created"].as_u64().unwrap() - v["seen_before"].as_u64().unwrap(),
        4 * gran
    );
    assert_eq!(v["seen_released"], v["seen_before"]);
}

#[test]
fn pitch_and_managed_allocations() {
    let (v, _state) = run("pitch_managed", "1x80GiB");
    let pitches = v["pitches"].as_object().unwrap();
    for (width, pitch) in pitches {
        let (w, p): (u64, u64) = (width.parse().unwrap(), pitch.as_u64().unwrap());
        assert!(
            p >= w && p % 512 == 0 && p < w + 512,
            "width {w}: pitch {p}"
        );
    }
    assert_eq!(pitches["100"], 512);
    assert_eq!(pitches["513"], 1024);
}

#[test]
fn async_frees_wait_for_the_stream_and_pools_account() {
    let (v, _state) = run("async_pools", "1x80GiB");
    // The free sat behind a 300 ms kernel.
    let waited = f64_of(&v, "waited_s");
    assert!((0.2..5.0).contains(&waited), "waited {waited} s");
}

#[test]
fn arrays_and_mipmapped_arrays_are_charged_their_size() {
    let (v, _state) = run("arrays", "1x80GiB");
    let sizes = &v["sizes"];
    assert_eq!(sizes["2d_float4"], 1000 * 100 * 16);
    assert_eq!(sizes["3d_float"], 64 * 64 * 64 * 4);
    assert_eq!(sizes["mip_9"], 349_524);
    assert_eq!(
        sizes["mip_20"], sizes["mip_9"],
        "levels clamp to what the extents allow"
    );
}

#[test]
fn graphs_run_their_kernels_on_the_engine() {
    let (v, state) = run("graphs", "1x80GiB");
    for (key, ms) in [
        ("captured_ms", 300.0),
        ("twice_ms", 600.0),
        ("built_ms", 200.0),
    ] {
        let got = f64_of(&v, key);
        assert!(
            got >= ms && got < ms * 1.5,
            "{key}: {got} ms, expected {ms}"
        );
    }
    // The engine was busy for every graph kernel, and captured launches did not run at capture.
    let want = v["kernels_ns"].as_u64().unwrap();
    let busy = tessera_sim_state::device_busy_ns(state.path(), 0);
    assert!(
        busy >= want && busy < want + want / 5,
        "engine busy {busy} ns, kernels {want} ns"
    );
}

#[test]
fn per_thread_default_stream_entry_points() {
    let (v, _state) = run("ptsz", "1x80GiB");
    assert_eq!(v["pairs"]["cuLaunchKernel"], "cuLaunchKernel_ptsz");
    assert_eq!(v["pairs"]["cuMemcpyHtoD"], "cuMemcpyHtoD_v2_ptds");
    let waited = f64_of(&v, "waited_s");
    assert!(
        (0.29..5.0).contains(&waited),
        "per-thread sync waited {waited} s"
    );
}

#[test]
fn bad_use_answers_the_driver_error_codes() {
    let (v, _state) = run("errors", "1x80GiB");
    let codes = v["null_codes"].as_object().unwrap();
    assert!(codes.len() >= 25, "{codes:?}");
    assert!(codes.values().all(|c| c == 1), "{codes:?}");
}

#[test]
fn every_allocation_kind_is_out_of_memory_on_a_full_card() {
    let (v, _state) = run("oom", "1x1GiB");
    let codes = v["codes"].as_object().unwrap();
    assert_eq!(codes.len(), 9, "{codes:?}");
    assert!(codes.values().all(|c| c == 2), "{codes:?}");
}

#[test]
fn copies_and_memsets_in_2d() {
    let (v, _state) = run("copies_2d", "1x80GiB");
    assert_eq!(v["pitch"], 512);
}

#[test]
fn host_functions_run_in_stream_order() {
    let (v, _state) = run("host_funcs", "1x80GiB");
    let after: Vec<f64> = v["after_s"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert!(
        after[0] >= 0.2 && after[1] >= 0.3 && after[2] >= after[1],
        "{after:?}"
    );
    assert!(after[2] < 5.0, "{after:?}");
}
