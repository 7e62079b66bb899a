//! What the backstop reads of the GPUs: processes and their memory, and GPU time (NVML).

#[allow(unused_imports)]
use super::*;

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
/// tests.
pub trait GpuSource: Send {
    /// How many GPUs there are.
    fn device_count(&self) -> Result<u32, GpuSourceError>;
    /// The devices to read, by arbiter index (whole GPUs by NVML index, MIG devices by
    /// [`crate::gpus::mig_index`]); by default `0..device_count`.
    fn device_indices(&self) -> Result<Vec<u32>, GpuSourceError> {
        Ok((0..self.device_count()?).collect())
    }
    /// The processes on GPU `gpu` with their device memory (compute and graphics).
    fn processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, GpuSourceError>;
    /// GPU `gpu`'s per-process utilisation samples newer than `since_us` (none: empty). `None`
    /// when this system cannot give them at all.
    fn utilization(&self, gpu: u32, since_us: u64) -> Option<Vec<UtilSample>>;
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

impl GpuSource for NvmlSource {
    fn device_count(&self) -> Result<u32, GpuSourceError> {
        Ok(self.0.device_count()?)
    }

    fn device_indices(&self) -> Result<Vec<u32>, GpuSourceError> {
        Ok(crate::gpus::devices(&self.0)?
            .into_iter()
            .map(|(i, _)| i)
            .collect())
    }

    fn processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, GpuSourceError> {
        // A MIG device's own handle: its processes, with no privilege needed.
        let dev = crate::gpus::device_of(&self.0, gpu)?;
        let mut list = dev.running_compute_processes()?;
        // A compute-only GPU (or the simulator) has no graphics list.
        list.extend(dev.running_graphics_processes().unwrap_or_default());
        Ok(list
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid as i32,
                gpu,
                used: match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                },
            })
            .collect())
    }

    fn utilization(&self, gpu: u32, since_us: u64) -> Option<Vec<UtilSample>> {
        if crate::gpus::mig_position(gpu).is_some() {
            // NVML has no utilization on MIG devices: GPU time there is not read (the memory
            // and identity rules still hold; the other devices keep theirs).
            return Some(Vec::new());
        }
        let dev = self.0.device_by_index(gpu).ok()?;
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
            Err(nvml_wrapper::error::NvmlError::NotFound) => Some(Vec::new()),
            Err(e) => {
                tracing::warn!(
                    "backstop: per-process GPU time unavailable ({e}); compute bypass is not policed"
                );
                None
            }
        }
    }
}
