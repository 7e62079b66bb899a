//! The exported `nvml*` entry points.
//!
//! Device handles are addresses inside a static table (one slot per possible GPU), so a handle is
//! validated by range. Every entry point catches panics and answers an NVML error code.
//!
//! Per-process utilization (`nvmlDeviceGetProcessUtilization`) comes from each process's
//! cumulative busy time in the engine file. The library keeps its last answers per device (the
//! busy ns of every process at each answer's timestamp, the first taken at `nvmlInit`), so a
//! caller passing the timestamp of a previous answer gets each process's share of exactly the
//! time since then; with 0, the time since the previous answer.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, c_char};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tessera_sim_state::{GpuInfo, MAX_GPUS, SimSpec, XidEvent};

use crate::ffi::*;

/// The MIG API: a part of this module's entry points (it shares their state, handles and
/// helpers, and they answer MIG device handles through it).
pub mod mig;

pub(crate) type Res = Result<(), nvmlReturn_t>;

pub(crate) fn guard(f: impl FnOnce() -> Res) -> nvmlReturn_t {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

/// Writes through an out-pointer, `INVALID_ARGUMENT` when null.
///
/// # Safety
/// `p` must be null or valid for writing a `T`.
pub(crate) unsafe fn put<T>(p: *mut T, v: T) -> Res {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null; the caller promises it is writable.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

pub(crate) struct State {
    pub(crate) spec: SimSpec,
    pub(crate) dir: PathBuf,
    /// Per device, the last [`ANSWERS_KEPT`] per-process utilization answers, oldest first.
    answers: Vec<Mutex<VecDeque<Answer>>>,
}

/// Per-process busy time of one device at one instant, as handed out (or taken at init).
struct Answer {
    /// Wall clock, µs since the epoch: the samples' `timeStamp`.
    wall_us: u64,
    /// Monotonic ns, the clock busy time is measured on.
    mono_ns: u64,
    /// Cumulative busy ns per pid (a pid missing had none).
    busy: HashMap<u32, u64>,
}

/// Answers kept per device (16 s of history at a 250 ms poll).
const ANSWERS_KEPT: usize = 64;

static STATE: OnceLock<State> = OnceLock::new();
static INIT_COUNT: AtomicU32 = AtomicU32::new(0);
static HANDLES: [u8; MAX_GPUS] = [0; MAX_GPUS];

pub(crate) fn state() -> Result<&'static State, nvmlReturn_t> {
    if INIT_COUNT.load(Ordering::SeqCst) == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    STATE.get().ok_or(NVML_ERROR_UNINITIALIZED)
}

pub(crate) fn handle_of(index: u32) -> nvmlDevice_t {
    &HANDLES[index as usize] as *const u8 as nvmlDevice_t
}

/// The GPU of handle `h`; for a MIG device's handle, its parent (PCI, compute capability and
/// events are the parent's).
pub(crate) fn device(h: nvmlDevice_t) -> Result<&'static GpuInfo, nvmlReturn_t> {
    let st = state()?;
    if let Some(gpu) = mig::mig_handle_parent(h) {
        return st
            .spec
            .gpus
            .get(gpu as usize)
            .ok_or(NVML_ERROR_INVALID_ARGUMENT);
    }
    let base = HANDLES.as_ptr() as usize;
    let off = (h as usize).wrapping_sub(base);
    st.spec
        .gpus
        .get(off)
        .filter(|_| off < MAX_GPUS)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

/// Copies a string into a C buffer; `INSUFFICIENT_SIZE` when it does not fit.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes.
pub(crate) unsafe fn copy_str(s: &str, buf: *mut c_char, len: u32) -> Res {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if s.len() + 1 > len as usize {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: buf holds len >= s.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, s.len());
        *buf.add(s.len()) = 0;
    }
    Ok(())
}

