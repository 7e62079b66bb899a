//! The device list while the arbiter runs: MIG instances come and go (the DRA plugin makes
//! one at a claim's prepare, destroys it at the last unprepare), so the list is read again
//! when a Create names a `MIG-` UUID it lacks and at every backstop poll. A device is known by its
//! UUID and keeps its index ([`crate::gpus::keep_indexes`]); a new one gets a scheduler (with
//! its timer); a gone one keeps its scheduler while allocations name it, and its allocations
//! stay (as for a GPU missing at start-up: the backstop polices their processes on no card).

#[allow(unused_imports)]
use super::*;

impl Arbiter {
    /// Reads the devices again through `discovery` whenever a Create names a `MIG-` UUID this list
    /// lacks. Once; later calls are ignored.
    pub fn set_discovery(&self, discovery: Box<dyn crate::gpus::GpuDiscovery + Send + Sync>) {
        let _ = self.discovery.set(discovery);
    }

    /// Marks the timers started on `rt` and returns the schedulers there are now, for the
    /// caller to start theirs; a scheduler made later starts its own there.
    pub(crate) fn start_timers(&self, rt: tokio::runtime::Handle) -> Vec<SchedulerHandle> {
        // The schedulers' lock first, as `scheduler_for` takes them: none is made between.
        let all = self.schedulers.lock();
        *self.timers.lock() = Some(rt);
        all.values().cloned().collect()
    }

    /// Takes `found` (a fresh discovery) as the device list, keeping the indexes of devices
    /// already known; returns whether anything changed.
    pub fn refresh_gpus(&self, found: Vec<GpuInfo>) -> bool {
        // Indexes of allocations, so that a gone instance's is not handed on while one names
        // it: needed only to place a new device (most polls find none, and take no `live`).
        let known = self.gpus();
        let placing = found
            .iter()
            .any(|f| !known.iter().any(|g| g.uuid.eq_ignore_ascii_case(&f.uuid)));
        let held: Vec<(String, u32)> = if placing {
            self.live()
                .by_id
                .values()
                .map(|a| (a.record.gpu_uuid.clone(), a.record.gpu_index))
                .collect()
        } else {
            Vec::new()
        };
        let added: Vec<GpuInfo> = {
            let mut gpus = self.gpus.write();
            let next = crate::gpus::keep_indexes(&gpus, found, &held);
            if next == **gpus {
                return false;
            }
            for g in gpus.iter() {
                if !next.iter().any(|n| n.uuid == g.uuid) {
                    tracing::info!("device {} {} ({}) is gone", g.index, g.uuid, g.name);
                }
            }
            let added = next
                .iter()
                .filter(|n| !gpus.iter().any(|g| g.uuid == n.uuid))
                .cloned()
                .collect();
            *gpus = Arc::new(next);
            added
        };
        for g in &added {
            tracing::info!(
                "device {} {} {} ({})",
                g.index,
                g.uuid,
                g.name,
                human(g.memory_total)
            );
            self.scheduler_for(&g.uuid);
        }
        true
    }

    /// Reads the devices again, if a discovery was set. What it changed is not the question a
    /// caller asks: another reading (the backstop's poll) may have taken the change first.
    pub(super) fn rediscover(&self) {
        let Some(d) = self.discovery.get() else {
            return;
        };
        match d.discover() {
            Ok(found) => {
                self.refresh_gpus(found);
            }
            Err(e) => tracing::warn!("cannot read the devices again: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpus::{FixedGpus, mig_index};

    fn gpu(index: u32, uuid: &str) -> GpuInfo {
        GpuInfo {
            index,
            uuid: uuid.into(),
            name: "n".into(),
            memory_total: 16 << 30,
        }
    }

    fn arbiter(gpus: Vec<GpuInfo>) -> (tempfile::TempDir, Arc<Arbiter>) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let arb = Arbiter::new(gpus, store, SchedulerParams::default()).unwrap();
        (dir, arb)
    }

    fn create(uuid: &str) -> CreateAllocation {
        CreateAllocation {
            gpu: GpuSelector::Uuid(uuid.into()),
            memory_limit: 1 << 30,
            share: 50,
            cap: None,
            labels: Default::default(),
        }
    }

    #[tokio::test]
    async fn a_create_naming_an_instance_made_since_start_reads_the_devices_again() {
        let (_dir, arb) = arbiter(vec![gpu(0, "GPU-a")]);
        let e = arb.create(create("MIG-new")).await.unwrap_err();
        assert!(e.to_string().contains("no GPU with UUID MIG-new"), "{e}");
        // The instance appears (at discovery's position 0 of GPU 1).
        arb.set_discovery(Box::new(FixedGpus(vec![
            gpu(0, "GPU-a"),
            gpu(mig_index(1, 0), "MIG-new"),
        ])));
        let (_token, status) = arb.create(create("MIG-new")).await.unwrap();
        assert_eq!(status.gpu_uuid, "MIG-new");
        assert_eq!(status.gpu_index, mig_index(1, 0));
        assert!(arb.schedulers().iter().any(|s| s.uuid() == "MIG-new"));
        // Still unknown after a fresh reading: refused as before.
        let e = arb.create(create("MIG-other")).await.unwrap_err();
        assert!(e.to_string().contains("no GPU with UUID MIG-other"), "{e}");
        arb.delete(&status.id).await.unwrap();
    }

    /// A discovery whose walk finds the arbiter already holding what it finds: the backstop's
    /// poll took the new instance in between the create's first look and its own walk.
    struct PolledFirst(std::sync::Weak<Arbiter>, Vec<GpuInfo>);

    impl std::fmt::Debug for PolledFirst {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("PolledFirst")
        }
    }

    impl crate::gpus::GpuDiscovery for PolledFirst {
        fn discover(&self) -> Result<Vec<GpuInfo>, crate::gpus::GpusError> {
            let arb = self
                .0
                .upgrade()
                .expect("the arbiter outlives its discovery");
            assert!(
                arb.refresh_gpus(self.1.clone()),
                "the poll takes the instance"
            );
            Ok(self.1.clone())
        }
    }

    /// Seen once in a CI-like loop: the DRA driver made an instance, the backstop's poll added
    /// it a few microseconds before the create's walk, the walk changed nothing, and the create
    /// was refused with "no GPU with UUID MIG-...".
    #[tokio::test]
    async fn an_instance_the_backstop_took_in_during_the_walk_is_found() {
        let (_dir, arb) = arbiter(vec![gpu(0, "GPU-a")]);
        let found = vec![gpu(0, "GPU-a"), gpu(mig_index(0, 0), "MIG-new")];
        arb.set_discovery(Box::new(PolledFirst(Arc::downgrade(&arb), found)));
        let (_token, status) = arb.create(create("MIG-new")).await.unwrap();
        assert_eq!(status.gpu_uuid, "MIG-new");
        arb.delete(&status.id).await.unwrap();
    }

    /// A discovery that counts its walks.
    #[derive(Debug, Default)]
    struct Counting(Arc<std::sync::atomic::AtomicU32>);

    impl crate::gpus::GpuDiscovery for Counting {
        fn discover(&self) -> Result<Vec<GpuInfo>, crate::gpus::GpusError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(vec![gpu(0, "GPU-a")])
        }
    }

