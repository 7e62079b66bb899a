//! Configuration and life cycle: install the interposer, read the GPUs, serve the plugin and
//! registration sockets, keep the ResourceSlice current, release claims nothing uses (on start
//! and every [`Config::claim_check`]), and on shutdown remove the sockets (the slice stays for
//! the next start unless [`Config::remove_slices_on_exit`]; see [`crate::publish`]).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_node::GpuFilter;
use tessera_node::health::{self, GpuSource};
use tessera_node::install::{self, InstallError};
use tokio::net::UnixListener;
use tokio::sync::{Mutex, watch};
use tokio_stream::wrappers::UnixListenerStream;

use crate::apiserver::{ApiError, Connection, KubeApi, KubeClient};
use crate::cdi::Wiring;
use crate::claim::DRIVER;
use crate::instances::{self, MigHandle, NoMig};
use crate::inventory::{self, InventoryError};
use crate::prepare::Settings;
use crate::proto::dra::dra_plugin_server::DraPluginServer;
use crate::proto::dra_v1beta1::dra_plugin_server::DraPluginServer as BetaServer;
use crate::proto::registration::registration_server::RegistrationServer;
use crate::service::{DraService, DraV1beta1, RegistrationService};
use crate::slices::{GpuAttrs, MEMORY_STEP};
use tessera_node::nvml_mig::MigNvml;

/// Everything the plugin needs; every path is a parameter (tests use temp folders).
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's name (the pool, and the slice's `nodeName`).
    pub node_name: String,
    /// The kubelet's plugin registration folder (`/var/lib/kubelet/plugins_registry`).
    pub registry_dir: PathBuf,
    /// Folder of the plugin socket (`/var/lib/kubelet/plugins/gpu.tessera.dev`).
    pub plugin_dir: PathBuf,
    /// Folder of CDI specs the runtime reads (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// Where the API server is (the pod's service account in a cluster).
    pub api: Connection,
    /// The arbiter's admin socket.
    pub admin_socket: PathBuf,
    /// The arbiter's tenant socket on the host.
    pub tenant_socket: PathBuf,
    /// Where the tenant socket's folder appears in containers.
    pub container_socket_dir: PathBuf,
    /// Host folder of the installed interposer copies.
    pub host_lib_dir: PathBuf,
    /// The interposer to install (default: next to the executable).
    pub interposer: Option<PathBuf>,
    /// The interposer's path in containers.
    pub container_lib_path: PathBuf,
    /// Host folder of identity files.
    pub host_identity_dir: PathBuf,
    /// NVML library.
    pub nvml_lib: PathBuf,
    /// sysfs root (NUMA nodes).
    pub sysfs: PathBuf,
    /// Memory of a fraction whose claim names none.
    pub default_memory: u64,
    /// CDI kind of the node's NVIDIA spec.
    pub nvidia_kind: String,
    /// GPU health poll interval.
    pub poll: Duration,
    /// Slice re-check interval.
    pub resync: Duration,
    /// Interval between checks of the prepared claims against the API server (claims whose
    /// pods are gone are unprepared).
    pub claim_check: Duration,
    /// Delete this node's ResourceSlice on shutdown (an uninstall). Off: the slice stays, so a
    /// restart or rolling update does not hide the GPUs from the scheduler.
    pub remove_slices_on_exit: bool,
    /// The GPUs published (`--gpus`); the others are left to another plugin
    /// ([`inventory::offered`]).
    pub gpus: GpuFilter,
    /// Which GPUs are published with MIG ([`crate::mig`]).
    pub mig: crate::mig::MigConfig,
    /// The plugin's own state (the MIG instances' checkpoint).
    pub state_dir: PathBuf,
}

/// File name of the plugin socket in [`Config::plugin_dir`].
pub(crate) const PLUGIN_SOCKET: &str = "dra.sock";

