//! The compute rule: GPU time used outside leases, per GPU, against one slack budget.

#[allow(unused_imports)]
use super::*;

/// Weight of an interval's GPU time in [`Debt`]'s recent sums, one interval later: about the
/// last 2 s (8 polls of 250 ms) count.
const RECENT_DECAY: f64 = 0.875;
/// The same for [`Debt`]'s long sums: about the last 10 s (40 polls of 250 ms).
const LONG_DECAY: f64 = 0.975;

/// Per allocation: GPU time its processes used against the leases it was granted; per GPU:
/// one slack budget that all its allocations draw on.
#[derive(Debug, Default)]
pub(crate) struct ComputeBook {
    per: HashMap<String, Debt>,
}

#[derive(Debug)]
struct Debt {
    /// The scheduler's lease total at the last observation.
    leased_seen: u64,
    /// Unleased GPU time built up, ns; down to minus one poll interval (kernel time is
    /// reported when a kernel ends, lease time as it passes, so the two drift apart briefly).
    debt_ns: i128,
    /// GPU time used and leased over the last few intervals (each interval weighs
    /// [`RECENT_DECAY`] less than the next): an allocation in debt is acted on only if it ran
    /// mostly outside leases over them too, so a tenant that leases is never caught up in a
    /// neighbour's bypass because of one bad interval (its kernels stuck behind the bypass
    /// kernels finish after its lease).
    recent_used: f64,
    recent_leased: f64,
    /// GPU time used and leased over a longer past (each interval weighs [`LONG_DECAY`] less
    /// than the next), without the floor on debt: an allocation is acted on only if it used
    /// more than it was leased over it. A tenant whose leases ran idle while its kernels
    /// waited behind a neighbour's bypass kernels paid for them in advance; when they run,
    /// after its leases, it is not a bypasser (its drift is still charged). Leases bank for
    /// at most this long, and only as far as they were granted (its share).
    long_used: f64,
    long_leased: f64,
    /// Its debt went beyond the tolerance since it was last below zero: the tolerance is not
    /// given again until it is (an allocation acted on, its debt cleared, that goes on
    /// bypassing is charged all of it, not a tolerance's worth less after every verdict).
    spent: bool,
}

/// One allocation's GPU time over the last interval, for [`ComputeBook::observe_gpu`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ComputeUse<'a> {
    /// Its public id.
    pub id: &'a str,
    /// GPU time its processes used during the interval, ns.
    pub used_ns: u64,
    /// Its lease total so far (the scheduler's), ns.
    pub leased_total: u64,
    /// It has a cap: lease time it held idle while alone on the GPU is returned to the cap
    /// (see [`ComputeVerdict::refund_ns`]).
    pub capped: bool,
}

/// What one observation of an allocation's GPU time calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ComputeVerdict {
    /// GPU time to charge to its virtual time (used beyond its leases and its part of the
    /// GPU's slack), ns.
    pub charge_ns: u64,
    /// Unleased GPU time built up, ns (after this observation).
    pub unleased_ns: u64,
    /// GPU time it used outside its leases in the interval that the slack forgave, ns (not
    /// charged to its share, but counted against a cap).
    pub forgiven_ns: u64,
    /// True when the GPU's unleased time passed the threshold and this allocation is one to act
    /// on (its debt is then cleared: the caller acts).
    pub over: bool,
    /// Capped allocations only: lease time it held in the interval without using it, as the
    /// card measured, to be returned to its cap (not its share), ns. Only while it is the only
    /// allocation on the GPU that used GPU time or held a lease: its idle is then its own,
    /// whereas beside others NVML's per-process attribution comes in lumps (on the H200, 200
    /// ms periods given to one process; see `DEFAULT_COMPUTE_TOLERANCE`), so one tenant's
    /// idle could not be told from a neighbour's use.
    pub refund_ns: u64,
}

/// Splits `budget` over `needs` max-min fairly: a need below the fair part is met in full and
/// what it leaves goes to the larger ones, so small overruns are forgiven whole however many
/// allocations bypass beside them, and together they never get more than `budget`.
pub(super) fn share_out(needs: &[i128], budget: i128) -> Vec<i128> {
    let mut order: Vec<usize> = (0..needs.len()).collect();
    order.sort_by_key(|&i| needs[i]);
    let mut given = vec![0; needs.len()];
    let (mut left, mut n) = (budget.max(0), needs.len() as i128);
    for i in order {
        let part = (left / n).min(needs[i].max(0));
        given[i] = part;
        left -= part;
        n -= 1;
    }
    given
}

