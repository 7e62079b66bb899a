//! flood_cgroups: a newcomer's first allocation beside a burst flood, with the flooders in the
//! newcomer's cgroup or in cgroups of their own (the arbiter's per-container admission).
//!
//! Starts the real `tessera-arbiter` on a simulated GPU for every run, then eight burst
//! flooders (`tessera-flood`: 32 token-less connections each, reconnecting with no pause, all
//! kinds of unfinished handshakes), waits until the arbiter holds the flood's connections, and
//! starts a newcomer: `mem_tenant hold` under the interposer, whose first act is its context
//! and one 64 MiB allocation. The figure is the newcomer's wall time from its start to its
//! exit (its first allocation done, or refused). Rows:
//!
//! - `no flood`: the newcomer alone (what start-up costs);
//! - `same cgroup`: flooders and newcomer in one cgroup (one pod flooding itself);
//! - `separate cgroups`: the flooders in one cgroup, the newcomer in another (a pod flooding a
//!   neighbour);
//! - `flooder per cgroup`: every flooder in a cgroup of its own, the newcomer in another;
//! - `flooder per sub-cgroup`: every flooder in a sub-cgroup of one pod's cgroup
//!   (`.../kubepods/burstable/pod<uid>/<n>`, what a pod with a delegated cgroup could make),
//!   the newcomer in another pod.
//!
//! Needs root and cgroup v2 (the cgroups are made under this process's own, and removed).
//!
//! Build and run: `cargo build -p tessera-benches -p tessera-arbiter -p tessera-interpose
//! -p tessera-testkit -p tessera-sim-cuda -p tessera-sim-nvml && target/debug/flood_cgroups
//! [--runs N] [--flooders N] [--only LAYOUT]` (or the same with `--release`).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_benches::{SimNode, exit_with_parent, need, tenant_field};
use tessera_protocol::node::ENV_TOKEN;
use tessera_protocol::{CreateAllocation, GpuSelector};
use tessera_testkit::cgroup::{Cgroup, TestCgroups};
use tessera_testkit::flood::raise_nofile;

const WHO: &str = "flood_cgroups";
/// Token-less connections each flooder keeps open (the per-pid pending cap).
const PER_FLOODER: usize = 32;

#[derive(Clone, Copy, PartialEq)]
enum Layout {
    NoFlood,
    Same,
    Separate,
    PerFlooder,
    SubCgroups,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Self::NoFlood => "no flood",
            Self::Same => "same cgroup",
            Self::Separate => "separate cgroups",
            Self::PerFlooder => "flooder per cgroup",
            Self::SubCgroups => "flooder per sub-cgroup",
        }
    }
}

