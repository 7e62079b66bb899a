//! The backstop: a second line of defence that does not depend on the tenant's process.
//!
//! The interposer enforces limits only inside processes that load it and play by its rules.
//! Every poll interval the backstop reads, from NVML, every process on every GPU with its
//! device memory and its GPU time, and attributes each to an allocation from identity the
//! tenant cannot change, in this order (the first that applies decides; see [`attribute`]):
//! 1. **the process's own container identity**: the identity file read through
//!    `/proc/<pid>/root`, from a read-only mount only (the device plugin mounts it into every
//!    container it wires, fraction or whole GPU; see [`tessera_protocol::identity`]). It names
//!    the allocation, whatever any connection claims; one that names no live allocation makes
//!    the process unknown. The first time a process is attributed this way its container's
//!    cgroup (cgroup v2, the `0::` line of `/proc/<pid>/cgroup`) is recorded for that
//!    allocation ([`Cgroups`]);
//! 2. **the container's cgroup**, recorded as above: a process of that container whose root no
//!    longer shows the file (a `chroot`) is still its container's. A container cannot move its
//!    processes out of its cgroup, and a cgroup path is never reused while the allocation lives;
//! 3. **the processes that connected to the tenant socket, and their descendants**, each named
//!    by pid *and start time* ([`ProcId`], taken at `accept` through the connection's
//!    `SO_PEERPIDFD`, so the process that connected and not a later one with its pid; the
//!    pidfd is kept with the connection ([`Peer`]) and a process it says exited is not listed)
//!    and checked against the live process at every use, ancestors included: a connection
//!    whose process exited attributes nobody, so a connection kept open by another process (a
//!    socket passed over `SCM_RIGHTS`) cannot reserve a pid for whoever gets it next;
//! 4. **a process under a live `tessera run`** (the allocation's owner, pid and start time), or
//!    one found under it before (see [`crate::owner`]), connected or not;
//! 5. otherwise the process is *unknown*: in a container (its mount namespace is not the
//!    host's) or on the host.
//!
//! Then, under `--enforce kill|report`:
//! - **memory**: an allocation whose processes together hold more than its limit plus one
//!   slack for the driver's rounding ([`Tolerance`]; contexts are inside the limit: the
//!   interposer reserves each one's cost) loses the processes that pushed it over: those that never spoke to the arbiter first (a child
//!   started without `LD_PRELOAD`, a library that reached the driver around the hooks in a
//!   process of its own), largest first, then the largest connected ones, until the rest fits;
//! - **compute**: GPU time its processes used beyond the leases it was granted (kernels
//!   launched around the gate, kernels overrunning a lease) first draws on one slack budget
//!   per GPU (5% of its time, shared by all its allocations); the rest is charged to its
//!   virtual time, so the fair queue pays the others back; once the unleased time of a GPU's
//!   bypassing allocations (those running mostly outside leases) passes a threshold, the
//!   busiest process of each is killed;
//! - **unknown processes** (`--unknown-processes`): in a container, a pod reached the GPU
//!   without asking for shares: killed by default; on the host, only ever reported (once per
//!   pid): system tools such as `nvidia-smi` or DCGM are not ours to kill.
//!
//! [`decide`] and [`ComputeBook`] are the pure rules (tested with fixed snapshots and a fake
//! clock); [`Backstop`] does the I/O through small traits: the GPUs through [`GpuSource`]
//! (NVML: [`NvmlSource`]), processes through [`ProcView`] (`/proc`), kills through [`Killer`]
//! (`SIGKILL`), so `poll` and `act` are tested with fakes.

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_protocol::identity::{CONTAINER_IDENTITY_FILE, Identity};
use tessera_protocol::size::human;

use crate::peer::proc_start;
pub use crate::peer::{Peer, ProcId};
use crate::state::{Arbiter, Watched};
use crate::stats::EnforceReason;

/// What to do with a process that breaks its allocation's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforce {
    /// `SIGKILL` it (the default).
    Kill,
    /// Log and count it only.
    Report,
}

/// What to do with a process in a container that belongs to no allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unknown {
    /// `SIGKILL` it (the default; `--enforce report` turns it into a report too).
    Kill,
    /// Log it once.
    Report,
    /// Say nothing.
    Ignore,
}

/// Settings of the backstop.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// How often NVML is read.
    pub interval: Duration,
    /// Device memory an allocation's processes may hold together beyond its limit.
    pub memory_tolerance: Tolerance,
    /// Kill or report.
    pub enforce: Enforce,
    /// Unknown processes in containers.
    pub unknown: Unknown,
    /// Unleased GPU time an allocation may build up before its busiest process is killed.
    pub compute_threshold: Duration,
    /// Unleased GPU time forgiven per unit of wall time (kernels that overrun their lease).
    pub compute_slack: f64,
}

/// What an allocation's processes may hold beyond its limit, by NVML: one slack per allocation
/// for the driver's own rounding (its contexts are inside the limit: the interposer reserves
/// each one's cost through the ledger), plus, only where an operator sets it, an amount per
/// process for contexts that cost more on the card than the interposer's estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tolerance {
    /// Bytes per allocation, whatever its number of processes.
    pub per_allocation: u64,
    /// Bytes per process of the allocation on the card (0 by default).
    pub per_process: u64,
}

/// Default [`Tolerance::per_allocation`]: 64 MiB, the driver's rounding of what it holds.
pub const DEFAULT_MEMORY_SLACK: u64 = 64 << 20;

impl From<u64> for Tolerance {
    /// A per-allocation slack only.
    fn from(per_allocation: u64) -> Self {
        Self {
            per_allocation,
            per_process: 0,
        }
    }
}

impl Tolerance {
    /// What an allocation of `limit` bytes with `processes` processes on the card may hold.
    pub fn allowed(&self, limit: u64, processes: usize) -> u64 {
        limit
            .saturating_add(self.per_allocation)
            .saturating_add(self.per_process.saturating_mul(processes as u64))
    }
}

/// One process on a GPU, as NVML reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuProcess {
    /// Host pid.
    pub pid: i32,
    /// The GPU (NVML index).
    pub gpu: u32,
    /// Device memory it holds, bytes.
    pub used: u64,
}

/// Where a process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// In the host's mount namespace.
    Host,
    /// In a container; `token` from its identity file, if it has a valid one.
    Container {
        /// The token its identity file names.
        token: Option<String>,
    },
}

/// What the backstop learns about processes from the system (`/proc` in production).
pub trait ProcView {
    /// The parent of `pid`.
    fn parent(&self, pid: i32) -> Option<i32>;
    /// Where `pid` runs.
    fn origin(&self, pid: i32) -> Origin;
    /// The start time of the process `pid` names now; `None` when there is none.
    fn start_time(&self, pid: i32) -> Option<u64>;
    /// The cgroup v2 path of `pid` (the `0::` line of `/proc/<pid>/cgroup`).
    fn cgroup(&self, pid: i32) -> Option<String>;
}

/// True when `id` still names a live process: the process at its pid started when it did.
pub fn is_live(id: &ProcId, view: &dyn ProcView) -> bool {
    view.start_time(id.pid) == Some(id.start)
}

/// Drops, from every allocation's connected processes, those that exited (or whose pid names
/// another process now), so the rules after attribution see only live connected processes.
pub fn forget_exited(watched: &mut [Watched], view: &dyn ProcView) {
    for w in watched {
        w.pids.retain(|p| is_live(p, view));
    }
}

/// Container cgroups learnt from identity files, each bound to the allocation whose identity
/// its first attributed process showed (see the module map, rule 2). Bounded; an entry goes
/// with its allocation.
#[derive(Debug, Default)]
pub struct Cgroups {
    by_path: HashMap<String, CgroupOwner>,
    /// Cgroups never learnt: the root, and the arbiter's own (processes a container shares
    /// with the host, e.g. without a cgroup namespace or on cgroup v1's `0::/`).
    never: HashSet<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum CgroupOwner {
    /// The allocation with this id.
    Allocation(String),
    /// Processes of two allocations were seen in it: it attributes nobody.
    Shared,
}

/// Most cgroups remembered at once (a node runs far fewer containers).
pub const CGROUPS_MAX: usize = 4096;

impl Cgroups {
    /// A book that never learns `never` (nor the root cgroup).
    pub fn new(never: impl IntoIterator<Item = String>) -> Self {
        let mut never: HashSet<String> = never.into_iter().collect();
        never.insert("/".to_owned());
        Self {
            by_path: HashMap::new(),
            never,
        }
    }

    /// A process of `cgroup` showed the identity of allocation `id`.
    fn learn(&mut self, cgroup: Option<String>, id: &str) {
        let Some(cg) = cgroup else { return };
        if self.never.contains(&cg) {
            return;
        }
        let full = self.by_path.len() >= CGROUPS_MAX;
        match self.by_path.entry(cg) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                if !matches!(e.get(), CgroupOwner::Allocation(a) if a == id) {
                    e.insert(CgroupOwner::Shared);
                }
            }
            // Full: the identity file still attributes its processes, poll after poll.
            std::collections::hash_map::Entry::Vacant(_) if full => {}
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(CgroupOwner::Allocation(id.to_owned()));
            }
        }
    }

    /// The allocation id `cgroup` was learnt for.
    fn owner(&self, cgroup: &str) -> Option<&str> {
        match self.by_path.get(cgroup)? {
            CgroupOwner::Allocation(id) => Some(id),
            CgroupOwner::Shared => None,
        }
    }

    /// Forgets the cgroups of allocations no longer live.
    pub fn retain(&mut self, live: &HashSet<&str>) {
        self.by_path.retain(|_, o| match o {
            CgroupOwner::Allocation(id) => live.contains(id.as_str()),
            CgroupOwner::Shared => true,
        });
    }

    /// Cgroups remembered.
    pub fn len(&self) -> usize {
        self.by_path.len()
    }

    /// True when none is remembered.
    pub fn is_empty(&self) -> bool {
        self.by_path.is_empty()
    }
}

/// Whom a GPU process belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Owner {
    /// The allocation at this index of the watched list.
    Allocation(usize),
    /// Nobody, and it runs on the host.
    UnknownHost,
    /// Nobody, and it runs in a container.
    UnknownContainer,
}

/// Why a process is acted on, with the evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// Its allocation's processes held too much device memory.
    Memory {
        /// Device memory the process held.
        used: u64,
        /// Device memory all the allocation's processes held.
        total: u64,
        /// What they may hold: the limit plus the tolerance ([`Tolerance::allowed`]).
        allowed: u64,
    },
    /// Its allocation used too much GPU time outside its leases.
    Compute {
        /// GPU time the process used in the last poll interval, ns.
        gpu_ns: u64,
        /// Unleased GPU time its allocation built up, ns.
        unleased_ns: u64,
    },
    /// It belongs to no allocation.
    Unknown {
        /// True in a container, false on the host.
        container: bool,
        /// Device memory it held.
        used: u64,
    },
}

/// One enforcement decision, with its evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    /// The process.
    pub pid: i32,
    /// Its allocation, if it has one.
    pub allocation: Option<String>,
    /// True when the process never connected to the arbiter (it went around the interposer).
    pub unconnected: bool,
    /// Why.
    pub reason: Reason,
}

/// Attributes every pid in `pids` (see the module map for the order), learning container
/// cgroups into `cgroups` on the way.
pub fn attribute(
    watched: &[Watched],
    pids: &[i32],
    view: &dyn ProcView,
    cgroups: &mut Cgroups,
) -> HashMap<i32, Owner> {
    let mut by_proc: HashMap<ProcId, usize> = HashMap::new();
    for (i, w) in watched.iter().enumerate() {
        for p in &w.pids {
            // A process connected for two allocations is the first one's.
            by_proc.entry(*p).or_insert(i);
        }
    }
    let by_token: HashMap<&str, usize> = watched
        .iter()
        .enumerate()
        .map(|(i, w)| (w.token.as_str(), i))
        .collect();
    let by_id: HashMap<&str, usize> = watched
        .iter()
        .enumerate()
        .map(|(i, w)| (w.id.as_str(), i))
        .collect();
    let mut out = HashMap::new();
    for &pid in pids {
        let origin = view.origin(pid);
        let owner = match &origin {
            // 1. Its own identity file: nothing a connection claims overrides it.
            Origin::Container { token: Some(t) } => match by_token.get(t.as_str()) {
                Some(&i) => {
                    cgroups.learn(view.cgroup(pid), &watched[i].id);
                    Owner::Allocation(i)
                }
                None => Owner::UnknownContainer,
            },
            _ => {
                // 2. Its container's cgroup (a container process only: a host process is
                // never taken for a container's).
                let by_cgroup = match origin {
                    Origin::Container { token: None } => view
                        .cgroup(pid)
                        .and_then(|cg| cgroups.owner(&cg).and_then(|id| by_id.get(id)).copied()),
                    _ => None,
                };
                // 3. A live connected process, or a descendant of one.
                match by_cgroup.or_else(|| connected_ancestor(pid, &by_proc, view)) {
                    Some(i) => Owner::Allocation(i),
                    None if origin == Origin::Host => Owner::UnknownHost,
                    None => Owner::UnknownContainer,
                }
            }
        };
        out.insert(pid, owner);
    }
    out
}

