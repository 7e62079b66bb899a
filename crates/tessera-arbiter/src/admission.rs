//! Admission before cost: a connection gets a thread and a frame buffer only once its `Hello`
//! has been accepted, and a flood costs its sender, not its neighbours.
//!
//! The tenant socket is mode 0666 and mounted into every pod, so any local process can
//! connect. A new connection is first counted as *pending* (its handshake has not finished):
//! globally, per pod (the peer's pod-level cgroup from `/proc/<pid>/cgroup`, [`group`]; one
//! shared unknown group where that cannot be read) and per pid (`SO_PEERCRED`). Over the
//! per-pid cap it is closed at once. Over its pod's handshake budget ([`budget`]: a token bucket
//! per pod, so that a pod's flood, whose evicted connections come straight back, costs the
//! arbiter's time only up to that pod's rate) it is held unread until its deadline and then
//! closed ([`park`]: a closed flood connection would come straight back, through the listen
//! queue every pod shares). Over
//! the per-container or the global cap it is let in and the oldest pending connection of that
//! container (globally: of the container with the most pending) is dropped instead: an honest
//! handshake takes microseconds, so the oldest pending connection is a flooder's, and a flood
//! can keep its own connections waiting but never a neighbour's out. Each pending handshake
//! runs as a small task on the runtime: the `Hello` is read into a fixed
//! [`crate::wire::HELLO_FRAME_LIMIT`]-byte buffer under one deadline for the whole handshake, so
//! a token-less connection costs at most one slot until that deadline.
//!
//! A tenant whose token is good is then counted against the caps on admitted connections: per
//! allocation, and in total with room guaranteed to every allocation. The first
//! [`Limits::guaranteed`] connections of an allocation are always admitted; beyond those,
//! connections come from a shared pool of `admitted - guaranteed x allocations` places (and
//! at most [`Limits::per_allocation`] per allocation), so a few allocations can fill the pool
//! but never the room of the others. A [`Role::Companion`] (an admitted process's lease
//! connection, proven by a ticket from its memory connection) meets none of these caps again:
//! a pid with an admitted connection has [`COMPANION_PENDING`] pending places of its own, and
//! each memory connection at most [`COMPANIONS_PER_CONNECTION`] companions.
//!
//! Admitted connections go to whatever the server gave [`accept_tenant`] (the tenant service:
//! a thread each). Every refusal is
//! counted ([`Admission::counts`]); a summary is logged at most once per second
//! ([`Admission::report`]), and individual handshake failures at most
//! [`FAILURE_LINES_PER_SEC`] lines per second.

#![forbid(unsafe_code)]

// `admission.rs` stays the module's root file (not `admission/mod.rs`): the tenant handshake
// below is being edited alongside; the new concerns live in files of their own.
pub(crate) mod budget;
pub(crate) mod group;
pub(crate) mod park;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tessera_protocol::{
    COMPANIONS_PER_CONNECTION, PROTOCOL_VERSION, RefusalKind, Role, ServerHello,
};
use tokio::net::UnixStream;
use tokio::sync::Notify;

use crate::ledger::{AccountKey, ConnId};
use crate::peer::ProcId;
use crate::state::{Arbiter, TenantBinding};
use crate::wire::{self, WireError};

pub(crate) use budget::BudgetParams;
use budget::Budgets;
pub(crate) use group::Group;
use group::ProcCgroups;
use park::Parked;
pub(crate) use park::ParkedSlot;

/// Handshake failures logged one by one per second; the rest are only counted.
pub(crate) const FAILURE_LINES_PER_SEC: u32 = 20;

/// Pending places of its own a pid with an admitted connection has (for its companions), so
/// a flood from its container cannot keep its lease connection out.
pub(crate) const COMPANION_PENDING: usize = 4;

