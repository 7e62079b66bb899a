//! The admin operations: create (one GPU, tiered, owned, a group of slices), delete, relabel,
//! list, each persisted before it answers (an allocation owned by a process: written behind,
//! see [`Arbiter::persist_owned`]); the checks a create passes first.

#[allow(unused_imports)]
use super::*;

/// Creating allocations: the checks, the records, one GPU or a group of slices.
impl Arbiter {
    /// The device `sel` names; a `MIG-` UUID this list lacks is looked for again in a fresh
    /// reading (an instance made since: [`Arbiter::set_discovery`]).
    pub(super) fn resolve_gpu(&self, sel: &GpuSelector) -> Result<GpuInfo, StateError> {
        let find = |gpus: &[GpuInfo]| {
            gpus.iter()
                .find(|g| match sel {
                    GpuSelector::Index(i) => g.index == *i,
                    GpuSelector::Uuid(u) => g.uuid.eq_ignore_ascii_case(u),
                })
                .cloned()
        };
        if let Some(g) = find(&self.gpus()) {
            return Ok(g);
        }
        // Only MIG instances come and go while the arbiter runs: a GPU index or `GPU-` UUID
        // it lacks is not worth an NVML walk (a caller cannot make it walk for a typo).
        let instance = matches!(sel, GpuSelector::Uuid(u)
            if u.get(..4).is_some_and(|p| p.eq_ignore_ascii_case("MIG-")));
        if instance {
            // Looked for whatever the walk says changed: the backstop's poll may have taken the
            // instance in between (then this walk changes nothing, and the device is there).
            self.rediscover();
            if let Some(g) = find(&self.gpus()) {
                return Ok(g);
            }
        }
        Err(StateError::Invalid(match sel {
            GpuSelector::Index(i) => format!(
                "no GPU with index {i} (this node has {} GPU(s))",
                self.gpus().len()
            ),
            GpuSelector::Uuid(u) => format!("no GPU with UUID {u}"),
        }))
    }

    /// Creates and persists an allocation.
    pub async fn create(
        &self,
        req: CreateAllocation,
    ) -> Result<(String, AllocationStatus), StateError> {
        self.create_owned(req, None).await
    }

    /// Checks `req` against the rules of `create` with `records` already promised; returns
    /// its GPU.
    pub(super) fn check_create(
        &self,
        records: &[AllocationRecord],
        req: &CreateAllocation,
    ) -> Result<GpuInfo, StateError> {
        let gpu = self.resolve_gpu(&req.gpu)?;
        if !(1..=100).contains(&req.share) {
            return Err(StateError::Invalid(format!(
                "share {} is not in 1..=100",
                req.share
            )));
        }
        if let Some(cap) = req.cap
            && !(1..=100).contains(&cap)
        {
            return Err(StateError::Invalid(format!("cap {cap} is not in 1..=100")));
        }
        if req.memory_limit == 0 {
            return Err(StateError::Invalid(
                "memory limit must be above 0 bytes".into(),
            ));
        }
        check_labels(&req.labels)?;
        if req.memory_limit > gpu.memory_total {
            return Err(StateError::Invalid(format!(
                "memory limit {} exceeds GPU {}'s {}",
                human(req.memory_limit),
                gpu.index,
                human(gpu.memory_total)
            )));
        }
        let on_gpu = records.iter().filter(|r| r.gpu_uuid == gpu.uuid);
        let (shares, memory) =
            on_gpu.fold((0u32, 0u64), |(s, m), r| (s + r.share, m + r.memory_limit));
        if shares + req.share > 100 {
            return Err(StateError::Exhausted(format!(
                "GPU {} has {} of 100 shares left, {} asked",
                gpu.index,
                100u32.saturating_sub(shares),
                req.share
            )));
        }
        if memory + req.memory_limit > gpu.memory_total {
            return Err(StateError::Exhausted(format!(
                "GPU {} has {} of {} not yet promised, {} asked",
                gpu.index,
                human(gpu.memory_total.saturating_sub(memory)),
                human(gpu.memory_total),
                human(req.memory_limit)
            )));
        }
        Ok(gpu)
    }

