//! NVML's MIG API on the simulated Hopper parts (`TESSERA_SIM_GPUS=8xH200`).
//!
//! Behaviour follows the NVML API reference (Multi Instance GPU Management):
//! `nvmlDeviceSetMigMode` needs root and, on Hopper, applies at once (`activationStatus`
//! SUCCESS, no reset pending); it answers `NVML_ERROR_IN_USE` while a process holds a context
//! on the GPU. Creating and destroying instances needs root too. A MIG device is a compute
//! instance, reached by `nvmlDeviceGetMigDeviceHandleByIndex` or by its `MIG-<uuid>` through
//! `nvmlDeviceGetHandleByUUID`. On a GPU with MIG on, `nvmlDeviceGetMemoryInfo` and
//! `nvmlDeviceGetComputeRunningProcesses` on the parent "return aggregate information only if
//! the caller has appropriate privileges; per-instance information can be queried by using
//! specific MIG device handles": here the privilege is root, and a root process can give it up
//! with `TESSERA_SIM_NVML_UNPRIVILEGED=1` (nothing can gain it). Utilization is
//! `NVML_ERROR_NOT_SUPPORTED` on MIG devices and on a parent with MIG on.
//!
//! Handles are addresses in static tables (GPU, GPU instance id < 8, compute instance id < 8),
//! looked up in the shared MIG state at every call, so a handle of a destroyed instance answers
//! `NVML_ERROR_NOT_FOUND` (or names its re-creation at the same ids).

use std::ffi::c_char;

use tessera_sim_state::GpuInfo;
use tessera_sim_state::mig::{self, GiProfile, GpuModel, MigDevice, MigError, MigState};

use super::{Res, copy_str, guard, handle_of, put, state};
use crate::ffi::*;
pub(crate) use handles::mig_handle_parent;
use handles::{ci_handle, gi_handle, mig_handle};

mod handles;

/// Environment variable by which a root process gives up NVML's MIG privilege.
pub const ENV_UNPRIVILEGED: &str = "TESSERA_SIM_NVML_UNPRIVILEGED";

fn load() -> Result<MigState, nvmlReturn_t> {
    mig::store::load(&state()?.dir).map_err(code)
}

fn code(e: MigError) -> nvmlReturn_t {
    match e {
        MigError::NotSupported => NVML_ERROR_NOT_SUPPORTED,
        MigError::MigOff => NVML_ERROR_NOT_SUPPORTED,
        MigError::InUse(_) => NVML_ERROR_IN_USE,
        MigError::InsufficientResources => NVML_ERROR_INSUFFICIENT_RESOURCES,
        MigError::InvalidArgument => NVML_ERROR_INVALID_ARGUMENT,
        MigError::NotFound => NVML_ERROR_NOT_FOUND,
        MigError::Io { .. } => NVML_ERROR_UNKNOWN,
    }
}

/// The MIG device behind `h`: `Ok(None)` when `h` is no MIG handle, `NOT_FOUND` when its
/// instance is gone.
pub(crate) fn mig_of(h: nvmlDevice_t) -> Result<Option<MigDevice>, nvmlReturn_t> {
    let Some((gpu, gi, ci)) = handles::mig_ids(h) else {
        return Ok(None);
    };
    let st = state()?;
    let g = st
        .spec
        .gpus
        .get(gpu as usize)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    load()?
        .devices_of(g)
        .into_iter()
        .find(|d| d.gi == gi && d.ci == ci)
        .map(Some)
        .ok_or(NVML_ERROR_NOT_FOUND)
}

/// Whether this process has NVML's privilege (root, unless it gave it up).
pub(crate) fn privileged() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    root && std::env::var(ENV_UNPRIVILEGED).map_or(true, |v| v.is_empty() || v == "0")
}

/// Whether MIG is on for `g`.
pub(crate) fn mig_on(g: &GpuInfo) -> Result<bool, nvmlReturn_t> {
    Ok(g.model.is_some() && load()?.enabled(g.index))
}

/// `NO_PERMISSION` for an unprivileged aggregate query on a parent with MIG on.
pub(crate) fn check_aggregate(g: &GpuInfo) -> Res {
    if mig_on(g)? && !privileged() {
        return Err(NVML_ERROR_NO_PERMISSION);
    }
    Ok(())
}