/// The caps and the handshake deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Deadline for a connection's whole handshake.
    pub handshake_timeout: Duration,
    /// Connections that have not finished their handshake, all peers together.
    pub pending: usize,
    /// Connections that have not finished their handshake, per container (cgroup; uid when
    /// the cgroup cannot be read).
    pub pending_per_group: usize,
    /// Connections that have not finished their handshake, per peer pid.
    pub pending_per_pid: usize,
    /// Admitted tenant connections per allocation.
    pub per_allocation: usize,
    /// Admitted tenant connections in total (each has a thread), guaranteed places included
    /// (more when `guaranteed x allocations` exceeds it).
    pub admitted: usize,
    /// Admitted connections every allocation may always have, whatever the others hold.
    pub guaranteed: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            handshake_timeout: wire::HANDSHAKE_TIMEOUT,
            pending: 256,
            pending_per_group: 128,
            pending_per_pid: 32,
            per_allocation: 1024,
            admitted: 4096,
            guaranteed: 16,
        }
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AdmissionError {
    /// Too many connections without a finished handshake from this pid.
    #[error("arbiter busy: {0} connections of this process are waiting for their handshake")]
    PendingPid(usize),
    /// The allocation has its cap of connections.
    #[error("the allocation already has {0} connections")]
    Allocation(usize),
    /// The shared pool is full and the allocation has used its guaranteed places.
    #[error(
        "the arbiter already serves {0} tenant connections (this allocation has its {1} guaranteed)"
    )]
    Admitted(usize, usize),
    /// The memory connection already has its companions.
    #[error("the process already has {0} lease connections")]
    Companions(usize),
}

/// Refusals and failures since start.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Pending connections dropped for a newer one: the global cap.
    pub evicted_pending: u64,
    /// Pending connections dropped for a newer one of their container: the per-container cap.
    pub evicted_group: u64,
    /// Closed at accept: the per-pid cap.
    pub refused_pid: u64,
    /// Failed or evicted handshakes held until their deadline: their pod had spent its
    /// budget of closes.
    pub held_budget: u64,
    /// Refused after a good hello: the per-allocation cap.
    pub refused_allocation: u64,
    /// Refused after a good hello: the shared pool.
    pub refused_admitted: u64,
    /// Handshakes that failed (deadline, bad frame, magic, version, role, token or ticket).
    pub failed: u64,
    /// Connections admitted (companions included).
    pub admitted: u64,
}

/// How a pending connection learns that a newer one took its place.
#[derive(Debug, Default)]
struct Evict {
    notify: Notify,
    /// Set (under the pending lock) once it was dropped from the counts.
    evicted: AtomicBool,
}

#[derive(Debug)]
struct Entry {
    seq: u64,
    pid: Option<i32>,
    evict: Arc<Evict>,
}

#[derive(Debug)]
struct Pending {
    total: usize,
    /// Per container, oldest first.
    by_group: HashMap<Group, VecDeque<Entry>>,
    by_pid: HashMap<i32, usize>,
    /// Companion places in use per pid.
    companions: HashMap<i32, usize>,
    seq: u64,
    /// Each pod's handshake budget (under the same lock: one decision per connection).
    budgets: Budgets,
    /// Connections over their pod's budget held until their deadline.
    parked: Parked,
}

impl Pending {
    fn new(budget: BudgetParams) -> Self {
        Self {
            total: 0,
            by_group: HashMap::new(),
            by_pid: HashMap::new(),
            companions: HashMap::new(),
            seq: 0,
            budgets: Budgets::new(budget),
            parked: Parked::default(),
        }
    }

    /// Drops the oldest pending connection of `group` from the counts and tells it to close.
    fn evict_oldest(&mut self, group: &Group) -> bool {
        let Some(q) = self.by_group.get_mut(group) else {
            return false;
        };
        let Some(e) = q.pop_front() else {
            return false;
        };
        if q.is_empty() {
            self.by_group.remove(group);
        }
        self.total -= 1;
        if let Some(pid) = e.pid {
            release(&mut self.by_pid, pid);
        }
        e.evict.evicted.store(true, Ordering::Release);
        e.evict.notify.notify_one();
        true
    }

    /// The container with the most pending connections; of several, the one whose oldest
    /// pending connection is oldest (a flood's, not a newcomer's: the map's order is arbitrary).
    fn largest(&self) -> Option<Group> {
        self.by_group
            .iter()
            .max_by_key(|(_, q)| (q.len(), std::cmp::Reverse(q.front().map_or(0, |e| e.seq))))
            .map(|(g, _)| g.clone())
    }
}

#[derive(Debug, Default)]
struct Admitted {
    /// Counted connections (companions are not).
    total: usize,
    /// Counted connections beyond their allocation's guaranteed places.
    pooled: usize,
    by_account: HashMap<AccountKey, usize>,
    /// Pids with counted connections (their companions get pending places of their own).
    by_pid: HashMap<i32, usize>,
    /// Companions per memory connection.
    companions: HashMap<ConnId, usize>,
}

