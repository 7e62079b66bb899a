//! Our `dlsym`, and the logic behind `cuGetProcAddress`.
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

use std::ffi::{CStr, c_char, c_int, c_void};

use crate::driver;
use crate::guard;
use crate::table::{self, Hook};
use crate::tlog;

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
    if table::is_wrapper(found) {
        return found;
    }
    // Fill every slot from the real library first, so `found` only fills gaps.
    driver::ensure(hook.lib);
    hook.adopt(found);
    tlog!(Trace, "dlsym({}) -> wrapper", hook.name.to_string_lossy());
    hook.wrapper.0 as *mut c_void
}

/// What `cuGetProcAddress(symbol, .., version, flags)` hands out when the driver resolved it
/// to `found`.
pub fn resolve_proc(symbol: &[u8], version: c_int, flags: u64, found: *mut c_void) -> *mut c_void {
    if found.is_null() || table::is_wrapper(found) {
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
            h.wrapper.0 as *mut c_void
        }
        None => found,
    }
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
    use crate::table::HookId;

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
        let w = h.wrapper.0 as *mut c_void;
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
        assert_eq!(
            got,
            HookId::MemAllocAsync_ptsz.hook().wrapper.0 as *mut c_void
        );
        let got = resolve_proc(b"cuMemAllocAsync", 12000, 0, 0x5008usize as *mut c_void);
        assert_eq!(got, HookId::MemAllocAsync.hook().wrapper.0 as *mut c_void);
        let gpa = resolve_proc(b"cuGetProcAddress", 13000, 0, 0x6000usize as *mut c_void);
        assert_eq!(
            gpa,
            HookId::GetProcAddress_v2.hook().wrapper.0 as *mut c_void
        );
        // Unhooked names are untouched.
        let other = 0x7000usize as *mut c_void;
        assert_eq!(resolve_proc(b"cuCtxGetDevice", 13000, 0, other), other);
        assert!(resolve_proc(b"cuMemAlloc", 13000, 0, std::ptr::null_mut()).is_null());
        // An alias of a known real pointer under another name is still wrapped.
        let real = HookId::MemAllocAsync_ptsz.hook().real_ptr();
        assert!(!real.is_null(), "adopted above");
        assert_eq!(
            resolve_proc(b"cuMemAllocAsync_ptsz", 13000, 0, real),
            HookId::MemAllocAsync_ptsz.hook().wrapper.0 as *mut c_void
        );
    }
}
