//! compute_tenant: the load of the `compute_share` benchmark. A CUDA driver client (loaded the
//! way the CUDA runtime does it, through `tessera_examples::Driver`: `dlopen("libcuda.so.1")`,
//! then `cuGetProcAddress_v2`) that launches kernels of a fixed length on the simulated GPU for
//! a while.
//!
//! `compute_tenant [--kernel-us N] [--seconds S] [--burst K --idle-ms M] [--sync [--host-us H]]`
//! - continuous (default): launch kernels back to back, synchronising every few launches so
//!   that without Tessera the queue stays short;
//! - synchronising (`--sync`): wait for every kernel before the next, then work `H` us on the
//!   host (a training loop reading its loss), as a tenant whose queue drains at every step;
//! - bursty (`--burst K`): K kernels, wait for them, note the moment the stream went idle,
//!   sleep M ms, repeat.
//!
//! Prints `pid <pid>` first, then at exit one line per event on the machine-wide monotonic
//! clock: `idle <ns>` (bursty: the stream became idle) and `unblocked <ns> <waited ns>` (a
//! launch that had to wait more than 200 us, i.e. for a compute lease, returned), and finally
//! `launches <n>`.

use std::ffi::c_void;
use std::io::Write;
use std::time::{Duration, Instant};

use tessera_examples::{Driver, SPIN_PTX, abi};
use tessera_sim_state::clock::monotonic_ns;

struct Args {
    kernel_ns: u64,
    seconds: f64,
    burst: Option<u32>,
    idle_ms: u64,
    sync: bool,
    host_ns: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        kernel_ns: 1_000_000,
        seconds: 10.0,
        burst: None,
        idle_ms: 50,
        sync: false,
        host_ns: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--kernel-us" => {
                a.kernel_ns = value()?.parse::<u64>().map_err(|e| e.to_string())? * 1000
            }
            "--seconds" => a.seconds = value()?.parse().map_err(|e| format!("{e}"))?,
            "--burst" => a.burst = Some(value()?.parse().map_err(|e| format!("{e}"))?),
            "--idle-ms" => a.idle_ms = value()?.parse().map_err(|e| format!("{e}"))?,
            "--sync" => a.sync = true,
            "--host-us" => a.host_ns = value()?.parse::<u64>().map_err(|e| e.to_string())? * 1000,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn check(what: &str, rc: abi::CUresult) {
    if rc != abi::CUDA_SUCCESS {
        eprintln!("compute_tenant: {what} failed with CUresult {rc}");
        std::process::exit(1);
    }
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("compute_tenant: {e}");
        std::process::exit(2);
    });
    println!("pid {}", std::process::id());
    let _ = std::io::stdout().flush();

    let driver = Driver::load().unwrap_or_else(|e| {
        eprintln!("compute_tenant: {e}");
        std::process::exit(1);
    });
    if let Err(e) = driver.init_primary_context(0) {
        eprintln!("compute_tenant: {e}");
        std::process::exit(1);
    }
    // SAFETY: each `sym` names the documented C signature of the entry point at that version.
    unsafe {
        let load: abi::cuModuleLoadData_t = driver.sym(c"cuModuleLoadData", 2000);
        let getf: abi::cuModuleGetFunction_t = driver.sym(c"cuModuleGetFunction", 2000);
        let stream_create: abi::cuStreamCreate_t = driver.sym(c"cuStreamCreate", 2000);
        let stream_sync: abi::cuStreamSynchronize_t = driver.sym(c"cuStreamSynchronize", 2000);
        let launch: abi::cuLaunchKernel_t = driver.sym(c"cuLaunchKernel", 4000);

        let mut module = std::ptr::null_mut();
        check(
            "cuModuleLoadData",
            load(&mut module, SPIN_PTX.as_ptr().cast()),
        );
        let mut func = std::ptr::null_mut();
        check(
            "cuModuleGetFunction",
            getf(&mut func, module, c"spin".as_ptr()),
        );
        let mut stream = std::ptr::null_mut();
        check("cuStreamCreate", stream_create(&mut stream, 0));

        let mut ns = args.kernel_ns;
        let mut params = [(&mut ns as *mut u64).cast::<c_void>()];
        let mut events: Vec<String> = Vec::new();
        let mut launches = 0u64;
        let mut launch_one = |events: &mut Vec<String>| {
            let t0 = monotonic_ns();
            let rc = launch(
                func,
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
            );
            check("cuLaunchKernel", rc);
            let t1 = monotonic_ns();
            if t1 - t0 > 200_000 {
                events.push(format!("unblocked {t1} {}", t1 - t0));
            }
        };
        let end = Instant::now() + Duration::from_secs_f64(args.seconds);
        while Instant::now() < end {
            match args.burst {
                None if args.sync => {
                    launch_one(&mut events);
                    launches += 1;
                    check("cuStreamSynchronize", stream_sync(stream));
                    // Host work: spun, as a CPU-bound step would be (a sleep would oversleep).
                    let until = monotonic_ns() + args.host_ns;
                    while monotonic_ns() < until {
                        std::hint::spin_loop();
                    }
                }
                None => {
                    for _ in 0..4 {
                        launch_one(&mut events);
                        launches += 1;
                    }
                    check("cuStreamSynchronize", stream_sync(stream));
                }
                Some(k) => {
                    for _ in 0..k {
                        launch_one(&mut events);
                        launches += 1;
                    }
                    check("cuStreamSynchronize", stream_sync(stream));
                    events.push(format!("idle {}", monotonic_ns()));
                    std::thread::sleep(Duration::from_millis(args.idle_ms));
                }
            }
        }
        let mut out = std::io::stdout().lock();
        for e in &events {
            let _ = writeln!(out, "{e}");
        }
        let _ = writeln!(out, "launches {launches}");
    }
}
