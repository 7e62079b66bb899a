//! The node's GPUs with the attributes the ResourceSlice publishes, from NVML, plus the NUMA
//! node from sysfs (`<sysfs>/bus/pci/devices/<bus id>/numa_node`, `-1` meaning none).
//!
//! Health comes from the device plugin's watcher ([`tessera_device_plugin::health`]): XID
//! events mark a GPU unhealthy, and [`merge_health`] carries that onto these attributes.

use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

use crate::slices::{GpuAttrs, normalize_bus_id};
use tessera_device_plugin::health::GpuState;

/// Errors reading the inventory.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// NVML could not be loaded.
    #[error("cannot initialise NVML from {lib}: {source}")]
    Init {
        /// Library.
        lib: PathBuf,
        /// Cause.
        source: NvmlError,
    },
    /// A query failed.
    #[error("NVML: {0}")]
    Query(#[from] NvmlError),
}

/// Reads every GPU's attributes through NVML loaded from `lib`; `sysfs` is `/sys` on a node.
pub fn read(lib: &Path, sysfs: &Path) -> Result<Vec<GpuAttrs>, InventoryError> {
    let nvml = Nvml::builder()
        .lib_path(lib.as_os_str())
        .init()
        .map_err(|source| InventoryError::Init {
            lib: lib.to_path_buf(),
            source,
        })?;
    let driver_version = nvml.sys_driver_version()?;
    let mut out = Vec::new();
    for index in 0..nvml.device_count()? {
        let dev = nvml.device_by_index(index)?;
        let cc = dev.cuda_compute_capability()?;
        let bus = normalize_bus_id(&dev.pci_info()?.bus_id);
        out.push(GpuAttrs {
            index,
            uuid: dev.uuid()?,
            product_name: dev.name()?,
            memory_total: dev.memory_info()?.total,
            compute_capability: (cc.major as u32, cc.minor as u32),
            driver_version: driver_version.clone(),
            numa_node: numa_node(sysfs, &bus),
            pci_bus_id: bus,
            unhealthy: None,
        });
    }
    Ok(out)
}

/// The NUMA node of PCI device `bus`, `None` if the platform has none or sysfs says nothing.
pub fn numa_node(sysfs: &Path, bus: &str) -> Option<i64> {
    let p = sysfs.join("bus/pci/devices").join(bus).join("numa_node");
    let n: i64 = std::fs::read_to_string(p).ok()?.trim().parse().ok()?;
    (n >= 0).then_some(n)
}

/// `gpus` with health from the watcher's `snapshot`: a GPU the watcher marks unhealthy is
/// marked so; one it no longer lists is left out (withdrawn).
pub fn merge_health(gpus: &[GpuAttrs], snapshot: &[GpuState]) -> Vec<GpuAttrs> {
    gpus.iter()
        .filter_map(|g| {
            let s = snapshot.iter().find(|s| s.uuid == g.uuid)?;
            Some(GpuAttrs {
                unhealthy: s.unhealthy.clone(),
                ..g.clone()
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_node_from_sysfs_with_minus_one_as_none() {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        assert_eq!(numa_node(dir.path(), "0000:3b:00.0"), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        assert_eq!(numa_node(dir.path(), "0000:3b:00.0"), None);
        assert_eq!(numa_node(dir.path(), "0000:00:00.0"), None);
    }

    #[test]
    fn health_marks_and_withdraws() {
        let g = |i: u32| GpuAttrs {
            index: i,
            uuid: format!("GPU-{i}"),
            product_name: "x".into(),
            memory_total: 1,
            compute_capability: (9, 0),
            driver_version: "1".into(),
            pci_bus_id: "0000:00:00.0".into(),
            numa_node: None,
            unhealthy: None,
        };
        let s = |i: u32, bad: Option<&str>| GpuState {
            index: i,
            uuid: format!("GPU-{i}"),
            memory_total: 1,
            unhealthy: bad.map(str::to_owned),
        };
        let merged = merge_health(&[g(0), g(1), g(2)], &[s(0, None), s(1, Some("XID 79"))]);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[1].unhealthy.as_deref(), Some("XID 79"));
    }
}
