//! The tenant socket's side of the state: connections attached to allocations, the ledger
//! operations their requests make, the memory wait and the pressure hub, and the close.

#[allow(unused_imports)]
use super::*;

impl Arbiter {
    /// How long a reservation that does not fit may wait, while other processes of its
    /// allocation hold memory, for them to give back unused credit or free what they hold
    /// (`--memory-wait-ms`, [`DEFAULT_MEMORY_WAIT`] by default).
    pub(crate) fn memory_wait(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.memory_wait_ns.load(Ordering::Relaxed))
    }

    /// Sets [`Arbiter::memory_wait`] (at start-up, from the configuration).
    pub(crate) fn set_memory_wait(&self, wait: std::time::Duration) {
        self.memory_wait_ns
            .store(wait.as_nanos() as u64, Ordering::Relaxed);
    }

    /// A new connection number.
    pub(crate) fn next_conn(&self) -> ConnId {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Handshake of a tenant: finds the allocation of `token` and attaches `conn` to it.
    pub(crate) fn attach_tenant(
        &self,
        token: &str,
        conn: ConnId,
        peer: Option<Peer>,
    ) -> Option<TenantBinding> {
        let mut live = self.live();
        let id = live.tokens.get(token)?.clone();
        let (key, view, scheduler, counters) = {
            let a = live.by_id.get(&id)?;
            (
                a.key,
                view(&a.record),
                a.scheduler.clone(),
                Arc::clone(&a.counters),
            )
        };
        live.ledger.attach(key, conn).ok()?;
        let pk = proc_key(peer.as_ref().map(|p| p.id), conn);
        let entry = live
            .procs
            .entry(key)
            .or_default()
            .entry(pk)
            .or_insert(ProcEntry {
                conns: 0,
                conn_ids: Vec::new(),
                peer,
            });
        entry.conns += 1;
        entry.conn_ids.push(conn);
        Some(TenantBinding {
            key,
            view,
            scheduler,
            counters,
        })
    }

    /// A tenant connection of allocation `id` broke the protocol (released more than it held,
    /// redeclared out of turn, ...) and is being closed; returns the allocation's count of such
    /// closings since the arbiter started (0 once the allocation is deleted), for the log.
    pub(crate) fn note_violation(&self, id: &str) -> u64 {
        self.live().by_id.get_mut(id).map_or(0, |a| {
            a.violations += 1;
            a.violations
        })
    }

    /// The registry of tenant processes' pressure channels.
    pub(crate) fn pressure(&self) -> &PressureHub {
        &self.pressure
    }

    /// Runs `f` on the ledger under the live lock (the tenant hot path).
    pub(crate) fn with_ledger<R>(&self, f: impl FnOnce(&mut Ledger) -> R) -> R {
        f(&mut self.live().ledger)
    }

    /// The process that made tenant connection `conn` of account `key` (as the kernel named
    /// it at the connection), if known.
    pub(crate) fn conn_process(&self, key: AccountKey, conn: ConnId) -> Option<ProcId> {
        let live = self.live();
        live.procs.get(&key)?.iter().find_map(|(pk, e)| match pk {
            ProcKey::Proc(id) if e.conn_ids.contains(&conn) => Some(*id),
            _ => None,
        })
    }

    /// Bytes of account `key` held by connections whose process has exited but which do not
    /// drain yet: their threads have not read the end of their streams (a batch-scheduled
    /// thread on a loaded host can take longer than the memory wait), so they will drain and
    /// be released within [`crate::drain::DRAIN_BOUND`]. Each process is asked (a poll of its
    /// pidfd) under the live lock: called only by a reservation about to be refused.
    pub(crate) fn exited_held(&self, key: AccountKey) -> u64 {
        let live = self.live();
        let Some(procs) = live.procs.get(&key) else {
            return 0;
        };
        procs
            .values()
            .filter(|e| e.peer.as_ref().is_some_and(crate::peer::Peer::has_exited))
            .flat_map(|e| e.conn_ids.iter())
            .map(|c| live.ledger.held_undrained(key, *c))
            .fold(0u64, u64::saturating_add)
    }

    /// A tenant connection closed: frees what it held. Returns the bytes freed.
    pub(crate) fn detach_tenant(
        &self,
        binding: &TenantBinding,
        conn: ConnId,
        peer: Option<ProcId>,
    ) -> Result<u64, LedgerError> {
        // The scheduler forgets the connection first, so that by the time `list` shows the
        // process gone no lease can still go to it.
        binding.scheduler.connection_closed(conn, self.now_ns());
        let (freed, gone) = {
            let mut live = self.live();
            let freed = live.ledger.detach(binding.key, conn)?;
            if let Some(procs) = live.procs.get_mut(&binding.key) {
                let pk = proc_key(peer, conn);
                if let Some(e) = procs.get_mut(&pk) {
                    e.conns -= 1;
                    e.conn_ids.retain(|c| *c != conn);
                    if e.conns == 0 {
                        procs.remove(&pk);
                        // Its last connection: an owned allocation may now be empty of
                        // processes, and deleted without waiting for the reaper's tick.
                        self.reap_soon();
                    }
                }
            }
            let gone = live.ledger.usage(binding.key).is_none();
            if gone {
                live.procs.remove(&binding.key);
            }
            (freed, gone)
        };
        // The scheduler forgets a deleted allocation once its last process is gone.
        if gone {
            binding
                .scheduler
                .remove_allocation(binding.key, self.now_ns());
        }
        Ok(freed)
    }
}
