//! NVML's MIG API on a simulated H200, called through the built `libtessera_sim_nvml.so` as
//! a DRA driver or `nvidia-smi mig` would: mode, profiles, placements, instances, MIG device
//! handles, the privilege rule and per-instance memory and processes.
//!
//! The one test of this binary (it sets the environment the library reads).

use std::ffi::{CStr, CString, c_char};

use libloading::Library;
use tessera_cuda_abi::*;
use tessera_sim_state::{ENV_DIR, ENV_GPUS, Ledger, SimSpec};

type InitF = unsafe extern "C" fn() -> nvmlReturn_t;
type ByIndexF = unsafe extern "C" fn(u32, *mut nvmlDevice_t) -> nvmlReturn_t;
type SetModeF = unsafe extern "C" fn(nvmlDevice_t, u32, *mut nvmlReturn_t) -> nvmlReturn_t;
type GetModeF = unsafe extern "C" fn(nvmlDevice_t, *mut u32, *mut u32) -> nvmlReturn_t;
type ProfileVF =
    unsafe extern "C" fn(nvmlDevice_t, u32, *mut nvmlGpuInstanceProfileInfo_v2_t) -> nvmlReturn_t;
type PlacementsF = unsafe extern "C" fn(
    nvmlDevice_t,
    u32,
    *mut nvmlGpuInstancePlacement_t,
    *mut u32,
) -> nvmlReturn_t;
type CreateGiF = unsafe extern "C" fn(
    nvmlDevice_t,
    u32,
    *const nvmlGpuInstancePlacement_t,
    *mut nvmlGpuInstance_t,
) -> nvmlReturn_t;
type CreateCiF =
    unsafe extern "C" fn(nvmlGpuInstance_t, u32, *mut nvmlComputeInstance_t) -> nvmlReturn_t;
type DestroyF = unsafe extern "C" fn(*mut std::ffi::c_void) -> nvmlReturn_t;
type MigByIndexF = unsafe extern "C" fn(nvmlDevice_t, u32, *mut nvmlDevice_t) -> nvmlReturn_t;
type StringF = unsafe extern "C" fn(nvmlDevice_t, *mut c_char, u32) -> nvmlReturn_t;
type ByUuidF = unsafe extern "C" fn(*const c_char, *mut nvmlDevice_t) -> nvmlReturn_t;
type U32F = unsafe extern "C" fn(nvmlDevice_t, *mut u32) -> nvmlReturn_t;
type ParentF = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlDevice_t) -> nvmlReturn_t;
type MemF = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;
type ProcsF = unsafe extern "C" fn(nvmlDevice_t, *mut u32, *mut nvmlProcessInfo_t) -> nvmlReturn_t;
type UtilF = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlUtilization_t) -> nvmlReturn_t;
type GiInfoF = unsafe extern "C" fn(nvmlGpuInstance_t, *mut nvmlGpuInstanceInfo_t) -> nvmlReturn_t;

const H200_1G: u32 = 19;
const H200_2G: u32 = 14;
const H200_1G_DOUBLE: u32 = 15;

fn set_privileged(on: bool) {
    // SAFETY: the only test in this binary: no other thread reads the environment.
    unsafe {
        if on {
            std::env::remove_var("TESSERA_SIM_NVML_UNPRIVILEGED");
        } else {
            std::env::set_var("TESSERA_SIM_NVML_UNPRIVILEGED", "1");
        }
    }
}

