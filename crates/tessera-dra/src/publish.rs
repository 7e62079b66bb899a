//! Keeps this node's ResourceSlice on the API server equal to [`crate::slices::slice`] of the
//! current GPUs: created when missing, replaced (pool generation + 1) when the GPUs or their
//! health change, strays of this driver and node deleted; deleted on shutdown.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::apiserver::{ApiError, KubeApi};
use crate::claim::DRIVER;
use crate::slices::{self, GpuAttrs};

/// One reconciliation: makes the API server's slices of this node what `gpus` says.
pub async fn sync(
    api: &dyn KubeApi,
    node: &str,
    gpus: &[GpuAttrs],
    default_memory: u64,
) -> Result<(), ApiError> {
    let name = slices::slice_name(node);
    let existing = api.list_slices(DRIVER, node).await?;
    let mut ours = None;
    for s in existing {
        if s.metadata.name.as_deref() == Some(name.as_str()) {
            ours = Some(s);
        } else if let Some(stray) = &s.metadata.name {
            tracing::info!("deleting stray ResourceSlice {stray}");
            api.delete_slice(stray).await?;
        }
    }
    match ours {
        None => {
            api.create_slice(&slices::slice(node, gpus, default_memory, 1))
                .await?;
            tracing::info!("published ResourceSlice {name} ({} GPUs)", gpus.len());
        }
        Some(cur) => {
            let want = slices::slice(node, gpus, default_memory, cur.spec.pool.generation);
            if want.spec != cur.spec {
                let mut next =
                    slices::slice(node, gpus, default_memory, cur.spec.pool.generation + 1);
                next.metadata.resource_version = cur.metadata.resource_version.clone();
                api.replace_slice(&next).await?;
                tracing::info!(
                    "updated ResourceSlice {name} to generation {}",
                    next.spec.pool.generation
                );
            }
        }
    }
    Ok(())
}

/// Reconciles on every change of `gpus` and every `resync` (a slice deleted by someone else
/// comes back), until `stop`; then deletes the slice.
pub async fn run(
    api: Arc<dyn KubeApi>,
    node: String,
    mut gpus: watch::Receiver<Arc<Vec<GpuAttrs>>>,
    default_memory: u64,
    resync: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let current = gpus.borrow_and_update().clone();
        if let Err(e) = sync(api.as_ref(), &node, &current, default_memory).await {
            tracing::warn!("ResourceSlice sync: {e}");
        }
        tokio::select! {
            r = gpus.changed() => if r.is_err() { break },
            () = tokio::time::sleep(resync) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    match api.delete_slice(&slices::slice_name(&node)).await {
        Ok(()) => tracing::info!("deleted ResourceSlice {}", slices::slice_name(&node)),
        Err(e) => tracing::warn!("deleting ResourceSlice: {e}"),
    }
}
