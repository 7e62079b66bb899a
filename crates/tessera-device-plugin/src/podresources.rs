//! Pod names and stale allocation clean-up through the kubelet's PodResources API.
//!
//! `Allocate` never learns which pod it serves, and nobody tells the plugin when a pod ends.
//! So the plugin periodically asks the kubelet (`List`) which container holds which unit ids.
//! From that it
//! - names each of its arbiter allocations (recognised by their labels) after the container
//!   holding its units: the labels `tessera.dev/namespace`, `tessera.dev/pod` and
//!   `tessera.dev/container`, written through the admin API only when they change, so the
//!   arbiter's metrics and `tessera status` show pods rather than ids;
//! - deletes allocations none of whose units anyone holds, once they have been orphaned for a
//!   grace period (when clean-up is on). The grace covers the moment between `Allocate` and
//!   the container showing up in `List`. If the kubelet cannot be asked, nothing is deleted;
//! - with a latency split, deletes at once the allocations of a container that holds units of
//!   both resources (`Allocate` cannot see it: the kubelet calls it once per resource, without
//!   the pod). Such a container would get whichever resource's identity the kubelet merged
//!   first; with neither allocation left it gets no GPU at all (fail closed).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_protocol::client::ClientError;
use tessera_protocol::{
    AdminErrorKind, AllocationStatus, LABEL_CONTAINER, LABEL_NAMESPACE, LABEL_POD,
};
use tokio::sync::watch;

use crate::metrics::PluginMetrics;
use crate::proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::proto::podresources::{ListPodResourcesRequest, PodResources};
use crate::units;
use tessera_node::arbiter::{Arbiter, ArbiterError, with_admin};
use tessera_node::grpc::{ConnectError, connect_unix, error_chain};

/// Errors of the clean-up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PodResourcesError {
    /// The PodResources socket could not be reached.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// `List` failed.
    #[error("PodResources List failed: {0}")]
    List(String),
    /// The arbiter could not be asked or told.
    #[error(transparent)]
    Arbiter(#[from] ArbiterError),
}

/// Settings of the PodResources poll.
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
    /// Delete orphaned allocations (off: only name pods).
    pub cleanup: bool,
    /// The plugin's other resource, if it serves two (best-effort and latency): a container
    /// must not hold both.
    pub exclusive_with: Option<String>,
}

/// The container holding a unit, per the kubelet.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Holder {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
}

/// The kubelet's `List`: every pod with its containers' devices.
pub(crate) async fn list(
    socket: &std::path::Path,
    timeout: Duration,
) -> Result<Vec<PodResources>, PodResourcesError> {
    let channel = connect_unix(socket, timeout).await?;
    let mut client = PodResourcesListerClient::new(channel);
    let resp = tokio::time::timeout(timeout, client.list(ListPodResourcesRequest {}))
        .await
        .map_err(|_| PodResourcesError::List("timed out".into()))?
        .map_err(|s| PodResourcesError::List(error_chain(&s)))?;
    Ok(resp.into_inner().pod_resources)
}

/// The containers holding devices of both `resource` and `other`.
pub(crate) fn mixed_in(pods: &[PodResources], resource: &str, other: &str) -> HashSet<Holder> {
    let mut out = HashSet::new();
    for pod in pods {
        for c in &pod.containers {
            let has = |r: &str| {
                c.devices
                    .iter()
                    .any(|d| d.resource_name == r && !d.device_ids.is_empty())
            };
            if has(resource) && has(other) {
                out.insert(Holder {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: c.name.clone(),
                });
            }
        }
    }
    out
}

/// The container holding each unit id of `resource` in a `List` answer.
pub(crate) fn holders_in(pods: &[PodResources], resource: &str) -> HashMap<String, Holder> {
    let mut held = HashMap::new();
    for pod in pods {
        for c in &pod.containers {
            let holder = Holder {
                namespace: pod.namespace.clone(),
                pod: pod.name.clone(),
                container: c.name.clone(),
            };
            for d in c.devices.iter().filter(|d| d.resource_name == resource) {
                for id in &d.device_ids {
                    held.insert(id.clone(), holder.clone());
                }
            }
        }
    }
    held
}

