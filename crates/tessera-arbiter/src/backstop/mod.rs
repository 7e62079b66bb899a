//! The backstop: a second line of defence that does not depend on the tenant's process.
//!
//! The interposer enforces limits only inside processes that load it and play by its rules.
//! Every poll interval the backstop reads, from NVML, every process on every GPU with its
//! device memory and its GPU time, and attributes each to an allocation from identity the
//! tenant cannot change, in this order (the first that applies decides; see [`attribute`]):
//! 1. **the process's own container identity**: the identity file read through
//!    `/proc/<pid>/root` (the plugins mount one into every container they wire, fraction or
//!    whole GPU; see [`tessera_protocol::identity`]), when it is read-only, names a live
//!    allocation and, with `--identity-dir`, is the plugin's own file for it (the same inode:
//!    [`IdentityFiles`]). It names the allocation, whatever any connection claims. The first
//!    time a process is attributed this way its container's cgroup (cgroup v2, the `0::` line
//!    of `/proc/<pid>/cgroup`) is recorded for that allocation ([`Cgroups`]);
//! 2. **the container's cgroup**, recorded as above: a process of that container whose root no
//!    longer shows the file (a `chroot`) is still its container's. A container cannot move its
//!    processes out of its cgroup, and a cgroup path is never reused while the allocation lives;
//! 3. **its nearest ancestor in the container with a genuine identity** (a process that covered
//!    its file in a user and mount namespace of its own is still its parent's child);
//! 4. **the processes that connected to the tenant socket, and their descendants**, each named
//!    by pid *and start time* ([`ProcId`], taken at `accept` through the connection's
//!    `SO_PEERPIDFD`, so the process that connected and not a later one with its pid; the
//!    pidfd is kept with the connection ([`Peer`]) and a process it says exited is not listed)
//!    and checked against the live process at every use, ancestors included: a connection
//!    whose process exited attributes nobody, so a connection kept open by another process (a
//!    socket passed over `SCM_RIGHTS`) cannot reserve a pid for whoever gets it next. Not for
//!    a process that shows an identity that proved nothing (its token may be stolen);
//! 5. **a process under a live `tessera run`** (the allocation's owner, pid and start time), or
//!    one found under it before (see [`crate::owner`]), connected or not;
//! 6. otherwise: a **forger** ([`Owner::Forged`]) when it claims an identity it does not have
//!    (a file that reads as one, or the plugin's mount covered in its mount table), stopped
//!    whatever `--unknown-processes` says; an **MPS daemon** ([`MPS_DAEMONS`]), left alone;
//!    else *unknown*: in a container (its mount namespace is not the host's) or on the host.
//!
//! Every process is held by a pidfd before anything about it is read ([`Held`]); decisions on
//! one that exited meanwhile are dropped, and kills go through the pidfd.
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

use tessera_protocol::GpuInfo;
use tessera_protocol::identity::{CONTAINER_IDENTITY_FILE, Identity};
use tessera_protocol::size::human;

#[cfg(test)]
use crate::peer::proc_start;

mod attribution;
mod compute;
mod gpu;
mod kill;
mod memory;
mod policy;
mod procfs;
#[cfg(test)]
mod tests;

pub(crate) use attribution::*;
pub(crate) use compute::*;
pub use gpu::*;
pub use kill::*;
pub(crate) use memory::*;
pub(crate) use policy::*;
pub(crate) use procfs::*;

pub(crate) use crate::peer::ProcId;
use crate::state::{Arbiter, Watched};
use crate::stats::EnforceReason;