#[derive(Debug)]
struct LogWindow {
    start: Instant,
    lines: u32,
    suppressed: u64,
}

/// The caps of one socket and their counters.
#[derive(Debug)]
pub(crate) struct Admission {
    limits: Limits,
    pending: Mutex<Pending>,
    admitted: Mutex<Admitted>,
    evicted_pending: AtomicU64,
    evicted_group: AtomicU64,
    refused_pid: AtomicU64,
    held_budget: AtomicU64,
    refused_allocation: AtomicU64,
    refused_admitted: AtomicU64,
    failed: AtomicU64,
    admitted_count: AtomicU64,
    log: Mutex<LogWindow>,
}

/// Decrements a per-peer count, dropping the entry at zero (the maps hold live peers only).
fn release<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, k: K) {
    if let Some(n) = map.get_mut(&k) {
        *n -= 1;
        if *n == 0 {
            map.remove(&k);
        }
    }
}

#[derive(Debug)]
enum PendingKind {
    /// Counted in the caps, in `group`'s queue under `seq`.
    Counted { group: Group, seq: u64 },
    /// A companion place of `pid`.
    Companion(i32),
}

/// A connection counted as pending until its handshake ends (dropped).
#[derive(Debug)]
pub(crate) struct PendingSlot {
    adm: Arc<Admission>,
    pid: Option<i32>,
    kind: PendingKind,
    evict: Arc<Evict>,
}

impl PendingSlot {
    /// Resolves once a newer connection took this one's place (it is then no longer counted).
    pub(crate) async fn evicted(&self) {
        self.evict.notify.notified().await;
    }
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut p = self.adm.pending.lock();
        match &self.kind {
            PendingKind::Companion(pid) => release(&mut p.companions, *pid),
            PendingKind::Counted { group, seq } => {
                if self.evict.evicted.load(Ordering::Acquire) {
                    return;
                }
                if let Some(q) = p.by_group.get_mut(group) {
                    q.retain(|e| e.seq != *seq);
                    if q.is_empty() {
                        p.by_group.remove(group);
                    }
                }
                p.total -= 1;
                if let Some(pid) = self.pid {
                    release(&mut p.by_pid, pid);
                }
            }
        }
    }
}

#[derive(Debug)]
enum SlotKind {
    Counted { key: AccountKey, pid: Option<i32> },
    Companion { mem: ConnId },
}

/// An admitted tenant connection, counted until its thread ends (dropped).
#[derive(Debug)]
pub(crate) struct TenantSlot {
    adm: Arc<Admission>,
    kind: SlotKind,
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut a = self.adm.admitted.lock();
        match self.kind {
            SlotKind::Counted { key, pid } => {
                let n = a.by_account.get(&key).copied().unwrap_or(0);
                if n > self.adm.limits.guaranteed {
                    a.pooled -= 1;
                }
                a.total -= 1;
                release(&mut a.by_account, key);
                if let Some(pid) = pid {
                    release(&mut a.by_pid, pid);
                }
            }
            SlotKind::Companion { mem } => release(&mut a.companions, mem),
        }
    }
}

impl Admission {
    /// Caps `limits` and the default handshake budget, nothing counted yet.
    pub(crate) fn new(limits: Limits) -> Arc<Self> {
        Self::with_budget(limits, BudgetParams::default())
    }

    /// Caps `limits`, each pod's handshake budget `budget`, nothing counted yet.
    pub(crate) fn with_budget(limits: Limits, budget: BudgetParams) -> Arc<Self> {
        Arc::new(Self {
            limits,
            pending: Mutex::new(Pending::new(budget)),
            admitted: Mutex::default(),
            evicted_pending: AtomicU64::new(0),
            evicted_group: AtomicU64::new(0),
            refused_pid: AtomicU64::new(0),
            held_budget: AtomicU64::new(0),
            refused_allocation: AtomicU64::new(0),
            refused_admitted: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            admitted_count: AtomicU64::new(0),
            log: Mutex::new(LogWindow {
                start: Instant::now(),
                lines: 0,
                suppressed: 0,
            }),
        })
    }