impl Config {
    /// The checks made before anything is opened (and all that `--check-config` runs).
    pub fn validate(&self) -> Result<(), PluginError> {
        if self.default_memory == 0 || !self.default_memory.is_multiple_of(MEMORY_STEP) {
            return Err(PluginError::Config(format!(
                "--default-memory-mib must be a positive multiple of {} MiB",
                MEMORY_STEP >> 20
            )));
        }
        self.mig.validate().map_err(PluginError::Config)?;
        // What can be told before the GPUs are read (an index list); a UUID is checked once
        // the inventory is ([`inventory::offered`]).
        if let Some((flag, index)) = self
            .mig
            .named()
            .into_iter()
            .find(|(_, i)| self.gpus.excludes_index(*i))
        {
            return Err(PluginError::Config(format!(
                "{flag} names GPU {index}, which --gpus {} does not offer",
                self.gpus
            )));
        }
        if self.node_name.is_empty() {
            return Err(PluginError::Config(
                "--node-name (or NODE_NAME) must not be empty: it names the node's pool".into(),
            ));
        }
        Ok(())
    }

    /// The plugin socket.
    pub fn plugin_socket(&self) -> PathBuf {
        self.plugin_dir.join(PLUGIN_SOCKET)
    }

    /// The registration socket (`<registry>/gpu.tessera.dev-reg.sock`).
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{DRIVER}-reg.sock"))
    }
}

