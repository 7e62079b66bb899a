//! compute_share: how well Tessera splits GPU time, measured on the simulated GPU.
//!
//! Starts the real `tessera-arbiter` on a simulated 80 GiB GPU (in a temp folder), runs
//! `compute_tenant` programs (1 ms kernels) under `tessera run --share N [--cap]`, and takes
//! each tenant's GPU time from the simulated engine's per-process busy counters (ground truth,
//! independent of what the interposer reports). Prints one table:
//! - 30/70 over 10 s, and the worst 1 s window;
//! - 20/30/50 with join and leave (A=20 and B=30 run throughout, C=50 joins at 3 s and leaves
//!   at 7 s);
//! - cap 30% alone (fraction of wall time);
//! - capped competition (30/70 both capped, 45/45 both capped, capped 30 vs uncapped 70): each
//!   tenant's GPU time, the worst 1 s window of each capped one, and the split;
//! - idle-reclaim latency p50/p90/p99/max (a bursty tenant goes idle; how long until the waiting
//!   tenant's launch is let through);
//! - total GPU busy with and without Tessera (two tenants, 30/70);
//! - a tenant whose queue drains at every step (with and without host work) against a
//!   free-running one, 50/50: its part of the busy time;
//! - a 2-GPU allocation, share 30 on each GPU with one rank per GPU (as tensor-parallel ranks
//!   run), against a share-70 tenant on each GPU: each GPU's split (on two simulated GPUs).
//!
//! Build and run: `cargo build --release --workspace && target/release/compute_share`
//! (`--scale 0.5` halves every duration; `--only idle,cap` runs some scenarios: `split`, `join`,
//! `cap`, `capped`, `idle`, `total`, `sync`, `multi`). Everything it needs is found next to it.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;
use std::time::Duration;

use tessera_protocol::client::AdminClient;
use tessera_sim_state::clock::monotonic_ns;

const SEC: u64 = 1_000_000_000;

struct Bench {
    node: tessera_benches::SimNode,
    tessera: PathBuf,
    tenant: PathBuf,
    interposer: PathBuf,
    scale: f64,
}

use tessera_benches::Tenant;

/// One sample of every process's cumulative busy time.
struct Sample {
    t: u64,
    busy: HashMap<u32, u64>,
    device: u64,
}