/// The handle of MIG device `uuid` (`MIG-...`).
pub(crate) fn handle_by_mig_uuid(uuid: &str) -> Result<nvmlDevice_t, nvmlReturn_t> {
    let st = state()?;
    let d = load()?
        .device_by_uuid(&st.spec, uuid)
        .ok_or(NVML_ERROR_NOT_FOUND)?;
    mig_handle(d.gpu, d.gi, d.ci)
}

/// A whole GPU (not a MIG handle) with a model, and its model.
fn parent(h: nvmlDevice_t) -> Result<(&'static GpuInfo, GpuModel), nvmlReturn_t> {
    if mig_handle_parent(h).is_some() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let g = super::device(h)?;
    Ok((g, g.model.ok_or(NVML_ERROR_NOT_SUPPORTED)?))
}

fn need_privilege() -> Res {
    if privileged() {
        Ok(())
    } else {
        Err(NVML_ERROR_NO_PERMISSION)
    }
}

/// Whether a live process holds a context or memory on GPU `gpu` (in MIG device `tag`, when
/// given).
fn busy(gpu: u32, tag: Option<u64>) -> Result<bool, nvmlReturn_t> {
    let procs = tessera_sim_state::read_processes(&state()?.dir).map_err(|_| NVML_ERROR_UNKNOWN)?;
    Ok(procs
        .iter()
        .any(|p| p.uses(gpu) && tag.is_none_or(|t| p.mig_tag[gpu as usize] == t)))
}

fn name_bytes(s: &str) -> [c_char; 96] {
    let mut out = [0 as c_char; 96];
    for (d, b) in out.iter_mut().zip(s.bytes().take(95)) {
        *d = b as c_char;
    }
    out
}

fn gi_name(p: &GiProfile) -> String {
    format!("MIG {}", p.name)
}

/// `nvmlDeviceSetMigMode`: Hopper switches at once (`activationStatus` SUCCESS).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    h: nvmlDevice_t,
    mode: u32,
    activation: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    guard(|| {
        let (g, _) = parent(h)?;
        if mode > NVML_DEVICE_MIG_ENABLE || activation.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        need_privilege()?;
        let dir = &state()?.dir;
        let was = load()?.enabled(g.index);
        let is_busy = was != (mode == NVML_DEVICE_MIG_ENABLE) && busy(g.index, None)?;
        mig::store::update(dir, |st| {
            st.gpu_mut(g.index)
                .set_mode(mode == NVML_DEVICE_MIG_ENABLE, is_busy)
        })
        .map_err(code)?;
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(activation, NVML_SUCCESS) }
    })
}

/// `nvmlDeviceGetMigMode`: current and pending mode (always equal on Hopper).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    h: nvmlDevice_t,
    current: *mut u32,
    pending: *mut u32,
) -> nvmlReturn_t {
    guard(|| {
        let (g, _) = parent(h)?;
        let on = u32::from(load()?.enabled(g.index));
        // SAFETY: caller's out-pointers, null-checked by put.
        unsafe {
            put(current, on)?;
            put(pending, on)
        }
    })
}

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of current `nvml.h` (the graphics and media-engine
/// profiles 10-16 included): an index below it that the part lacks is `NOT_SUPPORTED`, as
/// callers that walk every index (mig-parted, the DRA driver) expect; above, a bad argument.
const GI_PROFILE_COUNT: u32 = 17;

fn profile_of(model: GpuModel, index: u32) -> Result<&'static GiProfile, nvmlReturn_t> {
    if index >= GI_PROFILE_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    model
        .profile_by_index(index)
        .ok_or(NVML_ERROR_NOT_SUPPORTED)
}

fn profile_by_id(model: GpuModel, id: u32) -> Result<&'static GiProfile, nvmlReturn_t> {
    model.profile_by_id(id).ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

