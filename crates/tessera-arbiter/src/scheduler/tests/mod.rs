//! Scenario tests of the scheduler on a fake GPU and a fake clock ([`Sim`]), by concern, and
//! property tests against simple models (`props`).

use std::collections::HashMap;

use crate::ledger::{AccountKey, ConnId};

use super::*;

mod caps;
mod latency;
mod leases;
mod props;
mod shares;

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;

/// A fake GPU driven by a fake clock: every tenant process is backlogged (it asks for a
/// lease again as soon as it returns one) and uses its leases fully, unless it is idle.
struct Sim {
    s: GpuScheduler,
    now: u64,
    /// key of each connection.
    conns: HashMap<ConnId, AccountKey>,
    /// Connections currently wanting GPU time.
    active: HashMap<ConnId, bool>,
    /// Busy ns per key, as (time, ns) samples.
    busy: Vec<(AccountKey, u64, u64)>,
    lease: Option<Grant>,
    /// Per key: (idle ns at the start of each lease, busy ns past its deadline).
    lateness: HashMap<AccountKey, (u64, u64)>,
    /// Per key: durations of the leases granted.
    durations: HashMap<AccountKey, Vec<u64>>,
}

impl Sim {
    fn new() -> Self {
        Self {
            s: GpuScheduler::new(SchedulerParams::default()),
            now: 0,
            conns: HashMap::new(),
            active: HashMap::new(),
            busy: Vec::new(),
            lease: None,
            lateness: HashMap::new(),
            durations: HashMap::new(),
        }
    }

    fn alloc(&mut self, key: AccountKey, share: u32, cap: Option<u32>) {
        self.s.add_allocation(key, share, cap, self.now);
    }

    fn take(&mut self, grants: Vec<Grant>) {
        assert!(grants.len() <= 1, "one lease per GPU at a time");
        // The sim runs a lease whole: a revocation comes only with no lease out here.
        for r in self.s.take_revocations() {
            assert!(
                self.lease.is_none_or(|l| l.lease_id != r.lease_id),
                "the lease being run was revoked"
            );
        }
        if let Some(g) = grants.into_iter().next() {
            assert!(self.lease.is_none(), "granted while a lease is out");
            self.lease = Some(g);
        }
    }

    fn join(&mut self, key: AccountKey, conn: ConnId) {
        self.conns.insert(conn, key);
        self.active.insert(conn, true);
        let g = self.s.acquire(key, conn, self.now).unwrap();
        self.take(g);
    }

    fn leave(&mut self, conn: ConnId) {
        self.active.insert(conn, false);
        if self.lease.is_some_and(|l| l.conn == conn) {
            self.lease = None;
        }
        let g = self.s.connection_closed(conn, self.now);
        self.take(g);
    }

    /// Runs until `until`: the holder uses its whole lease, returns it, asks again.
    fn run(&mut self, until: u64) {
        while self.now < until {
            match self.lease.take() {
                Some(g) => {
                    let key = self.conns[&g.conn];
                    let (lag, over) = self.lateness.get(&key).copied().unwrap_or((0, 0));
                    self.durations.entry(key).or_default().push(g.duration_ns);
                    let held = g.duration_ns + over;
                    self.now += held;
                    self.busy.push((key, self.now, held.saturating_sub(lag)));
                    let grants = self.s.release(g.conn, g.lease_id, held, false, self.now);
                    self.take(grants);
                    if self.active[&g.conn] {
                        let grants = self.s.acquire(key, g.conn, self.now).unwrap();
                        self.take(grants);
                    }
                }
                None => match self.s.next_wakeup(self.now) {
                    Some(t) => {
                        self.now = t.max(self.now + 1);
                        let g = self.s.tick(self.now);
                        self.take(g);
                    }
                    None => self.now = until,
                },
            }
        }
    }

    /// Busy ns of `key` in (from, to]: a lease's busy time `ns` noted at `t` ran in
    /// (t - ns, t] (a window holds what ran inside it, as the engine's counters say).
    fn busy_of(&self, key: AccountKey, from: u64, to: u64) -> u64 {
        self.busy
            .iter()
            .filter(|(k, _, _)| *k == key)
            .map(|&(_, t, ns)| t.min(to).saturating_sub((t - ns).max(from)))
            .sum()
    }

    fn fraction(&self, key: AccountKey, from: u64, to: u64) -> f64 {
        self.busy_of(key, from, to) as f64 / (to - from) as f64 * 100.0
    }
}

/// What each tenant should get when all saturate the GPU: shares split the time, a cap is
/// a ceiling, and what a capped tenant cannot take goes to the others by their shares.
fn fair_with_caps(tenants: &[(u32, Option<u32>)]) -> Vec<f64> {
    let mut got = vec![None; tenants.len()];
    loop {
        let left = 100.0 - got.iter().flatten().sum::<f64>();
        let weight: f64 = tenants
            .iter()
            .zip(&got)
            .filter(|(_, g)| g.is_none())
            .map(|(t, _)| f64::from(t.0))
            .sum();
        let mut fixed = false;
        for (t, g) in tenants.iter().zip(got.iter_mut()) {
            let cap = t.1.map_or(100.0, f64::from);
            if g.is_none() && left * f64::from(t.0) / weight > cap {
                *g = Some(cap);
                fixed = true;
            }
        }
        if !fixed {
            return tenants
                .iter()
                .zip(got)
                .map(|(t, g)| g.unwrap_or(left * f64::from(t.0) / weight))
                .collect();
        }
    }
}
