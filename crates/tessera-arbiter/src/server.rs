//! Start-up and shutdown: binds both sockets, spawns the accept loops (each connection goes
//! through [`crate::admission`] first), the scheduler timers, the reaper, the metrics endpoint
//! and the backstop's thread; on shutdown stops every one of them (the metrics endpoint and the
//! backstop finish what they are doing first), removes the sockets and persists the
//! allocations.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_protocol::GpuInfo;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;

use crate::admin;
use crate::admission::{self, Admission, Limits};
use crate::config::Config;
use crate::metrics::{self, MetricsAddr};
use crate::scheduler::SchedulerParams;
use crate::state::{Arbiter, StateError};
use crate::store::Store;

/// How often refusals and failed handshakes are summed up in the log (when there were any).
const REPORT_EVERY: Duration = Duration::from_secs(1);

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
    /// The metrics endpoint could not listen.
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    /// The backstop could not load NVML.
    #[error("cannot start the backstop: {0}")]
    Backstop(#[source] crate::gpus::GpusError),
    /// The backstop's thread could not be started.
    #[error("cannot start the backstop thread: {0}")]
    BackstopThread(#[source] io::Error),
}

/// The backstop's thread and the sender that stops it.
#[derive(Debug)]
struct BackstopThread {
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

/// A running arbiter.
#[derive(Debug)]
pub struct Server {
    arbiter: Arc<Arbiter>,
    socket: PathBuf,
    admin_socket: PathBuf,
    /// The user socket, when `--users-group` serves one.
    user_socket: Option<PathBuf>,
    /// The metrics endpoint and what stops it.
    metrics: Option<(tokio::sync::oneshot::Sender<()>, JoinHandle<()>)>,
    backstop: Option<BackstopThread>,
    tasks: Vec<JoinHandle<()>>,
}

/// Raises the soft limit on open files so the caps, not the limit, decide who gets in: an
/// arbiter out of descriptors cannot even accept (and close) a connection, honest or not.
fn raise_nofile(limits: &Limits) {
    // Both sockets' pending caps (a tenant one also holds its peer's pidfd), three per admitted
    // tenant (its socket, the writer's clone, its peer's pidfd), and room for state files,
    // NVML and /proc.
    let want = (3 * limits.pending + 3 * limits.admitted + 1024) as libc::rlim_t;
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `rl` is a valid rlimit to write into.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 || rl.rlim_cur >= want {
        return;
    }
    let cur = want.min(rl.rlim_max);
    let new = libc::rlimit {
        rlim_cur: cur,
        rlim_max: rl.rlim_max,
    };
    // SAFETY: `new` is a valid rlimit; only the soft limit changes, within the hard one.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } != 0 || cur < want {
        tracing::warn!(
            "open files limited to {} (the caps want {want}): lower --max-tenant-connections \
             or raise the hard limit",
            cur.max(rl.rlim_cur)
        );
    }
}

/// Binds `path` with `mode`: removes a stale socket file first, binds under a temporary name,
/// sets the mode, then renames into place, so the final path never has the wrong mode.
fn bind(path: &Path, mode: u32) -> Result<UnixListener, ServerError> {
    bind_for_group(path, mode, None)
}

/// [`bind`], the socket's group set to `gid` (before it is in place) when given.
fn bind_for_group(path: &Path, mode: u32, gid: Option<u32>) -> Result<UnixListener, ServerError> {
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
    let placed = std::os::unix::fs::chown(&tmp, None, gid)
        .and_then(|()| fs::set_permissions(&tmp, fs::Permissions::from_mode(mode)))
        .and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(listener)
}

fn accept_loop<F>(
    listener: UnixListener,
    arb: Arc<Arbiter>,
    adm: Arc<Admission>,
    serve: F,
) -> JoinHandle<()>
where
    F: Fn(Arc<Arbiter>, &Arc<Admission>, tokio::net::UnixStream) + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => serve(Arc::clone(&arb), &adm, stream),
                Err(e) => {
                    // E.g. out of file descriptors: keep serving the open connections.
                    tracing::warn!("accept failed: {e}");
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
        arbiter.set_memory_wait(Duration::from_millis(config.memory_wait_ms));
        let tenant_listener = bind(&config.socket, 0o666)?;
        let admin_listener = match bind(&config.admin_socket, 0o600) {
            Ok(l) => l,
            Err(e) => {
                let _ = fs::remove_file(&config.socket);
                return Err(e);
            }
        };
        let limits = config.limits();
        let users = match bind_users(config) {
            Ok(u) => u,
            Err(e) => {
                let _ = fs::remove_file(&config.socket);
                let _ = fs::remove_file(&config.admin_socket);
                return Err(e);
            }
        };
        let user_socket = users.as_ref().map(|_| config.users.user_socket.clone());
        let remove_sockets = || {
            let _ = fs::remove_file(&config.socket);
            let _ = fs::remove_file(&config.admin_socket);
            if let Some(p) = &user_socket {
                let _ = fs::remove_file(p);
            }
        };
        raise_nofile(&limits);
        let tenant_admission = Admission::new(limits);
        let admin_admission = Admission::new(limits);
        let metrics = match config.metrics_addr {
            MetricsAddr::Off => None,
            MetricsAddr::At(addr) => match metrics::bind(addr).await {
                Ok(l) => Some(l),
                Err(e) => {
                    remove_sockets();
                    return Err(e.into());
                }
            },
        };
        let metrics_addr = metrics.as_ref().and_then(|l| l.local_addr().ok());
        let mut tasks = vec![
            accept_loop(
                tenant_listener,
                Arc::clone(&arbiter),
                Arc::clone(&tenant_admission),
                |arb, adm, stream| {
                    admission::accept_tenant(arb, adm, stream, crate::tenant::serve_admitted)
                },
            ),
            accept_loop(
                admin_listener,
                Arc::clone(&arbiter),
                Arc::clone(&admin_admission),
                admin::accept,
            ),
            tokio::spawn(Arc::clone(&tenant_admission).report("tenant", REPORT_EVERY)),
            tokio::spawn(crate::reaper::reap_loop(Arc::clone(&arbiter))),
            tokio::spawn(Arc::clone(&admin_admission).report("admin", REPORT_EVERY)),
        ];
        if let Some((listener, users)) = users {
            let user_admission = Admission::new(limits);
            let users = Arc::new(users);
            tasks.push(accept_loop(
                listener,
                Arc::clone(&arbiter),
                Arc::clone(&user_admission),
                move |arb, adm, stream| {
                    crate::users::socket::accept(arb, adm, Arc::clone(&users), stream)
                },
            ));
            tasks.push(tokio::spawn(user_admission.report("user", REPORT_EVERY)));
        }
        let epoch = arbiter.epoch();
        // A MIG instance made later is read on demand (a Create naming it, a backstop poll).
        arbiter.set_discovery(Box::new(crate::gpus::NvmlDiscovery {
            lib: Some(config.nvml_lib.clone().into()),
        }));
        for s in arbiter.start_timers(tokio::runtime::Handle::current()) {
            tasks.push(tokio::spawn(s.run_timer(epoch)));
        }
        // Shared by the backstop (which counts) and the metrics endpoint (which shows them).
        let backstop_counters = Arc::new(crate::backstop::Counters::default());
        let metrics = metrics.map(|listener| {
            let mut collector = metrics::ArbiterCollector::new(
                Arc::clone(&arbiter),
                Some(Arc::clone(&tenant_admission)),
            );
            if config.backstop_policy().is_some() {
                collector = collector.with_backstop(Arc::clone(&backstop_counters));
            }
            let registry = metrics::registry_of(collector);
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(metrics::serve(listener, Arc::new(registry), async {
                let _ = stopped.await;
            }));
            if let Some(addr) = metrics_addr {
                tracing::info!("metrics on http://{addr}/metrics");
            }
            (stop, task)
        });
        install_drain_card(config);
        let backstop = match start_backstop(config, &arbiter, backstop_counters) {
            Ok(b) => b,
            Err(e) => {
                for t in &tasks {
                    t.abort();
                }
                remove_sockets();
                return Err(e);
            }
        };
        Ok(Self {
            arbiter,
            socket: config.socket.clone(),
            admin_socket: config.admin_socket.clone(),
            user_socket,
            metrics,
            backstop,
            tasks,
        })
    }

    /// Stops every task and the backstop, removes the sockets and persists the allocations.
    pub async fn shutdown(self) -> Result<(), ServerError> {
        // Accept loops, timers and the reaper hold nothing in flight: stopped where they wait.
        for t in &self.tasks {
            t.abort();
        }
        // The metrics endpoint answers the scrapes it has begun, then returns.
        if let Some((stop, task)) = self.metrics {
            let _ = stop.send(());
            let _ = task.await;
        }
        // The backstop finishes its poll (a poll acts on what it read) and returns.
        if let Some(b) = self.backstop {
            drop(b.stop);
            if tokio::task::spawn_blocking(move || b.thread.join())
                .await
                .is_err()
            {
                tracing::warn!("the backstop thread could not be joined");
            }
        }
        for p in [&self.socket, &self.admin_socket]
            .into_iter()
            .chain(self.user_socket.as_ref())
        {
            if let Err(e) = fs::remove_file(p)
                && e.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!("cannot remove {}: {e}", p.display());
            }
        }
        self.arbiter.persist_all().await?;
        Ok(())
    }
}