/// `nvmlDeviceGetGpuInstanceProfileInfo` (v1 struct; `profile` is an index).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    h: nvmlDevice_t,
    profile: u32,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let (_, model) = parent(h)?;
        let p = profile_of(model, profile)?;
        let v = nvmlGpuInstanceProfileInfo_t {
            id: p.id,
            is_p2p_supported: 0,
            slice_count: p.compute_slices,
            instance_count: p.instance_count,
            multiprocessor_count: p.sms,
            copy_engine_count: p.copy_engines,
            decoder_count: p.decoders,
            encoder_count: 0,
            jpeg_count: p.jpegs,
            ofa_count: p.ofas,
            memory_size_mb: p.memory_mib,
        };
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(info, v) }
    })
}

/// Fills a versioned GPU-instance profile struct (v2 or v3, by its `version`).
///
/// # Safety
/// `info` must be null or point to a struct of the version it names.
unsafe fn gi_profile_v(p: &GiProfile, info: *mut nvmlGpuInstanceProfileInfo_v2_t) -> Res {
    if info.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null struct from the caller; its first word is the version.
    let version = unsafe { info.cast::<u32>().read_unaligned() };
    let name = name_bytes(&gi_name(p));
    match version {
        NVML_GPU_INSTANCE_PROFILE_INFO_V2 => {
            let v = nvmlGpuInstanceProfileInfo_v2_t {
                version,
                id: p.id,
                is_p2p_supported: 0,
                slice_count: p.compute_slices,
                instance_count: p.instance_count,
                multiprocessor_count: p.sms,
                copy_engine_count: p.copy_engines,
                decoder_count: p.decoders,
                encoder_count: 0,
                jpeg_count: p.jpegs,
                ofa_count: p.ofas,
                memory_size_mb: p.memory_mib,
                name,
            };
            // SAFETY: the caller's struct is a v2 one.
            unsafe { put(info, v) }
        }
        NVML_GPU_INSTANCE_PROFILE_INFO_V3 => {
            let v = nvmlGpuInstanceProfileInfo_v3_t {
                version,
                id: p.id,
                slice_count: p.compute_slices,
                instance_count: p.instance_count,
                multiprocessor_count: p.sms,
                copy_engine_count: p.copy_engines,
                decoder_count: p.decoders,
                encoder_count: 0,
                jpeg_count: p.jpegs,
                ofa_count: p.ofas,
                memory_size_mb: p.memory_mib,
                name,
                capabilities: 0,
            };
            // SAFETY: the caller's struct is a v3 one.
            unsafe { put(info.cast::<nvmlGpuInstanceProfileInfo_v3_t>(), v) }
        }
        _ => Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH),
    }
}

/// `nvmlDeviceGetGpuInstanceProfileInfoV` (`profile` is an index; v2 or v3 struct).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    h: nvmlDevice_t,
    profile: u32,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        let (_, model) = parent(h)?;
        let p = profile_of(model, profile)?;
        // SAFETY: the caller's struct matches its version.
        unsafe { gi_profile_v(p, info) }
    })
}

/// `nvmlDeviceGetGpuInstanceProfileInfoByIdV` (`profile_id` is an id).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    h: nvmlDevice_t,
    profile_id: u32,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        let (_, model) = parent(h)?;
        let p = profile_by_id(model, profile_id)?;
        // SAFETY: the caller's struct matches its version.
        unsafe { gi_profile_v(p, info) }
    })
}

