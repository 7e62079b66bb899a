//! Compute sharing: per-GPU time-slice leases (the contract is in `notes/COMPUTE.md` and
//! `docs/arbiter.md`).
//!
//! [`GpuScheduler`] is pure (time is a parameter, in ns on any monotonic clock), so tests drive
//! it with a fake clock. [`SchedulerHandle`] wraps it for the daemon: a mutex, the senders
//! that wake tenant connections waiting for a grant, and a timer task that revokes overdue
//! leases and wakes capped waiters when their bucket has refilled.
//!
//! Policy:
//! - at most one lease per GPU at a time;
//! - waiting requests are served by weighted fair queueing on virtual time
//!   (`vtime += charged_ns / share`); an allocation that becomes active again starts at
//!   `max(own vtime, min vtime of the active ones)`, so it banks no credit while idle; all
//!   processes of an allocation share its vtime, cap and history;
//! - a capped allocation has a token bucket filled at `cap`% of wall time (depth
//!   [`SchedulerParams::bucket_depth_ns`]); it is eligible only while the bucket holds at least
//!   one minimal lease, even alone on the GPU;
//! - the charge of a lease is `max(reported busy_ns, wall time the lease was held)`: the GPU
//!   was reserved for the holder all that time, and a tenant cannot lower its charge by
//!   under-reporting;
//! - lease length adapts per allocation between `min_lease_ns` and `max_lease_ns`: halved after
//!   an early hand-back, grown by a quarter after a lease used to its end; while other
//!   allocations wait it is at most `contended_lease_ns` so the split stays fine-grained;
//! - a lease not released by its deadline plus `grace_ns` is revoked and charged in full; a
//!   closed connection releases its lease (charged the wall time held).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::ledger::{AccountKey, ConnId};

/// Errors of scheduler operations.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// The allocation is not known to this GPU's scheduler.
    #[error("allocation {0} is not scheduled on this GPU")]
    UnknownAllocation(AccountKey),
}

/// Tunables (defaults in [`SchedulerParams::default`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerParams {
    /// Shortest lease, ns.
    pub min_lease_ns: u64,
    /// Longest lease, ns.
    pub max_lease_ns: u64,
    /// First lease of an allocation, ns.
    pub initial_lease_ns: u64,
    /// Longest lease while another allocation waits, ns.
    pub contended_lease_ns: u64,
    /// Time after the deadline before a lease is revoked, ns.
    pub grace_ns: u64,
    /// Depth of a capped allocation's token bucket, ns.
    pub bucket_depth_ns: u64,
    /// Window of [`GpuScheduler::gpu_time`], ns.
    pub window_ns: u64,
}

impl Default for SchedulerParams {
    fn default() -> Self {
        const MS: u64 = 1_000_000;
        Self {
            min_lease_ns: 10 * MS,
            max_lease_ns: 100 * MS,
            initial_lease_ns: 20 * MS,
            contended_lease_ns: 20 * MS,
            grace_ns: 50 * MS,
            bucket_depth_ns: 20 * MS,
            window_ns: 10_000 * MS,
        }
    }
}

/// A lease handed to a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The connection that asked.
    pub conn: ConnId,
    /// Lease id, echoed by the tenant in `LeaseRelease`.
    pub lease_id: u64,
    /// Lease length, ns.
    pub duration_ns: u64,
}

#[derive(Debug)]
struct Alloc {
    share: u32,
    cap: Option<u32>,
    vtime: f64,
    /// Token bucket in ns of GPU time (capped allocations only); may go negative on overrun.
    bucket_ns: f64,
    bucket_at: u64,
    lease_ns: u64,
    /// (time charged, ns charged), oldest first.
    history: VecDeque<(u64, u64)>,
}

#[derive(Debug, Clone, Copy)]
struct Waiter {
    conn: ConnId,
    key: AccountKey,
}

#[derive(Debug, Clone, Copy)]
struct Lease {
    id: u64,
    conn: ConnId,
    key: AccountKey,
    granted_at: u64,
    duration_ns: u64,
}