/// Why the plugin stopped.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// Bad configuration.
    #[error("{0}")]
    Config(String),
    /// The interposer could not be installed.
    #[error(transparent)]
    Install(#[from] InstallError),
    /// The GPUs could not be read.
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    /// The API server client could not be made.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// A socket could not be bound.
    #[error("cannot listen on {path}: {source}")]
    Bind {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// A gRPC server failed.
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
}

fn bind(path: &Path) -> Result<UnixListener, PluginError> {
    let err = |source| PluginError::Bind {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let _ = std::fs::remove_file(path);
    UnixListener::bind(path).map_err(err)
}

/// Runs until `shutdown`.
pub async fn run(cfg: Config, shutdown: impl Future<Output = ()>) -> Result<(), PluginError> {
    cfg.validate()?;
    let api: Arc<dyn KubeApi> = Arc::new(KubeClient::connect(&cfg.api).await?);
    let src = install::find_interposer(cfg.interposer.as_deref())?;
    let installed = install::install(
        &src,
        &cfg.host_lib_dir,
        env!("CARGO_PKG_VERSION"),
        &cfg.container_lib_path,
    )?;
    let (lib, sysfs) = (cfg.nvml_lib.clone(), cfg.sysfs.clone());
    let (mig_cfg, offered) = (cfg.mig.clone(), cfg.gpus.clone());
    let (attrs, node) = tokio::task::spawn_blocking(move || {
        let all = inventory::read(&lib, &sysfs)?;
        let node: Vec<(u32, String)> = all.iter().map(|g| (g.index, g.uuid.clone())).collect();
        // The one place GPUs `--gpus` leaves out are dropped: before MIG is looked at.
        let mut attrs = inventory::offered(all, &offered, &mig_cfg).map_err(PluginError::Config)?;
        inventory::read_mig(&lib, &mut attrs, &mig_cfg)?;
        Ok::<_, PluginError>((attrs, node))
    })
    .await
    .map_err(|e| PluginError::Config(format!("inventory task: {e}")))??;
    let dynamic: Vec<String> = attrs
        .iter()
        .filter(|g| matches!(g.mig, crate::mig::MigMode::Dynamic(_)))
        .map(|g| g.uuid.clone())
        .collect();
    let mig = if dynamic.is_empty() {
        MigHandle::new(NoMig)
    } else {
        let nvml = MigNvml::open(&cfg.nvml_lib)
            .map_err(|e| PluginError::Inventory(InventoryError::Mig(e.to_string())))?;
        MigHandle::new(nvml)
    };
    let mig_checkpoint = cfg.state_dir.join(instances::CHECKPOINT);
    reconcile_mig(&cfg.admin_socket, &mig, &mig_checkpoint, dynamic).await;
    if cfg.gpus.is_all() {
        tracing::info!("{} GPUs on node {}", attrs.len(), cfg.node_name);
    } else {
        tracing::info!(
            "{} of the {} GPUs of node {} offered (--gpus {})",
            attrs.len(),
            node.len(),
            cfg.node_name,
            cfg.gpus
        );
    }
    let gpus = watch_gpus(&cfg, attrs, &node);

    let container_socket = cfg.container_socket_dir.join(
        cfg.tenant_socket
            .file_name()
            .map(PathBuf::from)
            .unwrap_or_else(|| "tessera.sock".into()),
    );
    let settings = Settings {
        cdi_dir: cfg.cdi_dir.clone(),
        identity_dir: cfg.host_identity_dir.clone(),
        wiring: Wiring {
            host_lib: installed.lib_path,
            host_preload: installed.preload_path,
            container_lib: cfg.container_lib_path.clone(),
            host_socket_dir: cfg
                .tenant_socket
                .parent()
                .unwrap_or(Path::new("/"))
                .to_path_buf(),
            container_socket_dir: cfg.container_socket_dir.clone(),
            container_socket,
            container_identity: tessera_protocol::identity::CONTAINER_IDENTITY_FILE.into(),
        },
        nvidia_kind: cfg.nvidia_kind.clone(),
        mig,
        mig_checkpoint,
    };
    let dra = Arc::new(DraService {
        api: api.clone(),
        admin_socket: cfg.admin_socket.clone(),
        settings,
        pool: cfg.node_name.clone(),
        gpus: gpus.clone(),
        default_memory: cfg.default_memory,
        lock: Mutex::new(()),
    });
    let (stop_tx, stop) = watch::channel(false);
    let publisher = tokio::spawn(crate::publish::run(
        api,
        cfg.node_name.clone(),
        gpus,
        cfg.default_memory,
        held_devices(cfg.admin_socket.clone()),
        cfg.resync,
        cfg.remove_slices_on_exit,
        stop.clone(),
    ));
    let checker = tokio::spawn(check_claims(dra.clone(), cfg.claim_check, stop.clone()));

    // The plugin socket serves before the registration socket appears, so the kubelet never
    // finds an endpoint that does not answer.
    let plugin_sock = cfg.plugin_socket();
    let plugin_l = bind(&plugin_sock)?;
    let mut s1 = stop.clone();
    let plugin_srv = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DraPluginServer::from_arc(dra.clone()))
            .add_service(BetaServer::new(DraV1beta1(dra)))
            .serve_with_incoming_shutdown(UnixListenerStream::new(plugin_l), async move {
                let _ = s1.wait_for(|s| *s).await;
            }),
    );
    let reg_sock = cfg.registration_socket();
    let reg_l = bind(&reg_sock)?;
    let (status, _) = watch::channel(None);
    let reg = RegistrationService {
        endpoint: plugin_sock.clone(),
        status,
    };
    let mut s2 = stop.clone();
    let reg_srv = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(reg))
            // The kubelet's registration client sends an authority h2 refuses: relayed.
            .serve_with_incoming_shutdown(crate::authority::incoming(reg_l), async move {
                let _ = s2.wait_for(|s| *s).await;
            }),
    );
    tracing::info!(
        "serving {} (registration {})",
        plugin_sock.display(),
        reg_sock.display()
    );
    shutdown.await;
    let _ = stop_tx.send(true);
    // The registration socket goes first: the kubelet then stops using the plugin.
    let _ = std::fs::remove_file(&reg_sock);
    let _ = publisher.await;
    let _ = checker.await;
    for srv in [reg_srv, plugin_srv] {
        if let Ok(Err(e)) = srv.await {
            tracing::warn!("gRPC server: {e}");
        }
    }
    let _ = std::fs::remove_file(&plugin_sock);
    Ok(())
}

