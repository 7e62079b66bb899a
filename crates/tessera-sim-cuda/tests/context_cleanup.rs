//! Destroying a context gives back what was made in it: its device memory and its arrays, freed
//! by the clean-ups the memory and array modules register with the context module.
//!
//! The built `libtessera_sim_cuda.so` is loaded into this process (the one test of this binary,
//! so the environment it sets is read by nobody else).

use libloading::Library;
use tessera_cuda_abi::*;
use tessera_sim_state::{ENV_CONTEXT_MEMORY, ENV_DIR, ENV_GPUS};

const GIB: usize = 1 << 30;

/// `CU_AD_FORMAT_FLOAT`.
const FORMAT_FLOAT: u32 = 0x20;

struct Driver(Library);

impl Driver {
    /// # Safety
    /// `F` is the C signature of `name`.
    unsafe fn f<F: Copy>(&self, name: &str) -> F {
        // SAFETY: per the contract.
        unsafe { *self.0.get::<F>(name.as_bytes()).unwrap() }
    }

    /// `(free, total)` as `cuMemGetInfo_v2` reports them in the current context.
    fn mem_info(&self) -> (usize, usize) {
        let (mut free, mut total) = (0, 0);
        // SAFETY: the entry point's signature; valid out-pointers; a context is current.
        let rc = unsafe { self.f::<cuMemGetInfo_v2_t>("cuMemGetInfo_v2")(&mut free, &mut total) };
        assert_eq!(rc, CUDA_SUCCESS);
        (free, total)
    }
}

#[test]
fn destroying_a_context_frees_its_memory_and_arrays() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: the only test in this binary: no other thread reads the environment.
    unsafe {
        std::env::set_var(ENV_DIR, dir.path());
        std::env::set_var(ENV_GPUS, "1x16GiB");
        std::env::set_var(ENV_CONTEXT_MEMORY, "300MiB");
        std::env::remove_var("CUDA_VISIBLE_DEVICES");
    }
    let path = tessera_testkit::artifact("libtessera_sim_cuda.so");
    // SAFETY: the simulated driver's initialisers only set up empty registries.
    let d = Driver(unsafe { Library::new(&path) }.unwrap());
    // SAFETY: each type is the entry point's C signature; out-pointers are live locals.
    unsafe {
        assert_eq!(d.f::<cuInit_t>("cuInit")(0), CUDA_SUCCESS);
        let mut primary: CUcontext = std::ptr::null_mut();
        let retain = d.f::<cuDevicePrimaryCtxRetain_t>("cuDevicePrimaryCtxRetain");
        assert_eq!(retain(&mut primary, 0), CUDA_SUCCESS);
        let set_current = d.f::<cuCtxSetCurrent_t>("cuCtxSetCurrent");
        assert_eq!(set_current(primary), CUDA_SUCCESS);
        let (free_before, total) = d.mem_info();

        let mut ctx: CUcontext = std::ptr::null_mut();
        let create = d.f::<cuCtxCreate_v2_t>("cuCtxCreate_v2");
        assert_eq!(create(&mut ctx, 0, 0), CUDA_SUCCESS);
        let mut p: CUdeviceptr = 0;
        assert_eq!(
            d.f::<cuMemAlloc_v2_t>("cuMemAlloc_v2")(&mut p, GIB),
            CUDA_SUCCESS
        );
        let mut array: CUarray = std::ptr::null_mut();
        let desc = CUDA_ARRAY_DESCRIPTOR {
            width: 4096,
            height: 4096,
            format: FORMAT_FLOAT,
            num_channels: 1,
        };
        assert_eq!(
            d.f::<cuArrayCreate_v2_t>("cuArrayCreate_v2")(&mut array, &desc),
            CUDA_SUCCESS
        );
        let (free_in_use, _) = d.mem_info();
        let array_bytes = 4096 * 4096 * 4;
        assert!(
            free_in_use + GIB + array_bytes <= free_before,
            "allocation and array charged: {free_in_use} of {total} free, was {free_before}"
        );

        let destroy = d.f::<cuCtxDestroy_v2_t>("cuCtxDestroy_v2");
        assert_eq!(destroy(ctx), CUDA_SUCCESS);
        assert_eq!(set_current(primary), CUDA_SUCCESS);
        assert_eq!(
            d.mem_info().0,
            free_before,
            "the destroyed context's memory, array and context charge are all given back"
        );
        // The freed handles are gone with the context.
        let free = d.f::<cuMemFree_v2_t>("cuMemFree_v2");
        assert_eq!(free(p), CUDA_ERROR_INVALID_VALUE);
        let destroy_array = d.f::<cuArrayDestroy_t>("cuArrayDestroy");
        assert_eq!(destroy_array(array), CUDA_ERROR_INVALID_HANDLE);
    }
}
