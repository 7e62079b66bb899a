//! The plugin's life: install the interposer, watch the GPUs, then serve and register with the
//! kubelet, again every time the kubelet restarts, until shut down.
//!
//! With `--latency-shares N` the plugin serves two extended resources from one cut of each
//! GPU: the best-effort resource with the first `per_gpu - N` units and the latency resource
//! with the last `N`, each on its own socket and registration (the device plugin API has one
//! resource per registration). The tier is the resource's: `Allocate` gets only unit ids, and
//! those decide it before the container exists.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::allocate::{Mounts, Settings};
use crate::kubelet::{self, KubeletError, file_id};
use crate::metrics::{self, MetricsError, PluginMetrics};
use crate::podresources::{self, StaleConfig};
use crate::server::{AllocContext, PluginService};
use crate::units::{self, Pool};
use tessera_node::GpuFilter;
use tessera_node::cdi::CdiKind;
use tessera_node::health::{self, GpuSource, HealthError, Snapshot};
use tessera_node::install::{self, InstallError};
use tessera_protocol::Tier;

/// File name of the kubelet's registration socket in the device-plugins folder.
pub(crate) const KUBELET_SOCKET: &str = "kubelet.sock";

/// Errors that stop the plugin. Each maps to an exit code of the binary.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// Flags that cannot work together.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The interposer could not be installed.
    #[error(transparent)]
    Install(#[from] InstallError),
    /// No way to learn the node's GPUs.
    #[error(transparent)]
    Gpus(#[from] HealthError),
    /// The kubelet refused the registration.
    #[error(transparent)]
    Registration(KubeletError),
    /// The metrics endpoint could not be served.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// The plugin socket could not be created.
    #[error("cannot serve on {path}: {source}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
}

/// How the plugin learns the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// NVML, falling back to the arbiter if NVML cannot be loaded.
    Auto,
    /// NVML only.
    Nvml,
    /// The arbiter only (no health events).
    Arbiter,
}

/// Everything the plugin needs; every path is a parameter so tests run in temp folders.
#[derive(Debug, Clone)]
pub struct Config {
    /// The kubelet's device-plugins folder (holds `kubelet.sock` and our socket).
    pub kubelet_dir: PathBuf,
    /// Our socket's file name in that folder.
    pub endpoint: String,
    /// The kubelet's PodResources socket (`None`: neither pod names nor stale clean-up).
    pub pod_resources_socket: Option<PathBuf>,
    /// Delete allocations no container holds (pod names are written either way).
    pub stale_cleanup: bool,
    /// Where to serve `/metrics` (`None`: off).
    pub metrics_addr: Option<SocketAddr>,
    /// The arbiter's admin socket (never mounted into containers).
    pub admin_socket: PathBuf,
    /// The arbiter's tenant socket on the host; its folder is mounted into containers.
    pub tenant_socket: PathBuf,
    /// Where that folder appears in containers.
    pub container_socket_dir: PathBuf,
    /// Host folder for the versioned interposer copies.
    pub host_lib_dir: PathBuf,
    /// The interposer to install (`None`: next to the executable).
    pub interposer: Option<PathBuf>,
    /// Path of the interposer inside containers.
    pub container_lib_path: PathBuf,
    /// Host folder of the per-container identity files (mounted read-only into containers).
    pub host_identity_dir: PathBuf,
    /// Units per GPU.
    pub shares_per_gpu: u32,
    /// Extended resource name.
    pub resource_name: String,
    /// Units of each GPU set apart for the latency resource (0: no latency resource).
    pub latency_shares: u32,
    /// The latency resource's name.
    pub latency_resource_name: String,
    /// The latency resource's socket file name in the kubelet folder.
    pub latency_endpoint: String,
    /// The CDI kind of the node's NVIDIA spec (devices named by GPU UUID) whose devices every
    /// `Allocate` answer names, for runtimes with CDI and without NVIDIA's runtime (`None`:
    /// only `NVIDIA_VISIBLE_DEVICES`).
    pub nvidia_cdi_kind: Option<CdiKind>,
    /// GPU source.
    pub gpu_source: SourceKind,
    /// The GPUs advertised (`--gpus`); the others are left to another plugin: no units, no
    /// health, no allocations.
    pub gpus: GpuFilter,
    /// NVML library name or path.
    pub nvml_lib: PathBuf,
    /// How long an orphaned allocation lives before deletion.
    pub stale_grace: Duration,
    /// How often to look for orphaned allocations.
    pub stale_interval: Duration,
    /// How often to check the kubelet's and our sockets, and re-enumerate GPUs.
    pub poll: Duration,
}