    /// The caps.
    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Spends one close from `group`'s budget at time `now` (tests pass a fake clock): true
    /// while the pod is within it (the failed or evicted connection is closed at once), false
    /// past it (the connection is held until its deadline, [`park`]; counted).
    pub(crate) fn spend(&self, group: &Group, now: Instant) -> bool {
        let within = self.pending.lock().budgets.take(group, now);
        if !within {
            self.held_budget.fetch_add(1, Ordering::Relaxed);
        }
        within
    }

    /// Counts a new connection of peer `pid` in `group` as pending, or refuses it (the
    /// per-pid cap; counted). Where the container's or the global cap is reached, the oldest
    /// pending connection of the container (globally: of the fullest container) is dropped in
    /// its favour. A pid with an admitted connection first uses its companion places.
    pub(crate) fn begin(
        self: &Arc<Self>,
        group: Group,
        pid: Option<i32>,
    ) -> Result<PendingSlot, AdmissionError> {
        let l = &self.limits;
        let admitted_pid = pid.filter(|p| self.admitted.lock().by_pid.contains_key(p));
        let mut p = self.pending.lock();
        let evict = Arc::new(Evict::default());
        if let Some(pid) = admitted_pid {
            let n = p.companions.entry(pid).or_insert(0);
            if *n < COMPANION_PENDING {
                *n += 1;
                return Ok(PendingSlot {
                    adm: Arc::clone(self),
                    pid: Some(pid),
                    kind: PendingKind::Companion(pid),
                    evict,
                });
            }
        }
        if pid.is_some_and(|q| p.by_pid.get(&q).is_some_and(|&n| n >= l.pending_per_pid)) {
            self.refused_pid.fetch_add(1, Ordering::Relaxed);
            return Err(AdmissionError::PendingPid(l.pending_per_pid));
        }
        if p.by_group
            .get(&group)
            .is_some_and(|q| q.len() >= l.pending_per_group)
        {
            p.evict_oldest(&group);
            self.evicted_group.fetch_add(1, Ordering::Relaxed);
        } else if p.total >= l.pending
            && let Some(fullest) = p.largest()
        {
            p.evict_oldest(&fullest);
            self.evicted_pending.fetch_add(1, Ordering::Relaxed);
        }
        p.seq += 1;
        let seq = p.seq;
        p.total += 1;
        if let Some(pid) = pid {
            *p.by_pid.entry(pid).or_insert(0) += 1;
        }
        p.by_group
            .entry(group.clone())
            .or_default()
            .push_back(Entry {
                seq,
                pid,
                evict: Arc::clone(&evict),
            });
        Ok(PendingSlot {
            adm: Arc::clone(self),
            pid,
            kind: PendingKind::Counted { group, seq },
            evict,
        })
    }

    /// Holds a connection of `group` refused for its pod's budget ([`park`]), or `None` when
    /// the pod (the pending cap per container) or everyone (the global pending cap) already
    /// has that many held: it is then closed at once.
    pub(crate) fn park(self: &Arc<Self>, group: &Group) -> Option<ParkedSlot> {
        let l = &self.limits;
        let counted = self
            .pending
            .lock()
            .parked
            .add(group, l.pending_per_group, l.pending);
        counted.then(|| ParkedSlot::new(Arc::clone(self), group.clone()))
    }

    /// Connections held for their pod's budget now.
    #[cfg(test)]
    pub(crate) fn parked(&self) -> usize {
        self.pending.lock().parked.total()
    }

    pub(crate) fn unpark(&self, group: &Group) {
        self.pending.lock().parked.remove(group);
    }

    /// Counts an admitted connection of allocation `key` from `pid` while the arbiter holds
    /// `allocations` allocations, or says which cap refuses it (the refusal is counted).
    pub(crate) fn admit(
        self: &Arc<Self>,
        key: AccountKey,
        pid: Option<i32>,
        allocations: usize,
    ) -> Result<TenantSlot, AdmissionError> {
        let l = &self.limits;
        let mut a = self.admitted.lock();
        let n = a.by_account.get(&key).copied().unwrap_or(0);
        if n >= l.per_allocation {
            self.refused_allocation.fetch_add(1, Ordering::Relaxed);
            return Err(AdmissionError::Allocation(n));
        }
        if n >= l.guaranteed {
            let pool = l
                .admitted
                .saturating_sub(l.guaranteed.saturating_mul(allocations));
            if a.pooled >= pool {
                self.refused_admitted.fetch_add(1, Ordering::Relaxed);
                return Err(AdmissionError::Admitted(a.total, l.guaranteed));
            }
            a.pooled += 1;
        }
        *a.by_account.entry(key).or_insert(0) += 1;
        a.total += 1;
        if let Some(pid) = pid {
            *a.by_pid.entry(pid).or_insert(0) += 1;
        }
        self.admitted_count.fetch_add(1, Ordering::Relaxed);
        Ok(TenantSlot {
            adm: Arc::clone(self),
            kind: SlotKind::Counted { key, pid },
        })
    }

