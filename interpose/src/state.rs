//! The per-process state (arbiter session + ledger) and its life across `fork`.
//!
//! A process that sees several GPUs keeps one state per device of its allocation (see
//! [`process_on`]): its own session, ledger, launch gate and context book, so each device's
//! memory and time go to that device's slice of a multi-GPU allocation.
//!
//! The state lives behind one atomic pointer. A forked child's `pthread_atfork` handler closes
//! the inherited socket without sending anything and clears the pointer: the child then builds
//! a fresh state on first use, connects with its own connection and starts with nothing held
//! (CUDA allocations do not survive fork). The parent's state is leaked in the child, never
//! dropped: its locks may have been held by threads that do not exist there.

use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::config;
use crate::launch::Gate;
use crate::ledger::Ledger;
use crate::session::{Policy, Session};
use crate::tlog;

/// Everything a process under enforcement keeps.
#[derive(Debug)]
pub struct Process {
    /// The arbiter session.
    pub session: Session,
    /// Live objects and their sizes.
    pub ledger: parking_lot::Mutex<Ledger>,
    /// Kernel launch gating (compute leases).
    pub gate: Gate,
    /// What its contexts reserved.
    pub contexts: parking_lot::Mutex<crate::context_book::Book>,
}

impl Process {
    /// A process state with the given session and launch gate.
    pub fn new(session: Session, gate: Gate) -> Self {
        Self {
            session,
            ledger: parking_lot::Mutex::new(Ledger::default()),
            gate,
            contexts: parking_lot::Mutex::new(crate::context_book::Book::default()),
        }
    }

    /// The context book (locks never poison: every update is a single map change).
    pub fn contexts(&self) -> parking_lot::MutexGuard<'_, crate::context_book::Book> {
        self.contexts.lock()
    }

    /// The ledger, even after a panic elsewhere poisoned its lock (its data stays consistent:
    /// every operation is a single map update).
    pub fn ledger(&self) -> parking_lot::MutexGuard<'_, Ledger> {
        self.ledger.lock()
    }
}

static PROCESS: AtomicPtr<Process> = AtomicPtr::new(std::ptr::null_mut());

/// The process state when enforcing (a token is set); `None` means pass everything through.
#[inline]
pub fn process() -> Option<&'static Process> {
    let p = PROCESS.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: states are leaked, never freed, so the pointer stays valid forever.
        return Some(unsafe { &*p });
    }
    create()
}

/// A companion ticket from this process's memory connection, for its lease connection.
fn companion_ticket() -> Option<u64> {
    process().and_then(|p| p.session.companion_ticket())
}

#[cold]
fn create() -> Option<&'static Process> {
    let cfg = config::get();
    let token = cfg.token()?;
    let socket = cfg.socket().map(ToOwned::to_owned);
    let fresh = Box::into_raw(Box::new(Process::new(
        Session::new(socket.clone(), token.clone(), Policy::default()),
        if cfg.closed() {
            Gate::new(None, token).closed()
        } else {
            Gate::new(socket, token).with_companion(companion_ticket)
        },
    )));
    Some(publish(&PROCESS, fresh))
}

/// Publishes `fresh` (from `Box::into_raw`) in the empty `slot`, or, when another thread was
/// first, drops it and returns that thread's state. States are leaked, never freed.
fn publish(slot: &AtomicPtr<Process>, fresh: *mut Process) -> &'static Process {
    match slot.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: we just published `fresh`; it is never freed.
        Ok(_) => unsafe { &*fresh },
        Err(winner) => {
            // SAFETY: `fresh` was never shared; `winner` is a leaked, live state.
            unsafe {
                drop(Box::from_raw(fresh));
                &*winner
            }
        }
    }
}

/// Most device ordinals a process routes separately; devices beyond share the last slot's
/// fate: they get no state of their own and are refused (see [`process_on`]).
pub const MAX_DEVICES: usize = 16;

/// States of devices other than the allocation's own GPU, by CUDA ordinal.
static SLICES: [AtomicPtr<Process>; MAX_DEVICES] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_DEVICES];
/// Devices the driver shows (-1: not asked yet; 0: unknown, treated as one).
static DEVICE_COUNT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

type CtxGetDeviceFn = unsafe extern "C" fn(*mut i32) -> crate::ffi::CUresult;
type DeviceGetCountFn = unsafe extern "C" fn(*mut i32) -> crate::ffi::CUresult;
type DeviceGetUuidFn = unsafe extern "C" fn(*mut [u8; 16], i32) -> crate::ffi::CUresult;