/// Counters of the backstop, for the log and tests.
#[derive(Debug, Default)]
pub(crate) struct Counters {
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

/// The backstop's thread: GPU readings in, kills out.
pub(crate) struct Backstop {
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
    /// This poll's holds on its GPU processes, taken before anything about them was read
    /// (see [`Held`]): a kill reaches the process the decision was about, or nobody.
    held: HashMap<i32, Held>,
    /// Where the kubelet plugins write identity files (`--identity-dir`): only a file of
    /// theirs proves a container's identity (see [`IdentityFiles`]).
    identity_dir: Option<std::path::PathBuf>,
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
pub(crate) const COMPUTE_WARMUP: Duration = Duration::from_secs(2);

/// How long a host process may use a GPU unattributed before it is reported.
pub(crate) const HOST_GRACE: Duration = Duration::from_secs(1);

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Backstop {
    /// Loads NVML (`lib`, or `libnvidia-ml.so.1` from the loader's search path); `host_ns`
    /// names the host's mount namespace. Kills with `SIGKILL`.
    pub(crate) fn new(
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
    pub(crate) fn with_io(
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
            held: HashMap::new(),
            identity_dir: None,
            unknown_since: HashMap::new(),
            counters: Arc::default(),
        }
    }

    /// Takes only the identity files in `dir` (the kubelet plugins' `--host-identity-dir`) as
    /// proof of a container's identity; without one, any read-only file naming a live
    /// allocation is.
    pub(crate) fn with_identity_dir(mut self, dir: Option<std::path::PathBuf>) -> Self {
        if dir.is_none() {
            tracing::info!(
                "backstop: no --identity-dir: a container's identity file counts when it is \
                 read-only and names a live allocation (pass the plugins' identity folder to \
                 accept only their files)"
            );
        }
        self.identity_dir = dir;
        self
    }

    /// The node's devices, read again where the source can (a MIG instance made or destroyed
    /// since the last poll), with the arbiter's indexes.
    fn devices(&self) -> Result<Arc<Vec<GpuInfo>>, GpuSourceError> {
        if let Some(found) = self.gpus.discover() {
            self.arb.refresh_gpus(found?);
        }
        Ok(self.arb.gpus())
    }

    /// Every process on every device of `devices` with its device memory.
    fn gpu_processes(&self, devices: &[GpuInfo]) -> Result<Vec<GpuProcess>, GpuSourceError> {
        let mut out = Vec::new();
        for g in devices {
            out.extend(self.gpus.processes(g)?);
        }
        Ok(out)
    }

    /// GPU time per (pid, GPU index) over the last `elapsed_ns`, from NVML's per-process
    /// utilisation samples: the mean SM utilisation of a pid's samples times the interval.
    fn gpu_time(&mut self, devices: &[GpuInfo], elapsed_ns: u64) -> HashMap<(i32, u32), u64> {
        let mut out = HashMap::new();
        if self.compute_off {
            return out;
        }
        for g in devices {
            let i = g.index;
            let since = self.last_seen.get(&i).copied().unwrap_or(0);
            let Some(samples) = self.gpus.utilization(g, since) else {
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
    pub(crate) fn poll(&mut self) -> Vec<Action> {
        self.counters.polls.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let elapsed = self
            .last_poll
            .map(|t| now.duration_since(t).as_nanos() as u64);
        self.last_poll = Some(now);
        let (devices, procs) = match self
            .devices()
            .and_then(|d| Ok((self.gpu_processes(&d)?, d)))
        {
            Ok((p, d)) => (d, p),
            Err(e) => {
                if self.counters.failed_polls.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!("backstop: cannot read GPU processes from NVML: {e}");
                }
                return Vec::new();
            }
        };
        let gpu_per = self.gpu_time(&devices, elapsed.unwrap_or(0));
        let mut watched = self.arb.watched();
        let memory = memory_per_pid(&procs);
        let mut pids: Vec<i32> = memory
            .keys()
            .copied()
            .chain(gpu_per.keys().map(|(pid, _)| *pid))
            .collect();
        pids.sort_unstable();
        pids.dedup();
        // Hold every process first: what is read about it below is then about the process
        // the hold names as long as it has not exited, and a kill reaches it or nobody. A hold
        // from an earlier poll whose process lives still names the process at that pid (a pid
        // is reused only after its process is reaped), so only new pids cost a `pidfd_open`.
        let mut held = std::mem::take(&mut self.held);
        self.held = pids
            .iter()
            .filter_map(|&p| match held.remove(&p) {
                Some(h) if !h.exited() => Some((p, h)),
                _ => self.killer.hold(p).map(|h| (p, h)),
            })
            .collect();
        pids.retain(|p| self.held.contains_key(p));
        self.procfs.clear();
        self.reported.retain(|p| pids.binary_search(p).is_ok());
        forget_exited(&mut watched, &self.procfs);
        let live: HashSet<&str> = watched.iter().map(|w| w.id.as_str()).collect();
        self.cgroups.retain(&live);
        let files = match &self.identity_dir {
            Some(dir) => read_identity_files(dir),
            None => IdentityFiles::any(),
        };
        let mut owners = attribute_with(&watched, &pids, &self.procfs, &mut self.cgroups, &files);
        self.attribute_owned(&watched, &mut owners);
        self.unknown_since
            .retain(|p, _| owners.get(p) == Some(&Owner::UnknownHost));
        for (&pid, owner) in &owners {
            if *owner == Owner::UnknownHost {
                self.unknown_since.entry(pid).or_insert(now);
            }
            if *owner == Owner::Mps && self.reported.insert(pid) {
                tracing::info!(
                    "backstop: pid {pid} is an MPS daemon ({}) on a GPU: left alone (it \
                     belongs to no allocation; stopping it would stop every client on its GPU)",
                    human(memory.get(&pid).copied().unwrap_or(0))
                );
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
        // One action per process a poll (the memory and compute rules may both name it).
        let mut named = HashSet::new();
        actions.retain(|a| named.insert(a.pid));
        // A process that exited since it was held: what was read under its pid may be about
        // another process (a reused pid), and there is nothing left to stop.
        actions.retain(|a| self.held.get(&a.pid).is_some_and(|h| !h.exited()));
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

    /// Polls every interval until `stop` gets a message or its sender is dropped (run it on its
    /// own thread; the server does).
    pub(crate) fn run(mut self, stop: std::sync::mpsc::Receiver<()>) {
        use std::sync::mpsc::RecvTimeoutError;
        while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(self.policy.interval) {
            self.poll();
        }
        tracing::info!("backstop: stopped");
    }
}
