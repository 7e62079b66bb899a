//! The memory backstop: a second line of defence that does not depend on the tenant's process.
//!
//! The interposer enforces limits only inside processes that load it and play by its rules.
//! Every poll interval the backstop reads, from NVML, the device memory of every process on
//! every GPU, attributes each process to an allocation from identity the tenant cannot change
//! (the pids that connected to the tenant socket, seen through `SO_PEERCRED`, and their
//! descendants, found through `/proc/<pid>/stat`), and when an allocation's processes together
//! hold more than its limit plus a tolerance (context memory NVML counts but no allocation
//! returned: [`Policy::per_process_tolerance`] per process), it kills (or only reports, with
//! `--enforce report`) the processes that pushed it over: those that never spoke to the arbiter
//! first (a child started without `LD_PRELOAD`, a library that reached the driver around the
//! hooks in a process of its own), largest first, then the largest connected ones, until the
//! rest fits.
//!
//! [`decide`] is the pure rule (tested with fixed snapshots); [`Backstop`] does the I/O: NVML,
//! `/proc`, `kill(2)`, the log.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::state::Arbiter;

/// What to do with a process that breaks its allocation's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Enforce {
    /// `SIGKILL` it (the default).
    Kill,
    /// Log and count it only.
    Report,
}

/// Settings of the backstop.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// How often NVML is read.
    pub interval: Duration,
    /// Device memory a process may hold beyond what the ledger knows of (its CUDA context).
    pub per_process_tolerance: u64,
    /// Kill or report.
    pub enforce: Enforce,
}

/// One allocation as the backstop sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watched {
    /// Public id.
    pub id: String,
    /// Memory limit, bytes.
    pub limit: u64,
    /// Pids that connected to the tenant socket for it.
    pub pids: Vec<i32>,
}

/// One process on a GPU, as NVML reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuProcess {
    /// Host pid.
    pub pid: i32,
    /// Device memory it holds, bytes.
    pub used: u64,
}

/// One enforcement decision, with its evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    /// The process.
    pub pid: i32,
    /// Its allocation.
    pub allocation: String,
    /// Device memory the process held.
    pub used: u64,
    /// Device memory all the allocation's processes held.
    pub total: u64,
    /// What they may hold: the limit plus the tolerance for their processes.
    pub allowed: u64,
    /// True when the process never connected to the arbiter (it went around the interposer).
    pub unconnected: bool,
}

/// Attributes `pid` to an allocation: itself or its nearest ancestor connected for it.
fn owner(pid: i32, by_pid: &HashMap<i32, usize>, parent: &dyn Fn(i32) -> Option<i32>) -> Option<usize> {
    let mut p = pid;
    // Bounded: a pid cycle (a reused pid read mid-change) cannot loop forever.
    for _ in 0..64 {
        if let Some(&i) = by_pid.get(&p) {
            return Some(i);
        }
        match parent(p) {
            Some(pp) if pp > 1 && pp != p => p = pp,
            _ => return None,
        }
    }
    None
}

/// The rule: which processes to act on, given the allocations, what NVML reports (all GPUs
/// together) and the process tree. Processes that belong to no allocation are left alone.
pub fn decide(
    watched: &[Watched],
    procs: &[GpuProcess],
    parent: &dyn Fn(i32) -> Option<i32>,
    per_process_tolerance: u64,
) -> Vec<Action> {
    let by_pid: HashMap<i32, usize> = watched
        .iter()
        .enumerate()
        .flat_map(|(i, w)| w.pids.iter().map(move |p| (*p, i)))
        .collect();
    // One pid may appear on several GPUs: sum per pid first.
    let mut per_pid: HashMap<i32, u64> = HashMap::new();
    for p in procs {
        *per_pid.entry(p.pid).or_default() += p.used;
    }
    let mut groups: Vec<Vec<(i32, u64)>> = vec![Vec::new(); watched.len()];
    for (&pid, &used) in &per_pid {
        if let Some(i) = owner(pid, &by_pid, parent) {
            groups[i].push((pid, used));
        }
    }
    let mut actions = Vec::new();
    for (w, group) in watched.iter().zip(groups) {
        let total: u64 = group.iter().map(|(_, u)| u).sum();
        let allowed = w
            .limit
            .saturating_add(per_process_tolerance.saturating_mul(group.len() as u64));
        if total <= allowed {
            continue;
        }
        let connected: HashSet<i32> = w.pids.iter().copied().collect();
        let mut order = group.clone();
        // Those that went around the arbiter first, then the largest.
        order.sort_by_key(|(pid, used)| (connected.contains(pid), std::cmp::Reverse(*used), *pid));
        let mut left = total;
        for (pid, used) in order {
            if left <= allowed {
                break;
            }
            left -= used;
            actions.push(Action {
                pid,
                allocation: w.id.clone(),
                used,
                total,
                allowed,
                unconnected: !connected.contains(&pid),
            });
        }
    }
    actions
}

