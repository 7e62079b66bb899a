//! The few API server calls the plugin makes, behind the small [`KubeApi`] trait: get a
//! ResourceClaim; list, create, replace and delete this node's ResourceSlices.
//!
//! [`KubeClient`] implements it with kube-rs (`kube::Api<ResourceClaim>`,
//! `kube::Api<ResourceSlice>`, k8s-openapi's `resource.k8s.io/v1` types). Where it connects
//! ([`Connection`]): in a pod, the service account (`KUBERNETES_SERVICE_HOST`, its token and CA,
//! TLS); else a kubeconfig file; else a plain URL (the tests' stand-in API server speaks plain
//! HTTP), optionally with a bearer token file.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// How long one API call may take to connect, and then to answer.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of an API call.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No configuration to reach the API server.
    #[error("API server configuration: {0}")]
    Config(String),
    /// The object does not exist.
    #[error("{0} not found")]
    NotFound(String),
    /// A conflict (a replace with a stale resourceVersion, a create of an existing name).
    #[error("{0}: conflict")]
    Conflict(String),
    /// The API server answered with another error status.
    #[error("{what}: HTTP {code}: {message}")]
    Status {
        /// Request.
        what: String,
        /// Status code.
        code: u16,
        /// The API server's Status message.
        message: String,
    },
    /// Could not connect, no answer in time, or an answer that is not the expected JSON.
    #[error("{what}: {message}")]
    Transport {
        /// Request.
        what: String,
        /// Cause (the error chain).
        message: String,
    },
}

impl ApiError {
    fn from_kube(what: String, e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) if s.code == 404 => ApiError::NotFound(what),
            kube::Error::Api(s) if s.code == 409 => ApiError::Conflict(what),
            kube::Error::Api(s) => ApiError::Status {
                what,
                code: s.code,
                message: s.message,
            },
            other => ApiError::Transport {
                what,
                message: tessera_device_plugin::kubelet::error_chain(&other),
            },
        }
    }

    /// Whether the API server said the object does not exist (a definite answer, unlike a
    /// transport error or a refusal).
    pub fn is_not_found(&self) -> bool {
        matches!(self, ApiError::NotFound(_))
    }
}

/// What the plugin asks of the API server. [`KubeClient`] in the binary; tests may fake it.
#[tonic::async_trait]
pub trait KubeApi: Send + Sync {
    /// The ResourceClaim `namespace/name`.
    async fn get_claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ApiError>;
    /// The ResourceSlices of `driver` on `node`.
    async fn list_slices(&self, driver: &str, node: &str) -> Result<Vec<ResourceSlice>, ApiError>;
    /// Creates `slice`.
    async fn create_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError>;
    /// Replaces `slice` (its `metadata.resourceVersion` must be current).
    async fn replace_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError>;
    /// Deletes slice `name`; absent is fine.
    async fn delete_slice(&self, name: &str) -> Result<(), ApiError>;
}

/// Where the API server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Connection {
    /// The pod's service account: `KUBERNETES_SERVICE_HOST`/`_PORT`, the token and CA under
    /// `/var/run/secrets/kubernetes.io/serviceaccount/` (the token file is re-read as it
    /// rotates).
    InCluster,
    /// A kubeconfig file (its current context).
    Kubeconfig(PathBuf),
    /// A URL (`http://` or `https://`), with a bearer token file if given.
    Url {
        /// Base URL.
        url: String,
        /// Token file, re-read on each call.
        token_file: Option<PathBuf>,
    },
}

/// The kube-rs client.
#[derive(Clone)]
pub struct KubeClient {
    client: kube::Client,
    what: String,
}

impl std::fmt::Debug for KubeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KubeClient({})", self.what)
    }
}

impl KubeClient {
    /// A client for `conn`. Must run inside a Tokio runtime (kube-rs starts its connection
    /// pool there).
    pub async fn connect(conn: &Connection) -> Result<Self, ApiError> {
        let cfg_err = |e: &dyn std::error::Error| {
            ApiError::Config(tessera_device_plugin::kubelet::error_chain(e))
        };
        let mut config = match conn {
            Connection::InCluster => kube::Config::incluster().map_err(|e| cfg_err(&e))?,
            Connection::Kubeconfig(path) => {
                let kc = Kubeconfig::read_from(path).map_err(|e| {
                    ApiError::Config(format!(
                        "{}: {}",
                        path.display(),
                        tessera_device_plugin::kubelet::error_chain(&e)
                    ))
                })?;
                kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| cfg_err(&e))?
            }
            Connection::Url { url, token_file } => {
                let uri: http::Uri = url
                    .parse()
                    .map_err(|e| ApiError::Config(format!("API server URL {url:?}: {e}")))?;
                if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
                    return Err(ApiError::Config(format!(
                        "API server URL {url:?}: expected http(s)://HOST[:PORT]"
                    )));
                }
                let mut c = kube::Config::new(uri);
                c.auth_info.token_file = token_file.as_ref().map(|p| p.display().to_string());
                c
            }
        };
        config.connect_timeout = Some(CALL_TIMEOUT);
        config.read_timeout = Some(CALL_TIMEOUT);
        config.write_timeout = Some(CALL_TIMEOUT);
        let what = config.cluster_url.to_string();
        let client = kube::Client::try_from(config).map_err(|e| cfg_err(&e))?;
        Ok(Self { client, what })
    }

    fn slices(&self) -> Api<ResourceSlice> {
        Api::all(self.client.clone())
    }
}

