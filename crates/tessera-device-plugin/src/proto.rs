//! Code generated from `proto/` by `build.rs` (tonic + prost): the kubelet's device plugin
//! API and its PodResources API. prost renames fields to snake case, e.g.
//! `available_deviceIDs` becomes `available_device_i_ds`.

/// Device plugin API `v1beta1`: `Registration` (kubelet) and `DevicePlugin` (this plugin).
pub mod deviceplugin {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("v1beta1");
}

/// PodResources API `v1`: which container holds which devices.
pub mod podresources {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("v1");
}

/// The API version this plugin registers with.
pub const DEVICE_PLUGIN_VERSION: &str = "v1beta1";
/// Health value of a usable device.
pub const HEALTHY: &str = "Healthy";
/// Health value of a failed device.
pub const UNHEALTHY: &str = "Unhealthy";