/// The parent of `pid` from `/proc/<pid>/stat` (field 4, after the parenthesised name, which
/// may itself contain spaces and parentheses).
pub fn proc_parent(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Counters of the backstop, for the log and tests.
#[derive(Debug, Default)]
pub struct Counters {
    /// Polls done.
    pub polls: AtomicU64,
    /// Processes killed.
    pub killed: AtomicU64,
    /// Breaches reported (or killed).
    pub breaches: AtomicU64,
    /// Polls where NVML could not be read.
    pub failed_polls: AtomicU64,
}

/// The backstop's thread: NVML in, kills out.
pub struct Backstop {
    nvml: nvml_wrapper::Nvml,
    arb: Arc<Arbiter>,
    policy: Policy,
    /// What it did so far.
    pub counters: Arc<Counters>,
}

impl std::fmt::Debug for Backstop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backstop").field("policy", &self.policy).finish_non_exhaustive()
    }
}

impl Backstop {
    /// Loads NVML (`lib`, or `libnvidia-ml.so.1` from the loader's search path).
    pub fn new(
        arb: Arc<Arbiter>,
        policy: Policy,
        lib: Option<&std::ffi::OsStr>,
    ) -> Result<Self, crate::gpus::GpusError> {
        let mut builder = nvml_wrapper::Nvml::builder();
        if let Some(lib) = lib {
            builder.lib_path(lib);
        }
        let nvml = builder.init().map_err(|e| crate::gpus::GpusError::Load {
            lib: lib.map_or("libnvidia-ml.so.1".into(), |l| l.to_string_lossy().into_owned()),
            reason: e.to_string(),
        })?;
        Ok(Self { nvml, arb, policy, counters: Arc::default() })
    }