    /// Counts a companion of memory connection `mem` (outside the caps), or refuses it when
    /// `mem` already has [`COMPANIONS_PER_CONNECTION`].
    pub(crate) fn admit_companion(
        self: &Arc<Self>,
        mem: ConnId,
    ) -> Result<TenantSlot, AdmissionError> {
        let mut a = self.admitted.lock();
        let n = a.companions.entry(mem).or_insert(0);
        if *n >= COMPANIONS_PER_CONNECTION {
            return Err(AdmissionError::Companions(*n));
        }
        *n += 1;
        self.admitted_count.fetch_add(1, Ordering::Relaxed);
        Ok(TenantSlot {
            adm: Arc::clone(self),
            kind: SlotKind::Companion { mem },
        })
    }

    /// Connections now pending and admitted (counted ones; companions are not).
    pub(crate) fn current(&self) -> (usize, usize) {
        (self.pending.lock().total, self.admitted.lock().total)
    }

    /// Refusals and failures since start.
    pub(crate) fn counts(&self) -> Counts {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counts {
            evicted_pending: get(&self.evicted_pending),
            evicted_group: get(&self.evicted_group),
            refused_pid: get(&self.refused_pid),
            held_budget: get(&self.held_budget),
            refused_allocation: get(&self.refused_allocation),
            refused_admitted: get(&self.refused_admitted),
            failed: get(&self.failed),
            admitted: get(&self.admitted_count),
        }
    }

    /// Counts a failed handshake and logs it, unless this second already had
    /// [`FAILURE_LINES_PER_SEC`] lines (a flood must not turn into a flood of log lines).
    pub(crate) fn failed(&self, who: &str, e: &WireError) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let mut w = self.log.lock();
        if w.start.elapsed() >= Duration::from_secs(1) {
            w.start = Instant::now();
            w.lines = 0;
        }
        if w.lines < FAILURE_LINES_PER_SEC {
            w.lines += 1;
            drop(w);
            tracing::info!("{who}: closed at handshake: {e}");
        } else {
            w.suppressed += 1;
        }
    }

    /// Logs, once per `every`, what was refused or failed since the last line (nothing when
    /// nothing was). Runs until aborted.
    pub(crate) async fn report(self: Arc<Self>, socket: &'static str, every: Duration) {
        let mut last = self.counts();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = self.counts();
            let refused = |c: &Counts| {
                c.evicted_pending
                    + c.evicted_group
                    + c.refused_pid
                    + c.held_budget
                    + c.refused_allocation
                    + c.refused_admitted
            };
            if refused(&now) == refused(&last) && now.failed == last.failed {
                continue;
            }
            let suppressed = std::mem::take(&mut self.log.lock().suppressed);
            let (pending, admitted) = self.current();
            tracing::warn!(
                "admission on the {socket} socket: {} refused or evicted, {} failed handshakes \
                 ({suppressed} not logged) since the last report; totals: evicted pending {} \
                 group {}, refused pid {} budget {} allocation {} admitted {}, failed {}; now \
                 {pending} pending, {admitted} admitted",
                refused(&now) - refused(&last),
                now.failed - last.failed,
                now.evicted_pending,
                now.evicted_group,
                now.refused_pid,
                now.held_budget,
                now.refused_allocation,
                now.refused_admitted,
                now.failed,
            );
            last = now;
        }
    }
}

/// The peer's uid and pid from `SO_PEERCRED`.
pub(crate) fn peer(stream: &UnixStream) -> (Option<u32>, Option<i32>) {
    match stream.peer_cred() {
        Ok(c) => (Some(c.uid()), c.pid()),
        Err(_) => (None, None),
    }
}

