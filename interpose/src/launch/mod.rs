//! Compute sharing: every kernel launch is gated on a time-slice lease from the arbiter
//! (contract in docs/arbiter.md and docs/interposer.md, "Compute sharing").
//!
//! - **Fast path**: a launch takes one credit (`fetch_sub` on one atomic) and notes its stream
//!   through a per-thread cache; no lock, no allocation, no round trip. Credits exist only while
//!   the process holds a lease, and are handed out so that the estimated GPU work in flight
//!   never exceeds the time left in the lease: launches are not GPU time (a stream buffers
//!   about a thousand of them), so counting them alone would not bound anything.
//! - **Slow path**: without a credit, the first such launcher asks for a lease on the process's
//!   dedicated arbiter connection (`LeaseAcquireTiered`, once, however many threads wait; the
//!   others wait on a condition variable), receives the grant, hands out the first credits and
//!   launches: the grant wakes the thread that launches. It passes the lease to the process's
//!   manager thread, which samples every stream used with events while the lease lasts,
//!   estimates per-launch GPU time (an EWMA of event-measured durations per stream), and
//!   refills credits every tick.
//! - **Lease end** (deadline, noticed by the manager, never by an application thread): credits
//!   drop to zero, an event is recorded on every stream used during the lease, and once they
//!   completed `LeaseRelease` reports the real time the work occupied the GPU (from the grant
//!   to the completion of the last event: overrun included). The drain is polled with a bound,
//!   so a host callback waiting on a blocked launcher, or a thread blocked in
//!   `cuCtxSynchronize`, can delay the report but never deadlock it.
//! - **Early hand-back**: when the process launched nothing for [`IDLE`](lease::IDLE) and its streams have
//!   stayed drained (`cuEventQuery`) for [`DRAIN_IDLE`](lease::DRAIN_IDLE), the lease is returned early
//!   (`early = true`). Once launches stop the manager looks every [`DRAIN_TICK`](lease::DRAIN_TICK), and a
//!   `cuStreamSynchronize` / `cuCtxSynchronize` / `cuEventSynchronize` returning meanwhile wakes
//!   it at once (the hooks only notify; they never wait on the lease). The last stretch before
//!   the hand-back is spun through rather than slept (see [`SPIN`](lease::SPIN)), so a waiting tenant starts
//!   well within 2 ms of the holder's last work completing; counting from the drain (not from
//!   the last launch) keeps a busy tenant that synchronises and launches again at once from
//!   looking idle.
//! - **Used-up lease**: when nothing is in flight and too little of the lease is left for one
//!   more launch, the lease ends then rather than at its deadline (the GPU would idle). In both
//!   cases, with every stream seen drained and no credit taken since, the report goes out at
//!   once: there is nothing to wait for.
//! - **Arbiter unreachable** (its socket cannot be connected: it is down): the manager grants
//!   itself local leases of [`LOCAL_LEASE`], so tenants keep running and the work in flight
//!   stays bounded exactly as under a real lease; each new lease first tries the arbiter again,
//!   and real leases resume as soon as it is back. (Only a driver without events, where nothing
//!   can be measured, is left ungated.)
//! - **Arbiter up but not admitting** (a flood fills its caps, it closes the handshake): never
//!   taken for unreachable. The launch waits and the manager retries with backoff; no local
//!   lease, which would be GPU time the arbiter's backstop charges and kills for. The lease
//!   connection is opened as a companion of the process's admitted memory connection (a
//!   ticket from it), which the arbiter's caps do not count again.
//!
//! Per-thread default streams (`_ptsz` with stream 0, `CU_STREAM_PER_THREAD`) belong to the
//! launching thread and cannot be named from the manager thread: they are sampled through the
//! legacy default stream, which waits for all blocking streams of the context.
//!
//! Modules:
//! - [`gate`]: the credit fast path, the stream slots, and a launch's slow path to a lease.
//! - [`lease`]: the lease rules as a pure state machine (time passed in, no I/O).
//! - [`events`]: the driver's context and event functions behind a trait (a fake for tests).
//! - `manager`: the manager thread that runs each lease: socket, driver, clock.
//!
//! Imports run one way, `manager` -> `gate` -> `lease`, `events`: the gate reaches its manager
//! through the `gate::Manage` trait, wired up in [`Gate::new`].

pub mod events;
pub mod gate;
pub mod lease;
mod manager;

pub use gate::{Gate, GateStats, MAX_STREAMS, Slot, StreamKind, classify, reset_in_child};
pub use lease::LOCAL_LEASE;

impl Gate {
    /// A gate that will lease from the arbiter at `socket` with `token`.
    pub fn new(socket: Option<std::path::PathBuf>, token: String) -> Self {
        Gate::with_manager(socket, token, manager::new_manager)
    }
}
