//! The arbiter's shared state: GPUs, allocations, the memory ledger and the schedulers.
//!
//! Two locks, never held together across an await:
//! - `admin` (async): the persisted allocation list; it serialises Create and Delete so that
//!   validation, the disk write and the in-memory change happen in order, and the disk write
//!   happens outside the hot lock.
//! - `live` (sync, short): tokens, the ledger and the per-GPU bookkeeping used by every
//!   tenant request; held only for a few map operations, never across I/O.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, MutexGuard};

use tessera_protocol::size::human;
use tessera_protocol::{
    AdminErrorKind, AllocationStatus, AllocationView, CreateAllocation, GpuInfo, GpuSelector,
    LABEL_CONTAINER, LABEL_NAMESPACE, LABEL_POD, MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS,
};

use crate::ledger::{AccountKey, ConnId, Ledger, LedgerError};
use crate::peer::{Peer, ProcId};
use crate::pressure::PressureHub;
use crate::scheduler::{SchedulerHandle, SchedulerParams};
use crate::stats::{AllocCounters, AllocSample, EnforceReason, GpuSample, RequestStats, Snapshot};
use crate::store::{self, AllocationRecord, Store, StoreError};

// Who may do what (the user socket's owners and quotas) and the backstop's kill records: kept
// out of this file, which is long enough.
mod access;
mod kills;
pub use access::{By, Quota};

/// How long a reservation that does not fit waits, by default, while other processes of its
/// allocation hold memory, for them to give back unused credit (they answer a `Pressure` as
/// soon as their watcher thread runs) or to free what they hold. A process preempted between
/// its allocation and its free holds the bytes for a time slice or more on a busy node; this
/// wait turns that into a short delay instead of a false out-of-memory. With nothing held by
/// other processes, a reservation that does not fit is refused at once.
pub const DEFAULT_MEMORY_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Errors of admin operations, each mapped to an [`AdminErrorKind`] for the wire.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Bad parameters.
    #[error("{0}")]
    Invalid(String),
    /// No such allocation.
    #[error("no allocation {0}")]
    NotFound(String),
    /// The GPU cannot take the allocation.
    #[error("{0}")]
    Exhausted(String),
    /// Persisting failed; nothing changed.
    #[error("cannot persist allocations: {0}")]
    Store(#[from] StoreError),
    /// The persisted allocations could not be read or break the rules of `create`.
    #[error("cannot load allocations: {0}")]
    Load(#[source] StoreError),
    /// The background task writing the state failed.
    #[error("internal error: {0}")]
    Internal(#[source] tokio::task::JoinError),
    /// The caller may not (another user's allocation, a quota passed).
    #[error("{0}")]
    Forbidden(String),
}

impl StateError {
    /// The wire class of this error.
    pub fn kind(&self) -> AdminErrorKind {
        match self {
            StateError::Invalid(_) => AdminErrorKind::InvalidArgument,
            StateError::NotFound(_) => AdminErrorKind::NotFound,
            StateError::Exhausted(_) => AdminErrorKind::Exhausted,
            StateError::Forbidden(_) => AdminErrorKind::PermissionDenied,
            StateError::Store(_) | StateError::Load(_) | StateError::Internal(_) => {
                AdminErrorKind::Internal
            }
        }
    }
}

/// One allocation as the backstop sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watched {
    /// Public id.
    pub id: String,
    /// Memory limit, bytes.
    pub limit: u64,
    /// Processes that connected to the tenant socket for it (pid and start time).
    pub pids: Vec<ProcId>,
    /// Its secret token (what its containers' identity files hold).
    pub token: String,
    /// Its compute share; at 100 it holds a whole card (see `whole_gpus`).
    pub share: u32,
    /// The cards (NVML indexes) its processes hold wholly: its own when its share is 100,
    /// with those of the other whole-card allocations made for the same container (one
    /// identity, several cards; label [`tessera_protocol::LABEL_WHOLE_GROUP`]). Nobody else's
    /// memory or time is there to protect, so the backstop does not police its processes
    /// *there* (a pod holding whole GPUs runs without the interposer and its leases); on any
    /// other card they are policed like any allocation's, against a limit of 0 and no lease.
    pub whole_gpus: Vec<u32>,
    /// The card (NVML index) it lives on, when present.
    pub gpu: Option<u32>,
    /// Its GPU group (label [`tessera_protocol::group::LABEL_GPU_GROUP`]) when it is one
    /// slice of a multi-GPU allocation: its group's processes are policed per card, what they
    /// hold on a card charged to that card's slice, and on a card outside the group against a
    /// limit of 0.
    pub group: Option<String>,
}

/// What a tenant connection learns at its handshake.
#[derive(Debug, Clone)]
pub struct TenantBinding {
    /// Ledger account of its allocation.
    pub key: AccountKey,
    /// The allocation, as told to the tenant.
    pub view: AllocationView,
    /// The scheduler of its GPU.
    pub scheduler: SchedulerHandle,
    /// Its refusal counters (shared by all its connections).
    pub counters: Arc<AllocCounters>,
}

#[derive(Debug)]
struct LiveAlloc {
    key: AccountKey,
    record: AllocationRecord,
    scheduler: SchedulerHandle,
    /// Refusals and backstop actions.
    counters: Arc<AllocCounters>,
    /// Tenant connections closed for lying about their memory (see [`Arbiter::note_violation`]).
    violations: u64,
}

#[derive(Debug, Default)]
struct Live {
    /// Allocations by public id (deleted ones are removed here; their ledger account drains).
    by_id: HashMap<String, LiveAlloc>,
    /// Token to public id.
    tokens: HashMap<String, String>,
    ledger: Ledger,
    /// Connections per process per account (a process may open several connections).
    procs: HashMap<AccountKey, HashMap<ProcKey, ProcEntry>>,
    next_key: AccountKey,
}

/// The process behind a connection: its pid and start time, or the connection itself when
/// the kernel named no live process (such a connection attributes nobody to the backstop).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ProcKey {
    Proc(ProcId),
    Conn(ConnId),
}

/// One process's connections for one account.
#[derive(Debug)]
struct ProcEntry {
    conns: u32,
    /// Its connections, oldest first.
    conn_ids: Vec<ConnId>,
    /// The process, as its first connection named it (its pidfd says whether it lives).
    peer: Option<Peer>,
}

fn proc_key(peer: Option<ProcId>, conn: ConnId) -> ProcKey {
    peer.map_or(ProcKey::Conn(conn), ProcKey::Proc)
}

