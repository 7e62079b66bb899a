//! Tessera's per-node arbiter: the authority on GPU memory limits and compute shares.
//!
//! Modules:
//! - [`admission`]: admission before cost: handshakes on the runtime under one deadline and a
//!   small frame limit, pending places per container (oldest dropped first), admitted places
//!   per allocation with guaranteed room, companion connections, refusal counters.
//! - [`backstop`]: the memory backstop: NVML's per-process memory, attributed to allocations by
//!   connected pids and their descendants, over-limit processes killed or reported.
//! - [`config`]: command-line and environment configuration.
//! - [`drain`]: a closed connection's memory released on the card's word (its process's exit,
//!   then NVML), bounded.
//! - [`gpus`]: GPU discovery (NVML through `nvml-wrapper`, or a fixed list for tests).
//! - [`ledger`]: the memory ledger (pure): atomic reserve, release, redeclare, connection drop.
//! - [`metrics`]: Prometheus metrics on `--metrics-addr`: a collector rendering the state's
//!   [`stats`] at scrape time, and the small HTTP server.
//! - [`owner`]: allocations owned by a process (`tessera run`): its descendants attributed to
//!   it, and when the allocation may go (pure rules).
//! - [`peer`]: naming a process by pid and start time, and a tenant connection's process by its
//!   pidfd.
//! - [`reaper`]: deletes owned allocations once the owner and all their processes are gone.
//! - [`stats`]: what the arbiter counts and samples (backstop actions, refusals, requests by
//!   kind, scrape samples), owned by the state and rendered by [`metrics`].
//! - [`pressure`]: taking unused memory credit back from an allocation's other processes
//!   before a reservation is refused (tickets, pressure channels, the wait).
//! - [`store`]: persistence of allocations (atomic JSON file), ids and tokens.
//! - [`scheduler`]: compute sharing: per-GPU lease scheduling (WFQ, caps, revocation).
//! - [`state`]: the shared state tying GPUs, allocations, ledger and schedulers together;
//!   admin operations (create, list, delete).
//! - [`wire`]: async framing helpers shared by the socket servers.
//! - [`tenant`]: the tenant socket server (one thread per admitted connection).
//! - [`admin`]: the admin socket server.
//! - [`users`]: a shared workstation's users: the user socket (group, quotas, the caller the
//!   kernel names) and what a user may do there.
//! - [`server`]: start-up and shutdown wiring.
//!
//! Every module is private and its items `pub(crate)`. The public surface, re-exported at
//! the root for the daemon, the integration tests and the benchmarks: [`Config`], [`Server`],
//! [`Arbiter`] (its constructor, `create`, `gpus`, and the device refresh the MIG tests
//! drive), [`Store`], GPU discovery ([`GpuDiscovery`], [`NvmlDiscovery`], [`mig_index`]), the
//! backstop's device reader and killer ([`GpuSource`], [`NvmlSource`], [`Killer`], [`Sigkill`],
//! [`Held`]), [`SchedulerParams`] and [`STILL_PRESSED`], with their errors.
//!
//! The daemon (`src/main.rs`) parses a [`Config`], discovers GPUs and runs a [`Server`] until
//! SIGTERM or SIGINT. Logs go through `tracing` (levels from
//! `RUST_LOG`, `--log-format text|json`; set up by `tessera-log`).

mod admin;
mod admission;
mod backstop;
mod config;
mod drain;
mod gpus;
mod ledger;
mod metrics;
mod owner;
mod peer;
mod pressure;
mod reaper;
mod scheduler;
mod server;
mod state;
mod stats;
mod store;
mod tenant;
mod users;
mod wire;

// The public surface: what the daemon's `main.rs`, the integration tests and the benchmarks
// use. Everything else is `pub(crate)`, so the compiler reports what nothing uses.
pub use backstop::{GpuSource, Held, Killer, NvmlSource, Sigkill};
pub use config::{Config, ConfigError, DEFAULT_ADMIN_SOCKET, DEFAULT_SOCKET, DEFAULT_STATE_DIR};
pub use gpus::{GpuDiscovery, GpusError, NvmlDiscovery, mig_index};
pub use pressure::STILL_PRESSED;
pub use scheduler::SchedulerParams;
pub use server::{Server, ServerError};
pub use state::{Arbiter, StateError};
pub use store::{Store, StoreError};
