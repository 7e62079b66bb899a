//! The arbiter on a simulated H200 with MIG on: each MIG device is a device of its own (its
//! `MIG-` UUID, its instance's memory), the parent is none, and the backstop reads each
//! instance's processes through its MIG handle; instances made and destroyed while the
//! arbiter runs are read again, each device keeping its index.
//!
//! The one test of this binary (it sets the environment the simulated NVML reads).

use tessera_arbiter::{
    Arbiter, GpuDiscovery, GpuSource, NvmlDiscovery, NvmlSource, SchedulerParams, Store, mig_index,
};
use tessera_protocol::{CreateAllocation, GpuInfo, GpuSelector};
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
    let on = |g: &GpuInfo| {
        source
            .processes(g)
            .unwrap()
            .into_iter()
            .map(|p| (p.pid, p.gpu, p.used))
            .collect::<Vec<_>>()
    };
    let me = std::process::id() as i32;
    assert_eq!(on(&gpus[1]), vec![(me, mig_index(1, 0), 2 << 30)]);
    assert!(on(&gpus[2]).is_empty());
    assert!(on(&gpus[0]).is_empty());
    // No utilization on MIG devices, and that turns nothing off.
    assert_eq!(source.utilization(&gpus[1], 0), Some(Vec::new()));
    tenant.free(1, 2 << 30);

    // The layout changes while the arbiter runs (the DRA plugin's prepare and unprepare).
    let state = tempfile::tempdir().unwrap();
    let store = Store::open(state.path()).unwrap();
    let arb = Arbiter::new(gpus.clone(), store, SchedulerParams::default()).unwrap();
    arb.set_discovery(Box::new(NvmlDiscovery {
        lib: Some(lib.clone().into()),
    }));
    // The 1g instance goes (its compute instance, then it); a 2g is made at placement 0.
    let made = store::update(dir.path(), |st| {
        let g = st.gpu_mut(1);
        let gi = g.gis[0].id;
        g.destroy_ci(gi, 0, false)?;
        g.destroy_gi(gi)?;
        let gi = g.create_gi(m, m.profile_by_name("2g.35gb").unwrap(), Some(0))?;
        let u = st.fresh_uuid(&spec.gpus[1].uuid_bytes);
        st.gpu_mut(1).create_ci(m, gi, 1, u)?;
        Ok(tessera_sim_state::mig::format_mig_uuid(&u))
    })
    .unwrap();
    // A Create naming the new instance reads the layout again and finds it.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_, status) = rt
        .block_on(arb.create(CreateAllocation {
            gpu: GpuSelector::Uuid(made.clone()),
            memory_limit: 4 << 30,
            share: 50,
            cap: None,
            labels: Default::default(),
        }))
        .unwrap();
    // The 3g kept its index though it is now the parent's first MIG device; the new one took
    // the slot left free, and the gone 1g is no device.
    let now: Vec<(u32, String)> = arb
        .gpus()
        .iter()
        .map(|g| (g.index, g.uuid.clone()))
        .collect();
    assert_eq!(
        now,
        vec![
            (0, gpus[0].uuid.clone()),
            (mig_index(1, 0), made.clone()),
            (mig_index(1, 1), gpus[2].uuid.clone()),
        ]
    );
    assert_eq!(status.gpu_index, mig_index(1, 0));
    // The backstop's reading: a process on the new instance is seen under its index; the
    // discovery the backstop polls with changes nothing more.
    let devs = store::load(dir.path()).unwrap().devices(&spec);
    let new = devs.iter().find(|d| d.uuid == made).unwrap();
    let tenant = Ledger::open(
        dir.path(),
        spec.gpus.iter().map(|g| g.total_bytes).collect(),
    )
    .unwrap()
    .with_mig(new);
    tenant.try_alloc(1, 1 << 30).unwrap();
    assert!(!arb.refresh_gpus(source.discover().unwrap().unwrap()));
    let g = arb.gpus();
    assert_eq!(on(&g[1]), vec![(me, mig_index(1, 0), 1 << 30)]);
    assert!(on(&g[2]).is_empty());
    // A device gone since the arbiter's reading is read as empty, not as an error.
    assert!(on(&gpus[1]).is_empty());
}