/// Shared state of one arbiter.
#[derive(Debug)]
pub struct Arbiter {
    gpus: Vec<GpuInfo>,
    store: Store,
    admin: tokio::sync::Mutex<Vec<AllocationRecord>>,
    live: Mutex<Live>,
    /// One scheduler per GPU UUID (plus any UUID of a persisted allocation whose GPU vanished).
    schedulers: Mutex<HashMap<String, SchedulerHandle>>,
    sched_params: SchedulerParams,
    /// How long a reservation that does not fit waits for other processes' credit, ns
    /// ([`Arbiter::memory_wait`]).
    memory_wait_ns: AtomicU64,
    next_conn: AtomicU64,
    epoch: Instant,
    /// Pressure channels of tenant processes (memory credit reclaim).
    pressure: PressureHub,
    /// Tenant requests by kind (metrics).
    requests: RequestStats,
    /// Processes of owned allocations found under their owner (see [`crate::owner`]).
    members: Mutex<crate::owner::Members>,
    /// The last process the backstop killed per allocation, and why ([`kills`]).
    kills: Mutex<HashMap<String, tessera_protocol::KillRecord>>,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn view(record: &AllocationRecord) -> AllocationView {
    AllocationView {
        id: record.id.clone(),
        gpu_index: record.gpu_index,
        gpu_uuid: record.gpu_uuid.clone(),
        memory_limit: record.memory_limit,
        share: record.share,
        cap: record.cap,
    }
}

/// The second token of a multi-GPU allocation's first slice: the slice token of its own GPU
/// ([`tessera_protocol::group::slice_token`] of the group token and that GPU's UUID). Only the
/// first slice of a group answers it, so an interposer learns from it that its allocation spans
/// several GPUs (one of one GPU keeps every device on its one ledger); it opens nothing the
/// group token does not.
fn group_marker(record: &AllocationRecord) -> Option<String> {
    let group = record
        .labels
        .get(tessera_protocol::group::LABEL_GPU_GROUP)?;
    (*group == record.id)
        .then(|| tessera_protocol::group::slice_token(&record.token, &record.gpu_uuid))
}

/// Characters and lengths of a token: hex, as [`store::new_token`] makes them (64 digits), and
/// never fewer than 128 bits' worth.
const TOKEN_LEN: std::ops::RangeInclusive<usize> = 32..=256;
/// Length of an id, as [`store::new_id`] makes them.
const ID_LEN: usize = 8;

/// Applies the rules of `create` (and of the generated ids and tokens) to persisted records;
/// the error names the first bad record by index and id.
fn check_records(records: &[AllocationRecord], gpus: &[GpuInfo]) -> Result<(), String> {
    let is_hex = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit());
    let mut ids = HashMap::new();
    let mut tokens = HashMap::new();
    // Per GPU UUID: shares and bytes promised so far.
    let mut promised: HashMap<&str, (u32, u64)> = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        let bad = |what: String| Err(format!("allocation #{i} (id {:?}): {what}", r.id));
        if r.id.len() != ID_LEN || !is_hex(&r.id) {
            return bad(format!("id is not {ID_LEN} hex digits"));
        }
        if let Some(j) = ids.insert(r.id.as_str(), i) {
            return bad(format!("same id as allocation #{j}"));
        }
        if !TOKEN_LEN.contains(&r.token.len()) || !is_hex(&r.token) {
            return bad(format!(
                "token is not {} to {} hex digits",
                TOKEN_LEN.start(),
                TOKEN_LEN.end()
            ));
        }
        if let Some(j) = tokens.insert(r.token.as_str(), i) {
            return bad(format!("same token as allocation #{j}"));
        }
        if !(1..=100).contains(&r.share) {
            return bad(format!("share {} is not in 1..=100", r.share));
        }
        if let Some(cap) = r.cap
            && !(1..=100).contains(&cap)
        {
            return bad(format!("cap {cap} is not in 1..=100"));
        }
        if r.memory_limit == 0 {
            return bad("memory limit is 0 bytes".into());
        }
        let sum = promised.entry(r.gpu_uuid.as_str()).or_default();
        sum.0 = sum.0.saturating_add(r.share);
        sum.1 = sum.1.saturating_add(r.memory_limit);
        if sum.0 > 100 {
            return bad(format!(
                "brings GPU {}'s shares to {} of 100",
                r.gpu_uuid, sum.0
            ));
        }
        // A GPU that is not present is not checked against: its size is unknown.
        if let Some(g) = gpus.iter().find(|g| g.uuid == r.gpu_uuid) {
            if r.memory_limit > g.memory_total {
                return bad(format!(
                    "memory limit {} exceeds GPU {}'s {}",
                    human(r.memory_limit),
                    g.uuid,
                    human(g.memory_total)
                ));
            }
            if sum.1 > g.memory_total {
                return bad(format!(
                    "brings GPU {}'s promised memory to {} of {}",
                    g.uuid,
                    human(sum.1),
                    human(g.memory_total)
                ));
            }
        }
    }
    Ok(())
}

/// Checks labels against the admin API's bounds: they are kept, persisted, listed and exported
/// as metric labels, so an admin client cannot make them grow without end.
fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), StateError> {
    if labels.len() > MAX_LABELS {
        return Err(StateError::Invalid(format!(
            "{} labels, at most {MAX_LABELS} allowed",
            labels.len()
        )));
    }
    for (k, v) in labels {
        if k.is_empty() || k.len() > MAX_LABEL_KEY {
            return Err(StateError::Invalid(format!(
                "label key of {} bytes, 1 to {MAX_LABEL_KEY} allowed",
                k.len()
            )));
        }
        if v.len() > MAX_LABEL_VALUE {
            return Err(StateError::Invalid(format!(
                "label {k:?} has a value of {} bytes, at most {MAX_LABEL_VALUE} allowed",
                v.len()
            )));
        }
    }
    Ok(())
}