#[tonic::async_trait]
impl KubeApi for KubeClient {
    async fn get_claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ApiError> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
        api.get(name)
            .await
            .map_err(|e| ApiError::from_kube(format!("resourceclaim {namespace}/{name}"), e))
    }

    async fn list_slices(&self, driver: &str, node: &str) -> Result<Vec<ResourceSlice>, ApiError> {
        let lp =
            ListParams::default().fields(&format!("spec.driver={driver},spec.nodeName={node}"));
        let list = self
            .slices()
            .list(&lp)
            .await
            .map_err(|e| ApiError::from_kube("list resourceslices".into(), e))?;
        Ok(list.items)
    }

    async fn create_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        self.slices()
            .create(&PostParams::default(), slice)
            .await
            .map_err(|e| ApiError::from_kube("create resourceslice".into(), e))
    }

    async fn replace_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        let name = slice.metadata.name.clone().unwrap_or_default();
        self.slices()
            .replace(&name, &PostParams::default(), slice)
            .await
            .map_err(|e| ApiError::from_kube(format!("replace resourceslice {name}"), e))
    }

    async fn delete_slice(&self, name: &str) -> Result<(), ApiError> {
        match self
            .slices()
            .delete(name, &DeleteParams::default())
            .await
            .map_err(|e| ApiError::from_kube(format!("delete resourceslice {name}"), e))
        {
            Ok(_) | Err(ApiError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn urls_must_be_http_or_https_with_a_host() {
        let ok = Connection::Url {
            url: "http://127.0.0.1:8001".into(),
            token_file: None,
        };
        assert!(KubeClient::connect(&ok).await.is_ok());
        for bad in ["127.0.0.1:8001", "ftp://host", "http://", "not a url"] {
            let c = Connection::Url {
                url: bad.into(),
                token_file: None,
            };
            assert!(
                matches!(KubeClient::connect(&c).await, Err(ApiError::Config(_))),
                "{bad}"
            );
        }
    }

    #[tokio::test]
    async fn https_builds_the_tls_stack_and_a_dead_server_is_a_transport_error() {
        // Port 1 on loopback: nothing listens. The TLS client (rustls with ring) is built, and
        // the call fails as a transport error, never as "not found" (which would release
        // claims).
        let c = Connection::Url {
            url: "https://127.0.0.1:1".into(),
            token_file: None,
        };
        let api = KubeClient::connect(&c).await.unwrap();
        let e = api.get_claim("ns", "c").await.unwrap_err();
        assert!(matches!(e, ApiError::Transport { .. }), "{e:?}");
        assert!(!e.is_not_found());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kubeconfig_reaches_the_stand_in_api_server() {
        let server = tessera_testkit::FakeApiServer::start();
        let dir = tempfile::tempdir().unwrap();
        let kc = dir.path().join("kubeconfig");
        std::fs::write(
            &kc,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: test\n\
                 clusters: [{{name: stand-in, cluster: {{server: \"{}\"}}}}]\n\
                 users: [{{name: plugin, user: {{token: secret-token}}}}]\n\
                 contexts: [{{name: test, context: {{cluster: stand-in, user: plugin}}}}]\n",
                server.url()
            ),
        )
        .unwrap();
        let api = KubeClient::connect(&Connection::Kubeconfig(kc))
            .await
            .unwrap();
        assert!(
            api.list_slices("gpu.tessera.dev", "node-a")
                .await
                .unwrap()
                .is_empty()
        );
        let e = api.get_claim("team-a", "missing").await.unwrap_err();
        assert!(e.is_not_found(), "{e:?}");
        assert!(
            server
                .state()
                .requests
                .iter()
                .any(|r| r.starts_with("GET /apis/resource.k8s.io/v1/resourceslices?")),
            "{:?}",
            server.state().requests
        );
    }

    #[tokio::test]
    async fn a_missing_kubeconfig_is_a_configuration_error() {
        let c = Connection::Kubeconfig("/nonexistent/kubeconfig".into());
        let e = KubeClient::connect(&c).await.unwrap_err();
        assert!(e.to_string().contains("/nonexistent/kubeconfig"), "{e}");
    }
}