/// Binds the user socket (mode 0660, group `--users-group`) when `--users-group` asks for one.
/// Refused where a container could reach it (the tenant socket's folder, which the plugins
/// mount) or on another socket's path.
fn bind_users(config: &Config) -> Result<Option<(UnixListener, crate::users::Users)>, ServerError> {
    let Some(users) = config.users.users() else {
        return Ok(None);
    };
    let path = &config.users.user_socket;
    let refuse = |why: &str| ServerError::Socket {
        path: path.clone(),
        source: io::Error::new(io::ErrorKind::InvalidInput, why.to_owned()),
    };
    if path == &config.socket || path == &config.admin_socket {
        return Err(refuse("the user socket needs a path of its own"));
    }
    if path.parent() == config.socket.parent() {
        return Err(refuse(
            "the user socket must not be in the tenant socket's folder (containers see it)",
        ));
    }
    let listener = bind_for_group(path, 0o660, Some(users.gid))?;
    tracing::info!(
        "serving users of group {} on {} (quota per user: {}, shares {}; {} set per user)",
        users.gid,
        path.display(),
        tessera_protocol::size::human(users.default.memory),
        users.default.shares,
        users.per_uid.len()
    );
    Ok(Some((listener, users)))
}

/// Loads NVML for the drains of closed connections (see [`crate::drain`]); without it a closed
/// connection's memory is released when its process exits.
fn install_drain_card(config: &Config) {
    match crate::drain::NvmlCard::load(config.nvml_lib.as_os_str()) {
        Ok(card) => crate::drain::install_card(Arc::new(card)),
        Err(e) => tracing::info!(
            "no NVML for drains ({e}): a closed connection's memory is released when its \
             process exits"
        ),
    }
}

/// Loads NVML for the backstop and starts its thread (none with `--backstop-interval-ms 0`).
fn start_backstop(
    config: &Config,
    arbiter: &Arc<Arbiter>,
    counters: Arc<crate::backstop::Counters>,
) -> Result<Option<BackstopThread>, ServerError> {
    let Some(policy) = config.backstop_policy() else {
        return Ok(None);
    };
    let mut b = crate::backstop::Backstop::new(
        Arc::clone(arbiter),
        policy,
        Some(config.nvml_lib.as_os_str()),
        &config.host_mount_ns,
    )
    .map_err(ServerError::Backstop)?
    .with_identity_dir(config.identity_dir.clone());
    b.counters = counters;
    let (stop, stopped) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("backstop".into())
        .spawn(move || b.run(stopped))
        .map_err(ServerError::BackstopThread)?;
    Ok(Some(BackstopThread { stop, thread }))
}
