//! Added cost of an intercepted `cuMemAlloc_v2` + `cuMemFree_v2` pair against this machine's
//! raw Unix-socket round trip, measured in the same run. Target: added / round trip <= 1.3 (at
//! most one round trip per alloc and per free).
//!
//! Three intercepted patterns are measured:
//! - `intercepted_alloc_free`: the same size freed and allocated again (what caching allocators
//!   do). The free's bytes become the process's credit, and the next allocation takes them
//!   back locally: no round trip at all.
//! - `intercepted_alloc_free_cold`: every allocation 4 KiB larger than the last (wrapping
//!   once in 4096), so it is larger than anything the process freed. The credit granule the
//!   arbiter gave with the first reservation (1/32 of the limit, at most 512 MiB) covers the
//!   growth: no round trip either, after the first.
//! - `intercepted_alloc_free_miss`: every allocation 520 MiB larger than the last, more than
//!   the last free plus a granule (64 GiB limit: granule 512 MiB), so each one misses the
//!   credit and makes one `ReserveCredit` round trip. At the wrap (once in 118) the credit is
//!   dropped by a `cuMemGetInfo_v2` (another round trip), so the next one misses too.
//!
//! "Added" is the intercepted pair minus the direct (raw simulated driver) pair of the same
//! sizes, measured in the same interleaved run. The round trip is a 16-byte echo measured two
//! ways, both pinned to the same CPU as the arbiter: between two processes (like the interposer
//! and the arbiter; the ratio against the target) and between two threads of this process
//! (also printed).
//!
//! Build the artifacts first (see `interposer_bed`), then `cargo bench -p tessera-benches --bench alloc_overhead`.

mod interposer_bed;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};

use criterion::{Criterion, criterion_group, criterion_main};
use interposer_bed::{Bed, Echo, interleaved_medians, write_summary};
use tessera_cuda_abi::{
    cuMemAlloc_v2_t as AllocFn, cuMemFree_v2_t as FreeFn, cuMemGetInfo_v2_t as MemInfoFn,
};
use tessera_protocol::{TenantReply, TenantRequest};

const SIZE: usize = 1 << 20;

fn pair(alloc: AllocFn, free: FreeFn) {
    sized_pair(alloc, free, SIZE);
}

fn sized_pair(alloc: AllocFn, free: FreeFn, size: usize) {
    let mut p = 0u64;
    // SAFETY: the simulated driver's (or interposer's) cuMemAlloc_v2/cuMemFree_v2 with a
    // current context; the pointer is freed right away.
    unsafe {
        assert_eq!(alloc(&mut p, size), 0);
        assert_eq!(free(p), 0);
    }
}

/// Sizes of the cold pattern: 4 KiB more each time, so the previous free never covers the
/// next allocation (but for one wrap in 4096).
struct Growing(usize);

impl Growing {
    fn next(&mut self) -> usize {
        self.0 = (self.0 + 1) % 4096;
        SIZE + self.0 * 4096
    }
}

fn cold_pair(alloc: AllocFn, free: FreeFn, sizes: &mut Growing) {
    sized_pair(alloc, free, sizes.next());
}

/// Sizes of the miss pattern: 520 MiB more each time, from 1 MiB to under 60 GiB.
struct Leaping(usize);

const LEAP: usize = 520 << 20;
const LEAPS: usize = 118;

impl Leaping {
    /// The next size, and whether the sequence wrapped (the credit must be dropped first).
    fn next(&mut self) -> (usize, bool) {
        self.0 = (self.0 + 1) % LEAPS;
        (SIZE + self.0 * LEAP, self.0 == 0)
    }
}

fn miss_pair(alloc: AllocFn, free: FreeFn, info: Option<MemInfoFn>, sizes: &mut Leaping) {
    let (size, wrapped) = sizes.next();
    if wrapped && let Some(info) = info {
        let (mut f, mut t) = (0usize, 0usize);
        // SAFETY: valid out-pointers; a context is current. The query gives the credit back.
        assert_eq!(unsafe { info(&mut f, &mut t) }, 0);
    }
    sized_pair(alloc, free, size);
}

