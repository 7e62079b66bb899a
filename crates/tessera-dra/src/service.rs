//! The gRPC services: `DRAPlugin` (prepare and unprepare, thin over [`crate::prepare`]) in
//! `dra/v1` and, converted to it, `dra/v1beta1` ([`DraV1beta1`]); and `Registration` (what the
//! kubelet's plugin watcher asks through the registration socket).
//!
//! Prepares, unprepares and the unprepares of the clean-up of claims nothing uses
//! ([`DraService::release_unused`], rules in [`crate::cleanup`]) run one at a time (a lock):
//! each lists the arbiter's allocations and sweeps identity files of deleted ones, which must
//! not race a neighbour's prepare.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tessera_protocol::client::AdminClient;
use tokio::sync::{Mutex, watch};
use tonic::{Request, Response, Status};

use crate::apiserver::KubeApi;
use crate::claim::{self, DRIVER, NodeGpu};
use crate::cleanup::{self, Lookup, Release};
use crate::prepare::{self, ClaimRef, PrepareError, PreparedDevice, Settings};
use crate::proto::dra::dra_plugin_server::DraPlugin;
use crate::proto::dra::{
    Claim, Device, NodePrepareResourceResponse, NodePrepareResourcesRequest,
    NodePrepareResourcesResponse, NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest,
    NodeUnprepareResourcesResponse,
};
use crate::proto::dra_v1beta1 as beta;
use crate::proto::registration::registration_server::Registration;
use crate::proto::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use crate::proto::{DRA_V1_SERVICE, DRA_V1BETA1_SERVICE, PLUGIN_TYPE};
use crate::slices::GpuAttrs;

/// What the DRA service works with.
pub(crate) struct DraService {
    /// The API server.
    pub api: Arc<dyn KubeApi>,
    /// The arbiter's admin socket.
    pub admin_socket: PathBuf,
    /// Files and wiring.
    pub settings: Settings,
    /// This node's pool name (the node name).
    pub pool: String,
    /// The node's GPUs as published.
    pub gpus: watch::Receiver<Arc<Vec<GpuAttrs>>>,
    /// Memory of a fraction whose result names none.
    pub default_memory: u64,
    /// One prepare or unprepare at a time.
    pub lock: Mutex<()>,
}

impl DraService {
    fn node_gpus(&self) -> Vec<NodeGpu> {
        crate::slices::node_devices(&self.gpus.borrow())
    }

    /// Prepares one claim; the error is the per-claim message the kubelet shows.
    async fn prepare_one(&self, c: &Claim) -> Result<Vec<PreparedDevice>, String> {
        claim::check_ref(&c.namespace, &c.name, &c.uid).map_err(|e| format!("{DRIVER}: {e}"))?;
        let obj = self
            .api
            .get_claim(&c.namespace, &c.name)
            .await
            .map_err(|e| e.to_string())?;
        let plans = claim::plan(
            &obj,
            &c.uid,
            &self.pool,
            &self.node_gpus(),
            self.default_memory,
        )
        .map_err(|e| format!("{DRIVER}: {e}"))?;
        let (ns, name, uid, settings, admin) = (
            c.namespace.clone(),
            c.name.clone(),
            c.uid.clone(),
            self.settings.clone(),
            self.admin_socket.clone(),
        );
        blocking(admin, move |a| {
            let r = ClaimRef {
                namespace: &ns,
                name: &name,
                uid: &uid,
            };
            prepare::prepare(a, r, &plans, &settings)
        })
        .await
    }
}

/// Runs `f` with a fresh admin connection on the blocking pool (the client is blocking).
async fn blocking<T: Send + 'static>(
    admin: PathBuf,
    f: impl FnOnce(&mut AdminClient) -> Result<T, PrepareError> + Send + 'static,
) -> Result<T, String> {
    let shown = admin.display().to_string();
    tokio::task::spawn_blocking(move || {
        let mut client = AdminClient::connect(&admin).map_err(PrepareError::from)?;
        f(&mut client)
    })
    .await
    .map_err(|e| format!("prepare task failed: {e}"))?
    .map_err(|e| format!("{DRIVER} (arbiter at {shown}): {e}"))
}

