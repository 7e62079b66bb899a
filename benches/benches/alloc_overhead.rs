//! Added cost of an intercepted `cuMemAlloc_v2` + `cuMemFree_v2` pair (arbiter reservation
//! round trip + one-way release) against this machine's raw Unix-socket round trip, measured in
//! the same run. Target: added / round trip <= 1.3 (one round trip per alloc, none per free).
//!
//! Build the artifacts first (see `interposer_bed`), then `cargo bench -p tessera-benches --bench alloc_overhead`.

mod interposer_bed;

use std::io::Write;

use criterion::{Criterion, criterion_group, criterion_main};
use tessera_protocol::{TenantReply, TenantRequest};
use interposer_bed::{AllocFn, Bed, Echo, FreeFn, interleaved_medians, write_summary};

const SIZE: usize = 1 << 20;

fn pair(alloc: AllocFn, free: FreeFn) {
    let mut p = 0u64;
    // SAFETY: the simulated driver's (or interposer's) cuMemAlloc_v2/cuMemFree_v2 with a
    // current context; the pointer is freed right away.
    unsafe {
        assert_eq!(alloc(&mut p, SIZE), 0);
        assert_eq!(free(p), 0);
    }
}

fn bench(c: &mut Criterion) {
    // One CPU for everything (see `Bed::start`): the comparison with the echo stays fair.
    let bed = Bed::start(64 << 30, 50, None, Some(0));
    let (raw_alloc, raw_free) = (bed.raw::<AllocFn>("cuMemAlloc_v2"), bed.raw::<FreeFn>("cuMemFree_v2"));
    let (hook_alloc, hook_free) = (bed.hooked::<AllocFn>("cuMemAlloc_v2"), bed.hooked::<FreeFn>("cuMemFree_v2"));
    // First intercepted call connects to the arbiter.
    pair(hook_alloc, hook_free);
    let mut echo = Echo::start();
    // The arbiter's own round trip (Ping/Pong on a tenant connection), to tell apart what the
    // interposer adds from what the arbiter's event loop costs.
    let mut ping = bed.tenant_client();
    // The protocol's own cost of one pair as the interposer speaks it: the free's Release rides
    // in the same write as the next Reserve, then one reply is read.
    let mut proto = bed.tenant_client();
    let mut frames = tessera_protocol::frame::encode(&TenantRequest::Release { bytes: SIZE as u64 }).unwrap();
    frames.extend(tessera_protocol::frame::encode(&TenantRequest::Reserve { bytes: SIZE as u64 }).unwrap());
    assert!(matches!(proto.call(&TenantRequest::Reserve { bytes: SIZE as u64 }).unwrap(), TenantReply::Reserved { .. }));

    let mut g = c.benchmark_group("alloc_overhead");
    g.bench_function("unix_socket_round_trip", |b| b.iter(|| echo.round_trip()));
    g.bench_function("direct_alloc_free", |b| b.iter(|| pair(raw_alloc, raw_free)));
    g.bench_function("intercepted_alloc_free", |b| b.iter(|| pair(hook_alloc, hook_free)));
    g.finish();

    // The ratio, from medians measured interleaved in this same run.
    let m = interleaved_medians(
        200,
        200,
        &mut [
            &mut || echo.round_trip(),
            &mut || pair(raw_alloc, raw_free),
            &mut || pair(hook_alloc, hook_free),
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
        ],
    );
    let (rtt, direct, hooked, arbiter_rtt, proto_rtt) = (m[0], m[1], m[2], m[3], m[4]);
    let added = hooked - direct;
    let summary = format!(
        "alloc_overhead medians: unix socket round trip {:.2} us, direct alloc+free {:.2} us, \
         intercepted alloc+free {:.2} us, added {:.2} us, added/round-trip ratio {:.2} (target <= 1.3); \
         arbiter Ping round trip {:.2} us, added/arbiter-round-trip {:.2}; \
         protocol Release+Reserve exchange {:.2} us, interposer's own share {:.2} us\n",
        rtt / 1e3,
        direct / 1e3,
        hooked / 1e3,
        added / 1e3,
        added / rtt,
        arbiter_rtt / 1e3,
        added / arbiter_rtt,
        proto_rtt / 1e3,
        (added - proto_rtt) / 1e3
    );
    print!("{summary}");
    write_summary("alloc_overhead", &summary);
}

criterion_group!(benches, bench);
criterion_main!(benches);