/// Writes `items` to a caller's array of `cap` entries and the count to `count`.
///
/// # Safety
/// `count` must be null or writable; `out` null or valid for `cap` entries.
unsafe fn put_list<T: Copy>(items: &[T], out: *mut T, cap: usize, count: *mut u32) -> Res {
    // SAFETY: caller's out-pointer, null-checked by put.
    unsafe { put(count, items.len() as u32) }?;
    if items.is_empty() {
        return Ok(());
    }
    if out.is_null() || cap < items.len() {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (i, v) in items.iter().enumerate() {
        // SAFETY: the caller's array holds at least `cap` >= items.len() entries.
        unsafe { out.add(i).write_unaligned(*v) };
    }
    Ok(())
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`: every placement of the profile, whether
/// free or not; with `placements` null, the count only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    h: nvmlDevice_t,
    profile_id: u32,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut u32,
) -> nvmlReturn_t {
    guard(|| {
        let (g, model) = parent(h)?;
        let p = profile_by_id(model, profile_id)?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if !load()?.enabled(g.index) {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let list: Vec<nvmlGpuInstancePlacement_t> = p
            .placements
            .iter()
            .map(|&start| nvmlGpuInstancePlacement_t {
                start,
                size: p.memory_slices,
            })
            .collect();
        if placements.is_null() {
            // SAFETY: non-null count from the caller.
            return unsafe { put(count, list.len() as u32) };
        }
        // SAFETY: non-null count from the caller.
        let cap = unsafe { count.read_unaligned() } as usize;
        // SAFETY: the caller's array holds `cap` entries.
        unsafe { put_list(&list, placements, cap, count) }
    })
}

/// `nvmlDeviceGetGpuInstanceRemainingCapacity`: how many more of the profile fit now.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    h: nvmlDevice_t,
    profile_id: u32,
    count: *mut u32,
) -> nvmlReturn_t {
    guard(|| {
        let (g, model) = parent(h)?;
        let p = profile_by_id(model, profile_id)?;
        let mut gm = load()?.gpu(g.index);
        if !gm.enabled {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let mut n = 0;
        while gm.create_gi(model, p, None).is_ok() {
            n += 1;
        }
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(count, n) }
    })
}

fn create_gi(h: nvmlDevice_t, profile_id: u32, start: Option<u32>) -> Result<u32, nvmlReturn_t> {
    let (g, model) = parent(h)?;
    let p = profile_by_id(model, profile_id)?;
    need_privilege()?;
    let id = mig::store::update(&state()?.dir, |st| {
        if !st.enabled(g.index) {
            return Err(MigError::MigOff);
        }
        st.gpu_mut(g.index).create_gi(model, p, start)
    })
    .map_err(code)?;
    Ok(id)
}

/// `nvmlDeviceCreateGpuInstance`: at the first free placement.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    h: nvmlDevice_t,
    profile_id: u32,
    gi: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    guard(|| {
        if gi.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let g = super::device(h)?.index;
        let id = create_gi(h, profile_id, None)?;
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(gi, gi_handle(g, id)?) }
    })
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement`: at exactly `placement` (its `start`; its size
/// must be the profile's).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    h: nvmlDevice_t,
    profile_id: u32,
    placement: *const nvmlGpuInstancePlacement_t,
    gi: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    guard(|| {
        if gi.is_null() || placement.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null placement from the caller.
        let pl = unsafe { placement.read_unaligned() };
        let (g, model) = parent(h)?;
        if profile_by_id(model, profile_id)?.memory_slices != pl.size {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let id = create_gi(h, profile_id, Some(pl.start))?;
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(gi, gi_handle(g.index, id)?) }
    })
}

/// The GPU, its model and the GPU instance id behind a GPU-instance handle (which must still
/// exist).
fn gi_of(h: nvmlGpuInstance_t) -> Result<(&'static GpuInfo, GpuModel, u32), nvmlReturn_t> {
    let (gpu, id) = handles::gi_ids(h).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let g = state()?
        .spec
        .gpus
        .get(gpu as usize)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let model = g.model.ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    load()?.gpu(gpu).gi(id).ok_or(NVML_ERROR_NOT_FOUND)?;
    Ok((g, model, id))
}

/// `nvmlGpuInstanceDestroy`: `IN_USE` while it has compute instances.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceDestroy(gi: nvmlGpuInstance_t) -> nvmlReturn_t {
    guard(|| {
        let (g, _, id) = gi_of(gi)?;
        need_privilege()?;
        mig::store::update(&state()?.dir, |st| st.gpu_mut(g.index).destroy_gi(id)).map_err(code)
    })
}

/// `nvmlDeviceGetGpuInstances`: the GPU instances of one profile (the caller's array holds the
/// profile's instance count).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    h: nvmlDevice_t,
    profile_id: u32,
    out: *mut nvmlGpuInstance_t,
    count: *mut u32,
) -> nvmlReturn_t {
    guard(|| {
        let (g, model) = parent(h)?;
        let p = profile_by_id(model, profile_id)?;
        let gm = load()?.gpu(g.index);
        if !gm.enabled {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let list = gm
            .gis
            .iter()
            .filter(|gi| gi.profile_id == p.id)
            .map(|gi| gi_handle(g.index, gi.id))
            .collect::<Result<Vec<_>, _>>()?;
        // SAFETY: the caller's array holds the profile's instance count.
        unsafe { put_list(&list, out, p.instance_count as usize, count) }
    })
}

/// `nvmlDeviceGetGpuInstanceById`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    h: nvmlDevice_t,
    id: u32,
    gi: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    guard(|| {
        let (g, _) = parent(h)?;
        let gm = load()?.gpu(g.index);
        if !gm.enabled {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        gm.gi(id).ok_or(NVML_ERROR_NOT_FOUND)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(gi, gi_handle(g.index, id)?) }
    })
}

