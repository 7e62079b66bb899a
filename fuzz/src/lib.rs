//! Fuzz targets for `tessera-protocol`; the invariants live in [`checks`] (shared with the
//! bounded pass in `crates/tessera-protocol/tests/it/fuzz_props.rs`).

pub mod checks;