    /// A record for `req` on `gpu` with a fresh id (none of `records`' ids) and `token`.
    pub(super) fn new_record(
        records: &[AllocationRecord],
        req: CreateAllocation,
        gpu: &GpuInfo,
        token: String,
        owner: Option<tessera_protocol::ProcessOwner>,
        tier: tessera_protocol::Tier,
    ) -> Result<AllocationRecord, StateError> {
        let mut id = store::new_id()?;
        while records.iter().any(|r| r.id == id) {
            id = store::new_id()?;
        }
        Ok(AllocationRecord {
            id,
            token,
            gpu_index: gpu.index,
            gpu_uuid: gpu.uuid.clone(),
            memory_limit: req.memory_limit,
            share: req.share,
            cap: req.cap,
            labels: req.labels,
            created_unix: now_unix(),
            owner,
            tier,
            uid: None,
        })
    }

    /// Validates, persists and registers an allocation owned by `owner` (see
    /// [`crate::owner`]); returns its token and status.
    pub(crate) async fn create_owned(
        &self,
        req: CreateAllocation,
        owner: Option<tessera_protocol::ProcessOwner>,
    ) -> Result<(String, AllocationStatus), StateError> {
        self.create_tiered(req, owner, tessera_protocol::Tier::BestEffort)
            .await
    }

    /// [`Arbiter::create_owned`] in a service tier (admin socket only: the tier is the
    /// operator's, never the tenant's).
    pub(crate) async fn create_tiered(
        &self,
        req: CreateAllocation,
        owner: Option<tessera_protocol::ProcessOwner>,
        tier: tessera_protocol::Tier,
    ) -> Result<(String, AllocationStatus), StateError> {
        self.create_tiered_by(req, owner, tier, &By::OPERATOR).await
    }

    /// [`Arbiter::create_tiered`] for `by`: recorded as theirs, within their quota.
    pub(crate) async fn create_tiered_by(
        &self,
        req: CreateAllocation,
        owner: Option<tessera_protocol::ProcessOwner>,
        tier: tessera_protocol::Tier,
        by: &By,
    ) -> Result<(String, AllocationStatus), StateError> {
        let mut records = self.admin.lock().await;
        let gpu = self.check_create(&records, &req)?;
        by.check_quota(&records, &gpu, &req)?;
        let mut record = Self::new_record(&records, req, &gpu, store::new_token()?, owner, tier)?;
        record.uid = by.uid;
        let mut next = records.clone();
        next.push(record.clone());
        self.persist_owned(owner.is_some(), next.clone()).await?;
        *records = next;
        let token = record.token.clone();
        let id = record.id.clone();
        self.insert_live(record);
        let status = self
            .status_of(&id)
            .ok_or_else(|| StateError::NotFound(id.clone()))?;
        Ok((token, status))
    }

    /// Creates one allocation spanning several GPUs (see [`tessera_protocol::group`]): a
    /// slice per entry, each checked as `create` checks one, on distinct GPUs, all persisted in
    /// one write or none. Every slice is labelled with the group id (the first slice's id);
    /// the first slice's token is the group token, the others' are derived from it. Returns the
    /// group token and the slices' statuses in the order asked.
    #[cfg(test)]
    pub(crate) async fn create_group(
        &self,
        slices: Vec<CreateAllocation>,
        owner: Option<tessera_protocol::ProcessOwner>,
    ) -> Result<(String, Vec<AllocationStatus>), StateError> {
        self.create_group_by(slices, owner, &By::OPERATOR).await
    }

