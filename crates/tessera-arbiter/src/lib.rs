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
//! The daemon (`src/main.rs`) parses a [`config::Config`], discovers GPUs and runs a
//! [`server::Server`] until SIGTERM or SIGINT. Logs go through `tracing` (levels from
//! `RUST_LOG`, `--log-format text|json`; set up by `tessera-log`).

pub mod admin;
pub mod admission;
pub mod backstop;
pub mod config;
pub mod drain;
pub mod gpus;
pub mod ledger;
pub mod metrics;
pub mod owner;
pub mod peer;
pub mod pressure;
pub mod reaper;
pub mod scheduler;
pub mod server;
pub mod state;
pub mod stats;
pub mod store;
pub mod tenant;
pub mod users;
pub mod wire;
