//! Our `dlsym` and `cuGetProcAddress`, and the wrapper of every hooked variant they hand out.
//!
//! CUDA clients (the runtime, `cuda-bindings`) `dlopen("libcuda.so.1")` and `dlsym` their way
//! in: `dlsym(handle, ..)` never sees an `LD_PRELOAD` library's exports, so we override `dlsym`
//! itself. A hooked name (a CUDA or NVML function we count, or `cuGetProcAddress`) resolves to
//! our wrapper; everything else to the real answer. `cuGetProcAddress` results are mapped by
//! base name, version and flags (flag 2: the `_ptsz` variant) to the exact variant, whose real
//! pointer is stored and whose wrapper is handed out.
//!
//! `dlsym(RTLD_NEXT, ..)` depends on the caller's address: glibc searches the objects after the
//! one that called. On x86-64 a naked trampoline tail-jumps to the real `dlsym` for `RTLD_NEXT`
//! with the caller's return address intact, so such look-ups stay exact. On other
//! architectures `RTLD_NEXT` look-ups are answered relative to the interposer.
//!
//! [`WRAPPERS`] pairs each row of [`crate::table`] with its shim: the shims call through the
//! table, so the pairing sits here, above both, and no module below names a shim.

use std::ffi::{CStr, c_char, c_int, c_void};

use crate::contexts::hooks as c;
use crate::driver;
use crate::ffi::{
    CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS, CUresult, cuGetProcAddress_t, cuGetProcAddress_v2_t,
};
use crate::guard;
use crate::launch_hooks as l;
use crate::memory::hooks as m;
use crate::table::{self, HOOKS, Hook, HookId};
use crate::tlog;

/// Address of one of our wrappers (a plain code address, shareable between threads).
#[derive(Debug, Clone, Copy)]
pub struct Wrapper(pub *const c_void);

// SAFETY: a code address is immutable and valid for the life of the process.
unsafe impl Sync for Wrapper {}
// SAFETY: as above.
unsafe impl Send for Wrapper {}

/// Builds [`WRAPPERS`] by id, so the order of the list below does not matter; a missing or
/// repeated id leaves a null slot, which the tests catch.
macro_rules! wrappers {
    ($($id:ident => $f:path,)*) => {{
        const _: () = assert!([$(stringify!($id)),*].len() == HOOKS.len());
        let mut w = [Wrapper(std::ptr::null()); HOOKS.len()];
        $(w[HookId::$id as usize] = Wrapper($f as *const c_void);)*
        w
    }};
}

