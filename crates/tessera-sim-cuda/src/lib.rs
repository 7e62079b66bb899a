//! The simulated CUDA driver: built as `libtessera_sim_cuda.so` and loaded as `libcuda.so.1`.
//!
//! Devices, memory and engine time are shared between processes through `tessera-sim-state`
//! (folder `TESSERA_SIM_DIR`, GPUs `TESSERA_SIM_GPUS`). Kernels do no work: the first kernel
//! parameter, read as a u64, is the nanoseconds of engine time a launch occupies.
//!
//! Modules:
//! - [`ffi`]: the CUDA driver ABI (`tessera-cuda-abi`, re-exported) and the simulator's `Handle`.
//! - [`runtime`]: process-wide state after `cuInit`, handle registries, the panic guard.
//! - [`errors`]: `cuGetErrorName` / `cuGetErrorString`.
//! - [`device`]: device queries and attributes.
//! - [`context`]: primary and explicit contexts, the per-thread context stack, and the clean-ups
//!   other modules register for a destroyed context.
//! - [`queue`]: streams (a worker thread each), events, the engine hand-off, captures.
//! - [`stream`]: the stream and event entry points; stream handles in the current context.
//! - [`memory`]: the address-range table, allocations, pools, pointer attributes.
//! - [`copy`]: 1D and 2D copies and memsets.
//! - [`vmm`]: virtual memory management (`cuMemCreate`, reservations, `cuMemMap`, access).
//! - [`array`]: CUDA arrays and mipmapped arrays (charged, not backed).
//! - [`module`]: PTX modules, functions and kernel launches.
//! - [`graph`]: CUDA graphs with kernel and host nodes, and stream capture.
//! - [`capture_mode`]: capture interaction modes: a potentially unsafe call during a global
//!   capture fails and invalidates it, as on a card.
//! - [`proc_address`]: the name table behind `cuGetProcAddress(_v2)`.
//!
//! The modules form no import circle (checked for every crate by `tessera-testkit`'s `import_cycles` test).

// The exported entry points' safety contract is the vendor's C API documentation (valid
// pointers of the documented types); restating it on each of them adds nothing.
#![allow(clippy::missing_safety_doc)]

pub mod array;
pub mod capture_mode;
pub mod context;
pub mod copy;
pub mod device;
pub mod errors;
pub mod ffi;
pub mod graph;
pub mod memory;
pub mod module;
pub mod proc_address;
pub mod queue;
pub mod runtime;
pub mod stream;
pub mod vmm;
