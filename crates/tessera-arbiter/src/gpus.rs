//! GPU discovery, behind a trait so tests can use a fixed list.
//!
//! The daemon uses [`NvmlDiscovery`] (NVML through `nvml-wrapper`, loaded at run time, so the
//! simulated `libnvidia-ml.so.1` works when it is on `LD_LIBRARY_PATH`).

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
        let count = nvml.device_count().map_err(|e| q("device_count", e))?;
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            let dev = nvml
                .device_by_index(index)
                .map_err(|e| q("device_by_index", e))?;
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
