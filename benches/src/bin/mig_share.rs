//! mig_share: fractions inside a MIG instance, measured on a simulated H200.
//!
//! Makes GPU 0 of a simulated `1xH200` MIG-enabled with two `1g.18gb` instances (A and B, each
//! one compute instance, as the DRA driver or `nvidia-smi mig -cgi 19,19 -C` would), starts the
//! real `tessera-arbiter` (which then schedules each MIG device as a device of its own) and
//! runs tenants under `tessera run --gpu MIG-<uuid>`. Prints:
//! - memory: two tenants with `--memory 8GiB` each in instance A: 7 GiB inside the limit is
//!   granted, 9 GiB past it refused; a `--memory 20GiB` request on the 16 GiB instance is
//!   refused at admission;
//! - time: two `--share 50` tenants on A running 1 ms kernels back to back, each one's part of
//!   A's busy time (target: 50/50 within 2 points), while a tenant on B runs too; B's busy
//!   fraction of wall time alone and beside A's load (target: unaffected).
//!
//! GPU time is ground truth from the simulated driver's per-process busy counters, not what
//! the interposer reports.
//!
//! Build and run: `cargo build --release --workspace && target/release/mig_share`
//! (`--seconds S`, default 10: each timed phase; `--made-after`: the instances are made after
//! the arbiter started, as the DRA plugin makes them at prepare).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tessera_benches::{SimNode, Tenant, need, tenant_field};
use tessera_sim_state::mig::{GpuModel, MigDevice, store};
use tessera_sim_state::{SimSpec, clock::monotonic_ns};

const WHO: &str = "mig_share";

struct Bench {
    node: SimNode,
    tessera: PathBuf,
    compute: PathBuf,
    memory: PathBuf,
    interposer: PathBuf,
}

impl Bench {
    /// `tessera run` on MIG device `dev` with `args` before `--`, then `program` and its args.
    fn run(&self, dev: &MigDevice, args: &[&str], program: &PathBuf) -> std::process::Command {
        let mut c = self.node.command(&self.tessera);
        c.arg("run")
            .args(["--gpu", &dev.uuid])
            .args(args)
            .arg("--interposer")
            .arg(&self.interposer)
            .arg("--")
            .arg(program);
        c
    }

    fn compute(&self, dev: &MigDevice, share: u32, seconds: f64) -> Tenant {
        let mut c = self.run(
            dev,
            &["--memory", "1GiB", "--share", &share.to_string()],
            &self.compute,
        );
        c.args(["--kernel-us", "1000", "--seconds", &seconds.to_string()]);
        Tenant::spawn(c)
    }

    /// Whether a `hold` of `bytes` under `--memory limit` on `dev` was granted.
    fn hold(&self, dev: &MigDevice, limit: &str, bytes: u64) -> Result<bool, String> {
        let mut c = self.run(dev, &["--memory", limit, "--share", "10"], &self.memory);
        c.args(["hold", "--bytes", &bytes.to_string(), "--seconds", "0.2"]);
        let out = c.output().map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout);
        match text.lines().find_map(|l| tenant_field(l, "grants")) {
            Some(g) => Ok(g > 0),
            None => Err(format!(
                "exit {:?}: {}",
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).trim()
            )),
        }
    }

    /// Every process's cumulative busy time on GPU 0 (each runs on one instance).
    fn busy(&self) -> HashMap<u32, u64> {
        tessera_sim_state::read_processes(&self.node.sim_dir)
            .unwrap_or_default()
            .into_iter()
            .map(|p| (p.pid, p.busy_ns[0]))
            .collect()
    }

    /// Busy time of `pids` over `seconds` from now (after a 1 s warm-up), and the wall time.
    fn measure(&self, pids: &[u32], seconds: f64) -> (Vec<u64>, u64) {
        std::thread::sleep(Duration::from_secs(1));
        let (b0, t0) = (self.busy(), monotonic_ns());
        std::thread::sleep(Duration::from_secs_f64(seconds));
        let (b1, t1) = (self.busy(), monotonic_ns());
        let d = pids
            .iter()
            .map(|p| b1.get(p).copied().unwrap_or(0) - b0.get(p).copied().unwrap_or(0))
            .collect();
        (d, t1 - t0)
    }
}

fn pct(x: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        x as f64 * 100.0 / total as f64
    }
}