/// `pid` itself or its nearest ancestor connected for an allocation, each checked against the
/// live process at its pid (a connection whose process exited names nobody, and a process
/// given its pid later, or that one's children, are not its).
fn connected_ancestor(
    pid: i32,
    by_proc: &HashMap<ProcId, usize>,
    view: &dyn ProcView,
) -> Option<usize> {
    let mut p = pid;
    // Bounded: a pid cycle (a reused pid read mid-change) cannot loop forever.
    for _ in 0..64 {
        let start = view.start_time(p)?;
        if let Some(&i) = by_proc.get(&ProcId { pid: p, start }) {
            return Some(i);
        }
        match view.parent(p) {
            Some(pp) if pp > 1 && pp != p => p = pp,
            _ => return None,
        }
    }
    None
}

/// Device memory per pid (one pid may appear on several GPUs).
pub fn memory_per_pid(procs: &[GpuProcess]) -> HashMap<i32, u64> {
    let mut per_pid: HashMap<i32, u64> = HashMap::new();
    for p in procs {
        *per_pid.entry(p.pid).or_default() += p.used;
    }
    per_pid
}

/// True when `gpu` is a card the owner of a process holds wholly (see
/// [`Watched::whole_gpus`]): what its processes do there is not policed.
fn on_own_whole_card(watched: &[Watched], owner: Option<&Owner>, gpu: u32) -> bool {
    matches!(owner, Some(Owner::Allocation(i)) if watched[*i].whole_gpus.contains(&gpu))
}

/// Device memory per pid that the memory rule polices: all of it, less what a process of a
/// whole-card allocation holds on the cards that allocation holds wholly.
pub fn policed_memory(
    watched: &[Watched],
    procs: &[GpuProcess],
    owners: &HashMap<i32, Owner>,
) -> HashMap<i32, u64> {
    let mut per_pid: HashMap<i32, u64> = HashMap::new();
    for p in procs {
        if !on_own_whole_card(watched, owners.get(&p.pid), p.gpu) {
            *per_pid.entry(p.pid).or_default() += p.used;
        }
    }
    per_pid
}

/// GPU time per pid over all GPUs, and the part the compute rule polices (the same, less a
/// whole-card allocation's time on the cards it holds wholly), from time per (pid, GPU).
pub fn policed_gpu_time(
    watched: &[Watched],
    per_gpu: &HashMap<(i32, u32), u64>,
    owners: &HashMap<i32, Owner>,
) -> (HashMap<i32, u64>, HashMap<i32, u64>) {
    let (mut all, mut policed): (HashMap<i32, u64>, HashMap<i32, u64>) = Default::default();
    for (&(pid, gpu), &ns) in per_gpu {
        *all.entry(pid).or_default() += ns;
        if !on_own_whole_card(watched, owners.get(&pid), gpu) {
            *policed.entry(pid).or_default() += ns;
        }
    }
    (all, policed)
}

/// Device memory of one process charged to one owner: for a slice of a multi-GPU
/// allocation, what the process holds on that slice's card, or (`outside`) on the cards
/// outside its group; for any other owner, what it holds on all cards together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// The process.
    pub pid: i32,
    /// Whom the memory is charged to.
    pub owner: Owner,
    /// True for memory on cards outside its multi-GPU allocation (allowed: nothing).
    pub outside: bool,
    /// Bytes.
    pub used: u64,
}

/// The slice of `watched[i]`'s GPU group on card `gpu`, if `watched[i]` is a slice of a
/// multi-GPU allocation and the group has one there.
fn slice_on(watched: &[Watched], i: usize, gpu: u32) -> Option<usize> {
    let group = watched[i].group.as_ref()?;
    if watched[i].gpu == Some(gpu) {
        return Some(i);
    }
    watched
        .iter()
        .position(|w| w.group.as_ref() == Some(group) && w.gpu == Some(gpu))
}

/// Where the memory or time a process of `owner` uses on card `gpu` is charged: the
/// process's own owner, except for a slice of a multi-GPU allocation, whose group is policed
/// per card: the group's slice on that card, or `(owner, true)` for a card outside the group.
fn card_owner(watched: &[Watched], owner: Owner, gpu: u32) -> (Owner, bool) {
    match owner {
        Owner::Allocation(i) if watched[i].group.is_some() => match slice_on(watched, i, gpu) {
            Some(j) => (Owner::Allocation(j), false),
            None => (owner, true),
        },
        other => (other, false),
    }
}

/// The charges the memory rule polices, from NVML's per-card processes: each process's
/// memory per owner (see [`Charge`]), less what a process of a whole-card allocation holds
/// on the cards that allocation holds wholly. Memory on a card is charged to that card's
/// slice of a multi-GPU allocation, never summed into another card's.
pub fn card_charges(
    watched: &[Watched],
    procs: &[GpuProcess],
    owners: &HashMap<i32, Owner>,
) -> Vec<Charge> {
    let mut sums: HashMap<(i32, Owner, bool), u64> = HashMap::new();
    for p in procs {
        let Some(&owner) = owners.get(&p.pid) else {
            continue;
        };
        if on_own_whole_card(watched, Some(&owner), p.gpu) {
            continue;
        }
        let (owner, outside) = card_owner(watched, owner, p.gpu);
        *sums.entry((p.pid, owner, outside)).or_default() += p.used;
    }
    let mut out: Vec<Charge> = sums
        .into_iter()
        .map(|((pid, owner, outside), used)| Charge {
            pid,
            owner,
            outside,
            used,
        })
        .collect();
    out.sort_by_key(|c| (c.pid, c.outside));
    out
}

/// One process's GPU time over an interval, charged to one allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeRow {
    /// The process.
    pub pid: i32,
    /// Index in the watched list of the allocation charged.
    pub allocation: usize,
    /// All its GPU time charged there, ns.
    pub all_ns: u64,
    /// The part the compute rule polices (see [`policed_gpu_time`]), ns.
    pub policed_ns: u64,
}

/// GPU time per process and allocation, from time per (pid, GPU): as [`policed_gpu_time`],
/// except that a process of a multi-GPU allocation is charged per card, to that card's slice
/// (whose leases cover it); its time on a card outside its group is its own slice's, unleased.
pub fn gpu_time_rows(
    watched: &[Watched],
    per_gpu: &HashMap<(i32, u32), u64>,
    owners: &HashMap<i32, Owner>,
) -> Vec<TimeRow> {
    let mut sums: HashMap<(i32, usize), (u64, u64)> = HashMap::new();
    for (&(pid, gpu), &ns) in per_gpu {
        let Some(&owner) = owners.get(&pid) else {
            continue;
        };
        let whole = on_own_whole_card(watched, Some(&owner), gpu);
        let Owner::Allocation(i) = card_owner(watched, owner, gpu).0 else {
            continue;
        };
        let e = sums.entry((pid, i)).or_default();
        e.0 += ns;
        if !whole {
            e.1 += ns;
        }
    }
    let mut rows: Vec<TimeRow> = sums
        .into_iter()
        .map(|((pid, allocation), (all_ns, policed_ns))| TimeRow {
            pid,
            allocation,
            all_ns,
            policed_ns,
        })
        .collect();
    rows.sort_by_key(|r| (r.allocation, r.pid));
    rows
}

/// The memory rule and the unknown-process rule: which processes to act on, given the
/// allocations, each pid's device memory (all GPUs together) and its owner. Unknown host
/// processes come back as actions too (the caller reports them; it never kills them).
pub fn decide(
    watched: &[Watched],
    memory: &HashMap<i32, u64>,
    owners: &HashMap<i32, Owner>,
    tolerance: impl Into<Tolerance>,
) -> Vec<Action> {
    let mut charges: Vec<Charge> = memory
        .iter()
        .filter_map(|(&pid, &used)| {
            owners.get(&pid).map(|&owner| Charge {
                pid,
                owner,
                outside: false,
                used,
            })
        })
        .collect();
    charges.sort_by_key(|c| c.pid);
    decide_charges(watched, &charges, tolerance)
}

/// [`decide`] over charges (see [`card_charges`]): each allocation's charges against its
/// limit, and a multi-GPU allocation's memory on cards outside its group against nothing.
pub fn decide_charges(
    watched: &[Watched],
    charges: &[Charge],
    tolerance: impl Into<Tolerance>,
) -> Vec<Action> {
    let tolerance = tolerance.into();
    // Per allocation: its charges, then (second half) its charges outside its group.
    let mut groups: Vec<Vec<(i32, u64)>> = vec![Vec::new(); 2 * watched.len()];
    let mut actions = Vec::new();
    for c in charges {
        let (pid, used) = (c.pid, c.used);
        match c.owner {
            Owner::Allocation(i) => {
                groups[i + if c.outside { watched.len() } else { 0 }].push((pid, used))
            }
            Owner::UnknownHost | Owner::UnknownContainer => actions.push(Action {
                pid,
                allocation: None,
                unconnected: true,
                reason: Reason::Unknown {
                    container: c.owner == Owner::UnknownContainer,
                    used,
                },
            }),
        }
    }
    for (slot, group) in groups.into_iter().enumerate() {
        let outside = slot >= watched.len();
        let w = &watched[slot % watched.len()];
        let total: u64 = group.iter().map(|(_, u)| u).sum();
        // A whole-card allocation's memory here is only what it holds on cards it does not
        // own (see [`card_charges`]), where it may hold nothing; so is a multi-GPU
        // allocation's on cards outside its group.
        let allowed = if w.share < 100 && !outside {
            tolerance.allowed(w.limit, group.len())
        } else {
            0
        };
        if total <= allowed {
            continue;
        }
        let connected: HashSet<i32> = w.pids.iter().map(|p| p.pid).collect();
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
                allocation: Some(w.id.clone()),
                unconnected: !connected.contains(&pid),
                reason: Reason::Memory {
                    used,
                    total,
                    allowed,
                },
            });
        }
    }
    actions
}

/// Weight of an interval's GPU time in [`Debt`]'s recent sums, one interval later: about the
/// last 2 s (8 polls of 250 ms) count.
const RECENT_DECAY: f64 = 0.875;
/// The same for [`Debt`]'s long sums: about the last 10 s (40 polls of 250 ms).
const LONG_DECAY: f64 = 0.975;

/// What the card holds for each connected process beyond what its connections reserved: the
/// arbiter charges it to the allocation, so its ledger is what the card holds for it. The
/// interposer reserves a fixed estimate per context (300 MiB, what the simulated card charges
/// by default); a real context can cost more (300-600 MiB on common cards, more with large modules
/// loaded), the driver rounds allocations up, and without this a process whose allocations
/// fit the estimate could take the card past the limit and be killed by the memory rule. With
/// it, the next reservation that would not fit on the card is refused instead.
///
/// Pure: fed, each poll, (process, NVML's bytes for it, the most its connections held since
/// the last poll). The two figures are read at different instants: the card first, the ledger
/// after it, and a poll descheduled in between (a loaded host) would otherwise see a process
/// that freed and released meanwhile with more on the card than it holds; the peak held since
/// the last poll covers every instant the card figure can be from. An excess is charged only
/// as far as two polls in a row saw it (the smaller of the two): a stream-ordered free is
/// released when it is enqueued and leaves the card when the stream reaches it, so a card
/// can hold freed memory for a while. It is recomputed every poll, so
/// it follows the card down as well as up (the unused part of a reservation is never given
/// back: the process may still use it without asking).
#[derive(Debug)]
pub struct ExcessBook<K = ProcId> {
    last: HashMap<K, u64>,
}

impl<K> Default for ExcessBook<K> {
    fn default() -> Self {
        Self {
            last: HashMap::new(),
        }
    }
}

/// What the backstop's [`ExcessBook`] is keyed by: the process and, for a slice of a
/// multi-GPU allocation, the slice's card.
pub type ExcessKey = (ProcId, Option<u32>);

impl<K: Copy + Eq + std::hash::Hash> ExcessBook<K> {
    /// This poll's figures; returns the excess to charge per process (absent: none). Forgets
    /// processes not listed.
    pub fn observe(&mut self, seen: &[(K, u64, u64)]) -> HashMap<K, u64> {
        let now: HashMap<K, u64> = seen
            .iter()
            .map(|&(id, card, held)| (id, card.saturating_sub(held)))
            .collect();
        let charge = now
            .iter()
            .filter_map(|(id, &x)| {
                let both = x.min(self.last.get(id).copied().unwrap_or(0));
                (both > 0).then_some((*id, both))
            })
            .collect();
        self.last = now;
        charge
    }
}

/// Per allocation: GPU time its processes used against the leases it was granted; per GPU:
/// one slack budget that all its allocations draw on.
#[derive(Debug, Default)]
pub struct ComputeBook {
    per: HashMap<String, Debt>,
}