/// Real driver functions looked up once (a lookup is a `dlsym`, too slow for every hook).
static CTX_GET_DEVICE: AtomicPtr<std::ffi::c_void> = AtomicPtr::new(std::ptr::null_mut());
static DEVICE_GET_COUNT: AtomicPtr<std::ffi::c_void> = AtomicPtr::new(std::ptr::null_mut());
static DEVICE_GET_UUID: AtomicPtr<std::ffi::c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The real driver function `name` as `F` (cached in `slot`), or `None`.
///
/// # Safety
/// `F` must be the C function pointer type of `name`.
unsafe fn real_fn<F: Copy>(slot: &AtomicPtr<std::ffi::c_void>, name: &std::ffi::CStr) -> Option<F> {
    const { assert!(size_of::<F>() == size_of::<*mut std::ffi::c_void>()) };
    let mut p = slot.load(Ordering::Relaxed);
    if p.is_null() {
        p = crate::driver::cuda_symbol(name);
        slot.store(p, Ordering::Relaxed);
    }
    // SAFETY: non-null, and the caller names `F` as this symbol's type.
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut std::ffi::c_void, F>(&p) })
}

fn device_count() -> i32 {
    let n = DEVICE_COUNT.load(Ordering::Relaxed);
    if n >= 0 {
        return n;
    }
    let mut count = 0;
    // SAFETY: cuDeviceGetCount's signature; the out-pointer is a live local.
    let ok = unsafe { real_fn::<DeviceGetCountFn>(&DEVICE_GET_COUNT, c"cuDeviceGetCount") }
        .is_some_and(|f| unsafe { f(&mut count) } == crate::ffi::CUDA_SUCCESS);
    // Before cuInit the driver answers an error: ask again later.
    if ok {
        DEVICE_COUNT.store(count.max(0), Ordering::Relaxed);
    }
    if ok { count } else { 0 }
}

/// The device of the calling thread's current context, if any.
pub fn current_device() -> Option<i32> {
    let mut dev = -1;
    // SAFETY: cuCtxGetDevice's signature; the out-pointer is a live local.
    let f = unsafe { real_fn::<CtxGetDeviceFn>(&CTX_GET_DEVICE, c"cuCtxGetDevice") }?;
    // SAFETY: as above.
    (unsafe { f(&mut dev) } == crate::ffi::CUDA_SUCCESS && dev >= 0).then_some(dev)
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (lower case) of device ordinal `dev`.
fn device_uuid(dev: i32) -> Option<String> {
    let mut raw = [0u8; 16];
    // SAFETY: cuDeviceGetUuid's signature (CUuuid is 16 bytes); the out-pointer is live.
    let f = unsafe { real_fn::<DeviceGetUuidFn>(&DEVICE_GET_UUID, c"cuDeviceGetUuid") }?;
    // SAFETY: as above.
    if unsafe { f(&mut raw, dev) } != crate::ffi::CUDA_SUCCESS {
        return None;
    }
    let h: Vec<String> = raw.iter().map(|b| format!("{b:02x}")).collect();
    Some(format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    ))
}

/// Whether two device UUIDs name one device. `cuDeviceGetUuid` gives 16 bytes, which
/// [`device_uuid`] spells `GPU-...`; on a MIG device they are its MIG UUID, which NVML and the
/// arbiter spell `MIG-...` (NVML: `nvmlDeviceGetUUID` on a MIG handle): the bytes decide.
fn same_uuid(a: &str, b: &str) -> bool {
    let bytes = |u: &str| {
        u.split_once('-')
            .map_or(u, |(_, rest)| rest)
            .to_ascii_lowercase()
    };
    bytes(a) == bytes(b)
}

