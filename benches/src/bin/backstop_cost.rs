//! backstop_cost: what the arbiter's memory backstop costs, measured on the simulated GPU.
//!
//! Starts the real `tessera-arbiter` twice on a simulated 80 GiB GPU: with the backstop polling
//! every 250 ms (its default) and with it off (`--backstop-interval-ms 0`). Each time, 64
//! `mem_tenant hold` processes (8 allocations of 8 processes, under `tessera run`) hold 64 MiB
//! each; over a 10 s window the arbiter's CPU time (every thread's, from
//! `/proc/<pid>/task/*/schedstat`) is read. Prints one table: the arbiter's CPU with and without the backstop, and the difference
//! per poll.
//!
//! Build and run: `cargo build --release --workspace && target/release/backstop_cost`
//! (`--seconds S` sets the window, default 10).

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tessera_benches::{SimNode, need};

const ALLOCATIONS: usize = 8;
const PER_ALLOCATION: usize = 8;

/// CPU time of every thread of `pid`, ns (`/proc/<pid>/task/*/schedstat`, first field: finer
/// than the clock ticks of `/proc/<pid>/stat`). Threads that ended meanwhile are not counted:
/// the arbiter's long-lived threads (backstop, accept loops, timers) are.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| {
            s.split_whitespace()
                .next()
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum()
}

/// Runs the load against an arbiter started with `args`; returns (arbiter CPU seconds over the
/// window, processes NVML listed at the end).
fn measure(
    args: &[&str],
    seconds: f64,
    tessera: &Path,
    tenant: &Path,
    interposer: &Path,
) -> (f64, usize) {
    let node = SimNode::start_with("backstop_cost", "1x80GiB", args);
    let script = format!(
        "for i in $(seq {PER_ALLOCATION}); do \"$T\" hold --bytes {} --seconds {} & done; wait",
        64 << 20,
        seconds + 8.0
    );
    let groups: Vec<Child> = (0..ALLOCATIONS)
        .map(|_| {
            node.command(tessera)
                .args(["run", "--memory", "4GiB", "--interposer"])
                .arg(interposer)
                .args(["--", "/bin/sh", "-c", &script])
                .env("T", tenant)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start tenants")
        })
        .collect();
    // Wait until every process holds its memory.
    let t = Instant::now();
    let want = (ALLOCATIONS * PER_ALLOCATION) as u64 * (64 << 20);
    while tessera_sim_state::device_memory_used(&node.sim_dir, 0).unwrap_or(0) < want {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the tenants did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = node.arbiter_pid();
    let before = cpu_ns(pid);
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let used = cpu_ns(pid).saturating_sub(before) as f64 / 1e9;
    let procs = tessera_sim_state::read_processes(&node.sim_dir)
        .map(|p| p.len())
        .unwrap_or(0);
    for mut g in groups {
        let _ = g.kill();
        let _ = g.wait();
    }
    node.kill_gpu_processes();
    (used, procs)
}

fn main() {
    let seconds = tessera_benches::number_flag("backstop_cost", "--seconds", 10.0);
    let tessera = need("backstop_cost", "tessera");
    let tenant = need("backstop_cost", "mem_tenant");
    let interposer = need("backstop_cost", "libtessera_interpose.so");
    eprintln!("backstop_cost: arbiter with the backstop every 250 ms, {seconds} s ...");
    let (on, procs_on) = measure(
        &["--backstop-interval-ms", "250"],
        seconds,
        &tessera,
        &tenant,
        &interposer,
    );
    eprintln!("backstop_cost: arbiter with the backstop off, {seconds} s ...");
    let (off, procs_off) = measure(
        &["--backstop-interval-ms", "0"],
        seconds,
        &tessera,
        &tenant,
        &interposer,
    );
    let polls = seconds / 0.25;
    println!(
        "Tessera memory backstop: arbiter CPU over {seconds} s, {ALLOCATIONS} allocations x {PER_ALLOCATION} GPU processes (simulated GPU)"
    );
    println!(
        "{:<28} {:>10} {:>12} {:>10}",
        "arbiter", "processes", "CPU s", "CPU %"
    );
    println!(
        "{:<28} {:>10} {:>12.3} {:>9.2}%",
        "backstop every 250 ms",
        procs_on,
        on,
        100.0 * on / seconds
    );
    println!(
        "{:<28} {:>10} {:>12.3} {:>9.2}%",
        "backstop off",
        procs_off,
        off,
        100.0 * off / seconds
    );
    println!(
        "difference: {:.3} CPU s = {:.2} ms per poll ({polls:.0} polls of {procs_on} processes)",
        on - off,
        (on - off) * 1000.0 / polls
    );
}
