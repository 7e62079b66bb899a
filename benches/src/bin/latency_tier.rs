//! latency_tier: a latency-bound service next to saturating best-effort work on one simulated
//! GPU (the time-slicing engine: 1 ms slices, 50 us switches), with and without Tessera.
//!
//! The latency tenant is `compute_tenant --requests`: Poisson arrivals, each request a few
//! short kernels then a synchronise; its latency is arrival to completion. The best-effort
//! tenant launches 1-10 ms kernels back to back. Side by side, in one run:
//! - `alone`: the latency tenant(s) alone on the GPU, no Tessera;
//! - `time-slicing`: with the best-effort tenant(s), no Tessera (the GPU's own round robin);
//! - `shares only`: both under `tessera run --share`, every one best-effort;
//! - `latency tier`: the latency tenant(s) under `tessera run --tier latency`.
//!
//! Then the same with short best-effort kernels (0.1-1 ms), and with 2 latency tenants and 3
//! best-effort ones. Per row: the latency tenants'
//! p50/p99/p99.9 and their ratio to `alone`, and the best-effort tenants' GPU time as a part of
//! what the latency tenants leave (wall time less their busy time), from the simulated
//! engine's per-process busy counters (ground truth, not what the interposer reports).
//!
//! Build and run: `cargo build --release --workspace && target/release/latency_tier`
//! (`--seconds S` per row, default 15; `--linger-us U`: the arbiter's `--latency-linger-us`;
//! `--mix N`: only the Nth mix).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use tessera_benches::{SimNode, Tenant};
use tessera_protocol::Tier;
use tessera_sim_state::clock::monotonic_ns;

const WHO: &str = "latency_tier";

/// The seed of tenant `i` of `mix` (latency tenants from 0, best-effort ones from 100): the
/// same in every mode of the mix.
fn seed(mix: &Mix, i: usize) -> String {
    let name = mix
        .name
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    name.wrapping_add(i as u64).to_string()
}

/// How the tenants of a row run.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Alone,
    Plain,
    Shares,
    Tier,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Alone => "alone",
            Mode::Plain => "time-slicing (no Tessera)",
            Mode::Shares => "Tessera, shares only",
            Mode::Tier => "Tessera, latency tier",
        }
    }
}

/// One mix of tenants: latency ones (share, request gap ms, kernels per request, kernel us)
/// and best-effort ones (share each).
struct Mix {
    name: &'static str,
    latency: Vec<(u32, f64, u32, u64)>,
    best_effort: Vec<u32>,
    /// The best-effort kernels' lengths, us (drawn uniformly).
    be_kernel_us: (u64, u64),
}

struct Row {
    mode: Mode,
    latencies: Vec<u64>,
    /// The latency tenants' GPU time and the best-effort ones', ns, over `wall`.
    latency_busy: u64,
    be_busy: u64,
    wall: u64,
    /// Under Tessera: what the arbiter counted for the latency tenants' allocations (the last
    /// values listed before they went away).
    arbiter: Option<LeaseCounts>,
    /// Per request, the time its launches took to return, ns.
    issues: Vec<u64>,
}

/// The latency tenants' lease counters from the arbiter's `List`, summed.
#[derive(Clone, Copy, Default)]
struct LeaseCounts {
    leases: u64,
    /// GPU time charged (leases: time held, lingers included), ns.
    charged_ns: u64,
}

struct Bench {
    node: SimNode,
    tessera: PathBuf,
    tenant: PathBuf,
    interposer: PathBuf,
    seconds: f64,
}

impl Bench {
    fn command(&self, mode: Mode, share: u32, latency: bool) -> Command {
        if matches!(mode, Mode::Alone | Mode::Plain) {
            return self.node.command(&self.tenant);
        }
        let mut c = self.node.command(&self.tessera);
        // Room for the tenant's context (300 MiB: contexts count against the limit).
        c.args(["run", "--memory", "512MiB", "--share", &share.to_string()]);
        if latency && mode == Mode::Tier {
            c.args(["--tier", "latency"]);
        }
        c.arg("--interposer")
            .arg(&self.interposer)
            .arg("--")
            .arg(&self.tenant);
        c
    }