impl DraService {
    /// Unprepares every claim this plugin prepared that nothing uses any more (deleted,
    /// re-created, or reserved by no pod: [`cleanup::verdict`]); claims the API server gives
    /// no definite answer about are kept. Returns the released claims' uids with the reason.
    pub(crate) async fn release_unused(&self) -> Result<Vec<(String, Release)>, String> {
        // The API reads run without the lock (an API server that times out must not hold up
        // the kubelet's prepares); a claim found unreserved is read again under it, since a
        // new pod may reserve and prepare it in between. Deleted or re-created claims stay so.
        let all = blocking(self.admin_socket.clone(), |a| {
            tessera_node::arbiter::Arbiter::list(a).map_err(PrepareError::from)
        })
        .await?;
        let mut stale = Vec::new();
        for c in cleanup::prepared_claims(&all) {
            if let Some(why) = self.check(&c).await {
                stale.push((c, why));
            }
        }
        let mut released = Vec::new();
        if stale.is_empty() {
            return Ok(released);
        }
        let _guard = self.lock.lock().await;
        for (c, first) in stale {
            let why = match first {
                Release::NoConsumer | Release::Deallocated => match self.check(&c).await {
                    Some(why) => why,
                    None => continue,
                },
                why => why,
            };
            let (uid, settings) = (c.uid.clone(), self.settings.clone());
            match blocking(self.admin_socket.clone(), move |a| {
                prepare::unprepare(a, &uid, &settings)
            })
            .await
            {
                Ok(n) => {
                    tracing::info!(
                        "released claim {}/{} ({}): {why}; {n} allocations deleted",
                        c.namespace,
                        c.name,
                        c.uid
                    );
                    released.push((c.uid, why));
                }
                Err(e) => tracing::warn!(
                    "releasing claim {}/{} ({}): {e}",
                    c.namespace,
                    c.name,
                    c.uid
                ),
            }
        }
        Ok(released)
    }

    /// [`cleanup::verdict`] of prepared claim `c` as the API server shows it now.
    async fn check(&self, c: &cleanup::PreparedClaim) -> Option<Release> {
        let got = self.api.get_claim(&c.namespace, &c.name).await;
        let lookup = match &got {
            Ok(obj) => Lookup::Found(obj),
            Err(e) if e.is_not_found() => Lookup::NotFound,
            Err(e) => {
                tracing::warn!(
                    "claim check {}/{}: {e}; kept until a definite answer",
                    c.namespace,
                    c.name
                );
                Lookup::Failed
            }
        };
        cleanup::verdict(&c.uid, lookup)
    }
}

