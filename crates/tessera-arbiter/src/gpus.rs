//! GPU discovery, behind a trait so tests can use a fixed list.
//!
//! The daemon uses [`NvmlDiscovery`] (NVML through `nvml-wrapper`, loaded at run time, so the
//! simulated `libnvidia-ml.so.1` works when it is on `LD_LIBRARY_PATH`).
//!
//! **MIG**: a GPU with MIG on is no device of its own (CUDA runs nothing on it whole); each of
//! its MIG devices (compute instances) is one instead, with its `MIG-<uuid>`, its name
//! (`NVIDIA H200 MIG 1g.18gb`) and its GPU instance's memory, and an index of its own,
//! [`MIG_INDEX_BASE`] + 8 x parent + a slot of its parent's. So every MIG device is a
//! scheduling domain of its own (100 shares = that instance's time), memory limits are
//! relative to the instance, and the backstop reads each instance's processes through its MIG
//! handle (a MIG handle needs no privilege for memory and processes; utilization is not
//! supported on MIG devices, and nothing here needs it).
//!
//! **The layout changes while the arbiter runs** (the DRA plugin makes an instance at a claim's
//! prepare and destroys it at the last unprepare): the arbiter reads it again when a Create
//! names a `MIG-` UUID it does not know and at every backstop poll ([`keep_indexes`]). Devices are
//! known by UUID (a re-made instance has a fresh one); a MIG device keeps the slot it was first
//! given for as long as it exists (discovery numbers them by their position among the parent's
//! MIG devices, `nvmlDeviceGetMigDeviceHandleByIndex`, which shifts when a neighbour goes), so
//! an index never names two devices in one reading.

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
pub(crate) const MIG_INDEX_BASE: u32 = 1000;

/// The index of slot `k` (0..8) of GPU `parent`'s MIG devices.
pub fn mig_index(parent: u32, k: u32) -> u32 {
    MIG_INDEX_BASE + parent * 8 + k
}

/// `(parent, k)` of a MIG device index; `None` for a whole GPU's.
pub(crate) fn mig_position(index: u32) -> Option<(u32, u32)> {
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

/// Something that lists the node's GPUs.
pub trait GpuDiscovery: std::fmt::Debug {
    /// Every GPU, in NVML index order.
    fn discover(&self) -> Result<Vec<GpuInfo>, GpusError>;
}

/// A fixed list (tests, and tools that already know the GPUs).
#[derive(Debug, Clone, Default)]
#[cfg(test)]
pub(crate) struct FixedGpus(pub Vec<GpuInfo>);

#[cfg(test)]
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

/// Every device of `nvml` as [`devices`] lists them (MIG devices numbered by position).
pub(crate) fn discover_with(nvml: &nvml_wrapper::Nvml) -> Result<Vec<GpuInfo>, GpusError> {
    let q = |call: &str, source: nvml_wrapper::error::NvmlError| GpusError::Query {
        call: call.into(),
        source,
    };
    let mut gpus = Vec::new();
    for (index, dev) in devices(nvml).map_err(|e| q("device list", e))? {
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

/// `found` (a fresh discovery, MIG devices numbered by position) with the indexes the arbiter
/// already uses: a device `current` knows (by UUID) keeps its index; a new MIG device gets
/// its parent's lowest slot that no device of `current` still present, no other new device
/// and no allocation in `held` (its GPU's UUID and the index it was given) uses, so a gone
/// instance's index is not given to the next one while an allocation still names it; with
/// every slot taken (an allocation outliving its instance on a full GPU), the lowest slot no
/// present device uses. Whole GPUs keep NVML's index. In `found`'s order.
pub(crate) fn keep_indexes(
    current: &[GpuInfo],
    found: Vec<GpuInfo>,
    held: &[(String, u32)],
) -> Vec<GpuInfo> {
    let known = |uuid: &str| {
        current
            .iter()
            .find(|g| g.uuid.eq_ignore_ascii_case(uuid))
            .map(|g| g.index)
    };
    let present: Vec<Option<u32>> = found.iter().map(|g| known(&g.uuid)).collect();
    let mut taken: std::collections::HashSet<u32> = present.iter().flatten().copied().collect();
    let gone_held: std::collections::HashSet<u32> = held
        .iter()
        .filter(|(uuid, _)| !found.iter().any(|g| g.uuid.eq_ignore_ascii_case(uuid)))
        .map(|(_, i)| *i)
        .collect();
    let mut out = Vec::with_capacity(found.len());
    for (mut g, kept) in found.into_iter().zip(present) {
        if let Some(i) = kept {
            g.index = i;
        } else if let Some((parent, _)) = mig_position(g.index) {
            let slots = || (0..8).map(|k| mig_index(parent, k));
            let slot = slots()
                .find(|i| !taken.contains(i) && !gone_held.contains(i))
                .or_else(|| slots().find(|i| !taken.contains(i)));
            // Discovery lists at most 8 MIG devices a GPU, so a slot is always free.
            if let Some(i) = slot {
                g.index = i;
            }
            taken.insert(g.index);
        }
        out.push(g);
    }
    out
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
        discover_with(&nvml)
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

    fn dev(index: u32, uuid: &str) -> GpuInfo {
        GpuInfo {
            index,
            uuid: uuid.into(),
            name: "n".into(),
            memory_total: 1,
        }
    }

    #[test]
    fn a_mig_device_keeps_its_index_and_a_gone_ones_is_not_reused_while_held() {
        let current = vec![
            dev(0, "GPU-0"),
            dev(mig_index(1, 0), "MIG-a"),
            dev(mig_index(1, 1), "MIG-b"),
        ];
        // MIG-a gone, MIG-c new: discovery numbers them by position (b first, then c).
        let found = vec![
            dev(0, "GPU-0"),
            dev(mig_index(1, 0), "MIG-b"),
            dev(mig_index(1, 1), "MIG-c"),
        ];
        // An allocation still names MIG-a at slot 0: MIG-c gets slot 2.
        let held = vec![("mig-A".to_owned(), mig_index(1, 0))];
        let got = keep_indexes(&current, found.clone(), &held);
        let idx: Vec<(u32, &str)> = got.iter().map(|g| (g.index, g.uuid.as_str())).collect();
        assert_eq!(
            idx,
            vec![
                (0, "GPU-0"),
                (mig_index(1, 1), "MIG-b"),
                (mig_index(1, 2), "MIG-c")
            ]
        );
        // Nobody holds it: the lowest free slot, 0.
        let got = keep_indexes(&current, found, &[]);
        assert_eq!(got[2].index, mig_index(1, 0));
        // Every other slot taken by present devices and held ones: a held slot is reused
        // rather than none given.
        let current: Vec<GpuInfo> = (0..7)
            .map(|k| dev(mig_index(0, k), &format!("MIG-{k}")))
            .collect();
        let mut found = current.clone();
        found.push(dev(mig_index(0, 7), "MIG-new"));
        let got = keep_indexes(&current, found, &[("MIG-gone".into(), mig_index(0, 7))]);
        assert_eq!(got[7].index, mig_index(0, 7));
        // Whole GPUs keep NVML's index whatever they held.
        let got = keep_indexes(&[], vec![dev(3, "GPU-3")], &[]);
        assert_eq!(got[0].index, 3);
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
