use std::collections::BTreeMap;

use super::*;

/// A GPU's MIG state as NVML keeps it: mode, instances, overlap refused, fresh UUIDs.
#[derive(Default)]
struct Gpu {
    mig: bool,
    instances: Vec<LiveInstance>,
}

#[derive(Default)]
struct Fake {
    gpus: BTreeMap<String, Gpu>,
    made: u32,
    fail_create: bool,
    mode_changes: usize,
}

impl Fake {
    fn gpu(&mut self, parent: &str) -> Result<&mut Gpu, MigError> {
        self.gpus.get_mut(parent).ok_or_else(|| MigError::Nvml {
            call: "handle",
            gpu: parent.into(),
            message: "not found".into(),
        })
    }
    fn with(parents: &[&str]) -> Self {
        let mut f = Self::default();
        for p in parents {
            f.gpus.insert((*p).into(), Gpu::default());
        }
        f
    }
}

fn nvml(call: &'static str, gpu: &str, message: &str) -> MigError {
    MigError::Nvml {
        call,
        gpu: gpu.into(),
        message: message.into(),
    }
}

impl MigControl for Fake {
    fn mig_enabled(&mut self, parent: &str) -> Result<bool, MigError> {
        Ok(self.gpu(parent)?.mig)
    }
    fn set_mig(&mut self, parent: &str, on: bool) -> Result<(), MigError> {
        let g = self.gpu(parent)?;
        if !on && !g.instances.is_empty() {
            return Err(nvml("SetMigMode", parent, "in use"));
        }
        g.mig = on;
        self.mode_changes += 1;
        Ok(())
    }
    fn instances(&mut self, parent: &str) -> Result<Vec<LiveInstance>, MigError> {
        Ok(self.gpu(parent)?.instances.clone())
    }
    fn create(
        &mut self,
        parent: &str,
        profile_id: u32,
        pl: Placement,
    ) -> Result<LiveInstance, MigError> {
        let fail = self.fail_create;
        self.made += 1;
        let n = self.made;
        let g = self.gpu(parent)?;
        if !g.mig {
            return Err(nvml(
                "CreateGpuInstanceWithPlacement",
                parent,
                "not supported",
            ));
        }
        if fail || g.instances.iter().any(|l| overlaps(l.placement, pl)) {
            return Err(nvml(
                "CreateGpuInstanceWithPlacement",
                parent,
                "insufficient resources",
            ));
        }
        let l = LiveInstance {
            gpu_instance: n,
            profile_id,
            placement: pl,
            uuid: format!("MIG-{n}"),
        };
        g.instances.push(l.clone());
        Ok(l)
    }
    fn destroy(&mut self, parent: &str, gi: u32) -> Result<(), MigError> {
        let g = self.gpu(parent)?;
        let before = g.instances.len();
        g.instances.retain(|l| l.gpu_instance != gi);
        if g.instances.len() == before {
            return Err(nvml("GpuInstanceDestroy", parent, "not found"));
        }
        Ok(())
    }
}

fn want(parent: &str, profile: &str, start: u32, size: u32) -> Want {
    Want {
        parent: parent.into(),
        profile: profile.into(),
        profile_id: 19,
        placement: Placement { start, size },
    }
}

#[test]
fn two_claims_share_one_instance_and_the_last_release_removes_it_and_mig() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join(CHECKPOINT);
    let mut f = Fake::with(&["GPU-0"]);
    let w = want("GPU-0", "1g.18gb", 2, 1);
    let a = acquire(&mut f, &ck, "claim-a", &w).unwrap();
    assert!(f.gpus["GPU-0"].mig, "MIG turned on for the first instance");
    let b = acquire(&mut f, &ck, "claim-b", &w).unwrap();
    assert_eq!(a, b, "the second claim shares the instance");
    assert_eq!(f.gpus["GPU-0"].instances.len(), 1);
    // A repeated prepare is the same answer.
    assert_eq!(acquire(&mut f, &ck, "claim-a", &w).unwrap(), a);
    let rec = &Checkpoint::load(&ck).unwrap().records[0];
    assert_eq!(rec.state, State::PrepareCompleted);
    assert_eq!(rec.claims.len(), 2);

    assert!(release(&mut f, &ck, "claim-a").unwrap().is_empty());
    assert_eq!(f.gpus["GPU-0"].instances.len(), 1, "claim-b still uses it");
    assert_eq!(release(&mut f, &ck, "claim-b").unwrap(), vec![a.clone()]);
    assert!(f.gpus["GPU-0"].instances.is_empty());
    assert!(!f.gpus["GPU-0"].mig, "MIG off once nothing is left");
    assert!(
        release(&mut f, &ck, "claim-b").unwrap().is_empty(),
        "repeatable"
    );
    // Made again: a fresh UUID, as NVML gives.
    let c = acquire(&mut f, &ck, "claim-c", &w).unwrap();
    assert_ne!(c, a);
}

