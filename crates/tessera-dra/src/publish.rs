//! Keeps this node's ResourceSlice on the API server equal to [`crate::slices::slice`] of the
//! current GPUs: created when missing, replaced (pool generation + 1) when the GPUs or their
//! health change, strays of this driver and node deleted.
//!
//! On shutdown the slice is **kept** unless [`run`] is told to remove it
//! (`--remove-slices-on-exit`): a restart or a rolling update of the plugin must not hide the
//! node's GPUs from the scheduler, and the next start finds the slice equal to what it would
//! publish and leaves it as it is (same object, same generation). This is what upstream does:
//! the kubelet plugin helper's `Stop` only stops its ResourceSlice controller, which deletes
//! nothing (k8s.io/dynamic-resource-allocation v0.36.3 `kubeletplugin/draplugin.go`,
//! `resourceslice/resourceslicecontroller.go` `Controller.Stop`); the slices of a driver whose
//! plugin is gone for good are the kubelet's to delete, 30 s after its last plugin unregistered
//! or lost its connection, cancelled when one comes back (k8s.io/kubernetes v1.36.3
//! `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go` `sync`/`wipeResourceSlices`,
//! `defaultWipingDelay` in `pkg/kubelet/cm/dra/manager.go`).
//!
//! "Equal" is upstream's controller's comparison (`resourceslicecontroller.go`,
//! `DevicesDeepEqual`): quantities by value, and a taint's `timeAdded` (which the API server
//! sets when it is missing) ignored when ours has none; a replace carries the existing taints'
//! times over (`copyTaintTimeAdded`). What the API server stored of our last write counts as
//! what we asked for (`sliceStored`: an API server with `DRAConsumableCapacity` or
//! `DRADeviceTaints` off drops those fields), so neither is rewritten at every re-check.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSliceSpec;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tokio::sync::watch;

use crate::apiserver::{ApiError, KubeApi};
use crate::claim::DRIVER;
use crate::mig;
use crate::quantity;
use crate::slices::{self, GpuAttrs};

/// What this process last wrote and what the API server stored of it, per slice.
#[derive(Debug, Default, Clone)]
pub(crate) struct Written {
    slices: BTreeMap<String, (ResourceSliceSpec, ResourceSliceSpec)>,
}

impl Written {
    fn remember(&mut self, name: &str, asked: ResourceSliceSpec, stored: ResourceSliceSpec) {
        if !same(&asked, &stored) {
            tracing::warn!(
                "the API server stored ResourceSlice {name} without some of its fields (feature \
                 gates DRAConsumableCapacity, DRAPartitionableDevices or DRADeviceTaints off?); \
                 kept as stored"
            );
        }
        self.slices.insert(name.to_owned(), (asked, stored));
    }

    /// Whether `cur` is what the API server made of our last write of `want` as `name`.
    fn covers(&self, name: &str, want: &ResourceSliceSpec, cur: &ResourceSliceSpec) -> bool {
        matches!(self.slices.get(name), Some((a, s)) if same(a, want) && same(s, cur))
    }
}

/// What one [`sync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// There was none: created at this generation.
    Created(i64),
    /// The existing slice is what we publish: left as it is, at its generation.
    Kept(i64),
    /// Replaced at this (the next) generation.
    Replaced(i64),
}

/// `q` written the way this driver writes quantities, if it is a whole number.
fn canonical_quantity(q: &mut Quantity) {
    if let Ok(v) = quantity::parse(&q.0) {
        q.0 = quantity::format_bytes(v);
    }
}

/// `spec` with every quantity in one form and no taint times: what equality looks at.
fn canonical(spec: &ResourceSliceSpec) -> ResourceSliceSpec {
    let mut s = spec.clone();
    for d in s.devices.iter_mut().flatten() {
        for cap in d.capacity.iter_mut().flat_map(|c| c.values_mut()) {
            canonical_quantity(&mut cap.value);
            if let Some(p) = &mut cap.request_policy {
                p.default.iter_mut().for_each(canonical_quantity);
                p.valid_values
                    .iter_mut()
                    .flatten()
                    .for_each(canonical_quantity);
                if let Some(r) = &mut p.valid_range {
                    canonical_quantity(&mut r.min);
                    r.max.iter_mut().for_each(canonical_quantity);
                    r.step.iter_mut().for_each(canonical_quantity);
                }
            }
        }
        for t in d.taints.iter_mut().flatten() {
            t.time_added = None;
        }
    }
    s
}

