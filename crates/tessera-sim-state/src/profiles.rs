//! The MIG profile tables of the simulated Hopper parts (pure data).
//!
//! Sources: NVIDIA's MIG user guide, "Supported MIG Profiles"
//! (<https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html>): H100
//! and H200 have 7 compute slices and 8 memory slices; the GPU-instance profiles are 1g (7
//! instances, placements 0-6), 1g+me (one instance, media extensions), 1g with double memory
//! (placements 0/2/4/6), 2g (0/2/4), 3g (0/4: four memory slices), 4g (0) and 7g (0). The
//! profile ids (19, 20, 15, 14, 9, 5, 0), SM counts (16, 16, 26, 32, 60, 64, 132) and
//! memory sizes are what `nvidia-smi mig -lgip` lists on those cards (H100 80GB: 9.75, 19.62,
//! 39.50, 79.25 GiB; H200: 16.00 GiB for `1g.18gb`, 32.50, 69.75, 140.00 GiB for `7g.141gb`).
//! The NVML profile indexes are `nvml.h`'s `NVML_GPU_INSTANCE_PROFILE_*`: `1_SLICE` 0,
//! `2_SLICE` 1, `3_SLICE` 2, `4_SLICE` 3, `7_SLICE` 4, `1_SLICE_REV1` 7 (the `+me` profile),
//! `1_SLICE_REV2` 9 (double memory).

/// A simulated GPU model with MIG.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuModel {
    /// NVIDIA H100 80GB HBM3 (SXM5).
    H100,
    /// NVIDIA H200 (141 GB HBM3e).
    H200,
}

/// One GPU-instance profile of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiProfile {
    /// `NVML_GPU_INSTANCE_PROFILE_*`: the index `nvmlDeviceGetGpuInstanceProfileInfo` takes.
    pub index: u32,
    /// The profile id (`nvmlGpuInstanceProfileInfo_t.id`, what creation takes).
    pub id: u32,
    /// `1g.18gb`, `1g.18gb+me`, ...
    pub name: &'static str,
    /// Compute slices (of 7).
    pub compute_slices: u32,
    /// Memory slices (of 8): a placement's size.
    pub memory_slices: u32,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Memory, MiB (`memorySizeMB`).
    pub memory_mib: u64,
    /// Most instances of this profile on one GPU.
    pub instance_count: u32,
    /// Possible placement starts (memory slices).
    pub placements: &'static [u32],
    /// Copy engines, decoders, JPEG and OFA units (what `-lgip` shows).
    pub copy_engines: u32,
    pub decoders: u32,
    pub jpegs: u32,
    pub ofas: u32,
}

/// Compute slices of a GPU.
pub const COMPUTE_SLICES: u32 = 7;
/// Memory slices of a GPU.
pub const MEMORY_SLICES: u32 = 8;

const ALL_1G: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const EVEN: &[u32] = &[0, 2, 4, 6];
const TWO_G: &[u32] = &[0, 2, 4];
const THREE_G: &[u32] = &[0, 4];
const ZERO: &[u32] = &[0];

#[allow(clippy::too_many_arguments)]
const fn p(
    index: u32,
    id: u32,
    name: &'static str,
    compute_slices: u32,
    memory_slices: u32,
    sms: u32,
    memory_mib: u64,
    instance_count: u32,
    placements: &'static [u32],
    units: (u32, u32, u32, u32),
) -> GiProfile {
    GiProfile {
        index,
        id,
        name,
        compute_slices,
        memory_slices,
        sms,
        memory_mib,
        instance_count,
        placements,
        copy_engines: units.0,
        decoders: units.1,
        jpegs: units.2,
        ofas: units.3,
    }
}

const H100: &[GiProfile] = &[
    p(0, 19, "1g.10gb", 1, 1, 16, 9984, 7, ALL_1G, (1, 1, 1, 0)),
    p(7, 20, "1g.10gb+me", 1, 1, 16, 9984, 1, ALL_1G, (1, 1, 1, 1)),
    p(9, 15, "1g.20gb", 1, 2, 26, 20096, 4, EVEN, (1, 1, 1, 0)),
    p(1, 14, "2g.20gb", 2, 2, 32, 20096, 3, TWO_G, (2, 2, 2, 0)),
    p(2, 9, "3g.40gb", 3, 4, 60, 40448, 2, THREE_G, (3, 3, 3, 0)),
    p(3, 5, "4g.40gb", 4, 4, 64, 40448, 1, ZERO, (4, 4, 4, 0)),
    p(4, 0, "7g.80gb", 7, 8, 132, 81152, 1, ZERO, (8, 7, 7, 1)),
];

const H200: &[GiProfile] = &[
    p(0, 19, "1g.18gb", 1, 1, 16, 16384, 7, ALL_1G, (1, 1, 1, 0)),
    p(
        7,
        20,
        "1g.18gb+me",
        1,
        1,
        16,
        16384,
        1,
        ALL_1G,
        (1, 1, 1, 1),
    ),
    p(9, 15, "1g.35gb", 1, 2, 26, 33280, 4, EVEN, (1, 1, 1, 0)),
    p(1, 14, "2g.35gb", 2, 2, 32, 33280, 3, TWO_G, (2, 2, 2, 0)),
    p(2, 9, "3g.71gb", 3, 4, 60, 71424, 2, THREE_G, (3, 3, 3, 0)),
    p(3, 5, "4g.71gb", 4, 4, 64, 71424, 1, ZERO, (4, 4, 4, 0)),
    p(4, 0, "7g.141gb", 7, 8, 132, 143360, 1, ZERO, (8, 7, 7, 1)),
];

