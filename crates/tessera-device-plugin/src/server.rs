//! The `DevicePlugin` gRPC service the kubelet calls.
//!
//! - `ListAndWatch`: every healthy GPU as `per_gpu` units; a new full list whenever the GPU
//!   snapshot changes (an XID marks a GPU's units `Unhealthy`, a vanished GPU's units go).
//! - `GetPreferredAllocation`: [`crate::units::preferred`] (one GPU, best fit; whole GPUs above).
//! - `Allocate`: refuses units spread over GPUs that are not whole GPUs; creates the arbiter
//!   allocation and tells the kubelet what to put in the container (see [`Mounts`]).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::pin::Pin;

use tessera_protocol::client::ClientError;
use tessera_protocol::{AdminErrorKind, AllocationStatus, CreateAllocation, GpuSelector};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status};

use crate::arbiter::{ArbiterError, with_admin};
use crate::health::Snapshot;
use crate::install::Installed;
use crate::metrics::{PluginMetrics, Refusal};
use crate::proto::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use crate::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    Mount, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use crate::proto::{HEALTHY, UNHEALTHY};
use crate::units::{self, Claim, UnitsError};

/// Environment variable carrying the allocation's secret token into the container.
pub const ENV_TOKEN: &str = "TESSERA_TOKEN";
/// Environment variable carrying the tenant socket's path inside the container.
pub const ENV_SOCKET: &str = "TESSERA_SOCKET";
/// Environment variable carrying the public allocation id(s) (not secret).
pub const ENV_ALLOCATION: &str = "TESSERA_ALLOCATION_ID";
/// The NVIDIA container runtime's GPU selection.
pub const ENV_VISIBLE: &str = "NVIDIA_VISIBLE_DEVICES";
/// Where glibc's loader reads libraries to preload.
pub const CONTAINER_PRELOAD: &str = "/etc/ld.so.preload";
pub use tessera_protocol::identity::CONTAINER_IDENTITY_FILE;

/// Errors of the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The gRPC server failed.
    #[error("device plugin gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Where things are on the host and in containers.
#[derive(Debug, Clone)]
pub struct Mounts {
    /// Host path of the arbiter's tenant socket; its folder is mounted into containers.
    pub tenant_socket: PathBuf,
    /// Folder the tenant socket's folder appears as in containers.
    pub container_socket_dir: PathBuf,
    /// The installed interposer on the host.
    pub installed: Installed,
    /// Path of the interposer inside containers (what the preload file names).
    pub container_lib_path: PathBuf,
    /// Host folder of the per-container identity files.
    pub host_identity_dir: PathBuf,
}

/// Everything `Allocate` needs.
#[derive(Debug, Clone)]
pub struct AllocContext {
    /// Units per GPU.
    pub per_gpu: u32,
    /// Extended resource name (also stored in allocation labels).
    pub resource_name: String,
    /// Arbiter admin socket.
    pub admin_socket: PathBuf,
    /// Container wiring.
    pub mounts: Mounts,
    /// Counters of served and refused requests.
    pub metrics: std::sync::Arc<PluginMetrics>,
}

/// The service; cheap to clone per server generation.
#[derive(Clone)]
pub struct PluginService {
    ctx: std::sync::Arc<AllocContext>,
    gpus: watch::Receiver<Snapshot>,
    stop: watch::Receiver<bool>,
}

impl PluginService {
    /// A service over the GPU snapshot channel; streams end when `stop` turns true.
    pub fn new(
        ctx: std::sync::Arc<AllocContext>,
        gpus: watch::Receiver<Snapshot>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        Self { ctx, gpus, stop }
    }
}

/// The device list for a snapshot. GPUs whose ids would be too long are left out (logged
/// once by the caller that validates the snapshot).
pub fn device_list(snapshot: &Snapshot, per_gpu: u32) -> Vec<Device> {
    let mut out = Vec::new();
    for gpu in snapshot.iter() {
        if units::check_id_len(&gpu.uuid, per_gpu).is_err() {
            continue;
        }
        let health = if gpu.unhealthy.is_some() {
            UNHEALTHY
        } else {
            HEALTHY
        };
        out.extend(
            units::unit_ids(&gpu.uuid, per_gpu)
                .into_iter()
                .map(|id| Device {
                    id,
                    health: health.to_owned(),
                    topology: None,
                }),
        );
    }
    out
}

fn invalid(e: UnitsError) -> Status {
    Status::invalid_argument(e.to_string())
}

