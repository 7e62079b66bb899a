//! The CUDA driver (`cuda.h`) and NVML (`nvml.h`) C ABI as Tessera uses it, declared once for
//! the interposer, the simulated driver and NVML, `tessera doctor`, the examples and benches.
//!
//! Modules:
//! - [`cuda`]: driver types, `CUresult` codes, flags, struct layouts, function-pointer types.
//! - [`nvml`]: NVML types, `nvmlReturn_t` codes, struct layouts, function-pointer types.
//! - [`nvml_mig`]: NVML's MIG API: instance handles, profile constants, struct layouts.
//!
//! Layouts follow the CUDA 13 headers on 64-bit Linux, and each struct's size, alignment and
//! field offsets are checked at compile time against them. Status enums (`CUresult`,
//! `nvmlReturn_t`) and the enum-typed fields are C enums without negative values, which GCC and
//! Clang store as `unsigned int`: they are `u32` here, everywhere.
//!
//! Everything is re-exported at the crate root, so `use tessera_cuda_abi::*` reads like the C
//! headers.

#![allow(non_camel_case_types)]
#![forbid(unsafe_code)]

/// Compile-time check of a `#[repr(C)]` struct against its C layout: size, alignment and the
/// offset of each named field.
macro_rules! layout {
    ($t:ty, size $size:expr, align $align:expr $(, $field:ident @ $off:expr)* $(,)?) => {
        #[cfg(target_pointer_width = "64")]
        const _: () = {
            assert!(::core::mem::size_of::<$t>() == $size);
            assert!(::core::mem::align_of::<$t>() == $align);
            $(assert!(::core::mem::offset_of!($t, $field) == $off);)*
        };
    };
}

pub mod cuda;
pub mod nvml;
pub mod nvml_mig;

pub use cuda::*;
pub use nvml::*;
pub use nvml_mig::*;
