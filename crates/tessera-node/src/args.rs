//! [`NodeArgs`]: the flags both kubelet plugins take with the same name, meaning and default
//! (the arbiter's sockets, the interposer and identity folders on the host, the paths inside
//! containers, NVML, the log format, the GPUs offered), declared once and flattened into each
//! binary's own (`#[command(flatten)]`), as NVIDIA's DRA driver shares `pkg/flags` between its
//! kubelet binaries.
//!
//! Flags that differ between the two stay in each binary: `--nvidia-cdi-kind` (off by default
//! in the device plugin, `nvidia.com/gpu` in the DRA driver), `--poll-ms` (the device plugin
//! also polls its sockets with it), `--metrics-addr` (the device plugin's alone).

use std::path::PathBuf;

use clap::Args;
use tessera_protocol::node;

use crate::GpuFilter;

/// The flags both kubelet plugins share.
#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    /// Log format: `text` or `json` (one object per line). Levels come from `RUST_LOG`
    /// (default `info`).
    #[arg(
        long,
        env = node::ENV_LOG_FORMAT,
        default_value = "text",
        value_name = "text|json"
    )]
    pub log_format: tessera_log::LogFormat,
    /// The arbiter's admin socket.
    #[arg(
        long,
        value_name = "PATH",
        env = node::ENV_ADMIN_SOCKET,
        default_value = node::DEFAULT_ADMIN_SOCKET
    )]
    pub admin_socket: PathBuf,
    /// The arbiter's tenant socket on the host; its folder is mounted into containers.
    #[arg(
        long,
        value_name = "PATH",
        default_value = node::DEFAULT_TENANT_SOCKET
    )]
    pub tenant_socket: PathBuf,
    /// Where the tenant socket's folder appears inside containers.
    #[arg(long, value_name = "DIR", default_value = node::CONTAINER_SOCKET_DIR)]
    pub container_socket_dir: PathBuf,
    /// Host folder for the versioned interposer copies.
    #[arg(long, value_name = "DIR", default_value = node::HOST_LIB_DIR)]
    pub host_lib_dir: PathBuf,
    /// Host folder of the per-container identity files (token and socket, mounted read-only
    /// at /etc/tessera/tenant in each container).
    #[arg(long, value_name = "DIR", default_value = node::HOST_IDENTITY_DIR)]
    pub host_identity_dir: PathBuf,
    /// The interposer library to install (default: next to this executable).
    #[arg(long, value_name = "PATH")]
    pub interposer: Option<PathBuf>,
    /// Path of the interposer inside containers.
    #[arg(
        long,
        value_name = "PATH",
        default_value = node::CONTAINER_LIB_PATH
    )]
    pub container_lib_path: PathBuf,
    /// NVML library to load.
    #[arg(
        long,
        value_name = "PATH",
        env = node::ENV_NVML_LIB,
        default_value = "libnvidia-ml.so.1"
    )]
    pub nvml_lib: PathBuf,
    /// The GPUs this plugin offers: NVML indexes or UUIDs (`GPU-...`, any case),
    /// comma-separated, or `all`. The others are left to another plugin; one named that the
    /// node does not have is a warning at start, not an error.
    #[arg(
        long,
        value_name = "INDEX|UUID[,...]",
        env = node::ENV_GPUS,
        default_value = "all"
    )]
    pub gpus: GpuFilter,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Bin {
        #[command(flatten)]
        node: NodeArgs,
    }

    #[test]
    fn defaults_are_the_node_contracts_paths() {
        let a = Bin::try_parse_from(["bin"]).unwrap().node;
        assert_eq!(a.host_lib_dir, PathBuf::from(node::HOST_LIB_DIR));
        assert_eq!(a.host_identity_dir, PathBuf::from(node::HOST_IDENTITY_DIR));
        assert_eq!(a.tenant_socket, PathBuf::from(node::DEFAULT_TENANT_SOCKET));
        assert_eq!(
            a.container_socket_dir,
            PathBuf::from(node::CONTAINER_SOCKET_DIR)
        );
        assert_eq!(
            a.container_lib_path,
            PathBuf::from(node::CONTAINER_LIB_PATH)
        );
        assert_eq!(a.interposer, None);
        assert!(a.gpus.is_all());
        let a = Bin::try_parse_from(["bin", "--host-lib-dir=/x", "--interposer", "/i.so"])
            .unwrap()
            .node;
        assert_eq!(a.host_lib_dir, PathBuf::from("/x"));
        assert_eq!(a.interposer, Some(PathBuf::from("/i.so")));
    }

    #[test]
    fn gpus_parse_as_a_filter_and_a_bad_list_is_a_usage_error() {
        let a = Bin::try_parse_from(["bin", "--gpus", "2,GPU-ABC"])
            .unwrap()
            .node;
        assert!(a.gpus.admits(2, "GPU-x") && a.gpus.admits(0, "GPU-abc"));
        assert!(!a.gpus.admits(0, "GPU-x"));
        for bad in ["0,,1", "", "all,1", "MIG-abc"] {
            let e = Bin::try_parse_from(["bin", "--gpus", bad]).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad:?}");
            assert!(e.to_string().contains("--gpus"), "{e}");
        }
    }
}