fn init() -> Res {
    if STATE.get().is_none() {
        let spec = SimSpec::from_env().map_err(|e| {
            eprintln!("tessera-sim-nvml: {e}");
            NVML_ERROR_UNKNOWN
        })?;
        let dir = tessera_sim_state::state_dir_from_env();
        // The first answer of each device: a caller's first query covers the time since init.
        let answers = spec
            .gpus
            .iter()
            .map(|g| Mutex::new(VecDeque::from([take_answer(&dir, g.index, 0)])))
            .collect();
        let _ = STATE.set(State { spec, dir, answers });
    }
    INIT_COUNT.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// `nvmlInit_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    guard(init)
}

/// `nvmlInit` (v1).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> nvmlReturn_t {
    guard(init)
}

/// `nvmlInitWithFlags`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: u32) -> nvmlReturn_t {
    guard(init)
}

/// `nvmlShutdown`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    guard(|| {
        INIT_COUNT
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map(|_| ())
            .map_err(|_| NVML_ERROR_UNINITIALIZED)
    })
}

/// `nvmlErrorString`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(r: nvmlReturn_t) -> *const c_char {
    let s: &CStr = match r {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        10 => c"Timeout",
        19 => c"In use by another client",
        23 => c"Insufficient resources",
        25 => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: u32) -> nvmlReturn_t {
    guard(|| {
        state()?;
        // SAFETY: caller's buffer of `len` bytes.
        unsafe { copy_str("580.00.00-tessera-sim", buf, len) }
    })
}

/// `nvmlSystemGetNVMLVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(buf: *mut c_char, len: u32) -> nvmlReturn_t {
    guard(|| {
        state()?;
        // SAFETY: caller's buffer of `len` bytes.
        unsafe { copy_str("13.580.00", buf, len) }
    })
}

/// `nvmlSystemGetCudaDriverVersion` and `_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut i32) -> nvmlReturn_t {
    guard(|| {
        state()?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(v, 13000) }
    })
}

/// `nvmlSystemGetCudaDriverVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(v: *mut i32) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlSystemGetCudaDriverVersion_v2(v) }
}

/// `nvmlDeviceGetCount_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(n: *mut u32) -> nvmlReturn_t {
    guard(|| {
        let c = state()?.spec.count() as u32;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(n, c) }
    })
}

/// `nvmlDeviceGetCount`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(n: *mut u32) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetCount_v2(n) }
}

/// `nvmlDeviceGetHandleByIndex_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    i: u32,
    h: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        if i as usize >= state()?.spec.count() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(h, handle_of(i)) }
    })
}

/// `nvmlDeviceGetHandleByIndex`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(i: u32, h: *mut nvmlDevice_t) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetHandleByIndex_v2(i, h) }
}

fn by_string(
    s: *const c_char,
    h: *mut nvmlDevice_t,
    pick: fn(&GpuInfo, &str) -> bool,
) -> nvmlReturn_t {
    guard(|| {
        let st = state()?;
        if s.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null C string from the caller.
        let s = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
        let g = st
            .spec
            .gpus
            .iter()
            .find(|g| pick(g, &s))
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(h, handle_of(g.index)) }
    })
}

/// `nvmlDeviceGetHandleByUUID`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    h: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    if !uuid.is_null() {
        // SAFETY: non-null C string from the caller.
        let s = unsafe { CStr::from_ptr(uuid) }.to_string_lossy();
        if s.len() > 4 && s[..4].eq_ignore_ascii_case("MIG-") {
            return guard(|| {
                let found = mig::handle_by_mig_uuid(&s)?;
                // SAFETY: caller's out-pointer, null-checked by put.
                unsafe { put(h, found) }
            });
        }
    }
    by_string(uuid, h, |g, s| g.uuid.eq_ignore_ascii_case(s))
}

/// `nvmlDeviceGetHandleByPciBusId_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    id: *const c_char,
    h: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    by_string(id, h, |g, s| {
        g.pci_bus_id_nvml().eq_ignore_ascii_case(s) || g.pci_bus_id_cuda().eq_ignore_ascii_case(s)
    })
}

