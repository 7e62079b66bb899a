//! hello_gpu: a tiny CUDA driver client, loaded the way the CUDA runtime does it (dlopen
//! `libcuda.so.1`, then `cuGetProcAddress_v2` for every entry point).
//!
//! Run it on the simulated GPUs:
//! `cargo build --workspace && target/debug/tessera sim --gpus 2x80GiB -- target/debug/hello_gpu`

use std::ffi::{CStr, c_char, c_void};
use std::time::Instant;

use tessera_examples::{Driver, SPIN_PTX as PTX, abi};

fn main() {
    let d = Driver::load().unwrap_or_else(|e| {
        eprintln!("hello_gpu: {e}");
        std::process::exit(1)
    });
    if let Err(e) = d.init_primary_context(0) {
        eprintln!("hello_gpu: {e}");
        std::process::exit(1)
    }
    // SAFETY: each type below is the documented C signature of the named entry point.
    unsafe {
        let count: abi::cuDeviceGetCount_t = d.sym(c"cuDeviceGetCount", 2000);
        let name: abi::cuDeviceGetName_t = d.sym(c"cuDeviceGetName", 2000);
        let total: abi::cuDeviceTotalMem_v2_t = d.sym(c"cuDeviceTotalMem", 3020);
        let alloc: abi::cuMemAlloc_v2_t = d.sym(c"cuMemAlloc", 3020);
        let free: abi::cuMemFree_v2_t = d.sym(c"cuMemFree", 3020);
        let info: abi::cuMemGetInfo_v2_t = d.sym(c"cuMemGetInfo", 3020);
        let htod: abi::cuMemcpyHtoD_v2_t = d.sym(c"cuMemcpyHtoD", 3020);
        let dtoh: abi::cuMemcpyDtoH_v2_t = d.sym(c"cuMemcpyDtoH", 3020);
        let load: abi::cuModuleLoadData_t = d.sym(c"cuModuleLoadData", 2000);
        let getf: abi::cuModuleGetFunction_t = d.sym(c"cuModuleGetFunction", 2000);
        let stream_create: abi::cuStreamCreate_t = d.sym(c"cuStreamCreate", 2000);
        let stream_sync: abi::cuStreamSynchronize_t = d.sym(c"cuStreamSynchronize", 2000);
        let ev_create: abi::cuEventCreate_t = d.sym(c"cuEventCreate", 2000);
        let ev_record: abi::cuEventRecord_t = d.sym(c"cuEventRecord", 2000);
        let ev_elapsed: abi::cuEventElapsedTime_t = d.sym(c"cuEventElapsedTime", 12080);
        let launch: abi::cuLaunchKernel_t = d.sym(c"cuLaunchKernel", 4000);

        let mut n = 0;
        d.check("cuDeviceGetCount", count(&mut n));
        for i in 0..n {
            let mut buf = [0 as c_char; 64];
            let mut bytes = 0;
            d.check("cuDeviceGetName", name(buf.as_mut_ptr(), 64, i));
            d.check("cuDeviceTotalMem", total(&mut bytes, i));
            let s = CStr::from_ptr(buf.as_ptr()).to_string_lossy();
            println!("GPU {i}: {s}, {} GiB", bytes >> 30);
        }
        let mut dptr = 0u64;
        d.check("cuMemAlloc", alloc(&mut dptr, 40 << 30));
        let (mut f, mut t) = (0, 0);
        d.check("cuMemGetInfo", info(&mut f, &mut t));
        println!("allocated 40 GiB: {} GiB free of {} GiB", f >> 30, t >> 30);
        let msg = b"hello from the simulated GPU";
        let mut back = [0u8; 28];
        d.check(
            "cuMemcpyHtoD",
            htod(dptr, msg.as_ptr() as *const c_void, msg.len()),
        );
        d.check(
            "cuMemcpyDtoH",
            dtoh(back.as_mut_ptr() as *mut c_void, dptr, back.len()),
        );
        println!("copied back: {:?}", String::from_utf8_lossy(&back));

        let mut module = std::ptr::null_mut();
        let mut spin = std::ptr::null_mut();
        d.check(
            "cuModuleLoadData",
            load(&mut module, PTX.as_ptr() as *const c_void),
        );
        d.check(
            "cuModuleGetFunction",
            getf(&mut spin, module, c"spin".as_ptr()),
        );
        let mut streams = [std::ptr::null_mut(); 2];
        let mut events = [std::ptr::null_mut(); 4];
        for s in &mut streams {
            d.check("cuStreamCreate", stream_create(s, 0));
        }
        for e in &mut events {
            d.check("cuEventCreate", ev_create(e, 0));
        }
        let t0 = Instant::now();
        for (i, &s) in streams.iter().enumerate() {
            let mut ns: u64 = 100_000_000 * (i as u64 + 1);
            let mut params = [&mut ns as *mut u64 as *mut c_void];
            d.check("cuEventRecord", ev_record(events[2 * i], s));
            d.check(
                "cuLaunchKernel",
                launch(
                    spin,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    s,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
            );
            d.check("cuEventRecord", ev_record(events[2 * i + 1], s));
        }
        let submitted = t0.elapsed();
        for &s in &streams {
            d.check("cuStreamSynchronize", stream_sync(s));
        }
        println!(
            "launched 100 ms + 200 ms kernels on two streams in {:.3} ms; both done after {:.0} ms (one engine: they run in turn)",
            submitted.as_secs_f64() * 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
        for i in 0..2 {
            let mut ms = 0f32;
            d.check(
                "cuEventElapsedTime",
                ev_elapsed(&mut ms, events[2 * i], events[2 * i + 1]),
            );
            println!("stream {i}: events measured {ms:.1} ms");
        }
        d.check("cuMemFree", free(dptr));
    }
}