#[test]
fn another_profile_at_a_held_placement_or_an_unknown_instance_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join(CHECKPOINT);
    let mut f = Fake::with(&["GPU-0"]);
    acquire(&mut f, &ck, "a", &want("GPU-0", "1g.18gb", 0, 1)).unwrap();
    let e = acquire(&mut f, &ck, "b", &want("GPU-0", "2g.35gb", 0, 2)).unwrap_err();
    assert!(matches!(e, MigError::Conflict { .. }), "{e}");
    // An instance someone else made over slice 4: refused by name, nothing destroyed.
    f.gpus
        .get_mut("GPU-0")
        .unwrap()
        .instances
        .push(LiveInstance {
            gpu_instance: 99,
            profile_id: 9,
            placement: Placement { start: 4, size: 4 },
            uuid: "MIG-theirs".into(),
        });
    let e = acquire(&mut f, &ck, "c", &want("GPU-0", "1g.18gb", 5, 1)).unwrap_err();
    assert!(e.to_string().contains("MIG-theirs"), "{e}");
    assert_eq!(f.gpus["GPU-0"].instances.len(), 2);
    // The whole GPU is refused while an instance of ours is on it.
    assert!(ensure_whole(&mut f, &ck, "GPU-0").is_err());
}

#[test]
fn a_failed_create_leaves_no_record_and_mig_off() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join(CHECKPOINT);
    let mut f = Fake::with(&["GPU-0"]);
    f.fail_create = true;
    assert!(acquire(&mut f, &ck, "a", &want("GPU-0", "1g.18gb", 0, 1)).is_err());
    assert!(Checkpoint::load(&ck).unwrap().records.is_empty());
    assert!(!f.gpus["GPU-0"].mig);
}

#[test]
fn restart_adopts_checkpointed_instances_and_destroys_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join(CHECKPOINT);
    let mut f = Fake::with(&["GPU-0", "GPU-1"]);
    let kept = acquire(&mut f, &ck, "a", &want("GPU-0", "1g.18gb", 0, 1)).unwrap();
    let orphan = acquire(&mut f, &ck, "gone", &want("GPU-0", "1g.18gb", 1, 1)).unwrap();
    // A create that crashed after NVML made the instance, before the checkpoint said so.
    let mut c = Checkpoint::load(&ck).unwrap();
    c.records.push(Record {
        parent: "GPU-0".into(),
        profile: "1g.18gb".into(),
        profile_id: 19,
        start: 2,
        size: 1,
        state: State::PrepareStarted,
        gpu_instance: None,
        uuid: None,
        claims: BTreeSet::from(["b".into()]),
    });
    c.save(&ck).unwrap();
    let started = f
        .create("GPU-0", 19, Placement { start: 2, size: 1 })
        .unwrap();
    // An instance the checkpoint never knew, on a dynamic GPU; and one on GPU 1 alone.
    let unknown = f
        .create("GPU-0", 19, Placement { start: 3, size: 1 })
        .unwrap();
    f.set_mig("GPU-1", true).unwrap();
    let alone = f
        .create("GPU-1", 19, Placement { start: 0, size: 1 })
        .unwrap();

    let orphan_gi = c
        .records
        .iter()
        .find(|x| x.uuid.as_deref() == Some(orphan.as_str()))
        .and_then(|x| x.gpu_instance)
        .unwrap();
    let prepared = BTreeSet::from(["a".to_owned(), "b".to_owned()]);
    let r = reconcile(&mut f, &ck, &["GPU-0".into(), "GPU-1".into()], &prepared).unwrap();
    assert_eq!(r.adopted, vec![kept.clone()]);
    assert_eq!(
        r.dropped, 2,
        "the started create and the claim no longer prepared"
    );
    let gone: BTreeSet<u32> = r.destroyed.iter().map(|(_, gi)| *gi).collect();
    let expected = BTreeSet::from([
        started.gpu_instance,
        unknown.gpu_instance,
        alone.gpu_instance,
        orphan_gi,
    ]);
    assert_eq!(gone, expected);
    let left: Vec<&str> = f.gpus["GPU-0"]
        .instances
        .iter()
        .map(|l| l.uuid.as_str())
        .collect();
    assert_eq!(left, vec![kept.as_str()]);
    assert!(
        !f.gpus["GPU-1"].mig,
        "a GPU left with nothing turns MIG off"
    );
    // After the restart the adopted instance is shared as before.
    let w = want("GPU-0", "1g.18gb", 0, 1);
    assert_eq!(acquire(&mut f, &ck, "c", &w).unwrap(), kept);
}

#[test]
fn a_whole_gpu_turns_mig_off_when_nothing_is_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join(CHECKPOINT);
    let mut f = Fake::with(&["GPU-0"]);
    f.set_mig("GPU-0", true).unwrap();
    ensure_whole(&mut f, &ck, "GPU-0").unwrap();
    assert!(!f.gpus["GPU-0"].mig);
    let n = f.mode_changes;
    ensure_whole(&mut f, &ck, "GPU-0").unwrap();
    assert_eq!(f.mode_changes, n, "already off: nothing switched");
}

#[test]
fn a_torn_or_foreign_checkpoint_is_an_error_not_an_empty_one() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join(CHECKPOINT);
    std::fs::write(&ck, b"{\"records\": [").unwrap();
    let mut f = Fake::with(&["GPU-0"]);
    let e = acquire(&mut f, &ck, "a", &want("GPU-0", "1g.18gb", 0, 1)).unwrap_err();
    assert!(matches!(e, MigError::Checkpoint { .. }), "{e}");
    assert!(
        f.gpus["GPU-0"].instances.is_empty(),
        "nothing made on a checkpoint it cannot read"
    );
}
