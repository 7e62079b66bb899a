//! Generates the kubelet's DRA plugin API (`dra/v1`, and `dra/v1beta1` for older kubelets)
//! and plugin registration API
//! (`pluginregistration/v1`) from the vendored `.proto` files in `proto/` (unmodified copies of
//! k8s.io/kubelet `pkg/apis/`). `protox` parses them in Rust, so no `protoc` binary is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "dra/v1/api.proto",
        "dra/v1beta1/api.proto",
        "pluginregistration/v1/api.proto",
    ];
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    for p in protos {
        println!("cargo:rerun-if-changed=proto/{p}");
    }
    Ok(())
}
