//! The simulated NVML: built as `libtessera_sim_nvml.so`, loaded as `libnvidia-ml.so.1`.
//!
//! Reads the same shared state as the simulated driver (`TESSERA_SIM_DIR`, `TESSERA_SIM_GPUS`):
//! memory in use and running processes from the ledger, utilization from the engines' busy
//! history, XID events from the injected event file.
//!
//! Modules:
//! - [`ffi`]: NVML return codes and struct layouts (`nvml.h`).
//! - [`api`]: the exported `nvml*` entry points.
//! - [`api::mig`] (a part of `api`, sharing its state and helpers): the MIG API (modes, GPU and compute instances, MIG device handles) and the
//!   privilege rule for aggregate queries on a parent with MIG on.

// The exported entry points' safety contract is the vendor's C API documentation (valid
// pointers of the documented types); restating it on each of them adds nothing.
#![allow(clippy::missing_safety_doc)]

pub mod api;
pub mod ffi;
