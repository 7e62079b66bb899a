//! Admission before cost: a connection gets a thread and a frame buffer only once its `Hello`
//! has been accepted.
//!
//! The tenant socket is mode 0666 and mounted into every pod, so any local process can
//! connect. A new connection is first counted against the caps on connections that have not
//! finished their handshake (globally, per uid and per pid from `SO_PEERCRED`); over a cap it
//! is closed at once. Otherwise its handshake runs as a small task on the runtime: the `Hello`
//! is read into a fixed [`crate::wire::HELLO_FRAME_LIMIT`]-byte buffer under one deadline for the whole
//! handshake. A tenant whose token is good is then counted against the caps on admitted
//! connections (per allocation and in total) and only then handed to its own thread
//! ([`crate::tenant::spawn`]). Every refusal is counted ([`Admission::counts`]); a summary is
//! logged at most once per second ([`Admission::report`]), and individual handshake failures
//! at most [`FAILURE_LINES_PER_SEC`] lines per second.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tessera_protocol::{Role, ServerHello};
use tokio::net::UnixStream;

use crate::ledger::AccountKey;
use crate::state::Arbiter;
use crate::wire::{self, WireError};

/// Handshake failures logged one by one per second; the rest are only counted.
pub const FAILURE_LINES_PER_SEC: u32 = 20;

/// The caps and the handshake deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Deadline for a connection's whole handshake.
    pub handshake_timeout: Duration,
    /// Connections that have not finished their handshake, all peers together.
    pub pending: usize,
    /// Connections that have not finished their handshake, per peer uid.
    pub pending_per_uid: usize,
    /// Connections that have not finished their handshake, per peer pid.
    pub pending_per_pid: usize,
    /// Admitted tenant connections per allocation.
    pub per_allocation: usize,
    /// Admitted tenant connections in total (each has a thread).
    pub admitted: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            handshake_timeout: wire::HANDSHAKE_TIMEOUT,
            pending: 256,
            pending_per_uid: 128,
            pending_per_pid: 32,
            per_allocation: 1024,
            admitted: 4096,
        }
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// Too many connections without a finished handshake, all peers together.
    #[error("arbiter busy: {0} connections are waiting for their handshake")]
    Pending(usize),
    /// Too many connections without a finished handshake from this uid.
    #[error("arbiter busy: {0} connections of this uid are waiting for their handshake")]
    PendingUid(usize),
    /// Too many connections without a finished handshake from this pid.
    #[error("arbiter busy: {0} connections of this process are waiting for their handshake")]
    PendingPid(usize),
    /// The allocation has its cap of connections.
    #[error("the allocation already has {0} connections")]
    Allocation(usize),
    /// The arbiter has its cap of tenant connections.
    #[error("the arbiter already serves {0} tenant connections")]
    Admitted(usize),
}

/// Refusals and failures since start.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Closed at accept: the global cap on pending handshakes.
    pub refused_pending: u64,
    /// Closed at accept: the per-uid cap.
    pub refused_uid: u64,
    /// Closed at accept: the per-pid cap.
    pub refused_pid: u64,
    /// Refused after a good hello: the per-allocation cap.
    pub refused_allocation: u64,
    /// Refused after a good hello: the total cap.
    pub refused_admitted: u64,
    /// Handshakes that failed (deadline, bad frame, magic, version, role or token).
    pub failed: u64,
    /// Connections admitted.
    pub admitted: u64,
}

#[derive(Debug, Default)]
struct Pending {
    total: usize,
    by_uid: HashMap<u32, usize>,
    by_pid: HashMap<i32, usize>,
}

#[derive(Debug, Default)]
struct Admitted {
    total: usize,
    by_account: HashMap<AccountKey, usize>,
}

#[derive(Debug)]
struct LogWindow {
    start: Instant,
    lines: u32,
    suppressed: u64,
}

