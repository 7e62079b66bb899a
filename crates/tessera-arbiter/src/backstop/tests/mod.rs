//! The backstop's tests, by concern: `attribution` (who a process belongs to, the memory rule),
//! `compute` (the compute book: leases against NVML's GPU time), `service` (a poll end to end
//! over fake readings and a recording killer, `/proc` reading, identity files, kills). The
//! helpers here build watched allocations, GPU processes and a fake system.

use super::*;

const MIB: u64 = 1 << 20;
const MS: u64 = 1_000_000;
const GIB: u64 = 1 << 30;

/// The start time of every process of the fake system unless [`Fake::starts`] says else.
const START: u64 = 1000;

fn w(id: &str, limit: u64, pids: &[i32]) -> Watched {
    Watched {
        id: id.into(),
        limit,
        pids: pids
            .iter()
            .map(|&pid| ProcId { pid, start: START })
            .collect(),
        token: format!("tok-{id}"),
        share: 50,
        whole_gpus: Vec::new(),
        gpu: None,
        group: None,
    }
}

/// A process on GPU 0.
fn p(pid: i32, used: u64) -> GpuProcess {
    GpuProcess { pid, gpu: 0, used }
}

/// A process on GPU `gpu`.
fn on(gpu: u32, pid: i32, used: u64) -> GpuProcess {
    GpuProcess { pid, gpu, used }
}

/// A fake system: parents, the origin of each pid (host unless listed), start times
/// ([`START`] unless listed; `None`: no process has that pid) and cgroups.
#[derive(Default)]
struct Fake {
    parents: HashMap<i32, i32>,
    containers: HashMap<i32, Option<String>>,
    starts: HashMap<i32, Option<u64>>,
    cgroups: HashMap<i32, String>,
    /// The inode of the identity file a pid shows (none unless listed).
    files: HashMap<i32, FileKey>,
    /// Pids whose mount table shows the plugin's mount at the identity path.
    mounted: HashSet<i32>,
    /// Executable names (none unless listed).
    exes: HashMap<i32, String>,
}

impl ProcView for Fake {
    fn parent(&self, pid: i32) -> Option<i32> {
        self.parents.get(&pid).copied()
    }
    fn start_time(&self, pid: i32) -> Option<u64> {
        self.starts.get(&pid).copied().unwrap_or(Some(START))
    }
    fn cgroup(&self, pid: i32) -> Option<String> {
        self.cgroups.get(&pid).cloned()
    }
    fn identity_file(&self, pid: i32) -> Option<FileKey> {
        self.files.get(&pid).copied()
    }
    fn identity_mounted(&self, pid: i32) -> bool {
        self.mounted.contains(&pid)
    }
    fn exe_name(&self, pid: i32) -> Option<String> {
        self.exes.get(&pid).cloned()
    }
    fn origin(&self, pid: i32) -> Origin {
        match self.containers.get(&pid) {
            Some(token) => Origin::Container {
                token: token.clone(),
            },
            None => Origin::Host,
        }
    }
}

fn run(
    watched: &[Watched],
    procs: &[GpuProcess],
    view: &Fake,
    tol: impl Into<Tolerance>,
) -> Vec<Action> {
    let memory = memory_per_pid(procs);
    let pids: Vec<i32> = memory.keys().copied().collect();
    let owners = attribute(watched, &pids, view, &mut Cgroups::default());
    // The path `poll` takes: per-card charges (equal to the per-pid sums of
    // `policed_memory` for allocations that span one card).
    let tol: Tolerance = tol.into();
    let charges = card_charges(watched, procs, &owners);
    let by_pid = decide(
        watched,
        &policed_memory(watched, procs, &owners),
        &owners,
        tol,
    );
    let acts = decide_charges(watched, &charges, tol);
    if watched.iter().all(|w| w.group.is_none()) {
        assert_eq!(
            acts, by_pid,
            "per-card charges change nothing without GPU groups"
        );
    }
    acts.into_iter()
        .filter(|a| {
            !matches!(
                a.reason,
                Reason::Unknown {
                    container: false,
                    ..
                }
            )
        })
        .collect()
}

fn total(a: &Action) -> u64 {
    match a.reason {
        Reason::Memory { total, .. } => total,
        _ => panic!("not a memory action: {a:?}"),
    }
}

mod attribution;
mod compute;
mod service;