/// `--seconds S` (default 10) and `--made-after`; anything else: usage, exit 2.
fn flags() -> (f64, bool) {
    let (mut seconds, mut made_after) = (10.0, false);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--made-after" => made_after = true,
            "--seconds" => match it.next().and_then(|v| v.parse::<f64>().ok()) {
                Some(v) if v > 0.0 => seconds = v,
                _ => usage(),
            },
            _ => usage(),
        }
    }
    (seconds, made_after)
}

fn usage() -> ! {
    eprintln!("usage: {WHO} [--seconds S] [--made-after]");
    std::process::exit(2);
}

fn main() {
    let (seconds, made_after) = flags();
    let spec = SimSpec::parse("1xH200").expect("spec");
    let m = GpuModel::H200;
    // The two instances, made on the state folder `sim` (MIG on first if needed).
    let make = |sim: &std::path::Path| {
        store::update(sim, |st| {
            if !st.enabled(0) {
                st.gpu_mut(0).set_mode(true, false)?;
            }
            for _ in 0..2 {
                let gi = st.gpu_mut(0).create_gi(
                    m,
                    m.profile_by_name("1g.18gb").expect("profile"),
                    None,
                )?;
                let u = st.fresh_uuid(&spec.gpus[0].uuid_bytes);
                st.gpu_mut(0).create_ci(m, gi, 0, u)?;
            }
            Ok(())
        })
        .expect("MIG layout");
    };
    // `--made-after`: the instances are made once the arbiter runs (as the DRA plugin makes
    // them at a claim's prepare); the first `tessera run` naming one makes it read them.
    let node = if made_after {
        let node = SimNode::start(WHO, "1xH200");
        make(&node.sim_dir);
        node
    } else {
        SimNode::start_prepared(WHO, "1xH200", &[], make)
    };
    let devs = store::load(&node.sim_dir)
        .expect("MIG state")
        .devices(&spec);
    let (a, b) = (&devs[0], &devs[1]);
    let bench = Bench {
        tessera: need(WHO, "tessera"),
        compute: need(WHO, "compute_tenant"),
        memory: need(WHO, "mem_tenant"),
        interposer: need(WHO, "libtessera_interpose.so"),
        node,
    };
    println!(
        "Fractions inside MIG instances on a simulated H200 (GPU 0: A = {} {}, B = {} {}; made {} the arbiter started)",
        a.name,
        a.uuid,
        b.name,
        b.uuid,
        if made_after { "after" } else { "before" }
    );

    const GIB: u64 = 1 << 30;
    let show = |r: Result<bool, String>| match r {
        Ok(true) => "granted".to_string(),
        Ok(false) => "refused".to_string(),
        Err(e) => format!("not run ({e})"),
    };
    println!("memory (instance A, 16 GiB):");
    println!(
        "  --memory 8GiB, 7 GiB: {}",
        show(bench.hold(a, "8GiB", 7 * GIB))
    );
    println!(
        "  --memory 8GiB, 9 GiB: {}",
        show(bench.hold(a, "8GiB", 9 * GIB))
    );
    let mut big = bench.run(a, &["--memory", "20GiB"], &bench.memory);
    big.args(["hold", "--bytes", "1048576", "--seconds", "0.1"]);
    let started = Instant::now();
    let status = big.output().map(|o| o.status.success());
    println!(
        "  --memory 20GiB on the 16 GiB instance: {} ({:.1} s)",
        match status {
            Ok(true) => "admitted".into(),
            Ok(false) => "refused".into(),
            Err(e) => format!("not run ({e})"),
        },
        started.elapsed().as_secs_f64()
    );

    println!("time ({seconds} s per phase, 1 ms kernels back to back):");
    let run_for = seconds + 2.0;
    let alone = bench.compute(b, 100, run_for);
    let (d, wall) = bench.measure(&[alone.pid], seconds);
    let b_alone = pct(d[0], wall);
    alone.wait();
    let a1 = bench.compute(a, 50, run_for);
    let a2 = bench.compute(a, 50, run_for);
    let beside = bench.compute(b, 100, run_for);
    let (d, wall) = bench.measure(&[a1.pid, a2.pid, beside.pid], seconds);
    for t in [a1, a2, beside] {
        t.wait();
    }
    let a_total = d[0] + d[1];
    println!(
        "  A: share 50 / share 50 got {:.1}% / {:.1}% of A's busy time (A busy {:.1}% of wall)",
        pct(d[0], a_total),
        pct(d[1], a_total),
        pct(a_total, wall)
    );
    println!(
        "  B: busy {:.1}% of wall alone, {:.1}% beside A's two tenants",
        b_alone,
        pct(d[2], wall)
    );
    bench.node.kill_gpu_processes();
}
