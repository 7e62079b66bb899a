//! The DRA plugin's integration tests, one binary (one link, not one per file); each module
//! was a test binary of its own.
//!
//! - `kubelet`: a stand-in kubelet and API server drive the real plugin and arbiter end to end.
//! - `manifests`: `deploy/dra/` against k8s-openapi and the upstream OpenAPI schemas.

mod kubelet;
mod manifests;