/// `nvmlGpuInstanceGetInfo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gi: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let (g, _, id) = gi_of(gi)?;
        let gm = load()?.gpu(g.index);
        let i = gm.gi(id).ok_or(NVML_ERROR_NOT_FOUND)?;
        let v = nvmlGpuInstanceInfo_t {
            device: handle_of(g.index),
            id,
            profile_id: i.profile_id,
            placement: nvmlGpuInstancePlacement_t {
                start: i.start,
                size: i.size,
            },
        };
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(info, v) }
    })
}

/// The compute-instance profile `profile` of GPU instance `gi` (slices and SMs).
fn ci_profile(
    model: GpuModel,
    g: &GpuInfo,
    gi: u32,
    profile: u32,
) -> Result<(u32, u32, &'static GiProfile), nvmlReturn_t> {
    let gm = load()?.gpu(g.index);
    let i = gm.gi(gi).ok_or(NVML_ERROR_NOT_FOUND)?;
    let p = profile_by_id(model, i.profile_id)?;
    let slices = mig::profiles::ci_profile_slices(profile).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    if slices > p.compute_slices {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    Ok((slices, mig::profiles::ci_sms(p, slices), p))
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfo` (v1; `profile` an index, which is the id).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gi: nvmlGpuInstance_t,
    profile: u32,
    eng_profile: u32,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let (g, model, id) = gi_of(gi)?;
        if eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (slices, sms, p) = ci_profile(model, g, id, profile)?;
        let v = nvmlComputeInstanceProfileInfo_t {
            id: profile,
            slice_count: slices,
            instance_count: p.compute_slices / slices,
            multiprocessor_count: sms,
            shared_copy_engine_count: p.copy_engines,
            shared_decoder_count: p.decoders,
            shared_encoder_count: 0,
            shared_jpeg_count: p.jpegs,
            shared_ofa_count: p.ofas,
        };
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(info, v) }
    })
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfoV` (v2 struct).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gi: nvmlGpuInstance_t,
    profile: u32,
    eng_profile: u32,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        let (g, model, id) = gi_of(gi)?;
        if eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED || info.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null struct from the caller; its first word is the version.
        let version = unsafe { info.cast::<u32>().read_unaligned() };
        if version != NVML_COMPUTE_INSTANCE_PROFILE_INFO_V2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (slices, sms, p) = ci_profile(model, g, id, profile)?;
        let v = nvmlComputeInstanceProfileInfo_v2_t {
            version,
            id: profile,
            slice_count: slices,
            instance_count: p.compute_slices / slices,
            multiprocessor_count: sms,
            shared_copy_engine_count: p.copy_engines,
            shared_decoder_count: p.decoders,
            shared_encoder_count: 0,
            shared_jpeg_count: p.jpegs,
            shared_ofa_count: p.ofas,
            name: name_bytes(&format!("MIG {}", mig::profiles::ci_name(p, slices))),
        };
        // SAFETY: non-null v2 struct from the caller.
        unsafe { put(info, v) }
    })
}

/// `nvmlGpuInstanceGetComputeInstanceRemainingCapacity`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    gi: nvmlGpuInstance_t,
    profile: u32,
    count: *mut u32,
) -> nvmlReturn_t {
    guard(|| {
        let (g, model, id) = gi_of(gi)?;
        ci_profile(model, g, id, profile)?;
        let mut gm = load()?.gpu(g.index);
        let mut n = 0;
        while gm.create_ci(model, id, profile, [0; 16]).is_ok() {
            n += 1;
        }
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(count, n) }
    })
}