/// Our wrapper of each hooked variant, indexed by [`HookId`].
pub static WRAPPERS: [Wrapper; HOOKS.len()] = wrappers! {
    GetProcAddress => cuGetProcAddress,
    GetProcAddress_v2 => cuGetProcAddress_v2,
    MemAlloc_v2 => m::cuMemAlloc_v2,
    MemAllocPitch_v2 => m::cuMemAllocPitch_v2,
    MemAllocManaged => m::cuMemAllocManaged,
    MemAllocAsync => m::cuMemAllocAsync,
    MemAllocAsync_ptsz => m::cuMemAllocAsync_ptsz,
    MemAllocFromPoolAsync => m::cuMemAllocFromPoolAsync,
    MemAllocFromPoolAsync_ptsz => m::cuMemAllocFromPoolAsync_ptsz,
    MemCreate => m::cuMemCreate,
    MemRelease => m::cuMemRelease,
    MemMap => m::cuMemMap,
    MemUnmap => m::cuMemUnmap,
    MemAddressFree => m::cuMemAddressFree,
    MemRetainAllocationHandle => m::cuMemRetainAllocationHandle,
    MemImportFromShareableHandle => m::cuMemImportFromShareableHandle,
    ArrayCreate_v2 => m::cuArrayCreate_v2,
    Array3DCreate_v2 => m::cuArray3DCreate_v2,
    MipmappedArrayCreate => m::cuMipmappedArrayCreate,
    MemFree_v2 => m::cuMemFree_v2,
    MemFreeAsync => m::cuMemFreeAsync,
    MemFreeAsync_ptsz => m::cuMemFreeAsync_ptsz,
    ArrayDestroy => m::cuArrayDestroy,
    MipmappedArrayDestroy => m::cuMipmappedArrayDestroy,
    DevicePrimaryCtxRetain => c::cuDevicePrimaryCtxRetain,
    DevicePrimaryCtxRelease => c::cuDevicePrimaryCtxRelease,
    DevicePrimaryCtxRelease_v2 => c::cuDevicePrimaryCtxRelease_v2,
    DevicePrimaryCtxReset => c::cuDevicePrimaryCtxReset,
    DevicePrimaryCtxReset_v2 => c::cuDevicePrimaryCtxReset_v2,
    CtxCreate_v2 => c::cuCtxCreate_v2,
    CtxCreate_v3 => c::cuCtxCreate_v3,
    CtxCreate_v4 => c::cuCtxCreate_v4,
    CtxDestroy_v2 => c::cuCtxDestroy_v2,
    GreenCtxCreate => c::cuGreenCtxCreate,
    GreenCtxDestroy => c::cuGreenCtxDestroy,
    MemGetInfo_v2 => m::cuMemGetInfo_v2,
    DeviceTotalMem_v2 => m::cuDeviceTotalMem_v2,
    LaunchKernel => l::cuLaunchKernel,
    LaunchKernel_ptsz => l::cuLaunchKernel_ptsz,
    LaunchKernelEx => l::cuLaunchKernelEx,
    LaunchKernelEx_ptsz => l::cuLaunchKernelEx_ptsz,
    LaunchCooperativeKernel => l::cuLaunchCooperativeKernel,
    LaunchCooperativeKernel_ptsz => l::cuLaunchCooperativeKernel_ptsz,
    GraphLaunch => l::cuGraphLaunch,
    GraphLaunch_ptsz => l::cuGraphLaunch_ptsz,
    StreamDestroy_v2 => l::cuStreamDestroy_v2,
    StreamSynchronize => l::cuStreamSynchronize,
    StreamSynchronize_ptsz => l::cuStreamSynchronize_ptsz,
    CtxSynchronize => l::cuCtxSynchronize,
    CtxSynchronize_v2 => l::cuCtxSynchronize_v2,
    EventSynchronize => l::cuEventSynchronize,
    NvmlMemoryInfo => m::nvmlDeviceGetMemoryInfo,
    NvmlMemoryInfo_v2 => m::nvmlDeviceGetMemoryInfo_v2,
};

/// Our wrapper of `hook`.
#[inline]
pub fn wrapper(hook: &Hook) -> *mut c_void {
    WRAPPERS[hook.id as usize].0 as *mut c_void
}

/// True when `p` is one of our wrappers.
pub fn is_wrapper(p: *const c_void) -> bool {
    WRAPPERS.iter().any(|w| w.0 == p)
}

/// The `dlsym` logic for every handle but `RTLD_NEXT`.
///
/// # Safety
/// Same contract as `dlsym`: `symbol` is null or NUL-terminated.
pub unsafe extern "C" fn dlsym_hooked(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let Some(real) = driver::real_dlsym() else {
        return std::ptr::null_mut();
    };
    // SAFETY: forwarding the caller's arguments unchanged, under the same contract.
    let forward = || unsafe { real(handle, symbol) };
    if symbol.is_null() || guard::inside() {
        return forward();
    }
    // SAFETY: the caller passes a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    let Some(hook) = table::by_name(name) else {
        return forward();
    };
    if !crate::config::get().enforcing() {
        return forward();
    }
    let Some(_g) = guard::enter() else {
        return forward();
    };
    guard::no_unwind(std::ptr::null_mut(), || resolve_dlsym(hook, forward()))
}

