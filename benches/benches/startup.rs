//! Process start-up cost under the interposer: spawning `/bin/true` with and without
//! `LD_PRELOAD=libtessera_interpose.so` (and with a token set: the constructor still connects
//! nothing), measured in the same run. Target: a few ms at most (HAMi-core spends ~300 ms).
//!
//! Then the cost the context hooks add to a CUDA process's start (its first context reserves
//! the context's cost at the arbiter): `cuCtxCreate_v2` + `cuCtxDestroy_v2` on the simulated
//! driver, raw and through the interposer (reserve before, release after), interleaved.
//!
//! Build the interposer in this profile first: `cargo build --release -p tessera-interpose`.

mod interposer_bed;

use std::process::{Command, Stdio};

use criterion::{Criterion, criterion_group, criterion_main};
use interposer_bed::{Bed, interleaved_medians, profile_dir, write_summary};
use tessera_cuda_abi::{cuCtxCreate_v2_t, cuCtxDestroy_v2_t};
use tessera_protocol::node::{ENV_SOCKET, ENV_TOKEN};

/// Starts a CUDA process (`mem_tenant hold`: its context, 1 byte allocated, exit) on the bed's
/// simulated GPU, under the interposer with the allocation's token when `lib` is given.
fn cuda_process(bed: &Bed, lib: Option<&std::path::Path>) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mem_tenant"));
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .args(["hold", "--bytes", "1", "--seconds", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    bed.gpu.apply(&mut cmd);
    if let Some(p) = lib {
        cmd.env("LD_PRELOAD", p)
            .env(ENV_TOKEN, &bed.token)
            .env(ENV_SOCKET, &bed.socket);
    }
    assert!(cmd.status().unwrap().success());
}

/// Makes a context on device 0 and destroys it.
fn context_cycle(create: cuCtxCreate_v2_t, destroy: cuCtxDestroy_v2_t) {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the entry points' C signatures; a live out-pointer; the context just made.
    unsafe {
        assert_eq!(create(&mut ctx, 0, 0), 0);
        assert_eq!(destroy(ctx), 0);
    }
}

fn spawn(preload: Option<&std::path::Path>, token: bool) {
    let mut cmd = Command::new("/bin/true");
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null());
    if let Some(p) = preload {
        cmd.env("LD_PRELOAD", p);
    }
    if token {
        cmd.env(ENV_TOKEN, "0123456789abcdef")
            .env(ENV_SOCKET, "/nonexistent/tessera.sock");
    }
    assert!(cmd.status().unwrap().success());
}

fn bench(c: &mut Criterion) {
    // Set up first, before any thread exists (it sets this process's environment; the spawned
    // processes below start from a cleared one). For the context hooks: 4 GiB leaves room for
    // one context at a time (the raw primary one the bed made is not the interposer's to count).
    let bed = Bed::start(4 << 30, 10, None, None);
    let lib = profile_dir().join("libtessera_interpose.so");
    assert!(
        lib.exists(),
        "{} missing: cargo build --release -p tessera-interpose",
        lib.display()
    );
    let mut g = c.benchmark_group("startup");
    g.bench_function("true", |b| b.iter(|| spawn(None, false)));
    g.bench_function("true_preloaded", |b| b.iter(|| spawn(Some(&lib), false)));
    g.bench_function("true_preloaded_with_token", |b| {
        b.iter(|| spawn(Some(&lib), true))
    });
    g.finish();

    let m = interleaved_medians(
        100,
        10,
        &mut [
            &mut || spawn(None, false),
            &mut || spawn(Some(&lib), false),
            &mut || spawn(Some(&lib), true),
        ],
    );
    let summary = format!(
        "startup medians: /bin/true {:.3} ms, preloaded {:.3} ms (+{:.3} ms), preloaded with a token {:.3} ms (+{:.3} ms)\n",
        m[0] / 1e6,
        m[1] / 1e6,
        (m[1] - m[0]) / 1e6,
        m[2] / 1e6,
        (m[2] - m[0]) / 1e6
    );
    let raw = (
        bed.raw::<cuCtxCreate_v2_t>("cuCtxCreate_v2"),
        bed.raw::<cuCtxDestroy_v2_t>("cuCtxDestroy_v2"),
    );
    let hooked = (
        bed.hooked::<cuCtxCreate_v2_t>("cuCtxCreate_v2"),
        bed.hooked::<cuCtxDestroy_v2_t>("cuCtxDestroy_v2"),
    );
    let mut g = c.benchmark_group("startup");
    g.bench_function("context_raw", |b| b.iter(|| context_cycle(raw.0, raw.1)));
    g.bench_function("context_hooked", |b| {
        b.iter(|| context_cycle(hooked.0, hooked.1))
    });
    g.finish();
    let ctx = interleaved_medians(
        100,
        10,
        &mut [&mut || context_cycle(raw.0, raw.1), &mut || {
            context_cycle(hooked.0, hooked.1)
        }],
    );
    // A whole CUDA process: its first context now reserves at the arbiter (which connects it:
    // before, its first allocation did), its 1-byte allocation then comes from the credit.
    let procs = interleaved_medians(
        30,
        3,
        &mut [&mut || cuda_process(&bed, None), &mut || {
            cuda_process(&bed, Some(&lib))
        }],
    );
    let summary = format!(
        "{summary}context create+destroy medians: raw {:.1} us, through the hooks {:.1} us (+{:.1} us)\n\
         CUDA process (context, 1 byte, exit) medians: raw {:.3} ms, under the interposer {:.3} ms (+{:.3} ms)\n",
        ctx[0] / 1e3,
        ctx[1] / 1e3,
        (ctx[1] - ctx[0]) / 1e3,
        procs[0] / 1e6,
        procs[1] / 1e6,
        (procs[1] - procs[0]) / 1e6
    );
    print!("{summary}");
    write_summary("startup", &summary);
}

criterion_group!(benches, bench);
criterion_main!(benches);
