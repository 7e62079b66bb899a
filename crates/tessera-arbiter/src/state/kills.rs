//! What the backstop killed, per allocation: the last process and why, kept for `tessera run`
//! to print when its command is gone (the arbiter's words, not a guess from an exit status
//! of 137). One record per allocation, dropped with it.

#![forbid(unsafe_code)]

use tessera_protocol::KillRecord;

use super::{Arbiter, By, StateError};

impl Arbiter {
    /// Records that the backstop is killing `pid` of allocation `id`, in the words `describe`
    /// gives from the allocation's card and memory limit (the backstop's reason is its own
    /// business: this layer keeps text). Called just before the signal: the command's parent
    /// (`tessera run`) asks as soon as it sees the command gone, so the record must be there
    /// first.
    pub(crate) fn record_kill(
        &self,
        id: &str,
        pid: i32,
        describe: impl FnOnce(u32, u64) -> String,
    ) {
        let live = self.live();
        let Some(a) = live.by_id.get(id) else {
            return;
        };
        let record = KillRecord {
            pid,
            reason: describe(a.record.gpu_index, a.record.memory_limit),
            unix: super::now_unix(),
        };
        let mut kills = self.kills.lock();
        // One per live allocation: those deleted since go here (no other path to forget them).
        kills.retain(|k, _| live.by_id.contains_key(k));
        kills.insert(id.to_owned(), record);
    }

    /// The last kill recorded for allocation `id`, if `by` may see it.
    pub(crate) fn last_kill(&self, id: &str, by: &By) -> Result<Option<KillRecord>, StateError> {
        let live = self.live();
        let a = live
            .by_id
            .get(id)
            .ok_or_else(|| StateError::NotFound(id.to_owned()))?;
        by.may_touch(&a.record)?;
        Ok(self.kills.lock().get(id).cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_last_kill_is_kept_per_allocation_and_shown_only_to_its_owner() {
        let dir = tempfile::tempdir().unwrap();
        let arb = Arbiter::new(
            super::super::test_gpus(1),
            crate::store::Store::open(dir.path()).unwrap(),
            crate::scheduler::SchedulerParams::default(),
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let alice = By::user(
            61001,
            super::super::Quota {
                memory: 8 * GIB,
                shares: 100,
            },
        );
        let create = tessera_protocol::CreateAllocation {
            gpu: tessera_protocol::GpuSelector::Index(0),
            memory_limit: GIB,
            share: 10,
            cap: None,
            labels: Default::default(),
        };
        let (_, a) = rt
            .block_on(arb.create_tiered_by(create, None, Default::default(), &alice))
            .unwrap();
        assert_eq!(arb.last_kill(&a.id, &alice).unwrap(), None);
        arb.record_kill(&a.id, 1234, |gpu, limit| {
            format!("held 2 GiB on GPU {gpu}, allowed {limit} bytes")
        });
        let k = arb.last_kill(&a.id, &alice).unwrap().unwrap();
        assert_eq!(k.pid, 1234);
        assert!(
            k.reason == format!("held 2 GiB on GPU 0, allowed {GIB} bytes"),
            "{}",
            k.reason
        );
        let bob = By::user(
            61002,
            super::super::Quota {
                memory: GIB,
                shares: 10,
            },
        );
        assert!(matches!(
            arb.last_kill(&a.id, &bob),
            Err(StateError::Forbidden(_))
        ));
        rt.block_on(arb.delete(&a.id)).unwrap();
        assert!(matches!(
            arb.last_kill(&a.id, &alice),
            Err(StateError::NotFound(_))
        ));
    }
}