impl Config {
    /// Checks the flags make sense together.
    pub fn validate(&self) -> Result<(), PluginError> {
        let bad = |m: String| Err(PluginError::Config(m));
        if !(1..=1000).contains(&self.shares_per_gpu) {
            return bad(format!(
                "--shares-per-gpu must be 1..=1000, got {}",
                self.shares_per_gpu
            ));
        }
        if !valid_endpoint(&self.endpoint) {
            return bad(format!(
                "--endpoint must be a plain file name other than {KUBELET_SOCKET}"
            ));
        }
        if !valid_resource_name(&self.resource_name) {
            return bad(format!(
                "--resource-name {:?} must be <domain>/<name>, e.g. tessera.dev/gpu-shares",
                self.resource_name
            ));
        }
        if self.latency_shares >= self.shares_per_gpu {
            return bad(format!(
                "--latency-shares {} must be less than --shares-per-gpu {} (the best-effort \
                 resource keeps the rest of each GPU)",
                self.latency_shares, self.shares_per_gpu
            ));
        }
        if self.latency_shares > 0 {
            if !valid_resource_name(&self.latency_resource_name)
                || self.latency_resource_name == self.resource_name
            {
                return bad(format!(
                    "--latency-resource-name {:?} must be <domain>/<name> and differ from \
                     --resource-name",
                    self.latency_resource_name
                ));
            }
            if !valid_endpoint(&self.latency_endpoint) || self.latency_endpoint == self.endpoint {
                return bad(format!(
                    "--latency-endpoint must be a plain file name other than {KUBELET_SOCKET} \
                     and --endpoint"
                ));
            }
        }
        // The tenant socket's folder is mounted into every container: the admin socket must
        // not be reachable through it. Compared as resolved paths: `tenant/../tenant/x` or a
        // symlinked folder would pass a textual check and still land in the mount.
        let tenant_dir = self.tenant_socket.parent().unwrap_or(Path::new("/"));
        let (tenant_real, admin_real) = (resolve(tenant_dir), resolve(&self.admin_socket));
        if admin_real.starts_with(&tenant_real) {
            return bad(format!(
                "the admin socket {} ({}) lies in the tenant socket's folder {} ({}), which \
                 containers mount",
                self.admin_socket.display(),
                admin_real.display(),
                tenant_dir.display(),
                tenant_real.display()
            ));
        }
        if self.tenant_socket.file_name().is_none() || !self.container_socket_dir.is_absolute() {
            return bad(
                "--tenant-socket needs a file name and --container-socket-dir an absolute path"
                    .into(),
            );
        }
        Ok(())
    }
}

impl Config {
    /// The extended resources to serve: the best-effort one, and the latency one when
    /// `latency_shares` is set, as (socket file name, resource name, pool, tier).
    pub fn resources(&self) -> Vec<(String, String, Pool, Tier)> {
        let (be, lat) = Pool::split(self.shares_per_gpu, self.latency_shares);
        let mut out = vec![(
            self.endpoint.clone(),
            self.resource_name.clone(),
            be,
            Tier::BestEffort,
        )];
        if !lat.is_empty() {
            out.push((
                self.latency_endpoint.clone(),
                self.latency_resource_name.clone(),
                lat,
                Tier::Latency,
            ));
        }
        out
    }

    /// The PodResources looks to run (none without `pod_resources_socket`): one per served
    /// resource, each naming and cleaning up its own allocations (told apart by their labels)
    /// and refusing a container that holds both. With the latency split off, one more for the
    /// latency resource's name: allocations made while the split was on keep their units while
    /// their pods run (the kubelet still lists them) and then go like any stale allocation,
    /// rather than holding their shares on the arbiter forever.
    pub fn stale_configs(&self) -> Vec<StaleConfig> {
        let Some(socket) = &self.pod_resources_socket else {
            return Vec::new();
        };
        let look = |resource_name: &str, exclusive_with: Option<String>| StaleConfig {
            socket: socket.clone(),
            admin_socket: self.admin_socket.clone(),
            resource_name: resource_name.to_owned(),
            grace: self.stale_grace,
            interval: self.stale_interval,
            cleanup: self.stale_cleanup,
            exclusive_with,
        };
        let names: Vec<String> = self.resources().into_iter().map(|r| r.1).collect();
        let mut looks: Vec<StaleConfig> = names
            .iter()
            .map(|n| look(n, names.iter().find(|o| *o != n).cloned()))
            .collect();
        if names.len() == 1
            && self.latency_resource_name != self.resource_name
            && valid_resource_name(&self.latency_resource_name)
        {
            looks.push(look(&self.latency_resource_name, None));
        }
        looks
    }
}

