//! Cross-process state of Tessera's simulated GPUs, shared by the simulated `libcuda.so.1`,
//! the simulated `libnvidia-ml.so.1`, the `tessera sim` command and tests.
//!
//! Everything lives in one state folder (`TESSERA_SIM_DIR`, default [`default_state_dir`]):
//! - `procs/<pid>`: one record per process using the simulated GPUs (memory in use and engine
//!   busy time per device), OFD-locked by its owner so readers can tell dead records
//!   (`procs/<pid>.<n>` for a second copy of the driver in the same process).
//! - `mem.lock`: serialises allocation check-and-add across processes; its first 8 bytes count
//!   allocations, so a reading of the card is one instant's (see `generation`).
//! - `engine<N>`: the execution engine of device N (flock held while a kernel runs) and its
//!   busy-time counters.
//! - `events`: injected XID events.
//! - `lib/`: symlinks `libcuda.so.1` etc. to the built simulated libraries.
//! - `machine`: the GPU spec of the running machine, read-locked by every process that
//!   `tessera sim` started there.
//! - `driver.sock`, `driver.pidns`: the machine's kernel side, which tells a process in a
//!   container its host pid (served by `tessera sim`).
//!
//! Modules:
//! - [`spec`]: `TESSERA_SIM_GPUS` and `TESSERA_SIM_(FURTHER_)CONTEXT_MEMORY` parsing and per-GPU identity
//!   (UUID, name, PCI bus id).
//! - [`dirs`]: state folder and library folder layout.
//! - [`ledger`]: per-process records; global memory accounting; usage readers.
//! - [`shared`]: shareable VMM allocations, held by several processes, counted once.
//! - [`engine`]: the per-device execution engine and its busy-time history.
//! - [`timeslice`]: the rules by which an engine time-slices between contexts (pure).
//! - [`events`]: XID event injection and reading.
//! - [`machine`]: the running machine's spec, shared by every `tessera sim` of one folder.
//! - [`mig`]: MIG on the modelled parts (`1xH200`): profile tables, GPU and compute instances,
//!   kept in `mig` (under `mig.lock`) for every process.
//! - [`profiles`]: the modelled parts (H100 80GB, H200) and their MIG profile tables: pure data,
//!   named by [`spec`] and used by [`mig`].
//! - [`driver`]: each process's host pid (what records, engine slots and NVML carry), from
//!   `getpid()` or, in a container, from the server of `driver.sock`; whether a pid lives.
//! - [`clock`]: the machine-wide monotonic clock every process stamps with.

pub mod clock;
pub mod dirs;
pub mod driver;
pub mod engine;
pub mod events;
mod generation;
#[cfg(test)]
mod generation_tests;
pub mod ledger;
pub mod machine;
pub mod mig;
pub mod profiles;
pub mod shared;
pub mod spec;
pub mod timeslice;

pub use dirs::{
    DirsError, default_state_dir, find_built_lib_dir, prepare_lib_dir, state_dir_from_env,
};
pub use driver::{Broker, DriverError, Identity, host_pid, identity};
pub use engine::{Engine, EngineError, device_busy_ns, device_utilization, process_busy_ns};
pub use events::{EventsError, XidEvent, inject_xid, read_xid_events};
pub use ledger::{
    Ledger, LedgerError, ProcessUsage, device_memory_used, instance_memory_used, read_processes,
};
pub use machine::{MachineError, MachineHold};
pub use shared::SharedHold;
pub use spec::{
    GpuInfo, SimSpec, SpecError, context_memory_from_env, further_context_memory_from_env,
    parse_context_memory,
};

/// Environment variable naming the GPUs to simulate, e.g. `2x80GiB` or `1x16GiB,1x24GiB`.
pub const ENV_GPUS: &str = "TESSERA_SIM_GPUS";
/// Environment variable naming the shared state folder.
pub const ENV_DIR: &str = "TESSERA_SIM_DIR";
/// Environment variable naming the folder holding the built simulated libraries.
pub const ENV_LIB_DIR: &str = "TESSERA_SIM_LIB_DIR";
/// Environment variable naming the device memory a process's first context on a device costs,
/// e.g. `300MiB` (unset, empty or `0`: none).
pub const ENV_CONTEXT_MEMORY: &str = "TESSERA_SIM_CONTEXT_MEMORY";
/// Environment variable naming the device memory each further context of a process on the
/// same device costs (a `cuCtxCreate` beside the primary context, or a second one); unset: the
/// same as the first, since each context the driver makes has device state of its own.
pub const ENV_FURTHER_CONTEXT_MEMORY: &str = "TESSERA_SIM_FURTHER_CONTEXT_MEMORY";
/// The context memory test beds and `tessera sim` use unless told otherwise: what a context
/// costs on a real card.
pub const MODELED_CONTEXT_MEMORY: &str = "300MiB";
/// Environment variable setting time-slicing between processes on a simulated device, as a
/// GPU without MPS does (unset or `on`: the defaults, 1 ms slices and 50 us switches;
/// `QUANTUM[,SWITCH]` such as `2ms,30us`; see [`timeslice::Params::parse`]). `off`: each
/// kernel runs whole, first come first served (the engine before time-slicing).
pub const ENV_TIMESLICE: &str = "TESSERA_SIM_TIMESLICE";
/// The GPUs simulated when `TESSERA_SIM_GPUS` is unset.
pub const DEFAULT_GPUS: &str = "1x80GiB";
/// Most devices one simulated machine can have (fixed so records have a fixed layout).
pub const MAX_GPUS: usize = 16;