/// `nvmlDeviceGetName`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    h: nvmlDevice_t,
    buf: *mut c_char,
    len: u32,
) -> nvmlReturn_t {
    guard(|| {
        // SAFETY: caller's buffer of `len` bytes.
        if unsafe { mig::mig_string(h, buf, len, false) }? {
            return Ok(());
        }
        let g = device(h)?;
        // SAFETY: caller's buffer of `len` bytes.
        unsafe { copy_str(&g.name, buf, len) }
    })
}

/// `nvmlDeviceGetUUID`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    h: nvmlDevice_t,
    buf: *mut c_char,
    len: u32,
) -> nvmlReturn_t {
    guard(|| {
        // SAFETY: caller's buffer of `len` bytes.
        if unsafe { mig::mig_string(h, buf, len, true) }? {
            return Ok(());
        }
        let g = device(h)?;
        // SAFETY: caller's buffer of `len` bytes.
        unsafe { copy_str(&g.uuid, buf, len) }
    })
}

/// `nvmlDeviceGetIndex`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(h: nvmlDevice_t, i: *mut u32) -> nvmlReturn_t {
    guard(|| {
        let g = device(h)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(i, g.index) }
    })
}

/// `nvmlDeviceGetMinorNumber`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(h: nvmlDevice_t, i: *mut u32) -> nvmlReturn_t {
    // SAFETY: same contract as nvmlDeviceGetIndex.
    unsafe { nvmlDeviceGetIndex(h, i) }
}

/// `nvmlDeviceGetCudaComputeCapability`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    h: nvmlDevice_t,
    major: *mut i32,
    minor: *mut i32,
) -> nvmlReturn_t {
    guard(|| {
        device(h)?;
        // SAFETY: caller's out-pointers, null-checked by put.
        unsafe {
            put(major, 9)?;
            put(minor, 0)
        }
    })
}

fn used(g: &GpuInfo) -> Result<u64, nvmlReturn_t> {
    tessera_sim_state::device_memory_used(&state()?.dir, g.index)
        .map(|u| u.min(g.total_bytes))
        .map_err(|_| NVML_ERROR_UNKNOWN)
}

/// (total, used) of the device behind `h`: a MIG device's GPU instance, or the whole GPU
/// (with MIG on, only for a privileged caller: see [`mig`]).
fn memory(h: nvmlDevice_t) -> Result<(u64, u64), nvmlReturn_t> {
    if let Some(d) = mig::mig_of(h)? {
        let u = tessera_sim_state::instance_memory_used(&state()?.dir, d.gpu, d.tag())
            .map_err(|_| NVML_ERROR_UNKNOWN)?;
        return Ok((d.memory_bytes, u.min(d.memory_bytes)));
    }
    let g = device(h)?;
    mig::check_aggregate(g)?;
    Ok((g.total_bytes, used(g)?))
}

/// `nvmlDeviceGetMemoryInfo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    h: nvmlDevice_t,
    m: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    guard(|| {
        let (total, u) = memory(h)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe {
            put(
                m,
                nvmlMemory_t {
                    total,
                    free: total - u,
                    used: u,
                },
            )
        }
    })
}

/// `nvmlDeviceGetMemoryInfo_v2`: the caller sets `version` to `NVML_STRUCT_VERSION(Memory, 2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    h: nvmlDevice_t,
    m: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        device(h)?;
        if m.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null struct from the caller.
        let version = unsafe { std::ptr::addr_of!((*m).version).read_unaligned() };
        if version != NVML_MEMORY_V2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (total, u) = memory(h)?;
        // SAFETY: non-null struct from the caller.
        unsafe {
            put(
                m,
                nvmlMemory_v2_t {
                    version,
                    total,
                    reserved: 0,
                    free: total - u,
                    used: u,
                },
            )
        }
    })
}

