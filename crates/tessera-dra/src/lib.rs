//! Tessera's DRA kubelet plugin for driver `gpu.tessera.dev`: the scheduler places GPU
//! fractions by consumable capacity (`shares`, `memory`), and this plugin turns each prepared
//! claim into an arbiter allocation with exactly that share and memory limit, enforced by the
//! interposer and the backstop.
//!
//! It shares with the device plugin, through `tessera-node` and not through the device plugin,
//! the arbiter client, identity files, interposer installation, GPU health watcher, CDI kind,
//! owner label, gRPC over Unix sockets, shutdown signal and the shared flags
//! (`tessera_node::{arbiter, identity, install, health, cdi, labels, grpc, shutdown, NodeArgs}`).
//!
//! Modules:
//! - [`proto`]: generated gRPC code for the kubelet's `dra/v1`, `dra/v1beta1` and
//!   `pluginregistration/v1`.
//! - [`quantity`]: exact parsing of Kubernetes quantities.
//! - [`claim`]: pure rules: a ResourceClaim's allocation results to planned allocations.
//! - [`slices`]: pure rules: this node's ResourceSlices (devices, capacities, attributes).
//! - [`mig`]: pure rules: MIG partitions as partitionable devices (counter sets, one device
//!   per profile and placement) or, in static mode, the existing instances.
//! - [`cdi`]: the per-claim CDI spec (interposer, preload, identity, visible devices).
//! - [`instances`]: MIG instances behind claims: created, shared by reference count, destroyed
//!   at the last unprepare, a checkpoint (`PrepareStarted`/`PrepareCompleted`) reconciled at start.
//! - [`prepare`]: prepare / unprepare over the arbiter, idempotent, the arbiter's labels as
//!   checkpoint.
//! - [`apiserver`]: the API server calls (get ResourceClaims; list, create, replace, delete
//!   ResourceSlices) behind a small trait, implemented with kube-rs.
//! - [`cleanup`]: pure rules: which prepared claims nothing uses any more.
//! - [`inventory`]: the node's GPUs and their attributes from NVML and sysfs.
//! - [`publish`]: keeps the node's ResourceSlice current; keeps it on shutdown (removes it
//!   only with `--remove-slices-on-exit`).
//! - [`authority`]: the registration socket's connections relayed with an `:authority` the
//!   HTTP/2 server takes (the kubelet's plugin watcher sends the socket's path).
//! - [`service`]: the `DRAPlugin` (v1, v1beta1) and `Registration` gRPC services.
//! - [`plugin`]: configuration and life cycle.
//!
//! Public: [`proto`], [`quantity`], [`slices`] and [`mig`] (the integration tests check the
//! plugin against them), [`run`] with its [`Config`], [`Connection`] and [`PluginError`], the
//! CDI spec's type ([`CdiSpec`]) and the labels a prepare leaves ([`LABEL_CLAIM`],
//! [`LABEL_CLAIM_UID`]). The other modules are private, their items `pub(crate)`.

#![forbid(unsafe_code)]

mod apiserver;
mod authority;
mod cdi;
mod claim;
mod cleanup;
mod instances;
mod inventory;
pub mod mig;
#[cfg(test)]
mod mig_tests;
mod plugin;
mod prepare;
pub mod proto;
mod publish;
pub mod quantity;
mod service;
pub mod slices;

// The public surface: the plugin (`main.rs`), and what the integration tests check it against
// (the generated protocol, the pure rules for slices, partitions and quantities, the CDI spec
// and the arbiter labels a prepare leaves). Everything else is `pub(crate)`.
pub use apiserver::Connection;
pub use cdi::Spec as CdiSpec;
pub use plugin::{Config, PluginError, run};
pub use prepare::{LABEL_CLAIM, LABEL_CLAIM_UID};
