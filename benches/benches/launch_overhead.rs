//! Added cost per kernel launch on the lease fast path: the interposer's `cuLaunchKernel`
//! (credit taken, stream noted, no round trip) against the simulated driver's own, measured in
//! the same run, interleaved. Target: p50 added <= 0.5 us.
//!
//! Build the artifacts first (see `interposer_bed`), then
//! `cargo bench -p tessera-benches --bench launch_overhead`.

mod interposer_bed;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use interposer_bed::{Bed, write_summary};

use tessera_cuda_abi::{
    cuLaunchKernel_t as Launch, cuModuleGetFunction_t, cuModuleLoadData_t, cuStreamCreate_t,
    cuStreamSynchronize_t as StreamSync,
};

const PTX: &[u8] = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry spin(.param .u64 ns)\n{\n    ret;\n}\n\0";

struct Kernel {
    f: *mut c_void,
    stream: *mut c_void,
    sync: StreamSync,
}

impl Kernel {
    fn new(bed: &Bed) -> Self {
        let (mut m, mut f, mut s) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        // SAFETY: the simulated driver's entry points with their C signatures and a current
        // context; the PTX text is NUL-terminated.
        unsafe {
            assert_eq!(
                bed.raw::<cuModuleLoadData_t>("cuModuleLoadData")(&mut m, PTX.as_ptr().cast()),
                0
            );
            assert_eq!(
                bed.raw::<cuModuleGetFunction_t>("cuModuleGetFunction")(
                    &mut f,
                    m,
                    c"spin".as_ptr()
                ),
                0
            );
            assert_eq!(bed.raw::<cuStreamCreate_t>("cuStreamCreate")(&mut s, 0), 0);
        }
        Self {
            f,
            stream: s,
            sync: bed.raw::<StreamSync>("cuStreamSynchronize"),
        }
    }

    /// One launch of a kernel that takes no engine time.
    #[inline]
    fn launch(&self, l: Launch) {
        let mut ns: u64 = 0;
        let mut params = [(&raw mut ns).cast::<c_void>()];
        // SAFETY: a valid function, stream and parameter array for the simulated driver.
        let r = unsafe {
            l(
                self.f,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                self.stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(r, 0);
    }

    fn sync(&self) {
        // SAFETY: our own stream.
        assert_eq!(unsafe { (self.sync)(self.stream) }, 0);
    }
}

/// Per-call latencies of `n` launches (each timed on its own), then a stream sync.
fn timed(k: &Kernel, l: Launch, n: usize, out: &mut Vec<u64>) {
    for _ in 0..n {
        let t = Instant::now();
        k.launch(l);
        out.push(t.elapsed().as_nanos() as u64);
    }
    k.sync();
}

fn pct(v: &mut [u64], p: f64) -> f64 {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p) as usize] as f64
}

fn bench(c: &mut Criterion) {
    let bed = Bed::start(1 << 30, 50, None, None);
    let k = Kernel::new(&bed);
    let raw = bed.raw::<Launch>("cuLaunchKernel");
    let hooked = bed.hooked::<Launch>("cuLaunchKernel");
    // First gated launch starts the lease manager and takes a lease.
    k.launch(hooked);
    k.sync();

    let mut g = c.benchmark_group("launch_overhead");
    for (name, l) in [("direct_launch", raw), ("gated_launch", hooked)] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for i in 0..iters {
                    k.launch(l);
                    if i % 1024 == 1023 {
                        k.sync();
                    }
                }
                let d = t.elapsed();
                k.sync();
                d
            })
        });
    }
    g.finish();

    // Percentiles of single-call latency, interleaved blocks, same run.
    let (mut d, mut h) = (Vec::new(), Vec::new());
    let end = Instant::now() + Duration::from_secs(3);
    while Instant::now() < end {
        timed(&k, raw, 1000, &mut d);
        timed(&k, hooked, 1000, &mut h);
    }
    let (d50, h50) = (pct(&mut d, 0.5), pct(&mut h, 0.5));
    let (d99, h99) = (pct(&mut d, 0.99), pct(&mut h, 0.99));
    let summary = format!(
        "launch_overhead: {} launches each; direct p50 {:.3} us p99 {:.3} us; gated p50 {:.3} us p99 {:.3} us; \
         added p50 {:.3} us (target <= 0.5 us)\n",
        d.len(),
        d50 / 1e3,
        d99 / 1e3,
        h50 / 1e3,
        h99 / 1e3,
        (h50 - d50) / 1e3
    );
    print!("{summary}");
    write_summary("launch_overhead", &summary);
}

criterion_group!(benches, bench);
criterion_main!(benches);
