//! mem_tenant: the load of the multi-process memory tests and the `mem_share` benchmark. A CUDA
//! driver client (loaded the way the CUDA runtime does it, through `tessera_examples::Driver`)
//! that allocates and frees device memory in one of two patterns:
//!
//! - `handoff --first|--second --rounds N --bytes B --in FIFO --out FIFO`: two processes take
//!   turns. Each round the process whose turn it is allocates `B` bytes and frees them, then
//!   writes one byte to `--out`; the other reads that byte before it allocates. So every
//!   allocation starts after the other process's free returned: none may be refused when two
//!   `B` do not fit but one does.
//! - `churn --bytes B --seconds S [--start-ns T]`: allocate `B`, free it at once, repeat for
//!   `S` seconds (from machine-wide monotonic time `T` if given, so several processes start
//!   together).
//!
//! - `hold --bytes B --seconds S`: allocate `B` once and hold it for `S` seconds.
//! - `race --bytes B --chunks N --tickets DIR --seconds S`: for `S` seconds, race the other
//!   racers for the tickets in `DIR` (files, each a right to one allocation of `B`, taken with
//!   a non-blocking `flock`): hold up to `N` allocations of `B`, each under a ticket (take a
//!   ticket and allocate while fewer are held, else free the oldest and hand its ticket back),
//!   then exit *holding them*: the driver frees them at the process's teardown, as it does for
//!   a killed process. The tickets are opened before the driver is loaded, so at exit the
//!   kernel closes them, and hands them to the other racers, before the arbiter's socket and
//!   the driver's files. A refusal under a ticket (memory the allocation has room for) prints
//!   `refused` at once, so a process killed later has told of it.
//! - `vmm --bytes B --seconds S`: the VMM idiom NCCL and inference allocators use, for `S`
//!   seconds: `cuMemCreate` -> `cuMemAddressReserve` -> `cuMemMap` -> `cuMemSetAccess` ->
//!   `cuMemRelease` at once (the mapping keeps the memory), then `cuMemUnmap` and
//!   `cuMemAddressFree`. `B` is rounded up to 2 MiB.
//! - `fork --bytes B --seconds S`: for `S` seconds, fork a child that allocates `B`, frees it
//!   and exits, and wait for it (the interposer's fork handling, under the backstop).
//!
//! A refused allocation (`CUDA_ERROR_OUT_OF_MEMORY`) is counted; in `handoff` it is retried
//! after 100 us until it succeeds, so the rounds go on. Prints one JSON line at the end:
//! `{"pid":..,"grants":..,"refusals":..,"first_try_refusals":..}`; exits 1 on any other error.

use std::fs::File;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use tessera_examples::Driver;
use tessera_examples::abi::{self, CUDA_ERROR_OUT_OF_MEMORY};
use tessera_sim_state::clock::monotonic_ns;

enum Mode {
    Handoff {
        first: bool,
        rounds: u64,
        input: String,
        output: String,
    },
    Churn {
        seconds: f64,
        start_ns: u64,
    },
    Hold {
        seconds: f64,
    },
    Race {
        seconds: f64,
        chunks: usize,
        tickets: String,
    },
    Vmm {
        seconds: f64,
    },
    Fork {
        seconds: f64,
    },
}

