//! The CUDA driver ABI (`tessera-cuda-abi`, re-exported) and the one name the simulator adds.

use std::ffi::c_void;

pub use tessera_cuda_abi::*;

/// Any opaque driver handle (context, stream, event, module, ...): the simulator hands out
/// registry ids cast to pointers.
pub type Handle = *mut c_void;
