//! Tessera's Kubernetes device plugin: advertises each GPU as `--shares-per-gpu` units of an
//! extended resource (default `tessera.dev/gpu-shares`, 100 per GPU), keeps a request on one
//! GPU, and turns the kubelet's `Allocate` into an arbiter allocation plus the container
//! wiring (token, tenant socket, preloaded interposer). With `--latency-shares N`, N of each
//! GPU's units are a second resource (`tessera.dev/gpu-latency-shares`) whose allocations are
//! latency-tier.
//!
//! Modules:
//! - [`proto`]: generated gRPC code for the kubelet's device plugin `v1beta1` and PodResources
//!   `v1` APIs (from `proto/`, by `build.rs`).
//! - [`units`]: pure rules: unit ids, best-fit placement, whole-GPU requests, allocation
//!   labels, memory and share for a number of units, the pools of a latency split.
//! - [`health`]: the node's GPUs from NVML (XID events, vanished devices) or the arbiter.
//! - [`identity`]: the per-container identity files (token, socket) mounted read-only.
//! - [`install`]: versioned, never-overwritten installation of the interposer on the host.
//! - [`kubelet`]: gRPC over Unix sockets, registration, socket identities (restart watch).
//! - [`arbiter`]: the [`arbiter::Arbiter`] trait (the admin calls the plugin makes, implemented
//!   by the admin client and, in unit tests, by an in-memory fake); blocking calls from async
//!   code.
//! - [`allocate`]: the `Allocate` logic over that trait: plan, replace, create all or none,
//!   identity files, container responses; one typed error.
//! - [`cdi`]: the node's NVIDIA CDI devices named in the answer (`--nvidia-cdi-kind`), for
//!   runtimes that read CDI and not `NVIDIA_VISIBLE_DEVICES`.
//! - [`server`]: the `DevicePlugin` service, a thin gRPC adapter (ListAndWatch, preferred
//!   allocation, Allocate over [`allocate`]).
//! - [`podresources`]: pod names for allocations, stale clean-up and the refusal of a
//!   container holding both resources, from the PodResources `List`.
//! - [`metrics`]: the plugin's Prometheus metrics and their `/metrics` endpoint.
//! - [`plugin`]: configuration and the serve / register / re-register life cycle (one socket
//!   and registration per resource).

#![forbid(unsafe_code)]

pub mod allocate;
pub mod arbiter;
pub mod cdi;
pub mod health;
pub mod identity;
pub mod install;
pub mod kubelet;
pub mod metrics;
pub mod plugin;
pub mod podresources;
pub mod proto;
pub mod server;
pub mod units;

pub use plugin::{Config, PluginError, SourceKind, run};
