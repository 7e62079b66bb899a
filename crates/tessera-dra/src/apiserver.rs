//! The few API server calls the plugin makes, behind the small [`KubeApi`] trait: get a
//! ResourceClaim; list, create, replace and delete this node's ResourceSlices.
//!
//! [`KubeClient`] implements it with kube-rs (`kube::Api<ResourceClaim>`,
//! `kube::Api<ResourceSlice>`, k8s-openapi's `resource.k8s.io/v1` types). Where it connects
//! ([`Connection`]): in a pod, the service account (`KUBERNETES_SERVICE_HOST`, its token and CA,
//! TLS); else a kubeconfig file; else a plain URL (the tests' stand-in API server speaks plain
//! HTTP), optionally with a bearer token file.
//!
//! A bearer token file, whichever way it is named (the service account's, a kubeconfig's
//! `tokenFile`, `--token-file`), is read as client-go reads one ([`FileToken`]): surrounding
//! whitespace trimmed, re-read every minute, the last good token kept when a re-read fails.
//! kube-rs sends the file's bytes as they are, so a token file ending in a newline (what
//! `echo`, `kubectl create token > file` and most editors write) made every call fail with an
//! invalid `Authorization` header.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderValue;
use http::header::AUTHORIZATION;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// How long one API call may take to connect, and then to answer.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(10);

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
                message: tessera_node::grpc::error_chain(&other),
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
pub(crate) trait KubeApi: Send + Sync {
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
        /// Token file, read as a [`FileToken`].
        token_file: Option<PathBuf>,
    },
}

/// How often a token file is read again: client-go's `NewCachedFileTokenSource` period
/// (k8s.io/client-go `transport/token_source.go`; half the time between the kubelet's refresh
/// of a projected service account token and its expiry).
pub(crate) const TOKEN_REREAD: Duration = Duration::from_secs(60);

/// A bearer token kept in a file, read the way client-go reads one (k8s.io/client-go v0.36.3
/// `transport/token_source.go`, `fileTokenSource.Token`: `strings.TrimSpace`, an empty token is
/// an error; `cachingTokenSource` and `round_trippers.go` `bearerAuthRoundTripper`: re-read
/// when the cached one is [`TOKEN_REREAD`] old, and a failed re-read keeps the last token).
#[derive(Debug)]
pub(crate) struct FileToken {
    path: PathBuf,
    every: Duration,
    /// The `Authorization` value and when the file was last read.
    cached: Mutex<(HeaderValue, Instant)>,
}

impl FileToken {
    /// Reads `path` now (an unreadable or empty file is an error, as in client-go), and again
    /// when the token is `every` old.
    pub(crate) fn new(path: &Path, every: Duration) -> Result<Self, ApiError> {
        let header = Self::read(path).map_err(ApiError::Config)?;
        Ok(Self {
            path: path.to_path_buf(),
            every,
            cached: Mutex::new((header, Instant::now())),
        })
    }

    fn read(path: &Path) -> Result<HeaderValue, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("token file {}: {e}", path.display()))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(format!("token file {}: empty", path.display()));
        }
        let mut v = HeaderValue::try_from(format!("Bearer {token}")).map_err(|_| {
            format!(
                "token file {}: not a token (characters a header cannot carry)",
                path.display()
            )
        })?;
        v.set_sensitive(true);
        Ok(v)
    }

    /// The `Authorization` value to send now.
    pub(crate) fn header(&self) -> HeaderValue {
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if cached.1.elapsed() >= self.every {
            match Self::read(&self.path) {
                Ok(v) => cached.0 = v,
                Err(e) => tracing::warn!("{e}; the last token read is kept"),
            }
            cached.1 = Instant::now();
        }
        cached.0.clone()
    }
}

/// Takes the token file out of `config` into a [`FileToken`], so that kube-rs does not send it
/// untrimmed. A kubeconfig's inline `token` is left to kube-rs (it wins over `tokenFile` there).
fn take_token_file(config: &mut kube::Config) -> Result<Option<Arc<FileToken>>, ApiError> {
    if config.auth_info.token.is_some() {
        return Ok(None);
    }
    match config.auth_info.token_file.take() {
        Some(path) => Ok(Some(Arc::new(FileToken::new(
            Path::new(&path),
            TOKEN_REREAD,
        )?))),
        None => Ok(None),
    }
}

