//! The backstop's settings: what to do with a breach, and the tolerance of the memory rule.

#[allow(unused_imports)]
use super::*;

/// What to do with a process that breaks its allocation's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforce {
    /// `SIGKILL` it (the default).
    Kill,
    /// Log and count it only.
    Report,
}

/// What to do with a process in a container that belongs to no allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unknown {
    /// `SIGKILL` it (the default; `--enforce report` turns it into a report too).
    Kill,
    /// Log it once.
    Report,
    /// Say nothing.
    Ignore,
}

/// Settings of the backstop.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// How often NVML is read.
    pub interval: Duration,
    /// Device memory an allocation's processes may hold together beyond its limit.
    pub memory_tolerance: Tolerance,
    /// Kill or report.
    pub enforce: Enforce,
    /// Unknown processes in containers.
    pub unknown: Unknown,
    /// Unleased GPU time an allocation may build up before its busiest process is killed.
    pub compute_threshold: Duration,
    /// Unleased GPU time forgiven per unit of wall time (kernels that overrun their lease).
    pub compute_slack: f64,
    /// Unleased GPU time an allocation that takes part in leasing may show before any of it is
    /// charged: NVML gives GPU time per process in samples of whole periods (see
    /// [`DEFAULT_COMPUTE_TOLERANCE`]), not per lease.
    pub compute_tolerance: Duration,
}

/// Default [`Policy::compute_tolerance`]: 500 ms, two and a half of NVML's sample periods. On
/// an H200 (driver 580) NVML's per-process utilisation comes in 200 ms sample periods, each
/// giving the period to the processes that ran in it in lumps: two tenants time-slicing 30/70
/// in 20 ms leases showed one of them at 95-97% for a whole period, or both at 48-49%, never
/// 30 and 70. Over seconds the split is right; poll by poll (250 ms) an honest tenant's NVML
/// time ran ahead of its leases by up to 210 ms, and charging each excursion charged honest
/// tenants 0.3-1.3 s of 8-10 s (the 30/70 split of work came out 22.5/77.5 and 32/68; with
/// the backstop off, 30.0/70.0). Measured with examples/gpu-check (docs/benchmarks.md,
/// "gpu-check on an H200").
pub(crate) const DEFAULT_COMPUTE_TOLERANCE: Duration = Duration::from_millis(500);

/// What an allocation's processes may hold beyond its limit, by NVML: one slack per allocation
/// for the driver's own rounding (its contexts are inside the limit: the interposer reserves
/// each one's cost through the ledger), plus, only where an operator sets it, an amount per
/// process for contexts that cost more on the card than the interposer's estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tolerance {
    /// Bytes per allocation, whatever its number of processes.
    pub per_allocation: u64,
    /// Bytes per process of the allocation on the card (0 by default).
    pub per_process: u64,
}

/// Default [`Tolerance::per_allocation`]: 64 MiB, the driver's rounding of what it holds.
pub(crate) const DEFAULT_MEMORY_SLACK: u64 = 64 << 20;

impl From<u64> for Tolerance {
    /// A per-allocation slack only.
    fn from(per_allocation: u64) -> Self {
        Self {
            per_allocation,
            per_process: 0,
        }
    }
}

impl Tolerance {
    /// What an allocation of `limit` bytes with `processes` processes on the card may hold.
    pub fn allowed(&self, limit: u64, processes: usize) -> u64 {
        limit
            .saturating_add(self.per_allocation)
            .saturating_add(self.per_process.saturating_mul(processes as u64))
    }
}