#[derive(Debug)]
struct Debt {
    /// The scheduler's lease total at the last observation.
    leased_seen: u64,
    /// Unleased GPU time built up, ns; down to minus one poll interval (kernel time is
    /// reported when a kernel ends, lease time as it passes, so the two drift apart briefly).
    debt_ns: i128,
    /// GPU time used and leased over the last few intervals (each interval weighs
    /// [`RECENT_DECAY`] less than the next): an allocation in debt is acted on only if it ran
    /// mostly outside leases over them too, so a tenant that leases is never caught up in a
    /// neighbour's bypass because of one bad interval (its kernels stuck behind the bypass
    /// kernels finish after its lease).
    recent_used: f64,
    recent_leased: f64,
    /// GPU time used and leased over a longer past (each interval weighs [`LONG_DECAY`] less
    /// than the next), without the floor on debt: an allocation is acted on only if it used
    /// more than it was leased over it. A tenant whose leases ran idle while its kernels
    /// waited behind a neighbour's bypass kernels paid for them in advance; when they run,
    /// after its leases, it is not a bypasser (its drift is still charged). Leases bank for
    /// at most this long, and only as far as they were granted (its share).
    long_used: f64,
    long_leased: f64,
}

/// One allocation's GPU time over the last interval, for [`ComputeBook::observe_gpu`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeUse<'a> {
    /// Its public id.
    pub id: &'a str,
    /// GPU time its processes used during the interval, ns.
    pub used_ns: u64,
    /// Its lease total so far (the scheduler's), ns.
    pub leased_total: u64,
}

/// What one observation of an allocation's GPU time calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeVerdict {
    /// GPU time to charge to its virtual time (used beyond its leases and its part of the
    /// GPU's slack), ns.
    pub charge_ns: u64,
    /// Unleased GPU time built up, ns (after this observation).
    pub unleased_ns: u64,
    /// GPU time it used outside its leases in the interval that the slack forgave, ns (not
    /// charged to its share, but counted against a cap).
    pub forgiven_ns: u64,
    /// True when the GPU's unleased time passed the threshold and this allocation is one to act
    /// on (its debt is then cleared: the caller acts).
    pub over: bool,
}

/// Splits `budget` over `needs` max-min fairly: a need below the fair part is met in full and
/// what it leaves goes to the larger ones, so small overruns are forgiven whole however many
/// allocations bypass beside them, and together they never get more than `budget`.
fn share_out(needs: &[i128], budget: i128) -> Vec<i128> {
    let mut order: Vec<usize> = (0..needs.len()).collect();
    order.sort_by_key(|&i| needs[i]);
    let mut given = vec![0; needs.len()];
    let (mut left, mut n) = (budget.max(0), needs.len() as i128);
    for i in order {
        let part = (left / n).min(needs[i].max(0));
        given[i] = part;
        left -= part;
        n -= 1;
    }
    given
}

impl ComputeBook {
    /// Records one interval of one GPU: each allocation `uses` names used `used_ns` of GPU time
    /// during the last `elapsed_ns`, and its leases total `leased_total` ns so far. Returns a
    /// verdict per entry, in order. The first observation of an allocation only sets its
    /// starting point.
    ///
    /// Time used beyond an allocation's leases (its own unused lease time of the last interval
    /// pays first) draws on the GPU's slack, `compute_slack` of the interval for all its
    /// allocations together, shared out max-min fairly, first among the allocations that
    /// leased in the interval (the slack is there for their overruns), then among the others:
    /// kernels overrunning a lease are forgiven, but ten allocations cannot each take the
    /// slack, nor crowd a leasing tenant out of it. What the slack does not
    /// cover is debt: charged when it grows (to the allocation's virtual time) and counted
    /// towards the kill rule.
    ///
    /// The kill rule is per GPU too: when the debts of the allocations that ran mostly outside
    /// leases, in this interval and over the last few, and used more than they leased over
    /// the last several seconds, add up to more than the threshold, each of them is acted on
    /// (one allocation alone: its own debt against the threshold). A tenant that takes part in leasing has its drift (kernels finishing after
    /// a revoked lease, local leases while the arbiter restarted) charged to its share, never
    /// punished, and nothing is acted on unless `may_act` (the caller's warm-up after an
    /// arbiter start is over).
    pub fn observe_gpu(
        &mut self,
        uses: &[ComputeUse<'_>],
        elapsed_ns: u64,
        policy: &Policy,
        may_act: bool,
    ) -> Vec<ComputeVerdict> {
        let nothing = ComputeVerdict {
            charge_ns: 0,
            unleased_ns: 0,
            forgiven_ns: 0,
            over: false,
        };
        let mut verdicts = vec![nothing; uses.len()];
        // (index, debt before, debt before the slack, leased this interval) of the allocations
        // seen before.
        let mut rows = Vec::new();
        for (i, u) in uses.iter().enumerate() {
            let Some(d) = self.per.get_mut(u.id) else {
                self.per.insert(
                    u.id.to_owned(),
                    Debt {
                        leased_seen: u.leased_total,
                        debt_ns: 0,
                        recent_used: 0.0,
                        recent_leased: 0.0,
                        long_used: 0.0,
                        long_leased: 0.0,
                    },
                );
                continue;
            };
            let leased = u.leased_total.saturating_sub(d.leased_seen);
            d.leased_seen = u.leased_total;
            let pre = d.debt_ns + i128::from(u.used_ns) - i128::from(leased);
            rows.push((i, d.debt_ns, pre, leased));
        }
        // Allocations that leased in the interval draw on the slack first (it is there for
        // their overruns), the others get what is left.
        let budget = (elapsed_ns as f64 * policy.compute_slack) as i128;
        let mut given = vec![0; rows.len()];
        let mut left = budget;
        for leasing in [true, false] {
            let tier: Vec<usize> = (0..rows.len())
                .filter(|&r| (rows[r].3 > 0) == leasing)
                .collect();
            let needs: Vec<i128> = tier.iter().map(|&r| rows[r].2.max(0)).collect();
            for (&r, g) in tier.iter().zip(share_out(&needs, left)) {
                given[r] = g;
                left -= g;
            }
        }
        let floor = -(elapsed_ns as i128);
        let mut candidates = Vec::new();
        for (&(i, before, pre, leased), slack) in rows.iter().zip(given) {
            let debt = (pre - slack).max(floor);
            // Only debt that grows above zero is charged: kernel time reported a poll late
            // first pays back lease time it was granted earlier.
            verdicts[i].charge_ns = (debt.max(0) - before.max(0)).max(0) as u64;
            // This interval's new unleased time, less what was charged of it.
            let new_unleased = (pre - before.max(0)).max(0);
            verdicts[i].forgiven_ns =
                (new_unleased - i128::from(verdicts[i].charge_ns)).max(0) as u64;
            verdicts[i].unleased_ns = debt.max(0) as u64;
            // Debt from the warm-up is charged but never counted towards a kill: after an
            // arbiter restart tenants ran on local leases it never granted, and samples from
            // before the start arrive with the first polls.
            let kept = if may_act { debt } else { debt.min(0) };
            let used = uses[i].used_ns;
            let Some(d) = self.per.get_mut(uses[i].id) else {
                continue;
            };
            d.debt_ns = kept;
            d.recent_used = d.recent_used * RECENT_DECAY + used as f64;
            // At most an interval's worth: one GPU holds one lease at a time, and leases held
            // idle must not buy a bypass later.
            d.recent_leased = d.recent_leased * RECENT_DECAY + leased.min(elapsed_ns) as f64;
            d.long_used = d.long_used * LONG_DECAY + used as f64;
            d.long_leased = d.long_leased * LONG_DECAY + leased.min(elapsed_ns) as f64;
            let mostly_unleased = u128::from(leased) * 2 < u128::from(used)
                && d.recent_leased * 2.0 < d.recent_used
                && d.long_leased < d.long_used;
            if kept > 0 && mostly_unleased {
                candidates.push(i);
            }
        }
        // The neighbours lost the candidates' debts together: past the threshold every one of
        // them goes (one at a time, the rest would each have the threshold again).
        let total: u64 = candidates.iter().map(|&i| verdicts[i].unleased_ns).sum();
        if total > policy.compute_threshold.as_nanos() as u64 {
            for i in candidates {
                verdicts[i].over = true;
                if let Some(d) = self.per.get_mut(uses[i].id) {
                    d.debt_ns = 0;
                }
            }
        }
        verdicts
    }

    /// Forgets allocations no longer live.
    pub fn retain(&mut self, live: &HashSet<&str>) {
        self.per.retain(|id, _| live.contains(id.as_str()));
    }
}

/// The process of `group` (pid, GPU ns) to kill for a compute breach: one that never
/// connected first, then the one with the most GPU time.
pub fn compute_culprit(group: &[(i32, u64)], connected: &HashSet<i32>) -> Option<(i32, u64)> {
    group
        .iter()
        .filter(|(_, ns)| *ns > 0)
        .min_by_key(|(pid, ns)| (connected.contains(pid), std::cmp::Reverse(*ns), *pid))
        .copied()
}

/// Field `n` (1-based, `n` > 2) of `/proc/<pid>/stat`, counted after the parenthesised name,
/// which may itself contain spaces and parentheses (so the last `)` ends it).
fn stat_field<T: std::str::FromStr>(pid: i32, n: usize) -> Option<T> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(n - 3)?.parse().ok()
}

/// The parent of `pid` from `/proc/<pid>/stat` (field 4).
pub fn proc_parent(pid: i32) -> Option<i32> {
    stat_field(pid, 4)
}

/// The cgroup v2 path of `pid`: the `0::` line of `/proc/<pid>/cgroup`.
pub fn proc_cgroup(pid: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_owned)
}

/// [`ProcView`] over `/proc`.
#[derive(Debug)]
pub struct ProcFs {
    /// The host's mount namespace (`readlink` of it), e.g. of `/proc/1/ns/mnt` with `hostPID`.
    host_mnt: Option<std::path::PathBuf>,
    /// Identity per mount namespace, for one poll (the processes of a container share one).
    cache: std::cell::RefCell<HashMap<std::path::PathBuf, Option<String>>>,
}

impl ProcFs {
    /// A view whose host mount namespace is the one `host_ns` (a `/proc/<pid>/ns/mnt` link)
    /// names. When it cannot be read (no `hostPID`, no `CAP_SYS_PTRACE`), containers are
    /// still recognised by their identity file, but a process without one is taken for a
    /// host process (reported, never killed): failing closed there would kill the host's own
    /// GPU tools. The error is returned for the log.
    pub fn new(host_ns: &std::path::Path) -> (Self, Option<std::io::Error>) {
        let (host_mnt, err) = match std::fs::read_link(host_ns) {
            Ok(l) => (Some(l), None),
            Err(e) => (None, Some(e)),
        };
        (
            Self {
                host_mnt,
                cache: Default::default(),
            },
            err,
        )
    }

    /// Clears the per-poll cache (a pid and a namespace may be reused between polls).
    pub fn clear(&self) {
        self.cache.borrow_mut().clear();
    }
}

impl ProcView for ProcFs {
    fn parent(&self, pid: i32) -> Option<i32> {
        proc_parent(pid)
    }

    fn start_time(&self, pid: i32) -> Option<u64> {
        proc_start(pid)
    }

    fn cgroup(&self, pid: i32) -> Option<String> {
        proc_cgroup(&pid.to_string())
    }

    fn origin(&self, pid: i32) -> Origin {
        let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/mnt")) else {
            // Gone, or not ours to look at: nothing to attribute it by.
            return Origin::Host;
        };
        if self.host_mnt.as_ref() == Some(&ns) {
            return Origin::Host;
        }
        let token = self
            .cache
            .borrow_mut()
            .entry(ns)
            .or_insert_with(|| read_identity(pid).map(|i| i.token))
            .clone();
        match (token, &self.host_mnt) {
            // The host's namespace is unknown (see [`ProcFs::new`]): a process without a
            // Tessera identity may be a host process, and host processes are never killed.
            (None, None) => Origin::Host,
            (token, _) => Origin::Container { token },
        }
    }
}

/// Reads a container's identity file through `/proc/<pid>/root`, without following any
/// symlink inside the container (an absolute link would resolve on the host) and only from
/// a read-only mount (the plugin's; a file the container wrote itself proves nothing).
pub fn read_identity(pid: i32) -> Option<Identity> {
    let root = CString::new(format!("/proc/{pid}/root")).ok()?;
    // SAFETY: a valid C string; the descriptor returned is owned below.
    let dir = unsafe {
        libc::open(
            root.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if dir < 0 {
        return None;
    }
    // SAFETY: `dir` is a descriptor we just opened and own.
    let dir = unsafe { OwnedFd::from_raw_fd(dir) };
    let rel = CString::new(CONTAINER_IDENTITY_FILE.trim_start_matches('/')).ok()?;
    // SAFETY: open_how is plain integers; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u64;
    how.resolve = libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_BENEATH;
    // SAFETY: openat2 reads `how` (size given) and the C string `rel`; `dir` is open.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: openat2 returned a new descriptor we own.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    // SAFETY: fstatvfs fills the zeroed struct for an open descriptor.
    let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut vfs) } != 0
        || vfs.f_flag & libc::ST_RDONLY == 0
    {
        return None;
    }
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    Identity::read_from(file).ok()
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
    /// Unleased GPU time charged to allocations, ns.
    pub charged_ns: AtomicU64,
    /// Unknown processes acted on or reported.
    pub unknown: AtomicU64,
}

/// Errors of a [`GpuSource`].
#[derive(Debug, thiserror::Error)]
pub enum GpuSourceError {
    /// NVML failed.
    #[error(transparent)]
    Nvml(#[from] nvml_wrapper::error::NvmlError),
    /// A fake source was told to fail (tests).
    #[error("{0}")]
    Other(String),
}

/// One per-process utilisation sample of a GPU, as NVML gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UtilSample {
    /// Host pid.
    pub pid: i32,
    /// SM utilisation over the sample, percent.
    pub sm_util: u32,
    /// When it was taken, µs since the epoch.
    pub timestamp: u64,
}

