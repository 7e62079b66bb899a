//! `CUDA_VISIBLE_DEVICES=MIG-<uuid>` on a simulated H200: one device of the instance's size,
//! name, SM count and UUID; memory held to the GPU instance, where a neighbour instance's
//! memory does not count; the parent GPU and a second MIG device are not reachable.
//!
//! The built `libtessera_sim_cuda.so` is loaded into this process (the one test of this binary,
//! so the environment it sets is read by nobody else).

use std::ffi::{CStr, c_char};

use libloading::Library;
use tessera_cuda_abi::*;
use tessera_sim_state::mig::{GpuModel, store};
use tessera_sim_state::{ENV_CONTEXT_MEMORY, ENV_DIR, ENV_GPUS, Ledger, SimSpec};

const GIB: usize = 1 << 30;

#[test]
fn a_mig_device_is_one_instance_sized_device() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SimSpec::parse("2xH200").unwrap();
    let m = GpuModel::H200;
    // Two 1g.18gb instances on GPU 0 (as the DRA driver or `nvidia-smi mig -cgi` would make).
    store::update(dir.path(), |st| {
        st.gpu_mut(0).set_mode(true, false)?;
        for _ in 0..2 {
            let gi = st
                .gpu_mut(0)
                .create_gi(m, m.profile_by_name("1g.18gb").unwrap(), None)?;
            let u = st.fresh_uuid(&spec.gpus[0].uuid_bytes);
            st.gpu_mut(0).create_ci(m, gi, 0, u)?;
        }
        Ok(())
    })
    .unwrap();
    let devs = store::load(dir.path()).unwrap().devices(&spec);
    let (mine, neighbour) = (&devs[0], &devs[1]);
    // The neighbour instance holds 10 GiB: none of it is this instance's.
    let other = Ledger::open(dir.path(), vec![spec.gpus[0].total_bytes])
        .unwrap()
        .with_mig(neighbour);
    other.try_alloc(0, 10 << 30).unwrap();
    // SAFETY: the only test in this binary: no other thread reads the environment.
    unsafe {
        std::env::set_var(ENV_DIR, dir.path());
        std::env::set_var(ENV_GPUS, "2xH200");
        std::env::set_var(ENV_CONTEXT_MEMORY, "0");
        // Widening to the parent, GPU 1 or the neighbour after it ends the list there.
        std::env::set_var(
            "CUDA_VISIBLE_DEVICES",
            format!("{},{},1,0", mine.uuid, neighbour.uuid),
        );
    }
    let path = tessera_testkit::artifact("libtessera_sim_cuda.so");
    // SAFETY: the simulated driver's initialisers only set up empty registries.
    let lib = unsafe { Library::new(&path) }.unwrap();
    // SAFETY: each type is the entry point's C signature; out-pointers are live locals.
    unsafe {
        let init = *lib.get::<cuInit_t>(b"cuInit").unwrap();
        let count = *lib.get::<cuDeviceGetCount_t>(b"cuDeviceGetCount").unwrap();
        let name = *lib.get::<cuDeviceGetName_t>(b"cuDeviceGetName").unwrap();
        let uuid = *lib.get::<cuDeviceGetUuid_t>(b"cuDeviceGetUuid").unwrap();
        let total = *lib
            .get::<cuDeviceTotalMem_v2_t>(b"cuDeviceTotalMem_v2")
            .unwrap();
        let attr = *lib
            .get::<unsafe extern "C" fn(*mut i32, i32, CUdevice) -> CUresult>(
                b"cuDeviceGetAttribute",
            )
            .unwrap();
        let retain = *lib
            .get::<cuDevicePrimaryCtxRetain_t>(b"cuDevicePrimaryCtxRetain")
            .unwrap();
        let set_current = *lib.get::<cuCtxSetCurrent_t>(b"cuCtxSetCurrent").unwrap();
        let alloc = *lib.get::<cuMemAlloc_v2_t>(b"cuMemAlloc_v2").unwrap();
        let info = *lib.get::<cuMemGetInfo_v2_t>(b"cuMemGetInfo_v2").unwrap();

        assert_eq!(init(0), CUDA_SUCCESS);
        let mut n = 0;
        assert_eq!(count(&mut n), CUDA_SUCCESS);
        assert_eq!(n, 1, "one MIG device, nothing after it");
        let mut buf = [0 as c_char; 64];
        assert_eq!(name(buf.as_mut_ptr(), 64, 0), CUDA_SUCCESS);
        assert_eq!(
            CStr::from_ptr(buf.as_ptr()).to_str().unwrap(),
            "NVIDIA H200 MIG 1g.18gb"
        );
        let mut u = CUuuid { bytes: [0; 16] };
        assert_eq!(uuid(&mut u, 0), CUDA_SUCCESS);
        assert_eq!(u.bytes, mine.uuid_bytes);
        let mut t = 0usize;
        assert_eq!(total(&mut t, 0), CUDA_SUCCESS);
        assert_eq!(t, 16 * GIB);
        let mut sms = 0;
        assert_eq!(attr(&mut sms, 16, 0), CUDA_SUCCESS);
        assert_eq!(sms, 16);

        let mut ctx: CUcontext = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(set_current(ctx), CUDA_SUCCESS);
        let (mut free, mut tot) = (0usize, 0usize);
        assert_eq!(info(&mut free, &mut tot), CUDA_SUCCESS);
        assert_eq!(
            (free, tot),
            (16 * GIB, 16 * GIB),
            "the neighbour's 10 GiB are not here"
        );
        let mut p: CUdeviceptr = 0;
        assert_eq!(alloc(&mut p, 12 * GIB), CUDA_SUCCESS);
        assert_eq!(
            alloc(&mut p, 5 * GIB),
            CUDA_ERROR_OUT_OF_MEMORY,
            "past the instance, though the card has room"
        );
        assert_eq!(alloc(&mut p, 4 * GIB), CUDA_SUCCESS);
        let me = tessera_sim_state::read_processes(dir.path())
            .unwrap()
            .into_iter()
            .find(|p| p.pid == std::process::id() && p.mig_tag[0] == mine.tag());
        assert!(me.is_some(), "this process's record names its MIG device");
    }
    drop(other);
}