impl GpuModel {
    /// The model a `TESSERA_SIM_GPUS` item names (`H100`, `H200`, any case).
    pub fn parse(text: &str) -> Option<GpuModel> {
        match text.trim().to_ascii_uppercase().as_str() {
            "H100" => Some(GpuModel::H100),
            "H200" => Some(GpuModel::H200),
            _ => None,
        }
    }

    /// `nvmlDeviceGetName` / `cuDeviceGetName` of the whole card.
    pub fn name(self) -> &'static str {
        match self {
            GpuModel::H100 => "NVIDIA H100 80GB HBM3",
            GpuModel::H200 => "NVIDIA H200",
        }
    }

    /// Memory the whole card reports (`nvidia-smi`: 81559 MiB on an H100 80GB, 143771 MiB on
    /// an H200).
    pub fn total_bytes(self) -> u64 {
        match self {
            GpuModel::H100 => 81559 << 20,
            GpuModel::H200 => 143_771 << 20,
        }
    }

    /// Its GPU-instance profiles.
    pub fn profiles(self) -> &'static [GiProfile] {
        match self {
            GpuModel::H100 => H100,
            GpuModel::H200 => H200,
        }
    }

    /// The profile of NVML index `index` (`NVML_GPU_INSTANCE_PROFILE_*`).
    pub fn profile_by_index(self, index: u32) -> Option<&'static GiProfile> {
        self.profiles().iter().find(|p| p.index == index)
    }

    /// The profile of id `id`.
    pub fn profile_by_id(self, id: u32) -> Option<&'static GiProfile> {
        self.profiles().iter().find(|p| p.id == id)
    }

    /// The profile named `name` (`1g.18gb`).
    pub fn profile_by_name(self, name: &str) -> Option<&'static GiProfile> {
        self.profiles().iter().find(|p| p.name == name)
    }
}

/// A compute-instance profile index (`NVML_COMPUTE_INSTANCE_PROFILE_*`: 0 one slice, 1 two,
/// 2 three, 3 four, 4 seven, 6 six; the id equals the index) and its compute slices.
pub fn ci_profile_slices(index: u32) -> Option<u32> {
    match index {
        0 => Some(1),
        1 => Some(2),
        2 => Some(3),
        3 => Some(4),
        4 => Some(7),
        6 => Some(6),
        _ => None,
    }
}

/// SMs of a compute instance of `slices` compute slices in GPU instance `gi`: the whole GI's
/// when it takes every slice, else 16 per slice (a `1c.3g` has 16 SMs), at most the GI's.
pub fn ci_sms(gi: &GiProfile, slices: u32) -> u32 {
    if slices >= gi.compute_slices {
        gi.sms
    } else {
        (16 * slices).min(gi.sms)
    }
}

/// The name of a compute instance of `slices` slices in `gi`: the GI's own (`1g.18gb`) when it
/// takes every slice, else `<n>c.<gi>` (`1c.3g.71gb`), as `nvidia-smi` names MIG devices.
pub fn ci_name(gi: &GiProfile, slices: u32) -> String {
    if slices >= gi.compute_slices {
        gi.name.to_string()
    } else {
        format!("{slices}c.{}", gi.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h200_table_matches_what_the_card_lists() {
        let m = GpuModel::H200;
        let one = m.profile_by_index(0).unwrap();
        assert_eq!((one.id, one.name, one.sms), (19, "1g.18gb", 16));
        assert_eq!(one.memory_mib << 20, 16 << 30, "16.00 GiB");
        let seven = m.profile_by_id(0).unwrap();
        assert_eq!((seven.name, seven.sms), ("7g.141gb", 132));
        assert_eq!(seven.memory_mib << 20, 140 << 30, "140.00 GiB");
        assert_eq!(m.profile_by_index(9).unwrap().placements, &[0, 2, 4, 6]);
        assert_eq!(m.profile_by_name("3g.71gb").unwrap().memory_slices, 4);
        for p in m.profiles() {
            for s in p.placements {
                assert!(s + p.memory_slices <= MEMORY_SLICES, "{}", p.name);
            }
            assert!(p.compute_slices <= COMPUTE_SLICES);
        }
    }

    #[test]
    fn compute_instance_names_and_sms() {
        let gi = GpuModel::H100.profile_by_name("3g.40gb").unwrap();
        assert_eq!(ci_name(gi, 3), "3g.40gb");
        assert_eq!(ci_name(gi, 1), "1c.3g.40gb");
        assert_eq!((ci_sms(gi, 1), ci_sms(gi, 3)), (16, 60));
        assert_eq!(ci_profile_slices(4), Some(7));
        assert_eq!(ci_profile_slices(5), None);
    }
}
