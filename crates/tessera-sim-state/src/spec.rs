//! `TESSERA_SIM_GPUS` and `TESSERA_SIM_CONTEXT_MEMORY` parsing and the identity of each
//! simulated GPU.

#![forbid(unsafe_code)]

use crate::{DEFAULT_GPUS, ENV_CONTEXT_MEMORY, ENV_FURTHER_CONTEXT_MEMORY, ENV_GPUS, MAX_GPUS};

/// Errors of [`SimSpec::parse`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("empty GPU spec: expected e.g. 2x80GiB or 1x16GiB,1x24GiB")]
    Empty,
    #[error("bad GPU spec item {0:?}: expected COUNTxSIZE such as 2x80GiB")]
    BadItem(String),
    #[error("bad memory size {0:?}: {1}")]
    BadSize(String, String),
    #[error("{0} GPUs requested; at most {MAX_GPUS} are supported")]
    TooMany(usize),
    #[error("bad {ENV_CONTEXT_MEMORY} {0:?}: expected a size such as 300MiB, or 0 for none")]
    BadContextMemory(String),
    #[error(
        "bad {ENV_FURTHER_CONTEXT_MEMORY} {0:?}: expected a size such as 300MiB, or 0 for none"
    )]
    BadFurtherContextMemory(String),
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Device ordinal (CUDA and NVML index).
    pub index: u32,
    /// Memory size in bytes.
    pub total_bytes: u64,
    /// The 16 raw UUID bytes (as `cuDeviceGetUuid` returns them).
    pub uuid_bytes: [u8; 16],
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML reports it.
    pub uuid: String,
    /// Marketing name, e.g. `Tessera Sim GPU 80GiB`.
    pub name: String,
    /// PCI bus number (the `0N` in `00000000:0N:00.0`).
    pub pci_bus: u32,
    /// The modelled part (`1xH200`), which has MIG; `None` for a plain size (`1x80GiB`).
    pub model: Option<crate::profiles::GpuModel>,
    /// Streaming multiprocessors.
    pub sms: u32,
}

impl GpuInfo {
    fn new(index: u32, total_bytes: u64) -> GpuInfo {
        let uuid_bytes = uuid_for(index, total_bytes);
        GpuInfo {
            index,
            total_bytes,
            uuid: format_uuid(&uuid_bytes),
            uuid_bytes,
            name: format!("Tessera Sim GPU {}", format_size(total_bytes)),
            pci_bus: index + 1,
            model: None,
            sms: 132,
        }
    }

    fn of_model(index: u32, model: crate::profiles::GpuModel) -> GpuInfo {
        GpuInfo {
            name: model.name().to_string(),
            model: Some(model),
            ..GpuInfo::new(index, model.total_bytes())
        }
    }

    /// NVML style bus id: `00000000:01:00.0`.
    pub fn pci_bus_id_nvml(&self) -> String {
        format!("00000000:{:02X}:00.0", self.pci_bus)
    }

    /// CUDA style bus id (`cuDeviceGetPCIBusId`): `0000:01:00.0`.
    pub fn pci_bus_id_cuda(&self) -> String {
        format!("0000:{:02X}:00.0", self.pci_bus)
    }
}

/// The simulated machine: its GPUs in ordinal order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimSpec {
    pub gpus: Vec<GpuInfo>,
}

