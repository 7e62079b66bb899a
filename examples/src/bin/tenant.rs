//! tenant: what one tenant sees and gets under a Tessera allocation.
//!
//! `tenant [--name NAME] [--grab-gib N] [--seconds S] [--kernel-us K]`
//!
//! 1. prints the card as the process sees it (`cuDeviceTotalMem_v2`, `cuMemGetInfo_v2`);
//! 2. allocates 1 GiB blocks until the driver refuses one or N GiB are held, and prints the
//!    refusal (under `tessera run` that is the allocation's limit: `CUDA_ERROR_OUT_OF_MEMORY`);
//! 3. launches K µs kernels back to back for S seconds (a few in flight at a time) and prints
//!    how much GPU time it got (kernels times their length) in how much wall time.
//!
//! Run alone on the simulated GPU: `tessera sim -- target/debug/tenant`; under Tessera:
//! `tessera sim -- tessera run --memory 8GiB --share 30 -- target/debug/tenant`.

use std::ffi::{CStr, c_char, c_void};
use std::time::{Duration, Instant};

use tessera_examples::{Driver, SPIN_PTX, abi};

struct Args {
    name: String,
    grab_gib: u64,
    seconds: f64,
    kernel_us: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        name: "tenant".into(),
        grab_gib: 4,
        seconds: 3.0,
        kernel_us: 1000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--name" => a.name = value()?,
            "--grab-gib" => {
                a.grab_gib = value()?.parse().map_err(|e| format!("--grab-gib: {e}"))?
            }
            "--seconds" => a.seconds = value()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--kernel-us" => {
                a.kernel_us = value()?.parse().map_err(|e| format!("--kernel-us: {e}"))?
            }
            "-h" | "--help" => {
                println!("tenant [--name NAME] [--grab-gib N] [--seconds S] [--kernel-us K]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

const GIB: u64 = 1 << 30;

fn main() {
    let args = parse().unwrap_or_else(|e| {
        eprintln!("tenant: {e}");
        std::process::exit(2)
    });
    let d = Driver::load().unwrap_or_else(|e| {
        eprintln!("tenant: {e}");
        std::process::exit(1)
    });
    let n = &args.name;
    if let Err(e) = d.init_primary_context(0) {
        eprintln!("tenant {n}: {e}");
        std::process::exit(1)
    }
    // SAFETY: each type below is the documented C signature of the named entry point.
    unsafe {
        let name: abi::cuDeviceGetName_t = d.sym(c"cuDeviceGetName", 2000);
        let total: abi::cuDeviceTotalMem_v2_t = d.sym(c"cuDeviceTotalMem", 3020);
        let alloc: abi::cuMemAlloc_v2_t = d.sym(c"cuMemAlloc", 3020);
        let free: abi::cuMemFree_v2_t = d.sym(c"cuMemFree", 3020);
        let info: abi::cuMemGetInfo_v2_t = d.sym(c"cuMemGetInfo", 3020);
        let load: abi::cuModuleLoadData_t = d.sym(c"cuModuleLoadData", 2000);
        let getf: abi::cuModuleGetFunction_t = d.sym(c"cuModuleGetFunction", 2000);
        let stream_create: abi::cuStreamCreate_t = d.sym(c"cuStreamCreate", 2000);
        let ev_create: abi::cuEventCreate_t = d.sym(c"cuEventCreate", 2000);
        let ev_record: abi::cuEventRecord_t = d.sym(c"cuEventRecord", 2000);
        let ev_sync: abi::cuEventSynchronize_t = d.sym(c"cuEventSynchronize", 2000);
        let launch: abi::cuLaunchKernel_t = d.sym(c"cuLaunchKernel", 4000);

        let mut buf = [0 as c_char; 96];
        d.check(
            "cuDeviceGetName",
            name(buf.as_mut_ptr(), buf.len() as i32, 0),
        );
        let mut card = 0usize;
        d.check("cuDeviceTotalMem", total(&mut card, 0));
        let (mut free_b, mut total_b) = (0usize, 0usize);
        d.check("cuMemGetInfo", info(&mut free_b, &mut total_b));
        println!(
            "{n}: sees {} with {:.1} GiB ({:.1} GiB free)",
            CStr::from_ptr(buf.as_ptr()).to_string_lossy(),
            card as f64 / GIB as f64,
            free_b as f64 / GIB as f64
        );

        let mut held = Vec::new();
        let mut refused = None;
        while (held.len() as u64) < args.grab_gib {
            let mut p = 0u64;
            match alloc(&mut p, GIB as usize) {
                0 => held.push(p),
                rc => {
                    refused = Some(rc);
                    break;
                }
            }
        }
        match refused {
            Some(2) => println!(
                "{n}: holds {} GiB; the next 1 GiB was refused: CUDA_ERROR_OUT_OF_MEMORY",
                held.len()
            ),
            Some(rc) => println!(
                "{n}: holds {} GiB; the next 1 GiB failed: CUresult {rc}",
                held.len()
            ),
            None => println!("{n}: holds {} GiB", held.len()),
        }

        let mut module = std::ptr::null_mut();
        let mut spin = std::ptr::null_mut();
        d.check(
            "cuModuleLoadData",
            load(&mut module, SPIN_PTX.as_ptr() as *const c_void),
        );
        d.check(
            "cuModuleGetFunction",
            getf(&mut spin, module, c"spin".as_ptr()),
        );
        let mut stream = std::ptr::null_mut();
        d.check("cuStreamCreate", stream_create(&mut stream, 0));
        // A ring of events keeps a few kernels in flight without letting the queue grow.
        const IN_FLIGHT: usize = 4;
        let mut events = [std::ptr::null_mut(); IN_FLIGHT];
        for e in &mut events {
            d.check("cuEventCreate", ev_create(e, 0));
        }
        let start = Instant::now();
        let deadline = start + Duration::from_secs_f64(args.seconds);
        let mut launched = 0u64;
        while Instant::now() < deadline {
            let slot = (launched as usize) % IN_FLIGHT;
            if launched >= IN_FLIGHT as u64 {
                d.check("cuEventSynchronize", ev_sync(events[slot]));
            }
            let mut ns = args.kernel_us * 1000;
            let mut params = [&mut ns as *mut u64 as *mut c_void];
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
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
            );
            d.check("cuEventRecord", ev_record(events[slot], stream));
            launched += 1;
        }
        for &e in &events {
            d.check("cuEventSynchronize", ev_sync(e));
        }
        let wall = start.elapsed().as_secs_f64();
        let gpu = launched as f64 * args.kernel_us as f64 / 1e6;
        // Percent of the wall time; its share of the card's busy time needs the other tenants'
        // figures too (examples/demo.sh divides).
        println!(
            "{n}: ran {launched} kernels of {} us = {gpu:.2} s of GPU time in {wall:.2} s ({:.0}% of the GPU)",
            args.kernel_us,
            100.0 * gpu / wall
        );
        for p in held {
            d.check("cuMemFree", free(p));
        }
    }
}