/// A socket file name in the kubelet folder.
fn valid_endpoint(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && name != KUBELET_SOCKET
}

/// An extended resource name: `<DNS subdomain>/<name>` with simple characters.
fn valid_resource_name(name: &str) -> bool {
    let Some((domain, n)) = name.split_once('/') else {
        return false;
    };
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    };
    domain.contains('.') && ok(domain) && ok(n) && !n.contains('/')
}

/// The GPUs `--gpus` admits, from the configured source: the one list every unit, health
/// update and allocation of the plugin comes from.
fn start_gpus(cfg: &Config) -> Result<watch::Receiver<Snapshot>, PluginError> {
    let nvml = GpuSource::Nvml {
        lib: cfg.nvml_lib.clone(),
    };
    let arbiter = GpuSource::Arbiter {
        admin_socket: cfg.admin_socket.clone(),
    };
    let start = |source| health::start(source, cfg.gpus.clone(), cfg.poll);
    Ok(match cfg.gpu_source {
        SourceKind::Nvml => start(nvml)?,
        SourceKind::Arbiter => start(arbiter)?,
        SourceKind::Auto => match start(nvml) {
            Ok(rx) => rx,
            Err(e) => {
                tracing::warn!("{e}; taking the GPU list from the arbiter (no XID health)");
                start(arbiter)?
            }
        },
    })
}

/// Logs the GPU list whenever it changes, and GPUs whose ids the kubelet would reject; keeps
/// the unit gauge in step with what is advertised.
fn log_gpus(mut rx: watch::Receiver<Snapshot>, per_gpu: u32, metrics: Arc<PluginMetrics>) {
    tokio::spawn(async move {
        loop {
            let snap = rx.borrow_and_update().clone();
            let devices = crate::server::device_list(&snap, per_gpu);
            let healthy = devices
                .iter()
                .filter(|d| d.health == crate::proto::HEALTHY)
                .count();
            metrics.set_units(healthy, devices.len() - healthy);
            for g in snap.iter() {
                if let Err(e) = units::check_id_len(&g.uuid, per_gpu) {
                    tracing::warn!("not advertising GPU {}: {e}", g.index);
                }
            }
            let names: Vec<String> = snap
                .iter()
                .map(|g| match &g.unhealthy {
                    Some(why) => format!("{} (unhealthy: {why})", g.uuid),
                    None => g.uuid.clone(),
                })
                .collect();
            tracing::info!("GPUs: [{}]", names.join(", "));
            if rx.changed().await.is_err() {
                return;
            }
        }
    });
}

/// Installs the interposer as the init container does, and returns what was installed.
pub fn install_interposer(cfg: &Config) -> Result<install::Installed, PluginError> {
    let src = install::find_interposer(cfg.interposer.as_deref())?;
    let inst = install::install(
        &src,
        &cfg.host_lib_dir,
        env!("CARGO_PKG_VERSION"),
        &cfg.container_lib_path,
    )?;
    tracing::info!(
        "interposer {} at {}",
        if inst.wrote_lib {
            "installed"
        } else {
            "already installed"
        },
        inst.lib_path.display()
    );
    Ok(inst)
}