/// Upstream's equality of two slice specs (see the module documentation).
pub(crate) fn same(a: &ResourceSliceSpec, b: &ResourceSliceSpec) -> bool {
    a == b || canonical(a) == canonical(b)
}

/// Gives `want`'s taints that have no time the time of the same taint (key, value, effect) on
/// the same device in `cur` (upstream's `copyTaintTimeAdded`).
fn keep_taint_times(want: &mut ResourceSliceSpec, cur: &ResourceSliceSpec) {
    let old = cur.devices.as_deref().unwrap_or_default();
    for d in want.devices.iter_mut().flatten() {
        let Some(o) = old.iter().find(|o| o.name == d.name) else {
            continue;
        };
        for t in d
            .taints
            .iter_mut()
            .flatten()
            .filter(|t| t.time_added.is_none())
        {
            t.time_added = o
                .taints
                .iter()
                .flatten()
                .find(|x| x.key == t.key && x.value == t.value && x.effect == t.effect)
                .and_then(|x| x.time_added.clone());
        }
    }
}

/// One reconciliation: makes the API server's slices of this node what `gpus` says.
/// `written` carries what this process wrote last from one call to the next.
#[cfg(test)]
pub(crate) async fn sync(
    api: &dyn KubeApi,
    node: &str,
    gpus: &[GpuAttrs],
    default_memory: u64,
    written: &mut Written,
) -> Result<Outcome, ApiError> {
    sync_pool(api, node, gpus, default_memory, &BTreeSet::new(), written).await
}

/// One reconciliation: makes the API server's slices of this node what `gpus` says, keeping
/// the published definition of every GPU with a device in `allocated` whose counters would
/// change ([`mig::hold_allocated`]). `written` carries what this process wrote last from one
/// call to the next. The pool is all of this node's slices of the driver ([`slices::pool`]):
/// all written at one generation when any changes, strays (names the pool no longer has)
/// deleted.
pub(crate) async fn sync_pool(
    api: &dyn KubeApi,
    node: &str,
    gpus: &[GpuAttrs],
    default_memory: u64,
    allocated: &BTreeSet<String>,
    written: &mut Written,
) -> Result<Outcome, ApiError> {
    let existing = api.list_slices(DRIVER, node).await?;
    // The pool's highest generation, so slices made anew never go back behind a stray.
    let newest = existing
        .iter()
        .map(|s| s.spec.pool.generation)
        .max()
        .unwrap_or(0);
    let (mut devices, mut sets) = slices::pool_parts(gpus, default_memory);
    let held = mig::hold_allocated(&mut devices, &mut sets, &existing, allocated);
    if !held.is_empty() {
        tracing::info!(
            "GPUs {held:?} keep their published devices: a claim holds one whose counters \
             would change (kubernetes #140802)"
        );
    }
    let names: BTreeSet<String> = slices::layout(node, devices.clone(), sets.clone(), 0)
        .iter()
        .filter_map(|s| s.metadata.name.clone())
        .collect();
    let mut ours = BTreeMap::new();
    for s in existing {
        match &s.metadata.name {
            Some(n) if names.contains(n) => {
                ours.insert(n.clone(), s);
            }
            Some(stray) => {
                tracing::info!("deleting stray ResourceSlice {stray}");
                api.delete_slice(stray).await?;
            }
            None => {}
        }
    }
    let current = ours.values().map(|s| s.spec.pool.generation).max();
    if let Some(generation) = current {
        let mut want = slices::layout(node, devices.clone(), sets.clone(), generation);
        let unchanged = want.len() == ours.len()
            && want.iter_mut().all(|w| {
                let name = w.metadata.name.clone().unwrap_or_default();
                let Some(cur) = ours.get(&name) else {
                    return false;
                };
                keep_taint_times(&mut w.spec, &cur.spec);
                same(&w.spec, &cur.spec) || written.covers(&name, &w.spec, &cur.spec)
            });
        if unchanged {
            return Ok(Outcome::Kept(generation));
        }
    }
    let generation = newest.max(current.unwrap_or(0)) + 1;
    for mut next in slices::layout(node, devices, sets, generation) {
        let name = next.metadata.name.clone().unwrap_or_default();
        let stored = match ours.get(&name) {
            Some(cur) => {
                keep_taint_times(&mut next.spec, &cur.spec);
                next.metadata.resource_version = cur.metadata.resource_version.clone();
                api.replace_slice(&next).await?
            }
            None => api.create_slice(&next).await?,
        };
        written.remember(&name, next.spec, stored.spec);
    }
    if current.is_none() {
        tracing::info!("published ResourceSlices of {} GPUs", gpus.len());
        Ok(Outcome::Created(generation))
    } else {
        tracing::info!("updated the ResourceSlices of node {node} to generation {generation}");
        Ok(Outcome::Replaced(generation))
    }
}