/// `nvmlGpuInstanceCreateComputeInstance`: a fresh MIG device with a new UUID.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gi: nvmlGpuInstance_t,
    profile: u32,
    ci: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    guard(|| {
        let (g, model, id) = gi_of(gi)?;
        if ci.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        need_privilege()?;
        let made = mig::store::update(&state()?.dir, |st| {
            let uuid = st.fresh_uuid(&g.uuid_bytes);
            st.gpu_mut(g.index).create_ci(model, id, profile, uuid)
        })
        .map_err(code)?;
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(ci, ci_handle(g.index, id, made)?) }
    })
}

/// The GPU, GPU instance id and compute instance id behind a compute-instance handle (which
/// must still exist).
fn ci_of(h: nvmlComputeInstance_t) -> Result<(&'static GpuInfo, u32, u32), nvmlReturn_t> {
    let (gpu, gi, ci) = handles::ci_ids(h).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let g = state()?
        .spec
        .gpus
        .get(gpu as usize)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let gm = load()?.gpu(gpu);
    let i = gm.gi(gi).ok_or(NVML_ERROR_NOT_FOUND)?;
    i.cis
        .iter()
        .find(|c| c.id == ci)
        .ok_or(NVML_ERROR_NOT_FOUND)?;
    Ok((g, gi, ci))
}

/// `nvmlComputeInstanceDestroy`: `IN_USE` while a process runs on it.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlComputeInstanceDestroy(ci: nvmlComputeInstance_t) -> nvmlReturn_t {
    guard(|| {
        let (g, gi, id) = ci_of(ci)?;
        need_privilege()?;
        let is_busy = busy(g.index, Some(mig::tag(gi, id)))?;
        mig::store::update(&state()?.dir, |st| {
            st.gpu_mut(g.index).destroy_ci(gi, id, is_busy)
        })
        .map_err(code)
    })
}

/// `nvmlGpuInstanceGetComputeInstances`: those of one profile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gi: nvmlGpuInstance_t,
    profile: u32,
    out: *mut nvmlComputeInstance_t,
    count: *mut u32,
) -> nvmlReturn_t {
    guard(|| {
        let (g, model, id) = gi_of(gi)?;
        let (slices, _, p) = ci_profile(model, g, id, profile)?;
        let gm = load()?.gpu(g.index);
        let list = gm
            .gi(id)
            .ok_or(NVML_ERROR_NOT_FOUND)?
            .cis
            .iter()
            .filter(|c| c.profile == profile)
            .map(|c| ci_handle(g.index, id, c.id))
            .collect::<Result<Vec<_>, _>>()?;
        // SAFETY: the caller's array holds the profile's instance count.
        unsafe { put_list(&list, out, (p.compute_slices / slices) as usize, count) }
    })
}

/// `nvmlGpuInstanceGetComputeInstanceById`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gi: nvmlGpuInstance_t,
    id: u32,
    ci: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    guard(|| {
        let (g, _, gid) = gi_of(gi)?;
        let h = ci_handle(g.index, gid, id)?;
        ci_of(h)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(ci, h) }
    })
}

/// `nvmlComputeInstanceGetInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    ci: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let (g, gi, id) = ci_of(ci)?;
        let gm = load()?.gpu(g.index);
        let c = gm
            .gi(gi)
            .and_then(|i| i.cis.iter().find(|c| c.id == id))
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        let v = nvmlComputeInstanceInfo_t {
            device: handle_of(g.index),
            gpu_instance: gi_handle(g.index, gi)?,
            id,
            profile_id: c.profile,
            placement: nvmlComputeInstancePlacement_t {
                start: c.start,
                size: c.size,
            },
        };
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(info, v) }
    })
}

/// `nvmlComputeInstanceGetInfo` (the same struct).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo(
    ci: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlComputeInstanceGetInfo_v2(ci, info) }
}

/// `nvmlDeviceIsMigDeviceHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    h: nvmlDevice_t,
    is_mig: *mut u32,
) -> nvmlReturn_t {
    guard(|| {
        let mig = mig_of(h)?.is_some();
        if !mig {
            super::device(h)?;
        }
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(is_mig, u32::from(mig)) }
    })
}