/// Decides what `dlsym` returns for a hooked name whose real answer is `found`.
pub fn resolve_dlsym(hook: &'static Hook, found: *mut c_void) -> *mut c_void {
    if found.is_null() {
        // The handle does not have it: do not invent it.
        return found;
    }
    if is_wrapper(found) {
        return found;
    }
    // Fill every slot from the real library first, so `found` only fills gaps.
    driver::ensure(hook.lib);
    hook.adopt(found);
    tlog!(Trace, "dlsym({}) -> wrapper", hook.name.to_string_lossy());
    wrapper(hook)
}

/// What `cuGetProcAddress(symbol, .., version, flags)` hands out when the driver resolved it
/// to `found`.
pub fn resolve_proc(symbol: &[u8], version: c_int, flags: u64, found: *mut c_void) -> *mut c_void {
    if found.is_null() || is_wrapper(found) {
        return found;
    }
    let hook = table::by_base(symbol, version, flags).or_else(|| table::by_real(found));
    match hook {
        Some(h) => {
            h.adopt(found);
            tlog!(
                Trace,
                "cuGetProcAddress({}, {version}, {flags}) -> {} wrapper",
                String::from_utf8_lossy(symbol),
                h.name.to_string_lossy()
            );
            wrapper(h)
        }
        None => found,
    }
}

// ---- cuGetProcAddress ---------------------------------------------------------------------

/// Rewrites `*pfn` after a successful real `cuGetProcAddress`.
///
/// # Safety
/// `symbol` is NUL-terminated and `pfn` valid (both checked non-null by the caller).
unsafe fn after_proc(
    r: CUresult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) {
    if r != CUDA_SUCCESS || symbol.is_null() || pfn.is_null() {
        return;
    }
    if !crate::config::get().enforcing() {
        return;
    }
    // SAFETY: per the contract.
    unsafe {
        let name = CStr::from_ptr(symbol).to_bytes();
        *pfn = resolve_proc(name, version, flags, *pfn);
    }
}

/// `cuGetProcAddress` (CUDA 11.3 signature).
///
/// # Safety
/// C contract of `cuGetProcAddress`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    // SAFETY: the type is this entry point's signature; arguments are forwarded unchanged.
    let Some(real) = (unsafe { driver::real::<cuGetProcAddress_t>(HookId::GetProcAddress) }) else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarding unchanged.
    let r = unsafe { real(symbol, pfn, version, flags) };
    if let Some(_g) = guard::enter() {
        // SAFETY: pointers are checked inside; the driver just answered for them.
        guard::no_unwind((), || unsafe { after_proc(r, symbol, pfn, version, flags) });
    }
    r
}

/// `cuGetProcAddress_v2` (CUDA 12 signature, with the symbol status).
///
/// # Safety
/// C contract of `cuGetProcAddress_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    // SAFETY: as for cuGetProcAddress.
    let Some(real) = (unsafe { driver::real::<cuGetProcAddress_v2_t>(HookId::GetProcAddress_v2) })
    else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarding unchanged.
    let r = unsafe { real(symbol, pfn, version, flags, status) };
    if let Some(_g) = guard::enter() {
        // SAFETY: as for cuGetProcAddress.
        guard::no_unwind((), || unsafe { after_proc(r, symbol, pfn, version, flags) });
    }
    r
}

/// `dlsym` itself. On x86-64: `RTLD_NEXT` tail-jumps to glibc with the caller's return
/// address on the stack; anything else tail-jumps to [`dlsym_hooked`].
///
/// # Safety
/// Same contract as `dlsym`.
#[cfg(all(target_arch = "x86_64", not(test)))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "cmp rdi, -1",
        "jne {hooked}",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 2f",
        "jmp rax",
        "2:",
        // Cold path: resolve the real dlsym, keeping the two argument registers.
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {init}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 3f",
        "jmp rax",
        "3:",
        "xor eax, eax",
        "ret",
        hooked = sym dlsym_hooked,
        real = sym driver::REAL_DLSYM,
        init = sym driver::init_real_dlsym,
    )
}

