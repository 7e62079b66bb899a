//! The arbiter's shared state: GPUs, allocations, the memory ledger and the schedulers.
//!
//! The device list (`gpus`, read again when the MIG layout changes: [`devices`]) is behind a
//! lock of its own, held only to copy or swap an `Arc`.
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
mod admin;
mod devices;
mod kills;
mod observe;
mod tenants;
pub(crate) use access::{By, Quota};

/// How long a reservation that does not fit waits, by default, while other processes of its
/// allocation hold memory, for them to give back unused credit (they answer a `Pressure` as
/// soon as their watcher thread runs) or to free what they hold. A process preempted between
/// its allocation and its free holds the bytes for a time slice or more on a busy node; this
/// wait turns that into a short delay instead of a false out-of-memory. With nothing held by
/// other processes, a reservation that does not fit is refused at once.
pub(crate) const DEFAULT_MEMORY_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

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
    pub(crate) fn kind(&self) -> AdminErrorKind {
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
pub(crate) struct Watched {
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
pub(crate) struct TenantBinding {
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
    /// The devices, by UUID with stable indexes ([`crate::gpus::keep_indexes`]).
    gpus: parking_lot::RwLock<Arc<Vec<GpuInfo>>>,
    /// What reads them again when a Create names a device this list lacks (none: fixed).
    discovery: std::sync::OnceLock<Box<dyn crate::gpus::GpuDiscovery + Send + Sync>>,
    /// Where a scheduler made after start-up runs its timer (set once the server has started
    /// those of the schedulers made at start-up).
    timers: Mutex<Option<tokio::runtime::Handle>>,
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
    /// The wall-clock second this arbiter started in: an owned allocation created before it
    /// was restored from disk (its processes may not have reconnected yet).
    started_unix: u64,
    /// Pressure channels of tenant processes (memory credit reclaim).
    pressure: PressureHub,
    /// Tenant requests by kind (metrics).
    requests: RequestStats,
    /// Processes of owned allocations found under their owner (see [`crate::owner`]).
    members: Mutex<crate::owner::Members>,
    /// The last process the backstop killed per allocation, and why ([`kills`]).
    kills: Mutex<HashMap<String, tessera_protocol::KillRecord>>,
    /// Asks the reaper to look now, not at its next tick: an owner exited, or a process of
    /// an allocation closed its last connection ([`Arbiter::reap_soon`]).
    reap_now: Arc<tokio::sync::Notify>,
}

/// Seconds since the Unix epoch (0 before it).
pub(crate) fn now_unix() -> u64 {
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
/// the error names the first bad record (its index in `records`) and what is wrong, by id.
fn check_records(records: &[AllocationRecord], gpus: &[GpuInfo]) -> Result<(), (usize, String)> {
    let is_hex = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit());
    let mut ids = HashMap::new();
    let mut tokens = HashMap::new();
    // Per GPU UUID: shares and bytes promised so far.
    let mut promised: HashMap<&str, (u32, u64)> = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        let bad = |what: String| Err((i, format!("allocation {:?}: {what}", r.id)));
        if r.id.len() != ID_LEN || !is_hex(&r.id) {
            return bad(format!("id is not {ID_LEN} hex digits"));
        }
        if ids.insert(r.id.as_str(), i).is_some() {
            return bad("the same id is there twice".into());
        }
        if !TOKEN_LEN.contains(&r.token.len()) || !is_hex(&r.token) {
            return bad(format!(
                "token is not {} to {} hex digits",
                TOKEN_LEN.start(),
                TOKEN_LEN.end()
            ));
        }
        if let Some(j) = tokens.insert(r.token.as_str(), i) {
            return bad(format!("same token as allocation {:?}", records[j].id));
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
        check_records(&records, &gpus).map_err(|(i, reason)| {
            StateError::Load(StoreError::Corrupt {
                path: store.path_of(&records[i]),
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
            gpus: parking_lot::RwLock::new(Arc::new(gpus)),
            discovery: std::sync::OnceLock::new(),
            timers: Mutex::new(None),
            store,
            admin: tokio::sync::Mutex::new(records.clone()),
            live: Mutex::new(Live::default()),
            schedulers: Mutex::new(HashMap::new()),
            sched_params,
            memory_wait_ns: AtomicU64::new(DEFAULT_MEMORY_WAIT.as_nanos() as u64),
            next_conn: AtomicU64::new(1),
            epoch: Instant::now(),
            started_unix: now_unix(),
            pressure: PressureHub::new(),
            requests: RequestStats::default(),
            members: Mutex::default(),
            kills: Mutex::default(),
            reap_now: Arc::new(tokio::sync::Notify::new()),
        });
        for g in arb.gpus().iter() {
            arb.scheduler_for(&g.uuid);
        }
        for r in records {
            arb.insert_live(r);
        }
        Ok(arb)
    }

    /// Origin of the schedulers' clock.
    pub(crate) fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Nanoseconds since this arbiter started (the schedulers' clock).
    pub(crate) fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// The node's devices as last read.
    pub fn gpus(&self) -> Arc<Vec<GpuInfo>> {
        Arc::clone(&self.gpus.read())
    }

    /// Every scheduler.
    #[cfg(test)]
    pub(crate) fn schedulers(&self) -> Vec<SchedulerHandle> {
        self.schedulers.lock().values().cloned().collect()
    }

    fn scheduler_for(&self, uuid: &str) -> SchedulerHandle {
        let mut all = self.schedulers.lock();
        if let Some(s) = all.get(uuid) {
            return s.clone();
        }
        let s = SchedulerHandle::new(uuid.to_owned(), self.sched_params);
        all.insert(uuid.to_owned(), s.clone());
        if let Some(rt) = &*self.timers.lock() {
            rt.spawn(s.clone().run_timer(self.epoch));
        }
        s
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
    pub(crate) fn allocation_count(&self) -> usize {
        self.live().by_id.len()
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

/// An arbiter on `gpus` simulated GPUs with its state in `dir`, default scheduling, for tests.
#[cfg(test)]
pub(crate) fn test_arbiter(dir: &std::path::Path, gpus: u32) -> Arc<Arbiter> {
    Arbiter::new(
        test_gpus(gpus),
        Store::open(dir).unwrap(),
        SchedulerParams::default(),
    )
    .unwrap()
}

/// An arbiter on `gpus` simulated GPUs with its state in `dir`, and the token of one
/// allocation of `limit` bytes and share 50 on GPU 0, for tests of what tenants do to it.
#[cfg(test)]
pub(crate) fn test_arbiter_with_allocation(
    dir: &std::path::Path,
    gpus: u32,
    limit: u64,
) -> (Arc<Arbiter>, String) {
    let arb = test_arbiter(dir, gpus);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (token, _) = rt
        .block_on(arb.create(tessera_protocol::CreateAllocation {
            gpu: tessera_protocol::GpuSelector::Index(0),
            memory_limit: limit,
            share: 50,
            cap: None,
            labels: Default::default(),
        }))
        .unwrap();
    (arb, token)
}

#[cfg(test)]
mod tests;
