//! Who asks for an admin operation, and what they may do: the operator (the admin socket: any
//! allocation, no quota) or a user (the user socket: their own allocations, within their
//! quota). The uid is the kernel's (`SO_PEERCRED` of the socket's peer), never a field of the
//! request; see [`crate::users`].

#![forbid(unsafe_code)]

use tessera_protocol::size::human;
use tessera_protocol::{CreateAllocation, GpuInfo};

use super::StateError;
use crate::store::AllocationRecord;

/// What one user's allocations may hold together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Memory of all the user's allocations together, on every GPU, bytes.
    pub memory: u64,
    /// Shares of the user's allocations on any one GPU (a share is a part of one GPU).
    pub shares: u32,
}

/// Who asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct By {
    /// The peer's uid: what it creates is recorded as this uid's.
    pub uid: Option<u32>,
    /// `Some` for a user (the user socket): only allocations of `uid` may be touched, and its
    /// allocations stay within this quota.
    pub quota: Option<Quota>,
}

impl By {
    /// The operator, uid unknown (the arbiter's own work: the reaper, tests).
    pub(crate) const OPERATOR: By = By {
        uid: None,
        quota: None,
    };

    /// The operator as the admin socket's peer `uid`.
    pub(crate) fn operator(uid: Option<u32>) -> Self {
        Self { uid, quota: None }
    }

    /// User `uid` with `quota`.
    pub(crate) fn user(uid: u32, quota: Quota) -> Self {
        Self {
            uid: Some(uid),
            quota: Some(quota),
        }
    }

    /// Refuses `req` on `gpu` if it would take this user past their quota with `records`
    /// already promised: memory is summed over all their allocations on every GPU, shares
    /// over theirs on `gpu` (a share is a part of one GPU). The operator has no quota.
    pub(crate) fn check_quota(
        &self,
        records: &[AllocationRecord],
        gpu: &GpuInfo,
        req: &CreateAllocation,
    ) -> Result<(), StateError> {
        let (Some(q), Some(uid)) = (&self.quota, self.uid) else {
            return Ok(());
        };
        let mine = || records.iter().filter(|r| r.uid == Some(uid));
        let memory: u64 = mine().map(|r| r.memory_limit).sum();
        if memory.saturating_add(req.memory_limit) > q.memory {
            return Err(StateError::Forbidden(format!(
                "over uid {uid}'s quota: {} of memory asked, {} of its {} left (its allocations \
                 hold {}); the operator sets quotas with the arbiter's --user-quota",
                human(req.memory_limit),
                human(q.memory.saturating_sub(memory)),
                human(q.memory),
                human(memory)
            )));
        }
        let shares: u32 = mine()
            .filter(|r| r.gpu_uuid == gpu.uuid)
            .map(|r| r.share)
            .sum();
        if shares.saturating_add(req.share) > q.shares {
            return Err(StateError::Forbidden(format!(
                "over uid {uid}'s quota: share {} asked on GPU {}, {} of its {} left there; the \
                 operator sets quotas with the arbiter's --user-quota",
                req.share,
                gpu.index,
                q.shares.saturating_sub(shares),
                q.shares
            )));
        }
        Ok(())
    }

    /// Refuses a user another uid's allocation (or one whose creator is not recorded: the
    /// operator's). The operator may touch any.
    pub(crate) fn may_touch(&self, r: &AllocationRecord) -> Result<(), StateError> {
        if self.quota.is_none() || (self.uid.is_some() && r.uid == self.uid) {
            return Ok(());
        }
        let whose = r
            .uid
            .map_or("the operator".to_owned(), |u| format!("uid {u}"));
        Err(StateError::Forbidden(format!(
            "allocation {} belongs to {whose}, not to uid {}: a user may touch only their own",
            r.id,
            self.uid.map_or("?".into(), |u| u.to_string())
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn rec(
        id: &str,
        uid: Option<u32>,
        gpu: &str,
        memory_limit: u64,
        share: u32,
    ) -> AllocationRecord {
        AllocationRecord {
            id: id.into(),
            token: String::new(),
            gpu_index: 0,
            gpu_uuid: gpu.into(),
            memory_limit,
            share,
            cap: None,
            labels: Default::default(),
            created_unix: 0,
            owner: None,
            tier: Default::default(),
            uid,
        }
    }

    fn ask(memory_limit: u64, share: u32) -> CreateAllocation {
        CreateAllocation {
            gpu: tessera_protocol::GpuSelector::Index(0),
            memory_limit,
            share,
            cap: None,
            labels: Default::default(),
        }
    }

    #[test]
    fn a_users_memory_counts_on_every_gpu_and_shares_per_gpu() {
        let gpus = super::super::test_gpus(2);
        let alice = By::user(
            61001,
            Quota {
                memory: 16 * GIB,
                shares: 50,
            },
        );
        let records = vec![
            rec("a1", Some(61001), "GPU-0", 10 * GIB, 40),
            rec("a2", Some(61001), "GPU-1", 2 * GIB, 10),
            // Another user's and the operator's do not count.
            rec("b1", Some(61002), "GPU-0", 60 * GIB, 40),
            rec("o1", None, "GPU-0", 4 * GIB, 10),
        ];
        alice
            .check_quota(&records, &gpus[0], &ask(4 * GIB, 10))
            .unwrap();
        let e = alice
            .check_quota(&records, &gpus[0], &ask(4 * GIB + 1, 10))
            .unwrap_err();
        assert!(
            matches!(&e, StateError::Forbidden(m) if m.contains("4 GiB of its 16 GiB left")),
            "{e}"
        );
        let e = alice
            .check_quota(&records, &gpus[0], &ask(GIB, 11))
            .unwrap_err();
        assert!(
            matches!(&e, StateError::Forbidden(m) if m.contains("share 11")),
            "{e}"
        );
        // On the other GPU her shares there count.
        alice
            .check_quota(&records, &gpus[1], &ask(GIB, 40))
            .unwrap();
        // The operator has no quota.
        By::operator(Some(0))
            .check_quota(&records, &gpus[0], &ask(80 * GIB, 100))
            .unwrap();
    }

    #[test]
    fn a_user_touches_only_their_own() {
        let q = Quota {
            memory: GIB,
            shares: 10,
        };
        let alice = By::user(61001, q);
        let bob = By::user(61002, q);
        let hers = rec("a1", Some(61001), "GPU-0", GIB, 10);
        let operators = rec("o1", None, "GPU-0", GIB, 10);
        alice.may_touch(&hers).unwrap();
        let e = bob.may_touch(&hers).unwrap_err().to_string();
        assert!(e.contains("belongs to uid 61001, not to uid 61002"), "{e}");
        assert!(alice.may_touch(&operators).is_err());
        By::operator(Some(0)).may_touch(&hers).unwrap();
        By::OPERATOR.may_touch(&operators).unwrap();
    }
}
