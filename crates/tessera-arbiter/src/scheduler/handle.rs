//! The daemon's side: [`SchedulerHandle`] wraps a [`GpuScheduler`] in a mutex with the
//! [`GrantSink`]s of the connections waiting for a grant or holding a lease. Its timer task is
//! in `timer`.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use tokio::sync::Notify;

use crate::ledger::{AccountKey, ConnId};

use super::{AllocStats, GpuScheduler, Grant, SchedulerError, SchedulerParams, Tier};

/// Where a grant goes: the waiting connection. Called with the scheduler locked, so it must
/// not block (the tenant connection writes the reply with a non-blocking send).
pub(crate) trait GrantSink: Send + Sync {
    /// Tells the holder its lease `lease_id` is revoked (a latency request); false when the
    /// connection cannot take it (it is then closed, which stops its launches too).
    fn revoke(&self, lease_id: u64) -> bool;
    /// Delivers the grant; false when the connection cannot take it (it is then treated as
    /// closed and its lease given to the next waiter).
    fn grant(&self, grant: Grant) -> bool;
}

struct Inner {
    sched: GpuScheduler,
    /// Connections waiting for a grant.
    pending: HashMap<ConnId, Arc<dyn GrantSink>>,
    /// Connections that were granted a lease, to be told of a revocation (until they close).
    holders: HashMap<ConnId, Arc<dyn GrantSink>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("sched", &self.sched)
            .field("pending", &self.pending.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Inner {
    /// Hands out grants; a connection that cannot take one is closed in the scheduler, which
    /// may grant the next waiter.
    fn deliver(&mut self, mut grants: Vec<Grant>, now: u64) {
        // Revocations first: the best-effort holder stops launching while the grant travels.
        for r in self.sched.take_revocations() {
            if let Some(sink) = self.holders.get(&r.conn)
                && !sink.revoke(r.lease_id)
            {
                self.holders.remove(&r.conn);
                grants.extend(self.sched.connection_closed(r.conn, now));
            }
        }
        while let Some(g) = grants.pop() {
            let sink = self.pending.remove(&g.conn);
            let delivered = sink.as_ref().is_some_and(|sink| sink.grant(g));
            match sink {
                Some(sink) if delivered => {
                    self.holders.insert(g.conn, sink);
                }
                _ => {
                    self.holders.remove(&g.conn);
                    grants.extend(self.sched.connection_closed(g.conn, now));
                }
            }
        }
    }
}

#[derive(Debug)]
struct Shared {
    uuid: String,
    inner: Mutex<Inner>,
    /// Wakes the timer task when the next wake-up time may have changed.
    changed: Notify,
}

/// The daemon's handle on one GPU's scheduler (cheap to clone).
#[derive(Debug, Clone)]
pub(crate) struct SchedulerHandle(Arc<Shared>);

impl SchedulerHandle {
    /// A scheduler for the GPU `uuid`.
    pub(crate) fn new(uuid: String, params: SchedulerParams) -> Self {
        Self(Arc::new(Shared {
            uuid,
            inner: Mutex::new(Inner {
                sched: GpuScheduler::new(params),
                pending: HashMap::new(),
                holders: HashMap::new(),
            }),
            changed: Notify::new(),
        }))
    }

    /// The GPU's UUID.
    pub(crate) fn uuid(&self) -> &str {
        &self.0.uuid
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.0.inner.lock()
    }

    fn apply(&self, now: u64, f: impl FnOnce(&mut GpuScheduler) -> Vec<Grant>) {
        let mut inner = self.lock();
        let grants = f(&mut inner.sched);
        inner.deliver(grants, now);
        drop(inner);
        self.0.changed.notify_one();
    }

    /// Registers an allocation.
    pub(crate) fn add_allocation(&self, key: AccountKey, share: u32, cap: Option<u32>, now: u64) {
        self.lock().sched.add_allocation(key, share, cap, now);
    }

    /// Sets a registered allocation's tier (see [`GpuScheduler::set_tier`]).
    pub(crate) fn set_tier(&self, key: AccountKey, tier: Tier) {
        // Registered just before by the caller: an unknown key cannot happen here.
        let _ = self.lock().sched.set_tier(key, tier);
    }

    /// Forgets an allocation.
    pub(crate) fn remove_allocation(&self, key: AccountKey, now: u64) {
        self.apply(now, |s| s.remove_allocation(key, now));
    }

    /// Asks for a lease; `sink` receives it when granted (possibly before this returns).
    pub(crate) fn acquire(
        &self,
        key: AccountKey,
        conn: ConnId,
        now: u64,
        sink: Arc<dyn GrantSink>,
    ) -> Result<(), SchedulerError> {
        let mut inner = self.lock();
        inner.pending.insert(conn, sink);
        match inner.sched.acquire(key, conn, now) {
            Ok(grants) => {
                inner.deliver(grants, now);
                drop(inner);
                self.0.changed.notify_one();
                Ok(())
            }
            Err(e) => {
                inner.pending.remove(&conn);
                Err(e)
            }
        }
    }

    /// Returns a lease.
    pub(crate) fn release(&self, conn: ConnId, lease_id: u64, busy_ns: u64, early: bool, now: u64) {
        self.apply(now, |s| s.release(conn, lease_id, busy_ns, early, now));
    }

    /// A connection closed.
    pub(crate) fn connection_closed(&self, conn: ConnId, now: u64) {
        let mut inner = self.lock();
        inner.pending.remove(&conn);
        inner.holders.remove(&conn);
        let grants = inner.sched.connection_closed(conn, now);
        inner.deliver(grants, now);
        drop(inner);
        self.0.changed.notify_one();
    }

    /// See [`GpuScheduler::leased_total`].
    pub(crate) fn leased_total(&self, key: AccountKey, now: u64) -> Option<(u64, bool)> {
        let s = self.lock();
        Some((s.sched.leased_total(key, now)?, s.sched.capped(key)))
    }

    /// See [`GpuScheduler::refund_cap`].
    pub(crate) fn refund_cap(&self, key: AccountKey, ns: u64, now: u64) {
        self.apply(now, |s| {
            s.refund_cap(key, ns, now);
            Vec::new()
        });
    }

    /// See [`GpuScheduler::charge_unleased`].
    pub(crate) fn charge_unleased(&self, key: AccountKey, ns: u64, now: u64) {
        self.apply(now, |s| {
            s.charge_unleased(key, ns, now);
            Vec::new()
        });
    }

    /// See [`GpuScheduler::count_for_cap`].
    pub(crate) fn count_for_cap(&self, key: AccountKey, ns: u64, now: u64) {
        self.apply(now, |s| {
            s.count_for_cap(key, ns, now);
            Vec::new()
        });
    }

    /// GPU time charged to `key` over the last 10 s, ns.
    pub(crate) fn gpu_time_10s(&self, key: AccountKey, now: u64) -> u64 {
        self.lock().sched.gpu_time(key, now)
    }

    /// See [`GpuScheduler::alloc_stats`].
    pub(crate) fn alloc_stats(&self, key: AccountKey, now: u64) -> Option<AllocStats> {
        self.lock().sched.alloc_stats(key, now)
    }

    /// The GPU's busy total and the counters of `keys` (in order), under one lock.
    pub(crate) fn stats(&self, keys: &[AccountKey], now: u64) -> (u64, Vec<Option<AllocStats>>) {
        let inner = self.lock();
        let per = keys
            .iter()
            .map(|k| inner.sched.alloc_stats(*k, now))
            .collect();
        (inner.sched.busy_total(now), per)
    }

    /// Ticks the scheduler at `now`: revokes an overdue lease, delivers what becomes eligible,
    /// and says when to tick next (see [`GpuScheduler::next_wakeup`]).
    pub(super) fn tick(&self, now: u64) -> Option<u64> {
        let mut inner = self.lock();
        let grants = inner.sched.tick(now);
        inner.deliver(grants, now);
        inner.sched.next_wakeup(now)
    }

    /// Notified whenever the next wake-up time may have changed.
    pub(super) fn changed(&self) -> &Notify {
        &self.0.changed
    }
}
