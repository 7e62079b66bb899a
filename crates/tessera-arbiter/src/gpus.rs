//! GPU discovery, behind a trait so tests can use a fixed list.
//!
//! The daemon uses [`NvmlDiscovery`] (NVML through `nvml-wrapper`, loaded at run time, so the
//! simulated `libnvidia-ml.so.1` works when it is on `LD_LIBRARY_PATH`).
//!
//! **MIG**: a GPU with MIG on is no device of its own (CUDA runs nothing on it whole); each of
//! its MIG devices (compute instances) is one instead, with its `MIG-<uuid>`, its name
//! (`NVIDIA H200 MIG 1g.18gb`) and its GPU instance's memory, and an index of its own,
//! [`MIG_INDEX_BASE`] + 8 x parent + its position among the parent's MIG devices
//! (`nvmlDeviceGetMigDeviceHandleByIndex`). So every MIG device is a scheduling domain of its
//! own (100 shares = that instance's time), memory limits are relative to the instance, and
//! the backstop reads each instance's processes through its MIG handle (a MIG handle needs no
//! privilege for memory and processes; utilization is not supported on MIG devices, and
//! nothing here needs it). The layout is read when the arbiter starts.

#![forbid(unsafe_code)]

use std::ffi::OsString;

use tessera_protocol::GpuInfo;

/// Errors of GPU discovery.
#[derive(Debug, thiserror::Error)]
pub enum GpusError {
    /// NVML could not be loaded or initialised.
    #[error("cannot load NVML ({lib}): {source}")]
    Load {
        /// Library looked for.
        lib: String,
        /// Cause.
        source: nvml_wrapper::error::NvmlError,
    },
    /// NVML loaded but a query failed.
    #[error("NVML query {call} failed: {source}")]
    Query {
        /// What was asked.
        call: String,
        /// Cause.
        source: nvml_wrapper::error::NvmlError,
    },
}

/// Where MIG device indexes start (above any NVML index of a whole GPU).
pub const MIG_INDEX_BASE: u32 = 1000;

/// The index of the `k`-th MIG device of GPU `parent`.
pub fn mig_index(parent: u32, k: u32) -> u32 {
    MIG_INDEX_BASE + parent * 8 + k
}

/// `(parent, k)` of a MIG device index; `None` for a whole GPU's.
pub fn mig_position(index: u32) -> Option<(u32, u32)> {
    let i = index.checked_sub(MIG_INDEX_BASE)?;
    Some((i / 8, i % 8))
}

/// The node's devices as the arbiter schedules them: each GPU without MIG (by its NVML
/// index), and each MIG device of a GPU with MIG on (by [`mig_index`]).
pub(crate) fn devices(
    nvml: &nvml_wrapper::Nvml,
) -> Result<Vec<(u32, nvml_wrapper::Device<'_>)>, nvml_wrapper::error::NvmlError> {
    let mut out = Vec::new();
    for index in 0..nvml.device_count()? {
        let dev = nvml.device_by_index(index)?;
        // A GPU or driver without MIG answers NotSupported (or lacks the symbol): whole.
        let mig_on = dev.mig_mode().is_ok_and(|m| m.current == 1);
        if !mig_on {
            out.push((index, dev));
            continue;
        }
        let max = dev.mig_device_count().unwrap_or(0).min(8);
        for k in 0..max {
            match dev.mig_device_by_index(k) {
                Ok(m) => out.push((mig_index(index, k), m)),
                Err(nvml_wrapper::error::NvmlError::NotFound) => break,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(out)
}

/// The device of arbiter index `index` (see [`devices`]).
pub(crate) fn device_of(
    nvml: &nvml_wrapper::Nvml,
    index: u32,
) -> Result<nvml_wrapper::Device<'_>, nvml_wrapper::error::NvmlError> {
    match mig_position(index) {
        Some((parent, k)) => nvml.device_by_index(parent)?.mig_device_by_index(k),
        None => nvml.device_by_index(index),
    }
}

/// Something that lists the node's GPUs.
pub trait GpuDiscovery {
    /// Every GPU, in NVML index order.
    fn discover(&self) -> Result<Vec<GpuInfo>, GpusError>;
}

/// A fixed list (tests, and tools that already know the GPUs).
#[derive(Debug, Clone, Default)]
pub struct FixedGpus(pub Vec<GpuInfo>);

impl GpuDiscovery for FixedGpus {
    fn discover(&self) -> Result<Vec<GpuInfo>, GpusError> {
        Ok(self.0.clone())
    }
}

/// NVML discovery. `lib` overrides the library name (default `libnvidia-ml.so.1`, found
/// through the dynamic loader's usual search, `LD_LIBRARY_PATH` included).
#[derive(Debug, Clone, Default)]
pub struct NvmlDiscovery {
    /// Library path or name to load instead of the default.
    pub lib: Option<OsString>,
}

impl GpuDiscovery for NvmlDiscovery {
    fn discover(&self) -> Result<Vec<GpuInfo>, GpusError> {
        let lib_name = self
            .lib
            .as_ref()
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_else(|| "libnvidia-ml.so.1".into());
        let mut builder = nvml_wrapper::Nvml::builder();
        if let Some(lib) = &self.lib {
            builder.lib_path(lib);
        }
        let nvml = builder.init().map_err(|source| GpusError::Load {
            lib: lib_name,
            source,
        })?;
        let q = |call: &str, source: nvml_wrapper::error::NvmlError| GpusError::Query {
            call: call.into(),
            source,
        };
        let mut gpus = Vec::new();
        for (index, dev) in devices(&nvml).map_err(|e| q("device list", e))? {
            let uuid = dev.uuid().map_err(|e| q("uuid", e))?;
            let name = dev.name().map_err(|e| q("name", e))?;
            let memory_total = dev.memory_info().map_err(|e| q("memory_info", e))?.total;
            gpus.push(GpuInfo {
                index,
                uuid,
                name,
                memory_total,
            });
        }
        Ok(gpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_list_is_returned_as_is() {
        let g = GpuInfo {
            index: 0,
            uuid: "GPU-x".into(),
            name: "n".into(),
            memory_total: 1,
        };
        assert_eq!(FixedGpus(vec![g.clone()]).discover().unwrap(), vec![g]);
    }

    #[test]
    fn mig_indexes_sit_above_whole_gpus_and_name_their_parent() {
        assert_eq!(mig_index(2, 3), 1019);
        assert_eq!(mig_position(1019), Some((2, 3)));
        assert_eq!(mig_position(7), None);
        assert_eq!(mig_position(MIG_INDEX_BASE), Some((0, 0)));
    }

    #[test]
    fn missing_nvml_library_is_a_clear_error() {
        let d = NvmlDiscovery {
            lib: Some("/nonexistent/libnvidia-ml.so.1".into()),
        };
        let err = d.discover().unwrap_err();
        assert!(matches!(err, GpusError::Load { .. }), "{err}");
        assert!(
            err.to_string().contains("/nonexistent/libnvidia-ml.so.1"),
            "{err}"
        );
    }
}