impl SimSpec {
    /// Parses `2x80GiB`, `1x16GiB,1x24GiB` or `80GiB` (one GPU); a model name instead of a size
    /// (`8xH200`, `1xH100`) simulates that part, with its memory, name and MIG.
    pub fn parse(text: &str) -> Result<SimSpec, SpecError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(SpecError::Empty);
        }
        let mut gpus = Vec::new();
        for item in text.split(',') {
            let item = item.trim();
            let (count, size) = match item.split_once(['x', 'X']) {
                Some((c, s)) => {
                    let count: usize = c
                        .trim()
                        .parse()
                        .map_err(|_| SpecError::BadItem(item.to_string()))?;
                    (count, s)
                }
                None => (1, item),
            };
            if count == 0 {
                return Err(SpecError::BadItem(item.to_string()));
            }
            let model = crate::profiles::GpuModel::parse(size);
            let bytes = match model {
                Some(m) => m.total_bytes(),
                None => parse_size(size)?,
            };
            if gpus.len() + count > MAX_GPUS {
                return Err(SpecError::TooMany(gpus.len() + count));
            }
            for _ in 0..count {
                let index = gpus.len() as u32;
                gpus.push(match model {
                    Some(m) => GpuInfo::of_model(index, m),
                    None => GpuInfo::new(index, bytes),
                });
            }
        }
        Ok(SimSpec { gpus })
    }

    /// The spec from `TESSERA_SIM_GPUS`, or [`DEFAULT_GPUS`] when unset or empty.
    pub fn from_env() -> Result<SimSpec, SpecError> {
        match std::env::var(ENV_GPUS) {
            Ok(v) if !v.trim().is_empty() => SimSpec::parse(&v),
            _ => SimSpec::parse(DEFAULT_GPUS),
        }
    }

    /// Number of devices.
    pub fn count(&self) -> usize {
        self.gpus.len()
    }
}

/// Parses `80GiB`, `4Gi`, `512MiB`, `1.5GiB`, `16GB`: the parser of `tessera run --memory`
/// ([`tessera_protocol::size::parse_size`]), so every command reads a size the same way (a
/// number without a unit is refused: `2x80` is not two 80-byte GPUs); a simulated GPU is also
/// at most 1 PiB.
pub fn parse_size(text: &str) -> Result<u64, SpecError> {
    let bad = |why: String| SpecError::BadSize(text.trim().to_string(), why);
    let bytes = tessera_protocol::size::parse_size(text).map_err(|e| bad(e.to_string()))?;
    if bytes > 1 << 50 {
        return Err(bad("a simulated GPU has at most 1 PiB".into()));
    }
    Ok(bytes)
}

/// Parses a context memory size: `300MiB`, `0` (none) or empty (none).
pub fn parse_context_memory(text: &str) -> Result<u64, SpecError> {
    let t = text.trim();
    if t.is_empty() {
        return Ok(0);
    }
    tessera_protocol::size::parse_size_or_zero(t)
        .ok()
        .filter(|b| *b <= 1 << 50)
        .ok_or_else(|| SpecError::BadContextMemory(text.to_string()))
}

/// The context memory from `TESSERA_SIM_CONTEXT_MEMORY`; 0 when unset.
pub fn context_memory_from_env() -> Result<u64, SpecError> {
    match std::env::var(ENV_CONTEXT_MEMORY) {
        Ok(v) => parse_context_memory(&v),
        Err(_) => Ok(0),
    }
}

/// The memory of each further context from `TESSERA_SIM_FURTHER_CONTEXT_MEMORY`; `None` when
/// unset (then it costs what the first does).
pub fn further_context_memory_from_env() -> Result<Option<u64>, SpecError> {
    match std::env::var(ENV_FURTHER_CONTEXT_MEMORY) {
        Ok(v) => parse_context_memory(&v)
            .map(Some)
            .map_err(|_| SpecError::BadFurtherContextMemory(v)),
        Err(_) => Ok(None),
    }
}

fn format_size(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        format!("{}GiB", bytes >> 30)
    } else if bytes.is_multiple_of(1 << 20) {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{bytes}B")
    }
}

pub(crate) fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Deterministic (index, size) -> UUID, so every process and run agrees; RFC 4122 v4 layout.
fn uuid_for(index: u32, total_bytes: u64) -> [u8; 16] {
    let a = splitmix(0x7E55_E8A0_0000_0000 ^ u64::from(index));
    let b = splitmix(a ^ total_bytes);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&a.to_be_bytes());
    out[8..].copy_from_slice(&b.to_be_bytes());
    out[6] = (out[6] & 0x0F) | 0x40;
    out[8] = (out[8] & 0x3F) | 0x80;
    out
}

