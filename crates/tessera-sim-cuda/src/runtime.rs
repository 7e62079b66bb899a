//! Process-wide state after `cuInit`, handle registries and the panic guard.

use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tessera_sim_state::mig::{MigDevice, MigState};
use tessera_sim_state::{GpuInfo, Ledger, SimSpec};

use crate::ffi::*;

/// Result of an API body; `Err` carries the CUresult to return.
pub type Res = Result<(), CUresult>;

/// Runs an API body, turning a panic into `CUDA_ERROR_UNKNOWN` (never unwinds into C).
pub fn guard(f: impl FnOnce() -> Res) -> CUresult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes `v` through an out-pointer, `CUDA_ERROR_INVALID_VALUE` when it is null.
///
/// # Safety
/// `p` must be null or valid for writing a `T`.
pub unsafe fn put<T>(p: *mut T, v: T) -> Res {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller promises it is valid for writes.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// Everything `cuInit` sets up.
pub struct Runtime {
    pub spec: SimSpec,
    pub dir: PathBuf,
    pub ledger: Ledger,
    /// The physical GPUs this process sees (`CUDA_VISIBLE_DEVICES`), in ordinal order: device
    /// ordinal `n` is `spec.gpus[visible[n]]`.
    pub visible: Vec<u32>,
    /// The MIG device this process runs on, if `CUDA_VISIBLE_DEVICES` named one: its parent's
    /// entry in `spec` then shows the instance (memory, SMs, name, UUID), its memory is held
    /// to the instance and its kernels run on the instance's engine.
    pub mig: Option<MigDevice>,
}

impl Runtime {
    /// Device memory in use where physical GPU `gpu` is this process's device: its MIG
    /// device's GPU instance, or the whole card.
    pub fn memory_used(&self, gpu: u32) -> Result<u64, tessera_sim_state::LedgerError> {
        match self.mig.as_ref().filter(|d| d.gpu == gpu) {
            Some(d) => tessera_sim_state::instance_memory_used(&self.dir, gpu, d.tag()),
            None => tessera_sim_state::device_memory_used(&self.dir, gpu),
        }
    }

    /// The engine kernels on physical GPU `gpu` run on (its MIG device's own, if any).
    pub fn open_engine(
        &self,
        gpu: u32,
    ) -> Result<tessera_sim_state::Engine, tessera_sim_state::EngineError> {
        match self.mig.as_ref().filter(|d| d.gpu == gpu) {
            Some(d) => tessera_sim_state::Engine::open_mig(&self.dir, gpu, d.tag()),
            None => tessera_sim_state::Engine::open(&self.dir, gpu),
        }
    }
}

/// The physical GPUs a `CUDA_VISIBLE_DEVICES` value selects, in ordinal order, as the driver
/// reads it: unset means every GPU; otherwise a comma-separated list of indexes (`1`, `0,2`),
/// UUIDs (`GPU-21056e06-...`) or unique UUID prefixes (`GPU-2105`). The first entry that is
/// invalid (unknown, out of range, ambiguous, repeated, or empty) ends the list, so an empty
/// value selects no GPU at all.
pub fn visible_devices(spec: &SimSpec, value: Option<&str>) -> Vec<u32> {
    visible_with_mig(spec, &MigState::default(), value).0
}

/// [`visible_devices`] on a machine with MIG: a GPU with MIG on is no device of its own (unset,
/// it is left out; named by index or UUID, it ends the list), and `MIG-<uuid>` (or a unique
/// prefix) names a MIG device, shown on its parent's ordinal. As CUDA enumerates a single MIG
/// device per process, a second one ends the list. Returns the GPUs and the MIG device.
pub fn visible_with_mig(
    spec: &SimSpec,
    mig: &MigState,
    value: Option<&str>,
) -> (Vec<u32>, Option<MigDevice>) {
    let whole = |i: u32| !mig.enabled(i);
    let Some(value) = value else {
        return (
            spec.gpus
                .iter()
                .map(|g| g.index)
                .filter(|&i| whole(i))
                .collect(),
            None,
        );
    };
    let mut out: Vec<u32> = Vec::new();
    let mut chosen: Option<MigDevice> = None;
    for entry in value.split(',').map(str::trim) {
        let found = if entry.len() > 4 && entry[..4].eq_ignore_ascii_case("MIG-") {
            let want = entry.to_ascii_lowercase();
            let devices = mig.devices(spec);
            let mut matches = devices
                .iter()
                .filter(|d| d.uuid.to_ascii_lowercase().starts_with(&want));
            match (matches.next(), matches.next(), &chosen) {
                (Some(d), None, None) => {
                    chosen = Some(d.clone());
                    Some(d.gpu)
                }
                _ => None,
            }
        } else if !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit()) {
            entry
                .parse::<usize>()
                .ok()
                .and_then(|i| spec.gpus.get(i))
                .map(|g| g.index)
        } else if entry.len() > 4 && entry[..4].eq_ignore_ascii_case("GPU-") {
            let want = entry.to_ascii_lowercase();
            let mut matches = spec
                .gpus
                .iter()
                .filter(|g| g.uuid.to_ascii_lowercase().starts_with(&want));
            match (matches.next(), matches.next()) {
                (Some(g), None) => Some(g.index),
                _ => None,
            }
        } else {
            None
        };
        match found {
            Some(i)
                if !out.contains(&i)
                    && (whole(i) || chosen.as_ref().is_some_and(|d| d.gpu == i)) =>
            {
                out.push(i)
            }
            _ => break,
        }
    }
    if chosen.as_ref().is_some_and(|d| !out.contains(&d.gpu)) {
        chosen = None;
    }
    (out, chosen)
}