impl ComputeBook {
    /// Records one interval of one GPU: each allocation `uses` names used `used_ns` of GPU time
    /// during the last `elapsed_ns`, and its leases total `leased_total` ns so far. Returns a
    /// verdict per entry, in order. The first observation of an allocation only sets its
    /// starting point.
    ///
    /// Time used beyond an allocation's leases (its own unused lease time of the last interval
    /// pays first) draws on the GPU's slack, `compute_slack` of the interval for all its
    /// allocations together, shared out max-min fairly, first among the allocations that
    /// leased in the interval (the slack is there for their overruns), then among the others:
    /// kernels overrunning a lease are forgiven, but ten allocations cannot each take the
    /// slack, nor crowd a leasing tenant out of it. What the slack does not
    /// cover is debt: charged when it grows (to the allocation's virtual time) and counted
    /// towards the kill rule.
    ///
    /// The kill rule is per GPU too: when the debts of the allocations that ran mostly outside
    /// leases, in this interval and over the last few, and used more than they leased over
    /// the last several seconds, add up to more than the threshold, each of them is acted on
    /// (one allocation alone: its own debt against the threshold). A tenant that takes part in leasing has its drift (kernels finishing after
    /// a revoked lease, local leases while the arbiter restarted) charged to its share, never
    /// punished, and nothing is acted on unless `may_act` (the caller's warm-up after an
    /// arbiter start is over).
    pub(crate) fn observe_gpu(
        &mut self,
        uses: &[ComputeUse<'_>],
        elapsed_ns: u64,
        policy: &Policy,
        may_act: bool,
    ) -> Vec<ComputeVerdict> {
        let nothing = ComputeVerdict {
            charge_ns: 0,
            unleased_ns: 0,
            forgiven_ns: 0,
            over: false,
            refund_ns: 0,
        };
        let mut verdicts = vec![nothing; uses.len()];
        // (index, debt before, debt before the slack, leased this interval, no tolerance) of
        // the allocations seen before.
        let mut rows = Vec::new();
        // Allocations that used GPU time or held a lease in the interval (or whose first
        // sight says nothing yet): a capped one is refunded its idle only when it is the one.
        let mut active = 0usize;
        for (i, u) in uses.iter().enumerate() {
            let Some(d) = self.per.get_mut(u.id) else {
                active += 1;
                self.per.insert(
                    u.id.to_owned(),
                    Debt {
                        leased_seen: u.leased_total,
                        debt_ns: 0,
                        recent_used: 0.0,
                        recent_leased: 0.0,
                        long_used: 0.0,
                        long_leased: 0.0,
                        spent: false,
                    },
                );
                continue;
            };
            let leased = u.leased_total.saturating_sub(d.leased_seen);
            d.leased_seen = u.leased_total;
            if leased > 0 || u.used_ns > 0 {
                active += 1;
            }
            let pre = d.debt_ns + i128::from(u.used_ns) - i128::from(leased);
            // Whether it takes part in leasing (at least half its GPU time leased over the
            // recent intervals, this one included): only such an allocation's excursions can
            // be NVML's lumps; one that bypasses gets no tolerance (ten bypassers would each
            // take a tolerance's worth, as they each took a slack of their own before).
            let leasing = (d.recent_leased * RECENT_DECAY + leased.min(elapsed_ns) as f64) * 2.0
                >= d.recent_used * RECENT_DECAY + u.used_ns as f64;
            rows.push((i, d.debt_ns, pre, leased, d.spent || !leasing));
        }
        // Allocations that leased in the interval draw on the slack first (it is there for
        // their overruns), the others get what is left.
        let budget = (elapsed_ns as f64 * policy.compute_slack) as i128;
        let mut given = vec![0; rows.len()];
        let mut left = budget;
        for leasing in [true, false] {
            let tier: Vec<usize> = (0..rows.len())
                .filter(|&r| (rows[r].3 > 0) == leasing)
                .collect();
            let needs: Vec<i128> = tier.iter().map(|&r| rows[r].2.max(0)).collect();
            for (&r, g) in tier.iter().zip(share_out(&needs, left)) {
                given[r] = g;
                left -= g;
            }
        }
        // NVML's attribution comes in lumps of its sample periods (see
        // `DEFAULT_COMPUTE_TOLERANCE`): only debt beyond the tolerance is charged. The floor
        // stays one interval, so leases held idle still buy nothing later.
        let tolerance = policy.compute_tolerance.as_nanos() as i128;
        let floor = -(elapsed_ns as i128);
        let mut candidates = Vec::new();
        for (&(i, before, pre, leased, no_tolerance), slack) in rows.iter().zip(given) {
            let t = if no_tolerance { 0 } else { tolerance };
            let beyond = |x: i128| (x - t).max(0);
            // Alone and capped, the lease time it held idle in this interval goes back to its
            // cap at once, and its time beyond its leases is not forgiven from the slack (it
            // is the only one on the GPU; forgiven, kernel time reported a poll late would be
            // refunded as idle in one poll and forgiven in the next). Refunded time leaves the
            // balance, so it cannot also pay for unleased time later; late kernel time is debt
            // that the next idle pays off before anything is refunded again.
            let refunding = uses[i].capped && active == 1;
            let mut debt = if refunding { pre } else { pre - slack }.max(floor);
            if refunding {
                let idle = i128::from(leased) - i128::from(uses[i].used_ns);
                let back = (-debt).min(idle).max(0);
                verdicts[i].refund_ns = back as u64;
                debt += back;
            }
            // Only debt that grows beyond the tolerance is charged: kernel time reported a
            // poll late first pays back lease time it was granted earlier.
            verdicts[i].charge_ns = (beyond(debt) - beyond(before)).max(0) as u64;
            // This interval's new unleased time beyond the tolerance, less what was charged.
            let new_unleased = (beyond(pre) - beyond(before)).max(0);
            verdicts[i].forgiven_ns =
                (new_unleased - i128::from(verdicts[i].charge_ns)).max(0) as u64;
            verdicts[i].unleased_ns = debt.max(0) as u64;
            // Debt from the warm-up is charged but never counted towards a kill: after an
            // arbiter restart tenants ran on local leases it never granted, and samples from
            // before the start arrive with the first polls.
            let kept = if may_act { debt } else { debt.min(0) };
            let used = uses[i].used_ns;
            let Some(d) = self.per.get_mut(uses[i].id) else {
                continue;
            };
            d.debt_ns = kept;
            // A refund means it was below zero (held idle) before the refund.
            d.spent = (d.spent || debt > t) && debt >= 0 && verdicts[i].refund_ns == 0;
            d.recent_used = d.recent_used * RECENT_DECAY + used as f64;
            // At most an interval's worth: one GPU holds one lease at a time, and leases held
            // idle must not buy a bypass later.
            d.recent_leased = d.recent_leased * RECENT_DECAY + leased.min(elapsed_ns) as f64;
            d.long_used = d.long_used * LONG_DECAY + used as f64;
            d.long_leased = d.long_leased * LONG_DECAY + leased.min(elapsed_ns) as f64;
            let mostly_unleased = u128::from(leased) * 2 < u128::from(used)
                && d.recent_leased * 2.0 < d.recent_used
                && d.long_leased < d.long_used;
            if kept > 0 && mostly_unleased {
                candidates.push(i);
            }
        }
        // The neighbours lost the candidates' debts together: past the threshold every one of
        // them goes (one at a time, the rest would each have the threshold again).
        let total: u64 = candidates.iter().map(|&i| verdicts[i].unleased_ns).sum();
        if total > policy.compute_threshold.as_nanos() as u64 {
            for i in candidates {
                verdicts[i].over = true;
                if let Some(d) = self.per.get_mut(uses[i].id) {
                    d.debt_ns = 0;
                }
            }
        }
        verdicts
    }

    /// Forgets allocations no longer live.
    pub(crate) fn retain(&mut self, live: &HashSet<&str>) {
        self.per.retain(|id, _| live.contains(id.as_str()));
    }
}

/// The process of `group` (pid, GPU ns) to kill for a compute breach: one that never
/// connected first, then the one with the most GPU time.
pub(crate) fn compute_culprit(
    group: &[(i32, u64)],
    connected: &HashSet<i32>,
) -> Option<(i32, u64)> {
    group
        .iter()
        .filter(|(_, ns)| *ns > 0)
        .min_by_key(|(pid, ns)| (connected.contains(pid), std::cmp::Reverse(*ns), *pid))
        .copied()
}

/// The compute rule applied each poll: per GPU, against its leases and one slack.
impl Backstop {
    /// The compute rule over one interval; charges what was used outside leases.
    pub(super) fn compute(
        &mut self,
        watched: &[Watched],
        rows: &[TimeRow],
        elapsed: u64,
    ) -> Vec<Action> {
        let mut busy = vec![0u64; watched.len()];
        let mut groups: Vec<Vec<(i32, u64)>> = vec![Vec::new(); watched.len()];
        for r in rows {
            busy[r.allocation] += r.all_ns;
            if r.policed_ns > 0 {
                groups[r.allocation].push((r.pid, r.policed_ns));
            }
        }
        let live: HashSet<&str> = watched.iter().map(|w| w.id.as_str()).collect();
        self.book.retain(&live);
        // Policed allocations by GPU: each GPU has one slack budget.
        let mut per_gpu: HashMap<String, Vec<(usize, u64, u64, bool)>> = HashMap::new();
        for (i, (w, group)) in watched.iter().zip(&groups).enumerate() {
            if busy[i] > 0 {
                self.arb.note_gpu_busy(&w.id, busy[i]);
            }
            let used: u64 = group.iter().map(|(_, ns)| ns).sum();
            let (gpu, leased, capped) = if w.share < 100 {
                let Some(at) = self.arb.leased_total(&w.id) else {
                    continue;
                };
                at
            } else {
                // A whole-card allocation is policed only on cards it does not own, where no
                // lease of its covers anything; that time draws on a budget of its own.
                (format!("whole-card {}", w.id), 0, false)
            };
            per_gpu
                .entry(gpu)
                .or_default()
                .push((i, used, leased, capped));
        }
        let may_act = self.started.elapsed() >= COMPUTE_WARMUP;
        let mut actions = Vec::new();
        // Time on a card outside the allocation: over a limit of zero, no lease, no slack
        // (its context there holds memory too, so the memory rule usually acts first).
        for r in rows.iter().filter(|r| r.outside_ns > 0 && may_act) {
            let w = &watched[r.allocation];
            actions.push(Action {
                pid: r.pid,
                allocation: Some(w.id.clone()),
                unconnected: !w.pids.iter().any(|p| p.pid == r.pid),
                reason: Reason::Compute {
                    gpu_ns: r.outside_ns,
                    unleased_ns: r.outside_ns,
                },
            });
        }
        for rows in per_gpu.values() {
            let uses: Vec<ComputeUse<'_>> = rows
                .iter()
                .map(|&(i, used_ns, leased_total, capped)| ComputeUse {
                    id: &watched[i].id,
                    used_ns,
                    leased_total,
                    capped,
                })
                .collect();
            let verdicts = self.book.observe_gpu(&uses, elapsed, &self.policy, may_act);
            for (&(i, _, _, _), v) in rows.iter().zip(verdicts) {
                let w = &watched[i];
                if v.forgiven_ns > 0 {
                    self.arb.count_for_cap(&w.id, v.forgiven_ns);
                }
                if v.refund_ns > 0 {
                    self.arb.refund_cap(&w.id, v.refund_ns);
                }
                if v.charge_ns > 0 {
                    self.arb.charge_unleased(&w.id, v.charge_ns);
                    self.counters
                        .charged_ns
                        .fetch_add(v.charge_ns, Ordering::Relaxed);
                }
                if v.over {
                    let connected: HashSet<i32> = w.pids.iter().map(|p| p.pid).collect();
                    if let Some((pid, ns)) = compute_culprit(&groups[i], &connected) {
                        actions.push(Action {
                            pid,
                            allocation: Some(w.id.clone()),
                            unconnected: !connected.contains(&pid),
                            reason: Reason::Compute {
                                gpu_ns: ns,
                                unleased_ns: v.unleased_ns,
                            },
                        });
                    }
                }
            }
        }
        actions
    }
}