/// What one run saw.
struct Run {
    first_alloc: Duration,
    granted: bool,
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn one_run(layout: Layout, flooders: usize) -> Run {
    let node = SimNode::start(WHO, "1x80GiB");
    let token = node
        .admin()
        .create(CreateAllocation {
            gpu: GpuSelector::Index(0),
            memory_limit: 4 << 30,
            share: 10,
            cap: None,
            labels: Default::default(),
        })
        .expect("create")
        .0;
    let mut cg = TestCgroups::new("flood-bench");
    let (flood_groups, victim): (Vec<Cgroup>, Cgroup) = match layout {
        Layout::NoFlood => (Vec::new(), cg.child("victim")),
        Layout::Same => {
            let g = cg.child("pod");
            (vec![g.clone(); flooders], g)
        }
        Layout::Separate => {
            let g = cg.child("flooders");
            (vec![g; flooders], cg.child("victim"))
        }
        Layout::PerFlooder => (
            (0..flooders)
                .map(|i| cg.child(&format!("flooder{i}")))
                .collect(),
            cg.child("victim"),
        ),
        Layout::SubCgroups => {
            // A node's cgroupfs-driver layout: kubepods/<class>/pod<uid>/<container>.
            for dir in [
                "kubepods",
                "kubepods/burstable",
                "kubepods/burstable/podflooder",
            ] {
                cg.child(dir);
            }
            let subs = (0..flooders)
                .map(|i| cg.child(&format!("kubepods/burstable/podflooder/ctr{i}")))
                .collect();
            cg.child("kubepods/burstable/podvictim");
            (subs, cg.child("kubepods/burstable/podvictim/ctr"))
        }
    };
    let flood_bin = need(WHO, "tessera-flood");
    let arbiter = node.arbiter_pid();
    let base_fds = open_fds(arbiter);
    let mut floods: Vec<Child> = flood_groups
        .iter()
        .map(|g| {
            let mut cmd = Command::new(&flood_bin);
            cmd.arg(&node.socket)
                .arg(PER_FLOODER.to_string())
                .arg("600")
                .arg("0")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            exit_with_parent(&mut cmd);
            g.join_at_exec(&mut cmd);
            cmd.spawn().expect("flood child")
        })
        .collect();
    if !floods.is_empty() {
        // The flood is on once the arbiter holds most of what one container may keep pending
        // (128 by default): its pending connections are descriptors of the arbiter.
        let start = Instant::now();
        while open_fds(arbiter) < base_fds + 100 {
            if start.elapsed() > Duration::from_secs(20) {
                eprintln!(
                    "{WHO}: the flood never reached the arbiter ({} descriptors)",
                    open_fds(arbiter)
                );
                std::process::exit(1);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let mut cmd = node.command(&need(WHO, "mem_tenant"));
    cmd.args([
        "hold",
        "--bytes",
        &(64u64 << 20).to_string(),
        "--seconds",
        "0",
    ])
    .env("LD_PRELOAD", need(WHO, "libtessera_interpose.so"))
    .env(ENV_TOKEN, &token)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    exit_with_parent(&mut cmd);
    victim.join_at_exec(&mut cmd);
    let t0 = Instant::now();
    let out = cmd.spawn().expect("newcomer").wait_with_output();
    let first_alloc = t0.elapsed();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let granted = text
        .lines()
        .any(|l| tenant_field(l, "grants").is_some_and(|g| g == 1));
    for f in &mut floods {
        let _ = f.kill();
        let _ = f.wait();
    }
    drop(cg);
    Run {
        first_alloc,
        granted,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn usage() -> ! {
    eprintln!("usage: {WHO} [--runs N] [--flooders N] [--only LAYOUT-NAME-PREFIX]");
    std::process::exit(2)
}

fn main() {
    raise_nofile();
    let (mut runs, mut flooders, mut only) = (5usize, 8usize, None::<String>);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| usage());
        let count = || {
            value
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .unwrap_or_else(|| usage())
        };
        match flag.as_str() {
            "--runs" => runs = count(),
            "--flooders" => flooders = count(),
            "--only" => only = Some(value.clone()),
            _ => usage(),
        }
    }
    let layouts = [
        Layout::NoFlood,
        Layout::Same,
        Layout::Separate,
        Layout::PerFlooder,
        Layout::SubCgroups,
    ]
    .into_iter()
    .filter(|l| {
        only.as_ref()
            .is_none_or(|o| l.name().starts_with(o.as_str()))
    });
    println!(
        "newcomer's first 64 MiB allocation (start to exit, ms) beside {flooders} burst \
         flooders x {PER_FLOODER} token-less connections, {runs} runs each"
    );
    println!(
        "{:<24} {:>10} {:>10} {:>10} {:>8}  runs (ms)",
        "layout", "median", "min", "max", "granted"
    );
    for layout in layouts {
        // Interleaved would spread a machine's load spikes over the rows; one row at a time
        // keeps each row's runs comparable and the output readable as it comes.
        let mut seen: Vec<Run> = (0..runs).map(|_| one_run(layout, flooders)).collect();
        seen.sort_by_key(|r| r.first_alloc);
        let all: Vec<String> = seen
            .iter()
            .map(|r| format!("{:.0}", ms(r.first_alloc)))
            .collect();
        println!(
            "{:<24} {:>10.1} {:>10.1} {:>10.1} {:>5}/{:<2}  {}",
            layout.name(),
            ms(seen[seen.len() / 2].first_alloc),
            ms(seen[0].first_alloc),
            ms(seen[seen.len() - 1].first_alloc),
            seen.iter().filter(|r| r.granted).count(),
            seen.len(),
            all.join(" ")
        );
    }
}