fn arbiter_status(e: ArbiterError) -> Status {
    let msg = format!("tessera: {e}");
    match e.admin_kind() {
        Some(AdminErrorKind::InvalidArgument) => Status::invalid_argument(msg),
        Some(AdminErrorKind::Exhausted) => Status::resource_exhausted(msg),
        Some(AdminErrorKind::NotFound) => Status::not_found(msg),
        Some(AdminErrorKind::Internal) => Status::internal(msg),
        None => Status::unavailable(msg),
    }
}

/// One arbiter allocation to make.
#[derive(Debug, Clone)]
struct Planned {
    container: usize,
    uuid: String,
    units: BTreeSet<u32>,
}

/// Makes every planned allocation over one admin connection, or none: on a failure the ones
/// already made are deleted again.
fn create_all(
    c: &mut tessera_protocol::client::AdminClient,
    plans: &[Planned],
    per_gpu: u32,
    resource: &str,
    identity_dir: &Path,
) -> Result<Vec<(String, AllocationStatus)>, ClientError> {
    let gpus = c.gpus()?;
    let mut live: HashSet<String> = HashSet::new();
    // Units the kubelet hands out again are free in its eyes: an allocation still holding
    // them belongs to a container that is gone (or to an Allocate the kubelet retried).
    let wanted: HashSet<String> = plans
        .iter()
        .flat_map(|p| p.units.iter().map(move |n| format!("{}-{n}", p.uuid)))
        .collect();
    for a in c.list()? {
        live.insert(a.id.clone());
        let Some(ids) = units::units_from_labels(&a.labels, resource) else {
            continue;
        };
        if ids.iter().any(|id| wanted.contains(id)) {
            tracing::info!(
                "deleting allocation {} (its units are being reassigned)",
                a.id
            );
            match c.delete(&a.id) {
                Ok(())
                | Err(ClientError::Admin {
                    kind: AdminErrorKind::NotFound,
                    ..
                }) => {
                    live.remove(&a.id);
                }
                Err(e) => return Err(e),
            }
        }
    }
    let mut made: Vec<(String, AllocationStatus)> = Vec::new();
    let mut result = Ok(());
    for p in plans {
        let Some(gpu) = gpus.iter().find(|g| g.uuid == p.uuid) else {
            result = Err(ClientError::Admin {
                kind: AdminErrorKind::InvalidArgument,
                message: format!("the arbiter does not know GPU {}", p.uuid),
            });
            break;
        };
        let n = p.units.len() as u32;
        let req = CreateAllocation {
            gpu: GpuSelector::Uuid(p.uuid.clone()),
            memory_limit: units::memory_for(n, per_gpu, gpu.memory_total),
            share: units::share_for(n, per_gpu),
            cap: None,
            labels: units::allocation_labels(resource, &p.uuid, &p.units),
        };
        match c.create(req) {
            Ok(x) => made.push(x),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if let Err(e) = result {
        for (_, a) in &made {
            let _ = c.delete(&a.id);
        }
        return Err(e);
    }
    // Identity files of allocations deleted since (here, or by the stale clean-up) go.
    live.extend(made.iter().map(|(_, a)| a.id.clone()));
    crate::identity::sweep(identity_dir, &live);
    Ok(made)
}

fn mount(container: &Path, host: &Path) -> Mount {
    Mount {
        container_path: container.display().to_string(),
        host_path: host.display().to_string(),
        read_only: true,
    }
}

/// The container wiring for a fraction: token, socket, preload of the interposer, and the
/// identity file (`identity`: its host path), which the interposer trusts over the
/// environment (the environment variables stay for tools and for people).
fn fraction_response(
    m: &Mounts,
    uuid: &str,
    token: &str,
    id: &str,
    identity: &Path,
) -> ContainerAllocateResponse {
    let sock_name = m
        .tenant_socket
        .file_name()
        .map(Path::new)
        .unwrap_or(Path::new("tessera.sock"));
    let host_sock_dir = m.tenant_socket.parent().unwrap_or(Path::new("/"));
    let envs = BTreeMap::from([
        (ENV_TOKEN.to_owned(), token.to_owned()),
        (
            ENV_SOCKET.to_owned(),
            m.container_socket_dir.join(sock_name).display().to_string(),
        ),
        (ENV_VISIBLE.to_owned(), uuid.to_owned()),
        (ENV_ALLOCATION.to_owned(), id.to_owned()),
    ]);
    ContainerAllocateResponse {
        envs: envs.into_iter().collect(),
        mounts: vec![
            mount(&m.container_lib_path, &m.installed.lib_path),
            mount(Path::new(CONTAINER_PRELOAD), &m.installed.preload_path),
            mount(&m.container_socket_dir, host_sock_dir),
            mount(Path::new(CONTAINER_IDENTITY_FILE), identity),
        ],
        ..Default::default()
    }
}

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    type ListAndWatchStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }))
    }

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut gpus = self.gpus.clone();
        let mut stop = self.stop.clone();
        let per_gpu = self.ctx.per_gpu;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                let devices = device_list(&gpus.borrow_and_update().clone(), per_gpu);
                if tx.send(Ok(ListAndWatchResponse { devices })).await.is_err() {
                    break;
                }
                tokio::select! {
                    r = gpus.changed() => if r.is_err() { break },
                    _ = stop.wait_for(|s| *s) => break,
                    () = tx.closed() => break,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in request.into_inner().container_requests {
            let ids = units::preferred(
                &c.available_device_i_ds,
                &c.must_include_device_i_ds,
                i64::from(c.allocation_size),
                self.ctx.per_gpu,
            )
            .map_err(invalid)?;
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let n = request.get_ref().container_requests.len();
        match self.allocate_all(request).await {
            Ok(r) => {
                self.ctx.metrics.allocated(n);
                Ok(r)
            }
            Err((why, status)) => {
                self.ctx.metrics.refused(why);
                Err(status)
            }
        }
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

impl PluginService {
    /// `Allocate`; an error says why, for the refusal metric.
    async fn allocate_all(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, (Refusal, Status)> {
        let ctx = self.ctx.clone();
        let snapshot = self.gpus.borrow().clone();
        let requests = request.into_inner().container_requests;
        let mut plans = Vec::new();
        let mut whole: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (i, c) in requests.iter().enumerate() {
            let claim = units::classify(&c.devices_ids, ctx.per_gpu)
                .map_err(|e| (Refusal::BadUnits, invalid(e)))?;
            let uuids = match &claim {
                Claim::Fraction { uuid, .. } => vec![uuid.clone()],
                Claim::WholeGpus { uuids } => uuids.clone(),
            };
            for u in &uuids {
                match snapshot.iter().find(|g| &g.uuid == u) {
                    None => {
                        return Err((
                            Refusal::UnknownGpu,
                            Status::failed_precondition(format!("GPU {u} is not on this node")),
                        ));
                    }
                    Some(g) if g.unhealthy.is_some() => {
                        return Err((
                            Refusal::UnhealthyGpu,
                            Status::failed_precondition(format!(
                                "GPU {u} is unhealthy ({})",
                                g.unhealthy.as_deref().unwrap_or("")
                            )),
                        ));
                    }
                    Some(_) => {}
                }
            }
            match claim {
                Claim::Fraction { uuid, units } => plans.push(Planned {
                    container: i,
                    uuid,
                    units: units.into_iter().collect(),
                }),
                Claim::WholeGpus { uuids } => {
                    for uuid in &uuids {
                        plans.push(Planned {
                            container: i,
                            uuid: uuid.clone(),
                            units: (0..ctx.per_gpu).collect(),
                        });
                    }
                    whole.insert(i, uuids);
                }
            }
        }
        let (per_gpu, resource) = (ctx.per_gpu, ctx.resource_name.clone());
        let plans2 = plans.clone();
        let identity_dir = ctx.mounts.host_identity_dir.clone();
        let made = with_admin(&ctx.admin_socket, move |c| {
            create_all(c, &plans2, per_gpu, &resource, &identity_dir)
        })
        .await
        .map_err(|e| {
            let why = match e.admin_kind() {
                Some(AdminErrorKind::Exhausted) => Refusal::Exhausted,
                _ => Refusal::Arbiter,
            };
            (why, arbiter_status(e))
        })?;
        let container_socket = ctx.mounts.container_socket_dir.join(
            ctx.mounts
                .tenant_socket
                .file_name()
                .map(Path::new)
                .unwrap_or(Path::new("tessera.sock")),
        );

        let mut container_responses = Vec::new();
        for i in 0..requests.len() {
            let mine: Vec<(&Planned, &(String, AllocationStatus))> = plans
                .iter()
                .zip(&made)
                .filter(|(p, _)| p.container == i)
                .collect();
            let ids: Vec<&str> = mine.iter().map(|(_, (_, a))| a.id.as_str()).collect();
            // The container's identity: its (first) allocation's token. For whole GPUs it only
            // lets the backstop know the container's processes are entitled to the cards.
            let identity = match mine.first() {
                Some((_, (token, a))) => {
                    let whole_gpus = whole.contains_key(&i);
                    let id = tessera_protocol::identity::Identity {
                        token: token.clone(),
                        socket: (!whole_gpus).then(|| container_socket.clone()),
                        allocation: Some(a.id.clone()),
                    };
                    let written = crate::identity::write(&ctx.mounts.host_identity_dir, &a.id, &id);
                    Some(written.map_err(|e| {
                        (Refusal::Internal, Status::internal(format!("tessera: {e}")))
                    })?)
                }
                None => None,
            };
            if let Some(uuids) = whole.get(&i) {
                // Whole GPUs: the container has the cards to itself; no interposer, no token.
                let envs = BTreeMap::from([
                    (ENV_VISIBLE.to_owned(), uuids.join(",")),
                    (ENV_ALLOCATION.to_owned(), ids.join(",")),
                ]);
                container_responses.push(ContainerAllocateResponse {
                    envs: envs.into_iter().collect(),
                    mounts: identity
                        .iter()
                        .map(|p| mount(Path::new(CONTAINER_IDENTITY_FILE), p))
                        .collect(),
                    ..Default::default()
                });
            } else if let (Some((p, (token, a))), Some(identity)) = (mine.first(), &identity) {
                tracing::info!(
                    "allocation {} on {}: {} units, {} bytes",
                    a.id,
                    p.uuid,
                    p.units.len(),
                    a.memory_limit
                );
                container_responses.push(fraction_response(
                    &ctx.mounts,
                    &p.uuid,
                    token,
                    &a.id,
                    identity,
                ));
            }
        }
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }
}

/// Serves the plugin on `listener` until `stop` turns true.
pub async fn serve(
    listener: UnixListener,
    service: PluginService,
    mut stop: watch::Receiver<bool>,
) -> Result<(), ServerError> {
    tonic::transport::Server::builder()
        .add_service(DevicePluginServer::new(service))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::GpuState;
    use std::sync::Arc;

    #[test]
    fn device_list_marks_unhealthy_and_skips_long_ids() {
        let snap: Snapshot = Arc::new(vec![
            GpuState {
                index: 0,
                uuid: "GPU-a".into(),
                memory_total: 1,
                unhealthy: None,
            },
            GpuState {
                index: 1,
                uuid: "GPU-b".into(),
                memory_total: 1,
                unhealthy: Some("XID 79".into()),
            },
            GpuState {
                index: 2,
                uuid: format!("MIG-{}", "x".repeat(60)),
                memory_total: 1,
                unhealthy: None,
            },
        ]);
        let list = device_list(&snap, 4);
        assert_eq!(list.len(), 8);
        assert_eq!(list[0].id, "GPU-a-0");
        assert!(list[..4].iter().all(|d| d.health == HEALTHY));
        assert!(
            list[4..]
                .iter()
                .all(|d| d.health == UNHEALTHY && d.id.starts_with("GPU-b-"))
        );
    }

    #[test]
    fn fraction_wiring() {
        let m = Mounts {
            tenant_socket: "/run/tessera/tenant/tessera.sock".into(),
            container_socket_dir: "/run/tessera".into(),
            installed: Installed {
                lib_path: "/var/lib/tessera/lib/libtessera_interpose-0.1.0-abcd1234.so".into(),
                preload_path: "/var/lib/tessera/lib/ld.so.preload-0.1.0-abcd1234".into(),
                tag: "0.1.0-abcd1234".into(),
                wrote_lib: false,
            },
            container_lib_path: "/usr/lib/tessera/libtessera_interpose.so".into(),
            host_identity_dir: "/var/lib/tessera/identity".into(),
        };
        let r = fraction_response(
            &m,
            "GPU-a",
            "tok",
            "a1",
            Path::new("/var/lib/tessera/identity/a1.x"),
        );
        assert_eq!(r.envs[ENV_TOKEN], "tok");
        assert_eq!(r.envs[ENV_SOCKET], "/run/tessera/tessera.sock");
        assert_eq!(r.envs[ENV_VISIBLE], "GPU-a");
        assert_eq!(r.mounts.len(), 4);
        assert!(r.mounts.iter().all(|m| m.read_only));
        assert_eq!(r.mounts[1].container_path, "/etc/ld.so.preload");
        assert_eq!(r.mounts[2].host_path, "/run/tessera/tenant");
        assert_eq!(r.mounts[3].container_path, "/etc/tessera/tenant");
        assert_eq!(r.mounts[3].host_path, "/var/lib/tessera/identity/a1.x");
    }
}
