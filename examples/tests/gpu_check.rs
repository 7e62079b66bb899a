//! `examples/gpu-check/run.sh` end to end on the simulated GPU, as CI runs it: the debug build,
//! the `.venv` Python with cuda-bindings (no PyTorch, CuPy or JAX there, so those steps are
//! skipped and the cuda-bindings workloads stand in). Checks the markdown table has every row,
//! that nothing failed, and the memory-limit rows (exact on the simulated GPU) are met. The
//! timing rows are only checked for a figure: two shared CPU cores make their values noisy.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tessera_testkit::{python, target_dir};

#[test]
fn gpu_check_script_writes_every_row_on_the_simulated_gpu() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("gpu-check.md");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu-check/run.sh");
    let started = Instant::now();
    let run = Command::new("bash")
        .arg(&script)
        .args([
            "--sim",
            "--share-seconds",
            "2",
            "--bench-seconds",
            "1",
            "--ledger-seconds",
            "3",
            "--latency-seconds",
            "2",
        ])
        .arg("--bin")
        .arg(target_dir())
        .arg("--python")
        .arg(python())
        .arg("--out")
        .arg(&out)
        .env("TMPDIR", tmp.path())
        .env_remove("TESSERA_SIM_GPUS")
        .env_remove("TESSERA_SIM_DIR")
        .output()
        .unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "run.sh failed: {}\n{stderr}",
        run.status
    );
    assert!(took < Duration::from_secs(120), "run.sh took {took:?}");
    let table = std::fs::read_to_string(&out).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&run.stdout).trim(),
        table.trim(),
        "stdout is the table"
    );
    assert!(
        table.starts_with("## Tessera gpu-check: SIMULATED GPU"),
        "{table}"
    );
    assert!(
        table.contains("| step | measure | result | target | met |"),
        "{table}"
    );
    assert!(
        !table.contains("failed"),
        "a step failed:\n{table}\n{stderr}"
    );

    let rows: Vec<Vec<&str>> = table
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| step "))
        .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
        .collect();
    let find = |step: &str, measure: &str| {
        rows.iter()
            .find(|r| r[0].starts_with(step) && r[1].starts_with(measure))
            .unwrap_or_else(|| panic!("no row {step} / {measure}:\n{table}"))
    };
    for r in &rows {
        assert_eq!(r.len(), 5, "five columns: {r:?}");
    }

    // PyTorch, CuPy and JAX are not in CI's .venv.
    for (step, measure) in [
        ("1 limit", "PyTorch"),
        ("2 shares", "PyTorch"),
        ("4 overhead", "PyTorch"),
        ("4 overhead", "CuPy"),
        ("4 overhead", "JAX"),
        ("6 latency tier", "PyTorch"),
    ] {
        assert!(
            find(step, measure)[2].starts_with("skipped: "),
            "{step} {measure}:\n{table}"
        );
    }
    assert!(find("1 limit", "nvidia-smi")[2].starts_with("skipped: "));

    // The limit is exact on the simulated GPU: 30% of 80 GiB.
    let total = find("1 limit 30%", "cuda-bindings: cuMemGetInfo total");
    assert_eq!((total[2], total[4]), ("24.00 GiB", "yes"), "{table}");
    for measure in [
        "cuda-bindings: cuMemAlloc refused",
        "cuda-bindings: cuMemCreate (VMM)",
    ] {
        let r = find("1 limit 30%", measure);
        assert_eq!(r[4], "yes", "{measure}: {r:?}");
        assert!(r[2].starts_with("CUDA_ERROR_OUT_OF_MEMORY after"), "{r:?}");
    }

    // Every measured row has a figure and a verdict.
    for (step, measure) in [
        ("2 shares 30/70", "work done"),
        ("2 shares 30/70", "split of work"),
        ("2 shares 30/70", "total throughput vs one tenant alone"),
        ("3 cap 30%", "GPU time capped / wall"),
        ("4 overhead", "large kernels"),
        ("4 overhead", "loop of tiny kernels"),
        ("4 overhead", "CUDA-graph replay"),
        (
            "5 ledger vs NVML",
            "memory: ledger memory_used vs NVML used",
        ),
        ("5 ledger vs NVML", "GPU time of the run"),
    ] {
        let r = find(step, measure);
        assert!(
            r[2].chars().any(|c| c.is_ascii_digit()),
            "{step} {measure}: {r:?}"
        );
        assert!(!r[2].contains('?'), "{step} {measure}: {r:?}");
        if measure != "work done" {
            assert!(["yes", "NO"].contains(&r[4]), "{step} {measure}: {r:?}");
        }
    }
    // Step 6: p50 and p99 of each mode against the service alone, and a verdict where the
    // tier has a target (the figures themselves are latency_tier's to judge, on a quiet host).
    for (measure, verdict) in [
        ("latency tenant alone (no Tessera)", false),
        ("beside 2 best-effort: time-slicing (no Tessera)", false),
        ("beside 2 best-effort: Tessera, shares only", false),
        ("beside 2 best-effort: Tessera, latency tier", true),
        ("best-effort work under the tier / under time-slicing", true),
    ] {
        let r = find("6 latency tier", measure);
        assert!(
            r[2].chars().any(|c| c.is_ascii_digit()) && !r[2].contains("NaN"),
            "{measure}: {r:?}"
        );
        if measure.starts_with("beside") {
            assert!(r[2].contains("x alone)"), "{measure}: {r:?}");
        }
        assert_eq!(["yes", "NO"].contains(&r[4]), verdict, "{measure}: {r:?}");
    }
    eprintln!("run.sh took {took:?}\n{table}");
}

/// The latency scenario's pure parts (arrivals, quantiles, ratios, arguments): Python's
/// unittest on examples/gpu-check/test_latency.py, no GPU and no PyTorch needed.
#[test]
fn the_latency_scenarios_pure_parts_pass_their_python_tests() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu-check");
    let run = Command::new("python3")
        .arg("-B")
        .arg("test_latency.py")
        .current_dir(&dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "test_latency.py failed:\n{err}");
    assert!(err.contains("\nOK"), "{err}");
}
