//! Start-up and shutdown: binds both sockets, spawns the accept loops and the scheduler
//! timers, and on shutdown removes the sockets and persists the allocations.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_protocol::GpuInfo;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::scheduler::SchedulerParams;
use crate::state::{Arbiter, StateError};
use crate::store::Store;
use crate::{admin, tenant};

/// Errors of start-up and shutdown.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The state could not be loaded or saved.
    #[error(transparent)]
    State(#[from] StateError),
    /// A socket could not be created.
    #[error("socket {path}: {source}")]
    Socket {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// Another process answers on the socket.
    #[error("socket {0} is in use: another arbiter is running")]
    InUse(PathBuf),
    /// Something that is not a socket sits at the socket path; it is not removed.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
}

/// A running arbiter.
#[derive(Debug)]
pub struct Server {
    arbiter: Arc<Arbiter>,
    socket: PathBuf,
    admin_socket: PathBuf,
    tasks: Vec<JoinHandle<()>>,
}

/// Binds `path` with `mode`: removes a stale socket file first, binds under a temporary name,
/// sets the mode, then renames into place, so the final path never has the wrong mode.
fn bind(path: &Path, mode: u32) -> Result<UnixListener, ServerError> {
    let err = |source| ServerError::Socket {
        path: path.to_owned(),
        source,
    };
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ServerError::InUse(path.to_owned()));
            }
            fs::remove_file(path).map_err(err)?;
        }
        Ok(_) => return Err(ServerError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(err)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let _ = fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(err)?;
    let placed = fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))
        .and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(listener)
}

fn accept_loop<F>(listener: UnixListener, arb: Arc<Arbiter>, serve: F) -> JoinHandle<()>
where
    F: Fn(Arc<Arbiter>, tokio::net::UnixStream) + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => serve(Arc::clone(&arb), stream),
                Err(e) => {
                    // E.g. out of file descriptors: keep serving the open connections.
                    crate::log!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    })
}

impl Server {
    /// Loads the state, binds both sockets and starts serving. Must run inside a tokio
    /// runtime.
    pub async fn start(
        config: &Config,
        gpus: Vec<GpuInfo>,
        params: SchedulerParams,
    ) -> Result<Self, ServerError> {
        let store = Store::open(&config.state_dir).map_err(StateError::from)?;
        let arbiter = Arbiter::new(gpus, store, params)?;
        let tenant_listener = bind(&config.socket, 0o666)?;
        let admin_listener = match bind(&config.admin_socket, 0o600) {
            Ok(l) => l,
            Err(e) => {
                let _ = fs::remove_file(&config.socket);
                return Err(e);
            }
        };
        let mut tasks = vec![
            accept_loop(tenant_listener, Arc::clone(&arbiter), |arb, stream| {
                if let Err(e) = tenant::spawn(arb, stream) {
                    crate::log!("tenant connection dropped: {e}");
                }
            }),
            accept_loop(admin_listener, Arc::clone(&arbiter), |arb, stream| {
                tokio::spawn(admin::serve(arb, stream));
            }),
        ];
        let epoch = arbiter.epoch();
        for s in arbiter.schedulers() {
            tasks.push(tokio::spawn(s.run_timer(epoch)));
        }
        Ok(Self {
            arbiter,
            socket: config.socket.clone(),
            admin_socket: config.admin_socket.clone(),
            tasks,
        })
    }

    /// The shared state.
    pub fn arbiter(&self) -> &Arc<Arbiter> {
        &self.arbiter
    }

    /// Stops accepting, removes the sockets and persists the allocations.
    pub async fn shutdown(self) -> Result<(), ServerError> {
        for t in &self.tasks {
            t.abort();
        }
        for p in [&self.socket, &self.admin_socket] {
            if let Err(e) = fs::remove_file(p)
                && e.kind() != io::ErrorKind::NotFound
            {
                crate::log!("cannot remove {}: {e}", p.display());
            }
        }
        self.arbiter.persist_all().await?;
        Ok(())
    }
}
