//! Every context costs device memory, as on a real card: the first of a process on a device
//! `TESSERA_SIM_CONTEXT_MEMORY`, each further one `TESSERA_SIM_FURTHER_CONTEXT_MEMORY`; a
//! context the card has no room for is refused with `CUDA_ERROR_OUT_OF_MEMORY`.
//!
//! The built `libtessera_sim_cuda.so` is loaded into this process (the one test of this binary,
//! so the environment it sets is read by nobody else).

use libloading::Library;
use tessera_cuda_abi::*;
use tessera_sim_state::{ENV_CONTEXT_MEMORY, ENV_DIR, ENV_FURTHER_CONTEXT_MEMORY, ENV_GPUS};

const MIB: u64 = 1 << 20;

#[test]
fn sixty_four_contexts_in_one_process_are_each_charged_and_returned() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: the only test in this binary: no other thread reads the environment.
    unsafe {
        std::env::set_var(ENV_DIR, dir.path());
        // 300 + 63 * 100 MiB = 6.45 GiB fit; a card of 6.5 GiB has room for no 65th context.
        std::env::set_var(ENV_GPUS, "6656MiB");
        std::env::set_var(ENV_CONTEXT_MEMORY, "300MiB");
        std::env::set_var(ENV_FURTHER_CONTEXT_MEMORY, "100MiB");
        std::env::remove_var("CUDA_VISIBLE_DEVICES");
    }
    let path = tessera_testkit::artifact("libtessera_sim_cuda.so");
    // SAFETY: the simulated driver's initialisers only set up empty registries.
    let lib = unsafe { Library::new(&path) }.unwrap();
    // SAFETY: each type is the entry point's C signature; out-pointers are live locals.
    unsafe {
        let init = *lib.get::<cuInit_t>(b"cuInit").unwrap();
        let retain = *lib
            .get::<cuDevicePrimaryCtxRetain_t>(b"cuDevicePrimaryCtxRetain")
            .unwrap();
        let release = *lib
            .get::<cuDevicePrimaryCtxRelease_v2_t>(b"cuDevicePrimaryCtxRelease_v2")
            .unwrap();
        let create = *lib.get::<cuCtxCreate_v2_t>(b"cuCtxCreate_v2").unwrap();
        let destroy = *lib.get::<cuCtxDestroy_v2_t>(b"cuCtxDestroy_v2").unwrap();
        let held = || {
            let p = tessera_sim_state::read_processes(dir.path()).unwrap();
            p.first()
                .map_or((0, 0), |p| (p.contexts[0], p.mem_bytes[0]))
        };
        assert_eq!(init(0), CUDA_SUCCESS);
        let mut primary: CUcontext = std::ptr::null_mut();
        assert_eq!(retain(&mut primary, 0), CUDA_SUCCESS);
        // A second retain shares the primary context: nothing more is charged.
        assert_eq!(retain(&mut primary, 0), CUDA_SUCCESS);
        assert_eq!(held(), (1, 300 * MIB));
        let mut made = Vec::new();
        for i in 1..64u64 {
            let mut ctx: CUcontext = std::ptr::null_mut();
            assert_eq!(create(&mut ctx, 0, 0), CUDA_SUCCESS, "context {i}");
            made.push(ctx);
            assert_eq!(held(), (i + 1, 300 * MIB + i * 100 * MIB));
        }
        let mut ctx: CUcontext = std::ptr::null_mut();
        assert_eq!(
            create(&mut ctx, 0, 0),
            CUDA_ERROR_OUT_OF_MEMORY,
            "the card has no room for a 65th context"
        );
        assert_eq!(
            held(),
            (64, 300 * MIB + 63 * 100 * MIB),
            "the refusal left no trace"
        );
        for (i, ctx) in made.into_iter().enumerate() {
            assert_eq!(destroy(ctx), CUDA_SUCCESS);
            let left = 62 - i as u64;
            assert_eq!(held(), (left + 1, 300 * MIB + left * 100 * MIB));
        }
        assert_eq!(release(0), CUDA_SUCCESS);
        assert_eq!(held(), (1, 300 * MIB), "one retain is left");
        assert_eq!(release(0), CUDA_SUCCESS);
        assert_eq!(held(), (0, 0), "the last context gave everything back");
    }
}