/// Runs the plugin until `shutdown` completes (Ok) or a fatal error.
pub async fn run(cfg: Config, shutdown: impl Future<Output = ()>) -> Result<(), PluginError> {
    cfg.validate()?;
    let installed = install_interposer(&cfg)?;
    let metrics = Arc::new(PluginMetrics::new());
    let listener = metrics::bind(cfg.metrics_addr).await?;
    let gpus = start_gpus(&cfg)?;
    log_gpus(gpus.clone(), cfg.shares_per_gpu, metrics.clone());

    let (stop_all_tx, stop_all) = watch::channel(false);
    if let Some(l) = listener {
        if let Ok(a) = l.local_addr() {
            tracing::info!("metrics on http://{a}/metrics");
        }
        tokio::spawn(metrics::serve(l, metrics.clone(), stop_all.clone()));
    }
    for look in cfg.stale_configs() {
        tokio::spawn(podresources::run(look, metrics.clone(), stop_all.clone()));
    }
    let mut served = Vec::new();
    for (endpoint, resource_name, pool, tier) in cfg.resources() {
        let ctx = Arc::new(AllocContext {
            settings: Settings {
                per_gpu: cfg.shares_per_gpu,
                resource_name,
                pool,
                tier,
                mounts: Mounts {
                    tenant_socket: cfg.tenant_socket.clone(),
                    container_socket_dir: cfg.container_socket_dir.clone(),
                    installed: installed.clone(),
                    container_lib_path: cfg.container_lib_path.clone(),
                    host_identity_dir: cfg.host_identity_dir.clone(),
                },
                cdi_kind: cfg.nvidia_cdi_kind.clone(),
            },
            admin_socket: cfg.admin_socket.clone(),
            metrics: metrics.clone(),
        });
        served.push(Served { endpoint, ctx });
    }

    let res = generations(&cfg, &served, gpus, shutdown).await;
    let _ = stop_all_tx.send(true);
    res
}

/// One extended resource the plugin serves: its socket file name and its `Allocate` context.
struct Served {
    endpoint: String,
    ctx: Arc<AllocContext>,
}

/// One resource's server in a generation.
struct Serving<'a> {
    served: &'a Served,
    sock: PathBuf,
    id: Option<kubelet::FileId>,
    server: tokio::task::JoinHandle<Result<(), crate::server::ServerError>>,
    /// The `kubelet.sock` it registered with, once it has.
    registered: Option<kubelet::FileId>,
}