impl Arbiter {
    /// Builds the state from the discovered GPUs and the persisted allocations. Persisted
    /// allocations are matched to GPUs by UUID (indexes may change between boots); one whose
    /// GPU is gone is kept, logged, and keeps its last known index.
    pub fn new(
        gpus: Vec<GpuInfo>,
        store: Store,
        sched_params: SchedulerParams,
    ) -> Result<Arc<Self>, StateError> {
        let mut records = store.load().map_err(StateError::Load)?;
        // A hand-edited or damaged file must not bring in what Create would refuse (a share
        // of 1000 blocks its GPU, an empty token lets anyone in); it is left as it is.
        check_records(&records, &gpus).map_err(|reason| {
            StateError::Load(StoreError::Corrupt {
                path: store.path(),
                reason,
            })
        })?;
        for r in &mut records {
            match gpus.iter().find(|g| g.uuid == r.gpu_uuid) {
                Some(g) => r.gpu_index = g.index,
                None => tracing::warn!(
                    "allocation {} is on GPU {} which is not present; kept",
                    r.id,
                    r.gpu_uuid
                ),
            }
        }
        let arb = Arc::new(Self {
            gpus,
            store,
            admin: tokio::sync::Mutex::new(records.clone()),
            live: Mutex::new(Live::default()),
            schedulers: Mutex::new(HashMap::new()),
            sched_params,
            memory_wait_ns: AtomicU64::new(DEFAULT_MEMORY_WAIT.as_nanos() as u64),
            next_conn: AtomicU64::new(1),
            epoch: Instant::now(),
            pressure: PressureHub::new(),
            requests: RequestStats::default(),
            members: Mutex::default(),
            kills: Mutex::default(),
        });
        for g in &arb.gpus {
            arb.scheduler_for(&g.uuid);
        }
        for r in records {
            arb.insert_live(r);
        }
        Ok(arb)
    }

    /// Origin of the schedulers' clock.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Nanoseconds since this arbiter started (the schedulers' clock).
    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// The node's GPUs.
    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    /// Every scheduler (the server starts a timer task for each).
    pub fn schedulers(&self) -> Vec<SchedulerHandle> {
        self.schedulers.lock().values().cloned().collect()
    }

    fn scheduler_for(&self, uuid: &str) -> SchedulerHandle {
        self.schedulers
            .lock()
            .entry(uuid.to_owned())
            .or_insert_with(|| SchedulerHandle::new(uuid.to_owned(), self.sched_params))
            .clone()
    }

