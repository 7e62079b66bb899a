//! Generates the kubelet gRPC APIs (device plugin v1beta1, PodResources v1) from the `.proto`
//! files in `proto/`. `protox` parses them in Rust, so no `protoc` binary is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "deviceplugin/v1beta1/api.proto",
        "podresources/v1/api.proto",
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
