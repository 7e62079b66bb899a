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

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSliceSpec;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tokio::sync::watch;

use crate::apiserver::{ApiError, KubeApi};
use crate::claim::DRIVER;
use crate::quantity;
use crate::slices::{self, GpuAttrs};

/// What this process last wrote and what the API server stored of it.
#[derive(Debug, Default, Clone)]
pub struct Written {
    asked: Option<ResourceSliceSpec>,
    stored: Option<ResourceSliceSpec>,
}

impl Written {
    fn remember(&mut self, name: &str, asked: ResourceSliceSpec, stored: ResourceSliceSpec) {
        if !same(&asked, &stored) {
            tracing::warn!(
                "the API server stored ResourceSlice {name} without some of its fields (feature \
                 gates DRAConsumableCapacity or DRADeviceTaints off?); kept as stored"
            );
        }
        self.asked = Some(asked);
        self.stored = Some(stored);
    }

    /// Whether `cur` is what the API server made of our last write of `want`.
    fn covers(&self, want: &ResourceSliceSpec, cur: &ResourceSliceSpec) -> bool {
        matches!((&self.asked, &self.stored),
            (Some(a), Some(s)) if same(a, want) && same(s, cur))
    }
}

/// What one [`sync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
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
pub fn same(a: &ResourceSliceSpec, b: &ResourceSliceSpec) -> bool {
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
pub async fn sync(
    api: &dyn KubeApi,
    node: &str,
    gpus: &[GpuAttrs],
    default_memory: u64,
    written: &mut Written,
) -> Result<Outcome, ApiError> {
    let name = slices::slice_name(node);
    let existing = api.list_slices(DRIVER, node).await?;
    let mut ours = None;
    // The pool's highest generation, so a slice made anew never goes back behind a stray.
    let mut newest = 0;
    for s in existing {
        newest = newest.max(s.spec.pool.generation);
        if s.metadata.name.as_deref() == Some(name.as_str()) {
            ours = Some(s);
        } else if let Some(stray) = &s.metadata.name {
            tracing::info!("deleting stray ResourceSlice {stray}");
            api.delete_slice(stray).await?;
        }
    }
    let Some(cur) = ours else {
        let generation = newest + 1;
        let want = slices::slice(node, gpus, default_memory, generation);
        let stored = api.create_slice(&want).await?;
        written.remember(&name, want.spec, stored.spec);
        tracing::info!("published ResourceSlice {name} ({} GPUs)", gpus.len());
        return Ok(Outcome::Created(generation));
    };
    let generation = cur.spec.pool.generation;
    let mut want = slices::slice(node, gpus, default_memory, generation);
    keep_taint_times(&mut want.spec, &cur.spec);
    if same(&want.spec, &cur.spec) || written.covers(&want.spec, &cur.spec) {
        return Ok(Outcome::Kept(generation));
    }
    let generation = generation.max(newest) + 1;
    let mut next = want;
    next.spec.pool.generation = generation;
    next.metadata.resource_version = cur.metadata.resource_version.clone();
    let stored = api.replace_slice(&next).await?;
    written.remember(&name, next.spec, stored.spec);
    tracing::info!("updated ResourceSlice {name} to generation {generation}");
    Ok(Outcome::Replaced(generation))
}

/// Reconciles on every change of `gpus` and every `resync` (a slice deleted by someone else
/// comes back), until `stop`; then deletes the slice only if `remove_on_exit`.
pub async fn run(
    api: Arc<dyn KubeApi>,
    node: String,
    mut gpus: watch::Receiver<Arc<Vec<GpuAttrs>>>,
    default_memory: u64,
    resync: Duration,
    remove_on_exit: bool,
    mut stop: watch::Receiver<bool>,
) {
    let mut written = Written::default();
    loop {
        let current = gpus.borrow_and_update().clone();
        if let Err(e) = sync(api.as_ref(), &node, &current, default_memory, &mut written).await {
            tracing::warn!("ResourceSlice sync: {e}");
        }
        tokio::select! {
            r = gpus.changed() => if r.is_err() { break },
            () = tokio::time::sleep(resync) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    let name = slices::slice_name(&node);
    if !remove_on_exit {
        tracing::info!("ResourceSlice {name} kept for the next start");
        return;
    }
    match api.delete_slice(&name).await {
        Ok(()) => tracing::info!("deleted ResourceSlice {name} (--remove-slices-on-exit)"),
        Err(e) => tracing::warn!("deleting ResourceSlice: {e}"),
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

    async fn run_until_published(api: Arc<Api>, remove_on_exit: bool) {
        let (_tx, gpus) = watch::channel(Arc::new(vec![gpu(0)]));
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(run(
            api.clone(),
            "node-a".into(),
            gpus,
            DEFAULT_MEMORY,
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
