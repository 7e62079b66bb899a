//! The arbiter's integration tests, one binary (a binary per file was a link each on a 2-core
//! CI): each file a module. `mig_devices` stays a binary of its own: it sets the environment
//! the simulated NVML it loads reads.
//!
//! - `admission`: unauthenticated connections cost no thread, are dropped and capped.
//! - `arbiter`: the real binary over its sockets (allocations, ledger, limits, restarts).
//! - `leases`: compute leases through the tenant socket.
//! - `metrics`: a real Prometheus scraping the arbiter.
//! - `systemd`: the shipped unit, checked by systemd and the arbiter.
//! - `common`: the fixture that starts the real arbiter in a temporary folder.

mod admission;
mod arbiter;
mod common;
mod leases;
mod metrics;
mod systemd;