/// The label changes that name each of our allocations after the container holding its units,
/// as `(allocation id, labels to merge)`; allocations already named right, not held, or not
/// ours are left out, so an unchanged node costs no admin call. Were a unit set ever split
/// between containers, the container holding most of it (then the first by name) wins.
pub(crate) fn pod_label_updates(
    allocations: &[AllocationStatus],
    held: &HashMap<String, Holder>,
    resource: &str,
) -> Vec<(String, BTreeMap<String, String>)> {
    let mut out = Vec::new();
    for a in allocations {
        let Some(ids) = units::units_from_labels(&a.labels, resource) else {
            continue;
        };
        let mut count: BTreeMap<&Holder, usize> = BTreeMap::new();
        for h in ids.iter().filter_map(|id| held.get(id)) {
            *count.entry(h).or_default() += 1;
        }
        // max_by_key keeps the last maximum; iterate in reverse so the first name wins ties.
        let Some((h, _)) = count.iter().rev().max_by_key(|(_, n)| **n) else {
            continue;
        };
        let want = [
            (LABEL_NAMESPACE, &h.namespace),
            (LABEL_POD, &h.pod),
            (LABEL_CONTAINER, &h.container),
        ];
        if want
            .iter()
            .all(|(k, v)| a.labels.get(*k).map(String::as_str) == Some(v.as_str()))
        {
            continue;
        }
        let labels = want
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).clone()))
            .collect();
        out.push((a.id.clone(), labels));
    }
    out
}

/// Remembers since when each of our allocations has been orphaned.
#[derive(Debug, Default, Clone)]
pub(crate) struct StaleTracker {
    orphan_since: HashMap<String, Instant>,
}

