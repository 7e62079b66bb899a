//! Process start-up cost under the interposer: spawning `/bin/true` with and without
//! `LD_PRELOAD=libtessera_interpose.so` (and with a token set: the constructor still connects
//! nothing), measured in the same run. Target: a few ms at most (HAMi-core spends ~300 ms).
//!
//! Build the interposer in this profile first: `cargo build --release -p tessera-interpose`.

mod interposer_bed;

use std::process::{Command, Stdio};

use criterion::{Criterion, criterion_group, criterion_main};
use interposer_bed::{interleaved_medians, profile_dir, write_summary};

fn spawn(preload: Option<&std::path::Path>, token: bool) {
    let mut cmd = Command::new("/bin/true");
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null());
    if let Some(p) = preload {
        cmd.env("LD_PRELOAD", p);
    }
    if token {
        cmd.env("TESSERA_TOKEN", "0123456789abcdef")
            .env("TESSERA_SOCKET", "/nonexistent/tessera.sock");
    }
    assert!(cmd.status().unwrap().success());
}

fn bench(c: &mut Criterion) {
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
    print!("{summary}");
    write_summary("startup", &summary);
}

criterion_group!(benches, bench);
criterion_main!(benches);
