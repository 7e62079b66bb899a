//! Process-wide state after `cuInit`, handle registries and the panic guard.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

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
    let _g = INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if RT.get().is_some() {
        return Ok(());
    }
    let spec = SimSpec::from_env().map_err(|e| {
        eprintln!("tessera-sim: {e}");
        CUDA_ERROR_NO_DEVICE
    })?;
    let dir = tessera_sim_state::state_dir_from_env();
    let totals = spec.gpus.iter().map(|g| g.total_bytes).collect();
    let ledger = Ledger::open(&dir, totals).map_err(|e| {
        eprintln!("tessera-sim: {e}");
        CUDA_ERROR_OPERATING_SYSTEM
    })?;
    let _ = RT.set(Runtime { spec, dir, ledger });
    Ok(())
}

/// The simulated GPU with ordinal `dev`, or `CUDA_ERROR_INVALID_DEVICE`.
pub fn gpu(dev: CUdevice) -> Result<&'static GpuInfo, CUresult> {
    let rt = rt()?;
    usize::try_from(dev)
        .ok()
        .and_then(|d| rt.spec.gpus.get(d))
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
        self.map()
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, v);
    }

    pub fn get(&self, id: usize) -> Option<Arc<T>> {
        self.map()
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    pub fn remove(&self, id: usize) -> Option<Arc<T>> {
        self.map()
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
    }

    pub fn values(&self) -> Vec<Arc<T>> {
        self.map()
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
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
