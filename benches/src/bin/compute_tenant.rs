//! compute_tenant: the load of the `compute_share` benchmark. A CUDA driver client (loaded the
//! way the CUDA runtime does it, through `tessera_examples::Driver`: `dlopen("libcuda.so.1")`,
//! then `cuGetProcAddress_v2`) that launches kernels of a fixed length on the simulated GPU for
//! a while.
//!
//! `compute_tenant [--kernel-us N [--kernel-us-max X]] [--seconds S] [--burst K --idle-ms M]
//! [--sync [--host-us H]] [--requests MEAN_MS --request-kernels K] [--seed N]`
//! - continuous (default): launch kernels back to back, synchronising every few launches so
//!   that without Tessera the queue stays short;
//! - synchronising (`--sync`): wait for every kernel before the next, then work `H` us on the
//!   host (a training loop reading its loss), as a tenant whose queue drains at every step;
//! - bursty (`--burst K`): K kernels, wait for them, note the moment the stream went idle,
//!   sleep M ms, repeat;
//! - requests (`--requests MEAN_MS`): a latency-bound service: requests arrive as a Poisson
//!   process (exponential gaps of mean MEAN_MS, fixed by a seed), each K kernels then a
//!   synchronise; a request that arrives while the previous one runs waits for it. Prints
//!   `latency <ns>` per request, from its arrival to its completion, and `issue <ns>`, the time
//!   its launches took to return (under Tessera: the wait for a lease and launch credits),
//!   and `request <arrival> <issue> <done>` (monotonic ns: its nominal arrival, when its
//!   launches began, its completion), to lay beside the simulator's engine trace
//!   (`TESSERA_SIM_ENGINE_TRACE`, docs/simulator.md).
//!
//! `--kernel-us-max X`: each kernel's length is drawn uniformly between N and X us.
//!
//! `--seed N`: the seed of the arrivals and lengths (default: this process's pid, another
//! sequence per run). A benchmark that compares one tenant under several schedulers gives it
//! the same seed in each, so the rows differ by the scheduler, not by the draw.
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
    kernel_max_ns: u64,
    requests_ms: Option<f64>,
    request_kernels: u32,
    seed: Option<u64>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        kernel_ns: 1_000_000,
        seconds: 10.0,
        burst: None,
        idle_ms: 50,
        sync: false,
        host_ns: 0,
        kernel_max_ns: 0,
        requests_ms: None,
        request_kernels: 4,
        seed: None,
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
            "--kernel-us-max" => {
                a.kernel_max_ns = value()?.parse::<u64>().map_err(|e| e.to_string())? * 1000
            }
            "--requests" => a.requests_ms = Some(value()?.parse().map_err(|e| format!("{e}"))?),
            "--request-kernels" => {
                a.request_kernels = value()?.parse().map_err(|e| format!("{e}"))?
            }
            "--seed" => a.seed = Some(value()?.parse().map_err(|e| format!("{e}"))?),
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
        let ns_at: *mut u64 = &mut ns;
        let mut params = [ns_at.cast::<c_void>()];
        // A seeded generator (xorshift64*): `--seed`'s sequence, or another per process (the
        // pid).
        let seed = args.seed.unwrap_or(u64::from(std::process::id()));
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
        let (lo, hi) = (args.kernel_ns, args.kernel_max_ns.max(args.kernel_ns));
        let mut events: Vec<String> = Vec::new();
        let mut launches = 0u64;
        let mut launch_one = |events: &mut Vec<String>| {
            if hi > lo {
                // SAFETY: `ns_at` points at `ns`, alive for this scope; the driver read the
                // previous value during the previous launch call (parameters are copied).
                *ns_at = lo + rng.next() % (hi - lo + 1);
            }
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
        if let Some(mean_ms) = args.requests_ms {
            let mut gaps = Rng(0x2545_f491_4f6c_dd1d ^ seed);
            let mut arrival = monotonic_ns();
            while Instant::now() < end {
                arrival += gaps.exponential_ns(mean_ms * 1e6);
                wait_until(arrival);
                let issue = monotonic_ns();
                for _ in 0..args.request_kernels {
                    launch_one(&mut events);
                    launches += 1;
                }
                // The launches' own time: under Tessera, the wait for the lease and credits.
                events.push(format!("issue {}", monotonic_ns() - issue));
                check("cuStreamSynchronize", stream_sync(stream));
                let done = monotonic_ns();
                events.push(format!("latency {}", done - arrival));
                // For timelines beside the simulator's engine trace (monotonic ns).
                events.push(format!("request {arrival} {issue} {done}"));
            }
        }
        while args.requests_ms.is_none() && Instant::now() < end {
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

/// xorshift64* (Vigna): a small seeded generator, good enough for arrival gaps and lengths.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// An exponential gap of mean `mean_ns` (a Poisson process's inter-arrival time).
    fn exponential_ns(&mut self, mean_ns: f64) -> u64 {
        // Uniform in (0, 1]: never ln(0).
        let u = ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64;
        (-u.ln() * mean_ns) as u64
    }
}

/// Waits until `t` on the monotonic clock: a sleep to 200 us before it, then a spin (a sleep
/// alone wakes late by tens of microseconds and more under load, which would read as latency).
fn wait_until(t: u64) {
    let now = monotonic_ns();
    if t > now + 200_000 {
        std::thread::sleep(Duration::from_nanos(t - now - 200_000));
    }
    while monotonic_ns() < t {
        std::hint::spin_loop();
    }
}