/// The devices the arbiter's allocations of prepared claims name ([`crate::prepare::LABEL_DEVICE`]):
/// what the publisher must not change the counters of; `None` when the arbiter does not answer.
fn held_devices(admin: PathBuf) -> crate::publish::Allocated {
    Arc::new(move || {
        let mut a = tessera_protocol::client::AdminClient::connect(&admin).ok()?;
        tessera_node::arbiter::Arbiter::list(&mut a)
            .ok()
            .map(|all| {
                all.iter()
                    .filter(|x| {
                        x.labels
                            .get(tessera_node::labels::LABEL_OWNER)
                            .map(String::as_str)
                            == Some(tessera_node::labels::OWNER_DRA)
                    })
                    .filter_map(|x| x.labels.get(crate::prepare::LABEL_DEVICE).cloned())
                    .collect()
            })
    })
}

/// At start: the MIG instances of the dynamic GPUs `parents` against the checkpoint and the
/// claims the arbiter still holds allocations for ([`instances::reconcile`]). A failure is
/// logged, not fatal: the plugin still serves whole GPUs and fractions.
async fn reconcile_mig(admin: &Path, mig: &MigHandle, checkpoint: &Path, parents: Vec<String>) {
    if parents.is_empty() && !checkpoint.exists() {
        return;
    }
    let (admin, mig, checkpoint) = (admin.to_path_buf(), mig.clone(), checkpoint.to_path_buf());
    let done = tokio::task::spawn_blocking(move || {
        let mut a = tessera_protocol::client::AdminClient::connect(&admin)
            .map_err(|e| format!("arbiter: {e}"))?;
        let all = tessera_node::arbiter::Arbiter::list(&mut a).map_err(|e| e.to_string())?;
        let prepared = crate::cleanup::prepared_claims(&all)
            .into_iter()
            .map(|c| c.uid)
            .collect();
        mig.with(|m| instances::reconcile(m, &checkpoint, &parents, &prepared))
            .map_err(|e| e.to_string())
    })
    .await;
    match done {
        Ok(Ok(r)) => tracing::info!(
            "MIG at start: {} adopted, {} destroyed, {} records dropped",
            r.adopted.len(),
            r.destroyed.len(),
            r.dropped
        ),
        Ok(Err(e)) => tracing::warn!("MIG reconciliation at start: {e}"),
        Err(e) => tracing::warn!("MIG reconciliation task: {e}"),
    }
}

/// Releases claims nothing uses, now (a plugin that was down may have missed unprepares) and
/// every `every`, until `stop`.
async fn check_claims(dra: Arc<DraService>, every: Duration, mut stop: watch::Receiver<bool>) {
    loop {
        match dra.release_unused().await {
            Ok(released) if !released.is_empty() => {
                tracing::info!("claim check: {} claims released", released.len());
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("claim check: {e}"),
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// The published GPU list: the inventory with the device plugin's health watcher (XID events)
/// merged in; without NVML events, the inventory as read. The watcher looks only at the GPUs
/// `--gpus` admits and checks the filter against the node's (`node`, index and UUID) at start;
/// without it, that check is made here.
fn watch_gpus(
    cfg: &Config,
    attrs: Vec<GpuAttrs>,
    node: &[(u32, String)],
) -> watch::Receiver<Arc<Vec<GpuAttrs>>> {
    let (tx, rx) = watch::channel(Arc::new(attrs.clone()));
    match health::start(
        GpuSource::Nvml {
            lib: cfg.nvml_lib.clone(),
        },
        cfg.gpus.clone(),
        cfg.poll,
    ) {
        Ok(mut snap) => {
            tokio::spawn(async move {
                loop {
                    let merged = inventory::merge_health(&attrs, &snap.borrow_and_update());
                    tx.send_if_modified(|cur| {
                        let changed = **cur != merged;
                        if changed {
                            *cur = Arc::new(merged);
                        }
                        changed
                    });
                    if snap.changed().await.is_err() {
                        return;
                    }
                }
            });
        }
        Err(e) => {
            tracing::warn!("no GPU health events ({e}); publishing the inventory as read");
            let node: Vec<(u32, &str)> = node.iter().map(|(i, u)| (*i, u.as_str())).collect();
            cfg.gpus.warn_at_start(&node);
        }
    }
    rx
}