    #[tokio::test]
    async fn only_an_unknown_mig_uuid_makes_the_arbiter_walk_the_devices() {
        let (_dir, arb) = arbiter(vec![gpu(0, "GPU-a")]);
        let counting = Counting::default();
        let walks = Arc::clone(&counting.0);
        arb.set_discovery(Box::new(counting));
        let mut by_index = create("x");
        by_index.gpu = GpuSelector::Index(7);
        assert!(arb.create(by_index).await.is_err());
        assert!(arb.create(create("GPU-typo")).await.is_err());
        assert_eq!(walks.load(Ordering::Relaxed), 0);
        assert!(arb.create(create("mig-unknown")).await.is_err());
        assert_eq!(walks.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_scheduler_made_after_the_timers_started_gets_its_own() {
        let (_dir, arb) = arbiter(vec![gpu(0, "GPU-a")]);
        let started = arb.start_timers(tokio::runtime::Handle::current());
        assert_eq!(started.len(), 1);
        assert!(arb.refresh_gpus(vec![gpu(0, "GPU-a"), gpu(mig_index(0, 0), "MIG-x")]));
        assert!(!arb.refresh_gpus(vec![gpu(0, "GPU-a"), gpu(mig_index(0, 0), "MIG-x")]));
        let s = arb
            .schedulers()
            .into_iter()
            .find(|s| s.uuid() == "MIG-x")
            .unwrap();
        // A timer runs it: the first holder's lease runs out and the second waiter gets one
        // with nobody but the timer calling.
        struct Sink(tokio::sync::mpsc::UnboundedSender<u64>);
        impl crate::scheduler::GrantSink for Sink {
            fn revoke(&self, _: u64) -> bool {
                true
            }
            fn grant(&self, g: crate::scheduler::Grant) -> bool {
                self.0.send(g.conn).is_ok()
            }
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let now = arb.now_ns();
        s.add_allocation(1, 50, None, now);
        s.add_allocation(2, 50, None, now);
        s.acquire(1, 11, now, Arc::new(Sink(tx.clone()))).unwrap();
        assert_eq!(rx.recv().await, Some(11));
        s.acquire(2, 12, arb.now_ns(), Arc::new(Sink(tx))).unwrap();
        let next = tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv()).await;
        assert_eq!(
            next.ok().flatten(),
            Some(12),
            "no timer ended the first lease"
        );
    }

    #[test]
    fn a_gone_device_leaves_its_allocation_and_a_new_one_keeps_its_slot() {
        let (_dir, arb) = arbiter(vec![
            gpu(mig_index(0, 0), "MIG-a"),
            gpu(mig_index(0, 1), "MIG-b"),
        ]);
        // MIG-a destroyed: MIG-b is now discovery's position 0, and keeps its index.
        assert!(arb.refresh_gpus(vec![gpu(mig_index(0, 0), "MIG-b")]));
        assert_eq!(*arb.gpus(), vec![gpu(mig_index(0, 1), "MIG-b")]);
        // A new instance at position 1 takes the free slot 0.
        assert!(arb.refresh_gpus(vec![
            gpu(mig_index(0, 0), "MIG-b"),
            gpu(mig_index(0, 1), "MIG-c")
        ]));
        assert_eq!(
            *arb.gpus(),
            vec![gpu(mig_index(0, 1), "MIG-b"), gpu(mig_index(0, 0), "MIG-c")]
        );
    }
}
