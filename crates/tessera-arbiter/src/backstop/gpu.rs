//! What the backstop reads of the GPUs: processes and their memory, and GPU time (NVML).

#[allow(unused_imports)]
use super::*;
use nvml_wrapper::error::NvmlError;
use tessera_protocol::GpuInfo;

/// One process on a GPU, as NVML reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuProcess {
    /// Host pid.
    pub pid: i32,
    /// The GPU (NVML index).
    pub gpu: u32,
    /// Device memory it holds, bytes.
    pub used: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum GpuSourceError {
    /// NVML failed.
    #[error(transparent)]
    Nvml(#[from] nvml_wrapper::error::NvmlError),
    /// The devices could not be listed.
    #[error(transparent)]
    Discovery(#[from] crate::gpus::GpusError),
    /// A fake source was told to fail (tests).
    #[error("{0}")]
    Other(String),
}

/// One per-process utilisation sample of a GPU, as NVML gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UtilSample {
    /// Host pid.
    pub pid: i32,
    /// SM utilisation over the sample, percent.
    pub sm_util: u32,
    /// When it was taken, µs since the epoch.
    pub timestamp: u64,
}

/// What the backstop reads from the GPUs: NVML in production ([`NvmlSource`]), a fake in
/// tests. Devices are the arbiter's ([`crate::gpus`]): read by UUID, so a MIG device is read
/// whatever its position among its parent's.
pub trait GpuSource: Send {
    /// The node's devices now, numbered as discovery numbers them
    /// ([`crate::gpus::keep_indexes`] gives them the arbiter's indexes); `None` when this
    /// source's devices do not change (fakes): the arbiter's list is read as it is.
    fn discover(&self) -> Option<Result<Vec<GpuInfo>, GpuSourceError>> {
        None
    }
    /// The processes on `gpu` with their device memory (compute and graphics), each tagged
    /// with `gpu.index`; none when the device is gone.
    fn processes(&self, gpu: &GpuInfo) -> Result<Vec<GpuProcess>, GpuSourceError>;
    /// `gpu`'s per-process utilisation samples newer than `since_us` (none: empty). `None`
    /// when this system cannot give them at all.
    fn utilization(&self, gpu: &GpuInfo, since_us: u64) -> Option<Vec<UtilSample>>;
}

/// [`GpuSource`] over NVML.
pub struct NvmlSource(nvml_wrapper::Nvml);

impl NvmlSource {
    /// Loads NVML (`lib`, or `libnvidia-ml.so.1` from the loader's search path).
    pub fn load(lib: Option<&std::ffi::OsStr>) -> Result<Self, crate::gpus::GpusError> {
        let mut builder = nvml_wrapper::Nvml::builder();
        if let Some(lib) = lib {
            builder.lib_path(lib);
        }
        builder
            .init()
            .map(Self)
            .map_err(|source| crate::gpus::GpusError::Load {
                lib: lib.map_or("libnvidia-ml.so.1".into(), |l| {
                    l.to_string_lossy().into_owned()
                }),
                source,
            })
    }
}

impl NvmlSource {
    /// `gpu`'s device, by UUID (`GPU-` or `MIG-`); `None` when no device has it any more (an
    /// instance destroyed since the arbiter's last reading).
    fn device(&self, gpu: &GpuInfo) -> Result<Option<nvml_wrapper::Device<'_>>, NvmlError> {
        match self.0.device_by_uuid(gpu.uuid.as_str()) {
            Ok(d) => Ok(Some(d)),
            Err(NvmlError::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl GpuSource for NvmlSource {
    fn discover(&self) -> Option<Result<Vec<GpuInfo>, GpuSourceError>> {
        Some(crate::gpus::discover_with(&self.0).map_err(GpuSourceError::from))
    }

    fn processes(&self, gpu: &GpuInfo) -> Result<Vec<GpuProcess>, GpuSourceError> {
        // A MIG device's own handle: its processes, with no privilege needed.
        let Some(dev) = self.device(gpu)? else {
            return Ok(Vec::new());
        };
        let mut list = dev.running_compute_processes()?;
        // A compute-only GPU (or the simulator) has no graphics list.
        list.extend(dev.running_graphics_processes().unwrap_or_default());
        Ok(list
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid as i32,
                gpu: gpu.index,
                used: match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                },
            })
            .collect())
    }

    fn utilization(&self, gpu: &GpuInfo, since_us: u64) -> Option<Vec<UtilSample>> {
        if crate::gpus::mig_position(gpu.index).is_some() {
            // NVML has no utilization on MIG devices: GPU time there is not read (the memory
            // and identity rules still hold; the other devices keep theirs).
            return Some(Vec::new());
        }
        let dev = match self.device(gpu) {
            Ok(Some(d)) => d,
            Ok(None) => return Some(Vec::new()),
            Err(_) => return None,
        };
        match dev.process_utilization_stats(since_us) {
            Ok(s) => Some(
                s.into_iter()
                    .map(|s| UtilSample {
                        pid: s.pid as i32,
                        sm_util: s.sm_util,
                        timestamp: s.timestamp,
                    })
                    .collect(),
            ),
            Err(NvmlError::NotFound) => Some(Vec::new()),
            Err(e) => {
                tracing::warn!(
                    "backstop: per-process GPU time unavailable ({e}); compute bypass is not policed"
                );
                None
            }
        }
    }
}