/// Lease scheduler of one GPU. Pure: every method takes the current time.
#[derive(Debug)]
pub struct GpuScheduler {
    params: SchedulerParams,
    allocs: HashMap<AccountKey, Alloc>,
    /// Waiting requests in arrival order (ties in vtime go to the earliest).
    waiting: VecDeque<Waiter>,
    current: Option<Lease>,
    next_lease: u64,
}

impl GpuScheduler {
    /// An idle scheduler.
    pub fn new(params: SchedulerParams) -> Self {
        Self {
            params,
            allocs: HashMap::new(),
            waiting: VecDeque::new(),
            current: None,
            next_lease: 1,
        }
    }

    /// Registers an allocation (share 1..=100, cap percent).
    pub fn add_allocation(&mut self, key: AccountKey, share: u32, cap: Option<u32>, now: u64) {
        let depth = self.params.bucket_depth_ns as f64;
        self.allocs.insert(
            key,
            Alloc {
                share: share.max(1),
                cap,
                vtime: 0.0,
                bucket_ns: depth,
                bucket_at: now,
                lease_ns: self.params.initial_lease_ns,
                history: VecDeque::new(),
            },
        );
    }

    /// Forgets an allocation (its processes are gone); drops any waiter or lease it had.
    pub fn remove_allocation(&mut self, key: AccountKey, now: u64) -> Vec<Grant> {
        self.allocs.remove(&key);
        self.waiting.retain(|w| w.key != key);
        if self.current.is_some_and(|l| l.key == key) {
            self.current = None;
        }
        self.dispatch(now)
    }

    fn is_active(&self, key: AccountKey) -> bool {
        self.current.is_some_and(|l| l.key == key) || self.waiting.iter().any(|w| w.key == key)
    }

    /// A connection asks for a lease. Returns the grants this causes (possibly its own).
    pub fn acquire(
        &mut self,
        key: AccountKey,
        conn: ConnId,
        now: u64,
    ) -> Result<Vec<Grant>, SchedulerError> {
        if !self.allocs.contains_key(&key) {
            return Err(SchedulerError::UnknownAllocation(key));
        }
        // Asking again while holding a lease ends the old one (charged as held).
        if let Some(l) = self.current
            && l.conn == conn
        {
            self.end_lease(l, 0, false, now);
        }
        // A second request from the same connection replaces the first.
        self.waiting.retain(|w| w.conn != conn);
        if !self.is_active(key) {
            // Becoming active: no credit banked while idle.
            let floor = self
                .allocs
                .iter()
                .filter(|(k, _)| self.is_active(**k))
                .map(|(_, a)| a.vtime)
                .fold(f64::INFINITY, f64::min);
            let a = self.allocs.get_mut(&key).expect("checked above");
            if floor.is_finite() && floor > a.vtime {
                a.vtime = floor;
            }
        }
        self.waiting.push_back(Waiter { conn, key });
        Ok(self.dispatch(now))
    }