pub(crate) fn format_uuid(b: &[u8; 16]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counts_and_mixed_sizes() {
        let s = SimSpec::parse("2x80GiB").unwrap();
        assert_eq!(s.count(), 2);
        assert_eq!(s.gpus[1].total_bytes, 80 << 30);
        assert_eq!(s.gpus[1].index, 1);
        let s = SimSpec::parse("1x16GiB, 1x24GiB").unwrap();
        assert_eq!(s.gpus[0].total_bytes, 16 << 30);
        assert_eq!(s.gpus[1].total_bytes, 24 << 30);
        assert_eq!(
            SimSpec::parse("512MiB").unwrap().gpus[0].total_bytes,
            512 << 20
        );
    }

    #[test]
    fn sizes_read_as_tessera_run_reads_them() {
        // `tessera run --memory 4Gi` and `tessera sim --gpus 1x4Gi` agree.
        for text in ["4Gi", "4GiB", "4G", "4 GiB", "4096MiB"] {
            assert_eq!(
                SimSpec::parse(&format!("1x{text}")).unwrap().gpus[0].total_bytes,
                4 << 30,
                "{text}"
            );
        }
    }

    #[test]
    fn rejects_bad_specs() {
        assert_eq!(SimSpec::parse(""), Err(SpecError::Empty));
        assert!(matches!(
            SimSpec::parse("0x80GiB"),
            Err(SpecError::BadItem(_))
        ));
        assert!(matches!(
            SimSpec::parse("2x80Zib"),
            Err(SpecError::BadSize(..))
        ));
        assert!(matches!(
            SimSpec::parse("1x2048TiB"),
            Err(SpecError::BadSize(_, why)) if why.contains("at most 1 PiB")
        ));
        // A bare number is not bytes: `2x80` is refused with the unit it needs.
        assert!(matches!(
            SimSpec::parse("2x80"),
            Err(SpecError::BadSize(_, why)) if why.contains("a size needs a unit, e.g. 80GiB")
        ));
        assert!(matches!(
            SimSpec::parse("axGiB"),
            Err(SpecError::BadItem(_))
        ));
        assert!(matches!(
            SimSpec::parse("17x1GiB"),
            Err(SpecError::TooMany(17))
        ));
    }

    #[test]
    fn context_memory_sizes() {
        assert_eq!(parse_context_memory("300MiB"), Ok(300 << 20));
        assert_eq!(parse_context_memory(" 0 "), Ok(0));
        assert_eq!(parse_context_memory("0MiB"), Ok(0));
        assert!(matches!(
            parse_context_memory("300"),
            Err(SpecError::BadContextMemory(_))
        ));
        assert_eq!(parse_context_memory(""), Ok(0));
        assert!(matches!(
            parse_context_memory("lots"),
            Err(SpecError::BadContextMemory(v)) if v == "lots"
        ));
        assert!(matches!(
            parse_context_memory("-5MiB"),
            Err(SpecError::BadContextMemory(_))
        ));
    }

    #[test]
    fn a_bad_further_context_memory_names_its_variable() {
        let e = SpecError::BadFurtherContextMemory("lots".into()).to_string();
        assert!(e.contains(ENV_FURTHER_CONTEXT_MEMORY), "{e}");
    }

    #[test]
    fn uuids_are_stable_distinct_and_well_formed() {
        let a = SimSpec::parse("2x80GiB").unwrap();
        let b = SimSpec::parse("2x80GiB").unwrap();
        assert_eq!(a, b);
        assert_ne!(a.gpus[0].uuid, a.gpus[1].uuid);
        let u = &a.gpus[0].uuid;
        assert_eq!(u.len(), 4 + 36);
        assert!(u.starts_with("GPU-"));
        let parts: Vec<usize> = u[4..].split('-').map(str::len).collect();
        assert_eq!(parts, vec![8, 4, 4, 4, 12]);
        assert_ne!(
            SimSpec::parse("1x16GiB").unwrap().gpus[0].uuid,
            a.gpus[0].uuid
        );
        assert_eq!(a.gpus[1].pci_bus_id_nvml(), "00000000:02:00.0");
    }

    #[test]
    fn models_are_named_parts_with_mig() {
        let s = SimSpec::parse("1xH100,2xh200").unwrap();
        assert_eq!(s.gpus[0].name, "NVIDIA H100 80GB HBM3");
        assert_eq!(s.gpus[1].total_bytes, 143_771 << 20);
        assert_eq!(s.gpus[2].model, Some(crate::profiles::GpuModel::H200));
        assert_eq!(SimSpec::parse("1x80GiB").unwrap().gpus[0].model, None);
        assert_ne!(s.gpus[1].uuid, s.gpus[2].uuid);
    }
}
