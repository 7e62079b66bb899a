//! The cap rows: a tenant capped at 30% alone, and two capped 30 and 70 side by side, each
//! saturating the simulated GPU with 1 ms kernels (`compute_tenant`, as `compute_share` runs
//! it) under `tessera run --share N --cap`. The figure is each tenant's GPU time in percent of
//! the wall time, from the simulated engine's per-process busy counters (ground truth, not
//! what the interposer reports), over a measured stretch after a warm-up. A cap is a
//! ceiling, not a discount: the target is the cap less at most a point, and no more than the
//! cap plus the cap window's half point of slack.
//!
//! Side by side, two caps that add up to 100 leave no idle GPU time to fill: leases do not
//! overlap, so each tenant's own idle inside its leases (its synchronises) is lost to both,
//! and what a cap promises there is the split: each tenant's part of their GPU time within a
//! point of 30/70 (their % of wall is printed beside it).
//!
//! No control has no cap, so that column shows what the same tenants get uncontrolled: alone
//! the whole GPU, side by side the GPU's round robin. The grid size does not enter: Tessera
//! charges GPU time, not launched blocks.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use tessera_benches::{SimNode, Tenant, need};
use tessera_sim_state::clock::monotonic_ns;

use crate::{Args, Row, median_range};

/// Warm-up before the measured stretch, s (the tenants start, the first leases settle).
const WARM_S: f64 = 1.0;
/// The measured stretch, s (the cap window is 1 s).
const MEASURE_S: f64 = 8.0;
/// Above the cap: the cap window's slack (5 ms of every second).
const SLACK_PT: f64 = 0.5;

struct Bed {
    node: SimNode,
    tessera: PathBuf,
    tenant: PathBuf,
    interposer: PathBuf,
}

impl Bed {
    fn start() -> Self {
        Self {
            node: SimNode::start("speed", "1x80GiB"),
            tessera: need("speed", "tessera"),
            tenant: need("speed", "compute_tenant"),
            interposer: need("speed", "libtessera_interpose.so"),
        }
    }

    /// A saturating tenant: under `tessera run --share N --cap` (`Some(N)`), or bare.
    fn tenant(&self, share: Option<u32>) -> Tenant {
        let mut cmd: Command = match share {
            Some(n) => {
                let mut c = self.node.command(&self.tessera);
                // Room for the tenant's context (contexts count against the limit).
                c.args(["run", "--memory", "512MiB", "--share", &n.to_string()])
                    .args(["--gpu", "0", "--cap", "--interposer"])
                    .arg(&self.interposer)
                    .arg("--")
                    .arg(&self.tenant);
                c
            }
            None => self.node.command(&self.tenant),
        };
        let seconds = WARM_S + MEASURE_S + 1.0;
        cmd.args(["--kernel-us", "1000", "--seconds", &seconds.to_string()]);
        Tenant::spawn(cmd)
    }

    /// Runs the tenants (`Some(share)` capped at it, `None` bare) side by side; each one's GPU
    /// time over the measured stretch, percent of its wall time.
    fn run(&self, shares: &[Option<u32>]) -> Vec<f64> {
        let tenants: Vec<Tenant> = shares.iter().map(|s| self.tenant(*s)).collect();
        std::thread::sleep(Duration::from_secs_f64(WARM_S));
        let busy = |pid: u32| -> u64 {
            tessera_sim_state::read_processes(&self.node.sim_dir)
                .unwrap_or_default()
                .iter()
                .find(|p| p.pid == pid)
                .map_or(0, |p| p.busy_ns.iter().sum())
        };
        let (t0, b0): (u64, Vec<u64>) = (
            monotonic_ns(),
            tenants.iter().map(|t| busy(t.pid)).collect(),
        );
        std::thread::sleep(Duration::from_secs_f64(MEASURE_S));
        let (t1, b1): (u64, Vec<u64>) = (
            monotonic_ns(),
            tenants.iter().map(|t| busy(t.pid)).collect(),
        );
        for t in tenants {
            t.wait();
        }
        b0.iter()
            .zip(&b1)
            .map(|(a, b)| b.saturating_sub(*a) as f64 * 100.0 / (t1 - t0) as f64)
            .collect()
    }
}

/// The row of one tenant: its GPU time under Tessera against `cap`, uncontrolled beside.
fn row(figure: String, cap: u32, bare: &[f64], capped: &[f64]) -> Row {
    let (_, baseline) = median_range(bare, 1);
    let (m, tessera) = median_range(capped, 1);
    let cap = f64::from(cap);
    Row {
        figure,
        baseline,
        tessera,
        target: format!(
            "{:.1}-{:.1} (cap - 1 pt to cap + slack)",
            cap - 1.0,
            cap + SLACK_PT
        ),
        met: (cap - 1.0..=cap + SLACK_PT).contains(&m),
    }
}

/// The row of one tenant of a pair: its part of the pair's GPU time under Tessera against
/// `cap` (within a point), uncontrolled beside; `wall` is its % of wall time under Tessera.
fn split_row(figure: String, cap: u32, bare: &[f64], capped: &[f64], wall: &[f64]) -> Row {
    let (_, baseline) = median_range(bare, 1);
    let (m, tessera) = median_range(capped, 1);
    let (_, wall) = median_range(wall, 1);
    let cap = f64::from(cap);
    Row {
        figure,
        baseline,
        tessera: format!("{tessera} ({wall} % of wall)"),
        target: format!("{:.1}-{:.1} (cap +- 1 pt)", cap - 1.0, cap + 1.0),
        met: (cap - 1.0..=cap + 1.0).contains(&m),
    }
}

/// Each tenant's part of the pair's GPU time, percent.
fn split(pair: &[f64]) -> (f64, f64) {
    let sum = (pair[0] + pair[1]).max(f64::MIN_POSITIVE);
    (pair[0] * 100.0 / sum, pair[1] * 100.0 / sum)
}

/// The cap rows, no control and Tessera interleaved in each repeat.
pub(crate) fn rows(args: &Args) -> Vec<Row> {
    let bed = Bed::start();
    let (mut alone_bare, mut alone) = (Vec::new(), Vec::new());
    let (mut pair_bare, mut pair) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
    let mut pair_wall = (Vec::new(), Vec::new());
    for _ in 0..args.repeats {
        alone_bare.push(bed.run(&[None])[0]);
        alone.push(bed.run(&[Some(30)])[0]);
        let b = split(&bed.run(&[None, None]));
        pair_bare.0.push(b.0);
        pair_bare.1.push(b.1);
        let wall = bed.run(&[Some(30), Some(70)]);
        let c = split(&wall);
        pair.0.push(c.0);
        pair.1.push(c.1);
        pair_wall.0.push(wall[0]);
        pair_wall.1.push(wall[1]);
    }
    let s = format!("{MEASURE_S:.0} s, 1 ms kernels");
    vec![
        row(
            format!("cap 30 alone, % of wall ({s})"),
            30,
            &alone_bare,
            &alone,
        ),
        split_row(
            format!("capped 30/70: the 30's part of their GPU time, % ({s})"),
            30,
            &pair_bare.0,
            &pair.0,
            &pair_wall.0,
        ),
        split_row(
            format!("capped 30/70: the 70's part of their GPU time, % ({s})"),
            70,
            &pair_bare.1,
            &pair.1,
            &pair_wall.1,
        ),
    ]
}
