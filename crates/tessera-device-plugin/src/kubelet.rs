//! Talking to the kubelet: registration (over [`tessera_node::grpc::connect_unix`]), and the
//! socket identities that reveal a kubelet restart.
//!
//! A restarting kubelet deletes every socket in the device-plugins folder and creates a new
//! `kubelet.sock`. The plugin remembers the (device, inode) of `kubelet.sock` and of its own
//! socket when it registers; if either changes or disappears, it serves and registers again.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tessera_node::grpc::{ConnectError, connect_unix};

use crate::proto::DEVICE_PLUGIN_VERSION;
use crate::proto::deviceplugin::registration_client::RegistrationClient;
use crate::proto::deviceplugin::{DevicePluginOptions, RegisterRequest};

/// Errors talking to the kubelet.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    /// Could not reach the socket (absent, nobody listening, timed out).
    #[error("cannot reach {path}: {message}")]
    Unreachable {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        message: String,
    },
    /// The kubelet answered and refused.
    #[error("kubelet refused registration: {0}")]
    Refused(String),
    /// The kubelet did not answer in time.
    #[error("kubelet at {0} did not answer within the timeout")]
    Timeout(PathBuf),
}

impl From<ConnectError> for KubeletError {
    fn from(e: ConnectError) -> Self {
        match e {
            ConnectError::Unreachable { path, message } => {
                KubeletError::Unreachable { path, message }
            }
            ConnectError::Timeout(path) => KubeletError::Timeout(path),
        }
    }
}

/// Registers the plugin served at `<folder of kubelet_socket>/<endpoint>`.
pub(crate) async fn register(
    kubelet_socket: &Path,
    endpoint: &str,
    resource_name: &str,
    timeout: Duration,
) -> Result<(), KubeletError> {
    let channel = connect_unix(kubelet_socket, timeout).await?;
    let mut client = RegistrationClient::new(channel);
    let req = RegisterRequest {
        version: DEVICE_PLUGIN_VERSION.to_owned(),
        endpoint: endpoint.to_owned(),
        resource_name: resource_name.to_owned(),
        options: Some(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }),
    };
    match tokio::time::timeout(timeout, client.register(req)).await {
        Ok(Ok(_)) => Ok(()),
        // Transport failures (the kubelet went away mid-call) are worth a retry; a status
        // the kubelet chose to send is its verdict.
        Ok(Err(status)) if status.code() == tonic::Code::Unavailable => {
            Err(KubeletError::Unreachable {
                path: kubelet_socket.to_path_buf(),
                message: status.message().to_owned(),
            })
        }
        Ok(Err(status)) => Err(KubeletError::Refused(format!(
            "{:?}: {}",
            status.code(),
            status.message()
        ))),
        Err(_) => Err(KubeletError::Timeout(kubelet_socket.to_path_buf())),
    }
}

/// Identity of a file: it changes when the file is deleted and created again. The inode number
/// alone is not enough (a file system may hand the freed number to the new file at once), so
/// the change time is part of it; a spurious change only costs a re-registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

/// The identity of `path`, or `None` if it does not exist.
pub(crate) fn file_id(path: &Path) -> Option<FileId> {
    std::fs::symlink_metadata(path).ok().map(|m| FileId {
        dev: m.dev(),
        ino: m.ino(),
        ctime: m.ctime(),
        ctime_nsec: m.ctime_nsec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_id_changes_on_recreate() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("kubelet.sock");
        assert_eq!(file_id(&p), None);
        std::fs::write(&p, b"").unwrap();
        let a = file_id(&p).unwrap();
        assert_eq!(file_id(&p), Some(a));
        // Deleted and created again, possibly under the same inode number.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, b"").unwrap();
        assert_ne!(file_id(&p).unwrap(), a);
    }

    #[tokio::test]
    async fn unreachable_kubelet_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = register(
            &dir.path().join("kubelet.sock"),
            "x.sock",
            "tessera.dev/gpu-shares",
            Duration::from_secs(2),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, KubeletError::Unreachable { .. }), "{err}");
        assert!(err.to_string().contains("kubelet.sock"), "{err}");
    }
}