/// The peer's group (its pod, read from the host's `/proc`, never from what it sends) and pid.
pub(crate) fn peer_group(stream: &UnixStream) -> (Group, Option<i32>) {
    let (_, pid) = peer(stream);
    (group::group_of(&ProcCgroups::host(), pid), pid)
}

/// Reads a `Hello` under the handshake deadline, or gives up once `slot` was evicted (a newer
/// connection of its container took its place): `None` then.
pub(crate) async fn read_hello_or_evicted<R: tokio::io::AsyncRead + Unpin>(
    stream: &mut R,
    slot: &PendingSlot,
    timeout: Duration,
) -> Option<Result<Role, WireError>> {
    tokio::select! {
        r = wire::read_hello(stream, timeout) => Some(r),
        () = slot.evicted() => None,
    }
}

/// Answers a refused connection without ever waiting: one non-blocking write of a small frame
/// into a socket nobody has written to yet (so it fits), then the caller closes it.
///
/// The hello was read and is of this protocol version (a client of another version gets
/// [`refuse_version_now`]), so the refusal carries its kind.
pub(crate) fn refuse_now(stream: &UnixStream, kind: RefusalKind, reason: &str) {
    send_now(
        stream,
        &ServerHello::refusal(kind, reason, PROTOCOL_VERSION),
    );
}

/// Answers a client of another protocol version, in the form every version reads.
pub(crate) fn refuse_version_now(stream: &UnixStream, client_version: u32, reason: &str) {
    let msg = ServerHello::refusal(RefusalKind::Version, reason, client_version);
    send_now(stream, &msg);
}

fn send_now(stream: &UnixStream, msg: &ServerHello) {
    let mut out = Vec::new();
    if wire::push_frame(&mut out, msg).is_ok() {
        let _ = stream.try_write(&out);
    }
}

/// Reads, without waiting, what a peer whose handshake failed already sent, up to one hello's
/// worth: a socket closed with unread bytes resets the peer's next read, and a client that sent
/// a little junk should see a plain close.
pub(crate) fn drain_a_little(stream: &UnixStream) {
    let mut buf = [0u8; wire::HELLO_FRAME_LIMIT];
    let _ = stream.try_read(&mut buf);
}

/// Closes a connection refused at accept: no task, no thread, no answer. Without a `Refused`
/// frame a client takes it for an arbiter that is not there yet and retries with its backoff
/// (the interposer's `Refused` handling is for a bad token, and pauses much longer).
pub(crate) fn close_refused(stream: UnixStream) {
    drop(stream);
}

/// A new connection on an admin-protocol socket (admin, user): counted as pending (or closed
/// at once over the caps), then `serve(stream, slot, handshake deadline)` runs on the runtime;
/// the slot is released when the handshake ends.
pub(crate) fn accept_pending<F, Fut>(adm: &Arc<Admission>, stream: UnixStream, serve: F)
where
    F: FnOnce(UnixStream, PendingSlot, Duration) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (group, pid) = peer_group(&stream);
    match adm.begin(group, pid) {
        Ok(slot) => {
            tokio::spawn(serve(stream, slot, adm.limits.handshake_timeout));
        }
        Err(_) => close_refused(stream),
    }
}

/// An admitted tenant connection, handed to the tenant service ([`accept_tenant`]'s
/// `on_admitted`, which the server passes: admission knows nothing of what serves it).
#[derive(Debug)]
pub(crate) struct AdmittedTenant {
    /// The shared state.
    pub arb: Arc<Arbiter>,
    /// The connection, its handshake done.
    pub stream: UnixStream,
    /// Its id.
    pub conn: ConnId,
    /// The process that connected.
    pub proc: Option<ProcId>,
    /// What it is attached to.
    pub binding: TenantBinding,
    /// Its admitted place (freed when dropped).
    pub slot: TenantSlot,
}

