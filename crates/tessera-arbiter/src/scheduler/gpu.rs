//! One GPU's scheduler: its state, and the events that drive it (an allocation added or
//! removed, a request, a release, a closed connection, a tick). The policy each event applies
//! lives beside it: `queue`, `cap`, `lease`, `drains`, `latency`, `usage`.

use std::collections::{HashMap, VecDeque};

use crate::ledger::{AccountKey, ConnId};

use super::alloc::Alloc;
use super::drains::Drains;
use super::latency::Revocation;
use super::lease::Lease;
use super::queue::Waiter;
use super::{SchedulerParams, Tier};

/// Errors of scheduler operations.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SchedulerError {
    /// The allocation is not known to this GPU's scheduler.
    #[error("allocation {0} is not scheduled on this GPU")]
    UnknownAllocation(AccountKey),
}

/// A lease handed to a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    /// The connection that asked.
    pub conn: ConnId,
    /// Lease id, echoed by the tenant in `LeaseRelease`.
    pub lease_id: u64,
    /// Lease length, ns.
    pub duration_ns: u64,
    /// The predicted kernel time the holder may keep in flight, ns (`None`: unbounded): set
    /// for a best-effort holder while a latency allocation is in use (see
    /// [`GpuScheduler::latency_in_use`]).
    pub max_inflight_ns: Option<u64>,
    /// The holder is a latency allocation's: it hands the lease back as soon as its work has
    /// drained (`TenantReply::LeaseGrantedLatency`).
    pub latency: bool,
}

/// Lease scheduler of one GPU. Pure: every method takes the current time.
#[derive(Debug)]
pub(crate) struct GpuScheduler {
    pub(super) params: SchedulerParams,
    pub(super) allocs: HashMap<AccountKey, Alloc>,
    /// Waiting requests in arrival order (ties in vtime go to the earliest).
    pub(super) waiting: VecDeque<Waiter>,
    pub(super) current: Option<Lease>,
    /// The GPU is kept for this allocation until the time given (see
    /// [`SchedulerParams::rerequest_window_ns`]).
    pub(super) held_for: Option<(AccountKey, u64)>,
    /// The hold in `held_for` is a latency allocation's linger, begun at the time given: its
    /// elapsed part is charged to it when the hold ends.
    pub(super) linger_since: Option<u64>,
    pub(super) next_lease: u64,
    /// Every ns charged on this GPU (allocations removed since included).
    pub(super) charged_total_ns: u64,
    /// Leases revoked for a latency request and not yet told to their holders.
    pub(super) revoked: Vec<Revocation>,
    /// Leases ended by the scheduler whose holders have not released them yet (one per
    /// connection at most).
    pub(super) draining: Drains,
}

impl GpuScheduler {
    /// An idle scheduler.
    pub(crate) fn new(params: SchedulerParams) -> Self {
        Self {
            params,
            allocs: HashMap::new(),
            waiting: VecDeque::new(),
            current: None,
            held_for: None,
            linger_since: None,
            next_lease: 1,
            charged_total_ns: 0,
            revoked: Vec::new(),
            draining: Drains::new(params.revoked_drain_ns),
        }
    }

    /// Registers an allocation (share 1..=100, cap percent).
    pub(crate) fn add_allocation(
        &mut self,
        key: AccountKey,
        share: u32,
        cap: Option<u32>,
        now: u64,
    ) {
        self.allocs
            .insert(key, Alloc::new(share, cap, &self.params, now));
    }

    /// Forgets an allocation (its processes are gone); drops any waiter or lease it had.
    pub(crate) fn remove_allocation(&mut self, key: AccountKey, now: u64) -> Vec<Grant> {
        self.allocs.remove(&key);
        self.waiting.retain(|w| w.key != key);
        self.draining.forget(|d| d.key == key);
        if self.current.is_some_and(|l| l.key == key) {
            self.current = None;
        }
        if self.held_for.is_some_and(|(k, _)| k == key) {
            self.held_for = None;
            self.linger_since = None;
        }
        self.dispatch(now)
    }

