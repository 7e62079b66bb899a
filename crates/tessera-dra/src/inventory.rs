//! The node's GPUs with the attributes the ResourceSlice publishes, from NVML, plus from sysfs
//! the NUMA node (`<sysfs>/bus/pci/devices/<bus id>/numa_node`, `-1` meaning none) and the
//! PCIe root ([`pcie_root`]).
//!
//! Only the GPUs `--gpus` admits are published ([`offered`], applied once, right after the
//! read and before MIG is looked at: a GPU left to another plugin is neither published nor
//! switched into MIG mode to read its profiles).
//!
//! Health comes from the watcher the device plugin uses too ([`tessera_node::health`]): XID
//! events mark a GPU unhealthy, and [`merge_health`] carries that onto these attributes.

use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

use crate::mig::{Geometry, Instance, MigConfig, MigMode, Placement, Profile, Wanted};
use crate::slices::{GpuAttrs, normalize_bus_id};
use tessera_node::GpuFilter;
use tessera_node::health::GpuState;
use tessera_node::nvml_mig::MigNvml;

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
    /// NVML could not be opened for MIG.
    #[error("NVML (MIG): {0}")]
    Mig(String),
}

/// Reads every GPU's attributes through NVML loaded from `lib`; `sysfs` is `/sys` on a node.
pub(crate) fn read(lib: &Path, sysfs: &Path) -> Result<Vec<GpuAttrs>, InventoryError> {
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
            pcie_root: pcie_root(sysfs, &bus),
            pci_bus_id: bus,
            unhealthy: None,
            mig: crate::mig::MigMode::Off,
        });
    }
    Ok(out)
}

/// The GPUs of `all` that `gpus` (`--gpus`) admits. A GPU of the node that `--mig-dynamic` or
/// `--mig-static` names by index and `gpus` leaves out is refused (the reason, naming both
/// flags): MIG cannot be published for a GPU the plugin does not offer.
pub(crate) fn offered(
    all: Vec<GpuAttrs>,
    gpus: &GpuFilter,
    mig: &MigConfig,
) -> Result<Vec<GpuAttrs>, String> {
    for (flag, index) in mig.named() {
        if let Some(g) = all.iter().find(|g| g.index == index)
            && !gpus.admits(g.index, &g.uuid)
        {
            return Err(format!(
                "{flag} names GPU {index} ({}), which --gpus {gpus} does not offer",
                g.uuid
            ));
        }
    }
    Ok(all
        .into_iter()
        .filter(|g| gpus.admits(g.index, &g.uuid))
        .collect())
}

/// Gives each GPU of `gpus` its MIG mode under `cfg`, from NVML at `lib`: a dynamic GPU gets
/// its profiles and placements (a GPU without MIG profiles stays whole, with a warning); a
/// static GPU gets its existing instances (profile names from its profiles). A GPU NVML
/// cannot answer for keeps no MIG devices, and the error is logged: the rest still publish.
pub(crate) fn read_mig(
    lib: &Path,
    gpus: &mut [GpuAttrs],
    cfg: &MigConfig,
) -> Result<(), InventoryError> {
    if gpus.iter().all(|g| cfg.wanted(g.index) == Wanted::Off) {
        return Ok(());
    }
    let nvml = MigNvml::open(lib).map_err(|e| InventoryError::Mig(e.to_string()))?;
    for g in gpus.iter_mut() {
        let wanted = cfg.wanted(g.index);
        if wanted == Wanted::Off {
            continue;
        }
        match mig_mode(&nvml, &g.uuid, wanted) {
            Ok(m) => g.mig = m,
            Err(e) => tracing::warn!("GPU {} ({}): no MIG devices: {e}", g.index, g.uuid),
        }
    }
    Ok(())
}

/// The GPU's MIG profiles. NVML answers them only with MIG mode on (`NOT_SUPPORTED` off, as
/// `nvidia-smi mig -lgip` shows no profile then): a GPU with MIG off is switched on for the
/// question and back off after (Hopper and later switch at once, without a reset; upstream's
/// driver reads every profile the same way before publishing, kubernetes-sigs/
/// dra-driver-nvidia-gpu `partitions.go`, `maxCapacities` "from looking at all MIG profiles
/// beforehand").
fn read_profiles(
    nvml: &MigNvml,
    uuid: &str,
) -> Result<Vec<tessera_node::nvml_mig::ProfileInfo>, String> {
    if nvml.mig_enabled(uuid).map_err(|e| e.to_string())? {
        return nvml.profiles(uuid).map_err(|e| e.to_string());
    }
    nvml.set_mig(uuid, true)
        .map_err(|e| format!("turning MIG on to read its profiles: {e}"))?;
    let profiles = nvml.profiles(uuid).map_err(|e| e.to_string());
    if let Err(e) = nvml.set_mig(uuid, false) {
        tracing::warn!("GPU {uuid}: MIG left on after reading its profiles: {e}");
    }
    profiles
}