    /// The holder returns its lease. A stale or foreign lease id is ignored.
    pub fn release(
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
                self.dispatch(now)
            }
            _ => Vec::new(),
        }
    }

    /// A connection closed: its waiter is dropped and its lease released.
    pub fn connection_closed(&mut self, conn: ConnId, now: u64) -> Vec<Grant> {
        self.waiting.retain(|w| w.conn != conn);
        if let Some(l) = self.current
            && l.conn == conn
        {
            self.end_lease(l, 0, false, now);
        }
        self.dispatch(now)
    }

    /// Revokes an overdue lease and grants what has become eligible.
    pub fn tick(&mut self, now: u64) -> Vec<Grant> {
        if let Some(l) = self.current
            && now >= l.granted_at + l.duration_ns + self.params.grace_ns
        {
            self.end_lease(l, 0, false, now);
        }
        self.dispatch(now)
    }

    /// When [`tick`](Self::tick) must next run: the revocation time of the current lease, or
    /// the time the first capped waiter becomes eligible when the GPU is free.
    pub fn next_wakeup(&self, now: u64) -> Option<u64> {
        if let Some(l) = self.current {
            return Some(l.granted_at + l.duration_ns + self.params.grace_ns);
        }
        let need = self.threshold() as f64;
        self.waiting
            .iter()
            .filter_map(|w| {
                let a = self.allocs.get(&w.key)?;
                let cap = a.cap?;
                let have = self.bucket(a, now);
                let missing = need - have;
                Some(if missing <= 0.0 {
                    now
                } else {
                    now + (missing * 100.0 / f64::from(cap)).ceil() as u64
                })
            })
            .min()
    }

    /// GPU time charged to `key` over the last window, ns.
    pub fn gpu_time(&mut self, key: AccountKey, now: u64) -> u64 {
        let window = self.params.window_ns;
        match self.allocs.get_mut(&key) {
            Some(a) => {
                prune(&mut a.history, now, window);
                a.history.iter().map(|(_, ns)| ns).sum()
            }
            None => 0,
        }
    }

    /// The lease outstanding, as (connection, lease id).
    pub fn current(&self) -> Option<(ConnId, u64)> {
        self.current.map(|l| (l.conn, l.id))
    }

    /// Number of waiting requests.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    fn threshold(&self) -> u64 {
        self.params.min_lease_ns.min(self.params.bucket_depth_ns)
    }

    fn bucket(&self, a: &Alloc, now: u64) -> f64 {
        match a.cap {
            None => f64::INFINITY,
            Some(cap) => {
                let filled = (now.saturating_sub(a.bucket_at)) as f64 * f64::from(cap) / 100.0;
                (a.bucket_ns + filled).min(self.params.bucket_depth_ns as f64)
            }
        }
    }

    fn end_lease(&mut self, l: Lease, busy_ns: u64, early: bool, now: u64) {
        self.current = None;
        let held = now.saturating_sub(l.granted_at);
        let charged = busy_ns.max(held);
        let p = self.params;
        let bucket = self.allocs.get(&l.key).map(|a| self.bucket(a, now));
        let Some(a) = self.allocs.get_mut(&l.key) else {
            return;
        };
        a.vtime += charged as f64 / f64::from(a.share);
        if let Some(b) = bucket
            && a.cap.is_some()
        {
            a.bucket_ns = b - charged as f64;
            a.bucket_at = now;
        }
        a.lease_ns = if early {
            (a.lease_ns / 2).max(p.min_lease_ns)
        } else if held >= l.duration_ns {
            (a.lease_ns + a.lease_ns / 4).min(p.max_lease_ns)
        } else {
            a.lease_ns
        };
        a.history.push_back((now, charged));
        prune(&mut a.history, now, p.window_ns);
    }

    fn dispatch(&mut self, now: u64) -> Vec<Grant> {
        if self.current.is_some() {
            return Vec::new();
        }
        let need = self.threshold() as f64;
        let mut best: Option<(usize, f64)> = None;
        for (i, w) in self.waiting.iter().enumerate() {
            let Some(a) = self.allocs.get(&w.key) else {
                continue;
            };
            if self.bucket(a, now) < need {
                continue;
            }
            if best.is_none_or(|(_, v)| a.vtime < v) {
                best = Some((i, a.vtime));
            }
        }
        let Some((i, _)) = best else {
            return Vec::new();
        };
        let w = self.waiting.remove(i).expect("index from the scan");
        let a = &self.allocs[&w.key];
        let mut duration = a.lease_ns;
        if self.waiting.iter().any(|o| o.key != w.key) {
            duration = duration.min(self.params.contended_lease_ns);
        }
        if a.cap.is_some() {
            duration = duration
                .min(self.bucket(a, now) as u64)
                .max(self.params.min_lease_ns.min(duration));
        }
        let id = self.next_lease;
        self.next_lease += 1;
        self.current = Some(Lease {
            id,
            conn: w.conn,
            key: w.key,
            granted_at: now,
            duration_ns: duration,
        });
        vec![Grant {
            conn: w.conn,
            lease_id: id,
            duration_ns: duration,
        }]
    }
}

