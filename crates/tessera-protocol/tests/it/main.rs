//! The protocol's integration tests, one binary (one link, not one per file); each module was
//! a test file of its own: [`frames`] (framing against partial, oversized and garbage input),
//! [`golden`] (the tenant wire format, byte for byte), [`fuzz_props`] (a bounded pass of the
//! fuzz targets).

mod frames;
mod fuzz_props;
mod golden;