/// The allocation's own GPU, from the arbiter's welcome to the process session (which this
/// connects when it has not yet: the process reserves through it anyway). `None` while the
/// arbiter cannot be asked.
fn main_uuid(main: &'static Process) -> Option<&'static str> {
    main.session.allocation_gpu()
}

/// Whether the allocation spans several GPUs: 0 not known yet, 1 no, 2 yes.
static GROUP: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether the process's allocation is a multi-GPU one: the arbiter answers the slice token of
/// the allocation's own GPU only for the first slice of a group (one extra connection, once).
/// `None` while the arbiter cannot say (not reachable).
fn is_group(socket: &std::path::Path, token: &str, own_uuid: &str) -> Option<bool> {
    match GROUP.load(Ordering::Relaxed) {
        1 => return Some(false),
        2 => return Some(true),
        _ => {}
    }
    let probe = tessera_protocol::group::slice_token(token, own_uuid);
    let timeout = Some(std::time::Duration::from_secs(2));
    let answer = match crate::conn::Conn::connect(socket, &probe, timeout) {
        Ok(_) => true,
        Err(crate::conn::ConnError::Refused(_)) => false,
        Err(_) => return None,
    };
    GROUP.store(if answer { 2 } else { 1 }, Ordering::Relaxed);
    Some(answer)
}

/// The state of the calling thread's current device (see [`process_on`]).
#[inline]
pub fn process_here() -> Option<&'static Process> {
    let main = process()?;
    // One device: it is ordinal 0 whatever the current context (no driver call per hook).
    let dev = if device_count() <= 1 {
        Some(0)
    } else {
        current_device()
    };
    Some(route(main, dev))
}

/// The state that accounts for device ordinal `dev` (`None`: no device known, the process
/// state). A process that sees one device has one state. With several, the allocation's own
/// GPU (the one its token names) is the process state, and any other device gets a state of
/// its own whose session presents that device's slice token
/// ([`tessera_protocol::group::slice_token`]): the arbiter answers it only for a GPU of the
/// same multi-GPU allocation, so a device outside the allocation has a refused session and
/// every allocation there is `CUDA_ERROR_OUT_OF_MEMORY` (fail closed, never charged to a
/// neighbour or summed into another device's limit). Nothing here comes from the tenant's
/// environment but the token itself; the device's UUID comes from the driver.
pub fn process_on(dev: Option<i32>) -> Option<&'static Process> {
    Some(route(process()?, dev))
}

/// [`process_on`]'s answer, cached per ordinal after the first (one atomic load).
#[inline]
fn route(main: &'static Process, dev: Option<i32>) -> &'static Process {
    let Some(dev) = dev else {
        return main;
    };
    let slot = usize::try_from(dev)
        .unwrap_or(MAX_DEVICES - 1)
        .min(MAX_DEVICES - 1);
    let p = SLICES[slot].load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: states are leaked, never freed (the slot may hold the process state).
        return unsafe { &*p };
    }
    route_first(main, dev, slot)
}