    /// A connection asks for a lease. Returns the grants this causes (possibly its own).
    pub(crate) fn acquire(
        &mut self,
        key: AccountKey,
        conn: ConnId,
        now: u64,
    ) -> Result<Vec<Grant>, SchedulerError> {
        let Some(a) = self.allocs.get_mut(&key) else {
            return Err(SchedulerError::UnknownAllocation(key));
        };
        a.asked.insert(conn);
        // Asking again while holding a lease ends the old one (charged as held); a holder
        // asking again has drained a lease the scheduler ended (its release may be lost).
        if let Some(l) = self.current
            && l.conn == conn
        {
            self.end_lease(l, 0, false, now);
        }
        self.settle_drains(|d| d.conn == conn, now);
        // A second request from the same connection replaces the first.
        self.stop_waiting(|w| w.conn == conn, now);
        self.rejoin(key, now);
        self.waiting.push_back(Waiter {
            conn,
            key,
            since: now,
        });
        self.sync_backlog(now);
        Ok(self.dispatch(now))
    }

    /// The holder returns its lease. A stale or foreign lease id is ignored.
    pub(crate) fn release(
        &mut self,
        conn: ConnId,
        lease_id: u64,
        busy_ns: u64,
        early: bool,
        now: u64,
    ) -> Vec<Grant> {
        match self.current {
            Some(l) if l.id == lease_id && l.conn == conn => {
                self.end_lease(l, busy_ns, early, now);
                if early {
                    self.linger(l.key, now);
                } else {
                    self.hold_for_rerequest(l.key, now);
                }
                self.dispatch(now)
            }
            // The release of a lease the scheduler ended: its drain is over.
            _ => {
                self.settle_drains(|d| d.lease_id == lease_id && d.conn == conn, now);
                Vec::new()
            }
        }
    }

    /// A connection closed: its waiter is dropped and its lease released.
    pub(crate) fn connection_closed(&mut self, conn: ConnId, now: u64) -> Vec<Grant> {
        for a in self.allocs.values_mut() {
            a.asked.remove(&conn);
        }
        self.stop_waiting(|w| w.conn == conn, now);
        if let Some(l) = self.current
            && l.conn == conn
        {
            self.end_lease(l, 0, false, now);
        }
        self.settle_drains(|d| d.conn == conn, now);
        self.dispatch(now)
    }

    /// Revokes an overdue lease and grants what has become eligible.
    pub(crate) fn tick(&mut self, now: u64) -> Vec<Grant> {
        if let Some(l) = self.current
            && now >= l.granted_at + l.duration_ns + self.params.grace_ns
        {
            self.end_lease(l, 0, false, now);
            self.start_drain(l, now);
        }
        // A holder silent past the bound is charged the bound.
        let bound = self.params.revoked_drain_ns;
        self.settle_drains(|d| now >= d.since.saturating_add(bound), now);
        self.dispatch(now)
    }

    /// When [`tick`](Self::tick) must next run: the revocation time of the current lease, or
    /// the time the first capped waiter becomes eligible when the GPU is free.
    pub(crate) fn next_wakeup(&self, now: u64) -> Option<u64> {
        if let Some(l) = self.current {
            return Some(l.granted_at + l.duration_ns + self.params.grace_ns);
        }
        if let Some((_, until)) = self.held_for {
            return Some(until);
        }
        self.waiting
            .iter()
            .filter_map(|w| {
                let a = self.allocs.get(&w.key)?;
                // Nobody can go now (else the GPU would be leased): with others waiting, the
                // first to have room for a minimal lease is served then (see `eligible`).
                let need = if self.waiting.iter().any(|o| o.key != w.key) {
                    self.threshold()
                } else {
                    self.need(w.key, a, now)
                };
                a.meter
                    .ready_at(&self.params, a.tier == Tier::Latency, need, now)
            })
            .min()
    }

    /// The lease outstanding, as (connection, lease id).
    #[cfg(test)]
    pub(crate) fn current(&self) -> Option<(ConnId, u64)> {
        self.current.map(|l| (l.conn, l.id))
    }

    /// Number of waiting requests.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }
}