/// `dlsym` itself (architectures without the trampoline).
///
/// # Safety
/// Same contract as `dlsym`.
#[cfg(all(not(target_arch = "x86_64"), not(test)))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    if handle == crate::ffi::RTLD_NEXT {
        return match driver::real_dlsym() {
            // SAFETY: forwarding unchanged.
            Some(real) => unsafe { real(handle, symbol) },
            None => std::ptr::null_mut(),
        };
    }
    // SAFETY: same contract.
    unsafe { dlsym_hooked(handle, symbol) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unhooked_names_pass_through() {
        // SAFETY: RTLD_DEFAULT (null) and a NUL-terminated name.
        let p = unsafe { dlsym_hooked(std::ptr::null_mut(), c"getpid".as_ptr()) };
        // SAFETY: RTLD_DEFAULT is a valid pseudo-handle.
        assert_eq!(p, unsafe {
            driver::lookup(std::ptr::null_mut(), c"getpid")
        });
        assert!(!p.is_null());
    }

    #[test]
    fn hooked_dlsym_answers() {
        let h = HookId::MemGetInfo_v2.hook();
        assert!(
            resolve_dlsym(h, std::ptr::null_mut()).is_null(),
            "absent stays absent"
        );
        let w = wrapper(h);
        assert_eq!(resolve_dlsym(h, w), w, "our own export is returned as is");
        let fake = 0x1234usize as *mut c_void;
        assert_eq!(resolve_dlsym(h, fake), w);
        // The slot now holds a real function (the fake unless a driver filled it first).
        assert!(!h.real_ptr().is_null());
        assert_ne!(h.real_ptr(), w);
    }

    #[test]
    fn proc_address_maps_variants_and_aliases() {
        let fake_async = 0x5000usize as *mut c_void;
        let got = resolve_proc(b"cuMemAllocAsync", 12000, 2, fake_async);
        assert_eq!(got, wrapper(HookId::MemAllocAsync_ptsz.hook()));
        let got = resolve_proc(b"cuMemAllocAsync", 12000, 0, 0x5008usize as *mut c_void);
        assert_eq!(got, wrapper(HookId::MemAllocAsync.hook()));
        let gpa = resolve_proc(b"cuGetProcAddress", 13000, 0, 0x6000usize as *mut c_void);
        assert_eq!(gpa, wrapper(HookId::GetProcAddress_v2.hook()));
        // Unhooked names are untouched.
        let other = 0x7000usize as *mut c_void;
        assert_eq!(resolve_proc(b"cuCtxGetDevice", 13000, 0, other), other);
        assert!(resolve_proc(b"cuMemAlloc", 13000, 0, std::ptr::null_mut()).is_null());
        // An alias of a known real pointer under another name is still wrapped.
        let real = HookId::MemAllocAsync_ptsz.hook().real_ptr();
        assert!(!real.is_null(), "adopted above");
        assert_eq!(
            resolve_proc(b"cuMemAllocAsync_ptsz", 13000, 0, real),
            wrapper(HookId::MemAllocAsync_ptsz.hook())
        );
    }

    #[test]
    fn every_row_has_its_own_wrapper() {
        for (i, a) in HOOKS.iter().enumerate() {
            let w = wrapper(a);
            assert!(!w.is_null(), "{:?} has no wrapper", a.name);
            assert!(is_wrapper(w));
            for b in &HOOKS[i + 1..] {
                assert_ne!(
                    w,
                    wrapper(b),
                    "{:?} and {:?} share a wrapper",
                    a.name,
                    b.name
                );
            }
        }
        assert_eq!(
            wrapper(HookId::MemAlloc_v2.hook()),
            m::cuMemAlloc_v2 as *mut c_void
        );
        assert_eq!(
            wrapper(HookId::GetProcAddress_v2.hook()),
            cuGetProcAddress_v2 as *mut c_void
        );
        assert!(!is_wrapper(std::ptr::null()));
        assert!(table::by_real(std::ptr::null_mut()).is_none());
    }
}