struct Args {
    mode: Mode,
    bytes: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mode = it
        .next()
        .ok_or("usage: mem_tenant handoff|churn|hold|race|vmm|fork [flags]")?;
    let (mut first, mut rounds, mut input, mut output) = (None, 1000, None, None);
    let mut tickets = None;
    let (mut seconds, mut start_ns, mut bytes, mut chunks) = (10.0, 0, None, 1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--first" => first = Some(true),
            "--second" => first = Some(false),
            "--rounds" => rounds = value()?.parse().map_err(|e| format!("--rounds: {e}"))?,
            "--in" => input = Some(value()?),
            "--out" => output = Some(value()?),
            "--seconds" => seconds = value()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--start-ns" => start_ns = value()?.parse().map_err(|e| format!("--start-ns: {e}"))?,
            "--bytes" => bytes = Some(value()?.parse().map_err(|e| format!("--bytes: {e}"))?),
            "--chunks" => chunks = value()?.parse().map_err(|e| format!("--chunks: {e}"))?,
            "--tickets" => tickets = Some(value()?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let bytes = bytes.ok_or("--bytes is required")?;
    let mode = match mode.as_str() {
        "handoff" => Mode::Handoff {
            first: first.ok_or("handoff needs --first or --second")?,
            rounds,
            input: input.ok_or("handoff needs --in")?,
            output: output.ok_or("handoff needs --out")?,
        },
        "churn" => Mode::Churn { seconds, start_ns },
        "hold" => Mode::Hold { seconds },
        "race" => Mode::Race {
            seconds,
            chunks,
            tickets: tickets.ok_or("race needs --tickets")?,
        },
        "vmm" => Mode::Vmm { seconds },
        "fork" => Mode::Fork { seconds },
        other => return Err(format!("unknown mode {other}")),
    };
    Ok(Args { mode, bytes })
}

fn fail(msg: &str) -> ! {
    eprintln!("mem_tenant: {msg}");
    std::process::exit(1)
}

type Alloc = abi::cuMemAlloc_v2_t;
type Free = abi::cuMemFree_v2_t;

struct Counts {
    grants: u64,
    refusals: u64,
    first_try_refusals: u64,
}

/// One allocation and its free; `Err(())` when refused.
fn pair(alloc: Alloc, free: Free, bytes: u64) -> Result<(), ()> {
    let mut p = 0u64;
    // SAFETY: the driver's cuMemAlloc_v2/cuMemFree_v2 with a current context; the pointer is
    // freed right away.
    let rc = unsafe { alloc(&mut p, bytes as usize) };
    match rc {
        0 => {
            // SAFETY: as above; `p` was just allocated.
            let rc = unsafe { free(p) };
            if rc != 0 {
                fail(&format!("cuMemFree_v2 failed with CUresult {rc}"));
            }
            Ok(())
        }
        CUDA_ERROR_OUT_OF_MEMORY => Err(()),
        rc => fail(&format!("cuMemAlloc_v2 failed with CUresult {rc}")),
    }
}

/// One round of the VMM idiom (release right after the map); `Err(())` when refused.
fn vmm_round(driver: &Driver, bytes: u64) -> Result<(), ()> {
    const GRANULE: u64 = 2 << 20;
    let size = bytes.div_ceil(GRANULE) * GRANULE;
    let device0 = abi::CUmemLocation {
        kind: abi::CU_MEM_LOCATION_TYPE_DEVICE,
        id: 0,
    };
    let prop = abi::CUmemAllocationProp {
        kind: abi::CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: 0,
        location: device0,
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: abi::CUmemAllocFlags::default(),
    };
    let access = abi::CUmemAccessDesc {
        location: device0,
        flags: abi::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: each `sym` names the documented C signature of the VMM entry point; the
    // structures are laid out as cuda.h declares them; every handle and range is released.
    unsafe {
        let create: abi::cuMemCreate_t = driver.sym(c"cuMemCreate", 10020);
        let reserve: abi::cuMemAddressReserve_t = driver.sym(c"cuMemAddressReserve", 10020);
        let map: abi::cuMemMap_t = driver.sym(c"cuMemMap", 10020);
        let set_access: abi::cuMemSetAccess_t = driver.sym(c"cuMemSetAccess", 10020);
        let release: abi::cuMemRelease_t = driver.sym(c"cuMemRelease", 10020);
        let unmap: abi::cuMemUnmap_t = driver.sym(c"cuMemUnmap", 10020);
        let address_free: abi::cuMemAddressFree_t = driver.sym(c"cuMemAddressFree", 10020);
        let mut h = 0u64;
        match create(&mut h, size as usize, &prop, 0) {
            0 => {}
            CUDA_ERROR_OUT_OF_MEMORY => return Err(()),
            rc => fail(&format!("cuMemCreate failed with CUresult {rc}")),
        }
        let mut va = 0u64;
        let steps = [
            (
                "cuMemAddressReserve",
                reserve(&mut va, size as usize, 0, 0, 0),
            ),
            ("cuMemMap", map(va, size as usize, 0, h, 0)),
            ("cuMemSetAccess", set_access(va, size as usize, &access, 1)),
            ("cuMemRelease", release(h)),
            ("cuMemUnmap", unmap(va, size as usize)),
            ("cuMemAddressFree", address_free(va, size as usize)),
        ];
        for (name, rc) in steps {
            if rc != 0 {
                fail(&format!("{name} failed with CUresult {rc}"));
            }
        }
    }
    Ok(())
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("mem_tenant: {e}");
        std::process::exit(2);
    });
    // A racer's tickets: opened first, so their descriptors are the lowest (see the notes).
    let tickets: Vec<File> = match &args.mode {
        Mode::Race { tickets, .. } => {
            let mut paths: Vec<_> = std::fs::read_dir(tickets)
                .unwrap_or_else(|e| fail(&format!("--tickets: {e}")))
                .map(|e| e.unwrap_or_else(|e| fail(&e.to_string())).path())
                .collect();
            paths.sort();
            paths
                .iter()
                .map(|p| File::open(p).unwrap_or_else(|e| fail(&e.to_string())))
                .collect()
        }
        _ => Vec::new(),
    };
    let driver = Driver::load().unwrap_or_else(|e| fail(&e));
    driver.init_primary_context(0).unwrap_or_else(|e| fail(&e));
    // SAFETY: each `sym` names the documented C signature of the entry point at that version.
    let (alloc, free) = unsafe {
        let alloc: Alloc = driver.sym(c"cuMemAlloc", 3020);
        let free: Free = driver.sym(c"cuMemFree", 3020);
        (alloc, free)
    };
    let mut c = Counts {
        grants: 0,
        refusals: 0,
        first_try_refusals: 0,
    };
    match args.mode {
        Mode::Handoff {
            first,
            rounds,
            input,
            output,
        } => {
            // FIFOs: opening blocks until the other side opens too; open in an order that
            // cannot deadlock (the first process writes first).
            let (mut rx, mut tx) = if first {
                let tx = File::options()
                    .write(true)
                    .open(&output)
                    .unwrap_or_else(|e| fail(&e.to_string()));
                let rx = File::open(&input).unwrap_or_else(|e| fail(&e.to_string()));
                (rx, tx)
            } else {
                let rx = File::open(&input).unwrap_or_else(|e| fail(&e.to_string()));
                let tx = File::options()
                    .write(true)
                    .open(&output)
                    .unwrap_or_else(|e| fail(&e.to_string()));
                (rx, tx)
            };
            let mut byte = [0u8; 1];
            for _ in 0..rounds {
                if !first && rx.read_exact(&mut byte).is_err() {
                    fail("the other process went away");
                }
                let mut tries = 0;
                while pair(alloc, free, args.bytes).is_err() {
                    tries += 1;
                    c.refusals += 1;
                    if tries > 100_000 {
                        fail("refused for 10 s");
                    }
                    std::thread::sleep(Duration::from_micros(100));
                }
                if tries > 0 {
                    c.first_try_refusals += 1;
                }
                c.grants += 1;
                if tx.write_all(&[1]).is_err() {
                    fail("the other process went away");
                }
                if first && rx.read_exact(&mut byte).is_err() {
                    fail("the other process went away");
                }
            }
        }
        Mode::Hold { seconds } => {
            let mut p = 0u64;
            // SAFETY: cuMemAlloc_v2 with a current context; the memory is held until exit.
            match unsafe { alloc(&mut p, args.bytes as usize) } {
                0 => c.grants += 1,
                CUDA_ERROR_OUT_OF_MEMORY => c.refusals += 1,
                rc => fail(&format!("cuMemAlloc_v2 failed with CUresult {rc}")),
            }
            std::thread::sleep(Duration::from_secs_f64(seconds));
        }
        Mode::Race {
            seconds, chunks, ..
        } => {
            use std::os::fd::AsRawFd;
            let end = Instant::now() + Duration::from_secs_f64(seconds);
            // (pointer, ticket) per allocation held, oldest first.
            let mut held: std::collections::VecDeque<(u64, usize)> = Default::default();
            let mut next = std::process::id() as usize;
            while Instant::now() < end {
                if held.len() >= chunks {
                    let (p, t) = held.pop_front().expect("chunks > 0");
                    // SAFETY: `p` was allocated below and is freed once.
                    let rc = unsafe { free(p) };
                    if rc != 0 {
                        fail(&format!("cuMemFree_v2 failed with CUresult {rc}"));
                    }
                    // SAFETY: unlocks a ticket this process holds, on its own descriptor.
                    unsafe { libc::flock(tickets[t].as_raw_fd(), libc::LOCK_UN) };
                    continue;
                }
                // The next ticket nobody holds (one this process holds is skipped: its own
                // flock would be granted again).
                next += 1;
                let t = next % tickets.len();
                if held.iter().any(|(_, h)| *h == t) {
                    continue;
                }
                // SAFETY: a non-blocking flock on a descriptor this process owns.
                if unsafe { libc::flock(tickets[t].as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }
                    != 0
                {
                    if t == 0 {
                        // A round of taken tickets: let the holders run.
                        std::thread::yield_now();
                    }
                    continue;
                }
                let mut p = 0u64;
                // SAFETY: cuMemAlloc_v2 with a current context; freed above or at exit.
                match unsafe { alloc(&mut p, args.bytes as usize) } {
                    0 => {
                        held.push_back((p, t));
                        c.grants += 1;
                    }
                    CUDA_ERROR_OUT_OF_MEMORY => {
                        c.refusals += 1;
                        println!("refused");
                        // SAFETY: as above, a ticket this process holds.
                        unsafe { libc::flock(tickets[t].as_raw_fd(), libc::LOCK_UN) };
                    }
                    rc => fail(&format!("cuMemAlloc_v2 failed with CUresult {rc}")),
                }
            }
            // `held` is left allocated, its tickets taken: the process's teardown frees both.
        }
        Mode::Vmm { seconds } => {
            let end = Instant::now() + Duration::from_secs_f64(seconds);
            while Instant::now() < end {
                match vmm_round(&driver, args.bytes) {
                    Ok(()) => c.grants += 1,
                    Err(()) => c.refusals += 1,
                }
            }
        }
        Mode::Fork { seconds } => {
            let end = Instant::now() + Duration::from_secs_f64(seconds);
            while Instant::now() < end {
                // SAFETY: the child only calls the driver (through the interposer, whose fork
                // handler rebuilds its state) and `_exit`s.
                match unsafe { libc::fork() } {
                    0 => {
                        let code = match pair(alloc, free, args.bytes) {
                            Ok(()) => 0,
                            Err(()) => 3,
                        };
                        // SAFETY: ends the child without running the parent's exit handlers.
                        unsafe { libc::_exit(code) }
                    }
                    -1 => fail("fork failed"),
                    child => {
                        let mut status = 0;
                        // SAFETY: waits for our own child.
                        unsafe { libc::waitpid(child, &mut status, 0) };
                        match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
                            (true, 0) => c.grants += 1,
                            (true, 3) => c.refusals += 1,
                            _ => fail(&format!("a forked child ended with status {status}")),
                        }
                    }
                }
            }
        }
        Mode::Churn { seconds, start_ns } => {
            while monotonic_ns() < start_ns {
                std::thread::sleep(Duration::from_micros(200));
            }
            let end = Instant::now() + Duration::from_secs_f64(seconds);
            while Instant::now() < end {
                for _ in 0..16 {
                    match pair(alloc, free, args.bytes) {
                        Ok(()) => c.grants += 1,
                        Err(()) => c.refusals += 1,
                    }
                }
            }
        }
    }
    println!(
        "{{\"pid\":{},\"grants\":{},\"refusals\":{},\"first_try_refusals\":{}}}",
        std::process::id(),
        c.grants,
        c.refusals,
        c.first_try_refusals
    );
}