#[cold]
fn route_first(main: &'static Process, dev: i32, slot: usize) -> &'static Process {
    let cfg = config::get();
    if cfg.closed() {
        return main;
    }
    let in_slots = usize::try_from(dev).is_ok_and(|d| d < MAX_DEVICES - 1);
    let uuid = if in_slots { device_uuid(dev) } else { None };
    // Not routed yet (and not cached): the driver cannot name the device (before `cuInit`;
    // nothing is allocated there then), or the arbiter is not reachable yet (the process
    // session waits for it as it always does).
    if in_slots && uuid.is_none() {
        return main;
    }
    let Some(own) = main_uuid(main) else {
        return main;
    };
    if uuid.as_deref().is_some_and(|u| same_uuid(u, own)) {
        let main_ptr = main as *const Process as *mut Process;
        let _ = SLICES[slot].compare_exchange(
            std::ptr::null_mut(),
            main_ptr,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        return main;
    }
    let (Some(socket), Some(group_token)) = (cfg.socket(), cfg.token()) else {
        return main;
    };
    // Any other device gets a state of its own: a multi-GPU allocation's other cards their
    // slices; for an allocation of one GPU every other card is someone else's promise (a
    // tenant that widens its own CUDA_VISIBLE_DEVICES sees it), so its slice token names
    // nothing and its session is refused: no context there, no memory (the backstop stops
    // what goes around this). Only a process whose arbiter cannot say yet stays on its
    // own state.
    if is_group(socket, &group_token, own).is_none() {
        return main;
    }
    // An unnamed device, or one past the slots, gets a token nobody has: refused.
    let token = match uuid {
        Some(u) => tessera_protocol::group::slice_token(&group_token, &u),
        None => String::new(),
    };
    let socket = socket.to_owned();
    let fresh = Box::into_raw(Box::new(Process::new(
        Session::new(Some(socket.clone()), token.clone(), Policy::default()),
        Gate::new(Some(socket), token),
    )));
    publish(&SLICES[slot], fresh)
}

static NVML_GET_UUID: AtomicPtr<std::ffi::c_void> = AtomicPtr::new(std::ptr::null_mut());
type NvmlGetUuidFn =
    unsafe extern "C" fn(crate::ffi::nvmlDevice_t, *mut std::ffi::c_char, u32) -> u32;

/// The state that accounts for NVML device `device`: the CUDA device with the same UUID (NVML
/// ignores `CUDA_VISIBLE_DEVICES` and lists every GPU, so its indexes are not ordinals), else
/// `p` (a GPU this process's CUDA does not see, or CUDA not initialised: as before).
///
/// # Safety
/// `device` is what the caller passed to an NVML entry point (NVML checks the handle itself).
pub unsafe fn process_for_nvml(
    p: &'static Process,
    device: crate::ffi::nvmlDevice_t,
) -> &'static Process {
    let n = device_count();
    if n == 0 {
        return p;
    }
    let mut buf = [0 as std::ffi::c_char; 96];
    let slot = &NVML_GET_UUID;
    let mut f = slot.load(Ordering::Relaxed);
    if f.is_null() {
        f = crate::driver::nvml_symbol(c"nvmlDeviceGetUUID");
        slot.store(f, Ordering::Relaxed);
    }
    if f.is_null() {
        return p;
    }
    // SAFETY: `f` is NVML's nvmlDeviceGetUUID (that signature); `buf` is live and its length
    // is passed.
    let get: NvmlGetUuidFn =
        unsafe { std::mem::transmute::<*mut std::ffi::c_void, NvmlGetUuidFn>(f) };
    // SAFETY: as above.
    if unsafe { get(device, buf.as_mut_ptr(), buf.len() as u32) } != 0 {
        return p;
    }
    // SAFETY: NVML wrote a NUL-terminated string into `buf` on success.
    let uuid = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    let Some(main) = process() else {
        return p;
    };
    (0..n.min(MAX_DEVICES as i32))
        .find(|&d| device_uuid(d).is_some_and(|u| same_uuid(&u, &uuid)))
        .map_or(p, |d| route(main, Some(d)))
}

/// Every state of this process: its own, then each other device's.
pub fn all_states() -> impl Iterator<Item = &'static Process> {
    let main = PROCESS.load(Ordering::Acquire);
    std::iter::once(main)
        .chain(
            SLICES
                .iter()
                .map(|s| s.load(Ordering::Acquire))
                .filter(move |p| *p != main),
        )
        .filter(|p| !p.is_null())
        // SAFETY: states are leaked, never freed.
        .map(|p| unsafe { &*p })
}

/// The first state (`p` first, then every device's) whose ledger satisfies `has`, else `p`:
/// objects are freed, mapped and released from any device's context, and go back to the
/// device that holds them.
pub fn holder(p: &'static Process, has: impl Fn(&Ledger) -> bool) -> &'static Process {
    std::iter::once(p)
        .chain(all_states())
        .find(|s| has(&s.ledger()))
        .unwrap_or(p)
}

static ATFORK: AtomicBool = AtomicBool::new(false);

/// Registers the fork handler once (from the constructor when a token is set).
pub fn register_atfork() {
    if ATFORK.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: the handler is a plain function that lives as long as the process.
    let rc = unsafe { crate::ffi::pthread_atfork(None, None, Some(atfork_child)) };
    if rc != 0 {
        tlog!(
            Warn,
            "pthread_atfork failed ({rc}); a forked child would share its parent's connection"
        );
    }
}

/// Child side of `fork`: abandon the parent's state without sending anything.
unsafe extern "C" fn atfork_child() {
    // No allocation here (a forked child's handler): each distinct state is abandoned once,
    // the slots that only pointed at the process state are just cleared.
    let main = PROCESS.swap(std::ptr::null_mut(), Ordering::AcqRel);
    let slots = SLICES
        .iter()
        .map(|s| s.swap(std::ptr::null_mut(), Ordering::AcqRel))
        .filter(|p| *p != main);
    for p in std::iter::once(main).chain(slots) {
        if !p.is_null() {
            // SAFETY: states are never freed; only the (single) child thread runs here.
            unsafe {
                (*p).session.abandon_in_child();
                (*p).gate.abandon_in_child();
            }
        }
    }
    crate::launch::reset_in_child();
}
