//! Stale allocation clean-up through the kubelet's PodResources API.
//!
//! `Allocate` never learns which pod it serves, and nobody tells the plugin when a pod ends.
//! So the plugin periodically asks the kubelet (`List`) which unit ids running containers
//! hold, and deletes its own arbiter allocations (recognised by their labels) none of whose
//! units is held by anyone, once they have been orphaned for a grace period. The grace covers
//! the moment between `Allocate` and the container showing up in `List`. If the kubelet
//! cannot be asked, nothing is deleted.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tessera_protocol::AllocationStatus;
use tokio::sync::watch;

use crate::arbiter::{ArbiterError, with_admin};
use crate::kubelet::{KubeletError, connect_unix, error_chain};
use crate::proto::podresources::ListPodResourcesRequest;
use crate::proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::units;

/// Errors of the clean-up.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The PodResources socket could not be reached.
    #[error(transparent)]
    Connect(#[from] KubeletError),
    /// `List` failed.
    #[error("PodResources List failed: {0}")]
    List(String),
    /// The arbiter could not be asked or told.
    #[error(transparent)]
    Arbiter(#[from] ArbiterError),
}

/// Clean-up settings.
#[derive(Debug, Clone)]
pub struct StaleConfig {
    /// The kubelet's PodResources socket.
    pub socket: PathBuf,
    /// The arbiter's admin socket.
    pub admin_socket: PathBuf,
    /// Extended resource name whose allocations are ours.
    pub resource_name: String,
    /// How long an allocation must be orphaned before it is deleted.
    pub grace: Duration,
    /// How often to look.
    pub interval: Duration,
}

/// Unit ids of `resource` held by any container, per the kubelet.
pub async fn held_units(
    socket: &std::path::Path,
    resource: &str,
    timeout: Duration,
) -> Result<HashSet<String>, PodResourcesError> {
    let channel = connect_unix(socket, timeout).await?;
    let mut client = PodResourcesListerClient::new(channel);
    let resp = tokio::time::timeout(timeout, client.list(ListPodResourcesRequest {}))
        .await
        .map_err(|_| PodResourcesError::List("timed out".into()))?
        .map_err(|s| PodResourcesError::List(error_chain(&s)))?;
    let mut held = HashSet::new();
    for pod in resp.into_inner().pod_resources {
        for c in pod.containers {
            for d in c
                .devices
                .into_iter()
                .filter(|d| d.resource_name == resource)
            {
                held.extend(d.device_ids);
            }
        }
    }
    Ok(held)
}

/// Remembers since when each of our allocations has been orphaned.
#[derive(Debug, Default)]
pub struct StaleTracker {
    orphan_since: HashMap<String, Instant>,
}

impl StaleTracker {
    /// Updates the record from one look and returns the ids of allocations to delete now.
    pub fn review(
        &mut self,
        allocations: &[AllocationStatus],
        held: &HashSet<String>,
        resource: &str,
        grace: Duration,
        now: Instant,
    ) -> Vec<String> {
        let mut seen = HashSet::new();
        let mut doomed = Vec::new();
        for a in allocations {
            let Some(ids) = units::units_from_labels(&a.labels, resource) else {
                continue;
            };
            seen.insert(a.id.clone());
            if ids.iter().any(|id| held.contains(id)) {
                self.orphan_since.remove(&a.id);
                continue;
            }
            let since = *self.orphan_since.entry(a.id.clone()).or_insert(now);
            if now.duration_since(since) >= grace {
                doomed.push(a.id.clone());
            }
        }
        self.orphan_since.retain(|id, _| seen.contains(id));
        doomed
    }
}

/// One look: ask the kubelet and the arbiter, delete what has been orphaned long enough.
pub async fn sweep(
    cfg: &StaleConfig,
    tracker: &mut StaleTracker,
) -> Result<Vec<String>, PodResourcesError> {
    let held = held_units(&cfg.socket, &cfg.resource_name, Duration::from_secs(5)).await?;
    let allocations = with_admin(&cfg.admin_socket, |c| c.list()).await?;
    let doomed = tracker.review(
        &allocations,
        &held,
        &cfg.resource_name,
        cfg.grace,
        Instant::now(),
    );
    let mut deleted = Vec::new();
    for id in doomed {
        let del = id.clone();
        match with_admin(&cfg.admin_socket, move |c| c.delete(&del)).await {
            Ok(()) => {
                eprintln!(
                    "tessera-device-plugin: deleted stale allocation {id} (no container holds its units)"
                );
                deleted.push(id);
            }
            Err(e) if e.admin_kind() == Some(tessera_protocol::AdminErrorKind::NotFound) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(deleted)
}

/// Sweeps every interval until `stop` turns true. Errors are logged once per change, never
/// fatal: a kubelet or arbiter restart only delays the clean-up.
pub async fn run(cfg: StaleConfig, mut stop: watch::Receiver<bool>) {
    let mut tracker = StaleTracker::default();
    let mut last_err: Option<String> = None;
    loop {
        match sweep(&cfg, &mut tracker).await {
            Ok(_) => last_err = None,
            Err(e) => {
                let msg = e.to_string();
                if last_err.as_deref() != Some(msg.as_str()) {
                    eprintln!("tessera-device-plugin: stale clean-up skipped: {msg}");
                    last_err = Some(msg);
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(cfg.interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const R: &str = "tessera.dev/gpu-shares";

    fn alloc(id: &str, uuid: &str, units: &[u32]) -> AllocationStatus {
        let set: BTreeSet<u32> = units.iter().copied().collect();
        AllocationStatus {
            id: id.into(),
            gpu_index: 0,
            gpu_uuid: uuid.into(),
            memory_limit: 1,
            memory_used: 0,
            processes: 0,
            share: 1,
            cap: None,
            gpu_time_10s_ns: 0,
            labels: units::allocation_labels(R, uuid, &set),
            created_unix: 0,
            enforced: 0,
            gpu_time_total_ns: 0,
            throttled_total_ns: 0,
            oom_refusals: 0,
            leases: 0,
        }
    }

    #[test]
    fn orphans_are_deleted_after_grace_only() {
        let mut t = StaleTracker::default();
        let mut foreign = alloc("x", "GPU-a", &[9]);
        foreign.labels.clear(); // made by the CLI: never ours to delete
        let allocs = vec![
            alloc("a", "GPU-a", &[0, 1]),
            alloc("b", "GPU-a", &[2]),
            foreign,
        ];
        let held: HashSet<String> = ["GPU-a-1".to_string()].into();
        let grace = Duration::from_secs(10);
        let t0 = Instant::now();
        assert!(t.review(&allocs, &held, R, grace, t0).is_empty());
        assert!(
            t.review(&allocs, &held, R, grace, t0 + Duration::from_secs(5))
                .is_empty()
        );
        assert_eq!(
            t.review(&allocs, &held, R, grace, t0 + Duration::from_secs(10)),
            vec!["b"]
        );
        // Held again: the clock restarts.
        let held_b: HashSet<String> = ["GPU-a-1".to_string(), "GPU-a-2".to_string()].into();
        assert!(
            t.review(&allocs, &held_b, R, grace, t0 + Duration::from_secs(11))
                .is_empty()
        );
        assert!(
            t.review(&allocs, &held, R, grace, t0 + Duration::from_secs(12))
                .is_empty()
        );
        assert_eq!(
            t.review(&allocs, &held, R, grace, t0 + Duration::from_secs(22)),
            vec!["b"]
        );
        // Allocations that went away are forgotten.
        t.review(&[], &held, R, grace, t0);
        assert!(t.orphan_since.is_empty());
    }
}
