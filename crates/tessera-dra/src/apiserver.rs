//! The few API server calls the plugin makes, as plain HTTP/1.1 + JSON over k8s-openapi's
//! `resource.k8s.io/v1` types: get a ResourceClaim; list, create, update and delete this
//! node's ResourceSlices.
//!
//! kube-rs would bring a large dependency tree (and its TLS stack) to a 2-call client; this
//! one speaks plain HTTP to a base URL, with an optional bearer token. In a cluster the URL is
//! a `kubectl proxy` sidecar on the pod's loopback (`deploy/dra/`), which holds the service
//! account's credentials and TLS; TLS straight to the API server is not implemented.

use std::path::PathBuf;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::List;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};

/// How long one API call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of an API call.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The base URL is not `http://host:port[/prefix]`.
    #[error(
        "API server URL {0:?}: only http://HOST:PORT[/PATH] is supported (use a kubectl proxy sidecar for TLS)"
    )]
    Url(String),
    /// Could not connect or the connection broke.
    #[error("API server {url}: {message}")]
    Transport {
        /// Base URL.
        url: String,
        /// Cause.
        message: String,
    },
    /// No answer in time.
    #[error("API server {0}: no answer within {CALL_TIMEOUT:?}")]
    Timeout(String),
    /// The object does not exist.
    #[error("{0} not found")]
    NotFound(String),
    /// A conflict (an update with a stale resourceVersion, a create of an existing name).
    #[error("{0}: conflict")]
    Conflict(String),
    /// Another error status.
    #[error("{what}: HTTP {status}: {body}")]
    Status {
        /// Request.
        what: String,
        /// Status code.
        status: u16,
        /// Body (the API server's Status message).
        body: String,
    },
    /// A body that is not the expected JSON.
    #[error("{what}: bad JSON: {source}")]
    Json {
        /// Request.
        what: String,
        /// Cause.
        source: serde_json::Error,
    },
    /// The token file could not be read.
    #[error("token file {path}: {source}")]
    Token {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
}

/// A client for one API server.
#[derive(Debug, Clone)]
pub struct ApiClient {
    url: String,
    authority: String,
    prefix: String,
    token_file: Option<PathBuf>,
}

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

impl ApiClient {
    /// A client for `url` (`http://host:port[/prefix]`); each call reads `token_file` (a
    /// projected token rotates) if given.
    pub fn new(url: &str, token_file: Option<PathBuf>) -> Result<Self, ApiError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| ApiError::Url(url.to_owned()))?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() || !authority.contains(':') {
            return Err(ApiError::Url(url.to_owned()));
        }
        Ok(Self {
            url: url.to_owned(),
            authority: authority.to_owned(),
            prefix: prefix.to_owned(),
            token_file: token_file.clone(),
        })
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), ApiError> {
        let transport = |e: &dyn std::error::Error| ApiError::Transport {
            url: self.url.clone(),
            message: tessera_device_plugin::kubelet::error_chain(e),
        };
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.prefix))
            .header(hyper::header::HOST, &self.authority)
            .header(hyper::header::ACCEPT, "application/json");
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        if let Some(p) = &self.token_file {
            let token = std::fs::read_to_string(p).map_err(|source| ApiError::Token {
                path: p.clone(),
                source,
            })?;
            req = req.header(
                hyper::header::AUTHORIZATION,
                format!("Bearer {}", token.trim()),
            );
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| transport(&e))?;
        let fut = async {
            let stream = tokio::net::TcpStream::connect(&self.authority)
                .await
                .map_err(|e| transport(&e))?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| transport(&e))?;
            let conn = tokio::spawn(conn);
            let resp = send.send_request(req).await.map_err(|e| transport(&e))?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| transport(&e))?
                .to_bytes();
            conn.abort();
            Ok((status, bytes))
        };
        tokio::time::timeout(CALL_TIMEOUT, fut)
            .await
            .map_err(|_| ApiError::Timeout(self.url.clone()))?
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ApiError> {
        let (status, bytes) = self.call(method, path, body).await?;
        check(what, status, &bytes)?;
        serde_json::from_slice(&bytes).map_err(|source| ApiError::Json {
            what: what.to_owned(),
            source,
        })
    }

    /// The ResourceClaim `namespace/name`.
    pub async fn get_claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ApiError> {
        let path = format!("/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}");
        self.json(
            &format!("resourceclaim {namespace}/{name}"),
            Method::GET,
            &path,
            None,
        )
        .await
    }

    /// The ResourceSlices of `driver` on `node`.
    pub async fn list_slices(
        &self,
        driver: &str,
        node: &str,
    ) -> Result<Vec<ResourceSlice>, ApiError> {
        let path =
            format!("{SLICES}?fieldSelector=spec.driver%3D{driver}%2Cspec.nodeName%3D{node}");
        let list: List<ResourceSlice> = self
            .json("list resourceslices", Method::GET, &path, None)
            .await?;
        Ok(list.items)
    }

    /// Creates `slice`.
    pub async fn create_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        let body = serde_json::to_vec(slice).map_err(|source| ApiError::Json {
            what: "create resourceslice".into(),
            source,
        })?;
        self.json("create resourceslice", Method::POST, SLICES, Some(body))
            .await
    }

    /// Replaces `slice` (its `metadata.resourceVersion` must be current).
    pub async fn update_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        let name = slice.metadata.name.clone().unwrap_or_default();
        let what = format!("update resourceslice {name}");
        let body = serde_json::to_vec(slice).map_err(|source| ApiError::Json {
            what: what.clone(),
            source,
        })?;
        self.json(&what, Method::PUT, &format!("{SLICES}/{name}"), Some(body))
            .await
    }

    /// Deletes slice `name`; absent is fine.
    pub async fn delete_slice(&self, name: &str) -> Result<(), ApiError> {
        let what = format!("delete resourceslice {name}");
        let (status, bytes) = self
            .call(Method::DELETE, &format!("{SLICES}/{name}"), None)
            .await?;
        match check(&what, status, &bytes) {
            Ok(()) | Err(ApiError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

fn check(what: &str, status: StatusCode, body: &[u8]) -> Result<(), ApiError> {
    match status {
        s if s.is_success() => Ok(()),
        StatusCode::NOT_FOUND => Err(ApiError::NotFound(what.to_owned())),
        StatusCode::CONFLICT => Err(ApiError::Conflict(what.to_owned())),
        s => Err(ApiError::Status {
            what: what.to_owned(),
            status: s.as_u16(),
            body: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_http_urls_are_taken() {
        let c = ApiClient::new("http://127.0.0.1:8001", None).unwrap();
        assert_eq!(
            (c.authority.as_str(), c.prefix.as_str()),
            ("127.0.0.1:8001", "")
        );
        let c = ApiClient::new("http://proxy:8001/k8s/", None).unwrap();
        assert_eq!(c.prefix, "/k8s");
        for bad in [
            "https://kubernetes.default.svc",
            "http://",
            "127.0.0.1:8001",
            "http://host",
        ] {
            assert!(
                matches!(ApiClient::new(bad, None), Err(ApiError::Url(_))),
                "{bad}"
            );
        }
    }
}