    /// Watches every process's busy counter every 10 ms until `stop`: the last value seen
    /// of each (a process that exited is no longer listed) and when it was seen.
    /// With `admin`, also the latency allocations' lease counters every 100 ms (the last
    /// listing of each by id: an allocation of `tessera run` goes when its tenant exits).
    #[allow(clippy::type_complexity)]
    fn watch(
        &self,
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
        admin: bool,
    ) -> std::thread::JoinHandle<(HashMap<u32, (u64, u64)>, Option<LeaseCounts>)> {
        let dir = self.node.sim_dir.clone();
        let mut admin = admin.then(|| self.node.admin());
        std::thread::spawn(move || {
            let mut seen: HashMap<u32, (u64, u64)> = HashMap::new();
            let mut counts: HashMap<String, LeaseCounts> = HashMap::new();
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let procs = tessera_sim_state::read_processes(&dir).unwrap_or_default();
                let t = monotonic_ns();
                for p in procs {
                    seen.insert(p.pid, (p.busy_ns[0], t));
                }
                if n.is_multiple_of(10)
                    && let Some(list) = admin.as_mut().and_then(|a| a.list().ok())
                {
                    for a in list.into_iter().filter(|a| a.tier == Tier::Latency) {
                        counts.insert(
                            a.id,
                            LeaseCounts {
                                leases: a.leases,
                                charged_ns: a.gpu_time_total_ns,
                            },
                        );
                    }
                }
                n += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            let total = admin.map(|_| {
                counts
                    .values()
                    .fold(LeaseCounts::default(), |s, c| LeaseCounts {
                        leases: s.leases + c.leases,
                        charged_ns: s.charged_ns + c.charged_ns,
                    })
            });
            (seen, total)
        })
    }

    fn busy_now(&self) -> HashMap<u32, u64> {
        tessera_sim_state::read_processes(&self.node.sim_dir)
            .unwrap_or_default()
            .into_iter()
            .map(|p| (p.pid, p.busy_ns[0]))
            .collect()
    }

