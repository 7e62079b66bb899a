//! Raw C declarations: the dynamic loader, `pthread_atfork` and `pthread_setcancelstate`. The
//! CUDA driver and NVML types come from `tessera-cuda-abi`, re-exported here so every module
//! names the C ABI through `crate::ffi`.

#![allow(non_camel_case_types, dead_code)]

pub use tessera_cuda_abi::*;

use std::ffi::{c_char, c_int, c_void};

// ---- dynamic loader ----------------------------------------------------------------------

/// `RTLD_NEXT` is `((void *) -1)` in glibc.
pub const RTLD_NEXT: *mut c_void = usize::MAX as *mut c_void;
pub const RTLD_LAZY: c_int = 0x0001;
pub const RTLD_NOW: c_int = 0x0002;
pub const RTLD_NOLOAD: c_int = 0x0004;
pub const RTLD_LOCAL: c_int = 0;

/// `Dl_info` from `<dlfcn.h>`.
#[repr(C)]
pub struct Dl_info {
    pub dli_fname: *const c_char,
    pub dli_fbase: *mut c_void,
    pub dli_sname: *const c_char,
    pub dli_saddr: *mut c_void,
}

/// Signature of `dlsym`.
pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

unsafe extern "C" {
    pub fn dlvsym(
        handle: *mut c_void,
        symbol: *const c_char,
        version: *const c_char,
    ) -> *mut c_void;
    pub fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    pub fn dladdr(addr: *const c_void, info: *mut Dl_info) -> c_int;
    pub fn pthread_atfork(
        prepare: Option<unsafe extern "C" fn()>,
        parent: Option<unsafe extern "C" fn()>,
        child: Option<unsafe extern "C" fn()>,
    ) -> c_int;
    pub fn pthread_setcancelstate(state: c_int, oldstate: *mut c_int) -> c_int;
}

/// `PTHREAD_CANCEL_DISABLE` (glibc and musl).
pub const PTHREAD_CANCEL_DISABLE: c_int = 1;
