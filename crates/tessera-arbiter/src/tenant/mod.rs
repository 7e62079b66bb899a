//! The tenant socket: one OS thread per connection (one connection per interposed process).
//!
//! Why threads and blocking I/O here while the rest of the daemon is tokio: the interposer
//! pays a Reserve round trip on every device allocation, and a thread blocked in `read` is
//! woken straight by the kernel, which measured about twice as fast as a tokio task (whose
//! wake-up goes through the reactor and a worker hand-off). A slow or stuck client only
//! blocks its own thread. A connection gets its thread only once its `Hello` and token were
//! accepted on the runtime, within the caps (see [`crate::admission`]): an unauthenticated
//! peer never costs a thread.
//!
//! Connection threads are `SCHED_BATCH` (see [`batch_scheduling`]): a tenant's request then
//! costs two context switches, not three or four. A connection that asks for a compute lease
//! goes back to normal scheduling (see [`normal_scheduling`]): its `LeaseRelease` is one-way,
//! and the grant it triggers for the next tenant must not wait for a time slice to end.
//!
//! Requests on a connection are handled in order; replies to every request that arrived in
//! one read are written with one `write`. Reserve and Release touch only the in-memory ledger
//! (one short mutex section), never the disk. When the connection closes (the process exited,
//! was killed, or sent garbage), everything it held is released once the card has released it:
//! the bytes drain until the process has exited and NVML no longer lists its memory, for at
//! most [`crate::drain::DRAIN_BOUND`] (see [`crate::drain`]); a sibling's reservation that fits
//! once they are released waits for them.
//!
//! Leases: on `LeaseAcquire` the connection registers itself with its GPU's scheduler as a
//! [`GrantSink`] and goes back to reading. Whoever causes the grant (a release on another
//! connection, a closing connection, the timer) writes `LeaseGranted` to this socket directly
//! with a non-blocking send, so an idle GPU is handed over within one socket write. Replies
//! to requests that arrive while the lease is pending wait until it has been granted, which
//! keeps every reply in request order; one-way frames are handled meanwhile.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use tessera_protocol::{FrameDecoder, ServerHello, TenantReply, TenantRequest};

use crate::admission::{AdmittedTenant, TenantSlot};
use crate::ledger::{ConnId, Credit, LedgerError, Reservation};
use crate::pressure::{PressureError, PressureHub, PressureSink};
use crate::scheduler::{Grant, GrantSink};
use crate::state::{Arbiter, TenantBinding};
use crate::wire::{self, READ_CHUNK, WireError};

/// Stack of a connection thread (it needs a read buffer and small frames only).
const THREAD_STACK: usize = 256 * 1024;

/// Errors of tenant connections (each closes that connection only).
#[derive(Debug, thiserror::Error)]
pub(crate) enum TenantError {
    /// Framing, handshake or transport failure.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The connection thread could not be started.
    #[error("cannot start a connection thread: {0}")]
    Spawn(std::io::Error),
    /// A pressure-channel request that does not fit (bad ticket, relinquish elsewhere).
    #[error(transparent)]
    Pressure(#[from] PressureError),
    /// The tenant lied about its memory (released more than it held, redeclared out of turn
    /// or beyond its limit); counted per allocation.
    #[error("protocol violation #{count} of this allocation: {what}")]
    Violation {
        /// What it did.
        what: String,
        /// Violations of the allocation so far.
        count: u64,
    },
}

fn io_err(e: std::io::Error) -> TenantError {
    WireError::Frame(e.into()).into()
}

/// Largest request frame an admitted tenant may send. Every `TenantRequest` is under 40 bytes;
/// the margin is for new variants. It bounds what one connection buffers (one frame plus one
/// read) and so the arbiter's memory per connection (see docs/arbiter.md).
pub(crate) const TENANT_FRAME_LIMIT: usize = 1024;

/// Serves an admitted connection on its own thread ([`spawn`]): what the server hands
/// [`crate::admission::accept_tenant`].
pub(crate) fn serve_admitted(a: AdmittedTenant) -> Result<(), TenantError> {
    spawn(a.arb, a.stream, a.conn, a.proc, a.binding, a.slot)
}

/// Serves an admitted connection (its `Hello` was read and its token accepted on the runtime,
/// see [`crate::admission`]) on its own thread, which first sends the `Welcome`. `slot` counts
/// the connection against the caps until the thread ends.
pub(crate) fn spawn(
    arb: Arc<Arbiter>,
    stream: tokio::net::UnixStream,
    conn: ConnId,
    proc: Option<crate::peer::ProcId>,
    binding: TenantBinding,
    slot: TenantSlot,
) -> Result<(), TenantError> {
    let stream = stream.into_std().map_err(io_err)?;
    stream.set_nonblocking(false).map_err(io_err)?;
    std::thread::Builder::new()
        .name(format!("tenant-{conn}"))
        .stack_size(THREAD_STACK)
        .spawn(move || serve(arb, stream, conn, proc, binding, slot))
        .map_err(TenantError::Spawn)?;
    Ok(())
}

/// The write side of a connection, shared with the scheduler while a lease is pending.
struct ConnWriter {
    stream: UnixStream,
    /// True from `LeaseAcquire` until the grant was written.
    lease_pending: Mutex<bool>,
    granted: Condvar,
    /// The connection asked with `LeaseAcquireTiered`: its interposer reads
    /// `LeaseGrantedLatency` (an older one would take that frame for garbage).
    tiered: AtomicBool,
}

impl ConnWriter {
    fn lock(&self) -> MutexGuard<'_, bool> {
        self.lease_pending.lock()
    }