static RT: OnceLock<Runtime> = OnceLock::new();
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// The runtime, or `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
pub fn rt() -> Result<&'static Runtime, CUresult> {
    RT.get().ok_or(CUDA_ERROR_NOT_INITIALIZED)
}

/// Reads the environment and opens the shared state (idempotent).
pub fn init() -> Res {
    if RT.get().is_some() {
        return Ok(());
    }
    let _g = INIT_LOCK.lock();
    if RT.get().is_some() {
        return Ok(());
    }
    let mut spec = SimSpec::from_env().map_err(|e| {
        eprintln!("tessera-sim: {e}");
        CUDA_ERROR_NO_DEVICE
    })?;
    let dir = tessera_sim_state::state_dir_from_env();
    let visible_var = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    // A layout that cannot be read fails closed: no device rather than a guessed one.
    let mig_state = tessera_sim_state::mig::store::load(&dir).map_err(|e| {
        eprintln!("tessera-sim: {e}");
        CUDA_ERROR_NO_DEVICE
    })?;
    let (visible, mig) = visible_with_mig(&spec, &mig_state, visible_var.as_deref());
    if let Some(d) = &mig {
        // The MIG device stands in its parent's place: its memory, SMs, name and UUID.
        let g = &mut spec.gpus[d.gpu as usize];
        g.total_bytes = d.memory_bytes;
        g.sms = d.sms;
        g.name = d.name.clone();
        g.uuid = d.uuid.clone();
        g.uuid_bytes = d.uuid_bytes;
    }
    if visible.is_empty() {
        // As the driver: no visible device fails cuInit, and everything after it.
        return Err(CUDA_ERROR_NO_DEVICE);
    }
    let context_memory = tessera_sim_state::context_memory_from_env().map_err(|e| {
        eprintln!("tessera-sim: {e}");
        CUDA_ERROR_NO_DEVICE
    })?;
    // Each context the driver makes has its own device state (cuCtxCreate: "creates a new CUDA
    // context"; only the primary context is shared, per device, within a process), so a further
    // context costs what the first does unless told otherwise.
    let further_context_memory = tessera_sim_state::further_context_memory_from_env()
        .map_err(|e| {
            eprintln!("tessera-sim: {e}");
            CUDA_ERROR_NO_DEVICE
        })?
        .unwrap_or(context_memory);
    let totals = spec.gpus.iter().map(|g| g.total_bytes).collect();
    let mut ledger = Ledger::open(&dir, totals)
        .map_err(|e| {
            eprintln!("tessera-sim: {e}");
            CUDA_ERROR_OPERATING_SYSTEM
        })?
        .with_context_memory(context_memory)
        .with_further_context_memory(further_context_memory);
    if let Some(d) = &mig {
        ledger = ledger.with_mig(d);
    }
    let _ = RT.set(Runtime {
        spec,
        dir,
        ledger,
        visible,
        mig,
    });
    Ok(())
}

