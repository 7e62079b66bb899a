//! Who made an arbiter allocation: both plugins label theirs with [`LABEL_OWNER`], and each
//! touches only its own (the device plugin's stale clean-up, the DRA driver's unprepare and
//! claim check), so the two can run on one node side by side.

/// Who made the allocation.
pub const LABEL_OWNER: &str = "tessera.dev/owner";
/// Value of [`LABEL_OWNER`] on the device plugin's allocations.
pub const OWNER_DEVICE_PLUGIN: &str = "device-plugin";
/// Value of [`LABEL_OWNER`] on the DRA driver's allocations.
pub const OWNER_DRA: &str = "dra";
