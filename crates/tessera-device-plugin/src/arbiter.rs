//! Calls to the arbiter's admin socket from async code. The admin client is blocking, so each
//! call runs on tokio's blocking pool over a fresh connection: an arbiter restart between two
//! calls costs nothing, and a wedged arbiter is bounded by the client's own timeout.

use std::path::{Path, PathBuf};

use tessera_protocol::client::{AdminClient, ClientError};

/// Errors talking to the arbiter.
#[derive(Debug, thiserror::Error)]
pub enum ArbiterError {
    /// The admin call failed (connect, transport or an admin error reply).
    #[error("arbiter at {path}: {source}")]
    Client {
        /// Admin socket.
        path: PathBuf,
        /// Cause.
        source: ClientError,
    },
    /// The blocking task died.
    #[error("arbiter call task failed: {0}")]
    Task(String),
}

impl ArbiterError {
    /// The admin error class, if the arbiter answered with one.
    pub fn admin_kind(&self) -> Option<tessera_protocol::AdminErrorKind> {
        match self {
            ArbiterError::Client {
                source: ClientError::Admin { kind, .. },
                ..
            } => Some(*kind),
            _ => None,
        }
    }
}

/// Runs `f` with a connected admin client on the blocking pool.
pub async fn with_admin<T, F>(path: &Path, f: F) -> Result<T, ArbiterError>
where
    T: Send + 'static,
    F: FnOnce(&mut AdminClient) -> Result<T, ClientError> + Send + 'static,
{
    let owned = path.to_path_buf();
    let res = tokio::task::spawn_blocking(move || {
        let mut client = AdminClient::connect(&owned)?;
        f(&mut client)
    })
    .await
    .map_err(|e| ArbiterError::Task(e.to_string()))?;
    res.map_err(|source| ArbiterError::Client {
        path: path.to_path_buf(),
        source,
    })
}
