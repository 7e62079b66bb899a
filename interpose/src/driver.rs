//! Finding the real `dlsym`, the real driver and the real NVML, without ever resolving through
//! our own exports.
//!
//! - `dlsym` comes from `dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34")` (older glibc: `GLIBC_2.2.5`).
//! - The driver is `TESSERA_REAL_LIBCUDA` or `libcuda.so.1`, NVML is `libnvidia-ml.so.1`: first
//!   `dlopen(.., RTLD_NOLOAD)` (the copy the application already loaded), then a normal load.
//!   Real functions are looked up with the real `dlsym` on that handle, never with `RTLD_NEXT`.
//! - A handle that resolves into this very library (e.g. `TESSERA_REAL_LIBCUDA` pointing at the
//!   interposer, or the interposer installed as `libcuda.so.1`) is refused.

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU8, Ordering};

use crate::ffi::{self, DlsymFn};
use crate::table::{HOOKS, Hook, HookId, Lib};
use crate::tlog;

/// The real `dlsym`; read by the `dlsym` trampoline, so it must stay a plain pointer-sized static.
pub static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Resolves the real `dlsym` and caches it. Called by the trampoline when the cache is empty.
pub extern "C" fn init_real_dlsym() -> *mut c_void {
    let cached = REAL_DLSYM.load(Ordering::Acquire);
    if !cached.is_null() {
        return cached;
    }
    let mut p = std::ptr::null_mut();
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
        // SAFETY: both strings are NUL-terminated; dlvsym only reads them.
        p = unsafe { ffi::dlvsym(ffi::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !p.is_null() {
            break;
        }
    }
    REAL_DLSYM.store(p, Ordering::Release);
    p
}

/// The real `dlsym`.
#[inline]
pub fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p.is_null() {
        p = init_real_dlsym();
    }
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` is glibc's `dlsym`, whose signature is `DlsymFn`.
    Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) })
}

/// Looks `name` up in `handle` with the real `dlsym`.
///
/// # Safety
/// `handle` is a live `dlopen` handle or a pseudo-handle (`RTLD_DEFAULT`, `RTLD_NEXT`).
pub unsafe fn lookup(handle: *mut c_void, name: &CStr) -> *mut c_void {
    match real_dlsym() {
        // SAFETY: `name` is NUL-terminated; `handle` is valid per the contract.
        Some(f) => unsafe { f(handle, name.as_ptr()) },
        None => std::ptr::null_mut(),
    }
}

/// Base address of the object that contains `addr`, if any.
fn object_base(addr: *const c_void) -> *mut c_void {
    let mut info = ffi::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: `info` is a valid out-parameter; dladdr accepts any address.
    if unsafe { ffi::dladdr(addr, &mut info) } == 0 {
        return std::ptr::null_mut();
    }
    info.dli_fbase
}

/// Base address of this library.
pub fn self_base() -> *mut c_void {
    object_base(self_base as *const c_void)
}

/// Most loaded segments (`PT_LOAD`) an object has (a linker gives a library four or five).
const MAX_SEGMENTS: usize = 8;

/// The address ranges of this library's loaded segments, `[start, end)`.
#[derive(Debug, Default)]
struct OwnSegments {
    n: usize,
    ranges: [(usize, usize); MAX_SEGMENTS],
}

/// Found once, at the first load of a real library (`None`: the loader did not list us).
static OWN_SEGMENTS: std::sync::OnceLock<Option<OwnSegments>> = std::sync::OnceLock::new();

/// `dl_iterate_phdr` callback: fills `data` (an `OwnSegments`) from the object that holds this
/// very function, and stops there.
unsafe extern "C" fn collect_own(
    info: *mut libc::dl_phdr_info,
    _size: libc::size_t,
    data: *mut c_void,
) -> libc::c_int {
    // SAFETY: the loader passes a live `dl_phdr_info` for this call; `data` is the
    // `OwnSegments` that `own_segments` handed to `dl_iterate_phdr`.
    let (info, out) = unsafe { (&*info, &mut *data.cast::<OwnSegments>()) };
    if info.dlpi_phdr.is_null() {
        return 0;
    }
    // SAFETY: `dlpi_phdr` points at `dlpi_phnum` program headers of a loaded object.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
    let base = info.dlpi_addr as usize;
    let loads = phdrs.iter().filter(|p| p.p_type == libc::PT_LOAD).map(|p| {
        let start = base.wrapping_add(p.p_vaddr as usize);
        (start, start.wrapping_add(p.p_memsz as usize))
    });
    let me = collect_own as *const () as usize;
    if !loads.clone().any(|(a, b)| (a..b).contains(&me)) {
        return 0;
    }
    for (i, r) in loads.take(MAX_SEGMENTS).enumerate() {
        out.ranges[i] = r;
        out.n = i + 1;
    }
    1
}

fn own_segments() -> Option<&'static OwnSegments> {
    OWN_SEGMENTS
        .get_or_init(|| {
            let mut out = OwnSegments::default();
            // SAFETY: the callback only reads the loader's records and writes `out`, which lives
            // across the call.
            unsafe { libc::dl_iterate_phdr(Some(collect_own), (&raw mut out).cast()) };
            (out.n > 0).then_some(out)
        })
        .as_ref()
}

/// Whether `addr` lies in this very library (a hook that must never be adopted as a real
/// function: it would call itself).
///
/// Why not `dladdr` per pointer: glibc's `dladdr` searches the object's whole symbol table for
/// the nearest symbol on every call, and the real library's every hook is checked: measured
/// with callgrind, a quarter of a CUDA process's instructions at start-up (issue 36). The
/// segments are read once from the loader (`dl_iterate_phdr`); where that fails, `dladdr` still
/// decides (slow, never wrong).
fn is_own(addr: *const c_void) -> bool {
    match own_segments() {
        Some(own) => {
            let a = addr as usize;
            own.ranges[..own.n]
                .iter()
                .any(|&(s, e)| (s..e).contains(&a))
        }
        None => object_base(addr) == self_base(),
    }
}

const UNLOADED: u8 = 0;
const LOADING: u8 = 1;
const LOADED: u8 = 2;

struct LibState {
    state: AtomicU8,
    handle: AtomicPtr<c_void>,
}

static CUDA: LibState = LibState {
    state: AtomicU8::new(UNLOADED),
    handle: AtomicPtr::new(std::ptr::null_mut()),
};
static NVML: LibState = LibState {
    state: AtomicU8::new(UNLOADED),
    handle: AtomicPtr::new(std::ptr::null_mut()),
};

thread_local! {
    static LOADING_HERE: Cell<bool> = const { Cell::new(false) };
}

/// The real library's handle (null when it cannot be found), loading it and filling every hook
/// slot of that library on first use. A nested call from the same thread during the load (the
/// library's constructors calling back into hooked functions) gets null instead of deadlocking.
pub fn ensure(lib: Lib) -> *mut c_void {
    let st = match lib {
        Lib::Cuda => &CUDA,
        Lib::Nvml => &NVML,
    };
    loop {
        match st
            .state
            .compare_exchange(UNLOADED, LOADING, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                LOADING_HERE.with(|c| c.set(true));
                let h = load(lib);
                st.handle.store(h, Ordering::Release);
                st.state.store(LOADED, Ordering::Release);
                LOADING_HERE.with(|c| c.set(false));
                return h;
            }
            Err(LOADED) => return st.handle.load(Ordering::Acquire),
            Err(_) => {
                if LOADING_HERE.with(Cell::get) {
                    return std::ptr::null_mut();
                }
                std::thread::yield_now();
            }
        }
    }
}

fn load(lib: Lib) -> *mut c_void {
    let cfg = crate::config::get();
    let (path, probe): (&CStr, &CStr) = match lib {
        Lib::Cuda => (
            cfg.real_libcuda.as_deref().unwrap_or(c"libcuda.so.1"),
            c"cuInit",
        ),
        Lib::Nvml => (c"libnvidia-ml.so.1", c"nvmlInit_v2"),
    };
    let h = open(path);
    if h.is_null() {
        tlog!(Debug, "{} not found", path.to_string_lossy());
        return h;
    }
    // A library that resolves into ourselves would make every hook call itself.
    // SAFETY: `h` is a live handle from dlopen, used for every look-up below.
    let find = |name: &CStr| unsafe { lookup(h, name) };
    let mut probe_fn = find(probe);
    if probe_fn.is_null() {
        probe_fn = HOOKS
            .iter()
            .filter(|k| k.lib == lib)
            .map(|k| find(k.name))
            .find(|p| !p.is_null())
            .unwrap_or(std::ptr::null_mut());
    }
    if !probe_fn.is_null() && is_own(probe_fn) {
        tlog!(
            Error,
            "{} resolves to the interposer itself; refusing it",
            path.to_string_lossy()
        );
        return std::ptr::null_mut();
    }
    for hook in HOOKS.iter().filter(|k| k.lib == lib) {
        // Never one of our own exports (a hook must not call itself).
        let p = find(hook.name);
        if !p.is_null() && !is_own(p) {
            hook.adopt(p);
        }
    }
    tlog!(Debug, "real {} loaded", path.to_string_lossy());
    h
}

fn open(path: &CStr) -> *mut c_void {
    let p: *const c_char = path.as_ptr();
    // SAFETY: `p` is NUL-terminated; RTLD_NOLOAD only returns an already loaded object.
    let h = unsafe { ffi::dlopen(p, ffi::RTLD_LAZY | ffi::RTLD_NOLOAD) };
    if !h.is_null() {
        return h;
    }
    // SAFETY: as above; a normal load runs the library's constructors, which is what the
    // application's own dlopen would do.
    unsafe { ffi::dlopen(p, ffi::RTLD_LAZY | ffi::RTLD_LOCAL) }
}

/// The real function of `id` as a raw pointer, loading its library if needed.
#[inline]
pub fn real_raw(id: HookId) -> *mut c_void {
    let hook: &Hook = id.hook();
    let p = hook.real_ptr();
    if !p.is_null() {
        return p;
    }
    ensure(hook.lib);
    hook.real_ptr()
}

/// The real function of `id` as the function pointer type `F`.
///
/// # Safety
/// `F` must be the C function pointer type of that entry point.
#[inline]
pub unsafe fn real<F: Copy>(id: HookId) -> Option<F> {
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    let p = real_raw(id);
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller guarantees `F` is the pointer type of this symbol; sizes match.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// Looks up a real NVML function that is not hooked by exact name.
pub fn nvml_symbol(name: &CStr) -> *mut c_void {
    let h = ensure(Lib::Nvml);
    if h.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: `h` is the live NVML handle.
    unsafe { lookup(h, name) }
}

/// Looks up a real driver function that is not hooked (events, contexts) by exact name.
pub fn cuda_symbol(name: &CStr) -> *mut c_void {
    let h = ensure(Lib::Cuda);
    if h.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: `h` is the live driver handle.
    unsafe { lookup(h, name) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_dlsym_is_found_and_works() {
        let f = real_dlsym().expect("glibc dlsym");
        // SAFETY: RTLD_DEFAULT (null) with a NUL-terminated name.
        let p = unsafe { f(std::ptr::null_mut(), c"getpid".as_ptr()) };
        assert!(!p.is_null());
        // SAFETY: RTLD_DEFAULT is a valid pseudo-handle.
        unsafe {
            assert!(!lookup(std::ptr::null_mut(), c"getpid").is_null());
            assert!(lookup(std::ptr::null_mut(), c"no_such_symbol_tessera").is_null());
        }
    }

    #[test]
    fn self_base_is_this_object() {
        assert!(!self_base().is_null());
        assert_eq!(object_base(init_real_dlsym as *const c_void), self_base());
    }

    #[test]
    fn own_segments_hold_our_functions_and_nothing_of_libc() {
        assert!(own_segments().is_some(), "the loader lists this object");
        assert!(is_own(init_real_dlsym as *const c_void));
        assert!(is_own(lookup as *const c_void));
        // SAFETY: RTLD_DEFAULT (null) with a NUL-terminated name.
        let getpid = unsafe { lookup(std::ptr::null_mut(), c"getpid") };
        assert!(!getpid.is_null());
        assert!(!is_own(getpid), "libc's getpid is not ours");
        assert!(!is_own(std::ptr::null()));
    }

    #[test]
    fn missing_driver_yields_none_not_a_crash() {
        // Found exactly when a libcuda.so.1 can be opened; otherwise a clean `None`.
        let openable = !open(c"libcuda.so.1").is_null();
        // SAFETY: the type matches cuMemFree_v2's signature.
        let r = unsafe { real::<crate::ffi::cuMemFree_v2_t>(HookId::MemFree_v2) };
        assert_eq!(r.is_some(), openable);
    }
}
