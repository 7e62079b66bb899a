//! The simulated driver honours `CUDA_VISIBLE_DEVICES` as the real one does: indexes, UUIDs and
//! UUID prefixes select and order the GPUs, ordinals are renumbered 0..n over them, memory and
//! kernels land on the physical GPU behind the ordinal, an invalid entry ends the list and an
//! empty value leaves no device (`cuInit` answers `CUDA_ERROR_NO_DEVICE`). NVML ignores it.
//! A real `cuda-bindings` client (`tests/python/sim_visible.py`) under `tessera sim`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tessera_sim_state::SimSpec;
use tessera_testkit::{FirstLine, python, spawn_first_line};

const GPUS: &str = "1x16GiB,1x24GiB,1x80GiB";
const GIB: u64 = 1 << 30;

fn spec() -> SimSpec {
    SimSpec::parse(GPUS).unwrap()
}

fn uuid(i: usize) -> String {
    spec().gpus[i].uuid.clone()
}

fn client(state: &Path, visible: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.arg("sim")
        .arg("--state-dir")
        .arg(state)
        .args(["--gpus", GPUS, "--"])
        .arg(python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sim_visible.py"))
        .args(args)
        .env("CUDA_VISIBLE_DEVICES", visible);
    c
}

/// What the client saw with `visible`.
fn seen(visible: &str) -> serde_json::Value {
    let state = tempfile::tempdir().unwrap();
    let out = client(state.path(), visible, &[])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{visible:?}: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{visible:?}: {e}: {text}"))
}

/// The physical GPUs (by UUID) the client saw, in ordinal order.
fn uuids(v: &serde_json::Value) -> Vec<String> {
    v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["uuid"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn indexes_select_and_renumber_the_gpus() {
    let v = seen("1");
    assert_eq!(uuids(&v), [uuid(1)]);
    assert_eq!(v["count"], 1);
    assert_eq!(v["devices"][0]["total"], 24 * GIB);
    assert_eq!(
        v["beyond"], 101,
        "ordinal 1 does not exist: CUDA_ERROR_INVALID_DEVICE"
    );
    let v = seen("0,2");
    assert_eq!(uuids(&v), [uuid(0), uuid(2)]);
    assert_eq!(
        v["devices"][1]["pci"],
        spec().gpus[2].pci_bus_id_cuda(),
        "the PCI id is the physical GPU's"
    );
    let v = seen("2,0");
    assert_eq!(
        uuids(&v),
        [uuid(2), uuid(0)],
        "ordinals follow the list's order"
    );
    assert_eq!(v["nvml_count"], 3, "NVML is not filtered");
}

#[test]
fn uuids_and_uuid_prefixes_select_gpus() {
    assert_eq!(uuids(&seen(&uuid(2))), [uuid(2)]);
    assert_eq!(
        uuids(&seen(&format!("{},{}", uuid(1), uuid(0)))),
        [uuid(1), uuid(0)]
    );
    let prefix = &uuid(2)[..12];
    assert_eq!(uuids(&seen(prefix)), [uuid(2)], "unique prefix {prefix}");
    assert_eq!(
        uuids(&seen(&format!("1,{prefix}"))),
        [uuid(1), uuid(2)],
        "mixed forms"
    );
}

#[test]
fn an_invalid_entry_ends_the_list() {
    assert_eq!(uuids(&seen("1,7,0")), [uuid(1)], "out of range");
    assert_eq!(uuids(&seen("2,GPU-nosuch,0")), [uuid(2)], "unknown UUID");
    assert_eq!(uuids(&seen("0,0,1")), [uuid(0)], "repeated");
}

#[test]
fn an_empty_value_or_no_valid_entry_leaves_no_device() {
    for visible in ["", "-1", "GPU-nosuch"] {
        let v = seen(visible);
        assert_eq!(
            v["init"], 100,
            "{visible:?}: cuInit answers CUDA_ERROR_NO_DEVICE"
        );
        assert_eq!(
            v["count_rc"], 3,
            "{visible:?}: and the driver stays uninitialised"
        );
        assert!(uuids(&v).is_empty());
        assert_eq!(v["nvml_count"], 3, "{visible:?}: NVML is not filtered");
    }
}

#[test]
fn memory_and_kernels_go_to_the_physical_gpu_behind_the_ordinal() {
    let state = tempfile::tempdir().unwrap();
    let FirstLine {
        mut child,
        stdin,
        line,
    } = spawn_first_line(client(state.path(), "2,0", &["256", "50000000"]).stdin(Stdio::piped()));
    let v: serde_json::Value =
        serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    assert_eq!(v["ctx_device"], 0, "cuCtxGetDevice answers the ordinal");
    assert_eq!(v["ptr_ordinal"], 0, "the pointer's device ordinal");
    assert_eq!(v["by_pci"], 0, "cuDeviceGetByPCIBusId answers the ordinal");
    assert_eq!(
        v["info_total"],
        80 * GIB,
        "cuMemGetInfo is the physical GPU 2's"
    );
    // Plus the process's context (`tessera sim` models a real card's 300 MiB), on GPU 2 too.
    let context = 300 << 20;
    assert_eq!(v["info_used"], (256 << 20) + context);
    let dir: PathBuf = state.path().to_path_buf();
    let used = |g| tessera_sim_state::device_memory_used(&dir, g).unwrap();
    assert_eq!(
        (used(0), used(1), used(2)),
        (0, 0, (256 << 20) + context),
        "ordinal 0 is physical GPU 2"
    );
    assert!(
        tessera_sim_state::device_busy_ns(&dir, 2) >= 50_000_000,
        "the kernel ran on GPU 2"
    );
    assert_eq!(tessera_sim_state::device_busy_ns(&dir, 0), 0);
    let processes = tessera_sim_state::read_processes(&dir).unwrap();
    assert!(
        processes
            .iter()
            .any(|p| p.mem_bytes[2] == (256 << 20) + context),
        "charged to GPU 2 in the process record"
    );
    drop(stdin);
    assert!(child.wait().unwrap().success());
}