    fn live(&self) -> MutexGuard<'_, Live> {
        // A panic while holding the lock would be a bug; the data (plain maps) stays usable.
        self.live.lock()
    }

    fn insert_live(&self, record: AllocationRecord) {
        let scheduler = self.scheduler_for(&record.gpu_uuid);
        let mut live = self.live();
        live.next_key += 1;
        let key = live.next_key;
        live.ledger.open(key, record.memory_limit);
        scheduler.add_allocation(key, record.share, record.cap, self.now_ns());
        scheduler.set_tier(key, record.tier);
        live.tokens.insert(record.token.clone(), record.id.clone());
        if let Some(alias) = group_marker(&record) {
            live.tokens.insert(alias, record.id.clone());
        }
        live.by_id.insert(
            record.id.clone(),
            LiveAlloc {
                key,
                record,
                scheduler,
                counters: Arc::default(),
                violations: 0,
            },
        );
    }

    /// Allocations the arbiter holds now (each is guaranteed room on the tenant socket, see
    /// [`crate::admission`]).
    pub fn allocation_count(&self) -> usize {
        self.live().by_id.len()
    }

    /// How long a reservation that does not fit may wait, while other processes of its
    /// allocation hold memory, for them to give back unused credit or free what they hold
    /// (`--memory-wait-ms`, [`DEFAULT_MEMORY_WAIT`] by default).
    pub fn memory_wait(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.memory_wait_ns.load(Ordering::Relaxed))
    }

    /// Sets [`Arbiter::memory_wait`] (at start-up, from the configuration).
    pub fn set_memory_wait(&self, wait: std::time::Duration) {
        self.memory_wait_ns
            .store(wait.as_nanos() as u64, Ordering::Relaxed);
    }

    /// A new connection number.
    pub fn next_conn(&self) -> ConnId {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Handshake of a tenant: finds the allocation of `token` and attaches `conn` to it.
    pub fn attach_tenant(
        &self,
        token: &str,
        conn: ConnId,
        peer: Option<Peer>,
    ) -> Option<TenantBinding> {
        let mut live = self.live();
        let id = live.tokens.get(token)?.clone();
        let (key, view, scheduler, counters) = {
            let a = live.by_id.get(&id)?;
            (
                a.key,
                view(&a.record),
                a.scheduler.clone(),
                Arc::clone(&a.counters),
            )
        };
        live.ledger.attach(key, conn).ok()?;
        let pk = proc_key(peer.as_ref().map(|p| p.id), conn);
        let entry = live
            .procs
            .entry(key)
            .or_default()
            .entry(pk)
            .or_insert(ProcEntry {
                conns: 0,
                conn_ids: Vec::new(),
                peer,
            });
        entry.conns += 1;
        entry.conn_ids.push(conn);
        Some(TenantBinding {
            key,
            view,
            scheduler,
            counters,
        })
    }

    /// The backstop acted on a process of allocation `id` (shown by `List`, counted by
    /// reason in the metrics).
    pub fn note_enforced(&self, id: &str, why: EnforceReason) {
        if let Some(a) = self.live().by_id.get(id) {
            a.counters.enforced(why);
        }
    }

    /// The backstop read `ns` of GPU time used by allocation `id`'s processes (from NVML).
    pub fn note_gpu_busy(&self, id: &str, ns: u64) {
        if let Some(a) = self.live().by_id.get(id) {
            a.counters.add_gpu_busy(ns);
        }
    }

    /// Tenant requests by kind (the tenant connections count them).
    pub fn requests(&self) -> &RequestStats {
        &self.requests
    }

    /// Every live allocation and GPU with its counters, for a scrape. The live lock is held
    /// only to copy the allocations out; each scheduler is then locked once.
    pub fn snapshot(&self) -> Snapshot {
        let now = self.now_ns();
        let mut rows: Vec<(AllocSample, AccountKey, SchedulerHandle)> = {
            let live = self.live();
            live.by_id
                .values()
                .map(|a| {
                    let r = &a.record;
                    let label = |k: &str| r.labels.get(k).filter(|v| !v.is_empty()).cloned();
                    let sample = AllocSample {
                        id: r.id.clone(),
                        gpu_index: r.gpu_index,
                        gpu_uuid: r.gpu_uuid.clone(),
                        pod: [
                            label(LABEL_NAMESPACE),
                            label(LABEL_POD),
                            label(LABEL_CONTAINER),
                        ],
                        memory_limit: r.memory_limit,
                        memory_used: live.ledger.usage(a.key).map_or(0, |u| u.in_use),
                        share: r.share,
                        cap: r.cap,
                        tier: r.tier,
                        processes: live.procs.get(&a.key).map_or(0, |p| p.len() as u32),
                        sched: Default::default(),
                        oom_refusals: a.counters.oom_refusals(),
                        enforced: a.counters.enforcements(),
                        gpu_busy_ns: a.counters.gpu_busy_ns(),
                    };
                    (sample, a.key, a.scheduler.clone())
                })
                .collect()
        };
        rows.sort_by(|a, b| (a.0.gpu_index, &a.0.id).cmp(&(b.0.gpu_index, &b.0.id)));
        let mut gpus: Vec<GpuSample> = self
            .gpus
            .iter()
            .map(|g| GpuSample {
                index: g.index,
                uuid: g.uuid.clone(),
                memory_total: Some(g.memory_total),
                ..Default::default()
            })
            .collect();
        for (a, _, _) in &rows {
            let i = match gpus.iter().position(|g| g.uuid == a.gpu_uuid) {
                Some(i) => i,
                None => {
                    gpus.push(GpuSample {
                        index: a.gpu_index,
                        uuid: a.gpu_uuid.clone(),
                        ..Default::default()
                    });
                    gpus.len() - 1
                }
            };
            let g = &mut gpus[i];
            g.memory_promised = g.memory_promised.saturating_add(a.memory_limit);
            g.shares += a.share;
            g.allocations += 1;
        }
        let schedulers = self.schedulers.lock().clone();
        for g in &mut gpus {
            let Some(sched) = schedulers.get(&g.uuid) else {
                continue;
            };
            let keys: Vec<AccountKey> = rows
                .iter()
                .filter(|r| r.2.uuid() == g.uuid)
                .map(|r| r.1)
                .collect();
            let (busy, per) = sched.stats(&keys, now);
            g.busy_ns = busy;
            let mut per = per.into_iter();
            for r in rows.iter_mut().filter(|r| r.2.uuid() == g.uuid) {
                r.0.sched = per.next().flatten().unwrap_or_default();
            }
        }
        Snapshot {
            allocs: rows.into_iter().map(|r| r.0).collect(),
            gpus,
            tenant_connections: 0,
        }
    }

    /// A tenant connection of allocation `id` broke the protocol (released more than it held,
    /// redeclared out of turn, ...) and is being closed; returns the allocation's count of such
    /// closings since the arbiter started (0 once the allocation is deleted), for the log.
    pub fn note_violation(&self, id: &str) -> u64 {
        self.live().by_id.get_mut(id).map_or(0, |a| {
            a.violations += 1;
            a.violations
        })
    }

    /// Every live allocation with the processes connected for it (for the backstop).
    pub fn watched(&self) -> Vec<Watched> {
        let live = self.live();
        let index_of = |uuid: &str| {
            self.gpus
                .iter()
                .find(|g| g.uuid.eq_ignore_ascii_case(uuid))
                .map(|g| g.index)
        };
        fn group_of(r: &AllocationRecord) -> Option<&String> {
            (r.share >= 100)
                .then(|| r.labels.get(tessera_protocol::LABEL_WHOLE_GROUP))
                .flatten()
        }
        // The cards a whole-card allocation's processes hold: its own and its group's.
        let whole_gpus = |r: &AllocationRecord| -> Vec<u32> {
            if r.share < 100 {
                return Vec::new();
            }
            let mut gpus: Vec<u32> = index_of(&r.gpu_uuid).into_iter().collect();
            if let Some(group) = group_of(r) {
                gpus.extend(
                    live.by_id
                        .values()
                        .filter(|b| group_of(&b.record) == Some(group))
                        .filter_map(|b| index_of(&b.record.gpu_uuid)),
                );
            }
            gpus.sort_unstable();
            gpus.dedup();
            gpus
        };
        let listed: Vec<(Watched, Vec<Peer>)> = live
            .by_id
            .values()
            .map(|a| {
                let mut pids = Vec::new();
                let mut peers = Vec::new();
                for (k, e) in live.procs.get(&a.key).into_iter().flatten() {
                    match (k, &e.peer) {
                        (ProcKey::Proc(_), Some(p)) => peers.push(p.clone()),
                        (ProcKey::Proc(id), None) => pids.push(*id),
                        (ProcKey::Conn(_), _) => {}
                    }
                }
                let w = Watched {
                    id: a.record.id.clone(),
                    limit: a.record.memory_limit,
                    token: a.record.token.clone(),
                    share: a.record.share,
                    whole_gpus: whole_gpus(&a.record),
                    gpu: index_of(&a.record.gpu_uuid),
                    group: a
                        .record
                        .labels
                        .get(tessera_protocol::group::LABEL_GPU_GROUP)
                        .cloned(),
                    pids,
                };
                (w, peers)
            })
            .collect();
        drop(live);
        // Outside the lock (a syscall per connected process): a process that exited names
        // nobody, whoever keeps its connection open.
        listed
            .into_iter()
            .map(|(mut w, peers)| {
                w.pids
                    .extend(peers.iter().filter(|p| p.is_alive()).map(|p| p.id));
                w
            })
            .collect()
    }

    /// Owned allocations: id, owner, how many processes of it are connected, and whether it
    /// was restored from the state file (created before this arbiter started; for the reaper,
    /// see [`crate::owner`]).
    pub fn owned(&self) -> Vec<(String, tessera_protocol::ProcessOwner, usize, bool)> {
        let started_unix = now_unix().saturating_sub(self.epoch.elapsed().as_secs());
        let live = self.live();
        live.by_id
            .values()
            .filter_map(|a| {
                let o = a.record.owner?;
                let connected = live.procs.get(&a.key).map_or(0, |p| p.len());
                let restored = a.record.created_unix < started_unix;
                Some((a.record.id.clone(), o, connected, restored))
            })
            .collect()
    }

    /// The processes the backstop attributed to owned allocations through their owner.
    pub fn members(&self) -> MutexGuard<'_, crate::owner::Members> {
        self.members.lock()
    }

    /// The GPU (UUID) allocation `id` is scheduled on and the GPU time granted to it in leases
    /// so far, ns (for the backstop, which keeps one slack budget per GPU).
    pub fn leased_total(&self, id: &str) -> Option<(String, u64)> {
        let (key, sched) = self
            .live()
            .by_id
            .get(id)
            .map(|a| (a.key, a.scheduler.clone()))?;
        let leased = sched.leased_total(key, self.now_ns())?;
        Some((sched.uuid().to_owned(), leased))
    }

    /// Counts GPU time allocation `id` used outside its leases, forgiven from its GPU's slack,
    /// against its cap (not its share).
    pub fn count_for_cap(&self, id: &str, ns: u64) {
        let found = self
            .live()
            .by_id
            .get(id)
            .map(|a| (a.key, a.scheduler.clone()));
        if let Some((key, sched)) = found {
            sched.count_for_cap(key, ns, self.now_ns());
        }
    }

    /// Charges GPU time allocation `id` used outside its leases (seen by the backstop).
    pub fn charge_unleased(&self, id: &str, ns: u64) {
        let found = self
            .live()
            .by_id
            .get(id)
            .map(|a| (a.key, a.scheduler.clone()));
        if let Some((key, sched)) = found {
            sched.charge_unleased(key, ns, self.now_ns());
        }
    }

    /// The registry of tenant processes' pressure channels.
    pub fn pressure(&self) -> &PressureHub {
        &self.pressure
    }

    /// Every live connected process (named by its pidfd) with its account, its oldest
    /// connection, the most its connections held in the ledger since the last call (their
    /// excess left out; see [`Ledger::take_peak`]), and the card (NVML index) of that account
    /// when it is one slice of a multi-GPU allocation (such a process's card memory is compared
    /// per card; other accounts' over all cards). The backstop's one caller: the peak covers
    /// the card figures it read before this call, however long it was descheduled between.
    pub fn connected_processes(&self) -> Vec<(AccountKey, ProcId, ConnId, u64, Option<u32>)> {
        let mut guard = self.live();
        let live = &mut *guard;
        let slice_card: HashMap<AccountKey, u32> = live
            .by_id
            .values()
            .filter(|a| {
                a.record
                    .labels
                    .contains_key(tessera_protocol::group::LABEL_GPU_GROUP)
            })
            .filter_map(|a| {
                self.gpus
                    .iter()
                    .find(|g| g.uuid.eq_ignore_ascii_case(&a.record.gpu_uuid))
                    .map(|g| (a.key, g.index))
            })
            .collect();
        let mut out = Vec::new();
        for (key, procs) in &live.procs {
            for (pk, e) in procs {
                let (ProcKey::Proc(id), Some(peer)) = (pk, &e.peer) else {
                    continue;
                };
                let Some(&first) = e.conn_ids.first() else {
                    continue;
                };
                if !peer.is_alive() {
                    continue;
                }
                let held: u64 = e
                    .conn_ids
                    .iter()
                    .filter_map(|c| live.ledger.take_peak(*key, *c))
                    .sum();
                out.push((*key, *id, first, held, slice_card.get(key).copied()));
            }
        }
        out
    }

    /// See [`Ledger::set_excess`]; a connection gone since is ignored.
    pub fn set_excess(&self, key: AccountKey, conn: ConnId, bytes: u64) {
        let _ = self.live().ledger.set_excess(key, conn, bytes);
    }

    /// Runs `f` on the ledger under the live lock (the tenant hot path).
    pub fn with_ledger<R>(&self, f: impl FnOnce(&mut Ledger) -> R) -> R {
        f(&mut self.live().ledger)
    }

    /// A tenant connection closed: frees what it held. Returns the bytes freed.
    pub fn detach_tenant(
        &self,
        binding: &TenantBinding,
        conn: ConnId,
        peer: Option<ProcId>,
    ) -> Result<u64, LedgerError> {
        // The scheduler forgets the connection first, so that by the time `list` shows the
        // process gone no lease can still go to it.
        binding.scheduler.connection_closed(conn, self.now_ns());
        let (freed, gone) = {
            let mut live = self.live();
            let freed = live.ledger.detach(binding.key, conn)?;
            if let Some(procs) = live.procs.get_mut(&binding.key) {
                let pk = proc_key(peer, conn);
                if let Some(e) = procs.get_mut(&pk) {
                    e.conns -= 1;
                    e.conn_ids.retain(|c| *c != conn);
                    if e.conns == 0 {
                        procs.remove(&pk);
                    }
                }
            }
            let gone = live.ledger.usage(binding.key).is_none();
            if gone {
                live.procs.remove(&binding.key);
            }
            (freed, gone)
        };
        // The scheduler forgets a deleted allocation once its last process is gone.
        if gone {
            binding
                .scheduler
                .remove_allocation(binding.key, self.now_ns());
        }
        Ok(freed)
    }

    fn resolve_gpu(&self, sel: &GpuSelector) -> Result<&GpuInfo, StateError> {
        match sel {
            GpuSelector::Index(i) => self.gpus.iter().find(|g| g.index == *i).ok_or_else(|| {
                StateError::Invalid(format!(
                    "no GPU with index {i} (this node has {} GPU(s))",
                    self.gpus.len()
                ))
            }),
            GpuSelector::Uuid(u) => self
                .gpus
                .iter()
                .find(|g| g.uuid.eq_ignore_ascii_case(u))
                .ok_or_else(|| StateError::Invalid(format!("no GPU with UUID {u}"))),
        }
    }

    /// Creates and persists an allocation.
    pub async fn create(
        &self,
        req: CreateAllocation,
    ) -> Result<(String, AllocationStatus), StateError> {
        self.create_owned(req, None).await
    }

    /// Checks `req` against the rules of `create` with `records` already promised; returns
    /// its GPU.
    fn check_create(
        &self,
        records: &[AllocationRecord],
        req: &CreateAllocation,
    ) -> Result<GpuInfo, StateError> {
        let gpu = self.resolve_gpu(&req.gpu)?.clone();
        if !(1..=100).contains(&req.share) {
            return Err(StateError::Invalid(format!(
                "share {} is not in 1..=100",
                req.share
            )));
        }
        if let Some(cap) = req.cap
            && !(1..=100).contains(&cap)
        {
            return Err(StateError::Invalid(format!("cap {cap} is not in 1..=100")));
        }
        if req.memory_limit == 0 {
            return Err(StateError::Invalid(
                "memory limit must be above 0 bytes".into(),
            ));
        }
        check_labels(&req.labels)?;
        if req.memory_limit > gpu.memory_total {
            return Err(StateError::Invalid(format!(
                "memory limit {} exceeds GPU {}'s {}",
                human(req.memory_limit),
                gpu.index,
                human(gpu.memory_total)
            )));
        }
        let on_gpu = records.iter().filter(|r| r.gpu_uuid == gpu.uuid);
        let (shares, memory) =
            on_gpu.fold((0u32, 0u64), |(s, m), r| (s + r.share, m + r.memory_limit));
        if shares + req.share > 100 {
            return Err(StateError::Exhausted(format!(
                "GPU {} has {} of 100 shares left, {} asked",
                gpu.index,
                100u32.saturating_sub(shares),
                req.share
            )));
        }
        if memory + req.memory_limit > gpu.memory_total {
            return Err(StateError::Exhausted(format!(
                "GPU {} has {} of {} not yet promised, {} asked",
                gpu.index,
                human(gpu.memory_total.saturating_sub(memory)),
                human(gpu.memory_total),
                human(req.memory_limit)
            )));
        }
        Ok(gpu)
    }

    /// A record for `req` on `gpu` with a fresh id (none of `records`' ids) and `token`.
    fn new_record(
        records: &[AllocationRecord],
        req: CreateAllocation,
        gpu: &GpuInfo,
        token: String,
        owner: Option<tessera_protocol::ProcessOwner>,
        tier: tessera_protocol::Tier,
    ) -> Result<AllocationRecord, StateError> {
        let mut id = store::new_id()?;
        while records.iter().any(|r| r.id == id) {
            id = store::new_id()?;
        }
        Ok(AllocationRecord {
            id,
            token,
            gpu_index: gpu.index,
            gpu_uuid: gpu.uuid.clone(),
            memory_limit: req.memory_limit,
            share: req.share,
            cap: req.cap,
            labels: req.labels,
            created_unix: now_unix(),
            owner,
            tier,
            uid: None,
        })
    }

    /// Validates, persists and registers an allocation owned by `owner` (see
    /// [`crate::owner`]); returns its token and status.
    pub async fn create_owned(
        &self,
        req: CreateAllocation,
        owner: Option<tessera_protocol::ProcessOwner>,
    ) -> Result<(String, AllocationStatus), StateError> {
        self.create_tiered(req, owner, tessera_protocol::Tier::BestEffort)
            .await
    }

    /// [`Arbiter::create_owned`] in a service tier (admin socket only: the tier is the
    /// operator's, never the tenant's).
    pub async fn create_tiered(
        &self,
        req: CreateAllocation,
        owner: Option<tessera_protocol::ProcessOwner>,
        tier: tessera_protocol::Tier,
    ) -> Result<(String, AllocationStatus), StateError> {
        self.create_tiered_by(req, owner, tier, &By::OPERATOR).await
    }

    /// [`Arbiter::create_tiered`] for `by`: recorded as theirs, within their quota.
    pub async fn create_tiered_by(
        &self,
        req: CreateAllocation,
        owner: Option<tessera_protocol::ProcessOwner>,
        tier: tessera_protocol::Tier,
        by: &By,
    ) -> Result<(String, AllocationStatus), StateError> {
        let mut records = self.admin.lock().await;
        let gpu = self.check_create(&records, &req)?;
        by.check_quota(&records, &gpu, &req)?;
        let mut record = Self::new_record(&records, req, &gpu, store::new_token()?, owner, tier)?;
        record.uid = by.uid;
        let mut next = records.clone();
        next.push(record.clone());
        self.persist(next.clone()).await?;
        *records = next;
        let token = record.token.clone();
        let id = record.id.clone();
        self.insert_live(record);
        let status = self
            .status_of(&id)
            .ok_or_else(|| StateError::NotFound(id.clone()))?;
        Ok((token, status))
    }

    /// Creates one allocation spanning several GPUs (see [`tessera_protocol::group`]): a
    /// slice per entry, each checked as `create` checks one, on distinct GPUs, all persisted in
    /// one write or none. Every slice is labelled with the group id (the first slice's id);
    /// the first slice's token is the group token, the others' are derived from it. Returns the
    /// group token and the slices' statuses in the order asked.
    pub async fn create_group(
        &self,
        slices: Vec<CreateAllocation>,
        owner: Option<tessera_protocol::ProcessOwner>,
    ) -> Result<(String, Vec<AllocationStatus>), StateError> {
        self.create_group_by(slices, owner, &By::OPERATOR).await
    }

    /// [`Arbiter::create_group`] for `by`: every slice recorded as theirs, all within their
    /// quota together.
    pub async fn create_group_by(
        &self,
        slices: Vec<CreateAllocation>,
        owner: Option<tessera_protocol::ProcessOwner>,
        by: &By,
    ) -> Result<(String, Vec<AllocationStatus>), StateError> {
        use tessera_protocol::group::{LABEL_GPU_GROUP, MAX_GROUP_GPUS, slice_token};
        if slices.is_empty() || slices.len() > MAX_GROUP_GPUS {
            return Err(StateError::Invalid(format!(
                "{} GPUs asked, 1 to {MAX_GROUP_GPUS} allowed",
                slices.len()
            )));
        }
        let mut records = self.admin.lock().await;
        let mut next = records.clone();
        let group_token = store::new_token()?;
        let mut group_id: Option<String> = None;
        let mut made: Vec<AllocationRecord> = Vec::new();
        for mut req in slices {
            let gpu = self.check_create(&next, &req)?;
            by.check_quota(&next, &gpu, &req)?;
            if made.iter().any(|r| r.gpu_uuid == gpu.uuid) {
                return Err(StateError::Invalid(format!(
                    "GPU {} is asked twice; one slice per GPU",
                    gpu.index
                )));
            }
            let token = match group_id {
                None => group_token.clone(),
                Some(_) => slice_token(&group_token, &gpu.uuid),
            };
            let mut record = Self::new_record(
                &next,
                req.clone(),
                &gpu,
                token,
                owner,
                tessera_protocol::Tier::BestEffort,
            )?;
            record.uid = by.uid;
            let gid = group_id.get_or_insert_with(|| record.id.clone()).clone();
            req.labels.insert(LABEL_GPU_GROUP.to_owned(), gid);
            check_labels(&req.labels)?;
            record.labels = req.labels;
            next.push(record.clone());
            made.push(record);
        }
        self.persist(next.clone()).await?;
        *records = next;
        drop(records);
        let ids: Vec<String> = made.iter().map(|r| r.id.clone()).collect();
        for r in made {
            self.insert_live(r);
        }
        let statuses = ids
            .iter()
            .map(|id| {
                self.status_of(id)
                    .ok_or_else(|| StateError::NotFound(id.clone()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((group_token, statuses))
    }

    /// Deletes and persists. Live processes of the allocation keep their connection: their
    /// Reserves are denied from now on, Releases are still served, and the memory is counted
    /// until they exit.
    pub async fn delete(&self, id: &str) -> Result<(), StateError> {
        self.delete_by(id, &By::OPERATOR).await
    }

    /// [`Arbiter::delete`] if `by` may touch the allocation.
    pub async fn delete_by(&self, id: &str, by: &By) -> Result<(), StateError> {
        let mut records = self.admin.lock().await;
        if let Some(r) = records.iter().find(|r| r.id == id) {
            by.may_touch(r)?;
        }
        let next: Vec<_> = records.iter().filter(|r| r.id != id).cloned().collect();
        if next.len() == records.len() {
            return Err(StateError::NotFound(id.to_owned()));
        }
        self.persist(next.clone()).await?;
        *records = next;
        let mut live = self.live();
        if let Some(a) = live.by_id.remove(id) {
            live.tokens.remove(&a.record.token);
            if let Some(alias) = group_marker(&a.record) {
                live.tokens.remove(&alias);
            }
            // Ok(true): no process attached, the account is gone now.
            if live.ledger.close(a.key).unwrap_or(true) {
                drop(live);
                a.scheduler.remove_allocation(a.key, self.now_ns());
            }
        }
        Ok(())
    }

    /// Merges `labels` into an allocation's labels (an empty value removes the key) and
    /// persists; nothing changes if the result breaks the label bounds or cannot be written.
    pub async fn update_labels(
        &self,
        id: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<AllocationStatus, StateError> {
        self.update_labels_by(id, labels, &By::OPERATOR).await
    }

    /// [`Arbiter::update_labels`] if `by` may touch the allocation.
    pub async fn update_labels_by(
        &self,
        id: &str,
        labels: BTreeMap<String, String>,
        by: &By,
    ) -> Result<AllocationStatus, StateError> {
        let mut records = self.admin.lock().await;
        let Some(pos) = records.iter().position(|r| r.id == id) else {
            return Err(StateError::NotFound(id.to_owned()));
        };
        by.may_touch(&records[pos])?;
        let mut merged = records[pos].labels.clone();
        for (k, v) in labels {
            if v.is_empty() {
                merged.remove(&k);
            } else {
                merged.insert(k, v);
            }
        }
        check_labels(&merged)?;
        let mut next = records.clone();
        next[pos].labels = merged.clone();
        self.persist(next.clone()).await?;
        *records = next;
        if let Some(a) = self.live().by_id.get_mut(id) {
            a.record.labels = merged;
        }
        self.status_of(id)
            .ok_or_else(|| StateError::NotFound(id.to_owned()))
    }

    async fn persist(&self, records: Vec<AllocationRecord>) -> Result<(), StateError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || store.save(&records))
            .await
            .map_err(StateError::Internal)??;
        Ok(())
    }

    /// Writes the current allocations again (at shutdown).
    pub async fn persist_all(&self) -> Result<(), StateError> {
        let records = self.admin.lock().await;
        self.persist(records.clone()).await
    }

    fn status_of(&self, id: &str) -> Option<AllocationStatus> {
        let live = self.live();
        let a = live.by_id.get(id)?;
        let usage = live.ledger.usage(a.key)?;
        let r = &a.record;
        let now = self.now_ns();
        let gpu_time_10s_ns = a.scheduler.gpu_time_10s(a.key, now);
        let sched = a.scheduler.alloc_stats(a.key, now).unwrap_or_default();
        Some(AllocationStatus {
            id: r.id.clone(),
            gpu_index: r.gpu_index,
            gpu_uuid: r.gpu_uuid.clone(),
            memory_limit: r.memory_limit,
            memory_used: usage.in_use,
            processes: live.procs.get(&a.key).map_or(0, |p| p.len() as u32),
            share: r.share,
            cap: r.cap,
            gpu_time_10s_ns,
            labels: r.labels.clone(),
            created_unix: r.created_unix,
            enforced: a.counters.enforcements().iter().sum(),
            gpu_time_total_ns: sched.gpu_ns,
            throttled_total_ns: sched.throttled_ns,
            oom_refusals: a.counters.oom_refusals(),
            leases: sched.leases,
            owner: r.owner,
            orphaned: r
                .owner
                .is_some_and(|o| !crate::owner::alive(std::path::Path::new("/proc"), o)),
            tier: r.tier,
            owner_uid: r.uid,
        })
    }

    /// Every allocation with its use, ordered by GPU then creation.
    pub async fn list(&self) -> Vec<AllocationStatus> {
        let records = self.admin.lock().await;
        let mut out: Vec<_> = records
            .iter()
            .filter_map(|r| self.status_of(&r.id))
            .collect();
        // Stable: records are kept in creation order.
        out.sort_by_key(|a| a.gpu_index);
        out
    }
}

/// `n` simulated 80 GiB GPUs (`GPU-0`, `GPU-1`, ...), for tests.
#[cfg(test)]
pub(crate) fn test_gpus(n: u32) -> Vec<GpuInfo> {
    (0..n)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            name: "sim".into(),
            memory_total: 80 << 30,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_protocol::{CreateAllocation, GpuSelector, LABEL_WHOLE_GROUP};

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_whole_card_allocation_holds_its_card_and_its_groups_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let gpus = test_gpus(4);
        let arb = Arbiter::new(
            gpus,
            Store::open(dir.path()).unwrap(),
            SchedulerParams::default(),
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let make = |gpu: u32, share: u32, group: Option<&str>| {
            let req = CreateAllocation {
                gpu: GpuSelector::Index(gpu),
                memory_limit: GIB,
                share,
                cap: None,
                labels: group
                    .map(|g| (LABEL_WHOLE_GROUP.to_owned(), g.to_owned()))
                    .into_iter()
                    .collect(),
            };
            rt.block_on(arb.create(req)).unwrap().1.id
        };
        let (a, b) = (make(0, 100, Some("GPU-0")), make(1, 100, Some("GPU-0")));
        let c = make(2, 100, None);
        // A fraction carrying the label (an operator's mistake) holds no card.
        let d = make(3, 50, Some("GPU-0"));
        let watched = arb.watched();
        let of = |id: &str| {
            watched
                .iter()
                .find(|w| w.id == id)
                .unwrap()
                .whole_gpus
                .clone()
        };
        assert_eq!(of(&a), [0, 1]);
        assert_eq!(of(&b), [0, 1]);
        assert_eq!(of(&c), [2]);
        assert!(of(&d).is_empty());
    }

    #[test]
    fn a_process_that_freed_after_the_card_was_read_is_seen_holding_what_the_card_showed() {
        // The backstop reads the card, then the ledger. A process that frees 600 MiB and
        // releases it in between (the poll descheduled on a loaded host) shows 600 MiB more on
        // the card than it holds now; twice in a row, that was charged to it as excess and its
        // next cuMemGetInfo came back 600 MiB short. The ledger side is the most it held since
        // the last poll, so the card figure is within it.
        let dir = tempfile::tempdir().unwrap();
        let arb = two_gpu_arbiter(dir.path());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (token, _) = rt.block_on(arb.create(slice_req(0, GIB, 50))).unwrap();
        let me = crate::peer::ProcId {
            pid: std::process::id() as i32,
            start: 1,
        };
        let b = arb
            .attach_tenant(&token, 7, Some(crate::peer::Peer::without_pidfd(me)))
            .unwrap();
        const MIB: u64 = 1 << 20;
        let held = || -> Vec<(crate::peer::ProcId, u64)> {
            arb.connected_processes()
                .into_iter()
                .map(|(_, id, _, held, _)| (id, held))
                .collect()
        };
        arb.with_ledger(|l| l.reserve(b.key, 7, 300 * MIB)).unwrap();
        assert_eq!(held(), [(me, 300 * MIB)]);
        for _ in 0..2 {
            arb.with_ledger(|l| l.reserve(b.key, 7, 600 * MIB)).unwrap();
            arb.with_ledger(|l| l.release(b.key, 7, 600 * MIB)).unwrap();
            assert_eq!(held(), [(me, 900 * MIB)], "the card may have shown 900 MiB");
        }
        // Nothing held and released since the last look: what it holds.
        assert_eq!(held(), [(me, 300 * MIB)]);
    }

    fn two_gpu_arbiter(dir: &std::path::Path) -> Arc<Arbiter> {
        let gpus = test_gpus(2);
        Arbiter::new(gpus, Store::open(dir).unwrap(), SchedulerParams::default()).unwrap()
    }

    fn slice_req(gpu: u32, limit: u64, share: u32) -> CreateAllocation {
        CreateAllocation {
            gpu: GpuSelector::Index(gpu),
            memory_limit: limit,
            share,
            cap: None,
            labels: BTreeMap::new(),
        }
    }

    #[test]
    fn a_group_is_one_slice_per_gpu_under_one_token_with_per_gpu_limits() {
        use tessera_protocol::group::{LABEL_GPU_GROUP, slice_token};
        let dir = tempfile::tempdir().unwrap();
        let arb = two_gpu_arbiter(dir.path());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (token, slices) = rt
            .block_on(arb.create_group(
                vec![slice_req(0, 10 * GIB, 30), slice_req(1, 20 * GIB, 30)],
                None,
            ))
            .unwrap();
        assert_eq!(slices.len(), 2);
        assert_eq!((slices[0].gpu_index, slices[0].memory_limit), (0, 10 * GIB));
        assert_eq!((slices[1].gpu_index, slices[1].memory_limit), (1, 20 * GIB));
        for s in &slices {
            assert_eq!(s.labels[LABEL_GPU_GROUP], slices[0].id);
        }
        // The group token opens GPU 0's slice; GPU 1's is reached only through its derived
        // token, and a token for a GPU outside the group opens nothing.
        let a = arb.attach_tenant(&token, 1, None).unwrap();
        assert_eq!(a.view.id, slices[0].id);
        let b = arb
            .attach_tenant(&slice_token(&token, "GPU-1"), 2, None)
            .unwrap();
        assert_eq!(
            (b.view.id.as_str(), b.view.memory_limit),
            (slices[1].id.as_str(), 20 * GIB)
        );
        assert!(
            arb.attach_tenant(&slice_token(&token, "GPU-7"), 3, None)
                .is_none()
        );
        // The first slice answers its own GPU's slice token too (how an interposer learns it is
        // in a group).
        assert_eq!(
            arb.attach_tenant(&slice_token(&token, "GPU-0"), 5, None)
                .map(|b| b.view.id),
            Some(slices[0].id.clone())
        );
        // Separate ledgers: each refuses at its own limit.
        let granted = |key, conn, bytes| {
            arb.with_ledger(|l| {
                matches!(
                    l.reserve(key, conn, bytes),
                    Ok(crate::ledger::Reservation::Granted { .. })
                )
            })
        };
        assert!(granted(a.key, 1, 10 * GIB));
        assert!(!granted(a.key, 1, 1));
        assert!(granted(b.key, 2, 20 * GIB));
        assert!(!granted(b.key, 2, 1));
        // The backstop sees the slices per card, in one group.
        let w = arb.watched();
        let of = |id: &str| w.iter().find(|x| x.id == id).unwrap().clone();
        assert_eq!(
            (of(&slices[0].id).gpu, of(&slices[1].id).gpu),
            (Some(0), Some(1))
        );
        assert_eq!(
            of(&slices[1].id).group.as_deref(),
            Some(slices[0].id.as_str())
        );
        // It survives a restart (one record per slice, derived token included).
        drop((a, b));
        drop(arb);
        let again = two_gpu_arbiter(dir.path());
        assert!(
            again
                .attach_tenant(&slice_token(&token, "gpu-1"), 4, None)
                .is_some()
        );
    }

    #[test]
    fn a_group_is_created_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let arb = two_gpu_arbiter(dir.path());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(arb.create(slice_req(1, GIB, 80))).unwrap();
        // GPU 1 has 20 shares left: the whole group is refused and GPU 0 keeps its shares.
        let e = rt
            .block_on(arb.create_group(vec![slice_req(0, GIB, 30), slice_req(1, GIB, 30)], None))
            .unwrap_err();
        assert!(matches!(e, StateError::Exhausted(_)), "{e}");
        assert_eq!(arb.allocation_count(), 1);
        let e = rt
            .block_on(arb.create_group(vec![slice_req(0, GIB, 10), slice_req(0, GIB, 10)], None))
            .unwrap_err();
        assert!(e.to_string().contains("asked twice"), "{e}");
        let e = rt.block_on(arb.create_group(Vec::new(), None)).unwrap_err();
        assert!(matches!(e, StateError::Invalid(_)), "{e}");
        assert_eq!(arb.allocation_count(), 1);
    }
}
