//! What Tessera's two kubelet plugins share on a node: the device plugin
//! (`tessera-device-plugin`, `tessera.dev/gpu-shares`) and the DRA driver (`tessera-dra`,
//! `gpu.tessera.dev`) both talk to the node's arbiter over its admin socket, write the
//! per-container identity files, install the interposer on the host, watch the GPUs' health
//! and take the same node flags. Neither plugin depends on the other; both depend on this.
//!
//! Modules (the items listed are the crate's public surface; the rest is private or
//! `pub(crate)`):
//! - [`args`]: [`NodeArgs`], the flags both binaries declare once (`--admin-socket`,
//!   `--tenant-socket`, `--container-socket-dir`, `--host-lib-dir`, `--host-identity-dir`,
//!   `--interposer`, `--container-lib-path`, `--nvml-lib`, `--log-format`, `--gpus`),
//!   flattened into each binary's own.
//! - [`gpu_filter`]: [`GpuFilter`], the GPUs a plugin offers (`--gpus`: NVML indexes or UUIDs,
//!   or `all`), [`gpu_filter::GpuFilterError`]; the health watcher applies it to its list.
//! - [`arbiter`]: the [`arbiter::Arbiter`] trait (the admin calls the plugins make,
//!   implemented by the admin client), [`arbiter::ArbiterError`], [`arbiter::with_admin`]
//!   (blocking calls from async code); `arbiter::fake::{FakeArbiter, Call}`, an in-memory
//!   arbiter for unit tests (feature `fake`).
//! - [`identity`]: the per-container identity files (token, socket) on the host:
//!   [`identity::write`], [`identity::sweep`], [`identity::IdentityError`].
//! - [`install`]: versioned, never-overwritten installation of the interposer on the host:
//!   [`install::find_interposer`], [`install::install`], [`install::Installed`],
//!   [`install::InstallError`], [`install::INTERPOSER_FILE`].
//! - [`health`]: the node's GPUs from NVML (XID events, vanished devices) or the arbiter,
//!   those a [`GpuFilter`] admits: [`health::start`], [`health::GpuSource`],
//!   [`health::GpuState`], [`health::Snapshot`], [`health::HealthError`] (which XIDs mean a
//!   failed card is the module's own rule).
//! - [`cdi`]: [`cdi::CdiKind`], the CDI kind of the node's NVIDIA spec (`--nvidia-cdi-kind`),
//!   checked as the CDI parser checks it ([`cdi::CdiKindError`]).
//! - [`labels`]: who made an allocation: [`labels::LABEL_OWNER`] and its values
//!   [`labels::OWNER_DEVICE_PLUGIN`], [`labels::OWNER_DRA`].
//! - [`grpc`]: [`grpc::connect_unix`] (a gRPC channel over a Unix socket, with a deadline,
//!   [`grpc::ConnectError`]) and [`grpc::error_chain`] (an error and its sources on one line).
//! - [`shutdown`]: [`shutdown::watch`], SIGTERM or SIGINT, watched from before the sockets are bound.
//! - [`nvml_mig`]: NVML's MIG calls nvml-wrapper lacks (profiles and placements, GPU and
//!   compute instances), safe over the raw symbols: [`nvml_mig::MigNvml`],
//!   [`nvml_mig::MigNvmlError`].

// Unsafe only in `nvml_mig` (raw NVML symbols nvml-wrapper lacks, each call with its SAFETY
// note); everywhere else it is refused.
#![deny(unsafe_code)]

pub mod arbiter;
pub mod args;
pub mod cdi;
pub mod gpu_filter;
pub mod grpc;
pub mod health;
pub mod identity;
pub mod install;
pub mod labels;
#[allow(unsafe_code)]
pub mod nvml_mig;
pub mod shutdown;

pub use args::NodeArgs;
pub use gpu_filter::GpuFilter;
