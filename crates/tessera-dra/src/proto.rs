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

/// The plugin type the kubelet's plugin manager hands to its DRA handler
/// (k8s.io/kubelet `pkg/apis/pluginregistration/v1/constants.go`, `DRAPlugin`).
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// What `dra/v1` is called in `supported_versions`: `<last proto package component>.<service>`,
/// the kubelet's `DRAPluginService` (k8s.io/kubelet `pkg/apis/dra/v1/types.go`). The kubelet
/// (`pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`, `validateSupportedServices`) takes the
/// first entry of the plugin's list that is one of its own (`v1.DRAPlugin`,
/// `v1beta1.DRAPlugin`) and refuses the registration when none is; it then calls the full gRPC
/// path `/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/...`, which is what tonic serves from the
/// vendored proto's package ([`DRA_V1_GRPC_SERVICE`]).
pub const DRA_V1_SERVICE: &str = "v1.DRAPlugin";
/// What `dra/v1beta1` is called in `supported_versions` (k8s.io/kubelet
/// `pkg/apis/dra/v1beta1/types.go`).
pub const DRA_V1BETA1_SERVICE: &str = "v1beta1.DRAPlugin";
/// The gRPC service name (proto package + service) the kubelet calls for `dra/v1`
/// (k8s.io/kubelet `pkg/apis/dra/v1/api_grpc.pb.go`, `DRAPlugin_ServiceDesc`).
pub const DRA_V1_GRPC_SERVICE: &str = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin";
/// The gRPC service name the kubelet calls for `dra/v1beta1`.
pub const DRA_V1BETA1_GRPC_SERVICE: &str = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin";
/// The gRPC service name of the registration API the kubelet's plugin watcher calls
/// (k8s.io/kubelet `pkg/apis/pluginregistration/v1/api_grpc.pb.go`: the proto package is
/// `pluginregistration`, not `...v1`).
pub const REGISTRATION_GRPC_SERVICE: &str = "pluginregistration.Registration";