    /// Writes replies once no lease grant is outstanding (replies stay in request order).
    fn write_replies(&self, out: &mut Vec<u8>) -> Result<(), TenantError> {
        if out.is_empty() {
            return Ok(());
        }
        let mut pending = self.lock();
        while *pending {
            self.granted.wait(&mut pending);
        }
        (&self.stream).write_all(out).map_err(io_err)?;
        out.clear();
        Ok(())
    }
}

impl ConnWriter {
    /// Writes one frame without ever blocking (the caller is the scheduler or the pressure
    /// registry); false when it could not be written whole.
    fn send_now(&self, msg: &TenantReply) -> bool {
        let mut frame = Vec::with_capacity(24);
        if wire::push_frame(&mut frame, msg).is_err() {
            return false;
        }
        // SAFETY: the fd is open for the lifetime of `self.stream`, the buffer is valid for
        // `frame.len()` bytes, and MSG_DONTWAIT makes this never block.
        let n = unsafe {
            libc::send(
                self.stream.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        n == frame.len() as isize
    }
}

impl PressureSink for ConnWriter {
    fn press(&self, seq: u64) -> bool {
        // Never wait here (the caller holds the pressure registry): a connection whose thread
        // is writing is skipped this round.
        let Some(_guard) = self.lease_pending.try_lock() else {
            return false;
        };
        self.send_now(&TenantReply::Pressure { seq })
    }
}

impl GrantSink for ConnWriter {
    fn revoke(&self, lease_id: u64) -> bool {
        // Under the writer's lock, so the frame never lands inside a reply being written.
        let _guard = self.lock();
        let ok = self.send_now(&TenantReply::LeaseRevoked { lease_id });
        if !ok {
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
        ok
    }

    fn grant(&self, g: Grant) -> bool {
        let mut pending = self.lock();
        let ok = self.send_now(&match g.max_inflight_ns {
            None if g.latency && self.tiered.load(Ordering::Relaxed) => {
                TenantReply::LeaseGrantedLatency {
                    lease_id: g.lease_id,
                    duration_ns: g.duration_ns,
                }
            }
            None => TenantReply::LeaseGranted {
                lease_id: g.lease_id,
                duration_ns: g.duration_ns,
            },
            Some(max_inflight_ns) => TenantReply::LeaseGrantedBounded {
                lease_id: g.lease_id,
                duration_ns: g.duration_ns,
                max_inflight_ns,
            },
        });
        if !ok {
            // A peer that does not read its replies (or is gone) loses the connection; its
            // thread notices the shutdown and cleans up.
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
        *pending = false;
        self.granted.notify_all();
        ok
    }
}

/// Makes the calling connection thread `SCHED_BATCH` (same nice level, no privilege needed).
///
/// Why: a tenant's request wakes this thread while the tenant is about to block in `recv` for
/// the reply anyway, so a wake-up that preempts the sender only adds context switches. A batch
/// thread never preempts on wake-up; it runs when the sender blocks, which it does right away.
/// Measured with tenant and arbiter on one CPU: 3.6 -> 2.1 context switches per `Reserve` round
/// trip, 1-2 us less. The price: on a CPU where some other task keeps running, the thread
/// waits for the end of that task's time slice (under a millisecond by default) instead of
/// preempting it.
fn batch_scheduling() {
    set_policy(libc::SCHED_BATCH, "SCHED_BATCH");
}

/// Puts the calling connection thread back to `SCHED_OTHER` (lease connections).
///
/// Why: a lease holder's `LeaseRelease` is one-way (its sender does not block waiting for a
/// reply), and handling it grants the GPU to the next tenant: under load a batch thread would
/// add up to a time slice to every hand-over of the GPU.
fn normal_scheduling() {
    set_policy(libc::SCHED_OTHER, "SCHED_OTHER");
}

/// Sets the calling thread's scheduling policy (a normal-class one: no privilege needed); a
/// refusal is logged and the thread keeps running as it was.
fn set_policy(policy: libc::c_int, name: &str) {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param; pid 0 is the calling thread.
    if unsafe { libc::sched_setscheduler(0, policy, &param) } != 0 {
        tracing::warn!(
            "tenant thread not moved to {name}: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn serve(
    arb: Arc<Arbiter>,
    mut stream: UnixStream,
    conn: ConnId,
    proc: Option<crate::peer::ProcId>,
    binding: TenantBinding,
    _slot: TenantSlot,
) {
    batch_scheduling();
    let who = match proc {
        Some(p) => format!("tenant conn {conn} (pid {})", p.pid),
        None => format!("tenant conn {conn}"),
    };
    if let Err(e) = welcome(&mut stream, &binding) {
        let _ = arb.detach_tenant(&binding, conn, proc);
        tracing::info!("{who}: closed at handshake: {e}");
        return;
    }
    let mut dec = FrameDecoder::with_limit(TENANT_FRAME_LIMIT);
    // Set when this connection is the pressure channel of the process's memory connection.
    let mut channel_of = None;
    let result = match stream.try_clone() {
        Ok(w) => {
            let writer = Arc::new(ConnWriter {
                stream: w,
                lease_pending: Mutex::new(false),
                granted: Condvar::new(),
                tiered: AtomicBool::new(false),
            });
            serve_requests(
                &arb,
                &binding,
                &mut stream,
                &mut dec,
                conn,
                &writer,
                &mut channel_of,
            )
        }
        Err(e) => Err(io_err(e)),
    };
    if let Some(mem) = channel_of {
        arb.pressure().channel_closed(mem, conn);
        // At a process's exit this thread is woken before the memory connection's.
        crate::drain::after_channel_close(&arb, &binding, mem);
    }
    arb.pressure().conn_closed(conn);
    // What the connection held stays counted until the card let it go (its process's
    // teardown comes after its socket closed): siblings wait for it rather than pass the
    // limit on the card.
    crate::drain::after_close(&arb, &binding, conn, proc);
    let freed = arb.detach_tenant(&binding, conn, proc);
    arb.pressure().note_freed();
    let id = &binding.view.id;
    match (result, freed) {
        (Err(TenantError::Wire(WireError::Closed)), Ok(_)) | (Ok(()), Ok(_)) => {}
        (Err(e), Ok(freed)) => {
            tracing::info!(
                "{who} of {id}: closed: {e} (released {})",
                tessera_protocol::size::human(freed)
            )
        }
        (_, Err(e)) => tracing::error!("{who} of {id}: ledger: {e}"),
    }
}

/// Sends the `Welcome` that ends an admitted tenant's handshake.
fn welcome(stream: &mut UnixStream, binding: &TenantBinding) -> Result<(), TenantError> {
    let welcome = ServerHello::Welcome {
        version: tessera_protocol::PROTOCOL_VERSION,
        allocation: Some(binding.view.clone()),
    };
    let mut out = Vec::new();
    wire::push_frame(&mut out, &welcome).map_err(|e| TenantError::Wire(e.into()))?;
    stream.write_all(&out).map_err(io_err)
}

fn serve_requests(
    arb: &Arbiter,
    b: &TenantBinding,
    stream: &mut UnixStream,
    dec: &mut FrameDecoder,
    conn: ConnId,
    writer: &Arc<ConnWriter>,
    channel_of: &mut Option<ConnId>,
) -> Result<(), TenantError> {
    let mut buf = [0u8; READ_CHUNK];
    let mut out: Vec<u8> = Vec::with_capacity(256);
    let mut leasing = false;
    // Requests handled so far: `Redeclare` is valid only as the first one.
    let mut handled: u64 = 0;
    loop {
        // Handle every whole frame already buffered.
        while let Some(req) = dec.next::<TenantRequest>().map_err(WireError::from)? {
            let first = handled == 0;
            handled = handled.saturating_add(1);
            let kind = crate::stats::RequestKind::of(&req);
            if kind == crate::stats::RequestKind::LeaseAcquire {
                if req == TenantRequest::LeaseAcquireTiered {
                    writer.tiered.store(true, Ordering::Relaxed);
                }
                if !leasing {
                    leasing = true;
                    normal_scheduling();
                }
                // Replies before it go out first; a second acquire waits for the first grant.
                writer.write_replies(&mut out)?;
                {
                    let mut pending = writer.lock();
                    while *pending {
                        writer.granted.wait(&mut pending);
                    }
                    *pending = true;
                }
                let started = Instant::now();
                let sink: Arc<dyn GrantSink> = Arc::clone(writer) as Arc<dyn GrantSink>;
                let queued = b.scheduler.acquire(b.key, conn, arb.now_ns(), sink);
                arb.requests().observe(kind, started.elapsed());
                if let Err(e) = queued {
                    *writer.lock() = false;
                    reply(
                        &mut out,
                        &TenantReply::Error {
                            message: e.to_string(),
                        },
                    )?;
                }
                continue;
            }
            let started = Instant::now();
            match req {
                TenantRequest::Subscribe { ticket } => {
                    // Registered before the reply: a `Pressure` may reach the process ahead
                    // of `Subscribed`, and it answers it like any other.
                    let sink = Arc::clone(writer) as Arc<dyn PressureSink>;
                    let mem = arb.pressure().subscribe(ticket, b.key, conn, sink)?;
                    *channel_of = Some(mem);
                    // Its answers unblock a waiting reservation: no batch-scheduling delay.
                    normal_scheduling();
                    reply(&mut out, &TenantReply::Subscribed)?;
                }
                TenantRequest::Relinquish { seq, bytes } => {
                    let mem = channel_of.ok_or(PressureError::NotAChannel)?;
                    // Too much closes this channel; the memory connection keeps its holding
                    // (over-counting only its own allocation).
                    book_release(arb, b, mem, bytes)?;
                    let answered = arb.pressure().answered(mem, conn, seq);
                    // Wakes reservations waiting for room, or for this channel to catch up
                    // (after `answered` counted the frame, which such a waiter reads), even
                    // when the channel is no longer its connection's: the bytes were booked.
                    arb.pressure().note_freed();
                    if answered.is_err() {
                        // Its memory connection closed first (a process's sockets close one
                        // by one at its exit) and took the channel with it, or a later
                        // `Subscribe` replaced it: nothing is left to answer for, and this
                        // is no error of the process's.
                        tracing::debug!(
                            "pressure channel conn {conn}: its memory connection {mem} has no \
                             channel now; closing it"
                        );
                        return Ok(());
                    }
                }
                req => handle(arb, b, conn, stream.as_raw_fd(), req, first, &mut out)?,
            }
            arb.requests().observe(kind, started.elapsed());
        }
        writer.write_replies(&mut out)?;
        let n = loop {
            match stream.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                r => break r.map_err(io_err)?,
            }
        };
        wire::feed(dec, &buf[..n])?;
    }
}

fn reply(out: &mut Vec<u8>, r: &TenantReply) -> Result<(), TenantError> {
    wire::push_frame(out, r).map_err(|e| WireError::from(e).into())
}

/// Handles one request; `first`: it is the first request of the connection, whose socket is
/// `peer`.
fn handle(
    arb: &Arbiter,
    b: &TenantBinding,
    conn: ConnId,
    peer: RawFd,
    req: TenantRequest,
    first: bool,
    out: &mut Vec<u8>,
) -> Result<(), TenantError> {
    let key = b.key;
    match req {
        TenantRequest::Reserve { bytes } => {
            let msg = match reserve_pressing(arb, b, (conn, peer), bytes, 0, |l| {
                l.reserve(key, conn, bytes).map(|r| match r {
                    Reservation::Granted { in_use } => Credit::Granted { bytes, in_use },
                    Reservation::Denied { limit, in_use } => Credit::Denied { limit, in_use },
                })
            }) {
                Ok(Credit::Granted { in_use, .. }) => TenantReply::Reserved { in_use },
                Ok(Credit::Denied { limit, in_use }) => {
                    b.counters.refused();
                    TenantReply::Denied { limit, in_use }
                }
                Err(e) => TenantReply::Error {
                    message: e.to_string(),
                },
            };
            reply(out, &msg)?;
        }
        TenantRequest::ReserveCredit {
            bytes,
            extra,
            given_back,
        } => {
            let attempt = |l: &mut crate::ledger::Ledger| l.reserve_credit(key, conn, bytes, extra);
            let msg = match reserve_pressing(arb, b, (conn, peer), bytes, given_back, attempt) {
                Ok(Credit::Granted { bytes, in_use }) => TenantReply::Granted { bytes, in_use },
                Ok(Credit::Denied { limit, in_use }) => {
                    b.counters.refused();
                    TenantReply::Denied { limit, in_use }
                }
                Err(e) => TenantReply::Error {
                    message: e.to_string(),
                },
            };
            reply(out, &msg)?;
        }
        TenantRequest::Ticket => {
            let mut raw = [0u8; 8];
            let msg = match getrandom::fill(&mut raw) {
                Ok(()) => {
                    let ticket = u64::from_le_bytes(raw);
                    arb.pressure().issue_ticket(key, conn, ticket);
                    TenantReply::Ticket { ticket }
                }
                Err(e) => TenantReply::Error {
                    message: format!("no randomness for a ticket: {e}"),
                },
            };
            reply(out, &msg)?;
        }
        // Handled by the caller (they need the connection's state); reaching here is a bug.
        TenantRequest::Subscribe { .. } | TenantRequest::Relinquish { .. } => {
            return Err(PressureError::NotAChannel.into());
        }
        TenantRequest::Release { bytes } => {
            book_release(arb, b, conn, bytes)?;
            arb.pressure().note_freed();
        }
        TenantRequest::Redeclare { bytes } => {
            // Only a process that reconnects declares what it holds, and it does so before
            // anything else; later, it would undo what this connection reserved.
            if !first {
                return Err(violation(arb, b, "Redeclare after other requests".into()));
            }
            let msg = match arb.with_ledger(|l| l.redeclare(key, conn, bytes)) {
                Ok(in_use) => TenantReply::Reserved { in_use },
                Err(
                    e @ (LedgerError::RedeclareBelow { .. }
                    | LedgerError::RedeclareAboveLimit { .. }
                    | LedgerError::Overflow(_)),
                ) => return Err(violation(arb, b, e.to_string())),
                Err(e) => TenantReply::Error {
                    message: e.to_string(),
                },
            };
            reply(out, &msg)?;
        }
        TenantRequest::MemInfo | TenantRequest::MemInfoAfter { .. } => {
            let given_back = match req {
                TenantRequest::MemInfoAfter { given_back } => given_back,
                _ => 0,
            };
            // Exact: what this process gave back on its channel and the other processes'
            // unused credit are not in use.
            OwnGiveBacks::new(conn, given_back).wait_all(arb.pressure());
            press_others(arb, b, conn, Instant::now() + arb.memory_wait());
            let msg = match arb.with_ledger(|l| l.usage(key)) {
                Some(u) => TenantReply::MemInfo {
                    limit: u.limit,
                    in_use: u.in_use,
                },
                None => TenantReply::Error {
                    message: "allocation is gone".into(),
                },
            };
            reply(out, &msg)?;
        }
        TenantRequest::Ping => reply(out, &TenantReply::Pong)?,
        TenantRequest::LeaseRelease {
            lease_id,
            busy_ns,
            early,
        } => {
            b.scheduler
                .release(conn, lease_id, busy_ns, early, arb.now_ns());
        }
        // Handled by the caller (it needs the connection's writer).
        TenantRequest::LeaseAcquire | TenantRequest::LeaseAcquireTiered => {}
    }
    Ok(())
}

/// Releases `bytes` held by memory connection `holder` (a `Release` on it, or a `Relinquish` on
/// its pressure channel). More than it holds is a violation: nothing is freed and the
/// connection that sent it is closed.
fn book_release(
    arb: &Arbiter,
    b: &TenantBinding,
    holder: ConnId,
    bytes: u64,
) -> Result<(), TenantError> {
    match arb.with_ledger(|l| l.release(b.key, holder, bytes)) {
        Ok(_) => Ok(()),
        Err(e @ (LedgerError::OverRelease { .. } | LedgerError::Overflow(_))) => {
            Err(violation(arb, b, e.to_string()))
        }
        Err(e) => {
            tracing::warn!("tenant conn {holder} of {}: release: {e}", b.view.id);
            Ok(())
        }
    }
}

/// Counts a protocol violation of `b`'s allocation; the error closes the connection (which
/// releases everything it held, as when a process exits) and is logged with the count.
fn violation(arb: &Arbiter, b: &TenantBinding, what: String) -> TenantError {
    TenantError::Violation {
        what,
        count: arb.note_violation(&b.view.id),
    }
}

/// Longest a reservation waits for the give-backs its own process says it sent on its pressure
/// channel (a process that claims more than it sent delays only itself).
const OWN_GIVE_BACK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The `Relinquish` frames a process says it sent on its pressure channel before a request
/// (its own frees, which travel on another socket), waited for up to [`OWN_GIVE_BACK_WAIT`]
/// from the request.
struct OwnGiveBacks {
    conn: ConnId,
    given_back: u64,
    deadline: Instant,
}

impl OwnGiveBacks {
    fn new(conn: ConnId, given_back: u64) -> Self {
        Self {
            conn,
            given_back,
            deadline: Instant::now() + OWN_GIVE_BACK_WAIT,
        }
    }

    /// Whether some have not been handled yet, and the wait for them is not over.
    fn pending(&self, hub: &PressureHub) -> bool {
        hub.channel_frames(self.conn)
            .is_some_and(|n| n < self.given_back)
            && Instant::now() < self.deadline
    }

    /// Waits for the next free seen after `seen` was read (or the end of the wait).
    fn wait_one(&self, hub: &PressureHub, seen: u64) {
        hub.wait_freed(seen, self.deadline);
    }

    /// Waits until all are handled (or the end of the wait).
    fn wait_all(&self, hub: &PressureHub) {
        loop {
            let seen = hub.freed_count();
            if !self.pending(hub) {
                return;
            }
            self.wait_one(hub, seen);
        }
    }
}

/// Runs `attempt` on the ledger; while it is refused, presses the allocation's other
/// processes to give back unused credit, waits for their frees, and tries again, for at most
/// [`Arbiter::memory_wait`]. Refused only when the bytes are really held (or the allocation was
/// deleted). `given_back`: the `Relinquish` frames the process says it sent on its own pressure
/// channel; a refusal first waits for the channel to have handled them (the process's own
/// frees, which travel on another socket). `need`: the bytes asked for; a request that would
/// fit once the allocation's draining connections are released waits for them (see
/// [`Drains`]). `(conn, peer)`: the connection and its socket; a process that dies while its
/// request waits stops the wait (its bytes then drain like any closed connection's, and its
/// siblings wait for those rather than be refused beside them).
fn reserve_pressing(
    arb: &Arbiter,
    b: &TenantBinding,
    (conn, peer): (ConnId, RawFd),
    need: u64,
    given_back: u64,
    mut attempt: impl FnMut(&mut crate::ledger::Ledger) -> Result<Credit, crate::ledger::LedgerError>,
) -> Result<Credit, crate::ledger::LedgerError> {
    let own = OwnGiveBacks::new(conn, given_back);
    let mut drains = Drains::new(need);
    let mut deadline = Instant::now() + arb.memory_wait();
    let hub = arb.pressure();
    let key = b.key;
    // A grant while a sibling waits for room wakes it: its next press then reaches this
    // connection, which held less (maybe nothing) when it last pressed, and whose frees would
    // otherwise stay credit in this process that nobody asks back.
    let mut attempt = |arb: &Arbiter| {
        let (r, others) = arb.with_ledger(|l| {
            attempt(l).map(|r| {
                (
                    r,
                    matches!(r, Credit::Granted { .. }) && l.others_waiting(key, conn),
                )
            })
        })?;
        if others {
            hub.note_freed();
        }
        Ok::<_, LedgerError>(r)
    };
    // Set once the first attempt was refused: the connection waits for room (no credit is
    // given to anyone meanwhile, see `Ledger::begin_wait`); ends with this call.
    let mut waiting: Option<Waiting<'_>> = None;
    // Whether the others were pressed since the deadline was last set.
    let mut pressed = false;
    // Whether the deadline was moved for a sibling's turn (once).
    let mut turn_allowed = false;
    // When this request last pressed the others (set by each press, before any wait).
    let mut last_press;
    if hub.waiters() > 0 {
        // Someone waits for room: this process's own give-backs (sent on its channel before
        // this request, booked by another thread) are booked first, so that its grant takes
        // back its own bytes, not the room the waiter needs. (A process that frees and
        // allocates in a loop ran ahead of its channel by three chunks, and a sibling's context
        // waited out the memory wait beside bytes already given back.)
        own.wait_all(hub);
    }
    loop {
        let seen = hub.freed_count();
        let r = attempt(arb)?;
        if matches!(r, Credit::Granted { .. }) {
            return Ok(r);
        }
        // Registered before anyone is pressed: a sibling granted after the targets are chosen
        // gets no credit it would keep beside this waiter.
        let open = arb.with_ledger(|l| {
            let open = l.usage(key).is_some_and(|u| !u.closed);
            if open && waiting.is_none() {
                l.begin_wait(key, conn, need)?;
            }
            Ok::<_, LedgerError>(open)
        })?;
        if !open {
            // Deleted: nothing anyone frees makes room.
            return Ok(r);
        }
        if waiting.is_none() {
            hub.wait_began();
            waiting = Some(Waiting::begin(arb, key, conn));
        }
        if hung_up(peer) {
            // Killed while it waited: nobody reads the answer, and until this thread reads
            // the end of the stream its bytes (its tickets' chunks, in the racers) count as a
            // live process's, which nobody can press: siblings would be refused beside them.
            return Ok(r);
        }
        if own.pending(hub) {
            // This process's own give-backs are still on their way: they were sent and come
            // however loaded the host is (a CPU hog delayed one past the memory wait, and the
            // process was refused what it had just given back). The wait for others' frees
            // starts once they are in.
            own.wait_one(hub, seen);
            deadline = Instant::now() + arb.memory_wait();
            pressed = false;
            continue;
        }
        // Refused only after a press since the deadline was set: a thread the host did not
        // run for the whole memory wait (seen: 55 ms on a loaded VM) presses once, late,
        // rather than refusing on the word of its first attempt.
        if pressed && Instant::now() >= deadline {
            if drains.wait(arb, b, seen) {
                deadline = Instant::now() + arb.memory_wait();
                pressed = false;
                continue;
            }
            log_refusal(arb, b, conn, need, "after the memory wait");
            return Ok(r);
        }
        pressed = true;
        // Taken before the press: its frames are written then, and it may wait for answers.
        last_press = Instant::now();
        let pressing = press_others(arb, b, conn, deadline);
        if pressing == Pressing::Channels && !turn_allowed {
            // A sibling pressed in its turn keeps its credit until the turn ends
            // (`tessera_protocol::TURN`) and gives it back then: the memory wait counts from
            // there, so a sibling's turn never shortens it. Once per request: the wait ends.
            turn_allowed = true;
            deadline = deadline.max(Instant::now() + tessera_protocol::TURN + arb.memory_wait());
        }
        if pressing == Pressing::Nobody {
            // Nobody else holds anything (now): once more, then the request alone does not fit
            // (unless closed connections' bytes, still on the card, are what it waits for).
            let seen = hub.freed_count();
            let r = attempt(arb)?;
            if !matches!(r, Credit::Granted { .. }) && drains.wait(arb, b, seen) {
                deadline = Instant::now() + arb.memory_wait();
                pressed = false;
                continue;
            }
            if !matches!(r, Credit::Granted { .. }) {
                log_refusal(arb, b, conn, need, "nobody else holds anything");
            }
            return Ok(r);
        }
        // Counted before the retry, so a free between the two is not missed.
        let seen = hub.freed_count();
        let r = attempt(arb)?;
        if matches!(r, Credit::Granted { .. }) {
            return Ok(r);
        }
        // What the others hold is allocated right now: wait for one of them to free. Past the
        // deadline this returns at once, and the next turn tries once more and then refuses,
        // or waits for bytes on their way out (draining, or of exited processes), above: one
        // place decides a refusal after a press (a return here had refused 96 MiB beside
        // 616 MiB draining). Woken too when the press is due again: a pressed process keeps no
        // credit for `tessera_protocol::PRESSED_FOR` only, and a request that waits longer (the
        // memory wait and a sibling's turn) must press again before then, or a sibling whose
        // turn began after the press keeps its credit past it (the racers: a request under a
        // ticket refused after 70 ms without one free, beside 96 MiB of a sibling's credit).
        hub.wait_freed(
            seen,
            deadline.min(last_press + crate::pressure::STILL_PRESSED),
        );
    }
}

/// A reservation waiting for room (see `Ledger::begin_wait`), until it is dropped.
///
/// Its thread runs under normal scheduling meanwhile (see [`batch_scheduling`] for why it is
/// batch otherwise): the free that makes room comes from another process, whose sender does
/// not wait for this thread, so a batch thread woken by it would wait for the end of
/// whatever task has the CPU before it grants (issue 36: at a full allocation every grant is
/// such a wake-up).
struct Waiting<'a> {
    arb: &'a Arbiter,
    key: crate::ledger::AccountKey,
    conn: ConnId,
    /// The thread was batch-scheduled before the wait (and goes back to it after).
    was_batch: bool,
}

impl<'a> Waiting<'a> {
    fn begin(arb: &'a Arbiter, key: crate::ledger::AccountKey, conn: ConnId) -> Self {
        // SAFETY: no preconditions; pid 0 is the calling thread.
        let was_batch = unsafe { libc::sched_getscheduler(0) } == libc::SCHED_BATCH;
        if was_batch {
            normal_scheduling();
        }
        Self {
            arb,
            key,
            conn,
            was_batch,
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.arb.with_ledger(|l| l.end_wait(self.key, self.conn));
        self.arb.pressure().wait_ended();
        if self.was_batch {
            batch_scheduling();
        }
    }
}

/// A reservation refused after its wait, at debug level: what the allocation held then, so a
/// false out-of-memory can be told from a full allocation.
fn log_refusal(arb: &Arbiter, b: &TenantBinding, conn: ConnId, need: u64, when: &str) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let (usage, draining, holders) = arb.with_ledger(|l| {
        (
            l.usage(b.key),
            l.draining(b.key),
            l.others_holding(b.key, conn).len(),
        )
    });
    let exited = arb.exited_held(b.key);
    tracing::debug!(
        "tenant conn {conn} of {}: {need} bytes refused {when}: {usage:?}, draining {draining}, \
         held by exited processes {exited}, {holders} other connections holding",
        b.view.id
    );
}

/// The wait of a reservation for the bytes of its allocation's draining connections (closed,
/// their memory still on the card, see [`crate::drain`]): they are released within
/// [`crate::drain::DRAIN_BOUND`], so a request that fits once they are is not refused meanwhile.
struct Drains {
    need: u64,
    /// The end of the wait, set when it begins: drains that exist then end before it; one that
    /// begins later does not stretch it.
    until: Option<Instant>,
}

impl Drains {
    fn new(need: u64) -> Self {
        Self { need, until: None }
    }

    /// Waits for the next free after `seen` when the request would fit without the draining
    /// bytes; false when there is nothing to wait for (or the wait is over). The bytes of
    /// connections whose process has exited count as draining: their threads may not have
    /// read the end of their streams yet (seen: a SIGKILLed sibling's bytes still held, not
    /// yet draining, when a racer's context was refused beside them on a loaded host).
    fn wait(&mut self, arb: &Arbiter, b: &TenantBinding, seen: u64) -> bool {
        let (draining, usage) = arb.with_ledger(|l| (l.draining(b.key), l.usage(b.key)));
        let Some(u) = usage.filter(|u| !u.closed) else {
            return false;
        };
        let draining = draining.saturating_add(arb.exited_held(b.key));
        let room_after = u.limit.saturating_sub(u.in_use.saturating_sub(draining));
        if draining == 0 || self.need > room_after {
            return false;
        }
        // A little past the bound: the last drain's release and its wake-up come after it.
        let until = *self.until.get_or_insert_with(|| {
            Instant::now() + crate::drain::DRAIN_BOUND + std::time::Duration::from_millis(200)
        });
        if Instant::now() >= until {
            return false;
        }
        arb.pressure().wait_freed(seen, until);
        true
    }
}

/// True when the peer of socket `fd` has hung up (checked without waiting).
fn hung_up(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `pfd` is a valid pollfd array of length 1 and `fd` the caller's open socket; a
    // zero timeout never blocks.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Longest a press waits for the answers of processes that owed none before it. A live
/// interposer answers at once, so a late answer is a busy host, not memory in use (beside a CPU
/// hog one came after the 50 ms memory wait, and a sibling was refused the credit it was about
/// to give back). A process still silent from an earlier round (stopped) is waited for only up
/// to the memory wait, so it costs this once, not at every refusal.
const PRESS_ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Presses every other process of the allocation that holds bytes, and waits for their
/// answers: until `deadline`, and for those that answered the previous press, up to
/// [`PRESS_ANSWER_WAIT`] if that is later. False when no other process holds anything.
fn press_others(arb: &Arbiter, b: &TenantBinding, conn: ConnId, deadline: Instant) -> Pressing {
    let targets = arb.with_ledger(|l| l.others_holding(b.key, conn));
    if targets.is_empty() {
        return Pressing::Nobody;
    }
    let hub = arb.pressure();
    let round = hub.press(b.key, &targets);
    if round.sent > 0 {
        hub.wait_fresh(round, deadline.max(Instant::now() + PRESS_ANSWER_WAIT));
        hub.wait(round, deadline);
    }
    if round.channels > 0 {
        Pressing::Channels
    } else {
        Pressing::NoChannel
    }
}

/// Whom [`press_others`] found holding bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pressing {
    /// Nobody else holds anything.
    Nobody,
    /// Others hold bytes, none of them with a pressure channel (no credit to give back).
    NoChannel,
    /// Others hold bytes, some with a pressure channel (pressed now, or lately).
    Channels,
}

#[cfg(test)]
mod tests;