/// Profiling mode (`echo`, `batch-echo`, `ping`, `pair`, `cold`, `miss` or `direct`): runs that one pattern 200 000
/// times and exits, e.g. `TESSERA_ALLOC_PROFILE=cold perf stat -e context-switches <bench> --bench`.
const PROFILE: &str = "TESSERA_ALLOC_PROFILE";

/// Set in the child that [`ProcEcho`] starts: it serves the echo on fd 3 and exits.
const ECHO_CHILD: &str = "TESSERA_BENCH_ECHO_CHILD";

/// The same 16-byte echo as `interposer_bed::Echo`, but served by another process (this
/// benchmark's own executable, started with [`ECHO_CHILD`]), pinned like the arbiter: the
/// like-for-like baseline for a round trip to the arbiter, which is another process too (a
/// switch between processes also changes address space, which a switch between threads
/// does not).
struct ProcEcho {
    client: UnixStream,
    child: Child,
}

/// Set (with [`ECHO_CHILD`]) for an echo process that runs `SCHED_BATCH`, like the arbiter's
/// tenant threads.
const ECHO_BATCH: &str = "TESSERA_BENCH_ECHO_BATCH";

impl ProcEcho {
    /// Starts the echo process; it inherits the calling thread's CPU pinning. With `batch`, the
    /// echo runs `SCHED_BATCH` (no preemption on wake-up), like the arbiter's tenant threads.
    fn start(batch: bool) -> Self {
        let (client, server) = UnixStream::pair().unwrap();
        let fd = server.as_raw_fd();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.arg("--bench")
            .env(ECHO_CHILD, "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if batch {
            cmd.env(ECHO_BATCH, "1");
        }
        use std::os::unix::process::CommandExt;
        // SAFETY: pre_exec runs in the forked child before exec; dup2 is async-signal-safe
        // and gives the child the server end as fd 3 (without close-on-exec).
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        drop(server);
        Self { client, child }
    }

    /// The child's side: echo 16-byte messages on fd 3 until it closes.
    fn serve() -> ! {
        use std::os::fd::FromRawFd;
        // SAFETY: fd 3 is the socket the parent handed over in `start`, owned by nothing else.
        let mut s = unsafe { UnixStream::from_raw_fd(3) };
        if std::env::var_os(ECHO_BATCH).is_some() {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: a valid sched_param; pid 0 is this (single-threaded) process.
            let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
            assert_eq!(rc, 0);
        }
        let mut buf = [0u8; 16];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
        std::process::exit(0)
    }

    /// One 16-byte round trip.
    fn round_trip(&mut self) {
        let mut buf = [7u8; 16];
        self.client.write_all(&buf).unwrap();
        self.client.read_exact(&mut buf).unwrap();
    }
}

impl Drop for ProcEcho {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bench(c: &mut Criterion) {
    if std::env::var_os(ECHO_CHILD).is_some() {
        ProcEcho::serve();
    }
    // One CPU for everything (see `Bed::start`): the comparison with the echo stays fair.
    let bed = Bed::start(64 << 30, 50, None, Some(0));
    let (raw_alloc, raw_free) = (
        bed.raw::<AllocFn>("cuMemAlloc_v2"),
        bed.raw::<FreeFn>("cuMemFree_v2"),
    );
    let (hook_alloc, hook_free) = (
        bed.hooked::<AllocFn>("cuMemAlloc_v2"),
        bed.hooked::<FreeFn>("cuMemFree_v2"),
    );
    let hook_info = bed.hooked::<MemInfoFn>("cuMemGetInfo_v2");
    // First intercepted call connects to the arbiter.
    pair(hook_alloc, hook_free);
    let mut echo = Echo::start();
    let mut pecho = ProcEcho::start(false);
    let mut becho = ProcEcho::start(true);
    // The arbiter's own round trip (Ping/Pong on a tenant connection), to tell apart what the
    // interposer adds from what the arbiter's event loop costs.
    let mut ping = bed.tenant_client();
    // The protocol's own cost of one pair as the interposer speaks it: the free's Release rides
    // in the same write as the next Reserve, then one reply is read.
    let mut proto = bed.tenant_client();
    let mut frames =
        tessera_protocol::frame::encode(&TenantRequest::Release { bytes: SIZE as u64 }).unwrap();
    frames.extend(
        tessera_protocol::frame::encode(&TenantRequest::Reserve { bytes: SIZE as u64 }).unwrap(),
    );
    assert!(matches!(
        proto
            .call(&TenantRequest::Reserve { bytes: SIZE as u64 })
            .unwrap(),
        TenantReply::Reserved { .. }
    ));
    let mut proto2 = bed.tenant_client();
    assert!(matches!(
        proto2
            .call(&TenantRequest::Reserve { bytes: SIZE as u64 })
            .unwrap(),
        TenantReply::Reserved { .. }
    ));