#[test]
fn mig_lifecycle_handles_privilege_and_per_instance_views() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: the only test in this binary: no other thread reads the environment.
    unsafe {
        std::env::set_var(ENV_DIR, dir.path());
        std::env::set_var(ENV_GPUS, "2xH200");
    }
    set_privileged(true);
    let spec = SimSpec::parse("2xH200").unwrap();
    // SAFETY: the simulated NVML's initialisers only set up empty tables.
    let lib = unsafe { Library::new(tessera_testkit::artifact("libtessera_sim_nvml.so")) }.unwrap();
    // SAFETY: each type is the entry point's C signature (nvml.h); out-pointers are locals.
    unsafe {
        let f = |name: &str| CString::new(name).unwrap();
        macro_rules! sym {
            ($t:ty, $n:expr) => {
                *lib.get::<$t>(f($n).as_bytes_with_nul()).unwrap()
            };
        }
        let init = sym!(InitF, "nvmlInit_v2");
        let by_index = sym!(ByIndexF, "nvmlDeviceGetHandleByIndex_v2");
        let set_mode = sym!(SetModeF, "nvmlDeviceSetMigMode");
        let get_mode = sym!(GetModeF, "nvmlDeviceGetMigMode");
        let profile_v = sym!(ProfileVF, "nvmlDeviceGetGpuInstanceProfileInfoV");
        let placements = sym!(PlacementsF, "nvmlDeviceGetGpuInstancePossiblePlacements_v2");
        let create_gi = sym!(CreateGiF, "nvmlDeviceCreateGpuInstanceWithPlacement");
        let create_ci = sym!(CreateCiF, "nvmlGpuInstanceCreateComputeInstance");
        let destroy_gi = sym!(DestroyF, "nvmlGpuInstanceDestroy");
        let destroy_ci = sym!(DestroyF, "nvmlComputeInstanceDestroy");
        let mig_by_index = sym!(MigByIndexF, "nvmlDeviceGetMigDeviceHandleByIndex");
        let name = sym!(StringF, "nvmlDeviceGetName");
        let uuid = sym!(StringF, "nvmlDeviceGetUUID");
        let by_uuid = sym!(ByUuidF, "nvmlDeviceGetHandleByUUID");
        let is_mig = sym!(U32F, "nvmlDeviceIsMigDeviceHandle");
        let gi_id = sym!(U32F, "nvmlDeviceGetGpuInstanceId");
        let ci_id = sym!(U32F, "nvmlDeviceGetComputeInstanceId");
        let max_mig = sym!(U32F, "nvmlDeviceGetMaxMigDeviceCount");
        let parent_of = sym!(ParentF, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
        let mem = sym!(MemF, "nvmlDeviceGetMemoryInfo");
        let procs = sym!(ProcsF, "nvmlDeviceGetComputeRunningProcesses_v3");
        let util = sym!(UtilF, "nvmlDeviceGetUtilizationRates");
        let gi_info = sym!(GiInfoF, "nvmlGpuInstanceGetInfo");

        let string = |f: StringF, h: nvmlDevice_t| {
            let mut buf = [0 as c_char; 96];
            assert_eq!(f(h, buf.as_mut_ptr(), 96), NVML_SUCCESS);
            CStr::from_ptr(buf.as_ptr()).to_str().unwrap().to_string()
        };
        assert_eq!(init(), NVML_SUCCESS);
        let mut gpu: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(by_index(0, &mut gpu), NVML_SUCCESS);
        assert_eq!(string(name, gpu), "NVIDIA H200");
        let (mut cur, mut pend) = (9, 9);
        assert_eq!(get_mode(gpu, &mut cur, &mut pend), NVML_SUCCESS);
        assert_eq!((cur, pend), (0, 0));
        let mut n = 0;
        assert_eq!(max_mig(gpu, &mut n), NVML_SUCCESS);
        assert_eq!(n, 7);

        // Profiles: what `nvidia-smi mig -lgip` shows on an H200.
        let mut info: nvmlGpuInstanceProfileInfo_v2_t = std::mem::zeroed();
        info.version = NVML_GPU_INSTANCE_PROFILE_INFO_V2;
        assert_eq!(
            profile_v(gpu, NVML_GPU_INSTANCE_PROFILE_1_SLICE, &mut info),
            NVML_SUCCESS
        );
        assert_eq!(
            (info.id, info.multiprocessor_count, info.memory_size_mb),
            (H200_1G, 16, 16 * 1024)
        );
        assert_eq!(
            CStr::from_ptr(info.name.as_ptr()).to_str().unwrap(),
            "MIG 1g.18gb"
        );
        info.version = 1;
        assert_eq!(
            profile_v(gpu, NVML_GPU_INSTANCE_PROFILE_7_SLICE, &mut info),
            NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        );
        // A profile the part lacks (8 slices) is not supported; past the enum, a bad argument.
        info.version = NVML_GPU_INSTANCE_PROFILE_INFO_V2;
        assert_eq!(
            profile_v(gpu, NVML_GPU_INSTANCE_PROFILE_8_SLICE, &mut info),
            NVML_ERROR_NOT_SUPPORTED
        );
        assert_eq!(profile_v(gpu, 17, &mut info), NVML_ERROR_INVALID_ARGUMENT);

        // Mode: root only; refused while a process holds a context on the GPU.
        let mut act = 99;
        set_privileged(false);
        assert_eq!(set_mode(gpu, 1, &mut act), NVML_ERROR_NO_PERMISSION);
        set_privileged(true);
        let holder = Ledger::open(dir.path(), vec![spec.gpus[0].total_bytes]).unwrap();
        holder.context_changed(0, true).unwrap();
        assert_eq!(set_mode(gpu, 1, &mut act), NVML_ERROR_IN_USE);
        drop(holder);
        assert_eq!(set_mode(gpu, 1, &mut act), NVML_SUCCESS);
        assert_eq!(act, NVML_SUCCESS, "Hopper: no reset pending");
        assert_eq!(get_mode(gpu, &mut cur, &mut pend), NVML_SUCCESS);
        assert_eq!((cur, pend), (1, 1));

        // Placements: all of them, whether free or not.
        let mut pl = [nvmlGpuInstancePlacement_t::default(); 8];
        let mut count = 8;
        assert_eq!(
            placements(gpu, H200_1G_DOUBLE, pl.as_mut_ptr(), &mut count),
            NVML_SUCCESS
        );
        let got: Vec<(u32, u32)> = pl[..count as usize]
            .iter()
            .map(|p| (p.start, p.size))
            .collect();
        assert_eq!(got, vec![(0, 2), (2, 2), (4, 2), (6, 2)]);

        // 1g@0, then 2g@0 overlaps it.
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        let at = |start, size| nvmlGpuInstancePlacement_t { start, size };
        assert_eq!(create_gi(gpu, H200_1G, &at(0, 1), &mut gi), NVML_SUCCESS);
        let mut other: nvmlGpuInstance_t = std::ptr::null_mut();
        assert_eq!(
            create_gi(gpu, H200_2G, &at(0, 2), &mut other),
            NVML_ERROR_INSUFFICIENT_RESOURCES
        );
        assert_eq!(
            create_gi(gpu, H200_2G, &at(1, 2), &mut other),
            NVML_ERROR_INVALID_ARGUMENT
        );
        let mut gi2: nvmlGpuInstance_t = std::ptr::null_mut();
        assert_eq!(create_gi(gpu, H200_1G, &at(1, 1), &mut gi2), NVML_SUCCESS);
        let mut gii: nvmlGpuInstanceInfo_t = std::mem::zeroed();
        assert_eq!(gi_info(gi, &mut gii), NVML_SUCCESS);
        assert_eq!((gii.profile_id, gii.placement.start), (H200_1G, 0));
        assert_eq!(gii.device, gpu);

        // A compute instance is a MIG device.
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        assert_eq!(
            create_ci(gi, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &mut ci),
            NVML_SUCCESS
        );
        let mut ci2: nvmlComputeInstance_t = std::ptr::null_mut();
        assert_eq!(
            create_ci(gi2, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &mut ci2),
            NVML_SUCCESS
        );
        let mut dev: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(mig_by_index(gpu, 0, &mut dev), NVML_SUCCESS);
        let mut none: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(mig_by_index(gpu, 2, &mut none), NVML_ERROR_NOT_FOUND);
        assert_eq!(string(name, dev), "NVIDIA H200 MIG 1g.18gb");
        let dev_uuid = string(uuid, dev);
        assert!(
            dev_uuid.starts_with("MIG-") && dev_uuid.len() == 40,
            "{dev_uuid}"
        );
        let mut found: nvmlDevice_t = std::ptr::null_mut();
        let c = CString::new(dev_uuid.clone()).unwrap();
        assert_eq!(by_uuid(c.as_ptr(), &mut found), NVML_SUCCESS);
        assert_eq!(found, dev);
        let mut flag = 9;
        assert_eq!(is_mig(dev, &mut flag), NVML_SUCCESS);
        assert_eq!(flag, 1);
        assert_eq!(is_mig(gpu, &mut flag), NVML_SUCCESS);
        assert_eq!(flag, 0);
        let (mut g_id, mut c_id) = (99, 99);
        assert_eq!(gi_id(dev, &mut g_id), NVML_SUCCESS);
        assert_eq!(ci_id(dev, &mut c_id), NVML_SUCCESS);
        assert_eq!((g_id, c_id), (gii.id, 0));
        assert_eq!(gi_id(gpu, &mut g_id), NVML_ERROR_NOT_SUPPORTED);
        let mut up: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(parent_of(dev, &mut up), NVML_SUCCESS);
        assert_eq!(up, gpu);

        // Memory and processes: the instance's own; the parent's only with privilege.
        let mig_dev = tessera_sim_state::mig::store::load(dir.path())
            .unwrap()
            .device_by_uuid(&spec, &dev_uuid)
            .unwrap();
        let tenant = Ledger::open(dir.path(), vec![spec.gpus[0].total_bytes])
            .unwrap()
            .with_mig(&mig_dev);
        tenant.try_alloc(0, 3 << 30).unwrap();
        let mut m = nvmlMemory_t::default();
        assert_eq!(mem(dev, &mut m), NVML_SUCCESS);
        assert_eq!((m.total, m.used), (16 << 30, 3 << 30));
        let mut dev2: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(mig_by_index(gpu, 1, &mut dev2), NVML_SUCCESS);
        assert_eq!(mem(dev2, &mut m), NVML_SUCCESS);
        assert_eq!(m.used, 0, "another instance holds none of it");
        let mut list = [nvmlProcessInfo_t::default(); 4];
        let mut n = 4;
        assert_eq!(procs(dev, &mut n, list.as_mut_ptr()), NVML_SUCCESS);
        assert_eq!(n, 1);
        assert_eq!(
            (
                list[0].pid,
                list[0].used_gpu_memory,
                list[0].gpu_instance_id
            ),
            (std::process::id(), 3 << 30, gii.id)
        );
        assert_eq!(list[0].compute_instance_id, 0);
        n = 4;
        assert_eq!(procs(dev2, &mut n, list.as_mut_ptr()), NVML_SUCCESS);
        assert_eq!(n, 0);
        n = 4;
        assert_eq!(procs(gpu, &mut n, list.as_mut_ptr()), NVML_SUCCESS);
        assert_eq!((n, list[0].gpu_instance_id), (1, gii.id));
        assert_eq!(mem(gpu, &mut m), NVML_SUCCESS);
        set_privileged(false);
        assert_eq!(mem(gpu, &mut m), NVML_ERROR_NO_PERMISSION);
        n = 4;
        assert_eq!(
            procs(gpu, &mut n, list.as_mut_ptr()),
            NVML_ERROR_NO_PERMISSION
        );
        assert_eq!(mem(dev, &mut m), NVML_SUCCESS, "a MIG handle needs none");
        set_privileged(true);
        let mut u = nvmlUtilization_t::default();
        assert_eq!(util(dev, &mut u), NVML_ERROR_NOT_SUPPORTED);
        assert_eq!(util(gpu, &mut u), NVML_ERROR_NOT_SUPPORTED);

        // Tear-down: refused while in use, then a re-created instance is another device.
        assert_eq!(destroy_gi(gi), NVML_ERROR_IN_USE);
        assert_eq!(destroy_ci(ci), NVML_ERROR_IN_USE);
        drop(tenant);
        assert_eq!(destroy_ci(ci), NVML_SUCCESS);
        assert_eq!(destroy_ci(ci), NVML_ERROR_NOT_FOUND);
        assert_eq!(set_mode(gpu, 0, &mut act), NVML_ERROR_IN_USE);
        assert_eq!(
            create_ci(gi, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &mut ci),
            NVML_SUCCESS
        );
        let mut again: nvmlDevice_t = std::ptr::null_mut();
        assert_eq!(mig_by_index(gpu, 0, &mut again), NVML_SUCCESS);
        assert_ne!(string(uuid, again), dev_uuid, "a fresh UUID");
        assert_eq!(by_uuid(c.as_ptr(), &mut found), NVML_ERROR_NOT_FOUND);
        for (g, c) in [(gi, ci), (gi2, ci2)] {
            assert_eq!(destroy_ci(c), NVML_SUCCESS);
            assert_eq!(destroy_gi(g), NVML_SUCCESS);
        }
        assert_eq!(set_mode(gpu, 0, &mut act), NVML_SUCCESS);
        assert_eq!(util(gpu, &mut u), NVML_SUCCESS);
    }
}