fn mig_device(h: nvmlDevice_t) -> Result<MigDevice, nvmlReturn_t> {
    match mig_of(h)? {
        Some(d) => Ok(d),
        None => {
            super::device(h)?;
            Err(NVML_ERROR_NOT_SUPPORTED)
        }
    }
}

/// `nvmlDeviceGetGpuInstanceId` (MIG device handles only).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(h: nvmlDevice_t, id: *mut u32) -> nvmlReturn_t {
    guard(|| {
        let d = mig_device(h)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(id, d.gi) }
    })
}

/// `nvmlDeviceGetComputeInstanceId` (MIG device handles only).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    h: nvmlDevice_t,
    id: *mut u32,
) -> nvmlReturn_t {
    guard(|| {
        let d = mig_device(h)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(id, d.ci) }
    })
}

/// `nvmlDeviceGetMaxMigDeviceCount`: 7 on a modelled part, 0 otherwise.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    h: nvmlDevice_t,
    count: *mut u32,
) -> nvmlReturn_t {
    guard(|| {
        if mig_handle_parent(h).is_some() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let g = super::device(h)?;
        let n = if g.model.is_some() {
            mig::profiles::COMPUTE_SLICES
        } else {
            0
        };
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(count, n) }
    })
}

/// `nvmlDeviceGetMigDeviceHandleByIndex`: the `index`-th MIG device of a GPU (by GPU instance,
/// then compute instance id); `NOT_FOUND` past the last.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    h: nvmlDevice_t,
    index: u32,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        let (g, _) = parent(h)?;
        let st = load()?;
        if !st.enabled(g.index) {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let d = st
            .devices_of(g)
            .into_iter()
            .nth(index as usize)
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(out, mig_handle(d.gpu, d.gi, d.ci)?) }
    })
}

/// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    h: nvmlDevice_t,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        let d = mig_of(h)?.ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(out, handle_of(d.gpu)) }
    })
}

/// `nvmlDeviceGetAttributes_v2`: a MIG device's slices, SMs and memory; a whole GPU's SMs
/// and memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    h: nvmlDevice_t,
    a: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    guard(|| {
        let v = match mig_of(h)? {
            Some(d) => {
                let gm = load()?.gpu(d.gpu);
                let ci_slices = gm
                    .gi(d.gi)
                    .and_then(|i| i.cis.iter().find(|c| c.id == d.ci))
                    .map_or(0, |c| c.size);
                nvmlDeviceAttributes_t {
                    multiprocessor_count: d.sms,
                    shared_copy_engine_count: d.gi_profile.copy_engines,
                    shared_decoder_count: d.gi_profile.decoders,
                    shared_encoder_count: 0,
                    shared_jpeg_count: d.gi_profile.jpegs,
                    shared_ofa_count: d.gi_profile.ofas,
                    gpu_instance_slice_count: d.gi_profile.compute_slices,
                    compute_instance_slice_count: ci_slices,
                    memory_size_mb: d.gi_profile.memory_mib,
                }
            }
            None => {
                let g = super::device(h)?;
                nvmlDeviceAttributes_t {
                    multiprocessor_count: g.sms,
                    memory_size_mb: g.total_bytes >> 20,
                    ..Default::default()
                }
            }
        };
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(a, v) }
    })
}

/// `nvmlDeviceGetAttributes` (the same struct).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes(
    h: nvmlDevice_t,
    a: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetAttributes_v2(h, a) }
}

/// Writes a MIG device's name or UUID; `Ok(false)` when `h` is no MIG handle.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes.
pub(crate) unsafe fn mig_string(
    h: nvmlDevice_t,
    buf: *mut c_char,
    len: u32,
    uuid: bool,
) -> Result<bool, nvmlReturn_t> {
    let Some(d) = mig_of(h)? else {
        return Ok(false);
    };
    let s = if uuid { &d.uuid } else { &d.name };
    // SAFETY: the caller's buffer of `len` bytes.
    unsafe { copy_str(s, buf, len) }?;
    Ok(true)
}