    /// Runs `mix` in `mode`. Every tenant's arrivals and kernel lengths come from a seed that
    /// is the same in every mode ([`seed`]): the rows of a mix differ by the scheduler, not by
    /// the draw (with a new draw per row, the `alone` p99 of one mix moved from 19.9 to 23.4 ms
    /// between runs, and the ratios with it).
    fn run(&self, mix: &Mix, mode: Mode) -> Row {
        let secs = self.seconds;
        let mut be = Vec::new();
        if mode != Mode::Alone {
            for (i, &share) in mix.best_effort.iter().enumerate() {
                let mut c = self.command(mode, share, false);
                let (lo, hi) = mix.be_kernel_us;
                c.args(["--seed", &seed(mix, 100 + i)])
                    .args(["--kernel-us", &lo.to_string()])
                    .args(["--kernel-us-max", &hi.to_string()])
                    .args(["--seconds", &format!("{}", secs + 2.0)]);
                be.push(Tenant::spawn(c));
            }
            // The best-effort tenants saturate the GPU before the first request.
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        let lat: Vec<Tenant> = mix
            .latency
            .iter()
            .enumerate()
            .map(|(i, &(share, gap_ms, kernels, kernel_us))| {
                let mut c = self.command(mode, share, true);
                c.args(["--seed", &seed(mix, i)])
                    .args(["--requests", &gap_ms.to_string()])
                    .args(["--request-kernels", &kernels.to_string()])
                    .args(["--kernel-us", &kernel_us.to_string()])
                    .args(["--seconds", &secs.to_string()]);
                Tenant::spawn(c)
            })
            .collect();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watcher = self.watch(stop.clone(), mode == Mode::Tier);
        let (t0, before) = (monotonic_ns(), self.busy_now());
        let lat_pids: Vec<u32> = lat.iter().map(|t| t.pid).collect();
        let be_pids: Vec<u32> = be.iter().map(|t| t.pid).collect();
        let (mut latencies, mut issues) = (Vec::new(), Vec::new());
        for t in lat {
            let lines = t.wait();
            let field = |key: &str| -> Vec<u64> {
                lines
                    .iter()
                    .filter_map(|l| l.strip_prefix(key)?.parse::<u64>().ok())
                    .collect()
            };
            latencies.extend(field("latency "));
            issues.extend(field("issue "));
        }
        // The best-effort tenants run on: their counters now, at the latency tenants' end.
        let (t1, after) = (monotonic_ns(), self.busy_now());
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (seen, arbiter) = watcher.join().expect("watcher");
        let used = |pids: &[u32]| -> u64 {
            pids.iter()
                .map(|p| {
                    let end = after.get(p).copied().or(seen.get(p).map(|s| s.0));
                    end.unwrap_or(0)
                        .saturating_sub(before.get(p).copied().unwrap_or(0))
                })
                .sum()
        };
        let (latency_busy, be_busy) = (used(&lat_pids), used(&be_pids));
        for t in be {
            t.wait();
        }
        latencies.sort_unstable();
        Row {
            mode,
            latencies,
            latency_busy,
            be_busy,
            wall: t1 - t0,
            arbiter,
            issues,
        }
    }
}

/// The `q` quantile (0..1) of sorted `v`, ms.
fn quantile_ms(v: &[u64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    v[i] as f64 / 1e6
}

fn print_mix(mix: &Mix, rows: &[Row]) {
    println!("\n{}", mix.name);
    println!(
        "{:<28} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>10} {:>14}",
        "",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "p50/alone",
        "p99/alone",
        "requests",
        "lat. GPU %",
        "BE of the rest"
    );
    let alone = rows.iter().find(|r| r.mode == Mode::Alone);
    for r in rows {
        let (p50, p99, p999) = (
            quantile_ms(&r.latencies, 0.5),
            quantile_ms(&r.latencies, 0.99),
            quantile_ms(&r.latencies, 0.999),
        );
        let ratio = |q: f64, v: f64| alone.map_or(f64::NAN, |a| v / quantile_ms(&a.latencies, q));
        let rest = r.wall.saturating_sub(r.latency_busy);
        let be = if r.mode == Mode::Alone {
            "-".to_owned()
        } else {
            format!("{:.1}%", r.be_busy as f64 / rest as f64 * 100.0)
        };
        println!(
            "{:<28} {:>8.2} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>8} {:>9.1}% {:>14}",
            r.mode.label(),
            p50,
            p99,
            p999,
            ratio(0.5, p50),
            ratio(0.99, p99),
            r.latencies.len(),
            r.latency_busy as f64 / r.wall as f64 * 100.0,
            be
        );
    }
    // Where a request's extra time goes under the tier: its launches' own time (the wait for
    // a lease, its round trip and revocation included, and for credits) against the extra
    // mean latency over `alone`; the rest is the GPU shared with best-effort work in flight
    // (alternate slices and their switches). The arbiter's counters say how many leases a
    // request took and what they were charged.
    if let (Some(a), Some(t)) = (alone, rows.iter().find(|r| r.mode == Mode::Tier)) {
        let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64 / 1e6;
        let extra = mean(&t.latencies) - mean(&a.latencies);
        let issue = mean(&t.issues) - mean(&a.issues);
        let n = t.latencies.len().max(1) as f64;
        let c = t.arbiter.unwrap_or_default();
        println!(
            "  tier, per request: mean latency +{extra:.2} ms over alone: launches +{issue:.3} ms \
             (lease and credits), the rest +{:.2} ms beside best-effort work in flight; \
             {:.2} leases; charged {:.2}x the latency tenants' busy time",
            extra - issue,
            c.leases as f64 / n,
            c.charged_ns as f64 / t.latency_busy.max(1) as f64,
        );
    }
}

fn main() {
    // `--seconds S` per row; `--linger-us U`: the arbiter's linger after a latency request
    // (its default, 0, unless given).
    let (mut seconds, mut linger_us, mut only) = (15.0_f64, 0_u64, None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().and_then(|v| v.parse::<f64>().ok());
        match (a.as_str(), v) {
            ("--seconds", Some(v)) if v > 0.0 => seconds = v,
            ("--linger-us", Some(v)) if v >= 0.0 => linger_us = v as u64,
            ("--mix", Some(v)) if (1.0..=3.0).contains(&v) => only = Some(v as usize),
            _ => {
                eprintln!("usage: {WHO} [--seconds S] [--linger-us U] [--mix 1|2|3]");
                std::process::exit(2);
            }
        }
    }
    let need = |n: &str| tessera_benches::need(WHO, n);
    let bench = Bench {
        tessera: need("tessera"),
        tenant: need("compute_tenant"),
        interposer: need("libtessera_interpose.so"),
        node: SimNode::start_with(
            WHO,
            "1x80GiB",
            &["--latency-linger-us", &format!("{linger_us}")],
        ),
        seconds,
    };
    let mixes = [
        Mix {
            name: "1 latency tenant (requests of 4 x 2 ms kernels, Poisson, mean gap 30 ms: \
                   27% load; share 60) + 1 best-effort (1-10 ms kernels, saturating; share 40)",
            latency: vec![(60, 30.0, 4, 2_000)],
            best_effort: vec![40],
            be_kernel_us: (1_000, 10_000),
        },
        Mix {
            name: "the same with short best-effort kernels (0.1-1 ms)",
            latency: vec![(60, 30.0, 4, 2_000)],
            best_effort: vec![40],
            be_kernel_us: (100, 1_000),
        },
        Mix {
            name: "2 latency tenants (4 x 1.5 ms per request, mean gap 40 ms: 15% load each; \
                   share 35 each) + 3 best-effort (1-10 ms kernels; share 10 each)",
            latency: vec![(35, 40.0, 4, 1_500), (35, 40.0, 4, 1_500)],
            best_effort: vec![10, 10, 10],
            be_kernel_us: (1_000, 10_000),
        },
    ];
    println!(
        "latency_tier: simulated GPU, time-slicing engine (1 ms slices, 50 us switches), {seconds} s per row, latency linger {linger_us} us"
    );
    for (i, mix) in mixes.iter().enumerate() {
        if only.is_some_and(|n| n != i + 1) {
            continue;
        }
        let rows: Vec<Row> = [Mode::Alone, Mode::Plain, Mode::Shares, Mode::Tier]
            .into_iter()
            .map(|m| bench.run(mix, m))
            .collect();
        print_mix(mix, &rows);
    }
    println!(
        "\nBE of the rest: the best-effort tenants' GPU time as a part of the wall time the \
         latency tenants did not use."
    );
}
