//! Dev-only harness shared by the workspace's integration tests and benchmarks, so every suite
//! starts the same real binaries on the same simulated GPU the same way.
//!
//! Modules:
//! - [`artifacts`]: the cargo profile folder next to the running test (`<target>/debug/`) and
//!   the built binaries and libraries in it, with a clear message when one is missing.
//! - [`cgroup`]: child cgroups (v2) of a test's own, to put processes in separate containers
//!   as the arbiter sees them (per-container admission).
//! - [`container`]: a container emulated with `unshare` and `chroot` from container edits
//!   (mounts, environment), for `Allocate` answers and CDI specs alike.
//! - [`python`]: the Python with `cuda-bindings` used by real-client tests.
//! - [`sim`]: a simulated GPU in a temp folder (its `lib/` of driver links and its environment).
//! - [`apiserver`]: a stand-in Kubernetes API server (HTTP + JSON) for ResourceSlices and
//!   ResourceClaims, with the upstream slice validation rules the schema leaves out.
//! - [`arbiter`]: the real `tessera-arbiter` on a simulated GPU, with temp sockets and state,
//!   waited for until it serves.
//! - [`node`]: the kubelet plugins' end-to-end node (temp folder, simulated GPUs, the real
//!   arbiter, the plugin under test, logs printed on failure) and bounded awaits ([`within`],
//!   [`until`]).
//! - [`http`]: a plain HTTP GET (scraping a metrics endpoint) and reading one sample.
//! - [`process`]: kill-on-drop children, exit codes, polling with a timeout.
//! - [`alone`]: a test run again in a process of its own (one integration-test binary per
//!   crate; a test that sets what a process holds once must not share it).
//! - [`flood`]: a flood of unauthenticated connections against an arbiter socket (admission
//!   test, `arbiter_load`), and the `tessera-flood` binary that runs one as a process of its own.
//! - [`prometheus`]: the Prometheus server and `promtool` the metrics tests need (required:
//!   missing ones fail the test), and `promtool check metrics`.
//! - [`trap`]: the pid-reuse trap (a tenant connection kept open after its process exited) and
//!   starting a process at a given pid.
//!
//! Helpers panic with a message naming what is missing: they run inside tests, where a panic
//! is the failure report.

pub mod alone;
pub mod apiserver;
pub mod arbiter;
pub mod artifacts;
pub mod cgroup;
pub mod container;
pub mod flood;
pub mod http;
pub mod node;
pub mod process;
pub mod prometheus;
pub mod python;
pub mod sim;
pub mod trap;

pub use alone::alone;
pub use apiserver::FakeApiServer;
pub use arbiter::{ArbiterSpec, RunningArbiter, allocation, backstop_held_bytes};
pub use artifacts::{artifact, artifact_with_hint, target_dir};
pub use node::{NodeOptions, PluginNode, until, within};
pub use process::{FirstLine, KillOnDrop, code, spawn_first_line, wait_until};
pub use python::python;
pub use sim::SimGpu;

/// Bytes in a mebibyte.
pub const MIB: u64 = 1 << 20;
/// Bytes in a gibibyte.
pub const GIB: u64 = 1 << 30;
