//! The `DevicePlugin` gRPC service the kubelet calls.
//!
//! - `ListAndWatch`: every healthy GPU as the resource's pool of units (all `per_gpu` of them,
//!   or its part of a latency split); a new full list whenever the GPU snapshot changes (an
//!   XID marks a GPU's units `Unhealthy`, a vanished GPU's units go).
//! - `GetPreferredAllocation`: [`crate::units::preferred`] (one GPU, best fit; whole GPUs above).
//! - `Allocate`: a thin adapter over [`crate::allocate`]: decodes the request, plans, makes
//!   the allocations on the blocking pool over one admin connection, and maps an
//!   [`AllocateError`] to a gRPC status and a refusal reason for the metrics.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use tessera_protocol::AdminErrorKind;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status};

use crate::allocate::{self, AllocateError, Settings};
use crate::metrics::{PluginMetrics, Refusal};
use crate::proto::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use crate::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, Empty, ListAndWatchResponse, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
};
use crate::proto::{HEALTHY, UNHEALTHY};
use crate::units::{self, Pool, UnitsError};
use tessera_node::arbiter::{ArbiterError, with_admin};
use tessera_node::health::Snapshot;

/// Errors of the server.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServerError {
    /// The gRPC server failed.
    #[error("device plugin gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Everything `Allocate` needs.
#[derive(Debug, Clone)]
pub(crate) struct AllocContext {
    /// Units per GPU, resource name, container wiring.
    pub settings: Settings,
    /// Arbiter admin socket.
    pub admin_socket: PathBuf,
    /// Counters of served and refused requests.
    pub metrics: Arc<PluginMetrics>,
}

/// The service; cheap to clone per server generation.
#[derive(Clone)]
pub(crate) struct PluginService {
    ctx: Arc<AllocContext>,
    gpus: watch::Receiver<Snapshot>,
    stop: watch::Receiver<bool>,
}

impl PluginService {
    /// A service over the GPU snapshot channel; streams end when `stop` turns true.
    pub(crate) fn new(
        ctx: Arc<AllocContext>,
        gpus: watch::Receiver<Snapshot>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        Self { ctx, gpus, stop }
    }
}

/// The device list for a snapshot. GPUs whose ids would be too long are left out (logged
/// once by the caller that validates the snapshot).
pub(crate) fn device_list(snapshot: &Snapshot, per_gpu: u32) -> Vec<Device> {
    device_list_in(snapshot, per_gpu, Pool::all(per_gpu))
}

/// [`device_list`] for the units of `pool`.
pub(crate) fn device_list_in(snapshot: &Snapshot, per_gpu: u32, pool: Pool) -> Vec<Device> {
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
        out.extend(pool.ids(&gpu.uuid).into_iter().map(|id| Device {
            id,
            health: health.to_owned(),
            topology: None,
        }));
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
        // The plugin speaks on the admin socket as root; a refusal there is a misconfigured
        // node (the user socket given as --admin-socket), not the pod's fault.
        Some(AdminErrorKind::PermissionDenied) => Status::permission_denied(msg),
        Some(AdminErrorKind::Internal) => Status::internal(msg),
        None => Status::unavailable(msg),
    }
}

/// The refusal metric's reason and the gRPC status for an arbiter failure.
fn arbiter_refusal(e: ArbiterError) -> (Refusal, Status) {
    let why = match e.admin_kind() {
        Some(AdminErrorKind::Exhausted) => Refusal::Exhausted,
        _ => Refusal::Arbiter,
    };
    (why, arbiter_status(e))
}

