//! The node's NVIDIA CDI devices in an `Allocate` answer (`--nvidia-cdi-kind`; the kind itself
//! is [`tessera_node::cdi::CdiKind`]).
//!
//! On a node whose container runtime reads no `NVIDIA_VISIBLE_DEVICES` (containerd with plain
//! runc and CDI on, the containerd 2.x default), a container only gets the driver (device
//! nodes, libraries, hooks) when the answer names the GPU's CDI devices: the kubelet passes
//! `ContainerAllocateResponse.cdi_devices` to the runtime (KEP-4009, GA in Kubernetes 1.31),
//! which applies the edits of the node's NVIDIA spec (`nvidia-ctk cdi generate
//! --device-name-strategy=uuid`: kind `nvidia.com/gpu`, one device per GPU named by its UUID).
//!
//! The names follow NVIDIA's own device plugin with `--device-list-strategy=cdi-cri`
//! (NVIDIA/k8s-device-plugin, `internal/plugin/server.go`, `updateResponseForCDI`): one
//! `CDIDevice` per GPU of the container, named `<vendor>/<class>=<GPU UUID>` (the CDI parser's
//! `QualifiedName`, `nvidia.com` + `gpu` by default).

use tessera_node::cdi::CdiKind;

use crate::proto::deviceplugin::CdiDevice;

/// One CDI device of `kind` per GPU (by UUID), in the order given.
pub(crate) fn devices<'a>(
    kind: &CdiKind,
    uuids: impl IntoIterator<Item = &'a str>,
) -> Vec<CdiDevice> {
    uuids
        .into_iter()
        .map(|u| CdiDevice {
            name: kind.qualified(u),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_named_kind_equals_uuid_in_order() {
        let k: CdiKind = "nvidia.com/gpu".parse().unwrap();
        let names: Vec<String> = devices(&k, ["GPU-b", "GPU-a"])
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["nvidia.com/gpu=GPU-b", "nvidia.com/gpu=GPU-a"]);
        assert!(devices(&k, []).is_empty());
    }
}
