//! NVML return codes and struct layouts: `tessera-cuda-abi`, re-exported.

pub use tessera_cuda_abi::nvml::*;
pub use tessera_cuda_abi::nvml_mig::*;