    /// Every process on every GPU with its device memory.
    fn gpu_processes(&self) -> Result<Vec<GpuProcess>, nvml_wrapper::error::NvmlError> {
        let mut out = Vec::new();
        for i in 0..self.nvml.device_count()? {
            let dev = self.nvml.device_by_index(i)?;
            let mut list = dev.running_compute_processes()?;
            // A compute-only GPU (or the simulator) has no graphics list.
            list.extend(dev.running_graphics_processes().unwrap_or_default());
            for p in list {
                let used = match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                };
                out.push(GpuProcess { pid: p.pid as i32, used });
            }
        }
        Ok(out)
    }

    /// One poll: read, decide, act. Returns the actions taken.
    pub fn poll(&self) -> Vec<Action> {
        self.counters.polls.fetch_add(1, Ordering::Relaxed);
        let procs = match self.gpu_processes() {
            Ok(p) => p,
            Err(e) => {
                if self.counters.failed_polls.fetch_add(1, Ordering::Relaxed) == 0 {
                    crate::log!("backstop: cannot read GPU processes from NVML: {e}");
                }
                return Vec::new();
            }
        };
        let watched = self.arb.watched();
        let actions = decide(&watched, &procs, &proc_parent, self.policy.per_process_tolerance);
        for a in &actions {
            self.counters.breaches.fetch_add(1, Ordering::Relaxed);
            self.arb.note_enforced(&a.allocation);
            let how = if a.unconnected { "never connected to the arbiter" } else { "connected" };
            let verdict = match self.policy.enforce {
                Enforce::Kill => {
                    // SAFETY: kill(2) has no memory preconditions; a pid that exited meanwhile
                    // fails with ESRCH (or, reused, is the risk every pid-based tool takes
                    // within one poll interval).
                    let rc = unsafe { libc::kill(a.pid, libc::SIGKILL) };
                    if rc == 0 {
                        self.counters.killed.fetch_add(1, Ordering::Relaxed);
                        "killed"
                    } else {
                        "could not be killed"
                    }
                }
                Enforce::Report => "reported",
            };
            crate::log!(
                "backstop: pid {} of allocation {} {verdict}: it held {} bytes, its allocation's \
                 processes {} bytes, allowed {} (limit plus tolerance); it {how}",
                a.pid,
                a.allocation,
                a.used,
                a.total,
                a.allowed
            );
        }
        actions
    }

    /// Polls every interval, for ever (run it on its own thread).
    pub fn run(self) {
        loop {
            std::thread::sleep(self.policy.interval);
            self.poll();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn w(id: &str, limit: u64, pids: &[i32]) -> Watched {
        Watched { id: id.into(), limit, pids: pids.to_vec() }
    }

    fn p(pid: i32, used: u64) -> GpuProcess {
        GpuProcess { pid, used }
    }

    fn no_parents(_: i32) -> Option<i32> {
        None
    }

    #[test]
    fn within_the_limit_plus_tolerance_nothing_happens() {
        let a = [w("a", 1000 * MIB, &[10, 11])];
        // 1000 MiB allocated plus 2 x 100 MiB of context: allowed.
        let procs = [p(10, 600 * MIB), p(11, 600 * MIB)];
        assert!(decide(&a, &procs, &no_parents, 100 * MIB).is_empty());
        assert_eq!(decide(&a, &procs, &no_parents, 99 * MIB).len(), 1);
    }

    #[test]
    fn a_descendant_that_never_connected_is_charged_to_its_ancestor_and_killed_first() {
        let a = [w("a", 1000 * MIB, &[10])];
        // 10 -> 20 -> 30: 30 started without the interposer and took 4 GiB.
        let parent = |pid| match pid {
            30 => Some(20),
            20 => Some(10),
            _ => None,
        };
        let procs = [p(10, 900 * MIB), p(30, 4096 * MIB), p(99, 8192 * MIB)];
        let acts = decide(&a, &procs, &parent, 0);
        assert_eq!(acts.len(), 1, "{acts:?}");
        assert_eq!((acts[0].pid, acts[0].unconnected), (30, true));
        assert_eq!(acts[0].total, 4996 * MIB);
        // 99 belongs to nobody: untouched.
    }

    #[test]
    fn connected_processes_go_largest_first_until_the_rest_fits() {
        let a = [w("a", 1000 * MIB, &[1, 2, 3])];
        let procs = [p(1, 300 * MIB), p(2, 700 * MIB), p(3, 400 * MIB)];
        let acts = decide(&a, &procs, &no_parents, 0);
        assert_eq!(acts.iter().map(|a| a.pid).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn memory_on_several_gpus_is_summed_and_allocations_are_independent() {
        let a = [w("a", 1000 * MIB, &[1]), w("b", 1000 * MIB, &[2])];
        let procs = [p(1, 600 * MIB), p(1, 600 * MIB), p(2, 900 * MIB)];
        let acts = decide(&a, &procs, &no_parents, 0);
        assert_eq!(acts.len(), 1);
        assert_eq!((acts[0].pid, acts[0].allocation.as_str()), (1, "a"));
    }

    #[test]
    fn a_parent_cycle_ends() {
        let a = [w("a", MIB, &[1])];
        let parent = |pid| Some(if pid == 5 { 6 } else { 5 });
        assert!(decide(&a, &[p(5, 10 * MIB)], &parent, 0).is_empty());
    }

    #[test]
    fn proc_parent_reads_this_process() {
        let me = std::process::id() as i32;
        let parent = proc_parent(me).expect("own stat");
        // SAFETY: getppid has no preconditions.
        assert_eq!(parent, unsafe { libc::getppid() });
        assert_eq!(proc_parent(-5), None);
    }
}
