//! Tessera's Kubernetes device plugin: advertises each GPU as `--shares-per-gpu` units of an
//! extended resource (default `tessera.dev/gpu-shares`, 100 per GPU), keeps a request on one
//! GPU, and turns the kubelet's `Allocate` into an arbiter allocation plus the container
//! wiring (token, tenant socket, preloaded interposer). With `--latency-shares N`, N of each
//! GPU's units are a second resource (`tessera.dev/gpu-latency-shares`) whose allocations are
//! latency-tier.
//!
//! What it shares with the DRA driver (`tessera-dra`) is in `tessera-node`: the arbiter client
//! ([`tessera_node::arbiter::Arbiter`], blocking calls from async code, the unit tests' fake),
//! identity files, interposer installation, the GPU health watcher, the CDI kind, the owner
//! label, gRPC over Unix sockets, the shutdown signal and the shared flags
//! ([`tessera_node::NodeArgs`]).
//!
//! Modules:
//! - [`proto`]: generated gRPC code for the kubelet's device plugin `v1beta1` and PodResources
//!   `v1` APIs (from `proto/`, by `build.rs`).
//! - [`units`]: pure rules: unit ids, best-fit placement, whole-GPU requests, allocation
//!   labels, memory and share for a number of units, the pools of a latency split.
//! - [`kubelet`]: registration, socket identities (restart watch).
//! - [`allocate`]: the `Allocate` logic over the arbiter trait: plan, replace, create all or
//!   none, identity files, container responses; one typed error.
//! - [`cdi`]: the node's NVIDIA CDI devices named in the answer (`--nvidia-cdi-kind`), for
//!   runtimes that read CDI and not `NVIDIA_VISIBLE_DEVICES`.
//! - [`server`]: the `DevicePlugin` service, a thin gRPC adapter (ListAndWatch, preferred
//!   allocation, Allocate over [`allocate`]).
//! - [`podresources`]: pod names for allocations, stale clean-up and the refusal of a
//!   container holding both resources, from the PodResources `List`.
//! - [`metrics`]: the plugin's Prometheus metrics and their `/metrics` endpoint.
//! - [`plugin`]: configuration and the serve / register / re-register life cycle (one socket
//!   and registration per resource).
//!
//! Public surface (the binary's `main.rs` and the integration tests; the modules are
//! `pub(crate)`): [`Config`], [`SourceKind`], [`PluginError`], [`run`], [`install_interposer`],
//! [`DEFAULT_METRICS_ADDR`], [`parse_metrics_addr`], and [`proto`] (the fake kubelet of the
//! tests speaks it).

#![forbid(unsafe_code)]

pub(crate) mod allocate;
pub(crate) mod cdi;
pub(crate) mod kubelet;
pub(crate) mod metrics;
pub(crate) mod plugin;
pub(crate) mod podresources;
pub mod proto;
pub(crate) mod server;
pub(crate) mod units;

pub use metrics::{DEFAULT_ADDR as DEFAULT_METRICS_ADDR, parse_addr as parse_metrics_addr};
pub use plugin::{Config, PluginError, SourceKind, install_interposer, run};