    if let Ok(what) = std::env::var(PROFILE) {
        // Profiling mode: one pattern in a loop and nothing else, so that `perf stat` (which
        // follows the arbiter and the echo process too) counts per-iteration costs.
        let n = 200_000u32;
        let mut sizes = Growing(0);
        let mut f: Box<dyn FnMut()> = match what.as_str() {
            "echo" => Box::new(|| pecho.round_trip()),
            "batch-echo" => Box::new(|| becho.round_trip()),
            "ping" => {
                Box::new(|| assert_eq!(ping.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong))
            }
            "pair" => Box::new(|| pair(hook_alloc, hook_free)),
            "cold" => Box::new(|| cold_pair(hook_alloc, hook_free, &mut sizes)),
            "miss" => {
                let mut leaps = Leaping(0);
                Box::new(move || miss_pair(hook_alloc, hook_free, Some(hook_info), &mut leaps))
            }
            "direct" => Box::new(|| cold_pair(raw_alloc, raw_free, &mut sizes)),
            other => panic!(
                "{PROFILE}={other}: expected echo, batch-echo, ping, pair, cold, miss or direct"
            ),
        };
        let t = std::time::Instant::now();
        for _ in 0..n {
            f();
        }
        println!(
            "{what}: {:.2} us per iteration over {n}",
            t.elapsed().as_nanos() as f64 / f64::from(n) / 1e3
        );
        // Return (not exit): dropping the bed stops the arbiter, which would otherwise outlive
        // us holding every inherited descriptor (a `flock` on the benchmark lock included).
        return;
    }

    let mut g = c.benchmark_group("alloc_overhead");
    g.bench_function("unix_socket_round_trip", |b| b.iter(|| echo.round_trip()));
    g.bench_function("unix_socket_round_trip_process", |b| {
        b.iter(|| pecho.round_trip())
    });
    g.bench_function("unix_socket_round_trip_process_batch", |b| {
        b.iter(|| becho.round_trip())
    });
    g.bench_function("direct_alloc_free", |b| {
        b.iter(|| pair(raw_alloc, raw_free))
    });
    g.bench_function("intercepted_alloc_free", |b| {
        b.iter(|| pair(hook_alloc, hook_free))
    });
    let mut sizes = Growing(0);
    g.bench_function("direct_alloc_free_cold", |b| {
        b.iter(|| cold_pair(raw_alloc, raw_free, &mut sizes))
    });
    g.bench_function("intercepted_alloc_free_cold", |b| {
        b.iter(|| cold_pair(hook_alloc, hook_free, &mut sizes))
    });
    let mut leaps = Leaping(0);
    g.bench_function("direct_alloc_free_miss", |b| {
        b.iter(|| miss_pair(raw_alloc, raw_free, None, &mut leaps))
    });
    let mut leaps = Leaping(0);
    g.bench_function("intercepted_alloc_free_miss", |b| {
        b.iter(|| miss_pair(hook_alloc, hook_free, Some(hook_info), &mut leaps))
    });
    g.finish();
    let (mut direct_sizes, mut hooked_sizes) = (Growing(0), Growing(0));
    let (mut direct_leaps, mut hooked_leaps) = (Leaping(0), Leaping(0));