struct Sampler {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<Mutex<bool>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(sim_dir: &Path) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(Mutex::new(false));
        let (s, st, dir) = (
            Arc::clone(&samples),
            Arc::clone(&stop),
            sim_dir.to_path_buf(),
        );
        let handle = std::thread::spawn(move || {
            while !*st.lock() {
                let before = monotonic_ns();
                let procs = tessera_sim_state::read_processes(&dir).unwrap_or_default();
                // Every tenant runs on one GPU: its busy time on all of them is its GPU's.
                let busy = procs
                    .iter()
                    .map(|p| (p.pid, p.busy_ns.iter().sum()))
                    .collect();
                let device = tessera_sim_state::device_busy_ns(&dir, 0);
                let t = monotonic_ns();
                // A read the scheduler interrupted does not say when its counters were
                // taken (on a loaded machine by tens of ms, enough to move a 1 s window's
                // figure by points): skip it, the next one comes 20 ms later.
                if t - before <= 2_000_000 {
                    s.lock().push(Sample { t, busy, device });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Self {
            samples,
            stop,
            handle: Some(handle),
        }
    }

    fn finish(mut self) -> Vec<Sample> {
        *self.stop.lock() = true;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        std::mem::take(&mut *self.samples.lock())
    }
}

/// Busy ns of `pid` between the samples nearest to `t0` and `t1`.
fn busy_between(s: &[Sample], pid: Option<u32>, t0: u64, t1: u64) -> (u64, u64) {
    let at = |t: u64| s.iter().min_by_key(|x| x.t.abs_diff(t)).expect("samples");
    let (a, b) = (at(t0), at(t1));
    let v = |x: &Sample| match pid {
        Some(p) => x.busy.get(&p).copied().unwrap_or(0),
        None => x.device,
    };
    (v(b).saturating_sub(v(a)), b.t - a.t)
}

/// Whether samples lie within 25 ms of both ends of the 1 s window from `t0`. When the sampler
/// was descheduled, the samples nearest to the ends make a shorter or longer window, and a
/// short one over a tenant's burst reads high: such windows are skipped.
fn covered(s: &[Sample], t0: u64) -> bool {
    let near = |t: u64| s.iter().any(|x| x.t.abs_diff(t) <= 25_000_000);
    near(t0) && near(t0 + SEC)
}

/// `pid`'s busy time in the 1 s window from `t0`, in percent (`None`: not [`covered`]).
fn window_pct(s: &[Sample], pid: u32, t0: u64) -> Option<f64> {
    if !covered(s, t0) {
        return None;
    }
    let (x, wall) = busy_between(s, Some(pid), t0, t0 + SEC);
    Some(pct(x, wall))
}

impl Bench {
    fn start(scale: f64) -> Self {
        let need = |name| tessera_benches::need("compute_share", name);
        let (tessera, tenant, interposer) = (
            need("tessera"),
            need("compute_tenant"),
            need("libtessera_interpose.so"),
        );
        // Two GPUs for the multi-GPU scenario; the others use GPU 0 only.
        let node = tessera_benches::SimNode::start("compute_share", "2x80GiB");
        Self {
            node,
            tessera,
            tenant,
            interposer,
            scale,
        }
    }

    fn secs(&self, s: f64) -> f64 {
        s * self.scale
    }

    /// Starts a tenant: under `tessera run --share N [--cap]`, or bare (no Tessera) when
    /// `share` is None.
    fn tenant(&self, share: Option<u32>, cap: bool, args: &[String]) -> Tenant {
        self.tenant_on(0, share, cap, args)
    }

    /// [`Bench::tenant`] on GPU `gpu`.
    fn tenant_on(&self, gpu: u32, share: Option<u32>, cap: bool, args: &[String]) -> Tenant {
        let mut cmd = match share {
            Some(n) => {
                let mut c = self.node.command(&self.tessera);
                // Room for the tenant's context (300 MiB: contexts count against the limit).
                c.args(["run", "--memory", "512MiB", "--share", &n.to_string()])
                    .args(["--gpu", &gpu.to_string()]);
                if cap {
                    c.arg("--cap");
                }
                c.arg("--interposer")
                    .arg(&self.interposer)
                    .arg("--")
                    .arg(&self.tenant);
                c
            }
            None => self.node.command(&self.tenant),
        };
        cmd.args(args);
        Tenant::spawn(cmd)
    }

    fn continuous(&self, seconds: f64) -> Vec<String> {
        vec![
            "--kernel-us".into(),
            "1000".into(),
            "--seconds".into(),
            format!("{seconds}"),
        ]
    }

    /// GPU time the arbiter charged each tenant (`(share, capped)`, matched in order to the
    /// allocations listed) over the last 10 s, in percent of 10 s.
    fn charged_per_tenant(&self, tenants: &[(u32, bool)]) -> Vec<f64> {
        let mut list = AdminClient::connect(&self.node.admin_socket)
            .and_then(|mut a| a.list())
            .unwrap_or_default();
        tenants
            .iter()
            .map(|&(share, cap)| {
                let i = list
                    .iter()
                    .position(|a| a.share == share && a.cap.is_some() == cap);
                i.map_or(0.0, |i| pct(list.remove(i).gpu_time_10s_ns, 10 * SEC))
            })
            .collect()
    }

    /// GPU time the arbiter charged over the last 10 s, summed over allocations.
    fn charged_10s(&self) -> u64 {
        AdminClient::connect(&self.node.admin_socket)
            .and_then(|mut a| a.list())
            .map(|l| l.iter().map(|a| a.gpu_time_10s_ns).sum())
            .unwrap_or(0)
    }
}

fn pct(x: u64, total: u64) -> f64 {
    pct_f(x as f64, total as f64)
}

/// `x` in percent of `total` (0 when `total` is not positive).
fn pct_f(x: f64, total: f64) -> f64 {
    if total <= 0.0 { 0.0 } else { x * 100.0 / total }
}

/// Fractions of the busy time of `pids` over [t0, t1], in percent of their total.
fn split(s: &[Sample], pids: &[u32], t0: u64, t1: u64) -> Vec<f64> {
    let b: Vec<u64> = pids
        .iter()
        .map(|p| busy_between(s, Some(*p), t0, t1).0)
        .collect();
    let total: u64 = b.iter().sum();
    b.iter().map(|x| pct(*x, total)).collect()
}

fn fmt_split(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.1}"))
        .collect::<Vec<_>>()
        .join("/")
}

fn max_err(got: &[f64], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f64::max)
}

struct Row(String, String, String, String);

fn scenario_30_70(b: &Bench, rows: &mut Vec<Row>) -> (f64, bool) {
    let len = b.secs(10.0);
    let sampler = Sampler::start(&b.node.sim_dir);
    let t1 = b.tenant(Some(30), false, &b.continuous(len + 1.5));
    let t2 = b.tenant(Some(70), false, &b.continuous(len + 1.5));
    std::thread::sleep(Duration::from_millis(500));
    let start = monotonic_ns();
    std::thread::sleep(Duration::from_secs_f64(len));
    let end = monotonic_ns();
    let charged = b.charged_10s();
    let samples = sampler.finish();
    let (pids, want) = ([t1.pid, t2.pid], [30.0, 70.0]);
    let whole = split(&samples, &pids, start, end);
    let mut worst = whole.clone();
    let mut t = start;
    while t + SEC <= end {
        let w = split(&samples, &pids, t, t + SEC);
        if covered(&samples, t) && max_err(&w, &want) > max_err(&worst, &want) {
            worst = w;
        }
        t += SEC / 2;
    }
    let (dev, wall) = busy_between(&samples, None, start, end);
    t1.wait();
    t2.wait();
    rows.push(Row(
        format!("30/70, {len:.0} s"),
        "30.0/70.0".into(),
        format!("{} (worst 1 s: {})", fmt_split(&whole), fmt_split(&worst)),
        format!(
            "{:.1} pt (worst 1 s {:.1} pt)",
            max_err(&whole, &want),
            max_err(&worst, &want)
        ),
    ));
    (pct(dev, wall), charged > 0)
}

/// A tenant whose queue drains at every step (it waits for each kernel; then, in the second
/// row, works 0.6 ms on the host) against a free-running one, both share 50: drains and host
/// work must not be taken for idleness (an early hand-back at every step would give most of
/// the GPU to the other). With the host work, the synchroniser leaves the GPU idle for part of
/// its turns, so its fair part of the busy time is below half.
fn scenario_sync(b: &Bench, rows: &mut Vec<Row>) {
    for (what, host_us, target) in [
        ("sync every launch vs free-running, 50/50", "0", ">= 40.0"),
        ("sync + 0.6 ms host work vs free-running", "600", ">= 33.0"),
    ] {
        let len = b.secs(10.0);
        let sampler = Sampler::start(&b.node.sim_dir);
        let mut sync_args = b.continuous(len + 1.5);
        sync_args.extend(["--sync".into(), "--host-us".into(), host_us.into()]);
        let a = b.tenant(Some(50), false, &sync_args);
        let free = b.tenant(Some(50), false, &b.continuous(len + 1.5));
        std::thread::sleep(Duration::from_millis(500));
        let start = monotonic_ns();
        std::thread::sleep(Duration::from_secs_f64(len));
        let end = monotonic_ns();
        let samples = sampler.finish();
        let got = split(&samples, &[a.pid, free.pid], start, end);
        a.wait();
        free.wait();
        rows.push(Row(
            what.into(),
            target.into(),
            format!("{:.1} (A's part of the busy time)", got[0]),
            "-".into(),
        ));
    }
}

fn scenario_join_leave(b: &Bench, rows: &mut Vec<Row>) {
    let (p1, p2, total) = (b.secs(3.0), b.secs(7.0), b.secs(10.0));
    let sampler = Sampler::start(&b.node.sim_dir);
    let ta = b.tenant(Some(20), false, &b.continuous(total + 1.5));
    let tb = b.tenant(Some(30), false, &b.continuous(total + 1.5));
    std::thread::sleep(Duration::from_millis(500));
    let start = monotonic_ns();
    let at = |s: f64| start + (s * SEC as f64) as u64;
    std::thread::sleep(Duration::from_secs_f64(p1));
    let tc = b.tenant(Some(50), false, &b.continuous(p2 - p1));
    let c_pid = tc.pid;
    let joined = monotonic_ns();
    tc.wait();
    let left = monotonic_ns();
    std::thread::sleep(Duration::from_secs_f64(total - p2));
    let end = monotonic_ns();
    let samples = sampler.finish();
    // Skip 0.3 s after each change so the phases do not blur.
    let settle = 300_000_000;
    let phases = [
        (
            "A,B before C joins",
            vec![ta.pid, tb.pid],
            vec![40.0, 60.0],
            start,
            at(p1),
        ),
        // C's counters vanish when it exits: end the phase a little before.
        (
            "A,B,C",
            vec![ta.pid, tb.pid, c_pid],
            vec![20.0, 30.0, 50.0],
            joined + settle,
            left - settle,
        ),
        (
            "A,B after C left",
            vec![ta.pid, tb.pid],
            vec![40.0, 60.0],
            left + settle,
            end,
        ),
    ];
    for (name, pids, want, t0, t1) in phases {
        let got = split(&samples, &pids, t0, t1);
        rows.push(Row(
            format!("20/30/50 join/leave: {name}"),
            fmt_split(&want),
            fmt_split(&got),
            format!("{:.1} pt", max_err(&got, &want)),
        ));
    }
    ta.wait();
    tb.wait();
}

fn scenario_cap(b: &Bench, rows: &mut Vec<Row>) {
    let len = b.secs(10.0);
    let sampler = Sampler::start(&b.node.sim_dir);
    let t = b.tenant(Some(30), true, &b.continuous(len + 1.5));
    std::thread::sleep(Duration::from_millis(500));
    let start = monotonic_ns();
    std::thread::sleep(Duration::from_secs_f64(len));
    let end = monotonic_ns();
    let samples = sampler.finish();
    let (busy, wall) = busy_between(&samples, Some(t.pid), start, end);
    let mut worst = 0.0f64;
    let mut w = start;
    while w + SEC <= end {
        if let Some(x) = window_pct(&samples, t.pid, w) {
            worst = worst.max(x);
        }
        w += SEC / 2;
    }
    t.wait();
    rows.push(Row(
        format!("cap 30% alone, {len:.0} s"),
        "<= 30.0".into(),
        format!("{:.1} (worst 1 s: {worst:.1})", pct(busy, wall)),
        format!("{:+.1} pt over", pct(busy, wall) - 30.0),
    ));
}

/// Capped competition: every tenant saturates the GPU for 10 s under `--share N [--cap]`
/// (`(share, capped)` each). Per tenant: its GPU time in percent of wall time, and for a capped
/// one the worst 1 s window (sliding by 0.1 s; the cap is a ceiling in every window); then the
/// split of the busy time, which the shares decide (the caps here never ask for less).
fn scenario_capped(b: &Bench, rows: &mut Vec<Row>, tenants: &[(u32, bool)]) {
    let len = b.secs(10.0);
    let sampler = Sampler::start(&b.node.sim_dir);
    let running: Vec<Tenant> = tenants
        .iter()
        .map(|&(share, cap)| b.tenant(Some(share), cap, &b.continuous(len + 1.5)))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let start = monotonic_ns();
    std::thread::sleep(Duration::from_secs_f64(len));
    let end = monotonic_ns();
    let charged = b.charged_per_tenant(tenants);
    let samples = sampler.finish();
    let pids: Vec<u32> = running.iter().map(|t| t.pid).collect();
    let name = tenants
        .iter()
        .map(|&(s, c)| format!("{s}{}", if c { " capped" } else { "" }))
        .collect::<Vec<_>>()
        .join(" vs ");
    let mut got = Vec::new();
    let mut worst_over = 0.0f64;
    for (&(share, cap), &pid) in tenants.iter().zip(&pids) {
        let (busy, wall) = busy_between(&samples, Some(pid), start, end);
        let mut part = format!("{share}: {:.1}", pct(busy, wall));
        if cap {
            let mut worst = 0.0f64;
            let mut w = start;
            while w + SEC <= end {
                if let Some(x) = window_pct(&samples, pid, w) {
                    worst = worst.max(x);
                }
                w += SEC / 10;
            }
            worst_over = worst_over.max(worst - f64::from(share));
            part.push_str(&format!(" (worst 1 s {worst:.1})"));
        }
        got.push(part);
    }
    let total: f64 = tenants.iter().map(|t| f64::from(t.0)).sum();
    let want: Vec<f64> = tenants
        .iter()
        .map(|t| f64::from(t.0) * 100.0 / total)
        .collect();
    let split_now = split(&samples, &pids, start, end);
    for t in running {
        t.wait();
    }
    rows.push(Row(
        format!("{name}, {len:.0} s"),
        format!("cap +1 pt, {}", fmt_split(&want)),
        format!(
            "{}; split {}; charged (last 10 s) {}",
            got.join(", "),
            fmt_split(&split_now),
            fmt_split(&charged)
        ),
        format!(
            "cap {worst_over:+.1} pt worst 1 s, split {:.1} pt",
            max_err(&split_now, &want)
        ),
    ));
}

fn scenario_idle_reclaim(b: &Bench, rows: &mut Vec<Row>) {
    // 20 s: about 450 hand-overs, so p99 is not just the second-worst of ~130.
    let len = b.secs(20.0);
    // A: 3 x 1 ms kernels then 40 ms idle, repeatedly (always hands back early).
    // B: busy all the time, so it is waiting whenever A holds the GPU.
    let bursty = vec![
        "--kernel-us".into(),
        "1000".into(),
        "--seconds".into(),
        format!("{len}"),
        "--burst".into(),
        "3".into(),
        "--idle-ms".into(),
        "40".into(),
    ];
    let tb = b.tenant(Some(50), false, &b.continuous(len + 1.0));
    let ta = b.tenant(Some(50), false, &bursty);
    let a_lines = ta.wait();
    let b_lines = tb.wait();
    let idle: Vec<u64> = a_lines
        .iter()
        .filter_map(|l| l.strip_prefix("idle ").and_then(|v| v.parse().ok()))
        .collect();
    // (start, end) of each of B's waits for a lease.
    let waits: Vec<(u64, u64)> = b_lines
        .iter()
        .filter_map(|l| {
            let mut it = l.strip_prefix("unblocked ")?.split(' ');
            let end: u64 = it.next()?.parse().ok()?;
            let waited: u64 = it.next()?.parse().ok()?;
            Some((end - waited, end))
        })
        .collect();
    let mut lat: Vec<u64> = idle
        .iter()
        .filter_map(|&t| reclaim_latency(&waits, t))
        .collect();
    lat.sort_unstable();
    let q = |p: f64| {
        lat.get(((lat.len() as f64 - 1.0) * p).round() as usize)
            .copied()
    };
    let ms = |v: Option<u64>| v.map_or("n/a".into(), |v| format!("{:.2} ms", v as f64 / 1e6));
    rows.push(Row(
        "idle reclaim latency".into(),
        "p99 <= 2 ms".into(),
        format!(
            "p50 {} p90 {} p99 {} max {}",
            ms(q(0.5)),
            ms(q(0.9)),
            ms(q(0.99)),
            ms(q(1.0))
        ),
        format!(
            "{} hand-overs of {} idle points ({} before the holder's sync returned)",
            lat.len(),
            idle.len(),
            lat.iter().take_while(|l| **l == 0).count()
        ),
    ));
}

/// How long after the holder's idle point `t` the waiting tenant's launch went through: B's
/// last wait that began before `t`, if it ended after the holder's burst began (A's bursts
/// last 3 ms; a wait ending earlier belongs to an earlier hand-over). A wait that ended before
/// `t` counts 0: the hand-over beat the holder's own thread back from its synchronise.
/// `None`: B was not waiting (nothing to reclaim).
fn reclaim_latency(waits: &[(u64, u64)], t: u64) -> Option<u64> {
    const BURST_NS: u64 = 3_000_000;
    let &(_, end) = waits.iter().filter(|w| w.0 < t).max_by_key(|w| w.0)?;
    (end + BURST_NS >= t).then(|| end.saturating_sub(t))
}

fn scenario_no_control(b: &Bench) -> (f64, Vec<f64>) {
    let len = b.secs(5.0);
    let sampler = Sampler::start(&b.node.sim_dir);
    let t1 = b.tenant(None, false, &b.continuous(len + 1.5));
    let t2 = b.tenant(None, false, &b.continuous(len + 1.5));
    std::thread::sleep(Duration::from_millis(500));
    let start = monotonic_ns();
    std::thread::sleep(Duration::from_secs_f64(len));
    let end = monotonic_ns();
    let samples = sampler.finish();
    let (dev, wall) = busy_between(&samples, None, start, end);
    let s = split(&samples, &[t1.pid, t2.pid], start, end);
    t1.wait();
    t2.wait();
    (pct(dev, wall), s)
}

/// Names accepted by `--only`.
const SCENARIOS: [&str; 8] = [
    "split", "join", "cap", "capped", "idle", "total", "sync", "multi",
];

/// A 2-GPU allocation, share 30 on each GPU, with one rank per GPU (each rank sees only its
/// GPU, under the allocation's one token, as tensor-parallel ranks run), against a share-70
/// tenant of its own on each GPU: each GPU's split of its busy time.
fn scenario_multi(b: &Bench, rows: &mut Vec<Row>) {
    let len = b.secs(10.0);
    let mut admin = b.node.admin();
    let uuids: Vec<String> = admin
        .gpus()
        .expect("GPU list")
        .into_iter()
        .map(|g| g.uuid)
        .collect();
    let slices = (0..2)
        .map(|i| tessera_protocol::CreateAllocation {
            gpu: tessera_protocol::GpuSelector::Index(i),
            memory_limit: 512 << 20,
            share: 30,
            cap: None,
            labels: Default::default(),
        })
        .collect();
    let (token, allocs) = admin
        .create_group(slices, None)
        .expect("a 2-GPU allocation");
    drop(admin);
    let sampler = Sampler::start(&b.node.sim_dir);
    let ranks: Vec<Tenant> = uuids
        .iter()
        .take(2)
        .map(|uuid| {
            let mut cmd = b.node.command(&b.tenant);
            cmd.env("LD_PRELOAD", &b.interposer)
                .env(tessera_protocol::node::ENV_SOCKET, &b.node.socket)
                .env(tessera_protocol::node::ENV_TOKEN, &token)
                .env("CUDA_VISIBLE_DEVICES", uuid)
                .args(b.continuous(len + 1.5));
            Tenant::spawn(cmd)
        })
        .collect();
    let rivals: Vec<Tenant> = (0..2)
        .map(|gpu| b.tenant_on(gpu, Some(70), false, &b.continuous(len + 1.5)))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let start = monotonic_ns();
    std::thread::sleep(Duration::from_secs_f64(len));
    let end = monotonic_ns();
    let samples = sampler.finish();
    let want = [30.0, 70.0];
    for (gpu, (rank, rival)) in ranks.iter().zip(&rivals).enumerate() {
        let got = split(&samples, &[rank.pid, rival.pid], start, end);
        rows.push(Row(
            format!("2-GPU allocation 30 vs 70, GPU {gpu}, {len:.0} s"),
            "30.0/70.0".into(),
            fmt_split(&got),
            format!("{:.1} pt", max_err(&got, &want)),
        ));
    }
    for t in ranks.into_iter().chain(rivals) {
        t.wait();
    }
    let mut admin = b.node.admin();
    for a in allocs {
        let _ = admin.delete(&a.id);
    }
}

fn main() {
    let mut scale = 1.0;
    let mut only: Option<Vec<String>> = None;
    let usage = "usage: compute_share [--scale F] [--only NAME[,NAME...]]\n  \
                 scenarios: split, join, cap, capped, idle, total, sync, multi (total runs split too)";
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--scale" => {
                scale = args.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
                    eprintln!("compute_share: --scale needs a number\n{usage}");
                    std::process::exit(2)
                })
            }
            "--only" => {
                let names: Vec<String> = args
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned)
                    .collect();
                if names.is_empty() || names.iter().any(|n| !SCENARIOS.contains(&n.as_str())) {
                    eprintln!("compute_share: --only needs scenario names\n{usage}");
                    std::process::exit(2);
                }
                only = Some(names);
            }
            "-h" | "--help" => {
                println!("{usage}");
                return;
            }
            _ => {
                eprintln!("{usage}");
                std::process::exit(2);
            }
        }
    }
    let runs = |name: &str| only.as_ref().is_none_or(|o| o.iter().any(|n| n == name));
    let bench = Bench::start(scale);
    let mut rows = Vec::new();
    let mut gated = true;
    let mut busy_ctl = None;
    if runs("split") || runs("total") {
        let (busy, g) = scenario_30_70(&bench, &mut rows);
        busy_ctl = Some(busy);
        gated = g;
    }
    if runs("join") {
        scenario_join_leave(&bench, &mut rows);
    }
    if runs("cap") {
        scenario_cap(&bench, &mut rows);
    }
    if runs("capped") {
        scenario_capped(&bench, &mut rows, &[(30, true), (70, true)]);
        scenario_capped(&bench, &mut rows, &[(45, true), (45, true)]);
        scenario_capped(&bench, &mut rows, &[(30, true), (70, false)]);
    }
    if runs("idle") {
        scenario_idle_reclaim(&bench, &mut rows);
    }
    if runs("sync") {
        scenario_sync(&bench, &mut rows);
    }
    if runs("multi") {
        scenario_multi(&bench, &mut rows);
    }
    if runs("total") {
        let (busy_free, free_split) = scenario_no_control(&bench);
        let busy_ctl = busy_ctl.unwrap_or(0.0);
        rows.push(Row(
            "total GPU busy, 30/70 with Tessera".into(),
            ">= 95% of no ctl".into(),
            format!("{busy_ctl:.1}% of wall"),
            format!(
                "{:.1}% of no control ({:+.1} pt)",
                pct_f(busy_ctl, busy_free),
                busy_ctl - busy_free
            ),
        ));
        rows.push(Row(
            "total GPU busy, 2 tenants, no control".into(),
            "-".into(),
            format!("{busy_free:.1}% (split {})", fmt_split(&free_split)),
            "-".into(),
        ));
    }

    let w = [40, 15, 44, 30];
    println!(
        "Tessera compute sharing on the simulated GPU (1 ms kernels, shares = tessera run --share)"
    );
    println!(
        "{:<a$} {:<b$} {:<c$} {:<d$}",
        "scenario",
        "target",
        "measured (% of GPU busy time)",
        "error",
        a = w[0],
        b = w[1],
        c = w[2],
        d = w[3]
    );
    for Row(a, b2, c, d) in &rows {
        println!(
            "{a:<x$} {b2:<y$} {c:<z$} {d:<v$}",
            x = w[0],
            y = w[1],
            z = w[2],
            v = w[3]
        );
    }
    if !gated {
        println!(
            "\nNOTE: the arbiter charged no GPU time: the interposer in {} did not ask for \
             compute leases, so these splits are uncontrolled.",
            bench.interposer.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::reclaim_latency;

    const MS: u64 = 1_000_000;

    #[test]
    fn each_idle_point_is_matched_with_the_wait_it_ended() {
        // B waited 10-13.4 ms (A's burst), then 56-59.2 ms; a refill wait at 40-40.3 ms.
        let waits = [
            (10 * MS, 13_400_000),
            (40 * MS, 40_300_000),
            (56 * MS, 59_200_000),
        ];
        assert_eq!(reclaim_latency(&waits, 13 * MS), Some(400_000));
        // Handed over before the holder's thread came back from its synchronise: 0.
        assert_eq!(reclaim_latency(&waits, 59_500_000), Some(0));
        // The last wait before t ended long before: B was not waiting.
        assert_eq!(reclaim_latency(&waits, 50 * MS), None);
        // Nothing before t at all.
        assert_eq!(reclaim_latency(&waits, 5 * MS), None);
    }
}
