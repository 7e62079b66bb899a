//! The arbiter on a simulated H200 with MIG on: each MIG device is a device of its own (its
//! `MIG-` UUID, its instance's memory), the parent is none, and the backstop reads each
//! instance's processes through its MIG handle.
//!
//! The one test of this binary (it sets the environment the simulated NVML reads).

use tessera_arbiter::backstop::{GpuSource, NvmlSource};
use tessera_arbiter::gpus::{GpuDiscovery, NvmlDiscovery, mig_index};
use tessera_sim_state::mig::{GpuModel, store};
use tessera_sim_state::{ENV_DIR, ENV_GPUS, Ledger, SimSpec};

#[test]
fn mig_devices_are_the_arbiters_devices() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SimSpec::parse("2xH200").unwrap();
    let m = GpuModel::H200;
    store::update(dir.path(), |st| {
        st.gpu_mut(1).set_mode(true, false)?;
        // Each with one compute instance of all its slices (CI profile 0: one, 2: three).
        for (name, ci_profile) in [("1g.18gb", 0), ("3g.71gb", 2)] {
            let gi = st
                .gpu_mut(1)
                .create_gi(m, m.profile_by_name(name).unwrap(), None)?;
            let u = st.fresh_uuid(&spec.gpus[1].uuid_bytes);
            st.gpu_mut(1).create_ci(m, gi, ci_profile, u)?;
        }
        Ok(())
    })
    .unwrap();
    // SAFETY: the only test in this binary: no other thread reads the environment.
    unsafe {
        std::env::set_var(ENV_DIR, dir.path());
        std::env::set_var(ENV_GPUS, "2xH200");
    }
    let lib = tessera_testkit::artifact("libtessera_sim_nvml.so");
    let gpus = NvmlDiscovery {
        lib: Some(lib.clone().into()),
    }
    .discover()
    .unwrap();
    let shown: Vec<(u32, &str, u64)> = gpus
        .iter()
        .map(|g| (g.index, g.name.as_str(), g.memory_total))
        .collect();
    assert_eq!(
        shown,
        vec![
            (0, "NVIDIA H200", spec.gpus[0].total_bytes),
            (mig_index(1, 0), "NVIDIA H200 MIG 1g.18gb", 16 << 30),
            (mig_index(1, 1), "NVIDIA H200 MIG 3g.71gb", 71424 << 20),
        ]
    );
    let devs = store::load(dir.path()).unwrap().devices(&spec);
    assert_eq!(gpus[1].uuid, devs[0].uuid);
    assert!(gpus[2].uuid.starts_with("MIG-"));

    // A process on the 1g instance is seen there, and on no other device.
    let totals = spec.gpus.iter().map(|g| g.total_bytes).collect();
    let tenant = Ledger::open(dir.path(), totals).unwrap().with_mig(&devs[0]);
    tenant.try_alloc(1, 2 << 30).unwrap();
    let source = NvmlSource::load(Some(lib.as_os_str())).unwrap();
    assert_eq!(
        source.device_indices().unwrap(),
        vec![0, mig_index(1, 0), mig_index(1, 1)]
    );
    let on = |i: u32| {
        source
            .processes(i)
            .unwrap()
            .into_iter()
            .map(|p| (p.pid, p.used))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        on(mig_index(1, 0)),
        vec![(std::process::id() as i32, 2 << 30)]
    );
    assert!(on(mig_index(1, 1)).is_empty());
    assert!(on(0).is_empty());
    // No utilization on MIG devices, and that turns nothing off.
    assert_eq!(source.utilization(mig_index(1, 0), 0), Some(Vec::new()));
}
