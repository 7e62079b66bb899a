//! One allocation's state on a GPU: its place in the fair queue, its cap meter, its lease
//! length, and its counters.

use std::collections::{BTreeSet, VecDeque};

use crate::ledger::ConnId;

use super::cap::CapMeter;
use super::lease::LeaseLength;
use super::{SchedulerParams, Tier};

#[derive(Debug)]
pub(super) struct Alloc {
    pub(super) share: u32,
    pub(super) tier: Tier,
    pub(super) vtime: f64,
    /// Its cap (a latency allocation's is at most its share: see
    /// [`GpuScheduler::set_tier`](super::GpuScheduler::set_tier)), token bucket and cap
    /// window.
    pub(super) meter: CapMeter,
    pub(super) lease_len: LeaseLength,
    /// When its last lease ended (None: never had one).
    pub(super) last_lease_end: Option<u64>,
    /// (time charged, ns charged), oldest first.
    pub(super) history: VecDeque<(u64, u64)>,
    /// Every ns charged for leases since the allocation was added (the backstop compares it
    /// with the GPU time NVML saw its processes use).
    pub(super) leased_total_ns: u64,
    /// Every ns charged, leases and unleased time alike (exported as its GPU time).
    pub(super) charged_total_ns: u64,
    /// Time its requests waited for a lease and are no longer waiting, ns.
    pub(super) waited_total_ns: u64,
    /// Leases granted.
    pub(super) leases: u64,
    /// Its connections that have asked for a lease and are still open (a latency allocation
    /// bounds best-effort work only while it has one: see
    /// [`GpuScheduler::latency_in_use`](super::GpuScheduler::latency_in_use)).
    pub(super) asked: BTreeSet<ConnId>,
}

impl Alloc {
    /// A best-effort allocation with a full bucket, added at `now`.
    pub(super) fn new(share: u32, cap: Option<u32>, params: &SchedulerParams, now: u64) -> Self {
        Self {
            share: share.max(1),
            tier: Tier::BestEffort,
            vtime: 0.0,
            meter: CapMeter::new(cap, params, now),
            lease_len: LeaseLength::new(params),
            last_lease_end: None,
            history: VecDeque::new(),
            leased_total_ns: 0,
            charged_total_ns: 0,
            waited_total_ns: 0,
            leases: 0,
            asked: BTreeSet::new(),
        }
    }
}