/// `nvmlDeviceGetUtilizationRates`: gpu = engine busy share of the last second; memory = share
/// of the card in use.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    h: nvmlDevice_t,
    u: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    guard(|| {
        let g = device(h)?;
        // "On MIG-enabled GPUs, querying device utilization rates is not currently supported"
        // (NVML reference, nvmlDeviceGetUtilizationRates).
        if mig::mig_of(h)?.is_some() || mig::mig_on(g)? {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let busy =
            tessera_sim_state::device_utilization(&state()?.dir, g.index, Duration::from_secs(1));
        let mem = used(g)? as f64 / g.total_bytes as f64;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe {
            put(
                u,
                nvmlUtilization_t {
                    gpu: (busy * 100.0).round() as u32,
                    memory: (mem * 100.0).round() as u32,
                },
            )
        }
    })
}

fn processes(
    h: nvmlDevice_t,
    count: *mut u32,
    infos: *mut nvmlProcessInfo_t,
    graphics: bool,
) -> nvmlReturn_t {
    guard(|| {
        let g = device(h)?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // A MIG device lists its own processes; the parent, with MIG on, all of them with
        // their instances, and only to a privileged caller (see [`mig`]).
        let only = mig::mig_of(h)?.map(|d| d.tag());
        if only.is_none() {
            mig::check_aggregate(g)?;
        }
        let list: Vec<nvmlProcessInfo_t> = if graphics {
            Vec::new()
        } else {
            tessera_sim_state::read_processes(&state()?.dir)
                .map_err(|_| NVML_ERROR_UNKNOWN)?
                .into_iter()
                .filter(|p| p.uses(g.index))
                .filter(|p| only.is_none_or(|t| p.mig_tag[g.index as usize] == t))
                .map(|p| {
                    let tag = p.mig_tag[g.index as usize];
                    let (gi, ci) =
                        tessera_sim_state::mig::untag(tag).unwrap_or((u32::MAX, u32::MAX));
                    nvmlProcessInfo_t {
                        pid: p.pid,
                        used_gpu_memory: p.mem_bytes[g.index as usize],
                        gpu_instance_id: gi,
                        compute_instance_id: ci,
                    }
                })
                .collect()
        };
        // SAFETY: non-null count from the caller.
        let cap = unsafe { count.read_unaligned() } as usize;
        // SAFETY: non-null count from the caller.
        unsafe { put(count, list.len() as u32) }?;
        if list.is_empty() {
            return Ok(());
        }
        if cap < list.len() || infos.is_null() {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        for (i, p) in list.into_iter().enumerate() {
            // SAFETY: the caller's array holds `cap` >= list.len() entries.
            unsafe { infos.add(i).write_unaligned(p) };
        }
        Ok(())
    })
}

/// `nvmlDeviceGetComputeRunningProcesses_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    h: nvmlDevice_t,
    c: *mut u32,
    i: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    processes(h, c, i, false)
}

/// `nvmlDeviceGetComputeRunningProcesses_v2` (same struct layout).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    h: nvmlDevice_t,
    c: *mut u32,
    i: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    processes(h, c, i, false)
}

/// `nvmlDeviceGetGraphicsRunningProcesses_v3`: none on a compute-only simulation.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    h: nvmlDevice_t,
    c: *mut u32,
    i: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    processes(h, c, i, true)
}

fn pci_info(h: nvmlDevice_t, p: *mut nvmlPciInfo_t) -> nvmlReturn_t {
    guard(|| {
        let g = device(h)?;
        let mut legacy = [0u8; 16];
        let mut full = [0u8; 32];
        let l = g.pci_bus_id_cuda();
        let f = g.pci_bus_id_nvml();
        legacy[..l.len()].copy_from_slice(l.as_bytes());
        full[..f.len()].copy_from_slice(f.as_bytes());
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe {
            put(
                p,
                nvmlPciInfo_t {
                    bus_id_legacy: legacy,
                    domain: 0,
                    bus: g.pci_bus,
                    device: 0,
                    pci_device_id: 0x2330_10DE,
                    pci_sub_system_id: 0x16C1_10DE,
                    bus_id: full,
                },
            )
        }
    })
}

