//! What the arbiter counts and samples, for its read models and its renderers: why the
//! backstop acted ([`EnforceReason`]), per-allocation counters bumped on the tenant path
//! ([`AllocCounters`]), tenant requests by kind with their durations ([`RequestStats`]), and the
//! samples one scrape reads from the state ([`Snapshot`]). Pure data with atomics: the state
//! owns them, `metrics` renders them, the services bump them.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tessera_protocol::TenantRequest;

use crate::scheduler::AllocStats;

/// Why the backstop acted on a process of an allocation (label `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EnforceReason {
    /// Its allocation's processes held more device memory than the limit plus tolerance.
    MemoryOverLimit,
    /// Its allocation used too much GPU time outside its leases.
    ComputeBypass,
}

impl EnforceReason {
    /// Every reason, in the order of [`AllocCounters`]' slots.
    pub(crate) const ALL: [EnforceReason; 2] = [Self::MemoryOverLimit, Self::ComputeBypass];

    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::MemoryOverLimit => "memory_over_limit",
            Self::ComputeBypass => "compute_bypass",
        }
    }
}

/// Counters of one allocation kept outside the schedulers, shared by its tenant connections
/// (lock-free: they are bumped on the tenant path).
#[derive(Debug, Default)]
pub(crate) struct AllocCounters {
    oom_refusals: AtomicU64,
    enforced: [AtomicU64; 2],
    /// GPU time of its processes by NVML, as the backstop reads it.
    gpu_busy_ns: AtomicU64,
}

impl AllocCounters {
    /// A reservation was refused at the limit (the tenant sees an out-of-memory error).
    pub(crate) fn refused(&self) {
        self.oom_refusals.fetch_add(1, Ordering::Relaxed);
    }

    /// Reservations refused so far.
    pub(crate) fn oom_refusals(&self) -> u64 {
        self.oom_refusals.load(Ordering::Relaxed)
    }

    /// The backstop acted on one of its processes.
    pub(crate) fn enforced(&self, why: EnforceReason) {
        self.enforced[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The backstop read `ns` of GPU time used by the allocation's processes (NVML's
    /// per-process utilisation over one poll interval).
    pub(crate) fn add_gpu_busy(&self, ns: u64) {
        self.gpu_busy_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// GPU time read from NVML so far, ns.
    pub(crate) fn gpu_busy_ns(&self) -> u64 {
        self.gpu_busy_ns.load(Ordering::Relaxed)
    }

    /// Backstop actions so far, per reason (in [`EnforceReason::ALL`]'s order).
    pub(crate) fn enforcements(&self) -> [u64; 2] {
        [0, 1].map(|i| self.enforced[i].load(Ordering::Relaxed))
    }
}

/// Upper bounds of the request-duration buckets, seconds: a `Reserve` round trip takes a few
/// microseconds, one that presses other processes up to the 50 ms memory wait.
pub(crate) const DURATION_BUCKETS: [f64; 12] = [
    5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 250e-3,
];

/// The kind of a tenant request (label `type` of the request metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestKind {
    /// `Reserve`.
    Reserve,
    /// `Release`.
    Release,
    /// `Redeclare`.
    Redeclare,
    /// `MemInfo`.
    MemInfo,
    /// `Ping`.
    Ping,
    /// `LeaseAcquire`.
    LeaseAcquire,
    /// `LeaseRelease`.
    LeaseRelease,
    /// `ReserveCredit`.
    ReserveCredit,
    /// `Ticket`.
    Ticket,
    /// `Subscribe`.
    Subscribe,
    /// `Relinquish`.
    Relinquish,
}

impl RequestKind {
    /// Every kind, in the order of [`RequestStats`]' slots.
    pub(crate) const ALL: [RequestKind; 11] = [
        Self::Reserve,
        Self::Release,
        Self::Redeclare,
        Self::MemInfo,
        Self::Ping,
        Self::LeaseAcquire,
        Self::LeaseRelease,
        Self::ReserveCredit,
        Self::Ticket,
        Self::Subscribe,
        Self::Relinquish,
    ];

    /// The kind of `req`.
    pub(crate) fn of(req: &TenantRequest) -> Self {
        match req {
            TenantRequest::Reserve { .. } => Self::Reserve,
            TenantRequest::Release { .. } => Self::Release,
            TenantRequest::Redeclare { .. } => Self::Redeclare,
            TenantRequest::MemInfo | TenantRequest::MemInfoAfter { .. } => Self::MemInfo,
            TenantRequest::Ping => Self::Ping,
            TenantRequest::LeaseAcquire | TenantRequest::LeaseAcquireTiered => Self::LeaseAcquire,
            TenantRequest::LeaseRelease { .. } => Self::LeaseRelease,
            TenantRequest::ReserveCredit { .. } => Self::ReserveCredit,
            TenantRequest::Ticket => Self::Ticket,
            TenantRequest::Subscribe { .. } => Self::Subscribe,
            TenantRequest::Relinquish { .. } => Self::Relinquish,
        }
    }

    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Reserve => "reserve",
            Self::Release => "release",
            Self::Redeclare => "redeclare",
            Self::MemInfo => "mem_info",
            Self::Ping => "ping",
            Self::LeaseAcquire => "lease_acquire",
            Self::LeaseRelease => "lease_release",
            Self::ReserveCredit => "reserve_credit",
            Self::Ticket => "ticket",
            Self::Subscribe => "subscribe",
            Self::Relinquish => "relinquish",
        }
    }
}