/// A new tenant connection: counts it as pending (or closes it at once), runs its handshake
/// on the runtime, and hands it to `on_admitted` once admitted (an error there detaches it).
pub(crate) fn accept_tenant<E: std::fmt::Display + 'static>(
    arb: Arc<Arbiter>,
    adm: &Arc<Admission>,
    stream: UnixStream,
    on_admitted: fn(AdmittedTenant) -> Result<(), E>,
) {
    let (group, pid) = peer_group(&stream);
    match adm.begin(group.clone(), pid) {
        Ok(slot) => {
            // Named now, by the connection itself: the process that connected, not a later
            // holder of its pid.
            let peer = pid.and_then(|p| {
                use std::os::fd::AsFd;
                crate::peer::peer_process(stream.as_fd(), p)
            });
            tokio::spawn(tenant_handshake(
                arb,
                Arc::clone(adm),
                stream,
                (slot, group),
                pid,
                peer,
                on_admitted,
            ));
        }
        Err(_) => close_refused(stream),
    }
}

async fn tenant_handshake<E: std::fmt::Display>(
    arb: Arc<Arbiter>,
    adm: Arc<Admission>,
    mut stream: UnixStream,
    (slot, group): (PendingSlot, Group),
    pid: Option<i32>,
    peer: Option<crate::peer::Peer>,
    on_admitted: fn(AdmittedTenant) -> Result<(), E>,
) {
    let proc = peer.as_ref().map(|p| p.id);
    let who = match pid {
        Some(p) => format!("tenant connection of pid {p}"),
        None => "tenant connection".to_owned(),
    };
    let hello = read_hello_or_evicted(&mut stream, &slot, adm.limits.handshake_timeout).await;
    let Some(hello) = hello else {
        // A newer connection of its container took its place: closed without an answer
        // (or held, past the pod's budget).
        return park::close_or_hold(&adm, stream, slot, &group).await;
    };
    let role = match hello {
        Ok(r) => r,
        Err(e) => {
            drain_a_little(&stream);
            if let WireError::BadVersion(v) = e {
                refuse_version_now(&stream, v, &e.to_string());
            }
            adm.failed(&who, &e);
            return park::close_or_hold(&adm, stream, slot, &group).await;
        }
    };
    let (token, ticket) = match role {
        Role::Tenant { token } => (token, None),
        Role::Companion { token, ticket } => (token, Some(ticket)),
        Role::Probe => {
            // `tessera doctor`: no failed handshake, so no warning in the log.
            let probed = ServerHello::Probed {
                version: PROTOCOL_VERSION,
                socket: tessera_protocol::SocketKind::Tenant,
            };
            send_now(&stream, &probed);
            return;
        }
        Role::Admin => {
            let reason = "admin clients use the admin socket";
            drain_a_little(&stream);
            refuse_now(&stream, RefusalKind::WrongSocket, reason);
            adm.failed(&who, &WireError::WrongRole(reason));
            return park::close_or_hold(&adm, stream, slot, &group).await;
        }
    };
    let conn = arb.next_conn();
    let Some(binding) = arb.attach_tenant(&token, conn, peer) else {
        let reason = "unknown allocation token";
        drain_a_little(&stream);
        refuse_now(&stream, RefusalKind::UnknownToken, reason);
        adm.failed(&who, &WireError::WrongRole(reason));
        return park::close_or_hold(&adm, stream, slot, &group).await;
    };
    let admitted = match ticket {
        None => adm.admit(binding.key, pid, arb.allocation_count()),
        Some(t) => match arb.pressure().redeem(t, binding.key) {
            Ok(mem) => adm.admit_companion(mem),
            Err(e) => {
                let _ = arb.detach_tenant(&binding, conn, proc);
                let reason = "unknown or used companion ticket";
                refuse_now(&stream, RefusalKind::BadTicket, &e.to_string());
                adm.failed(&who, &WireError::WrongRole(reason));
                return park::close_or_hold(&adm, stream, slot, &group).await;
            }
        },
    };
    let tenant_slot = match admitted {
        Ok(s) => s,
        Err(e) => {
            // Attached a moment ago and holding nothing: this only undoes the attach.
            let _ = arb.detach_tenant(&binding, conn, proc);
            refuse_now(&stream, RefusalKind::Full, &e.to_string());
            return;
        }
    };
    // Admitted: no longer pending, whatever happens next.
    drop(slot);
    let id = binding.view.id.clone();
    if let Err(e) = on_admitted(AdmittedTenant {
        arb: Arc::clone(&arb),
        stream,
        conn,
        proc,
        binding: binding.clone(),
        slot: tenant_slot,
    }) {
        let _ = arb.detach_tenant(&binding, conn, proc);
        tracing::info!("{who} of {id}: dropped: {e}");
    }
}

#[cfg(test)]
mod tests;