fn prune(history: &mut VecDeque<(u64, u64)>, now: u64, window: u64) {
    while history
        .front()
        .is_some_and(|(t, _)| now.saturating_sub(*t) > window)
    {
        history.pop_front();
    }
}

/// Where a grant goes: the waiting connection. Called with the scheduler locked, so it must
/// not block (the tenant connection writes the reply with a non-blocking send).
pub trait GrantSink: Send + Sync {
    /// Delivers the grant; false when the connection cannot take it (it is then treated as
    /// closed and its lease given to the next waiter).
    fn grant(&self, grant: Grant) -> bool;
}

struct Inner {
    sched: GpuScheduler,
    /// Connections waiting for a grant.
    pending: HashMap<ConnId, Arc<dyn GrantSink>>,
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
        while let Some(g) = grants.pop() {
            let delivered = self
                .pending
                .remove(&g.conn)
                .is_some_and(|sink| sink.grant(g));
            if !delivered {
                grants.extend(self.sched.connection_closed(g.conn, now));
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
pub struct SchedulerHandle(Arc<Shared>);

impl SchedulerHandle {
    /// A scheduler for the GPU `uuid`.
    pub fn new(uuid: String, params: SchedulerParams) -> Self {
        Self(Arc::new(Shared {
            uuid,
            inner: Mutex::new(Inner {
                sched: GpuScheduler::new(params),
                pending: HashMap::new(),
            }),
            changed: Notify::new(),
        }))
    }

    /// The GPU's UUID.
    pub fn uuid(&self) -> &str {
        &self.0.uuid
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.0.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn apply(&self, now: u64, f: impl FnOnce(&mut GpuScheduler) -> Vec<Grant>) {
        let mut inner = self.lock();
        let grants = f(&mut inner.sched);
        inner.deliver(grants, now);
        drop(inner);
        self.0.changed.notify_one();
    }

    /// Registers an allocation.
    pub fn add_allocation(&self, key: AccountKey, share: u32, cap: Option<u32>, now: u64) {
        self.lock().sched.add_allocation(key, share, cap, now);
    }

    /// Forgets an allocation.
    pub fn remove_allocation(&self, key: AccountKey, now: u64) {
        self.apply(now, |s| s.remove_allocation(key, now));
    }

    /// Asks for a lease; `sink` receives it when granted (possibly before this returns).
    pub fn acquire(
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
    pub fn release(&self, conn: ConnId, lease_id: u64, busy_ns: u64, early: bool, now: u64) {
        self.apply(now, |s| s.release(conn, lease_id, busy_ns, early, now));
    }

    /// A connection closed.
    pub fn connection_closed(&self, conn: ConnId, now: u64) {
        let mut inner = self.lock();
        inner.pending.remove(&conn);
        let grants = inner.sched.connection_closed(conn, now);
        inner.deliver(grants, now);
        drop(inner);
        self.0.changed.notify_one();
    }

    /// GPU time charged to `key` over the last 10 s, ns.
    pub fn gpu_time_10s(&self, key: AccountKey, now: u64) -> u64 {
        self.lock().sched.gpu_time(key, now)
    }

    /// Revokes overdue leases and wakes capped waiters on time; runs until the task is
    /// dropped. `epoch` is the origin of the `now` values given to the other methods.
    pub async fn run_timer(self, epoch: Instant) {
        loop {
            let now = epoch.elapsed().as_nanos() as u64;
            let wake = {
                let mut inner = self.lock();
                let grants = inner.sched.tick(now);
                inner.deliver(grants, now);
                inner.sched.next_wakeup(now)
            };
            match wake {
                Some(at) => {
                    // One extra microsecond so float rounding cannot make a busy loop.
                    let deadline = epoch + Duration::from_nanos(at + 1_000);
                    tokio::select! {
                        _ = tokio::time::sleep_until(deadline.into()) => {}
                        _ = self.0.changed.notified() => {}
                    }
                }
                None => self.0.changed.notified().await,
            }
        }
    }
}
