//! The device plugin's integration tests, one binary (one link, not one per file); each
//! module was a test file of its own.
//!
//! Modules: [`kubelet`] (a fake kubelet drives the real plugin and arbiter end to end),
//! [`manifests`] and [`helm`] (`deploy/`: the manifests against `k8s-openapi`, the chart with
//! the real Helm and the Kubernetes schemas), [`dashboard`] (the Grafana dashboard against
//! docs/metrics.md), [`doc_commands`] (`.ci/doc_commands.py`, the docs' command checker).

mod dashboard;
mod doc_commands;
mod helm;
mod kubelet;
mod manifests;

use std::path::{Path, PathBuf};

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}
