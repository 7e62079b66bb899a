//! Code generated from `proto/` by `build.rs` (tonic + prost).

/// The kubelet's DRA plugin API `v1`: `DRAPlugin` (NodePrepareResources,
/// NodeUnprepareResources), served by this plugin.
pub mod dra {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// The kubelet's DRA plugin API `v1beta1` (the same calls; no `share_id`), served beside
/// `v1` for kubelets that do not speak `v1`.
pub mod dra_v1beta1 {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
}

/// The kubelet's plugin registration API `v1`: `Registration` (GetInfo,
/// NotifyRegistrationStatus), served by this plugin on a socket in `plugins_registry`.
pub mod registration {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("pluginregistration");
}

/// The plugin type the kubelet's plugin manager hands to its DRA handler.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The gRPC service name of `dra/v1`: the kubelet (1.34+) lists service names, not API
/// versions, in `supported_versions` and picks the newest it knows.
pub const DRA_V1_SERVICE: &str = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin";
/// The gRPC service name of `dra/v1beta1`.
pub const DRA_V1BETA1_SERVICE: &str = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin";