/// The simulated GPU with ordinal `dev` (counted over the visible GPUs), or
/// `CUDA_ERROR_INVALID_DEVICE`. Its `index` is the physical GPU, which every charge, engine
/// and context is kept under.
pub fn gpu(dev: CUdevice) -> Result<&'static GpuInfo, CUresult> {
    let rt = rt()?;
    usize::try_from(dev)
        .ok()
        .and_then(|d| rt.visible.get(d))
        .and_then(|&i| rt.spec.gpus.get(i as usize))
        .ok_or(CUDA_ERROR_INVALID_DEVICE)
}

/// The physical GPU `index` (as kept in contexts, allocations and pools).
pub fn physical_gpu(index: u32) -> Result<&'static GpuInfo, CUresult> {
    rt()?
        .spec
        .gpus
        .get(index as usize)
        .ok_or(CUDA_ERROR_INVALID_DEVICE)
}

/// The device ordinal this process knows physical GPU `index` by.
pub fn ordinal(index: u32) -> Result<CUdevice, CUresult> {
    rt()?
        .visible
        .iter()
        .position(|&i| i == index)
        .map(|o| o as CUdevice)
        .ok_or(CUDA_ERROR_INVALID_DEVICE)
}

/// A fresh opaque handle value (never 0, 1 or 2, which are special stream values).
pub fn next_handle() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0x7e55_0000_1000);
    NEXT.fetch_add(0x10, Ordering::Relaxed)
}

/// Handle -> object map for one kind of driver object.
pub struct Registry<T> {
    map: OnceLock<RwLock<HashMap<usize, Arc<T>>>>,
}

impl<T> Registry<T> {
    pub const fn new() -> Registry<T> {
        Registry {
            map: OnceLock::new(),
        }
    }

    fn map(&self) -> &RwLock<HashMap<usize, Arc<T>>> {
        self.map.get_or_init(|| RwLock::new(HashMap::new()))
    }

    pub fn insert(&self, id: usize, v: Arc<T>) {
        self.map().write().insert(id, v);
    }

    pub fn get(&self, id: usize) -> Option<Arc<T>> {
        self.map().read().get(&id).cloned()
    }

    pub fn remove(&self, id: usize) -> Option<Arc<T>> {
        self.map().write().remove(&id)
    }

    pub fn values(&self) -> Vec<Arc<T>> {
        self.map().read().values().cloned().collect()
    }
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// `cuInit`.
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: u32) -> CUresult {
    guard(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        init()
    })
}

/// The driver version reported: CUDA 13.0.
pub const DRIVER_VERSION: i32 = 13000;