impl StaleTracker {
    /// Updates the record from one look and returns the ids of allocations to delete now.
    pub(crate) fn review(
        &mut self,
        allocations: &[AllocationStatus],
        held: &HashMap<String, Holder>,
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
            if ids.iter().any(|id| held.contains_key(id)) {
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

/// What one look did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Swept {
    /// Allocations whose pod labels were written.
    pub labelled: Vec<String>,
    /// Allocations deleted as stale.
    pub deleted: Vec<String>,
    /// Allocations deleted because their container holds both resources.
    pub mixed: Vec<String>,
}

/// Our allocations any of whose units a container in `mixed` holds.
pub(crate) fn mixed_allocations(
    allocations: &[AllocationStatus],
    held: &HashMap<String, Holder>,
    mixed: &HashSet<Holder>,
    resource: &str,
) -> Vec<String> {
    if mixed.is_empty() {
        return Vec::new();
    }
    allocations
        .iter()
        .filter(|a| {
            units::units_from_labels(&a.labels, resource).is_some_and(|ids| {
                ids.iter()
                    .any(|id| held.get(id).is_some_and(|h| mixed.contains(h)))
            })
        })
        .map(|a| a.id.clone())
        .collect()
}

/// The arbiter's side of one look, given who holds which unit (`held`): names the pods and,
/// when clean-up is on, deletes what has been orphaned for the grace period at `now`. An
/// allocation deleted in between is skipped; any other admin failure ends the look (what was
/// done so far is counted in `metrics`).
pub(crate) fn reconcile<A: Arbiter + ?Sized>(
    arbiter: &mut A,
    held: &HashMap<String, Holder>,
    mixed: &HashSet<Holder>,
    tracker: &mut StaleTracker,
    cfg: &StaleConfig,
    now: Instant,
    metrics: &PluginMetrics,
) -> Result<Swept, ClientError> {
    let resource = cfg.resource_name.as_str();
    let gone = |e: &ClientError| {
        matches!(
            e,
            ClientError::Admin {
                kind: AdminErrorKind::NotFound,
                ..
            }
        )
    };
    let mut allocations = arbiter.list()?;
    let mut swept = Swept::default();
    // A container holding both resources has no one tier: none of its allocations stays,
    // whether clean-up is on or not (this is a refusal, not a clean-up).
    for id in mixed_allocations(&allocations, held, mixed, resource) {
        match arbiter.delete(&id) {
            Ok(()) => {
                tracing::warn!(
                    "deleted allocation {id}: its container asks for both Tessera resources, \
                     and a container gets one tier (request one resource)"
                );
                metrics.mixed_tier_deleted();
                swept.mixed.push(id);
            }
            Err(e) if gone(&e) => {}
            Err(e) => return Err(e),
        }
    }
    allocations.retain(|a| !swept.mixed.contains(&a.id));
    for (id, labels) in pod_label_updates(&allocations, held, resource) {
        match arbiter.update_labels(&id, labels) {
            Ok(_) => {
                metrics.labelled();
                swept.labelled.push(id);
            }
            // Deleted in between: nothing to name.
            Err(e) if gone(&e) => {}
            Err(e) => return Err(e),
        }
    }
    if !cfg.cleanup {
        return Ok(swept);
    }
    for id in tracker.review(&allocations, held, resource, cfg.grace, now) {
        match arbiter.delete(&id) {
            Ok(()) => {
                tracing::info!("deleted stale allocation {id} (no container holds its units)");
                metrics.cleaned_up(1);
                swept.deleted.push(id);
            }
            Err(e) if gone(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(swept)
}

/// One look: ask the kubelet, then [`reconcile`] over one admin connection.
pub(crate) async fn sweep(
    cfg: &StaleConfig,
    tracker: &mut StaleTracker,
    metrics: &Arc<PluginMetrics>,
) -> Result<Swept, PodResourcesError> {
    let pods = list(&cfg.socket, Duration::from_secs(5)).await?;
    let held = holders_in(&pods, &cfg.resource_name);
    let mixed = match &cfg.exclusive_with {
        Some(other) => mixed_in(&pods, &cfg.resource_name, other),
        None => HashSet::new(),
    };
    // The blocking call owns a copy of the tracker; it comes back whenever the arbiter was
    // reached, so a refused connection leaves the record as it was.
    let mut copy = tracker.clone();
    let (owned, metrics) = (cfg.clone(), metrics.clone());
    let now = Instant::now();
    let (copy, res) = with_admin(&cfg.admin_socket, move |c| {
        let res = reconcile(c, &held, &mixed, &mut copy, &owned, now, &metrics);
        Ok((copy, res))
    })
    .await?;
    *tracker = copy;
    res.map_err(|e| ArbiterError::client(&cfg.admin_socket, e).into())
}

/// Sweeps every interval until `stop` turns true. Errors are logged once per change, never
/// fatal: a kubelet or arbiter restart only delays the clean-up.
pub(crate) async fn run(
    cfg: StaleConfig,
    metrics: Arc<PluginMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tracker = StaleTracker::default();
    let mut last_err: Option<String> = None;
    loop {
        match sweep(&cfg, &mut tracker, &metrics).await {
            Ok(_) => last_err = None,
            Err(e) => {
                let msg = e.to_string();
                if last_err.as_deref() != Some(msg.as_str()) {
                    tracing::warn!("PodResources poll skipped: {msg}");
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
    use tessera_node::arbiter::fake::{Call, FakeArbiter};

    const R: &str = "tessera.dev/gpu-shares";

    fn alloc(id: &str, uuid: &str, units: &[u32]) -> AllocationStatus {
        let set: BTreeSet<u32> = units.iter().copied().collect();
        AllocationStatus {
            id: id.into(),
            gpu_index: 0,
            gpu_uuid: uuid.into(),
            memory_limit: 1,
            share: 1,
            labels: units::allocation_labels(R, uuid, &set),
            ..Default::default()
        }
    }

    fn holder(ns: &str, pod: &str, c: &str) -> Holder {
        Holder {
            namespace: ns.into(),
            pod: pod.into(),
            container: c.into(),
        }
    }

    fn holding(ids: &[&str]) -> HashMap<String, Holder> {
        ids.iter()
            .map(|id| (id.to_string(), holder("ns", "p", "c")))
            .collect()
    }

    #[test]
    fn pods_are_named_once_and_renamed_on_change() {
        let mine = alloc("a", "GPU-a", &[0, 1, 2]);
        let mut foreign = alloc("x", "GPU-a", &[5]);
        foreign.labels.clear();
        let orphan = alloc("o", "GPU-a", &[7]);
        let mut held: HashMap<String, Holder> = HashMap::new();
        held.insert("GPU-a-0".into(), holder("team", "train", "main"));
        held.insert("GPU-a-1".into(), holder("team", "train", "main"));
        held.insert("GPU-a-2".into(), holder("team", "other", "side"));
        held.insert("GPU-a-5".into(), holder("team", "foreign", "main"));
        let mut allocs = vec![mine, foreign, orphan];
        let ups = pod_label_updates(&allocs, &held, R);
        assert_eq!(ups.len(), 1, "{ups:?}");
        assert_eq!(ups[0].0, "a");
        let want: BTreeMap<String, String> = [
            (LABEL_NAMESPACE.to_string(), "team".to_string()),
            (LABEL_POD.to_string(), "train".to_string()),
            (LABEL_CONTAINER.to_string(), "main".to_string()),
        ]
        .into();
        assert_eq!(ups[0].1, want);
        // Once written, nothing more to do.
        allocs[0].labels.extend(want);
        assert!(pod_label_updates(&allocs, &held, R).is_empty());
        // A new holder (units handed to another pod) is written again.
        for id in ["GPU-a-0", "GPU-a-1", "GPU-a-2"] {
            held.insert(id.into(), holder("team", "train-2", "main"));
        }
        let ups = pod_label_updates(&allocs, &held, R);
        assert_eq!(ups.len(), 1);
        assert_eq!(ups[0].1[LABEL_POD], "train-2");
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
        let held = holding(&["GPU-a-1"]);
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
        let held_b = holding(&["GPU-a-1", "GPU-a-2"]);
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

    fn config(cleanup: bool) -> StaleConfig {
        StaleConfig {
            socket: "/unused/pod-resources.sock".into(),
            admin_socket: "/unused/admin.sock".into(),
            resource_name: R.into(),
            grace: Duration::from_secs(10),
            interval: Duration::from_secs(1),
            cleanup,
            exclusive_with: None,
        }
    }

    /// One look with no container holding both resources.
    fn look<A: Arbiter + ?Sized>(
        arb: &mut A,
        held: &HashMap<String, Holder>,
        t: &mut StaleTracker,
        cfg: &StaleConfig,
        now: Instant,
        metrics: &PluginMetrics,
    ) -> Swept {
        reconcile(arb, held, &HashSet::new(), t, cfg, now, metrics).unwrap()
    }

    fn fake_with(allocs: Vec<AllocationStatus>) -> FakeArbiter {
        let mut arb = FakeArbiter::with_gpus(&[("GPU-a", 1 << 30)]);
        arb.allocations = allocs.into_iter().map(|a| ("t".to_owned(), a)).collect();
        arb
    }

    #[test]
    fn reconcile_writes_pod_labels_only_on_change() {
        let mut arb = fake_with(vec![
            alloc("a", "GPU-a", &[0, 1]),
            alloc("b", "GPU-a", &[2]),
        ]);
        let held: HashMap<String, Holder> = [
            ("GPU-a-0".to_string(), holder("team", "train", "main")),
            ("GPU-a-1".to_string(), holder("team", "train", "main")),
        ]
        .into();
        let metrics = PluginMetrics::new();
        let cfg = config(false);
        let mut t = StaleTracker::default();
        let now = Instant::now();
        let swept = look(&mut arb, &held, &mut t, &cfg, now, &metrics);
        assert_eq!(swept.labelled, ["a"]);
        assert!(swept.deleted.is_empty());
        assert_eq!(arb.calls, [Call::List, Call::UpdateLabels("a".into())]);
        assert_eq!(arb.get("a").unwrap().labels[LABEL_POD], "train");
        assert!(!arb.get("b").unwrap().labels.contains_key(LABEL_POD));
        assert!(
            metrics
                .render()
                .contains("tessera_plugin_pod_labels_total 1\n")
        );
        // Nothing changed: a look costs only the list.
        arb.calls.clear();
        let swept = look(&mut arb, &held, &mut t, &cfg, now, &metrics);
        assert_eq!(swept, Swept::default());
        assert_eq!(arb.calls, [Call::List]);
        // Clean-up off: the orphan "b" stays however long it waits.
        let later = now + Duration::from_secs(60);
        look(&mut arb, &held, &mut t, &cfg, later, &metrics);
        assert_eq!(arb.ids(), ["a", "b"]);
    }

    #[test]
    fn reconcile_deletes_orphans_after_grace_and_skips_ones_gone() {
        let mut arb = fake_with(vec![alloc("a", "GPU-a", &[0]), alloc("b", "GPU-a", &[1])]);
        let held = holding(&["GPU-a-0"]);
        let metrics = PluginMetrics::new();
        let cfg = config(true);
        let mut t = StaleTracker::default();
        let t0 = Instant::now();
        let swept = look(&mut arb, &held, &mut t, &cfg, t0, &metrics);
        assert!(swept.deleted.is_empty());
        let late = t0 + Duration::from_secs(10);
        let swept = look(&mut arb, &held, &mut t, &cfg, late, &metrics);
        assert_eq!(swept.deleted, ["b"]);
        assert_eq!(arb.ids(), ["a"]);
        assert!(
            metrics
                .render()
                .contains("tessera_plugin_stale_cleanups_total 1\n")
        );
        // Listed, then deleted by someone else before the plugin got to it: not an error.
        struct Racing(FakeArbiter);
        impl Arbiter for Racing {
            fn gpus(&mut self) -> Result<Vec<tessera_protocol::GpuInfo>, ClientError> {
                self.0.gpus()
            }
            fn list(&mut self) -> Result<Vec<AllocationStatus>, ClientError> {
                let out = self.0.list();
                self.0.allocations.clear();
                out
            }
            fn create(
                &mut self,
                req: tessera_protocol::CreateAllocation,
            ) -> Result<(String, AllocationStatus), ClientError> {
                self.0.create(req)
            }
            fn create_group(
                &mut self,
                slices: Vec<tessera_protocol::CreateAllocation>,
            ) -> Result<(String, Vec<AllocationStatus>), ClientError> {
                self.0.create_group(slices)
            }
            fn delete(&mut self, id: &str) -> Result<(), ClientError> {
                self.0.delete(id)
            }
            fn update_labels(
                &mut self,
                id: &str,
                labels: BTreeMap<String, String>,
            ) -> Result<AllocationStatus, ClientError> {
                self.0.update_labels(id, labels)
            }
        }
        let mut racing = Racing(fake_with(vec![alloc("c", "GPU-a", &[2])]));
        let held_c: HashMap<String, Holder> =
            [("GPU-a-2".to_string(), holder("ns", "p", "c"))].into();
        let swept = look(&mut racing, &held_c, &mut t, &cfg, late, &metrics);
        assert_eq!(swept, Swept::default());
        assert_eq!(racing.0.calls, [Call::List, Call::UpdateLabels("c".into())]);
    }

    #[test]
    fn a_container_holding_both_resources_loses_its_allocations_at_once() {
        use crate::proto::podresources::{ContainerDevices, ContainerResources};
        const L: &str = "tessera.dev/gpu-latency-shares";
        let container = |name: &str, devs: &[(&str, &[&str])]| ContainerResources {
            name: name.into(),
            devices: devs
                .iter()
                .map(|(r, ids)| ContainerDevices {
                    resource_name: (*r).into(),
                    device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
                    topology: None,
                })
                .collect(),
            ..Default::default()
        };
        let pods = vec![PodResources {
            name: "p".into(),
            namespace: "ns".into(),
            containers: vec![
                container("mix", &[(R, &["GPU-a-0"]), (L, &["GPU-a-90"])]),
                container("plain", &[(R, &["GPU-a-1"])]),
            ],
        }];
        let mixed = mixed_in(&pods, R, L);
        assert_eq!(mixed.len(), 1);
        assert_eq!(mixed.iter().next().unwrap().container, "mix");
        assert_eq!(mixed_in(&pods, L, R), mixed, "either side sees it");
        let held = holders_in(&pods, R);
        let mut arb = fake_with(vec![alloc("m", "GPU-a", &[0]), alloc("k", "GPU-a", &[1])]);
        let metrics = PluginMetrics::new();
        let mut t = StaleTracker::default();
        // Even with clean-up off and long before any grace: the mixed one goes, the plain one
        // stays (and is named).
        let cfg = config(false);
        let swept = reconcile(
            &mut arb,
            &held,
            &mixed,
            &mut t,
            &cfg,
            Instant::now(),
            &metrics,
        )
        .unwrap();
        assert_eq!(swept.mixed, ["m"]);
        assert_eq!(swept.labelled, ["k"]);
        assert_eq!(arb.ids(), ["k"]);
        assert!(
            metrics
                .render()
                .contains("tessera_plugin_mixed_tier_deletions_total 1")
        );
    }
}