    /// [`Arbiter::create_group`] for `by`: every slice recorded as theirs, all within their
    /// quota together.
    pub(crate) async fn create_group_by(
        &self,
        slices: Vec<CreateAllocation>,
        owner: Option<tessera_protocol::ProcessOwner>,
        by: &By,
    ) -> Result<(String, Vec<AllocationStatus>), StateError> {
        use tessera_protocol::group::{LABEL_GPU_GROUP, MAX_GROUP_GPUS, slice_token};
        if slices.is_empty() || slices.len() > MAX_GROUP_GPUS {
            return Err(StateError::Invalid(format!(
                "{} GPUs asked, 1 to {MAX_GROUP_GPUS} allowed",
                slices.len()
            )));
        }
        let mut records = self.admin.lock().await;
        let mut next = records.clone();
        let group_token = store::new_token()?;
        let mut group_id: Option<String> = None;
        let mut made: Vec<AllocationRecord> = Vec::new();
        for mut req in slices {
            let gpu = self.check_create(&next, &req)?;
            by.check_quota(&next, &gpu, &req)?;
            if made.iter().any(|r| r.gpu_uuid == gpu.uuid) {
                return Err(StateError::Invalid(format!(
                    "GPU {} is asked twice; one slice per GPU",
                    gpu.index
                )));
            }
            let token = match group_id {
                None => group_token.clone(),
                Some(_) => slice_token(&group_token, &gpu.uuid),
            };
            let mut record = Self::new_record(
                &next,
                req.clone(),
                &gpu,
                token,
                owner,
                tessera_protocol::Tier::BestEffort,
            )?;
            record.uid = by.uid;
            let gid = group_id.get_or_insert_with(|| record.id.clone()).clone();
            req.labels.insert(LABEL_GPU_GROUP.to_owned(), gid);
            check_labels(&req.labels)?;
            record.labels = req.labels;
            next.push(record.clone());
            made.push(record);
        }
        self.persist_owned(owner.is_some(), next.clone()).await?;
        *records = next;
        drop(records);
        let ids: Vec<String> = made.iter().map(|r| r.id.clone()).collect();
        for r in made {
            self.insert_live(r);
        }
        let statuses = ids
            .iter()
            .map(|id| {
                self.status_of(id)
                    .ok_or_else(|| StateError::NotFound(id.clone()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((group_token, statuses))
    }
}

/// Changes to allocations that exist, and reading them back.
impl Arbiter {
    /// Deletes and persists. Live processes of the allocation keep their connection: their
    /// Reserves are denied from now on, Releases are still served, and the memory is counted
    /// until they exit.
    pub(crate) async fn delete(&self, id: &str) -> Result<(), StateError> {
        self.delete_by(id, &By::OPERATOR).await
    }

    /// [`Arbiter::delete`] if `by` may touch the allocation.
    pub(crate) async fn delete_by(&self, id: &str, by: &By) -> Result<(), StateError> {
        let mut records = self.admin.lock().await;
        let mut owned = false;
        if let Some(r) = records.iter().find(|r| r.id == id) {
            by.may_touch(r)?;
            owned = r.owner.is_some();
        }
        let next: Vec<_> = records.iter().filter(|r| r.id != id).cloned().collect();
        if next.len() == records.len() {
            return Err(StateError::NotFound(id.to_owned()));
        }
        self.persist_owned(owned, next.clone()).await?;
        *records = next;
        let mut live = self.live();
        if let Some(a) = live.by_id.remove(id) {
            live.tokens.remove(&a.record.token);
            if let Some(alias) = group_marker(&a.record) {
                live.tokens.remove(&alias);
            }
            // Ok(true): no process attached, the account is gone now.
            if live.ledger.close(a.key).unwrap_or(true) {
                drop(live);
                a.scheduler.remove_allocation(a.key, self.now_ns());
            }
        }
        Ok(())
    }

    /// Merges `labels` into an allocation's labels (an empty value removes the key) and
    /// persists, if `by` may touch the allocation; nothing changes if the result breaks the
    /// label bounds or cannot be written.
    pub(crate) async fn update_labels_by(
        &self,
        id: &str,
        labels: BTreeMap<String, String>,
        by: &By,
    ) -> Result<AllocationStatus, StateError> {
        let mut records = self.admin.lock().await;
        let Some(pos) = records.iter().position(|r| r.id == id) else {
            return Err(StateError::NotFound(id.to_owned()));
        };
        by.may_touch(&records[pos])?;
        let mut merged = records[pos].labels.clone();
        for (k, v) in labels {
            if v.is_empty() {
                merged.remove(&k);
            } else {
                merged.insert(k, v);
            }
        }
        check_labels(&merged)?;
        let mut next = records.clone();
        next[pos].labels = merged.clone();
        self.persist(next.clone()).await?;
        *records = next;
        if let Some(a) = self.live().by_id.get_mut(id) {
            a.record.labels = merged;
        }
        self.status_of(id)
            .ok_or_else(|| StateError::NotFound(id.to_owned()))
    }

    pub(super) async fn persist(&self, records: Vec<AllocationRecord>) -> Result<(), StateError> {
        let store = self.store.clone();
        let version = store.next_version();
        tokio::task::spawn_blocking(move || store.save_version(version, &records))
            .await
            .map_err(StateError::Internal)??;
        Ok(())
    }

    /// [`Arbiter::persist`], or, when the change is to an allocation owned by a process (`tessera
    /// run`'s), a write behind: the answer does not wait for the disk. Why: such an allocation
    /// lives only as long as its owner, and `tessera run`'s start-up waits for its create
    /// (issue 36); its file is not even fsynced (see [`crate::store`]). What a crash
    /// before the write costs fails closed: a created allocation is unknown after the restart
    /// (its processes are refused: no memory, no launches); a deleted one comes back with its
    /// owner gone, and the owner rule deletes it (see [`crate::owner`]). Writes are versioned,
    /// so a late one never puts back an older list ([`store::Store::save_version`]); a failed
    /// one is logged, and the next write carries the change.
    pub(super) async fn persist_owned(
        &self,
        owned: bool,
        records: Vec<AllocationRecord>,
    ) -> Result<(), StateError> {
        if !owned {
            return self.persist(records).await;
        }
        let store = self.store.clone();
        let version = store.next_version();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = store.save_version(version, &records) {
                tracing::error!("allocations not written (the next change writes them): {e}");
            }
        });
        Ok(())
    }

    /// Writes the current allocations again (at shutdown).
    pub(crate) async fn persist_all(&self) -> Result<(), StateError> {
        let records = self.admin.lock().await;
        self.persist(records.clone()).await
    }

    pub(super) fn status_of(&self, id: &str) -> Option<AllocationStatus> {
        let live = self.live();
        let a = live.by_id.get(id)?;
        let usage = live.ledger.usage(a.key)?;
        let r = &a.record;
        let now = self.now_ns();
        let gpu_time_10s_ns = a.scheduler.gpu_time_10s(a.key, now);
        let sched = a.scheduler.alloc_stats(a.key, now).unwrap_or_default();
        Some(AllocationStatus {
            id: r.id.clone(),
            gpu_index: r.gpu_index,
            gpu_uuid: r.gpu_uuid.clone(),
            memory_limit: r.memory_limit,
            memory_used: usage.in_use,
            processes: live.procs.get(&a.key).map_or(0, |p| p.len() as u32),
            share: r.share,
            cap: r.cap,
            gpu_time_10s_ns,
            labels: r.labels.clone(),
            created_unix: r.created_unix,
            enforced: a.counters.enforcements().iter().sum(),
            gpu_time_total_ns: sched.gpu_ns,
            throttled_total_ns: sched.throttled_ns,
            oom_refusals: a.counters.oom_refusals(),
            leases: sched.leases,
            owner: r.owner,
            orphaned: r
                .owner
                .is_some_and(|o| !crate::owner::alive(std::path::Path::new("/proc"), o)),
            tier: r.tier,
            owner_uid: r.uid,
        })
    }

    /// Every allocation with its use, ordered by GPU then creation.
    pub(crate) async fn list(&self) -> Vec<AllocationStatus> {
        let records = self.admin.lock().await;
        let mut out: Vec<_> = records
            .iter()
            .filter_map(|r| self.status_of(&r.id))
            .collect();
        // Stable: records are kept in creation order.
        out.sort_by_key(|a| a.gpu_index);
        out
    }
}
