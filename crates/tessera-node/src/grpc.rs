//! gRPC over Unix sockets, as the kubelet speaks it to both plugins (device plugin
//! registration and serving, DRA plugin and registration sockets), and errors on one line.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Why a Unix socket could not be connected.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Could not reach the socket (absent, nobody listening).
    #[error("cannot reach {path}: {message}")]
    Unreachable {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        message: String,
    },
    /// The connection did not complete in time.
    #[error("{0} did not answer within the timeout")]
    Timeout(PathBuf),
}

/// Connects a gRPC channel to a Unix socket, with a deadline on the connection.
pub async fn connect_unix(path: &Path, timeout: Duration) -> Result<Channel, ConnectError> {
    let owned = path.to_path_buf();
    // The URI is required by the API but unused: the connector ignores it.
    let endpoint = Endpoint::from_static("http://localhost").connect_timeout(timeout);
    let connect =
        endpoint.connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = owned.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?))
            }
        }));
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(ch)) => Ok(ch),
        Ok(Err(e)) => Err(ConnectError::Unreachable {
            path: path.to_path_buf(),
            message: error_chain(&e),
        }),
        Err(_) => Err(ConnectError::Timeout(path.to_path_buf())),
    }
}

/// An error with its sources, on one line (tonic's top-level message is terse).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chain_joins_every_source() {
        let inner = std::io::Error::other("inner");
        let outer = std::io::Error::other(ChainTop(inner));
        assert_eq!(error_chain(&outer), "top: inner");
    }

    #[derive(Debug)]
    struct ChainTop(std::io::Error);
    impl std::fmt::Display for ChainTop {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("top")
        }
    }
    impl std::error::Error for ChainTop {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[tokio::test]
    async fn a_missing_socket_is_unreachable_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = connect_unix(&dir.path().join("none.sock"), Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(matches!(err, ConnectError::Unreachable { .. }), "{err}");
        assert!(err.to_string().contains("none.sock"), "{err}");
    }
}