fn mig_mode(nvml: &MigNvml, uuid: &str, wanted: Wanted) -> Result<MigMode, String> {
    let profiles: Vec<Profile> = read_profiles(nvml, uuid)?
        .into_iter()
        .map(|p| Profile {
            id: p.id,
            name: p.name,
            compute_slices: p.slice_count,
            memory: p.memory_mib << 20,
            multiprocessors: p.multiprocessors,
            placements: p
                .placements
                .into_iter()
                .map(|(start, size)| Placement { start, size })
                .collect(),
        })
        .collect();
    match wanted {
        Wanted::Off => Ok(MigMode::Off),
        Wanted::Dynamic => Geometry::of(profiles)
            .map(MigMode::Dynamic)
            .ok_or_else(|| "NVML lists no MIG profile".to_owned()),
        Wanted::Static => {
            let live = nvml.instances(uuid).map_err(|e| e.to_string())?;
            let instances = live
                .into_iter()
                .filter_map(|i| {
                    let p = profiles.iter().find(|p| p.id == i.profile_id)?;
                    Some(Instance {
                        profile: p.name.clone(),
                        placement: Placement {
                            start: i.placement.0,
                            size: i.placement.1,
                        },
                        uuid: i.uuid?,
                        memory: p.memory,
                    })
                })
                .collect();
            Ok(MigMode::Static(instances))
        }
    }
}

/// The NUMA node of PCI device `bus`, `None` if the platform has none or sysfs says nothing.
pub(crate) fn numa_node(sysfs: &Path, bus: &str) -> Option<i64> {
    let p = sysfs.join("bus/pci/devices").join(bus).join("numa_node");
    let n: i64 = std::fs::read_to_string(p).ok()?.trim().parse().ok()?;
    (n >= 0).then_some(n)
}

/// The PCIe root complex of PCI device `bus`, as the standard `resource.kubernetes.io/pcieRoot`
/// attribute names it (`pci0000:00`): `<sysfs>/bus/pci/devices/<bus>` is a link into
/// `<sysfs>/devices/`, and the first folder of its target is the root bridge
/// (`devices/pci0000:00/0000:00:01.0/0000:01:00.0`). `None` when the link does not resolve
/// there (no sysfs, a virtual device, the simulated GPUs).
pub(crate) fn pcie_root(sysfs: &Path, bus: &str) -> Option<String> {
    let devices = std::fs::canonicalize(sysfs.join("devices")).ok()?;
    let dev = std::fs::canonicalize(sysfs.join("bus/pci/devices").join(bus)).ok()?;
    let first = dev.strip_prefix(&devices).ok()?.components().next()?;
    let name = first.as_os_str().to_str()?;
    is_root_bridge(name).then(|| name.to_owned())
}

/// `pci` + a 4-digit hex domain + `:` + a 2-digit hex bus.
fn is_root_bridge(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("pci") else {
        return false;
    };
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    matches!(rest.split_once(':'), Some((domain, bus)) if hex(domain, 4) && hex(bus, 2))
}

