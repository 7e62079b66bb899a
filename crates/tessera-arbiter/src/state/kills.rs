//! What the backstop killed, per allocation: the last process and why, kept for `tessera run`
//! to print when its command is gone (the arbiter's words, not a guess from an exit status
//! of 137). One record per allocation, dropped with it.

#![forbid(unsafe_code)]

use tessera_protocol::KillRecord;
use tessera_protocol::size::human;

use super::{Arbiter, By, StateError};
use crate::backstop::Reason;

/// `reason` for people, on `gpu` (the allocation's card; `None` when the limit was 0: a card
/// outside the allocation, whose number the reason does not carry).
fn describe(reason: &Reason, gpu: Option<u32>) -> String {
    let on = gpu.map_or("on a GPU outside its allocation".to_owned(), |g| {
        format!("on GPU {g}")
    });
    match *reason {
        Reason::Memory {
            used,
            total,
            allowed,
        } if used == total => format!(
            "held {} {on}, allowed {} (the allocation's limit plus the tolerance)",
            human(used),
            human(allowed)
        ),
        Reason::Memory {
            used,
            total,
            allowed,
        } => format!(
            "held {} {on}; the allocation's processes held {}, allowed {} (its limit plus the \
             tolerance)",
            human(used),
            human(total),
            human(allowed)
        ),
        Reason::Compute {
            gpu_ns,
            unleased_ns,
        } => format!(
            "its allocation used {} ms of GPU time {on} outside its leases, past its slack; this \
             process {} ms in the last poll",
            unleased_ns / 1_000_000,
            gpu_ns / 1_000_000
        ),
        Reason::Unknown { used, .. } => format!("held {} {on} outside any allocation", human(used)),
        // Reasons that name no allocation's limit (new ones included): what it held.
        #[allow(unreachable_patterns)]
        _ => format!("{reason:?} {on}"),
    }
}

impl Arbiter {
    /// Records that the backstop is killing `pid` of allocation `id` for `reason`. Called just
    /// before the signal: the command's parent (`tessera run`) asks as soon as it sees the
    /// command gone, so the record must be there first.
    pub fn record_kill(&self, id: &str, pid: i32, reason: &Reason) {
        let live = self.live();
        let Some(a) = live.by_id.get(id) else {
            return;
        };
        let limit0 =
            matches!(reason, Reason::Memory { allowed, .. } if *allowed < a.record.memory_limit);
        let gpu = (!limit0).then_some(a.record.gpu_index);
        let record = KillRecord {
            pid,
            reason: describe(reason, gpu),
            unix: super::now_unix(),
        };
        let mut kills = self.kills.lock();
        // One per live allocation: those deleted since go here (no other path to forget them).
        kills.retain(|k, _| live.by_id.contains_key(k));
        kills.insert(id.to_owned(), record);
    }

    /// The last kill recorded for allocation `id`, if `by` may see it.
    pub fn last_kill(&self, id: &str, by: &By) -> Result<Option<KillRecord>, StateError> {
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
    fn a_kill_reads_as_the_arbiter_saw_it() {
        let r = Reason::Memory {
            used: 5 * GIB + 300 * (1 << 20),
            total: 5 * GIB + 300 * (1 << 20),
            allowed: 4 * GIB + 64 * (1 << 20),
        };
        assert_eq!(
            describe(&r, Some(0)),
            "held 5.29 GiB on GPU 0, allowed 4.06 GiB (the allocation's limit plus the tolerance)"
        );
        let r = Reason::Memory {
            used: GIB,
            total: 3 * GIB,
            allowed: 0,
        };
        let text = describe(&r, None);
        assert!(
            text.contains("on a GPU outside its allocation") && text.contains("held 3 GiB"),
            "{text}"
        );
    }

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
            crate::users::Quota {
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
        let r = Reason::Memory {
            used: 2 * GIB,
            total: 2 * GIB,
            allowed: GIB + (64 << 20),
        };
        arb.record_kill(&a.id, 1234, &r);
        let k = arb.last_kill(&a.id, &alice).unwrap().unwrap();
        assert_eq!(k.pid, 1234);
        assert!(
            k.reason
                .starts_with("held 2 GiB on GPU 0, allowed 1.06 GiB"),
            "{}",
            k.reason
        );
        let bob = By::user(
            61002,
            crate::users::Quota {
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
