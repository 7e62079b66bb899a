//! What the backstop and the metrics read of the state and report back: the allocations as the
//! backstop sees them, GPU time and enforcement notes, the lease totals and unleased charges, the
//! snapshot the metrics render.

#[allow(unused_imports)]
use super::*;

impl Arbiter {
    /// The backstop acted on a process of allocation `id` (shown by `List`, counted by
    /// reason in the metrics).
    pub(crate) fn note_enforced(&self, id: &str, why: EnforceReason) {
        if let Some(a) = self.live().by_id.get(id) {
            a.counters.enforced(why);
        }
    }

    /// The backstop read `ns` of GPU time used by allocation `id`'s processes (from NVML).
    pub(crate) fn note_gpu_busy(&self, id: &str, ns: u64) {
        if let Some(a) = self.live().by_id.get(id) {
            a.counters.add_gpu_busy(ns);
        }
    }

    /// Tenant requests by kind (the tenant connections count them).
    pub(crate) fn requests(&self) -> &RequestStats {
        &self.requests
    }

    /// Every live allocation and GPU with its counters, for a scrape. The live lock is held
    /// only to copy the allocations out; each scheduler is then locked once.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let now = self.now_ns();
        let mut rows: Vec<(AllocSample, AccountKey, SchedulerHandle)> = {
            let live = self.live();
            live.by_id
                .values()
                .map(|a| {
                    let r = &a.record;
                    let label = |k: &str| r.labels.get(k).filter(|v| !v.is_empty()).cloned();
                    let sample = AllocSample {
                        id: r.id.clone(),
                        gpu_index: r.gpu_index,
                        gpu_uuid: r.gpu_uuid.clone(),
                        pod: [
                            label(LABEL_NAMESPACE),
                            label(LABEL_POD),
                            label(LABEL_CONTAINER),
                        ],
                        memory_limit: r.memory_limit,
                        memory_used: live.ledger.usage(a.key).map_or(0, |u| u.in_use),
                        share: r.share,
                        cap: r.cap,
                        tier: r.tier,
                        processes: live.procs.get(&a.key).map_or(0, |p| p.len() as u32),
                        sched: Default::default(),
                        oom_refusals: a.counters.oom_refusals(),
                        enforced: a.counters.enforcements(),
                        gpu_busy_ns: a.counters.gpu_busy_ns(),
                    };
                    (sample, a.key, a.scheduler.clone())
                })
                .collect()
        };
        rows.sort_by(|a, b| (a.0.gpu_index, &a.0.id).cmp(&(b.0.gpu_index, &b.0.id)));
        let mut gpus: Vec<GpuSample> = self
            .gpus()
            .iter()
            .map(|g| GpuSample {
                index: g.index,
                uuid: g.uuid.clone(),
                memory_total: Some(g.memory_total),
                ..Default::default()
            })
            .collect();
        for (a, _, _) in &rows {
            let i = match gpus.iter().position(|g| g.uuid == a.gpu_uuid) {
                Some(i) => i,
                None => {
                    gpus.push(GpuSample {
                        index: a.gpu_index,
                        uuid: a.gpu_uuid.clone(),
                        ..Default::default()
                    });
                    gpus.len() - 1
                }
            };
            let g = &mut gpus[i];
            g.memory_promised = g.memory_promised.saturating_add(a.memory_limit);
            g.shares += a.share;
            g.allocations += 1;
        }
        let schedulers = self.schedulers.lock().clone();
        for g in &mut gpus {
            let Some(sched) = schedulers.get(&g.uuid) else {
                continue;
            };
            let keys: Vec<AccountKey> = rows
                .iter()
                .filter(|r| r.2.uuid() == g.uuid)
                .map(|r| r.1)
                .collect();
            let (busy, per) = sched.stats(&keys, now);
            g.busy_ns = busy;
            let mut per = per.into_iter();
            for r in rows.iter_mut().filter(|r| r.2.uuid() == g.uuid) {
                r.0.sched = per.next().flatten().unwrap_or_default();
            }
        }
        Snapshot {
            allocs: rows.into_iter().map(|r| r.0).collect(),
            gpus,
            tenant_connections: 0,
        }
    }

    /// Every live allocation with the processes connected for it (for the backstop).
    pub(crate) fn watched(&self) -> Vec<Watched> {
        let devices = self.gpus();
        let live = self.live();
        let index_of = |uuid: &str| {
            devices
                .iter()
                .find(|g| g.uuid.eq_ignore_ascii_case(uuid))
                .map(|g| g.index)
        };
        fn group_of(r: &AllocationRecord) -> Option<&String> {
            (r.share >= 100)
                .then(|| r.labels.get(tessera_protocol::LABEL_WHOLE_GROUP))
                .flatten()
        }
        // The cards a whole-card allocation's processes hold: its own and its group's.
        let whole_gpus = |r: &AllocationRecord| -> Vec<u32> {
            if r.share < 100 {
                return Vec::new();
            }
            let mut gpus: Vec<u32> = index_of(&r.gpu_uuid).into_iter().collect();
            if let Some(group) = group_of(r) {
                gpus.extend(
                    live.by_id
                        .values()
                        .filter(|b| group_of(&b.record) == Some(group))
                        .filter_map(|b| index_of(&b.record.gpu_uuid)),
                );
            }
            gpus.sort_unstable();
            gpus.dedup();
            gpus
        };
        let listed: Vec<(Watched, Vec<Peer>)> = live
            .by_id
            .values()
            .map(|a| {
                let mut pids = Vec::new();
                let mut peers = Vec::new();
                for (k, e) in live.procs.get(&a.key).into_iter().flatten() {
                    match (k, &e.peer) {
                        (ProcKey::Proc(_), Some(p)) => peers.push(p.clone()),
                        (ProcKey::Proc(id), None) => pids.push(*id),
                        (ProcKey::Conn(_), _) => {}
                    }
                }
                let w = Watched {
                    id: a.record.id.clone(),
                    limit: a.record.memory_limit,
                    token: a.record.token.clone(),
                    share: a.record.share,
                    whole_gpus: whole_gpus(&a.record),
                    gpu: index_of(&a.record.gpu_uuid),
                    group: a
                        .record
                        .labels
                        .get(tessera_protocol::group::LABEL_GPU_GROUP)
                        .cloned(),
                    pids,
                };
                (w, peers)
            })
            .collect();
        drop(live);
        // Outside the lock (a syscall per connected process): a process that exited names
        // nobody, whoever keeps its connection open.
        listed
            .into_iter()
            .map(|(mut w, peers)| {
                w.pids
                    .extend(peers.iter().filter(|p| p.is_alive()).map(|p| p.id));
                w
            })
            .collect()
    }

    /// Owned allocations: id, owner, how many processes of it are connected, and whether it
    /// was restored from the state file (created before this arbiter started; for the reaper,
    /// see [`crate::owner`]).
    pub(crate) fn owned(&self) -> Vec<(String, tessera_protocol::ProcessOwner, usize, bool)> {
        let live = self.live();
        live.by_id
            .values()
            .filter_map(|a| {
                let o = a.record.owner?;
                let connected = live.procs.get(&a.key).map_or(0, |p| p.len());
                let restored = a.record.created_unix < self.started_unix;
                Some((a.record.id.clone(), o, connected, restored))
            })
            .collect()
    }

    /// Asks the reaper ([`crate::reaper`]) to look at the owned allocations now, not at its
    /// next tick (several asks before it looks are one look).
    pub(crate) fn reap_soon(&self) {
        self.reap_now.notify_one();
    }

    /// What [`Arbiter::reap_soon`] wakes: held by a task watching an owner's exit.
    pub(crate) fn reap_signal(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.reap_now)
    }

    /// The processes the backstop attributed to owned allocations through their owner.
    pub(crate) fn members(&self) -> MutexGuard<'_, crate::owner::Members> {
        self.members.lock()
    }

    /// Allocation `id`'s account and its GPU's scheduler (`None`: no such live allocation),
    /// taken out of the live lock so the scheduler is locked without it.
    fn scheduler_of(&self, id: &str) -> Option<(AccountKey, SchedulerHandle)> {
        self.live()
            .by_id
            .get(id)
            .map(|a| (a.key, a.scheduler.clone()))
    }

    /// The GPU (UUID) allocation `id` is scheduled on, the GPU time granted to it in leases
    /// so far, ns, and whether it is capped (for the backstop, which keeps one slack budget
    /// per GPU and returns a capped allocation's idle lease time to its cap).
    pub(crate) fn leased_total(&self, id: &str) -> Option<(String, u64, bool)> {
        let (key, sched) = self.scheduler_of(id)?;
        let (leased, capped) = sched.leased_total(key, self.now_ns())?;
        Some((sched.uuid().to_owned(), leased, capped))
    }

    /// Returns `ns` of lease time allocation `id` held without using it (the card's
    /// measure, read by the backstop) to its cap, not its share.
    pub(crate) fn refund_cap(&self, id: &str, ns: u64) {
        if let Some((key, sched)) = self.scheduler_of(id) {
            sched.refund_cap(key, ns, self.now_ns());
        }
    }

    /// Counts GPU time allocation `id` used outside its leases, forgiven from its GPU's slack,
    /// against its cap (not its share).
    pub(crate) fn count_for_cap(&self, id: &str, ns: u64) {
        if let Some((key, sched)) = self.scheduler_of(id) {
            sched.count_for_cap(key, ns, self.now_ns());
        }
    }

    /// Charges GPU time allocation `id` used outside its leases (seen by the backstop).
    pub(crate) fn charge_unleased(&self, id: &str, ns: u64) {
        if let Some((key, sched)) = self.scheduler_of(id) {
            sched.charge_unleased(key, ns, self.now_ns());
        }
    }

    /// Every live connected process (named by its pidfd) with its account, its oldest
    /// connection, the most its connections held in the ledger since the last call (their
    /// excess left out; see [`Ledger::take_peak`]), and the card (NVML index) of that account
    /// when it is one slice of a multi-GPU allocation (such a process's card memory is compared
    /// per card; other accounts' over all cards). The backstop's one caller: the peak covers
    /// the card figures it read before this call, however long it was descheduled between.
    pub(crate) fn connected_processes(
        &self,
    ) -> Vec<(AccountKey, ProcId, ConnId, u64, Option<u32>)> {
        let devices = self.gpus();
        let mut guard = self.live();
        let live = &mut *guard;
        let slice_card: HashMap<AccountKey, u32> = live
            .by_id
            .values()
            .filter(|a| {
                a.record
                    .labels
                    .contains_key(tessera_protocol::group::LABEL_GPU_GROUP)
            })
            .filter_map(|a| {
                devices
                    .iter()
                    .find(|g| g.uuid.eq_ignore_ascii_case(&a.record.gpu_uuid))
                    .map(|g| (a.key, g.index))
            })
            .collect();
        let mut out = Vec::new();
        for (key, procs) in &live.procs {
            for (pk, e) in procs {
                let (ProcKey::Proc(id), Some(peer)) = (pk, &e.peer) else {
                    continue;
                };
                let Some(&first) = e.conn_ids.first() else {
                    continue;
                };
                if !peer.is_alive() {
                    continue;
                }
                let held: u64 = e
                    .conn_ids
                    .iter()
                    .filter_map(|c| live.ledger.take_peak(*key, *c))
                    .sum();
                out.push((*key, *id, first, held, slice_card.get(key).copied()));
            }
        }
        out
    }

    /// See [`Ledger::set_excess`]; a connection gone since is ignored.
    pub(crate) fn set_excess(&self, key: AccountKey, conn: ConnId, bytes: u64) {
        let _ = self.live().ledger.set_excess(key, conn, bytes);
    }
}
