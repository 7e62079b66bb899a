//! Compute sharing: per-GPU time-slice leases (the contract and the policy in prose:
//! `docs/compute.md`).
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
//!   `max(own vtime, min vtime of the active ones)`, so it banks no credit while idle (a
//!   pause shorter than [`SchedulerParams::idle_after_ns`] after a lease is not idleness); all
//!   processes of an allocation share its vtime, cap and history;
//! - a capped allocation has a token bucket filled at `cap`% of wall time (depth
//!   [`SchedulerParams::bucket_depth_ns`]) and a cap window: its GPU time of the last
//!   [`SchedulerParams::cap_window_ns`], plus its largest recent overrun, plus the new lease,
//!   must fit in `cap`% of the window (plus [`SchedulerParams::cap_window_slack_ns`]). It is
//!   eligible when both leave room for the lease it would get uncapped (so its leases are as
//!   long as its competitors'), or for a minimal one when the others waiting could not take a
//!   whole lease either; even alone on the GPU;
//! - the charge of a lease is `max(reported busy_ns, wall time the lease was held)`: the GPU
//!   was reserved for the holder all that time, and a tenant cannot lower its charge by
//!   under-reporting;
//! - lease length adapts per allocation between `min_lease_ns` and `max_lease_ns`: halved after
//!   an early hand-back, grown by a quarter after a lease used to its end; while other
//!   allocations wait it is at most `contended_lease_ns` so the split stays fine-grained;
//! - a lease not released by its deadline plus `grace_ns` is revoked and charged in full; a
//!   closed connection releases its lease (charged the wall time held);
//! - a lease the scheduler ended before its holder did (overdue, or revoked for a latency
//!   request) still counts as leased, and is charged, from then until the holder releases it,
//!   asks again or closes, for at most `revoked_drain_ns`: the holder stopped launching but
//!   drains what it launched in the lease, and that work (slowed by a neighbour's kernels, it
//!   can run long past the deadline) is the lease's, not GPU time outside leases;
//! - a holder whose lease ran to its end is still busy and asks again right after releasing:
//!   if it is next by virtual time, the GPU waits up to `rerequest_window_ns` for that request
//!   instead of going to a waiter that is further behind (an early hand-back never waits);
//! - tiers ([`Tier`], set by the operator): a latency allocation's share is its guarantee and
//!   its ceiling over the cap window (no bucket: its requests come in bursts); within that
//!   budget its requests are served before every best-effort one, and a best-effort lease
//!   outstanding when one becomes eligible is revoked at once ([`GpuScheduler::take_revocations`]
//!   names it for the holder). While a latency allocation is in use (a connection of it has asked for a lease and is
//!   open: [`GpuScheduler::latency_in_use`]), best-effort grants
//!   carry a bound on the predicted kernel time their holder keeps in flight
//!   ([`SchedulerParams::best_effort_inflight_ns`]), so a latency request waits about that long
//!   for the GPU, not a lease. Best-effort allocations get every other moment (work-conserving).
//!   A latency allocation that hands back early may keep the GPU for a short linger
//!   ([`SchedulerParams::latency_linger_ns`], off by default), charged to it and granted only
//!   while its cap window has room, so a request soon after the last one finds no
//!   best-effort kernel started in between.
//!
//! Layout (one concern per file; everything but the handle and the timer is pure):
//! - `params`: [`SchedulerParams`], the tunables.
//! - `gpu`: [`GpuScheduler`], one GPU's state, and the events that drive it (an allocation
//!   added or removed, a request, a release, a closed connection, a tick) and
//!   [`GpuScheduler::next_wakeup`]; [`Grant`], [`SchedulerError`].
//! - `alloc`: one allocation's state, built from the value types below.
//! - `queue`: weighted fair queueing on virtual time: the waiting requests, who is eligible,
//!   who is served next, the hold for a holder's re-request.
//! - `cap`: `CapMeter`, a capped allocation's token bucket and cap window (a value type with
//!   its own tests), and the room an allocation needs for a lease.
//! - `lease`: `LeaseLength` (adapted per allocation, a value type with its own tests), a
//!   lease's grant and end.
//! - `drains`: `Drains`, the leases the scheduler ended whose holders still drain them (a value
//!   type with its own tests).
//! - `latency`: the latency tier: tiers, revocations, latency waiters first, the linger.
//! - `usage`: charging GPU time, and what is read at scrape time ([`AllocStats`]).
//! - `handle`: [`SchedulerHandle`], the daemon's locked scheduler and its [`GrantSink`]s.
//! - `timer`: the tokio task ([`SchedulerHandle::run_timer`]) that ticks the scheduler at its
//!   next wake-up; the only code here that reads a clock.
//! - `tests`: scenario tests on a fake GPU and clock, and property tests (`tests::props`).

#![forbid(unsafe_code)]

mod alloc;
mod cap;
mod drains;
mod gpu;
mod handle;
mod latency;
mod lease;
mod params;
mod queue;
mod timer;
mod usage;

#[cfg(test)]
mod tests;

pub(crate) use gpu::{GpuScheduler, Grant, SchedulerError};
pub(crate) use handle::{GrantSink, SchedulerHandle};
pub use params::SchedulerParams;
pub(crate) use tessera_protocol::Tier;
pub(crate) use usage::AllocStats;