/// `nvmlDeviceGetPciInfo_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    h: nvmlDevice_t,
    p: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    pci_info(h, p)
}

/// `nvmlDeviceGetPciInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v2(
    h: nvmlDevice_t,
    p: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    pci_info(h, p)
}

// ---- per-process utilization ----

fn wall_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The busy time of every process on `gpu` now, stamped later than `after_us`.
fn take_answer(dir: &std::path::Path, gpu: u32, after_us: u64) -> Answer {
    let (mono_ns, busy) = tessera_sim_state::process_busy_ns(dir, gpu);
    Answer {
        wall_us: wall_us().max(after_us + 1),
        mono_ns,
        busy: busy.into_iter().collect(),
    }
}

/// Samples of the processes busy on `gpu` between `base` and `now` (idle ones are omitted).
fn samples_between(base: &Answer, now: &Answer) -> Vec<nvmlProcessUtilizationSample_t> {
    let window = now.mono_ns.saturating_sub(base.mono_ns).max(1);
    let mut out: Vec<nvmlProcessUtilizationSample_t> = now
        .busy
        .iter()
        .filter_map(|(&pid, &busy)| {
            let ran = busy.saturating_sub(base.busy.get(&pid).copied().unwrap_or(0));
            (ran > 0).then(|| nvmlProcessUtilizationSample_t {
                pid,
                time_stamp: now.wall_us,
                sm_util: ((ran as f64 * 100.0 / window as f64).round() as u32).min(100),
                mem_util: 0,
                enc_util: 0,
                dec_util: 0,
            })
        })
        .collect();
    out.sort_by_key(|s| s.pid);
    out
}

/// `nvmlDeviceGetProcessUtilization`: for each process whose kernels ran on the device since
/// `last_seen` (a previous answer's `timeStamp`; with 0, since this library's previous answer,
/// or init), the percent of that time they ran (`smUtil`; the other fields are 0). Processes
/// that did not run are omitted; none at all answers `NVML_ERROR_NOT_FOUND`. With `utilization`
/// null, or a count too small, `NVML_ERROR_INSUFFICIENT_SIZE` and the count needed (with null,
/// every process the device has busy time for, a bound that the answer cannot outgrow while the
/// caller allocates). A `last_seen` older than the kept answers measures from the oldest.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    h: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    count: *mut u32,
    last_seen: u64,
) -> nvmlReturn_t {
    guard(|| {
        let g = device(h)?;
        let st = state()?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if mig::mig_of(h)?.is_some() || mig::mig_on(g)? {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        if utilization.is_null() {
            let (_, busy) = tessera_sim_state::process_busy_ns(&st.dir, g.index);
            // SAFETY: non-null count from the caller.
            unsafe { put(count, busy.len() as u32) }?;
            return Err(if busy.is_empty() {
                NVML_ERROR_NOT_FOUND
            } else {
                NVML_ERROR_INSUFFICIENT_SIZE
            });
        }
        let mut answers = st.answers[g.index as usize].lock();
        let latest_us = answers.back().map_or(0, |a| a.wall_us);
        let now = take_answer(&st.dir, g.index, latest_us);
        let base = if last_seen == 0 {
            answers.back()
        } else {
            answers
                .iter()
                .rev()
                .find(|a| a.wall_us <= last_seen)
                .or(answers.front())
        };
        let samples = base.map(|b| samples_between(b, &now)).unwrap_or_default();
        // SAFETY: non-null count from the caller.
        let cap = unsafe { count.read_unaligned() } as usize;
        // SAFETY: non-null count from the caller.
        unsafe { put(count, samples.len() as u32) }?;
        if samples.is_empty() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        if cap < samples.len() {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        for (i, s) in samples.into_iter().enumerate() {
            // SAFETY: the caller's array holds `cap` >= samples.len() entries.
            unsafe { utilization.add(i).write_unaligned(s) };
        }
        // Only answers handed out are kept: a later `last_seen` names one of them.
        answers.push_back(now);
        if answers.len() > ANSWERS_KEPT {
            answers.pop_front();
        }
        Ok(())
    })
}

// ---- events ----

struct EventSet {
    registered: Vec<u32>,
    offset: u64,
    pending: VecDeque<XidEvent>,
}

/// `nvmlEventSetCreate`: the set sees events injected from now on.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    guard(|| {
        let st = state()?;
        let (_, offset) = tessera_sim_state::read_xid_events(&st.dir, u64::MAX);
        let b = Box::new(Mutex::new(EventSet {
            registered: Vec::new(),
            offset,
            pending: VecDeque::new(),
        }));
        // SAFETY: caller's out-pointer, null-checked by put (the box is leaked into the handle).
        unsafe { put(set, Box::into_raw(b) as nvmlEventSet_t) }
    })
}