/// `cuDriverGetVersion` (works before `cuInit`, as the real one does).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut i32) -> CUresult {
    // SAFETY: `v` is the caller's out-pointer; `put` checks null.
    guard(|| unsafe { put(v, DRIVER_VERSION) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SimSpec {
        SimSpec::parse("1x16GiB,1x24GiB,1x80GiB").unwrap()
    }

    fn v(value: Option<&str>) -> Vec<u32> {
        visible_devices(&spec(), value)
    }

    #[test]
    fn unset_shows_every_gpu() {
        assert_eq!(v(None), vec![0, 1, 2]);
    }

    #[test]
    fn indexes_select_and_reorder() {
        assert_eq!(v(Some("1")), vec![1]);
        assert_eq!(v(Some("0,2")), vec![0, 2]);
        assert_eq!(
            v(Some("2,0")),
            vec![2, 0],
            "ordinals follow the list's order"
        );
        assert_eq!(v(Some(" 2 , 1 ")), vec![2, 1]);
    }

    #[test]
    fn uuids_and_unique_prefixes() {
        let s = spec();
        let u1 = s.gpus[1].uuid.clone();
        let u2 = s.gpus[2].uuid.clone();
        assert_eq!(visible_devices(&s, Some(&u1)), vec![1]);
        assert_eq!(visible_devices(&s, Some(&format!("{u2},{u1}"))), vec![2, 1]);
        assert_eq!(
            visible_devices(&s, Some(&u2[..12])),
            vec![2],
            "a unique prefix"
        );
        assert_eq!(visible_devices(&s, Some(&u2.to_ascii_uppercase())), vec![2]);
        assert_eq!(
            visible_devices(&s, Some(&format!("0,{u2}"))),
            vec![0, 2],
            "mixed forms"
        );
        assert_eq!(
            visible_devices(&s, Some("GPU-")),
            Vec::<u32>::new(),
            "matches all: ambiguous"
        );
        assert_eq!(visible_devices(&s, Some("GPU-zzzz")), Vec::<u32>::new());
    }

    #[test]
    fn an_invalid_entry_ends_the_list() {
        assert_eq!(v(Some("1,7,0")), vec![1], "out of range");
        assert_eq!(v(Some("0,foo,2")), vec![0]);
        assert_eq!(v(Some("2,-1,0")), vec![2]);
        assert_eq!(v(Some("1,1,2")), vec![1], "a repeated GPU");
        assert_eq!(v(Some("0,,1")), vec![0]);
        assert_eq!(v(Some("MIG-1234")), Vec::<u32>::new());
    }

    #[test]
    fn empty_means_no_gpu() {
        assert_eq!(v(Some("")), Vec::<u32>::new());
        assert_eq!(v(Some("-1")), Vec::<u32>::new());
    }

    #[test]
    fn a_mig_device_stands_alone_and_its_parent_is_no_device() {
        use tessera_sim_state::mig::{GpuModel, MigState};
        let spec = SimSpec::parse("3xH200").unwrap();
        let m = GpuModel::H200;
        let mut st = MigState::default();
        st.gpu_mut(1).set_mode(true, false).unwrap();
        for _ in 0..2 {
            let gi = st
                .gpu_mut(1)
                .create_gi(m, m.profile_by_name("1g.18gb").unwrap(), None)
                .unwrap();
            let u = st.fresh_uuid(&spec.gpus[1].uuid_bytes);
            st.gpu_mut(1).create_ci(m, gi, 0, u).unwrap();
        }
        let devs = st.devices(&spec);
        let (a, b) = (&devs[0].uuid, &devs[1].uuid);
        // Unset: the GPUs without MIG only.
        assert_eq!(visible_with_mig(&spec, &st, None), (vec![0, 2], None));
        // A MIG device on its parent's ordinal; a prefix that names one works.
        let (gpus, dev) = visible_with_mig(&spec, &st, Some(&a[..12]));
        assert_eq!((gpus, dev.as_ref()), (vec![1], Some(&devs[0])));
        // A second MIG device, or the parent with MIG on, ends the list.
        let (gpus, dev) = visible_with_mig(&spec, &st, Some(&format!("0,{b},{a},2")));
        assert_eq!((gpus, dev.as_ref()), (vec![0, 1], Some(&devs[1])));
        assert_eq!(
            visible_with_mig(&spec, &st, Some(&format!("1,{a}"))),
            (vec![], None)
        );
        assert_eq!(
            visible_with_mig(&spec, &st, Some(&spec.gpus[1].uuid)),
            (vec![], None)
        );
        assert_eq!(
            visible_with_mig(&spec, &st, Some("MIG-ffff")),
            (vec![], None)
        );
    }
}