/// Why a generation ended.
enum End {
    Shutdown,
    Restart(&'static str),
}

/// One server generation per kubelet incarnation: every resource is served and registered
/// again together.
async fn generations(
    cfg: &Config,
    served: &[Served],
    gpus: watch::Receiver<Snapshot>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), PluginError> {
    tokio::pin!(shutdown);
    let kubelet_sock = cfg.kubelet_dir.join(KUBELET_SOCKET);
    loop {
        // Wait for a kubelet to serve registrations.
        let mut waited = false;
        while file_id(&kubelet_sock).is_none() {
            if !waited {
                tracing::info!("waiting for {}", kubelet_sock.display());
                waited = true;
            }
            tokio::select! {
                () = tokio::time::sleep(cfg.poll) => {}
                () = &mut shutdown => return Ok(()),
            }
        }
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut serving = Vec::new();
        for s in served {
            let sock = cfg.kubelet_dir.join(&s.endpoint);
            let _ = std::fs::remove_file(&sock);
            let listener = match UnixListener::bind(&sock) {
                Ok(l) => l,
                Err(source) => {
                    let _ = stop_tx.send(true);
                    return Err(PluginError::Bind { path: sock, source });
                }
            };
            let id = file_id(&sock);
            let service = PluginService::new(s.ctx.clone(), gpus.clone(), stop_rx.clone());
            let server = tokio::spawn(crate::server::serve(listener, service, stop_rx.clone()));
            serving.push(Serving {
                served: s,
                sock,
                id,
                server,
                registered: None,
            });
        }

        let end = serve_generation(cfg, &kubelet_sock, &mut serving, &mut shutdown).await;
        let _ = stop_tx.send(true);
        for s in &mut serving {
            // Streams end on `stop`; bound the wait anyway so a stuck peer cannot hold us.
            // (A finished handle was already awaited and must not be polled again.)
            if !s.server.is_finished()
                && tokio::time::timeout(Duration::from_secs(3), &mut s.server)
                    .await
                    .is_err()
            {
                s.server.abort();
            }
        }
        match end? {
            End::Shutdown => {
                for s in &serving {
                    if file_id(&s.sock) == s.id {
                        let _ = std::fs::remove_file(&s.sock);
                    }
                }
                return Ok(());
            }
            End::Restart(why) => {
                tracing::warn!("{why}: serving and registering again")
            }
        }
    }
}

/// Registers every resource, then watches the sockets until the kubelet restarts or we are
/// shut down.
async fn serve_generation(
    cfg: &Config,
    kubelet_sock: &Path,
    serving: &mut [Serving<'_>],
    shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<End, PluginError> {
    let mut last_err = String::new();
    loop {
        for s in serving.iter_mut().filter(|s| s.registered.is_none()) {
            let kid = file_id(kubelet_sock);
            let settings = &s.served.ctx.settings;
            match kubelet::register(
                kubelet_sock,
                &s.served.endpoint,
                &settings.resource_name,
                Duration::from_secs(5),
            )
            .await
            {
                Ok(()) => {
                    s.served.ctx.metrics.registered();
                    tracing::info!(
                        "registered {} ({} units per GPU, {} tier) at {}",
                        settings.resource_name,
                        settings.pool.len(),
                        settings.tier,
                        s.sock.display()
                    );
                    s.registered = kid;
                }
                Err(e @ KubeletError::Refused(_)) => return Err(PluginError::Registration(e)),
                Err(e) => {
                    // The kubelet is (re)starting: retry until it listens.
                    let msg = e.to_string();
                    if msg != last_err {
                        tracing::warn!("registration failed, retrying: {msg}");
                        last_err = msg;
                    }
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(cfg.poll) => {}
            () = &mut *shutdown => return Ok(End::Shutdown),
        }
        for s in serving.iter_mut() {
            if s.server.is_finished() {
                let why = match (&mut s.server).await {
                    Ok(Ok(())) => "server stopped".to_string(),
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => format!("server task failed: {e}"),
                };
                tracing::warn!("{why}");
                return Ok(End::Restart("the gRPC server ended"));
            }
            if file_id(&s.sock) != s.id {
                return Ok(End::Restart("our socket was removed (kubelet restart?)"));
            }
            if let Some(kid) = s.registered
                && file_id(kubelet_sock) != Some(kid)
            {
                return Ok(End::Restart(
                    "kubelet.sock was re-created (kubelet restart)",
                ));
            }
        }
    }
}

/// `path` made absolute with its longest existing ancestor canonicalized (symlinks and `..`
/// resolved by the kernel) and the rest, which does not exist yet, normalized lexically.
fn resolve(path: &Path) -> PathBuf {
    use std::path::Component;
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("/"))
            .join(path)
    };
    let comps: Vec<Component<'_>> = abs.components().collect();
    // The longest prefix that canonicalizes; `/` always does.
    let (mut out, rest) = (0..=comps.len())
        .rev()
        .find_map(|n| {
            let prefix: PathBuf = comps[..n].iter().collect();
            std::fs::canonicalize(&prefix)
                .ok()
                .map(|p| (p, &comps[n..]))
        })
        .unwrap_or_else(|| (PathBuf::from("/"), &comps[..]));
    for c in rest {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config {
            kubelet_dir: "/var/lib/kubelet/device-plugins".into(),
            endpoint: "tessera.sock".into(),
            pod_resources_socket: None,
            stale_cleanup: true,
            metrics_addr: None,
            admin_socket: "/run/tessera/admin.sock".into(),
            tenant_socket: "/run/tessera/tenant/tessera.sock".into(),
            container_socket_dir: "/run/tessera".into(),
            host_lib_dir: "/var/lib/tessera/lib".into(),
            host_identity_dir: "/var/lib/tessera/identity".into(),
            interposer: None,
            container_lib_path: "/usr/lib/tessera/libtessera_interpose.so".into(),
            shares_per_gpu: 100,
            resource_name: "tessera.dev/gpu-shares".into(),
            latency_shares: 0,
            latency_resource_name: "tessera.dev/gpu-latency-shares".into(),
            latency_endpoint: "tessera-latency.sock".into(),
            nvidia_cdi_kind: None,
            gpu_source: SourceKind::Auto,
            gpus: GpuFilter::all(),
            nvml_lib: "libnvidia-ml.so.1".into(),
            stale_grace: Duration::from_secs(60),
            stale_interval: Duration::from_secs(10),
            poll: Duration::from_millis(500),
        }
    }

    #[test]
    fn defaults_are_valid_and_bad_combinations_are_refused() {
        cfg().validate().unwrap();
        let mut c = cfg();
        c.admin_socket = "/run/tessera/tenant/admin.sock".into();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("admin socket")
        );
        let mut c = cfg();
        c.admin_socket = "/run/tessera/x/../tenant/admin.sock".into();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("admin socket")
        );
        let mut c = cfg();
        c.shares_per_gpu = 0;
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.endpoint = "kubelet.sock".into();
        assert!(c.validate().is_err());
        for bad in [
            "gpu-shares",
            "tessera/x",
            "tessera.dev/",
            "a.b/c/d",
            "tessera.dev/g pu",
        ] {
            let mut c = cfg();
            c.resource_name = bad.into();
            assert!(c.validate().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_latency_resources_allocations_are_looked_after_also_with_the_split_off() {
        let looks = |c: &Config| -> Vec<(String, Option<String>)> {
            c.stale_configs()
                .into_iter()
                .map(|l| (l.resource_name, l.exclusive_with))
                .collect()
        };
        let (be, lat) = (
            "tessera.dev/gpu-shares".to_owned(),
            "tessera.dev/gpu-latency-shares".to_owned(),
        );
        let mut c = cfg();
        assert!(looks(&c).is_empty(), "no PodResources socket, no looks");
        c.pod_resources_socket = Some("/var/lib/kubelet/pod-resources/kubelet.sock".into());
        // Split off: the served resource, and the latency resource's leftovers from a run with
        // the split on (a plugin restarted without it used to leave them holding shares).
        assert_eq!(looks(&c), vec![(be.clone(), None), (lat.clone(), None)]);
        // Split on: each resource its own, a container holding both refused.
        c.latency_shares = 30;
        assert_eq!(
            looks(&c),
            vec![(be.clone(), Some(lat.clone())), (lat, Some(be.clone()))]
        );
        // A latency name that is the served one's (only possible with the split off): one look.
        c.latency_shares = 0;
        c.latency_resource_name = be.clone();
        assert_eq!(looks(&c), vec![(be, None)]);
        c.stale_cleanup = false;
        assert!(c.stale_configs().iter().all(|l| !l.cleanup));
    }

    #[test]
    fn a_latency_split_adds_a_second_resource_and_bad_splits_are_refused() {
        let c = cfg();
        assert_eq!(c.resources().len(), 1, "no latency resource by default");
        assert_eq!(c.resources()[0].2, Pool::all(100));
        let mut c = cfg();
        c.latency_shares = 30;
        c.validate().unwrap();
        let r = c.resources();
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].1.as_str(), r[0].2, r[0].3),
            (
                "tessera.dev/gpu-shares",
                Pool { first: 0, end: 70 },
                Tier::BestEffort
            )
        );
        assert_eq!(
            (r[1].0.as_str(), r[1].1.as_str(), r[1].2, r[1].3),
            (
                "tessera-latency.sock",
                "tessera.dev/gpu-latency-shares",
                Pool {
                    first: 70,
                    end: 100
                },
                Tier::Latency
            )
        );
        for bad in [100, 101] {
            let mut c = cfg();
            c.latency_shares = bad;
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("--latency-shares"), "{err}");
        }
        let mut c = cfg();
        c.latency_shares = 30;
        c.latency_resource_name = c.resource_name.clone();
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.latency_shares = 30;
        c.latency_endpoint = c.endpoint.clone();
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.latency_shares = 30;
        c.latency_endpoint = "kubelet.sock".into();
        assert!(c.validate().is_err());
    }

    #[test]
    fn an_admin_socket_reached_through_a_symlink_or_dotdot_is_in_the_tenant_folder() {
        let dir = tempfile::tempdir().unwrap();
        let tenant = dir.path().join("tenant");
        std::fs::create_dir(&tenant).unwrap();
        std::fs::create_dir(dir.path().join("x")).unwrap();
        std::os::unix::fs::symlink(&tenant, dir.path().join("admin-dir")).unwrap();
        let mut c = cfg();
        c.tenant_socket = tenant.join("tessera.sock");
        for admin in [
            dir.path().join("admin-dir/admin.sock"),
            dir.path().join("x/../tenant/admin.sock"),
            dir.path().join("x/../tenant/new/../admin.sock"),
            tenant.join("sub/admin.sock"),
        ] {
            c.admin_socket = admin.clone();
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("admin socket"), "{}: {err}", admin.display());
        }
        // A tenant folder reached through a symlink is compared by what it resolves to too.
        c.tenant_socket = dir.path().join("admin-dir/tessera.sock");
        c.admin_socket = tenant.join("admin.sock");
        assert!(c.validate().is_err());
        // A sibling folder is fine.
        c.admin_socket = dir.path().join("x/admin.sock");
        c.validate().unwrap();
    }
}