/// The devices prepared claims hold (read before each reconciliation, off the async threads);
/// `None` when that cannot be known, and then nothing is written that round (a slice change
/// could otherwise alter the counters of a device a claim holds).
pub(crate) type Allocated = Arc<dyn Fn() -> Option<BTreeSet<String>> + Send + Sync>;

/// Reconciles on every change of `gpus` and every `resync` (a slice deleted by someone else
/// comes back), until `stop`; then deletes the node's slices only if `remove_on_exit`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    api: Arc<dyn KubeApi>,
    node: String,
    mut gpus: watch::Receiver<Arc<Vec<GpuAttrs>>>,
    default_memory: u64,
    allocated: Allocated,
    resync: Duration,
    remove_on_exit: bool,
    mut stop: watch::Receiver<bool>,
) {
    let mut written = Written::default();
    loop {
        let current = gpus.borrow_and_update().clone();
        let f = allocated.clone();
        match tokio::task::spawn_blocking(move || f())
            .await
            .ok()
            .flatten()
        {
            Some(held) => {
                let r = sync_pool(
                    api.as_ref(),
                    &node,
                    &current,
                    default_memory,
                    &held,
                    &mut written,
                );
                if let Err(e) = r.await {
                    tracing::warn!("ResourceSlice sync: {e}");
                }
            }
            None => tracing::warn!(
                "ResourceSlice sync skipped: the devices prepared claims hold are unknown (arbiter)"
            ),
        }
        tokio::select! {
            r = gpus.changed() => if r.is_err() { break },
            () = tokio::time::sleep(resync) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    if !remove_on_exit {
        tracing::info!("ResourceSlices of node {node} kept for the next start");
        return;
    }
    let names = match api.list_slices(DRIVER, &node).await {
        Ok(l) => l.into_iter().filter_map(|s| s.metadata.name).collect(),
        Err(e) => {
            tracing::warn!("listing ResourceSlices to delete: {e}");
            vec![slices::slice_name(&node)]
        }
    };
    for name in names {
        match api.delete_slice(&name).await {
            Ok(()) => tracing::info!("deleted ResourceSlice {name} (--remove-slices-on-exit)"),
            Err(e) => tracing::warn!("deleting ResourceSlice {name}: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::slices::{DEFAULT_MEMORY, GpuAttrs};

    /// How the stand-in API server changes what it is sent, as a real one does.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Server {
        /// Stores it as sent.
        AsSent,
        /// 1.36 defaults: sets a missing taint `timeAdded` (k8s.io/kubernetes
        /// `pkg/apis/resource/v1/defaults.go`, `SetDefaults_DeviceTaint`).
        Defaults,
        /// `DRAConsumableCapacity` off: drops `allowMultipleAllocations` and request policies
        /// (`pkg/registry/resource/resourceslice/strategy.go`).
        GateOff,
    }

    struct Api {
        server: Server,
        slices: Mutex<BTreeMap<String, ResourceSlice>>,
        writes: Mutex<Vec<String>>,
    }

    impl Api {
        fn new(server: Server) -> Self {
            Self {
                server,
                slices: Mutex::default(),
                writes: Mutex::default(),
            }
        }

        fn store(&self, mut s: ResourceSlice) -> ResourceSlice {
            for d in s.spec.devices.iter_mut().flatten() {
                match self.server {
                    Server::AsSent => {}
                    Server::Defaults => {
                        for t in d.taints.iter_mut().flatten() {
                            t.time_added
                                .get_or_insert_with(|| Time(k8s_openapi::jiff::Timestamp::now()));
                        }
                    }
                    Server::GateOff => {
                        d.allow_multiple_allocations = None;
                        for c in d.capacity.iter_mut().flat_map(|c| c.values_mut()) {
                            c.request_policy = None;
                        }
                    }
                }
            }
            let mut slices = self.slices.lock().unwrap();
            let rv = slices.len() + self.writes.lock().unwrap().len();
            s.metadata.resource_version = Some(rv.to_string());
            slices.insert(s.metadata.name.clone().unwrap(), s.clone());
            s
        }

        fn writes(&self) -> Vec<String> {
            self.writes.lock().unwrap().clone()
        }

        fn generation(&self, name: &str) -> Option<i64> {
            let slices = self.slices.lock().unwrap();
            slices.get(name).map(|s| s.spec.pool.generation)
        }
    }

    #[tonic::async_trait]
    impl KubeApi for Api {
        async fn get_claim(&self, _: &str, name: &str) -> Result<ResourceClaim, ApiError> {
            Err(ApiError::NotFound(name.into()))
        }
        async fn list_slices(&self, _: &str, _: &str) -> Result<Vec<ResourceSlice>, ApiError> {
            Ok(self.slices.lock().unwrap().values().cloned().collect())
        }
        async fn create_slice(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
            self.writes.lock().unwrap().push("create".into());
            Ok(self.store(s.clone()))
        }
        async fn replace_slice(&self, s: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
            self.writes.lock().unwrap().push("replace".into());
            Ok(self.store(s.clone()))
        }
        async fn delete_slice(&self, name: &str) -> Result<(), ApiError> {
            self.writes.lock().unwrap().push(format!("delete {name}"));
            self.slices.lock().unwrap().remove(name);
            Ok(())
        }
    }

    fn gpu(index: u32) -> GpuAttrs {
        GpuAttrs {
            index,
            uuid: format!("GPU-{index}"),
            product_name: "NVIDIA H100 80GB HBM3".into(),
            memory_total: 80 << 30,
            compute_capability: (9, 0),
            driver_version: "570.124.06".into(),
            pci_bus_id: format!("0000:{index:02x}:00.0"),
            numa_node: Some(0),
            pcie_root: None,
            unhealthy: None,
            mig: crate::mig::MigMode::Off,
        }
    }

    const NAME: &str = "node-a-gpu.tessera.dev";

    #[tokio::test]
    async fn a_restart_keeps_an_equal_slice_as_it_is() {
        let api = Api::new(Server::Defaults);
        let mut sick = vec![gpu(0), gpu(1)];
        sick[1].unhealthy = Some("XID 79".into());
        // What a previous run left: generation 3, a taint the API server gave a time.
        api.store(slices::slice("node-a", &sick, DEFAULT_MEMORY, 3));
        let before = api.slices.lock().unwrap()[NAME].clone();
        // A new process (nothing written yet) finds it equal and leaves it alone.
        let mut fresh = Written::default();
        let got = sync(&api, "node-a", &sick, DEFAULT_MEMORY, &mut fresh).await;
        assert_eq!(got.unwrap(), Outcome::Kept(3));
        assert!(api.writes().is_empty(), "{:?}", api.writes());
        assert_eq!(api.slices.lock().unwrap()[NAME], before);
    }

    #[tokio::test]
    async fn a_change_is_the_next_generation_and_generations_never_go_back() {
        let api = Api::new(Server::AsSent);
        let mut w = Written::default();
        api.store(slices::slice("node-a", &[gpu(0)], DEFAULT_MEMORY, 3));
        let two = [gpu(0), gpu(1)];
        let got = sync(&api, "node-a", &two, DEFAULT_MEMORY, &mut w).await;
        assert_eq!(got.unwrap(), Outcome::Replaced(4));
        let got = sync(&api, "node-a", &two, DEFAULT_MEMORY, &mut w).await;
        assert_eq!(got.unwrap(), Outcome::Kept(4));
        // A stray of this node and driver (an older name) at a later generation: deleted, and
        // ours is made after it, not at 1.
        api.slices.lock().unwrap().clear();
        let mut stray = slices::slice("node-a", &two, DEFAULT_MEMORY, 9);
        stray.metadata.name = Some("node-a-old".into());
        api.store(stray);
        let got = sync(&api, "node-a", &two, DEFAULT_MEMORY, &mut w).await;
        assert_eq!(got.unwrap(), Outcome::Created(10));
        assert_eq!(api.generation("node-a-old"), None);
        assert_eq!(api.generation(NAME), Some(10));
    }

    #[tokio::test]
    async fn what_the_api_server_adds_or_drops_is_not_written_again() {
        for server in [Server::Defaults, Server::GateOff] {
            let api = Api::new(server);
            let mut w = Written::default();
            let mut gpus = vec![gpu(0), gpu(1)];
            sync(&api, "node-a", &gpus, DEFAULT_MEMORY, &mut w)
                .await
                .unwrap();
            gpus[1].unhealthy = Some("XID 79".into());
            for _ in 0..3 {
                sync(&api, "node-a", &gpus, DEFAULT_MEMORY, &mut w)
                    .await
                    .unwrap();
            }
            // One create, one replace for the taint, and nothing at the re-checks after it.
            assert_eq!(api.writes(), ["create", "replace"]);
            assert_eq!(api.generation(NAME), Some(2));
            // A new process under an API server that keeps what it is sent (gate on) finds it
            // equal, the taint's time included.
            if server == Server::Defaults {
                let mut fresh = Written::default();
                let got = sync(&api, "node-a", &gpus, DEFAULT_MEMORY, &mut fresh).await;
                assert_eq!(got.unwrap(), Outcome::Kept(2));
            }
        }
    }

    #[test]
    fn equal_means_equal_quantities_and_taints_whatever_their_times() {
        let mut sick = gpu(0);
        sick.unhealthy = Some("XID 79".into());
        let a = slices::slice("node-a", &[sick], DEFAULT_MEMORY, 1).spec;
        let mut b = a.clone();
        let d = &mut b.devices.as_mut().unwrap()[0];
        // `80Gi` as bytes, and a time on the taint: the same slice.
        d.capacity
            .as_mut()
            .unwrap()
            .get_mut("memory")
            .unwrap()
            .value = Quantity((80u64 << 30).to_string());
        d.taints.as_mut().unwrap()[0].time_added = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        assert!(same(&a, &b));
        // Another value, another effect: not.
        let mut c = b.clone();
        c.devices.as_mut().unwrap()[0]
            .capacity
            .as_mut()
            .unwrap()
            .get_mut("memory")
            .unwrap()
            .value = Quantity("79Gi".into());
        assert!(!same(&a, &c));
        let mut e = b;
        e.devices.as_mut().unwrap()[0].taints.as_mut().unwrap()[0].effect = "NoExecute".into();
        assert!(!same(&a, &e));
    }

    #[tokio::test]
    async fn a_mig_pool_is_written_whole_and_keeps_what_claims_hold() {
        use crate::mig::{MigMode, h200, mig_device_name};
        let api = Api::new(Server::AsSent);
        let mut w = Written::default();
        let mut g = gpu(0);
        g.mig = MigMode::Dynamic(h200());
        let got = sync(
            &api,
            "node-a",
            std::slice::from_ref(&g),
            DEFAULT_MEMORY,
            &mut w,
        )
        .await;
        assert_eq!(got.unwrap(), Outcome::Created(1));
        let counters = "node-a-gpu.tessera.dev-counters-0";
        assert_eq!(api.generation(NAME), Some(1));
        assert_eq!(api.generation(counters), Some(1));
        let got = sync(
            &api,
            "node-a",
            std::slice::from_ref(&g),
            DEFAULT_MEMORY,
            &mut w,
        )
        .await;
        assert_eq!(got.unwrap(), Outcome::Kept(1));
        // MIG turned off by configuration while a claim holds a 1g: nothing changes.
        let held = BTreeSet::from([mig_device_name(0, "1g.18gb", 0)]);
        let off = [gpu(0)];
        let got = sync_pool(&api, "node-a", &off, DEFAULT_MEMORY, &held, &mut w).await;
        assert_eq!(got.unwrap(), Outcome::Kept(1));
        assert_eq!(api.writes(), ["create", "create"]);
        // Released: the next generation, one slice, the counter slice gone.
        let got = sync_pool(
            &api,
            "node-a",
            &off,
            DEFAULT_MEMORY,
            &BTreeSet::new(),
            &mut w,
        )
        .await;
        assert_eq!(got.unwrap(), Outcome::Replaced(2));
        assert_eq!(api.generation(counters), None);
        let s = api.slices.lock().unwrap()[NAME].clone();
        assert_eq!(s.spec.pool.resource_slice_count, 1);
        assert_eq!(s.spec.devices.unwrap().len(), 1);
    }

    async fn run_until_published(api: Arc<Api>, remove_on_exit: bool) {
        let (_tx, gpus) = watch::channel(Arc::new(vec![gpu(0)]));
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(run(
            api.clone(),
            "node-a".into(),
            gpus,
            DEFAULT_MEMORY,
            Arc::new(|| Some(BTreeSet::new())),
            Duration::from_secs(3600),
            remove_on_exit,
            stop,
        ));
        while api.generation(NAME).is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop_tx.send(true).unwrap();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn a_stop_keeps_the_slice_unless_told_to_remove_it() {
        let api = Arc::new(Api::new(Server::AsSent));
        run_until_published(api.clone(), false).await;
        assert_eq!(api.generation(NAME), Some(1));
        assert_eq!(api.writes(), ["create"]);
        // The next start keeps it; a stop told to remove it (an uninstall) deletes it.
        run_until_published(api.clone(), true).await;
        assert_eq!(
            api.writes(),
            ["create".to_owned(), format!("delete {NAME}")]
        );
        assert_eq!(api.generation(NAME), None);
    }
}