/// The kube-rs client.
#[derive(Clone)]
pub(crate) struct KubeClient {
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
    pub(crate) async fn connect(conn: &Connection) -> Result<Self, ApiError> {
        let cfg_err =
            |e: &dyn std::error::Error| ApiError::Config(tessera_node::grpc::error_chain(e));
        let config = match conn {
            Connection::InCluster => kube::Config::incluster().map_err(|e| cfg_err(&e))?,
            Connection::Kubeconfig(path) => {
                let kc = Kubeconfig::read_from(path).map_err(|e| {
                    ApiError::Config(format!(
                        "{}: {}",
                        path.display(),
                        tessera_node::grpc::error_chain(&e)
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
        Self::from_config(config)
    }

    /// A client for `config` (what [`KubeClient::connect`] made of a [`Connection`]): the call
    /// timeouts, and a token file read as a [`FileToken`].
    pub(crate) fn from_config(mut config: kube::Config) -> Result<Self, ApiError> {
        let cfg_err =
            |e: &dyn std::error::Error| ApiError::Config(tessera_node::grpc::error_chain(e));
        config.connect_timeout = Some(CALL_TIMEOUT);
        config.read_timeout = Some(CALL_TIMEOUT);
        config.write_timeout = Some(CALL_TIMEOUT);
        let what = config.cluster_url.to_string();
        let token = take_token_file(&mut config)?;
        let builder = kube::client::ClientBuilder::try_from(config).map_err(|e| cfg_err(&e))?;
        let client = match token {
            None => builder.build(),
            Some(token) => builder
                .with_layer(&tower::util::MapRequestLayer::new(
                    move |mut req: http::Request<kube::client::Body>| {
                        if !req.headers().contains_key(AUTHORIZATION) {
                            req.headers_mut().insert(AUTHORIZATION, token.header());
                        }
                        req
                    },
                ))
                .build(),
        };
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

    /// Connects every way a token file can be named, all to `server` with the token in `file`:
    /// `--api-server` with `--token-file`, a kubeconfig's `tokenFile`, and the in-cluster
    /// configuration (kube-rs's `Config::incluster` is the cluster URL and the service
    /// account's token file in `auth_info.token_file`, nothing else; its paths are fixed, so the
    /// same shape is built here and goes through the same [`KubeClient::from_config`]).
    async fn every_way_to_a_token_file(
        server: &tessera_testkit::FakeApiServer,
        file: &Path,
    ) -> Vec<(&'static str, Result<KubeClient, ApiError>)> {
        let url = Connection::Url {
            url: server.url(),
            token_file: Some(file.to_path_buf()),
        };
        let kc = file.with_extension("kubeconfig");
        std::fs::write(
            &kc,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: test\n\
                 clusters: [{{name: stand-in, cluster: {{server: \"{}\"}}}}]\n\
                 users: [{{name: plugin, user: {{tokenFile: \"{}\"}}}}]\n\
                 contexts: [{{name: test, context: {{cluster: stand-in, user: plugin}}}}]\n",
                server.url(),
                file.display()
            ),
        )
        .unwrap();
        let mut incluster = kube::Config::new(server.url().parse().unwrap());
        incluster.auth_info.token_file = Some(file.display().to_string());
        vec![
            ("--token-file", KubeClient::connect(&url).await),
            (
                "kubeconfig tokenFile",
                KubeClient::connect(&Connection::Kubeconfig(kc)).await,
            ),
            ("in-cluster", KubeClient::from_config(incluster)),
        ]
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_token_file_ending_in_a_newline_is_sent_trimmed_as_client_go_does() {
        let server = tessera_testkit::FakeApiServer::start();
        server.state().require_token = Some("secret-token".into());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        // What `kubectl create token sa > token` or `echo` leaves: the token and a newline.
        std::fs::write(&file, "secret-token\n").unwrap();
        for (how, api) in every_way_to_a_token_file(&server, &file).await {
            let api = api.unwrap_or_else(|e| panic!("{how}: {e}"));
            let got = api.list_slices("gpu.tessera.dev", "node-a").await;
            assert!(got.is_ok(), "{how}: {got:?}");
        }
        let st = server.state();
        assert_eq!(st.authorizations.len(), 3, "{:?}", st.requests);
        assert!(
            st.authorizations.iter().all(|a| a == "Bearer secret-token"),
            "{:?}",
            st.authorizations
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_empty_or_missing_token_file_is_a_configuration_error() {
        let server = tessera_testkit::FakeApiServer::start();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, " \n").unwrap();
        for (how, api) in every_way_to_a_token_file(&server, &file).await {
            assert!(matches!(api, Err(ApiError::Config(_))), "{how}: {api:?}");
        }
        let missing = dir.path().join("absent");
        let url = Connection::Url {
            url: server.url(),
            token_file: Some(missing),
        };
        let e = KubeClient::connect(&url).await.unwrap_err();
        assert!(e.to_string().contains("absent"), "{e}");
    }

    #[test]
    fn a_token_file_is_read_again_and_a_failed_read_keeps_the_last_token() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "first\n").unwrap();
        let t = FileToken::new(&file, Duration::ZERO).unwrap();
        assert_eq!(t.header(), "Bearer first");
        // Rotated (the kubelet rewrites a projected token before it expires).
        std::fs::write(&file, "  second \r\n").unwrap();
        assert_eq!(t.header(), "Bearer second");
        // Removed or emptied: the last token read is kept, as client-go keeps it.
        std::fs::write(&file, "\n").unwrap();
        assert_eq!(t.header(), "Bearer second");
        std::fs::remove_file(&file).unwrap();
        assert_eq!(t.header(), "Bearer second");
        assert!(t.header().is_sensitive());
        // Not due yet: the file is not read.
        std::fs::write(&file, "third").unwrap();
        let slow = FileToken::new(&file, TOKEN_REREAD).unwrap();
        std::fs::write(&file, "fourth").unwrap();
        assert_eq!(slow.header(), "Bearer third");
    }

    #[tokio::test]
    async fn a_missing_kubeconfig_is_a_configuration_error() {
        let c = Connection::Kubeconfig("/nonexistent/kubeconfig".into());
        let e = KubeClient::connect(&c).await.unwrap_err();
        assert!(e.to_string().contains("/nonexistent/kubeconfig"), "{e}");
    }
}