/// What the backstop reads from the GPUs: NVML in production ([`NvmlSource`]), a fake in
/// tests.
pub trait GpuSource: Send {
    /// How many GPUs there are.
    fn device_count(&self) -> Result<u32, GpuSourceError>;
    /// The processes on GPU `gpu` with their device memory (compute and graphics).
    fn processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, GpuSourceError>;
    /// GPU `gpu`'s per-process utilisation samples newer than `since_us` (none: empty). `None`
    /// when this system cannot give them at all.
    fn utilization(&self, gpu: u32, since_us: u64) -> Option<Vec<UtilSample>>;
}

/// [`GpuSource`] over NVML.
pub struct NvmlSource(nvml_wrapper::Nvml);

impl NvmlSource {
    /// Loads NVML (`lib`, or `libnvidia-ml.so.1` from the loader's search path).
    pub fn load(lib: Option<&std::ffi::OsStr>) -> Result<Self, crate::gpus::GpusError> {
        let mut builder = nvml_wrapper::Nvml::builder();
        if let Some(lib) = lib {
            builder.lib_path(lib);
        }
        builder
            .init()
            .map(Self)
            .map_err(|source| crate::gpus::GpusError::Load {
                lib: lib.map_or("libnvidia-ml.so.1".into(), |l| {
                    l.to_string_lossy().into_owned()
                }),
                source,
            })
    }
}

impl GpuSource for NvmlSource {
    fn device_count(&self) -> Result<u32, GpuSourceError> {
        Ok(self.0.device_count()?)
    }

    fn processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, GpuSourceError> {
        let dev = self.0.device_by_index(gpu)?;
        let mut list = dev.running_compute_processes()?;
        // A compute-only GPU (or the simulator) has no graphics list.
        list.extend(dev.running_graphics_processes().unwrap_or_default());
        Ok(list
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid as i32,
                gpu,
                used: match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                },
            })
            .collect())
    }

    fn utilization(&self, gpu: u32, since_us: u64) -> Option<Vec<UtilSample>> {
        let dev = self.0.device_by_index(gpu).ok()?;
        match dev.process_utilization_stats(since_us) {
            Ok(s) => Some(
                s.into_iter()
                    .map(|s| UtilSample {
                        pid: s.pid as i32,
                        sm_util: s.sm_util,
                        timestamp: s.timestamp,
                    })
                    .collect(),
            ),
            Err(nvml_wrapper::error::NvmlError::NotFound) => Some(Vec::new()),
            Err(e) => {
                tracing::warn!(
                    "backstop: per-process GPU time unavailable ({e}); compute bypass is not policed"
                );
                None
            }
        }
    }
}

/// How the backstop stops a process: `SIGKILL` in production ([`Sigkill`]), a recorder in
/// tests.
pub trait Killer: Send {
    /// Kills `pid`; false when it could not (it exited meanwhile).
    fn kill(&self, pid: i32) -> bool;
}

/// [`Killer`] by `kill(2)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sigkill;

impl Killer for Sigkill {
    fn kill(&self, pid: i32) -> bool {
        // SAFETY: kill(2) has no memory preconditions; a pid that exited meanwhile fails with
        // ESRCH (or, reused, is the risk every pid-based tool takes within one poll interval).
        unsafe { libc::kill(pid, libc::SIGKILL) == 0 }
    }
}

/// The backstop's thread: GPU readings in, kills out.
pub struct Backstop {
    gpus: Box<dyn GpuSource>,
    killer: Box<dyn Killer>,
    arb: Arc<Arbiter>,
    policy: Policy,
    procfs: ProcFs,
    book: ComputeBook,
    /// Container cgroups learnt from identity files.
    cgroups: Cgroups,
    /// Per GPU index: the newest utilisation sample timestamp seen (µs since the epoch).
    last_seen: HashMap<u32, u64>,
    last_poll: Option<Instant>,
    /// When this backstop started.
    started: Instant,
    /// Compute is not readable on this system (logged once).
    compute_off: bool,
    /// Unknown host pids already reported.
    reported: HashSet<i32>,
    /// When each unknown host pid was first seen: one is reported only after
    /// [`HOST_GRACE`] (a process under `tessera run` has a context before its first allocation
    /// connects it).
    unknown_since: HashMap<i32, Instant>,
    /// What the card holds for connected processes beyond their reservations.
    excess: ExcessBook<ExcessKey>,
    /// What it did so far.
    pub counters: Arc<Counters>,
}

impl std::fmt::Debug for Backstop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backstop")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// After the backstop starts (an arbiter restart), tenants may still run on the local leases
/// their interposer grants itself while the arbiter is away: no compute kill before this.
pub const COMPUTE_WARMUP: Duration = Duration::from_secs(2);