/// # Safety
/// `set` must be a handle from `nvmlEventSetCreate` not yet freed.
unsafe fn event_set<'a>(set: nvmlEventSet_t) -> Result<&'a Mutex<EventSet>, nvmlReturn_t> {
    if set.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: per the contract, `set` came from Box::into_raw in nvmlEventSetCreate.
    Ok(unsafe { &*(set as *const Mutex<EventSet>) })
}

/// `nvmlDeviceGetSupportedEventTypes`: XID critical errors.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    h: nvmlDevice_t,
    types: *mut u64,
) -> nvmlReturn_t {
    guard(|| {
        device(h)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(types, NVML_EVENT_TYPE_XID_CRITICAL_ERROR) }
    })
}

/// `nvmlDeviceRegisterEvents`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    h: nvmlDevice_t,
    types: u64,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    guard(|| {
        let g = device(h)?;
        if types & !NVML_EVENT_TYPE_XID_CRITICAL_ERROR != 0 {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        // SAFETY: the caller passes a live event set.
        let set = unsafe { event_set(set) }?;
        let mut s = set.lock();
        if types != 0 && !s.registered.contains(&g.index) {
            s.registered.push(g.index);
        }
        Ok(())
    })
}

/// `nvmlEventSetWait_v2`: waits up to `timeout_ms` for an XID on a registered device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: u32,
) -> nvmlReturn_t {
    guard(|| {
        let st = state()?;
        if data.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: the caller passes a live event set.
        let set = unsafe { event_set(set) }?;
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        loop {
            {
                let mut s = set.lock();
                let (events, next) = tessera_sim_state::read_xid_events(&st.dir, s.offset);
                s.offset = next;
                let regs = s.registered.clone();
                s.pending
                    .extend(events.into_iter().filter(|e| regs.contains(&e.gpu)));
                if let Some(e) = s.pending.pop_front() {
                    // SAFETY: non-null out-struct from the caller.
                    return unsafe {
                        put(
                            data,
                            nvmlEventData_t {
                                device: handle_of(e.gpu),
                                event_type: NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
                                event_data: e.code,
                                gpu_instance_id: u32::MAX,
                                compute_instance_id: u32::MAX,
                            },
                        )
                    };
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(NVML_ERROR_TIMEOUT);
            }
            std::thread::sleep((deadline - now).min(Duration::from_millis(10)));
        }
    })
}

/// `nvmlEventSetFree`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    guard(|| {
        state()?;
        if set.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: `set` came from Box::into_raw in nvmlEventSetCreate and is freed once.
        drop(unsafe { Box::from_raw(set as *mut Mutex<EventSet>) });
        Ok(())
    })
}