/// The refusal metric's reason and the gRPC status for a refused `Allocate`; admin call
/// failures name the arbiter at `admin_socket`.
fn refusal(e: AllocateError, admin_socket: &Path) -> (Refusal, Status) {
    match e {
        AllocateError::Units(e) => (Refusal::BadUnits, invalid(e)),
        e @ AllocateError::UnknownGpu(_) => (
            Refusal::UnknownGpu,
            Status::failed_precondition(e.to_string()),
        ),
        e @ AllocateError::UnhealthyGpu { .. } => (
            Refusal::UnhealthyGpu,
            Status::failed_precondition(e.to_string()),
        ),
        AllocateError::Arbiter(source) => {
            arbiter_refusal(ArbiterError::client(admin_socket, source))
        }
        AllocateError::Identity(e) => {
            (Refusal::Internal, Status::internal(format!("tessera: {e}")))
        }
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
        let (per_gpu, pool) = (self.ctx.settings.per_gpu, self.ctx.settings.pool);
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                let devices = device_list_in(&gpus.borrow_and_update().clone(), per_gpu, pool);
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
        let pool = self.ctx.settings.pool;
        for c in request.into_inner().container_requests {
            pool.check(&c.available_device_i_ds).map_err(invalid)?;
            pool.check(&c.must_include_device_i_ds).map_err(invalid)?;
            let ids = units::preferred(
                &c.available_device_i_ds,
                &c.must_include_device_i_ds,
                i64::from(c.allocation_size),
                self.ctx.settings.per_gpu,
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
    /// `Allocate`: plans here (no call, so a bad request is refused even while the arbiter is
    /// down), then makes the allocations on the blocking pool; an error says why, for the
    /// refusal metric.
    async fn allocate_all(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, (Refusal, Status)> {
        let requests: Vec<Vec<String>> = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| c.devices_ids)
            .collect();
        let snapshot = self.gpus.borrow().clone();
        let admin_socket = &self.ctx.admin_socket;
        let settings = &self.ctx.settings;
        let plan = allocate::plan_in(&requests, &snapshot, settings.per_gpu, settings.pool)
            .map_err(|e| refusal(e, admin_socket))?;
        let ctx = self.ctx.clone();
        let made = with_admin(admin_socket, move |c| {
            Ok(allocate::execute(c, &plan, &ctx.settings))
        })
        .await
        .map_err(arbiter_refusal)?;
        let container_responses = made.map_err(|e| refusal(e, admin_socket))?;
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }
}

/// Serves the plugin on `listener` until `stop` turns true.
pub(crate) async fn serve(
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
    use tessera_node::health::GpuState;

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
        // A latency split: each resource lists its own units of each GPU, never the other's.
        let (be, lat) = Pool::split(4, 1);
        let ids = |p| -> Vec<String> {
            device_list_in(&snap, 4, p)
                .into_iter()
                .map(|d| d.id)
                .collect()
        };
        assert_eq!(
            ids(be),
            [
                "GPU-a-0", "GPU-a-1", "GPU-a-2", "GPU-b-0", "GPU-b-1", "GPU-b-2"
            ]
        );
        assert_eq!(ids(lat), ["GPU-a-3", "GPU-b-3"]);
    }

    #[test]
    fn refusals_keep_their_codes_reasons_and_messages() {
        let sock = Path::new("/run/tessera/admin.sock");
        let (why, st) = refusal(AllocateError::UnknownGpu("GPU-z".into()), sock);
        assert_eq!(why, Refusal::UnknownGpu);
        assert_eq!(st.code(), tonic::Code::FailedPrecondition);
        assert_eq!(st.message(), "GPU GPU-z is not on this node");
        let (why, st) = refusal(
            AllocateError::UnhealthyGpu {
                uuid: "GPU-a".into(),
                reason: "XID 79".into(),
            },
            sock,
        );
        assert_eq!(why, Refusal::UnhealthyGpu);
        assert_eq!(st.code(), tonic::Code::FailedPrecondition);
        assert_eq!(st.message(), "GPU GPU-a is unhealthy (XID 79)");
        let units_err = units::classify(&[], 4).unwrap_err();
        let (why, st) = refusal(AllocateError::Units(units_err), sock);
        assert_eq!(why, Refusal::BadUnits);
        assert_eq!(st.code(), tonic::Code::InvalidArgument);
        let full = tessera_protocol::client::ClientError::Admin {
            kind: AdminErrorKind::Exhausted,
            message: "no room".into(),
        };
        let (why, st) = refusal(AllocateError::Arbiter(full), sock);
        assert_eq!(why, Refusal::Exhausted);
        assert_eq!(st.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            st.message(),
            "tessera: arbiter at /run/tessera/admin.sock: no room"
        );
        let broken = tessera_protocol::client::ClientError::Unexpected("x".into());
        let (why, st) = refusal(AllocateError::Arbiter(broken), sock);
        assert_eq!(why, Refusal::Arbiter);
        assert_eq!(st.code(), tonic::Code::Unavailable);
        let io = tessera_node::identity::IdentityError::Random("none".into());
        let (why, st) = refusal(AllocateError::Identity(io), sock);
        assert_eq!(why, Refusal::Internal);
        assert_eq!(st.code(), tonic::Code::Internal);
    }
}
