//! MIG handles as addresses in static tables, one byte per (GPU, GPU instance id, compute
//! instance id): a handle names its ids and nothing else, so it stays meaningful (or answers
//! `NOT_FOUND`) after its instance is gone, and no allocation is needed to hand one out.

use tessera_sim_state::MAX_GPUS;

use crate::ffi::*;

/// Instance ids per level the handle tables cover (an H100/H200 has at most 7 of each).
const IDS: usize = 8;
static MIG_DEVICES: [u8; MAX_GPUS * IDS * IDS] = [0; MAX_GPUS * IDS * IDS];
static GPU_INSTANCES: [u8; MAX_GPUS * IDS] = [0; MAX_GPUS * IDS];
static COMPUTE_INSTANCES: [u8; MAX_GPUS * IDS * IDS] = [0; MAX_GPUS * IDS * IDS];

fn slot_of(table: &'static [u8], h: *mut std::ffi::c_void) -> Option<usize> {
    let off = (h as usize).wrapping_sub(table.as_ptr() as usize);
    (off < table.len()).then_some(off)
}

/// `(gpu, gi, ci)` of a slot in a two-level table.
fn ids3(slot: usize) -> (u32, u32, u32) {
    (
        (slot / (IDS * IDS)) as u32,
        ((slot / IDS) % IDS) as u32,
        (slot % IDS) as u32,
    )
}

pub(super) fn mig_handle(gpu: u32, gi: u32, ci: u32) -> Result<nvmlDevice_t, nvmlReturn_t> {
    let (g, i, c) = (gpu as usize, gi as usize, ci as usize);
    if g >= MAX_GPUS || i >= IDS || c >= IDS {
        return Err(NVML_ERROR_UNKNOWN);
    }
    Ok(&MIG_DEVICES[(g * IDS + i) * IDS + c] as *const u8 as nvmlDevice_t)
}

pub(super) fn gi_handle(gpu: u32, gi: u32) -> Result<nvmlGpuInstance_t, nvmlReturn_t> {
    let (g, i) = (gpu as usize, gi as usize);
    if g >= MAX_GPUS || i >= IDS {
        return Err(NVML_ERROR_UNKNOWN);
    }
    Ok(&GPU_INSTANCES[g * IDS + i] as *const u8 as nvmlGpuInstance_t)
}

pub(super) fn ci_handle(gpu: u32, gi: u32, ci: u32) -> Result<nvmlComputeInstance_t, nvmlReturn_t> {
    let (g, i, c) = (gpu as usize, gi as usize, ci as usize);
    if g >= MAX_GPUS || i >= IDS || c >= IDS {
        return Err(NVML_ERROR_UNKNOWN);
    }
    Ok(&COMPUTE_INSTANCES[(g * IDS + i) * IDS + c] as *const u8 as nvmlComputeInstance_t)
}

/// `(gpu, gi, ci)` of a MIG device handle; `None` for any other value.
pub(super) fn mig_ids(h: nvmlDevice_t) -> Option<(u32, u32, u32)> {
    slot_of(&MIG_DEVICES, h).map(ids3)
}

/// `(gpu, gi)` of a GPU-instance handle; `None` for any other value.
pub(super) fn gi_ids(h: nvmlGpuInstance_t) -> Option<(u32, u32)> {
    slot_of(&GPU_INSTANCES, h).map(|s| ((s / IDS) as u32, (s % IDS) as u32))
}

/// `(gpu, gi, ci)` of a compute-instance handle; `None` for any other value.
pub(super) fn ci_ids(h: nvmlComputeInstance_t) -> Option<(u32, u32, u32)> {
    slot_of(&COMPUTE_INSTANCES, h).map(ids3)
}

/// The parent GPU of a MIG device handle; `None` for any other value.
pub(crate) fn mig_handle_parent(h: nvmlDevice_t) -> Option<u32> {
    mig_ids(h).map(|(gpu, _, _)| gpu)
}