    // The ratio, from medians measured interleaved in this same run.
    let m = interleaved_medians(
        200,
        200,
        &mut [
            &mut || echo.round_trip(),
            &mut || pair(raw_alloc, raw_free),
            &mut || pair(hook_alloc, hook_free),
            &mut || pecho.round_trip(),
            &mut || {
                let r = ping.call(&TenantRequest::Ping).unwrap();
                assert_eq!(r, TenantReply::Pong);
            },
            &mut || {
                let mut s = proto.stream();
                s.write_all(&frames).unwrap();
                let r: TenantReply = tessera_protocol::frame::read_frame(&mut s).unwrap();
                assert!(matches!(r, TenantReply::Reserved { .. }));
            },
            // The same exchange followed by the direct pair: what the interposer costs if its
            // own code were free. The driver's work runs after a switch to the arbiter and
            // back (cold caches), which the separately measured direct pair does not show.
            &mut || {
                let mut s = proto2.stream();
                s.write_all(&frames).unwrap();
                let r: TenantReply = tessera_protocol::frame::read_frame(&mut s).unwrap();
                assert!(matches!(r, TenantReply::Reserved { .. }));
                pair(raw_alloc, raw_free);
            },
            &mut || cold_pair(raw_alloc, raw_free, &mut direct_sizes),
            &mut || cold_pair(hook_alloc, hook_free, &mut hooked_sizes),
            &mut || becho.round_trip(),
            &mut || miss_pair(raw_alloc, raw_free, None, &mut direct_leaps),
            &mut || miss_pair(hook_alloc, hook_free, Some(hook_info), &mut hooked_leaps),
        ],
    );
    let (
        rtt,
        direct,
        hooked,
        prtt,
        arbiter_rtt,
        proto_rtt,
        proto_direct,
        direct_cold,
        hooked_cold,
        brtt,
    ) = (m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], m[8], m[9]);
    let (direct_miss, hooked_miss) = (m[10], m[11]);
    let added = hooked - direct;
    let added_cold = hooked_cold - direct_cold;
    let added_miss = hooked_miss - direct_miss;
    let summary = format!(
        "alloc_overhead medians: unix socket round trip between threads {:.2} us, between processes {:.2} us; \
         same-size pair (from the credit, no round trip): direct alloc+free {:.2} us, intercepted {:.2} us, added {:.2} us \
         (target <= 0.5), added/process-round-trip ratio {:.2}; \
         cold pair (growing sizes, covered by the credit granule): direct {:.2} us, intercepted {:.2} us, added {:.2} us \
         (target <= 2), added/process-round-trip ratio {:.2}, added/thread-round-trip ratio {:.2}; \
         credit-miss pair (one ReserveCredit round trip each): direct {:.2} us, intercepted {:.2} us, added {:.2} us, \
         added/process-round-trip ratio {:.2}; \
         echo between processes with a SCHED_BATCH server (like the arbiter's tenant threads) {:.2} us, \
         miss added/that {:.2}; \
         arbiter Ping round trip {:.2} us, miss added/arbiter-round-trip {:.2}; \
         protocol Release+Reserve exchange {:.2} us, the same followed by the direct pair {:.2} us, \
         interposer's own share on the miss path (intercepted miss minus direct miss minus that exchange) {:.2} us\n",
        rtt / 1e3,
        prtt / 1e3,
        direct / 1e3,
        hooked / 1e3,
        added / 1e3,
        added / prtt,
        direct_cold / 1e3,
        hooked_cold / 1e3,
        added_cold / 1e3,
        added_cold / prtt,
        added_cold / rtt,
        direct_miss / 1e3,
        hooked_miss / 1e3,
        added_miss / 1e3,
        added_miss / prtt,
        brtt / 1e3,
        added_miss / brtt,
        arbiter_rtt / 1e3,
        added_miss / arbiter_rtt,
        proto_rtt / 1e3,
        proto_direct / 1e3,
        (hooked_miss - direct_miss - proto_rtt) / 1e3
    );
    print!("{summary}");
    write_summary("alloc_overhead", &summary);
}

criterion_group!(benches, bench);
criterion_main!(benches);