/// How long a host process may use a GPU unattributed before it is reported.
pub const HOST_GRACE: Duration = Duration::from_secs(1);

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Backstop {
    /// Loads NVML (`lib`, or `libnvidia-ml.so.1` from the loader's search path); `host_ns`
    /// names the host's mount namespace. Kills with `SIGKILL`.
    pub fn new(
        arb: Arc<Arbiter>,
        policy: Policy,
        lib: Option<&std::ffi::OsStr>,
        host_ns: &std::path::Path,
    ) -> Result<Self, crate::gpus::GpusError> {
        let gpus = NvmlSource::load(lib)?;
        Ok(Self::with_io(
            arb,
            policy,
            Box::new(gpus),
            Box::new(Sigkill),
            host_ns,
        ))
    }

    /// A backstop reading `gpus` and stopping processes with `killer` (fakes in tests).
    pub fn with_io(
        arb: Arc<Arbiter>,
        policy: Policy,
        gpus: Box<dyn GpuSource>,
        killer: Box<dyn Killer>,
        host_ns: &std::path::Path,
    ) -> Self {
        let (procfs, err) = ProcFs::new(host_ns);
        if let Some(e) = err {
            tracing::warn!(
                "backstop: cannot read the host's mount namespace {} ({e}): processes without a \
                 Tessera identity are treated as host processes (reported, never killed); run \
                 with hostPID and CAP_SYS_PTRACE, or pass --host-mount-ns",
                host_ns.display()
            );
        }
        Self {
            gpus,
            killer,
            arb,
            policy,
            procfs,
            book: ComputeBook::default(),
            // Our own cgroup is never a container's: the processes beside us are the host's.
            cgroups: Cgroups::new(proc_cgroup("self")),
            last_seen: HashMap::new(),
            last_poll: None,
            started: Instant::now(),
            compute_off: false,
            reported: HashSet::new(),
            excess: ExcessBook::default(),
            unknown_since: HashMap::new(),
            counters: Arc::default(),
        }
    }

    /// Every process on every GPU with its device memory.
    fn gpu_processes(&self) -> Result<Vec<GpuProcess>, GpuSourceError> {
        let mut out = Vec::new();
        for i in 0..self.gpus.device_count()? {
            out.extend(self.gpus.processes(i)?);
        }
        Ok(out)
    }

    /// GPU time per (pid, GPU index) over the last `elapsed_ns`, from NVML's per-process
    /// utilisation samples: the mean SM utilisation of a pid's samples times the interval.
    fn gpu_time(&mut self, elapsed_ns: u64) -> HashMap<(i32, u32), u64> {
        let mut out = HashMap::new();
        if self.compute_off {
            return out;
        }
        let Ok(n) = self.gpus.device_count() else {
            return out;
        };
        for i in 0..n {
            let since = self.last_seen.get(&i).copied().unwrap_or(0);
            let Some(samples) = self.gpus.utilization(i, since) else {
                self.compute_off = true;
                return HashMap::new();
            };
            let newest = samples.iter().map(|s| s.timestamp).max().unwrap_or(0);
            self.last_seen
                .insert(i, newest.max(since).max(now_us().saturating_sub(1)));
            let mut per: HashMap<i32, (u64, u64)> = HashMap::new();
            for s in samples {
                let e = per.entry(s.pid).or_default();
                e.0 += u64::from(s.sm_util.min(100));
                e.1 += 1;
            }
            for (pid, (sum, count)) in per {
                *out.entry((pid, i)).or_default() += elapsed_ns * sum / (100 * count);
            }
        }
        out
    }

    /// One poll: read, decide, act. Returns the actions taken.
    pub fn poll(&mut self) -> Vec<Action> {
        self.counters.polls.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let elapsed = self
            .last_poll
            .map(|t| now.duration_since(t).as_nanos() as u64);
        self.last_poll = Some(now);
        let procs = match self.gpu_processes() {
            Ok(p) => p,
            Err(e) => {
                if self.counters.failed_polls.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!("backstop: cannot read GPU processes from NVML: {e}");
                }
                return Vec::new();
            }
        };
        let gpu_per = self.gpu_time(elapsed.unwrap_or(0));
        let mut watched = self.arb.watched();
        let memory = memory_per_pid(&procs);
        let mut pids: Vec<i32> = memory
            .keys()
            .copied()
            .chain(gpu_per.keys().map(|(pid, _)| *pid))
            .collect();
        pids.sort_unstable();
        pids.dedup();
        self.procfs.clear();
        self.reported.retain(|p| pids.binary_search(p).is_ok());
        forget_exited(&mut watched, &self.procfs);
        let live: HashSet<&str> = watched.iter().map(|w| w.id.as_str()).collect();
        self.cgroups.retain(&live);
        let mut owners = attribute(&watched, &pids, &self.procfs, &mut self.cgroups);
        self.attribute_owned(&watched, &mut owners);
        self.unknown_since
            .retain(|p, _| owners.get(p) == Some(&Owner::UnknownHost));
        for (&pid, owner) in &owners {
            if *owner == Owner::UnknownHost {
                self.unknown_since.entry(pid).or_insert(now);
            }
        }
        self.correct_excess(&memory, &procs);
        let charges = card_charges(&watched, &procs, &owners);
        let rows = gpu_time_rows(&watched, &gpu_per, &owners);
        let mut actions = decide_charges(&watched, &charges, self.policy.memory_tolerance);
        if let Some(elapsed) = elapsed {
            actions.extend(self.compute(&watched, &rows, elapsed));
        }
        let mut taken = Vec::new();
        for a in actions {
            if self.act(&a) {
                taken.push(a);
            }
        }
        taken
    }

    /// Charges each connected process what the card holds for it beyond what its connections
    /// reserved (see [`ExcessBook`]), from NVML's memory per pid.
    /// A process connected for a slice of a multi-GPU allocation is compared with what it holds
    /// on that slice's card only (the book is keyed per card then).
    fn correct_excess(&mut self, memory: &HashMap<i32, u64>, on_cards: &[GpuProcess]) {
        let procs = self.arb.connected_processes();
        let on_card = |pid: i32, gpu: u32| -> u64 {
            on_cards
                .iter()
                .filter(|p| p.pid == pid && p.gpu == gpu)
                .map(|p| p.used)
                .sum()
        };
        let seen: Vec<(ExcessKey, u64, u64)> = procs
            .iter()
            .map(|&(_, id, _, held, card)| {
                let used = match card {
                    Some(gpu) => on_card(id.pid, gpu),
                    None => memory.get(&id.pid).copied().unwrap_or(0),
                };
                ((id, card), used, held)
            })
            .collect();
        let charge = self.excess.observe(&seen);
        for (key, id, conn, _, card) in procs {
            self.arb
                .set_excess(key, conn, charge.get(&(id, card)).copied().unwrap_or(0));
        }
    }

    /// The last attribution step, kept apart from [`attribute`]: a process nothing else names
    /// that runs under a live `tessera run` (its owner, pid and start time; see
    /// [`crate::owner`]), or was found under one before, is that allocation's, connected or
    /// not (a double-forked child without `LD_PRELOAD`, a `dlmopen`-first process).
    fn attribute_owned(&self, watched: &[Watched], owners: &mut HashMap<i32, Owner>) {
        let owned = self.arb.owned();
        if owned.is_empty() {
            return;
        }
        let proc = std::path::Path::new("/proc");
        let index: HashMap<&str, usize> = watched
            .iter()
            .enumerate()
            .map(|(i, w)| (w.id.as_str(), i))
            .collect();
        let list: Vec<_> = owned.iter().map(|(_, o, ..)| *o).collect();
        let parent = |p: i32| self.procfs.parent(p);
        let start = |p: i32| crate::owner::start_time(proc, p);
        let mut members = self.arb.members();
        for (&pid, owner) in owners.iter_mut() {
            if matches!(owner, Owner::Allocation(_)) {
                continue;
            }
            let Some(start_time) = start(pid) else {
                continue;
            };
            let me = tessera_protocol::ProcessOwner { pid, start_time };
            let id = match members.of(me) {
                Some(id) => Some(id.to_owned()),
                None => crate::owner::owned_ancestor(pid, &list, &parent, &start)
                    .map(|i| owned[i].0.clone()),
            };
            if let Some(id) = id
                && let Some(&i) = index.get(id.as_str())
            {
                *owner = Owner::Allocation(i);
                members.note(&id, me);
            }
        }
    }

    /// The compute rule over one interval; charges what was used outside leases.
    fn compute(&mut self, watched: &[Watched], rows: &[TimeRow], elapsed: u64) -> Vec<Action> {
        let mut busy = vec![0u64; watched.len()];
        let mut groups: Vec<Vec<(i32, u64)>> = vec![Vec::new(); watched.len()];
        for r in rows {
            busy[r.allocation] += r.all_ns;
            if r.policed_ns > 0 {
                groups[r.allocation].push((r.pid, r.policed_ns));
            }
        }
        let live: HashSet<&str> = watched.iter().map(|w| w.id.as_str()).collect();
        self.book.retain(&live);
        // Policed allocations by GPU: each GPU has one slack budget.
        let mut per_gpu: HashMap<String, Vec<(usize, u64, u64)>> = HashMap::new();
        for (i, (w, group)) in watched.iter().zip(&groups).enumerate() {
            if busy[i] > 0 {
                self.arb.note_gpu_busy(&w.id, busy[i]);
            }
            let used: u64 = group.iter().map(|(_, ns)| ns).sum();
            let (gpu, leased) = if w.share < 100 {
                let Some(at) = self.arb.leased_total(&w.id) else {
                    continue;
                };
                at
            } else {
                // A whole-card allocation is policed only on cards it does not own, where no
                // lease of its covers anything; that time draws on a budget of its own.
                (format!("whole-card {}", w.id), 0)
            };
            per_gpu.entry(gpu).or_default().push((i, used, leased));
        }
        let may_act = self.started.elapsed() >= COMPUTE_WARMUP;
        let mut actions = Vec::new();
        for rows in per_gpu.values() {
            let uses: Vec<ComputeUse<'_>> = rows
                .iter()
                .map(|&(i, used_ns, leased_total)| ComputeUse {
                    id: &watched[i].id,
                    used_ns,
                    leased_total,
                })
                .collect();
            let verdicts = self.book.observe_gpu(&uses, elapsed, &self.policy, may_act);
            for (&(i, _, _), v) in rows.iter().zip(verdicts) {
                let w = &watched[i];
                if v.forgiven_ns > 0 {
                    self.arb.count_for_cap(&w.id, v.forgiven_ns);
                }
                if v.charge_ns > 0 {
                    self.arb.charge_unleased(&w.id, v.charge_ns);
                    self.counters
                        .charged_ns
                        .fetch_add(v.charge_ns, Ordering::Relaxed);
                }
                if v.over {
                    let connected: HashSet<i32> = w.pids.iter().map(|p| p.pid).collect();
                    if let Some((pid, ns)) = compute_culprit(&groups[i], &connected) {
                        actions.push(Action {
                            pid,
                            allocation: Some(w.id.clone()),
                            unconnected: !connected.contains(&pid),
                            reason: Reason::Compute {
                                gpu_ns: ns,
                                unleased_ns: v.unleased_ns,
                            },
                        });
                    }
                }
            }
        }
        actions
    }

    /// Carries out one decision (kill or report, log, count). False when nothing was done
    /// (an unknown process the policy ignores, or one reported before).
    fn act(&mut self, a: &Action) -> bool {
        let kill = match (&a.reason, self.policy.enforce) {
            (_, Enforce::Report) => false,
            (
                Reason::Unknown {
                    container: false, ..
                },
                _,
            ) => false,
            (
                Reason::Unknown {
                    container: true, ..
                },
                _,
            ) => self.policy.unknown == Unknown::Kill,
            _ => true,
        };
        if let Reason::Unknown { container, .. } = a.reason {
            let young = !container
                && self
                    .unknown_since
                    .get(&a.pid)
                    .is_none_or(|t| t.elapsed() < HOST_GRACE);
            if young {
                return false;
            }
            let quiet = self.policy.unknown == Unknown::Ignore
                || (!container && !self.reported.insert(a.pid))
                || (container && !kill && !self.reported.insert(a.pid));
            if quiet {
                return false;
            }
            self.counters.unknown.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.breaches.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(id) = &a.allocation {
            let why = match a.reason {
                Reason::Compute { .. } => EnforceReason::ComputeBypass,
                _ => EnforceReason::MemoryOverLimit,
            };
            self.arb.note_enforced(id, why);
        }
        let verdict = if kill {
            if self.killer.kill(a.pid) {
                self.counters.killed.fetch_add(1, Ordering::Relaxed);
                "killed"
            } else {
                "could not be killed"
            }
        } else {
            "reported"
        };
        let how = if a.unconnected {
            "never connected to the arbiter"
        } else {
            "connected"
        };
        match (&a.reason, &a.allocation) {
            (
                Reason::Memory {
                    used,
                    total,
                    allowed,
                },
                Some(id),
            ) => tracing::warn!(
                "backstop: pid {} of allocation {id} {verdict}: it held {}, its \
                 allocation's processes {}, allowed {} (limit plus \
                 tolerance); it {how}",
                a.pid,
                human(*used),
                human(*total),
                human(*allowed)
            ),
            (
                Reason::Compute {
                    gpu_ns,
                    unleased_ns,
                },
                Some(id),
            ) => tracing::warn!(
                "backstop: pid {} of allocation {id} {verdict}: its allocation used {} ms of \
                 GPU time outside its leases beyond its part of the GPU's slack (threshold {} ms \
                 for the GPU's allocations together), this process {} ms in the last {} ms; it \
                 {how}",
                a.pid,
                unleased_ns / 1_000_000,
                self.policy.compute_threshold.as_millis(),
                gpu_ns / 1_000_000,
                self.policy.interval.as_millis()
            ),
            (Reason::Unknown { container, used }, _) => tracing::warn!(
                "backstop: unknown {} process {} {verdict}: it uses a GPU ({}) and \
                 belongs to no allocation{}",
                if *container { "container" } else { "host" },
                a.pid,
                human(*used),
                if *container {
                    " (no Tessera identity in its container)"
                } else {
                    ""
                }
            ),
            (_, None) => {}
        }
        true
    }

    /// Polls every interval until `stop` gets a message or its sender is dropped (run it on its
    /// own thread; the server does).
    pub fn run(mut self, stop: std::sync::mpsc::Receiver<()>) {
        use std::sync::mpsc::RecvTimeoutError;
        while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(self.policy.interval) {
            self.poll();
        }
        tracing::info!("backstop: stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const MS: u64 = 1_000_000;

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

    #[test]
    fn within_the_limit_plus_tolerance_nothing_happens() {
        let a = [w("a", 1000 * MIB, &[10, 11])];
        // 1000 MiB allocated plus 2 x 100 MiB of context beyond the estimate: allowed only
        // where the operator allows 100 MiB per process.
        let procs = [p(10, 600 * MIB), p(11, 600 * MIB)];
        let per_process = |b| Tolerance {
            per_allocation: 0,
            per_process: b,
        };
        assert!(run(&a, &procs, &Fake::default(), per_process(100 * MIB)).is_empty());
        assert_eq!(
            run(&a, &procs, &Fake::default(), per_process(99 * MIB)).len(),
            1
        );
        // The default: one slack per allocation.
        assert!(run(&a, &procs, &Fake::default(), 200 * MIB).is_empty());
        assert_eq!(run(&a, &procs, &Fake::default(), 199 * MIB).len(), 1);
    }

    #[test]
    fn the_slack_is_per_allocation_whatever_the_number_of_processes() {
        // 64 processes of a 1 GiB allocation each holding 316 MiB (a context and 16 MiB):
        // the old 512 MiB per process allowed 33 GiB; one slack allows limit + 64 MiB.
        let pids: Vec<i32> = (1..=64).collect();
        let a = [w("a", GIB, &pids)];
        let procs: Vec<GpuProcess> = pids.iter().map(|&i| p(i, 316 * MIB)).collect();
        let acts = run(&a, &procs, &Fake::default(), DEFAULT_MEMORY_SLACK);
        let left = 64 - acts.len() as u64;
        assert!(
            left * 316 * MIB <= GIB + DEFAULT_MEMORY_SLACK,
            "{left} processes left"
        );
        assert_eq!(left, 3, "no more are killed than needed");
        // Three such processes are within it: an honest allocation is left alone.
        let procs: Vec<GpuProcess> = (1..=3).map(|i| p(i, 316 * MIB)).collect();
        assert!(run(&a, &procs, &Fake::default(), DEFAULT_MEMORY_SLACK).is_empty());
    }

    #[test]
    fn a_descendant_that_never_connected_is_charged_to_its_ancestor_and_killed_first() {
        let a = [w("a", 1000 * MIB, &[10])];
        // 10 -> 20 -> 30: 30 started without the interposer and took 4 GiB.
        let view = Fake {
            parents: HashMap::from([(30, 20), (20, 10)]),
            ..Default::default()
        };
        let procs = [p(10, 900 * MIB), p(30, 4096 * MIB), p(99, 8192 * MIB)];
        let acts = run(&a, &procs, &view, 0);
        assert_eq!(acts.len(), 1, "{acts:?}");
        assert_eq!((acts[0].pid, acts[0].unconnected), (30, true));
        assert_eq!(total(&acts[0]), 4996 * MIB);
        // 99 is a host process of nobody: only reported (filtered out by `run`).
    }

    #[test]
    fn connected_processes_go_largest_first_until_the_rest_fits() {
        let a = [w("a", 1000 * MIB, &[1, 2, 3])];
        let procs = [p(1, 300 * MIB), p(2, 700 * MIB), p(3, 400 * MIB)];
        let acts = run(&a, &procs, &Fake::default(), 0);
        assert_eq!(acts.iter().map(|a| a.pid).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn memory_on_several_gpus_is_summed_and_allocations_are_independent() {
        let a = [w("a", 1000 * MIB, &[1]), w("b", 1000 * MIB, &[2])];
        let procs = [p(1, 600 * MIB), p(1, 600 * MIB), p(2, 900 * MIB)];
        let acts = run(&a, &procs, &Fake::default(), 0);
        assert_eq!(acts.len(), 1);
        assert_eq!((acts[0].pid, acts[0].allocation.as_deref()), (1, Some("a")));
    }

    #[test]
    fn a_parent_cycle_ends() {
        let a = [w("a", MIB, &[1])];
        let view = Fake {
            parents: HashMap::from([(5, 6), (6, 5)]),
            ..Default::default()
        };
        assert!(run(&a, &[p(5, 10 * MIB)], &view, 0).is_empty());
    }

    #[test]
    fn a_container_process_that_never_connected_is_attributed_by_its_identity_file() {
        let a = [w("a", GIB, &[]), w("b", GIB, &[])];
        let view = Fake {
            containers: HashMap::from([
                (40, Some("tok-a".into())),
                (41, Some("tok-a".into())),
                (50, Some("tok-b".into())),
            ]),
            ..Default::default()
        };
        // Two processes of container a hold 3 GiB together; b holds 100 MiB.
        let procs = [p(40, 2 * GIB), p(41, GIB), p(50, 100 * MIB)];
        let acts = run(&a, &procs, &view, 0);
        // The largest goes; the 1 GiB left fits.
        assert_eq!(acts.len(), 1, "{acts:?}");
        assert_eq!(
            (
                acts[0].pid,
                acts[0].allocation.as_deref(),
                acts[0].unconnected
            ),
            (40, Some("a"), true)
        );
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn unknown_processes_are_told_apart_by_where_they_run() {
        let a = [w("a", GIB, &[1])];
        let view = Fake {
            containers: HashMap::from([
                (60, None),                  // a container without any identity
                (61, Some("forged".into())), // an identity naming no allocation
            ]),
            ..Default::default()
        };
        let procs = [
            p(1, 10 * MIB),
            p(60, 10 * MIB),
            p(61, 10 * MIB),
            p(70, 10 * MIB),
        ];
        let memory = memory_per_pid(&procs);
        let owners = attribute(&a, &[1, 60, 61, 70], &view, &mut Cgroups::default());
        assert_eq!(owners[&1], Owner::Allocation(0));
        assert_eq!(owners[&60], Owner::UnknownContainer);
        assert_eq!(owners[&61], Owner::UnknownContainer);
        assert_eq!(owners[&70], Owner::UnknownHost);
        let acts = decide(&a, &memory, &owners, 0);
        let unknown: Vec<(i32, bool)> = acts
            .iter()
            .map(|x| match x.reason {
                Reason::Unknown { container, .. } => (x.pid, container),
                _ => panic!("{x:?}"),
            })
            .collect();
        assert_eq!(unknown, vec![(60, true), (61, true), (70, false)]);
    }

    /// A whole-card allocation holding the cards `gpus`.
    fn whole(id: &str, pids: &[i32], gpus: &[u32]) -> Watched {
        let mut x = w(id, 80 * GIB, pids);
        x.share = 100;
        x.whole_gpus = gpus.to_vec();
        x
    }

    #[test]
    fn a_whole_card_is_not_policed_on_its_own_cards() {
        // A pod holding cards 1 and 2 (one group) fills both: nothing to police there.
        let a = [whole("a", &[1], &[1, 2])];
        let procs = [on(1, 1, 80 * GIB), on(2, 1, 80 * GIB)];
        assert!(run(&a, &procs, &Fake::default(), 0).is_empty());
    }

    #[test]
    fn a_whole_card_allocation_is_policed_on_cards_it_does_not_own() {
        // a holds card 1 wholly; its process also took 20 GiB on card 0, whose tenants it
        // would crowd out: over a limit of 0 there, whatever it holds on card 1.
        let a = [whole("a", &[1], &[1]), w("b", 8 * GIB, &[5])];
        let procs = [on(1, 1, 10 * GIB), on(0, 1, 20 * GIB), on(0, 5, GIB)];
        let acts = run(&a, &procs, &Fake::default(), 512 * MIB);
        assert_eq!(acts.len(), 1, "{acts:?}");
        assert_eq!((acts[0].pid, acts[0].allocation.as_deref()), (1, Some("a")));
        assert_eq!(
            acts[0].reason,
            Reason::Memory {
                used: 20 * GIB,
                total: 20 * GIB,
                allowed: 0
            }
        );
        // Even a context's worth on a foreign card is over (no tolerance there).
        let procs = [on(1, 1, GIB), on(0, 1, MIB)];
        assert_eq!(run(&a, &procs, &Fake::default(), 512 * MIB).len(), 1);
        // A whole allocation whose card is gone owns nothing: policed everywhere.
        let gone = [whole("a", &[1], &[])];
        assert_eq!(run(&gone, &[on(1, 1, GIB)], &Fake::default(), 0).len(), 1);
    }

    /// Slice `id` of GPU group `group` on card `gpu`.
    fn slice(id: &str, group: &str, gpu: u32, limit: u64, pids: &[i32]) -> Watched {
        let mut x = w(id, limit, pids);
        x.gpu = Some(gpu);
        x.group = Some(group.into());
        x
    }

    #[test]
    fn a_multi_gpu_allocation_is_policed_per_card_never_summed() {
        // One process (connected for slice a) on both cards of a 10/20 GiB allocation.
        let g = [
            slice("a", "a", 0, 10 * GIB, &[1]),
            slice("b", "a", 1, 20 * GIB, &[]),
        ];
        let at_limits = [on(0, 1, 10 * GIB), on(1, 1, 20 * GIB)];
        assert!(run(&g, &at_limits, &Fake::default(), 0).is_empty());
        // Over on card 1 only: charged to b, card 0's figure is not added in.
        let over1 = [on(0, 1, 10 * GIB), on(1, 1, 20 * GIB + MIB)];
        let acts = run(&g, &over1, &Fake::default(), 0);
        assert_eq!(acts.len(), 1, "{acts:?}");
        assert_eq!(acts[0].allocation.as_deref(), Some("b"));
        assert_eq!(total(&acts[0]), 20 * GIB + MIB);
        // Over on card 0 only: charged to a, however little card 1 holds.
        let over0 = [on(0, 1, 10 * GIB + MIB), on(1, 1, MIB)];
        let acts = run(&g, &over0, &Fake::default(), 0);
        assert_eq!(acts.len(), 1, "{acts:?}");
        assert_eq!(acts[0].allocation.as_deref(), Some("a"));
        assert_eq!(total(&acts[0]), 10 * GIB + MIB);
        // Two processes, one per card (TP ranks), each at its card's limit: nothing.
        let g2 = [
            slice("a", "a", 0, 10 * GIB, &[1]),
            slice("b", "a", 1, 20 * GIB, &[2]),
        ];
        let ranks = [on(0, 1, 10 * GIB), on(1, 2, 20 * GIB)];
        assert!(run(&g2, &ranks, &Fake::default(), 0).is_empty());
    }

    #[test]
    fn a_multi_gpu_tenant_cannot_use_a_card_outside_its_group_nor_charge_a_neighbour() {
        // Group a on cards 0 and 1; neighbour c on card 2 with room to spare.
        let g = [
            slice("a", "a", 0, 10 * GIB, &[1]),
            slice("b", "a", 1, 20 * GIB, &[]),
            w("c", 40 * GIB, &[9]),
        ];
        // The tenant's process takes memory on card 2: allowed nothing there, whatever room
        // its slices or the neighbour have; the neighbour is untouched.
        let procs = [on(0, 1, GIB), on(2, 1, MIB), on(2, 9, GIB)];
        let acts = run(&g, &procs, &Fake::default(), 512 * MIB);
        assert_eq!(acts.len(), 1, "{acts:?}");
        assert_eq!((acts[0].pid, acts[0].allocation.as_deref()), (1, Some("a")));
        assert_eq!(
            acts[0].reason,
            Reason::Memory {
                used: MIB,
                total: MIB,
                allowed: 0
            }
        );
        // A process of the neighbour's on card 1 is the neighbour's (summed into c, as for
        // any one-card allocation), never charged to slice b.
        let procs = [on(1, 9, 41 * GIB)];
        let acts = run(&g, &procs, &Fake::default(), 0);
        assert_eq!(acts.len(), 1, "{acts:?}");
        assert_eq!(acts[0].allocation.as_deref(), Some("c"));
    }

    #[test]
    fn a_multi_gpu_allocations_gpu_time_is_charged_to_each_cards_slice() {
        let g = [slice("a", "a", 0, GIB, &[1]), slice("b", "a", 1, GIB, &[])];
        let owners = HashMap::from([(1, Owner::Allocation(0))]);
        let per_gpu = HashMap::from([((1, 0), 3 * MS), ((1, 1), 5 * MS), ((1, 7), 2 * MS)]);
        let rows = gpu_time_rows(&g, &per_gpu, &owners);
        // Card 0 and card 7 (outside the group, unleased) on a; card 1 on b.
        assert_eq!(
            rows,
            vec![
                TimeRow {
                    pid: 1,
                    allocation: 0,
                    all_ns: 5 * MS,
                    policed_ns: 5 * MS
                },
                TimeRow {
                    pid: 1,
                    allocation: 1,
                    all_ns: 5 * MS,
                    policed_ns: 5 * MS
                },
            ]
        );
    }

    #[test]
    fn a_whole_card_allocations_gpu_time_is_policed_only_on_foreign_cards() {
        let a = [whole("a", &[1], &[1]), w("b", GIB, &[5])];
        let owners = attribute(&a, &[1, 5, 9], &Fake::default(), &mut Cgroups::default());
        let per_gpu = HashMap::from([
            ((1, 1), 900 * MS),
            ((1, 0), 300 * MS),
            ((5, 0), 200 * MS),
            ((9, 0), 50 * MS),
        ]);
        let (all, policed) = policed_gpu_time(&a, &per_gpu, &owners);
        assert_eq!(
            (all[&1], all[&5], all[&9]),
            (1200 * MS, 200 * MS, 50 * MS),
            "every ns is counted as busy"
        );
        assert_eq!(
            (policed[&1], policed[&5], policed[&9]),
            (300 * MS, 200 * MS, 50 * MS),
            "only card 1's time is a's own"
        );
    }

    #[test]
    fn the_identity_file_beats_any_connection() {
        // A process whose container's read-only file names a is a's, even connected for b (and
        // a connection for b from a container of nobody cannot make it b's either).
        let a = [w("a", GIB, &[]), w("b", GIB, &[7, 8])];
        let view = Fake {
            containers: HashMap::from([(7, Some("tok-a".into())), (8, Some("forged".into()))]),
            ..Default::default()
        };
        let owners = attribute(&a, &[7, 8], &view, &mut Cgroups::default());
        assert_eq!(owners[&7], Owner::Allocation(0));
        assert_eq!(owners[&8], Owner::UnknownContainer);
    }

    #[test]
    fn a_reused_pid_and_its_descendants_are_not_attributed_and_the_live_original_still_is() {
        // a's process 100 connected (start 1000) and exited; a host job got pid 100 later
        // (start 5000) and forked 101. a's live process 200 and its child 201 are a's.
        let a = [w("a", GIB, &[100, 200])];
        let view = Fake {
            parents: HashMap::from([(101, 100), (201, 200)]),
            starts: HashMap::from([(100, Some(5000))]),
            ..Default::default()
        };
        let owners = attribute(&a, &[100, 101, 200, 201], &view, &mut Cgroups::default());
        assert_eq!(owners[&100], Owner::UnknownHost);
        assert_eq!(owners[&101], Owner::UnknownHost);
        assert_eq!(owners[&200], Owner::Allocation(0));
        assert_eq!(owners[&201], Owner::Allocation(0));
        // The memory rule kills nothing on the host for a's limit: 2 GiB on the trap pid.
        let procs = [p(100, 2 * GIB), p(200, 100 * MIB)];
        assert!(run(&a, &procs, &view, 0).is_empty());
        // And the trap entry is gone from what the rules after attribution see.
        let mut live = a.to_vec();
        forget_exited(&mut live, &view);
        assert_eq!(
            live[0].pids,
            vec![ProcId {
                pid: 200,
                start: START
            }]
        );
    }

    #[test]
    fn a_trap_pid_taken_by_a_neighbour_is_the_neighbours() {
        // b's honest process connected for b with pid 100 after a's connection of a former
        // pid 100 exited: it is b's alone, and b's limit is what counts.
        let mut a = [w("a", GIB, &[100]), w("b", 8 * GIB, &[])];
        a[1].pids.push(ProcId {
            pid: 100,
            start: 5000,
        });
        let view = Fake {
            starts: HashMap::from([(100, Some(5000))]),
            ..Default::default()
        };
        assert_eq!(
            attribute(&a, &[100], &view, &mut Cgroups::default())[&100],
            Owner::Allocation(1)
        );
        assert!(run(&a, &[p(100, 2 * GIB)], &view, 0).is_empty());
        // A connection whose process is gone altogether attributes nobody either.
        let view = Fake {
            starts: HashMap::from([(100, None)]),
            ..Default::default()
        };
        assert_eq!(
            attribute(&a, &[100], &view, &mut Cgroups::default())[&100],
            Owner::UnknownHost
        );
    }

    #[test]
    fn a_containers_cgroup_is_learnt_from_its_identity_and_attributes_after() {
        let a = [w("a", GIB, &[]), w("b", GIB, &[])];
        let mut view = Fake {
            containers: HashMap::from([(40, Some("tok-a".into())), (41, None), (42, None)]),
            cgroups: HashMap::from([
                (40, "/kubepods/pod1/c1".into()),
                (41, "/kubepods/pod1/c1".into()),
                (42, "/kubepods/pod2/c2".into()),
                (43, "/kubepods/pod1/c1".into()),
            ]),
            ..Default::default()
        };
        let mut book = Cgroups::new(["/arbiter".to_owned()]);
        // Before any process of it showed its identity, 41 (no file: it chrooted away) is
        // nobody's.
        let owners = attribute(&a, &[41], &view, &mut book);
        assert_eq!(owners[&41], Owner::UnknownContainer);
        let owners = attribute(&a, &[40, 41, 42, 43], &view, &mut book);
        assert_eq!(owners[&40], Owner::Allocation(0));
        assert_eq!(owners[&41], Owner::Allocation(0), "same cgroup as 40");
        assert_eq!(owners[&42], Owner::UnknownContainer, "another container");
        // 43 runs on the host (its mount namespace is the host's): never a container's by
        // cgroup.
        assert_eq!(owners[&43], Owner::UnknownHost);
        assert_eq!(book.len(), 1);
        // The root and the arbiter's own cgroup are never learnt (a container sharing them
        // with the host would make host processes its own).
        view.cgroups.insert(40, "/".into());
        view.cgroups.insert(41, "/".into());
        let mut book = Cgroups::new(["/arbiter".to_owned()]);
        let owners = attribute(&a, &[40, 41], &view, &mut book);
        assert_eq!(owners[&41], Owner::UnknownContainer);
        view.cgroups.insert(40, "/arbiter".into());
        view.cgroups.insert(41, "/arbiter".into());
        let owners = attribute(&a, &[40, 41], &view, &mut book);
        assert_eq!(owners[&41], Owner::UnknownContainer);
        assert!(book.is_empty());
        // A cgroup where two allocations' identities show attributes nobody.
        view.cgroups.insert(40, "/c".into());
        view.cgroups.insert(41, "/c".into());
        view.cgroups.insert(44, "/c".into());
        view.containers.insert(44, Some("tok-b".into()));
        let owners = attribute(&a, &[40, 44, 41], &view, &mut book);
        assert_eq!(
            (owners[&40], owners[&44]),
            (Owner::Allocation(0), Owner::Allocation(1))
        );
        assert_eq!(owners[&41], Owner::UnknownContainer);
        // Dropped with the allocation.
        book.retain(&HashSet::new());
        view.cgroups.insert(44, "/d".into());
        attribute(&a, &[44], &view, &mut book);
        assert_eq!(book.len(), 2);
        book.retain(&HashSet::from(["a"]));
        assert_eq!(book.len(), 1, "the shared /c stays, b's /d goes");
    }

    #[test]
    fn the_cgroup_book_is_bounded() {
        let mut book = Cgroups::default();
        for i in 0..CGROUPS_MAX + 10 {
            book.learn(Some(format!("/c{i}")), "a");
        }
        assert_eq!(book.len(), CGROUPS_MAX);
        assert_eq!(book.owner(&format!("/c{}", CGROUPS_MAX + 5)), None);
    }

    fn policy() -> Policy {
        Policy {
            interval: Duration::from_millis(250),
            memory_tolerance: Tolerance::default(),
            enforce: Enforce::Kill,
            unknown: Unknown::Kill,
            compute_threshold: Duration::from_millis(500),
            compute_slack: 0.05,
        }
    }

    /// One observation of an allocation alone on its GPU.
    fn observe1(
        book: &mut ComputeBook,
        id: &str,
        used_ns: u64,
        leased_total: u64,
        elapsed: u64,
        pol: &Policy,
        may_act: bool,
    ) -> ComputeVerdict {
        let u = ComputeUse {
            id,
            used_ns,
            leased_total,
        };
        book.observe_gpu(&[u], elapsed, pol, may_act)[0]
    }

    #[test]
    fn honest_use_within_leases_builds_no_debt() {
        let mut book = ComputeBook::default();
        let pol = policy();
        let mut leased = 0;
        assert!(
            !observe1(&mut book, "a", 0, leased, 250 * MS, &pol, true).over,
            "first sight sets the start"
        );
        // Kernel time reported when kernels end: up to one lease behind or ahead each poll.
        let mut charged = 0;
        for i in 0..400u64 {
            leased += 250 * MS;
            let used = if i % 2 == 0 { 150 * MS } else { 350 * MS };
            let v = observe1(&mut book, "a", used, leased, 250 * MS, &pol, true);
            assert!(!v.over, "poll {i}: {v:?}");
            assert!(v.unleased_ns <= 100 * MS, "poll {i}: {v:?}");
            charged += v.charge_ns;
        }
        assert_eq!(
            charged, 0,
            "late kernel time pays back earlier lease time, nothing is charged"
        );
    }

    #[test]
    fn gpu_time_without_leases_is_charged_and_past_the_threshold_the_process_goes() {
        let mut book = ComputeBook::default();
        let pol = policy();
        observe1(&mut book, "a", 0, 0, 250 * MS, &pol, true);
        // Half the GPU, no lease at all: 125 ms per poll, less 12.5 ms of slack.
        let mut over_at = None;
        for i in 1..=10 {
            let v = observe1(&mut book, "a", 125 * MS, 0, 250 * MS, &pol, true);
            assert_eq!(v.charge_ns, 112_500_000);
            assert_eq!(
                v.forgiven_ns, 12_500_000,
                "the slack, counted against a cap"
            );
            if v.over {
                over_at = Some(i);
                break;
            }
        }
        // 5 polls: 562.5 ms > 500 ms, 1.25 s after the bypass began.
        assert_eq!(over_at, Some(5));
        // The debt starts again after an action.
        assert!(!observe1(&mut book, "a", 125 * MS, 0, 250 * MS, &pol, true).over);
    }

    #[test]
    fn a_tenant_that_leases_is_charged_for_drift_but_not_killed_and_warm_up_holds_kills() {
        let mut book = ComputeBook::default();
        let pol = policy();
        observe1(&mut book, "a", 0, 0, 250 * MS, &pol, true);
        // Leases cover only 150 of every 250 ms of its GPU time (say, revoked leases whose
        // kernels finish late): the debt grows and is charged, but it mostly leases: no kill.
        let (mut leased, mut charged) = (0, 0);
        for i in 0..20 {
            leased += 150 * MS;
            let v = observe1(&mut book, "a", 250 * MS, leased, 250 * MS, &pol, true);
            assert!(!v.over, "poll {i}: {v:?}");
            charged += v.charge_ns;
        }
        assert_eq!(
            charged,
            20 * 87_500_000,
            "every unleased ms beyond the slack is charged"
        );
        // No lease at all, but within the warm-up after a start: charged, no kill.
        let mut b = ComputeBook::default();
        observe1(&mut b, "b", 0, 0, 250 * MS, &pol, false);
        for _ in 0..20 {
            let v = observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, false);
            assert!(!v.over && v.charge_ns > 0);
        }
        // Warm-up over: its debt was forgiven (charged, not counted towards a kill); new
        // unleased time is, and passes the 500 ms threshold on the third poll (237.5 ms each).
        assert!(!observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, true).over);
        assert!(!observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, true).over);
        assert!(observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, true).over);
    }

    #[test]
    fn unused_leases_bank_at_most_one_interval() {
        let mut book = ComputeBook::default();
        let pol = policy();
        observe1(&mut book, "a", 0, 0, 250 * MS, &pol, true);
        // Ten idle leased seconds...
        observe1(&mut book, "a", 0, 10_000 * MS, 250 * MS, &pol, true);
        // ...do not pay for a bypass later: 250 ms of credit, then the debt grows.
        let mut polls = 0;
        while !observe1(&mut book, "a", 250 * MS, 10_000 * MS, 250 * MS, &pol, true).over {
            polls += 1;
            assert!(polls < 10);
        }
        assert_eq!(polls, 3, "(250 + 500) / 237.5 ms per poll");
    }

    #[test]
    fn the_slack_is_shared_out_max_min_fairly_and_never_beyond_the_budget() {
        assert_eq!(share_out(&[1, 10, 10], 9), vec![1, 4, 4]);
        assert_eq!(share_out(&[10, 0, 3], 100), vec![10, 0, 3], "all met");
        assert_eq!(share_out(&[5, 5], 0), vec![0, 0]);
        assert_eq!(share_out(&[], 5), Vec::<i128>::new());
        let given = share_out(&[7; 10], 25);
        assert_eq!(given.iter().sum::<i128>(), 25);
        assert!(given.iter().all(|g| (2..=3).contains(g)), "{given:?}");
    }

    /// The names of `n` bypassing allocations.
    fn bypasser_ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("b{i}")).collect()
    }

    /// One poll's GPU use: each of `ids` used `bypass` ns and never leased, and the last one,
    /// "honest", used `used` ns against `leased` ns leased in all.
    fn beside_honest(ids: &[String], bypass: u64, used: u64, leased: u64) -> Vec<ComputeUse<'_>> {
        let mut u: Vec<ComputeUse<'_>> = ids
            .iter()
            .map(|id| ComputeUse {
                id,
                used_ns: bypass,
                leased_total: 0,
            })
            .collect();
        u.push(ComputeUse {
            id: "honest",
            used_ns: used,
            leased_total: leased,
        });
        u
    }

    /// The policy, ten bypassers' names, and a book that has seen them and "honest" once, all
    /// at zero.
    fn ten_bypassers_seen() -> (Policy, ComputeBook, Vec<String>) {
        let (pol, mut book, ids) = (policy(), ComputeBook::default(), bypasser_ids(10));
        book.observe_gpu(&beside_honest(&ids, 0, 0, 0), 250 * MS, &pol, true);
        (pol, book, ids)
    }

    /// `v` (ten bypassers, then "honest"): "honest" is in debt, yet only the bypassers are
    /// acted on.
    fn only_the_bypassers_acted_on_beside_a_debt(v: &[ComputeVerdict]) {
        assert!(v[10].unleased_ns > 0, "in debt: {:?}", v[10]);
        assert!(v[..10].iter().all(|v| v.over), "{v:?}");
        assert!(!v[10].over, "the leasing tenant was acted on: {:?}", v[10]);
    }

    /// `n` share-1 allocations each using `each` ns around the gate per 250 ms poll, beside an
    /// honest one whose GPU time matches its leases; `polls` polls. Returns every verdict of
    /// the bypassers and the honest one's total charge and whether it was ever over.
    fn bypassers_beside_an_honest_tenant(
        n: usize,
        each: u64,
        polls: usize,
    ) -> (Vec<Vec<ComputeVerdict>>, u64, bool) {
        let pol = policy();
        let mut book = ComputeBook::default();
        let ids = bypasser_ids(n);
        let mut leased = 0;
        let uses = |used: u64, leased: u64| beside_honest(&ids, used, 200 * MS, leased);
        book.observe_gpu(&uses(0, 0), 250 * MS, &pol, true);
        let (mut out, mut honest_charged, mut honest_over) = (Vec::new(), 0, false);
        for _ in 0..polls {
            leased += 200 * MS;
            let mut v = book.observe_gpu(&uses(each, leased), 250 * MS, &pol, true);
            let h = v.pop().unwrap();
            honest_charged += h.charge_ns;
            honest_over |= h.over;
            out.push(v);
        }
        (out, honest_charged, honest_over)
    }

    #[test]
    fn ten_allocations_share_one_slack_per_gpu_and_the_rest_is_charged_and_counted() {
        // Each takes 4.9% of the GPU around the gate: under a 5% slack per allocation none
        // was ever charged; now the ten share 12.5 ms per 250 ms poll.
        let each = 12_250_000;
        let (polls, honest_charged, honest_over) = bypassers_beside_an_honest_tenant(10, each, 8);
        let first = &polls[0];
        let charged: u64 = first.iter().map(|v| v.charge_ns).sum();
        assert_eq!(
            charged,
            10 * each - 12_500_000,
            "only one slack forgiven for all ten: {first:?}"
        );
        assert!(
            first
                .iter()
                .all(|v| v.charge_ns == each - 1_250_000 && v.forgiven_ns == 1_250_000)
        );
        // Their debts together pass 500 ms on the fifth poll (5 x 110 ms), although each has
        // only 55 ms: all ten are acted on at once.
        let over_at = polls.iter().position(|p| p.iter().any(|v| v.over));
        assert_eq!(over_at, Some(4));
        assert!(polls[4].iter().all(|v| v.over), "{:?}", polls[4]);
        assert!(polls[4].iter().all(|v| v.unleased_ns == 55 * MS));
        // Their debts start again after the action.
        assert!(polls[5].iter().all(|v| !v.over && v.unleased_ns == 11 * MS));
        // The honest tenant uses what it leased: never charged, never acted on.
        assert_eq!(honest_charged, 0);
        assert!(!honest_over);
    }

    #[test]
    fn a_lease_overrun_is_forgiven_whole_beside_bypassers() {
        let pol = policy();
        let mut book = ComputeBook::default();
        let ids = bypasser_ids(5);
        let mut leased = 0;
        let mut uses = |used: u64, overrun: u64| {
            leased += 100 * MS;
            beside_honest(&ids, used, 100 * MS + overrun, leased)
        };
        book.observe_gpu(&uses(0, 0), 250 * MS, &pol, true);
        for i in 0..20 {
            // 8 ms over its leases each poll, beyond an equal part of the slack (12.5 / 6 ms):
            // it leased, so its overrun is served first; the bypassers share the rest.
            let v = book.observe_gpu(&uses(20 * MS, 8 * MS), 250 * MS, &pol, true);
            let h = v[5];
            assert_eq!((h.charge_ns, h.over), (0, false), "poll {i}: {v:?}");
            let to_bypassers: u64 = v[..5].iter().map(|v| v.charge_ns).sum();
            assert_eq!(to_bypassers, 5 * 20 * MS - 4_500_000, "poll {i}");
        }
    }

    #[test]
    fn a_leasing_tenant_in_debt_is_not_caught_up_in_its_neighbours_bypass() {
        // Seen in the ten-bypasser test before this rule: the share-90 tenant, flooded by
        // bypass kernels, drifted into debt while it leased, then had one interval with
        // hardly a lease (waiting on its drain); the bypassers' debts took the GPU past the
        // threshold and it was killed with them.
        let (pol, mut book, ids) = ten_bypassers_seen();
        let uses = |bypass: u64, used: u64, leased: u64| beside_honest(&ids, bypass, used, leased);
        // Three polls: it leases 150 ms and uses 250 (drift), the ten bypass 5 ms each.
        let mut leased = 0;
        for _ in 0..3 {
            leased += 150 * MS;
            let v = book.observe_gpu(&uses(5 * MS, 250 * MS, leased), 250 * MS, &pol, true);
            assert!(v.iter().all(|v| !v.over), "{v:?}");
        }
        // Then an interval with 5 ms of use and no lease, while the bypassers pass the
        // threshold together.
        let v = book.observe_gpu(&uses(60 * MS, 5 * MS, leased), 250 * MS, &pol, true);
        only_the_bypassers_acted_on_beside_a_debt(&v);
    }

    #[test]
    fn one_interval_without_a_lease_does_not_make_a_leasing_tenant_a_bypasser() {
        // Seen in a full test run: the share-90 tenant leased all it used, then its kernels,
        // stuck behind the bypass kernels, finished after its lease: 110 ms used, no lease in
        // that interval, its debt above zero for the first time, while ten bypassers passed
        // the threshold together.
        let (pol, mut book, ids) = ten_bypassers_seen();
        let uses = |bypass: u64, used: u64, leased: u64| beside_honest(&ids, bypass, used, leased);
        let mut leased = 0;
        for _ in 0..4 {
            leased += 240 * MS;
            book.observe_gpu(&uses(10 * MS, 240 * MS, leased), 250 * MS, &pol, true);
        }
        let v = book.observe_gpu(&uses(60 * MS, 110 * MS, leased), 250 * MS, &pol, true);
        only_the_bypassers_acted_on_beside_a_debt(&v);
    }

    #[test]
    fn kernels_that_ran_late_on_leases_paid_before_do_not_make_a_tenant_a_bypasser() {
        // Seen once in the ten-bypasser test beside a CPU hog: the share-90 tenant's kernels
        // waited behind the bypass kernels while its leases ran (part of them idle), and ran
        // after them, mostly outside leases for seconds. Its debt and the bypassers' passed
        // the threshold together and it was killed with them, for time it had leased earlier.
        let (pol, mut book, ids) = ten_bypassers_seen();
        let uses = |bypass: u64, used: u64, leased: u64| beside_honest(&ids, bypass, used, leased);
        let mut leased = 0;
        // 10 s: it holds the GPU's leases but its kernels get only 150 ms of each 250.
        for _ in 0..40 {
            leased += 250 * MS;
            let v = book.observe_gpu(&uses(0, 150 * MS, leased), 250 * MS, &pol, true);
            assert!(v.iter().all(|v| !v.over), "{v:?}");
        }
        // 2.5 s: its queued kernels run, 240 ms a poll, beside 40 ms of lease, while the ten
        // bypass 10 ms each.
        let (mut honest_charged, mut bypassers_over) = (0, false);
        for poll in 0..10 {
            leased += 40 * MS;
            let v = book.observe_gpu(&uses(10 * MS, 240 * MS, leased), 250 * MS, &pol, true);
            assert!(
                !v[10].over,
                "poll {poll}: the tenant that leased was acted on: {v:?}"
            );
            honest_charged += v[10].charge_ns;
            bypassers_over |= v[..10].iter().all(|v| v.over);
        }
        // Its drift beyond the slack is charged to its share; the bypassers are acted on.
        assert!(honest_charged > 0, "the drift was not charged");
        assert!(bypassers_over, "the bypassers were never acted on");
    }

    #[test]
    fn leases_held_before_buy_no_bypass_later() {
        // Attack: lease honestly for 10 s (bank lease time), then launch around the gate with
        // no lease at all. The long sums tip at the first poll of the bypass; its debt is
        // over the 500 ms threshold at the third, as without the banked leases.
        let pol = policy();
        let mut book = ComputeBook::default();
        let mut leased = 0;
        observe1(&mut book, "banker", 0, leased, 250 * MS, &pol, true);
        for _ in 0..40 {
            leased += 100 * MS;
            let v = observe1(&mut book, "banker", 100 * MS, leased, 250 * MS, &pol, true);
            assert!(!v.over, "{v:?}");
        }
        let over_at = (1..=10)
            .find(|_| observe1(&mut book, "banker", 250 * MS, leased, 250 * MS, &pol, true).over);
        assert_eq!(over_at, Some(3));
    }

    #[test]
    fn a_leasing_tenant_is_never_acted_on_for_a_neighbour_that_bypasses() {
        let pol = policy();
        let mut book = ComputeBook::default();
        let mut leased = 0;
        let mut polls = 0;
        let uses = |leased: u64| {
            [
                // Leases cover 150 of its 250 ms (drift): debt, but mostly leased.
                ComputeUse {
                    id: "drifter",
                    used_ns: 250 * MS,
                    leased_total: leased,
                },
                ComputeUse {
                    id: "bypasser",
                    used_ns: 50 * MS,
                    leased_total: 0,
                },
            ]
        };
        book.observe_gpu(&uses(0), 250 * MS, &pol, true);
        loop {
            leased += 150 * MS;
            let v = book.observe_gpu(&uses(leased), 250 * MS, &pol, true);
            polls += 1;
            assert!(!v[0].over, "poll {polls}: {v:?}");
            assert!(v[0].charge_ns > 0, "the drift is charged");
            if v[1].over {
                break;
            }
            assert!(polls < 20, "the bypasser was never acted on");
        }
        // The bypasser alone counts: 50 ms a poll less at most all of the slack, past 500 ms.
        assert!((11..=14).contains(&polls), "{polls}");
    }

    #[test]
    fn a_processes_excess_on_the_card_is_charged_once_two_polls_saw_it_and_follows_the_card() {
        let (a, b) = (ProcId { pid: 10, start: 1 }, ProcId { pid: 11, start: 1 });
        const MIB: u64 = 1 << 20;
        let mut book = ExcessBook::default();
        // a: a 500 MiB context on the card, 300 MiB reserved for it; b: within its reservation.
        let first = book.observe(&[(a, 500 * MIB, 300 * MIB), (b, 100 * MIB, 400 * MIB)]);
        assert!(first.is_empty(), "one poll is not enough: {first:?}");
        let second = book.observe(&[(a, 500 * MIB, 300 * MIB), (b, 100 * MIB, 400 * MIB)]);
        assert_eq!(second, HashMap::from([(a, 200 * MIB)]));
        // A moment's excess (b between a free and its release) is not charged.
        let third = book.observe(&[(a, 500 * MIB, 300 * MIB), (b, 450 * MIB, 400 * MIB)]);
        assert_eq!(third, HashMap::from([(a, 200 * MIB)]));
        // a's context shrank on the card (or it reserved more): the charge follows down.
        let fourth = book.observe(&[(a, 400 * MIB, 300 * MIB), (b, 100 * MIB, 400 * MIB)]);
        assert_eq!(fourth, HashMap::from([(a, 100 * MIB)]));
        // A pid given to another process starts from nothing.
        let c = ProcId { pid: 10, start: 2 };
        assert!(book.observe(&[(c, 900 * MIB, 0)]).is_empty());
    }

    #[test]
    fn the_culprit_is_unconnected_first_then_the_busiest() {
        let connected = HashSet::from([1, 2]);
        assert_eq!(
            compute_culprit(&[(1, 50), (2, 90), (3, 10)], &connected),
            Some((3, 10))
        );
        assert_eq!(
            compute_culprit(&[(1, 50), (2, 90)], &connected),
            Some((2, 90))
        );
        assert_eq!(compute_culprit(&[(1, 0)], &connected), None);
    }

    #[test]
    fn proc_parent_reads_this_process() {
        let me = std::process::id() as i32;
        let parent = proc_parent(me).expect("own stat");
        // SAFETY: getppid has no preconditions.
        assert_eq!(parent, unsafe { libc::getppid() });
        assert_eq!(proc_parent(-5), None);
        // We started after our parent, and a start time does not change.
        let (mine, theirs) = (proc_start(me).unwrap(), proc_start(parent).unwrap());
        assert!(mine >= theirs, "{mine} {theirs}");
        assert_eq!(proc_start(me), Some(mine));
        assert_eq!(proc_start(-5), None);
        assert!(proc_cgroup("self").is_some_and(|c| c.starts_with('/')));
    }

    #[test]
    fn this_process_runs_on_the_host_and_has_no_identity() {
        let (view, err) = ProcFs::new(std::path::Path::new("/proc/self/ns/mnt"));
        assert!(err.is_none());
        assert_eq!(view.origin(std::process::id() as i32), Origin::Host);
        // An unreadable host namespace: a process without an identity is a host process.
        let (view, err) = ProcFs::new(std::path::Path::new("/nonexistent/ns/mnt"));
        assert!(err.is_some());
        assert_eq!(view.origin(std::process::id() as i32), Origin::Host);
        // Our root has no read-only identity file (and a gone pid has none either).
        assert_eq!(read_identity(-1), None);
    }

    /// GPU readings set by the test; `fail` makes every read fail, as a wedged NVML would.
    #[derive(Default)]
    struct FakeGpus {
        procs: std::sync::Mutex<Vec<GpuProcess>>,
        fail: std::sync::atomic::AtomicBool,
    }

    impl GpuSource for Arc<FakeGpus> {
        fn device_count(&self) -> Result<u32, GpuSourceError> {
            if self.fail.load(Ordering::Relaxed) {
                return Err(GpuSourceError::Other("NVML is gone".into()));
            }
            Ok(1)
        }

        fn processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, GpuSourceError> {
            let all = self.procs.lock().unwrap();
            Ok(all.iter().copied().filter(|p| p.gpu == gpu).collect())
        }

        fn utilization(&self, _: u32, _: u64) -> Option<Vec<UtilSample>> {
            Some(Vec::new())
        }
    }

    /// Records whom it was told to kill; kills nobody.
    struct Recorder(Arc<std::sync::Mutex<Vec<i32>>>);

    impl Killer for Recorder {
        fn kill(&self, pid: i32) -> bool {
            self.0.lock().unwrap().push(pid);
            true
        }
    }

    /// What [`bed`] makes: the arbiter, the allocation's id, the fake readings, whom the fake
    /// killer was told to kill, and the backstop.
    type Bed = (
        Arc<Arbiter>,
        String,
        Arc<FakeGpus>,
        Arc<std::sync::Mutex<Vec<i32>>>,
        Backstop,
    );

    /// An arbiter with one 80 GiB GPU and one 1 GiB allocation whose tenant is this very test
    /// process (connected, named by pid and start time); a backstop over fakes in `enforce`.
    fn bed(dir: &std::path::Path, enforce: Enforce) -> Bed {
        let gpus = vec![tessera_protocol::GpuInfo {
            index: 0,
            uuid: "GPU-0".into(),
            name: "fake".into(),
            memory_total: 80 * GIB,
        }];
        let arb = Arbiter::new(
            gpus,
            crate::store::Store::open(dir).unwrap(),
            crate::scheduler::SchedulerParams::default(),
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (token, view) = rt
            .block_on(arb.create(tessera_protocol::CreateAllocation {
                gpu: tessera_protocol::GpuSelector::Index(0),
                memory_limit: GIB,
                share: 10,
                cap: None,
                labels: Default::default(),
            }))
            .unwrap();
        let me = std::process::id() as i32;
        let peer = Peer::without_pidfd(ProcId {
            pid: me,
            start: proc_start(me).unwrap(),
        });
        arb.attach_tenant(&token, 1, Some(peer)).unwrap();
        let readings = Arc::new(FakeGpus::default());
        let killed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let policy = Policy {
            interval: Duration::from_millis(250),
            memory_tolerance: Tolerance::from(DEFAULT_MEMORY_SLACK),
            enforce,
            unknown: Unknown::Report,
            compute_threshold: Duration::from_millis(500),
            compute_slack: 0.05,
        };
        let b = Backstop::with_io(
            Arc::clone(&arb),
            policy,
            Box::new(Arc::clone(&readings)),
            Box::new(Recorder(Arc::clone(&killed))),
            std::path::Path::new("/proc/self/ns/mnt"),
        );
        (arb, view.id, readings, killed, b)
    }

    fn on_gpu0(pid: i32, used: u64) -> GpuProcess {
        GpuProcess { pid, gpu: 0, used }
    }

    #[test]
    fn a_poll_kills_the_process_that_takes_its_allocation_past_the_limit_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let (arb, id, readings, killed, mut b) = bed(dir.path(), Enforce::Kill);
        let me = std::process::id() as i32;
        // Within the limit and its slack: nothing happens.
        *readings.procs.lock().unwrap() = vec![on_gpu0(me, GIB + DEFAULT_MEMORY_SLACK)];
        assert!(b.poll().is_empty());
        assert!(killed.lock().unwrap().is_empty());
        // One byte past it: this process (the allocation's only one) is killed, counted and
        // noted on the allocation for `tessera status`.
        *readings.procs.lock().unwrap() = vec![on_gpu0(me, GIB + DEFAULT_MEMORY_SLACK + 1)];
        let taken = b.poll();
        assert_eq!(taken.len(), 1, "{taken:?}");
        assert!(
            matches!(taken[0].reason, Reason::Memory { .. }),
            "{taken:?}"
        );
        assert_eq!(taken[0].allocation.as_deref(), Some(id.as_str()));
        assert_eq!(*killed.lock().unwrap(), [me]);
        assert_eq!(b.counters.polls.load(Ordering::Relaxed), 2);
        assert_eq!(b.counters.killed.load(Ordering::Relaxed), 1);
        assert_eq!(b.counters.breaches.load(Ordering::Relaxed), 1);
        let snap = arb.snapshot();
        assert_eq!(snap.allocs[0].enforced, [1, 0], "one memory action noted");
    }

    #[test]
    fn in_report_mode_a_poll_acts_without_killing() {
        let dir = tempfile::tempdir().unwrap();
        let (_arb, _, readings, killed, mut b) = bed(dir.path(), Enforce::Report);
        let me = std::process::id() as i32;
        *readings.procs.lock().unwrap() = vec![on_gpu0(me, 4 * GIB)];
        let taken = b.poll();
        assert_eq!(taken.len(), 1);
        assert!(killed.lock().unwrap().is_empty(), "report mode killed");
        assert_eq!(b.counters.killed.load(Ordering::Relaxed), 0);
        assert_eq!(b.counters.breaches.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_gpu_source_that_fails_is_counted_and_nobody_is_touched() {
        let dir = tempfile::tempdir().unwrap();
        let (_arb, _, readings, killed, mut b) = bed(dir.path(), Enforce::Kill);
        let me = std::process::id() as i32;
        *readings.procs.lock().unwrap() = vec![on_gpu0(me, 4 * GIB)];
        readings.fail.store(true, Ordering::Relaxed);
        assert!(b.poll().is_empty());
        assert!(b.poll().is_empty());
        assert_eq!(b.counters.failed_polls.load(Ordering::Relaxed), 2);
        assert!(killed.lock().unwrap().is_empty());
        // NVML comes back: the breach is acted on at the next poll.
        readings.fail.store(false, Ordering::Relaxed);
        assert_eq!(b.poll().len(), 1);
        assert_eq!(*killed.lock().unwrap(), [me]);
    }
}