#[tonic::async_trait]
impl DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        req: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let _guard = self.lock.lock().await;
        let mut claims = HashMap::new();
        for c in req.into_inner().claims {
            let answer = match self.prepare_one(&c).await {
                Ok(devs) => NodePrepareResourceResponse {
                    devices: devs
                        .into_iter()
                        .map(|d| Device {
                            request_names: vec![d.request],
                            pool_name: d.pool,
                            device_name: d.device,
                            cdi_device_ids: d.cdi_ids,
                            share_id: d.share_id,
                        })
                        .collect(),
                    error: String::new(),
                },
                Err(error) => {
                    tracing::warn!("prepare {}/{} ({}): {error}", c.namespace, c.name, c.uid);
                    NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    }
                }
            };
            claims.insert(c.uid, answer);
        }
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let _guard = self.lock.lock().await;
        let mut claims = HashMap::new();
        for c in req.into_inner().claims {
            let (uid, settings) = (c.uid.clone(), self.settings.clone());
            let res = match claim::check_ref(&c.namespace, &c.name, &c.uid) {
                Err(e) => Err(format!("{DRIVER}: {e}")),
                Ok(()) => {
                    blocking(self.admin_socket.clone(), move |a| {
                        prepare::unprepare(a, &uid, &settings)
                    })
                    .await
                }
            };
            let error = match res {
                Ok(n) => {
                    tracing::info!(
                        "unprepared {}/{} ({}): {n} allocations",
                        c.namespace,
                        c.name,
                        c.uid
                    );
                    String::new()
                }
                Err(e) => {
                    tracing::warn!("unprepare {}/{} ({}): {e}", c.namespace, c.name, c.uid);
                    e
                }
            };
            claims.insert(c.uid, NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

/// `dra/v1beta1`: the same calls as `v1` (which was copied from it), without `share_id` in
/// the answer; each request is converted and served by the `v1` implementation.
pub(crate) struct DraV1beta1(pub Arc<DraService>);

fn claims_v1(claims: Vec<beta::Claim>) -> Vec<Claim> {
    claims
        .into_iter()
        .map(|c| Claim {
            namespace: c.namespace,
            uid: c.uid,
            name: c.name,
        })
        .collect()
}

#[tonic::async_trait]
impl beta::dra_plugin_server::DraPlugin for DraV1beta1 {
    async fn node_prepare_resources(
        &self,
        req: Request<beta::NodePrepareResourcesRequest>,
    ) -> Result<Response<beta::NodePrepareResourcesResponse>, Status> {
        let v1 = NodePrepareResourcesRequest {
            claims: claims_v1(req.into_inner().claims),
        };
        let out = DraPlugin::node_prepare_resources(&*self.0, Request::new(v1)).await?;
        let claims = out
            .into_inner()
            .claims
            .into_iter()
            .map(|(uid, r)| {
                let devices = r
                    .devices
                    .into_iter()
                    .map(|d| beta::Device {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                    })
                    .collect();
                (
                    uid,
                    beta::NodePrepareResourceResponse {
                        devices,
                        error: r.error,
                    },
                )
            })
            .collect();
        Ok(Response::new(beta::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<beta::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<beta::NodeUnprepareResourcesResponse>, Status> {
        let v1 = NodeUnprepareResourcesRequest {
            claims: claims_v1(req.into_inner().claims),
        };
        let out = DraPlugin::node_unprepare_resources(&*self.0, Request::new(v1)).await?;
        let claims = out
            .into_inner()
            .claims
            .into_iter()
            .map(|(uid, r)| (uid, beta::NodeUnprepareResourceResponse { error: r.error }))
            .collect();
        Ok(Response::new(beta::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

/// The `Registration` service on the registration socket.
pub(crate) struct RegistrationService {
    /// The plugin socket's absolute path (the kubelet dials it).
    pub endpoint: PathBuf,
    /// The kubelet's verdict, once it sends one.
    pub status: watch::Sender<Option<RegistrationStatus>>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_owned(),
            name: DRIVER.to_owned(),
            endpoint: self.endpoint.display().to_string(),
            // The kubelet takes the first entry it knows (pkg/kubelet/cm/dra/plugin/
            // dra_plugin_manager.go, validateSupportedServices): v1 on 1.34+, v1beta1 before.
            supported_versions: vec![DRA_V1_SERVICE.to_owned(), DRA_V1BETA1_SERVICE.to_owned()],
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let st = req.into_inner();
        if st.plugin_registered {
            tracing::info!("registered with the kubelet");
        } else {
            tracing::error!("the kubelet refused the registration: {}", st.error);
        }
        let _ = self.status.send(Some(st));
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kubelet's choice among `supported_versions` (k8s.io/kubernetes v1.36.3
    /// `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`, `validateSupportedServices`): the first
    /// of the plugin's entries that the kubelet speaks (`servicesSupportedByKubelet` in
    /// `dra_plugin.go`), none if none is.
    fn kubelet_choice<'a>(plugin: &'a [String], kubelet: &[&str]) -> Option<&'a str> {
        plugin
            .iter()
            .map(String::as_str)
            .find(|s| kubelet.contains(s))
    }

    fn registration() -> (
        RegistrationService,
        watch::Receiver<Option<RegistrationStatus>>,
    ) {
        let (status, rx) = watch::channel(None);
        let svc = RegistrationService {
            endpoint: "/var/lib/kubelet/plugins/gpu.tessera.dev/dra.sock".into(),
            status,
        };
        (svc, rx)
    }

    #[test]
    fn advertised_names_are_the_kubelets_and_the_served_paths_are_the_ones_it_calls() {
        use crate::proto::dra::dra_plugin_server::DraPluginServer;
        use crate::proto::dra_v1beta1::dra_plugin_server::DraPluginServer as BetaServer;
        use crate::proto::registration::registration_server::RegistrationServer;
        use crate::proto::{
            DRA_V1_GRPC_SERVICE, DRA_V1BETA1_GRPC_SERVICE, REGISTRATION_GRPC_SERVICE,
        };
        use tonic::server::NamedService;
        // The kubelet's constants, copied from k8s.io/kubelet v0.36.3.
        assert_eq!(DRA_V1_SERVICE, "v1.DRAPlugin");
        assert_eq!(DRA_V1BETA1_SERVICE, "v1beta1.DRAPlugin");
        // What tonic serves, from the vendored protos' packages: the kubelet's full method
        // paths (`/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources`, ...).
        assert_eq!(
            <DraPluginServer<DraService> as NamedService>::NAME,
            DRA_V1_GRPC_SERVICE
        );
        assert_eq!(
            <BetaServer<DraV1beta1> as NamedService>::NAME,
            DRA_V1BETA1_GRPC_SERVICE
        );
        assert_eq!(
            <RegistrationServer<RegistrationService> as NamedService>::NAME,
            REGISTRATION_GRPC_SERVICE
        );
        // Each advertised name is the last package component and the service of one served.
        for (advertised, served) in [
            (DRA_V1_SERVICE, DRA_V1_GRPC_SERVICE),
            (DRA_V1BETA1_SERVICE, DRA_V1BETA1_GRPC_SERVICE),
        ] {
            let tail: Vec<&str> = served.rsplitn(3, '.').take(2).collect();
            assert_eq!(advertised, format!("{}.{}", tail[1], tail[0]));
        }
    }

    #[tokio::test]
    async fn get_info_is_what_the_kubelets_plugin_manager_accepts() {
        let (svc, _) = registration();
        let info = svc
            .get_info(Request::new(InfoRequest {}))
            .await
            .unwrap()
            .into_inner();
        // pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go: the handler is
        // picked by type, validated and registered under the name, dialled at the endpoint.
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, "gpu.tessera.dev");
        assert_eq!(
            info.endpoint,
            "/var/lib/kubelet/plugins/gpu.tessera.dev/dra.sock"
        );
        // A 1.34+ kubelet picks v1; an older one (v1beta1 only) still finds its service.
        let now = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];
        assert_eq!(
            kubelet_choice(&info.supported_versions, &now),
            Some("v1.DRAPlugin")
        );
        assert_eq!(
            kubelet_choice(&info.supported_versions, &["v1beta1.DRAPlugin"]),
            Some("v1beta1.DRAPlugin")
        );
    }

    #[tokio::test]
    async fn the_kubelets_verdict_is_answered_and_kept() {
        let (svc, rx) = registration();
        for (ok, error) in [(false, "no handler"), (true, "")] {
            let st = RegistrationStatus {
                plugin_registered: ok,
                error: error.into(),
            };
            svc.notify_registration_status(Request::new(st.clone()))
                .await
                .unwrap();
            assert_eq!(rx.borrow().as_ref(), Some(&st));
        }
    }
}