/// The caps of one socket and their counters.
#[derive(Debug)]
pub struct Admission {
    limits: Limits,
    pending: Mutex<Pending>,
    admitted: Mutex<Admitted>,
    refused_pending: AtomicU64,
    refused_uid: AtomicU64,
    refused_pid: AtomicU64,
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

/// A connection counted as pending until its handshake ends (dropped).
#[derive(Debug)]
pub struct PendingSlot {
    adm: Arc<Admission>,
    uid: Option<u32>,
    pid: Option<i32>,
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut p = self.adm.pending.lock();
        p.total -= 1;
        if let Some(uid) = self.uid {
            release(&mut p.by_uid, uid);
        }
        if let Some(pid) = self.pid {
            release(&mut p.by_pid, pid);
        }
    }
}

/// An admitted tenant connection, counted until its thread ends (dropped).
#[derive(Debug)]
pub struct TenantSlot {
    adm: Arc<Admission>,
    key: AccountKey,
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut a = self.adm.admitted.lock();
        a.total -= 1;
        release(&mut a.by_account, self.key);
    }
}

impl Admission {
    /// Caps `limits`, nothing counted yet.
    pub fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            pending: Mutex::default(),
            admitted: Mutex::default(),
            refused_pending: AtomicU64::new(0),
            refused_uid: AtomicU64::new(0),
            refused_pid: AtomicU64::new(0),
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
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Counts a new connection of peer `uid`/`pid` as pending, or says which cap refuses it
    /// (the refusal is counted). A peer the kernel gave no uid or pid for is held to the
    /// global cap (and the other one it has).
    pub fn begin(
        self: &Arc<Self>,
        uid: Option<u32>,
        pid: Option<i32>,
    ) -> Result<PendingSlot, AdmissionError> {
        let l = &self.limits;
        let mut p = self.pending.lock();
        let refused = if p.total >= l.pending {
            Some((AdmissionError::Pending(p.total), &self.refused_pending))
        } else if uid.is_some_and(|u| p.by_uid.get(&u).is_some_and(|&n| n >= l.pending_per_uid)) {
            Some((
                AdmissionError::PendingUid(l.pending_per_uid),
                &self.refused_uid,
            ))
        } else if pid.is_some_and(|q| p.by_pid.get(&q).is_some_and(|&n| n >= l.pending_per_pid)) {
            Some((
                AdmissionError::PendingPid(l.pending_per_pid),
                &self.refused_pid,
            ))
        } else {
            None
        };
        if let Some((e, counter)) = refused {
            counter.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        p.total += 1;
        if let Some(uid) = uid {
            *p.by_uid.entry(uid).or_insert(0) += 1;
        }
        if let Some(pid) = pid {
            *p.by_pid.entry(pid).or_insert(0) += 1;
        }
        Ok(PendingSlot {
            adm: Arc::clone(self),
            uid,
            pid,
        })
    }

    /// Counts an admitted connection of allocation `key`, or says which cap refuses it (the
    /// refusal is counted).
    pub fn admit(self: &Arc<Self>, key: AccountKey) -> Result<TenantSlot, AdmissionError> {
        let l = &self.limits;
        let mut a = self.admitted.lock();
        if a.total >= l.admitted {
            self.refused_admitted.fetch_add(1, Ordering::Relaxed);
            return Err(AdmissionError::Admitted(a.total));
        }
        let n = a.by_account.entry(key).or_insert(0);
        if *n >= l.per_allocation {
            self.refused_allocation.fetch_add(1, Ordering::Relaxed);
            return Err(AdmissionError::Allocation(*n));
        }
        *n += 1;
        a.total += 1;
        self.admitted_count.fetch_add(1, Ordering::Relaxed);
        Ok(TenantSlot {
            adm: Arc::clone(self),
            key,
        })
    }

    /// Connections now pending and admitted.
    pub fn current(&self) -> (usize, usize) {
        (self.pending.lock().total, self.admitted.lock().total)
    }

    /// Refusals and failures since start.
    pub fn counts(&self) -> Counts {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counts {
            refused_pending: get(&self.refused_pending),
            refused_uid: get(&self.refused_uid),
            refused_pid: get(&self.refused_pid),
            refused_allocation: get(&self.refused_allocation),
            refused_admitted: get(&self.refused_admitted),
            failed: get(&self.failed),
            admitted: get(&self.admitted_count),
        }
    }

    /// Counts a failed handshake and logs it, unless this second already had
    /// [`FAILURE_LINES_PER_SEC`] lines (a flood must not turn into a flood of log lines).
    pub fn failed(&self, who: &str, e: &WireError) {
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
    pub async fn report(self: Arc<Self>, socket: &'static str, every: Duration) {
        let mut last = self.counts();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = self.counts();
            let refused = |c: &Counts| {
                c.refused_pending
                    + c.refused_uid
                    + c.refused_pid
                    + c.refused_allocation
                    + c.refused_admitted
            };
            if refused(&now) == refused(&last) && now.failed == last.failed {
                continue;
            }
            let suppressed = std::mem::take(&mut self.log.lock().suppressed);
            let (pending, admitted) = self.current();
            tracing::warn!(
                "admission on the {socket} socket: {} refused, {} failed handshakes ({suppressed} \
                 not logged) since the last report; totals: refused pending {} uid {} pid {} \
                 allocation {} admitted {}, failed {}; now {pending} pending, {admitted} admitted",
                refused(&now) - refused(&last),
                now.failed - last.failed,
                now.refused_pending,
                now.refused_uid,
                now.refused_pid,
                now.refused_allocation,
                now.refused_admitted,
                now.failed,
            );
            last = now;
        }
    }
}

/// The peer's uid and pid from `SO_PEERCRED`.
pub fn peer(stream: &UnixStream) -> (Option<u32>, Option<i32>) {
    match stream.peer_cred() {
        Ok(c) => (Some(c.uid()), c.pid()),
        Err(_) => (None, None),
    }
}

/// Answers a refused connection without ever waiting: one non-blocking write of a small frame
/// into a socket nobody has written to yet (so it fits), then the caller closes it.
pub fn refuse_now(stream: &UnixStream, reason: &str) {
    let mut out = Vec::new();
    let msg = ServerHello::Refused {
        reason: reason.to_owned(),
    };
    if wire::push_frame(&mut out, &msg).is_ok() {
        let _ = stream.try_write(&out);
    }
}

/// Reads, without waiting, what a peer whose handshake failed already sent, up to one hello's
/// worth: a socket closed with unread bytes resets the peer's next read, and a client that sent
/// a little junk should see a plain close.
pub fn drain_a_little(stream: &UnixStream) {
    let mut buf = [0u8; wire::HELLO_FRAME_LIMIT];
    let _ = stream.try_read(&mut buf);
}

/// Closes a connection refused at accept: no task, no thread, no answer. Without a `Refused`
/// frame a client takes it for an arbiter that is not there yet and retries with its backoff
/// (the interposer's `Refused` handling is for a bad token, and pauses much longer).
pub fn close_refused(stream: UnixStream) {
    drop(stream);
}

/// A new tenant connection: counts it as pending (or closes it at once), runs its handshake
/// on the runtime, and hands it to its own thread once admitted.
pub fn accept_tenant(arb: Arc<Arbiter>, adm: &Arc<Admission>, stream: UnixStream) {
    let (uid, pid) = peer(&stream);
    match adm.begin(uid, pid) {
        Ok(slot) => {
            // Named now, by the connection itself: the process that connected, not a later
            // holder of its pid.
            let peer = pid.and_then(|p| {
                use std::os::fd::AsFd;
                crate::backstop::peer_process(stream.as_fd(), p)
            });
            tokio::spawn(tenant_handshake(
                arb,
                Arc::clone(adm),
                stream,
                slot,
                pid,
                peer,
            ));
        }
        Err(_) => close_refused(stream),
    }
}

async fn tenant_handshake(
    arb: Arc<Arbiter>,
    adm: Arc<Admission>,
    mut stream: UnixStream,
    slot: PendingSlot,
    pid: Option<i32>,
    peer: Option<crate::backstop::Peer>,
) {
    let proc = peer.as_ref().map(|p| p.id);
    let who = match pid {
        Some(p) => format!("tenant connection of pid {p}"),
        None => "tenant connection".to_owned(),
    };
    let role = match wire::read_hello(&mut stream, adm.limits.handshake_timeout).await {
        Ok(r) => r,
        Err(e) => {
            drain_a_little(&stream);
            if let WireError::BadVersion(_) = e {
                refuse_now(&stream, &e.to_string());
            }
            adm.failed(&who, &e);
            return;
        }
    };
    let Role::Tenant { token } = role else {
        let reason = "admin clients use the admin socket";
        drain_a_little(&stream);
        refuse_now(&stream, reason);
        adm.failed(&who, &WireError::WrongRole(reason));
        return;
    };
    let conn = arb.next_conn();
    let Some(binding) = arb.attach_tenant(&token, conn, peer) else {
        let reason = "unknown allocation token";
        drain_a_little(&stream);
        refuse_now(&stream, reason);
        adm.failed(&who, &WireError::WrongRole(reason));
        return;
    };
    let tenant_slot = match adm.admit(binding.key) {
        Ok(s) => s,
        Err(e) => {
            // Attached a moment ago and holding nothing: this only undoes the attach.
            let _ = arb.detach_tenant(&binding, conn, proc);
            refuse_now(&stream, &e.to_string());
            return;
        }
    };
    // Admitted: no longer pending, whatever happens next.
    drop(slot);
    let id = binding.view.id.clone();
    if let Err(e) = crate::tenant::spawn(
        Arc::clone(&arb),
        stream,
        conn,
        proc,
        binding.clone(),
        tenant_slot,
    ) {
        let _ = arb.detach_tenant(&binding, conn, proc);
        tracing::info!("{who} of {id}: dropped: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            handshake_timeout: Duration::from_secs(1),
            pending: 4,
            pending_per_uid: 3,
            pending_per_pid: 2,
            per_allocation: 2,
            admitted: 3,
        }
    }

    #[test]
    fn pending_caps_count_per_pid_per_uid_and_globally_and_free_on_drop() {
        let adm = Admission::new(limits());
        let a1 = adm.begin(Some(1000), Some(10)).unwrap();
        let a2 = adm.begin(Some(1000), Some(10)).unwrap();
        assert_eq!(
            adm.begin(Some(1000), Some(10)).unwrap_err(),
            AdmissionError::PendingPid(2)
        );
        // Another process of the same uid still gets in, up to the uid's cap.
        let b1 = adm.begin(Some(1000), Some(11)).unwrap();
        assert_eq!(
            adm.begin(Some(1000), Some(12)).unwrap_err(),
            AdmissionError::PendingUid(3)
        );
        // Another uid gets the last global slot; then everyone is refused.
        let c1 = adm.begin(Some(0), Some(20)).unwrap();
        assert_eq!(
            adm.begin(Some(5), None).unwrap_err(),
            AdmissionError::Pending(4)
        );
        let c = adm.counts();
        assert_eq!((c.refused_pid, c.refused_uid, c.refused_pending), (1, 1, 1));
        drop((a1, a2, b1, c1));
        assert_eq!(adm.current(), (0, 0));
        // Freed slots are reusable; the maps forget peers at zero.
        let _again = adm.begin(Some(1000), Some(10)).unwrap();
        assert!(adm.pending.lock().by_pid.len() == 1 && adm.pending.lock().by_uid.len() == 1);
    }

    #[test]
    fn admitted_caps_per_allocation_and_in_total() {
        let adm = Admission::new(limits());
        let a = [adm.admit(1).unwrap(), adm.admit(1).unwrap()];
        assert_eq!(adm.admit(1).unwrap_err(), AdmissionError::Allocation(2));
        let b = adm.admit(2).unwrap();
        assert_eq!(adm.admit(3).unwrap_err(), AdmissionError::Admitted(3));
        assert_eq!(adm.counts().refused_allocation, 1);
        assert_eq!(adm.counts().refused_admitted, 1);
        assert_eq!(adm.counts().admitted, 3);
        drop(a);
        assert_eq!(adm.current(), (0, 1));
        let _a = adm.admit(1).unwrap();
        drop(b);
        assert_eq!(adm.admitted.lock().by_account.len(), 1);
    }
}
