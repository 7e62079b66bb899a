//! The `nvml-wrapper` crate reads the simulated GPUs through the simulated NVML. The test runs
//! alone in a process of its own (`crate::nvml_alone`): the library reads its state folder
//! from the environment.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::UsedGpuMemory;
use tessera_testkit::python;

#[test]
fn nvml_wrapper_sees_devices_memory_utilization_processes_and_xids() {
    let Some(state) = crate::nvml_alone(
        module_path!(),
        "nvml_wrapper_sees_devices_memory_utilization_processes_and_xids",
        "1x16GiB,1x24GiB",
    ) else {
        return;
    };
    let nvml = crate::sim_nvml();
    assert_eq!(nvml.device_count().unwrap(), 2);
    assert!(nvml.sys_driver_version().unwrap().contains("tessera"));
    let d1 = nvml.device_by_index(1).unwrap();
    assert_eq!(d1.memory_info().unwrap().total, 24 << 30);
    let uuid = d1.uuid().unwrap();
    assert!(uuid.starts_with("GPU-") && uuid.len() == 40);
    assert_eq!(
        nvml.device_by_uuid(uuid.as_str()).unwrap().index().unwrap(),
        1
    );
    assert_eq!(d1.pci_info().unwrap().bus_id, "00000000:02:00.0");
    let d0 = nvml.device_by_index(0).unwrap();
    assert_eq!(d0.memory_info().unwrap().used, 0);
    assert_eq!(d0.utilization_rates().unwrap().gpu, 0);

    // A real client holds 2 GiB on GPU 0 and keeps its engine busy for 3 s.
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["sim", "--gpus", "1x16GiB,1x24GiB", "--state-dir"])
        .arg(state.as_path())
        .arg("--")
        .arg(python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sim_worker.py"))
        .args([(2u64 << 30).to_string().as_str(), "3000000000", "1"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut used, mut util) = (0, 0);
    while Instant::now() < deadline && (used == 0 || util == 0) {
        used = d0.memory_info().unwrap().used;
        util = d0.utilization_rates().unwrap().gpu;
        std::thread::sleep(Duration::from_millis(50));
    }
    // `tessera sim` models a real card: the client's context costs 300 MiB besides its 2 GiB.
    let context = 300 << 20;
    assert_eq!(used, (2 << 30) + context);
    assert!(util > 0, "utilization stayed 0 while a kernel ran");
    let procs = d0.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(
        procs[0].used_gpu_memory,
        UsedGpuMemory::Used((2 << 30) + context)
    );
    assert!(d1.running_compute_processes().unwrap().is_empty());
    assert!(child.wait().unwrap().success());
    assert_eq!(d0.memory_info().unwrap().used, 0);

    // XID events injected by the CLI reach a registered event set.
    let set = nvml.create_event_set().unwrap();
    let set = d1
        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
        .unwrap();
    assert!(set.wait(50).is_err(), "no event yet");
    let st = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["sim", "--gpus", "1x16GiB,1x24GiB", "--state-dir"])
        .arg(state.as_path())
        .args(["--inject-xid", "1:79"])
        .status()
        .unwrap();
    assert!(st.success());
    let ev = set.wait(5000).unwrap();
    assert!(matches!(
        ev.event_data,
        Some(nvml_wrapper::enums::event::XidError::Value(79))
    ));
    assert_eq!(ev.device.index().unwrap(), 1);
    tessera_sim_state::inject_xid(state.as_path(), 0, 48).unwrap();
    assert!(set.wait(200).is_err(), "GPU 0 is not registered");
}