#[derive(Debug, Default)]
struct KindStats {
    count: AtomicU64,
    sum_ns: AtomicU64,
    /// Per bucket (not cumulative); the last slot is above every bound.
    buckets: [AtomicU64; DURATION_BUCKETS.len() + 1],
}

/// Tenant requests handled, by kind, with a histogram of the time each took: three relaxed
/// atomic additions per request.
#[derive(Debug, Default)]
pub(crate) struct RequestStats {
    kinds: [KindStats; RequestKind::ALL.len()],
}

impl RequestStats {
    /// Counts one request of kind `kind` that took `took`.
    pub(crate) fn observe(&self, kind: RequestKind, took: Duration) {
        let k = &self.kinds[kind as usize];
        let secs = took.as_secs_f64();
        let slot = DURATION_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(DURATION_BUCKETS.len());
        k.count.fetch_add(1, Ordering::Relaxed);
        k.sum_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        k.buckets[slot].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests of kind `kind` so far.
    pub(crate) fn count(&self, kind: RequestKind) -> u64 {
        self.kinds[kind as usize].count.load(Ordering::Relaxed)
    }

    /// The duration histogram of `kind`: (upper bound in seconds, requests in that bucket, not
    /// cumulative) for each of [`DURATION_BUCKETS`] and then infinity, and the sum in ns.
    pub(crate) fn histogram(&self, kind: RequestKind) -> (Vec<(f64, u64)>, u64) {
        let k = &self.kinds[kind as usize];
        let buckets = DURATION_BUCKETS
            .iter()
            .chain(&[f64::INFINITY])
            .zip(&k.buckets)
            .map(|(b, c)| (*b, c.load(Ordering::Relaxed)))
            .collect();
        (buckets, k.sum_ns.load(Ordering::Relaxed))
    }
}

/// One allocation at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct AllocSample {
    /// Public id.
    pub id: String,
    /// GPU index.
    pub gpu_index: u32,
    /// GPU UUID.
    pub gpu_uuid: String,
    /// `namespace`, `pod`, `container` from its labels, when known.
    pub pod: [Option<String>; 3],
    /// Memory limit, bytes.
    pub memory_limit: u64,
    /// Bytes reserved in the ledger.
    pub memory_used: u64,
    /// Compute share, percent.
    pub share: u32,
    /// Compute cap, percent.
    pub cap: Option<u32>,
    /// Service tier.
    pub tier: tessera_protocol::Tier,
    /// Connected processes.
    pub processes: u32,
    /// The scheduler's counters.
    pub sched: AllocStats,
    /// Reservations refused at the limit.
    pub oom_refusals: u64,
    /// Backstop actions per reason ([`EnforceReason::ALL`]'s order).
    pub enforced: [u64; 2],
    /// GPU time of its processes by NVML (the backstop's reading), ns.
    pub gpu_busy_ns: u64,
}

/// One GPU at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct GpuSample {
    /// Index (the last known one for a GPU that is gone).
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Memory, bytes (`None`: the GPU is not present).
    pub memory_total: Option<u64>,
    /// Bytes promised to its allocations.
    pub memory_promised: u64,
    /// Shares promised, percent.
    pub shares: u32,
    /// Allocations on it.
    pub allocations: u32,
    /// GPU time charged on it so far, ns.
    pub busy_ns: u64,
}

/// What one scrape reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Snapshot {
    /// Live allocations.
    pub allocs: Vec<AllocSample>,
    /// GPUs: the discovered ones, then any an allocation names that is not present.
    pub gpus: Vec<GpuSample>,
    /// Admitted tenant connections.
    pub tenant_connections: u64,
}