/// `gpus` with health from the watcher's `snapshot`: a GPU the watcher marks unhealthy is
/// marked so; one it no longer lists is left out (withdrawn).
pub(crate) fn merge_health(gpus: &[GpuAttrs], snapshot: &[GpuState]) -> Vec<GpuAttrs> {
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

    /// A sysfs tree as Linux lays it out: the device under its root bridge, and the bus
    /// folder's link to it.
    fn fake_sysfs(root: &Path, bridge: &str, chain: &[&str]) {
        let mut dev = root.join("devices").join(bridge);
        for c in chain {
            dev = dev.join(c);
        }
        std::fs::create_dir_all(&dev).unwrap();
        let bus = root.join("bus/pci/devices");
        std::fs::create_dir_all(&bus).unwrap();
        let rel = format!("../../../devices/{bridge}/{}", chain.join("/"));
        std::os::unix::fs::symlink(rel, bus.join(chain.last().unwrap())).unwrap();
    }

    #[test]
    fn pcie_root_follows_the_bus_link_to_its_root_bridge() {
        let dir = tempfile::tempdir().unwrap();
        // Behind a switch: root port, switch ports, then the GPU.
        fake_sysfs(
            dir.path(),
            "pci0000:3a",
            &[
                "0000:3a:00.0",
                "0000:3b:00.0",
                "0000:3c:00.0",
                "0000:3d:00.0",
            ],
        );
        fake_sysfs(dir.path(), "pci0001:00", &["0001:00:01.0", "0001:01:00.0"]);
        assert_eq!(
            pcie_root(dir.path(), "0000:3d:00.0").as_deref(),
            Some("pci0000:3a")
        );
        assert_eq!(
            pcie_root(dir.path(), "0001:01:00.0").as_deref(),
            Some("pci0001:00")
        );
        // Not present, or a plain folder (no link into devices/): no attribute.
        assert_eq!(pcie_root(dir.path(), "0000:99:00.0"), None);
        let plain = dir.path().join("bus/pci/devices/0000:05:00.0");
        std::fs::create_dir_all(&plain).unwrap();
        assert_eq!(pcie_root(dir.path(), "0000:05:00.0"), None);
        // A link into devices/ whose first folder is no root bridge (a virtual bus).
        std::fs::create_dir_all(dir.path().join("devices/virtual/0000:06:00.0")).unwrap();
        std::os::unix::fs::symlink(
            "../../../devices/virtual/0000:06:00.0",
            dir.path().join("bus/pci/devices/0000:06:00.0"),
        )
        .unwrap();
        assert_eq!(pcie_root(dir.path(), "0000:06:00.0"), None);
        assert!(!is_root_bridge("pci0000:3"));
        assert!(!is_root_bridge("pcizzzz:00"));
        assert_eq!(pcie_root(Path::new("/nonexistent"), "0000:3d:00.0"), None);
    }

    fn attrs(i: u32) -> GpuAttrs {
        GpuAttrs {
            index: i,
            uuid: format!("GPU-{i}"),
            product_name: "x".into(),
            memory_total: 1,
            compute_capability: (9, 0),
            driver_version: "1".into(),
            pci_bus_id: "0000:00:00.0".into(),
            numa_node: None,
            pcie_root: None,
            unhealthy: None,
            mig: crate::mig::MigMode::Off,
        }
    }

    #[test]
    fn only_offered_gpus_are_kept_and_mig_on_one_left_out_is_refused() {
        use crate::mig::GpuSet;
        let node = || vec![attrs(0), attrs(1), attrs(2)];
        let f = |s: &str| s.parse::<GpuFilter>().unwrap();
        let idx = |v: &[u32]| GpuSet::Indices(v.iter().copied().collect());
        let no_mig = MigConfig::default();
        let kept = |v: Vec<GpuAttrs>| v.into_iter().map(|g| g.index).collect::<Vec<_>>();
        assert_eq!(
            kept(offered(node(), &f("all"), &no_mig).unwrap()),
            [0, 1, 2]
        );
        assert_eq!(
            kept(offered(node(), &f("2,gpu-0"), &no_mig).unwrap()),
            [0, 2]
        );
        assert!(offered(node(), &f("7"), &no_mig).unwrap().is_empty());
        // MIG on an offered GPU, on `all` of them, or on a GPU the node lacks: fine.
        let on = |dynamic: GpuSet, fixed: GpuSet| MigConfig { dynamic, fixed };
        let ok = [
            on(idx(&[2]), GpuSet::None),
            on(GpuSet::All, GpuSet::None),
            on(GpuSet::None, idx(&[0, 9])),
        ];
        for mig in ok {
            assert_eq!(kept(offered(node(), &f("0,GPU-2"), &mig).unwrap()), [0, 2]);
        }
        // On a GPU of the node the filter leaves out: the reason names both flags and the GPU.
        let err = offered(node(), &f("0,GPU-2"), &on(GpuSet::None, idx(&[1]))).unwrap_err();
        assert_eq!(
            err,
            "--mig-static names GPU 1 (GPU-1), which --gpus 0,GPU-2 does not offer"
        );
        let err = offered(node(), &f("GPU-1"), &on(idx(&[0]), GpuSet::None)).unwrap_err();
        assert!(
            err.starts_with("--mig-dynamic names GPU 0 (GPU-0)"),
            "{err}"
        );
    }

    #[test]
    fn health_marks_and_withdraws() {
        let g = attrs;
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
