//! The memory rule: each allocation's processes against its limit, per card, and what the
//! card holds for a process beyond its reservations.

#[allow(unused_imports)]
use super::*;

/// Device memory per pid (one pid may appear on several GPUs).
pub(crate) fn memory_per_pid(procs: &[GpuProcess]) -> HashMap<i32, u64> {
    let mut per_pid: HashMap<i32, u64> = HashMap::new();
    for p in procs {
        *per_pid.entry(p.pid).or_default() += p.used;
    }
    per_pid
}

/// True when `gpu` is a card the owner of a process holds wholly (see
/// [`Watched::whole_gpus`]): what its processes do there is not policed.
fn on_own_whole_card(watched: &[Watched], owner: Option<&Owner>, gpu: u32) -> bool {
    matches!(owner, Some(Owner::Allocation(i)) if watched[*i].whole_gpus.contains(&gpu))
}

/// Device memory per pid that the memory rule polices: all of it, less what a process of a
/// whole-card allocation holds on the cards that allocation holds wholly.
#[cfg(test)]
pub(crate) fn policed_memory(
    watched: &[Watched],
    procs: &[GpuProcess],
    owners: &HashMap<i32, Owner>,
) -> HashMap<i32, u64> {
    let mut per_pid: HashMap<i32, u64> = HashMap::new();
    for p in procs {
        if !on_own_whole_card(watched, owners.get(&p.pid), p.gpu) {
            *per_pid.entry(p.pid).or_default() += p.used;
        }
    }
    per_pid
}

/// GPU time per pid over all GPUs, and the part the compute rule polices (the same, less a
/// whole-card allocation's time on the cards it holds wholly), from time per (pid, GPU).
#[cfg(test)]
pub(crate) fn policed_gpu_time(
    watched: &[Watched],
    per_gpu: &HashMap<(i32, u32), u64>,
    owners: &HashMap<i32, Owner>,
) -> (HashMap<i32, u64>, HashMap<i32, u64>) {
    let (mut all, mut policed): (HashMap<i32, u64>, HashMap<i32, u64>) = Default::default();
    for (&(pid, gpu), &ns) in per_gpu {
        *all.entry(pid).or_default() += ns;
        if !on_own_whole_card(watched, owners.get(&pid), gpu) {
            *policed.entry(pid).or_default() += ns;
        }
    }
    (all, policed)
}

/// Device memory of one process charged to one owner: for a slice of a multi-GPU
/// allocation, what the process holds on that slice's card, or (`outside`) on the cards
/// outside its group; for any other owner, what it holds on all cards together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Charge {
    /// The process.
    pub pid: i32,
    /// Whom the memory is charged to.
    pub owner: Owner,
    /// True for memory on cards outside its multi-GPU allocation (allowed: nothing).
    pub outside: bool,
    /// Bytes.
    pub used: u64,
}

/// The slice of `watched[i]`'s GPU group on card `gpu`, if `watched[i]` is a slice of a
/// multi-GPU allocation and the group has one there.
fn slice_on(watched: &[Watched], i: usize, gpu: u32) -> Option<usize> {
    let group = watched[i].group.as_ref()?;
    if watched[i].gpu == Some(gpu) {
        return Some(i);
    }
    watched
        .iter()
        .position(|w| w.group.as_ref() == Some(group) && w.gpu == Some(gpu))
}

/// Where the memory or time a process of `owner` uses on card `gpu` is charged: the
/// process's own owner, except for a slice of a multi-GPU allocation, whose group is policed
/// per card: the group's slice on that card, or `(owner, true)` for a card outside the group.
///
/// An allocation of one card (a fraction: share below 100) holds nothing on any other card:
/// what its processes use there is outside it, against a limit of 0 and no lease, however
/// much of its own limit is left (the card is someone else's promise).
fn card_owner(watched: &[Watched], owner: Owner, gpu: u32) -> (Owner, bool) {
    match owner {
        Owner::Allocation(i) if watched[i].group.is_some() => match slice_on(watched, i, gpu) {
            Some(j) => (Owner::Allocation(j), false),
            None => (owner, true),
        },
        Owner::Allocation(i)
            if watched[i].share < 100 && watched[i].gpu.is_some_and(|g| g != gpu) =>
        {
            (owner, true)
        }
        other => (other, false),
    }
}

/// The charges the memory rule polices, from NVML's per-card processes: each process's
/// memory per owner (see [`Charge`]), less what a process of a whole-card allocation holds
/// on the cards that allocation holds wholly. Memory on a card is charged to that card's
/// slice of a multi-GPU allocation, never summed into another card's.
pub(crate) fn card_charges(
    watched: &[Watched],
    procs: &[GpuProcess],
    owners: &HashMap<i32, Owner>,
) -> Vec<Charge> {
    let mut sums: HashMap<(i32, Owner, bool), u64> = HashMap::new();
    for p in procs {
        let Some(&owner) = owners.get(&p.pid) else {
            continue;
        };
        if on_own_whole_card(watched, Some(&owner), p.gpu) {
            continue;
        }
        let (owner, outside) = card_owner(watched, owner, p.gpu);
        *sums.entry((p.pid, owner, outside)).or_default() += p.used;
    }
    let mut out: Vec<Charge> = sums
        .into_iter()
        .map(|((pid, owner, outside), used)| Charge {
            pid,
            owner,
            outside,
            used,
        })
        .collect();
    out.sort_by_key(|c| (c.pid, c.outside));
    out
}

/// One process's GPU time over an interval, charged to one allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimeRow {
    /// The process.
    pub pid: i32,
    /// Index in the watched list of the allocation charged.
    pub allocation: usize,
    /// All its GPU time charged there, ns.
    pub all_ns: u64,
    /// The part the compute rule polices against the allocation's leases (see
    /// [`policed_gpu_time`]), ns.
    pub policed_ns: u64,
    /// The part used on cards outside the allocation (see [`card_charges`]), where no lease of
    /// its covers anything and it may use nothing, ns.
    pub outside_ns: u64,
}

/// GPU time per process and allocation, from time per (pid, GPU): as [`policed_gpu_time`],
/// except that a process of a multi-GPU allocation is charged per card, to that card's slice
/// (whose leases cover it), and time on a card outside the allocation (its group's, or its
/// one card) is apart, in `outside_ns`.
pub(crate) fn gpu_time_rows(
    watched: &[Watched],
    per_gpu: &HashMap<(i32, u32), u64>,
    owners: &HashMap<i32, Owner>,
) -> Vec<TimeRow> {
    let mut sums: HashMap<(i32, usize), (u64, u64, u64)> = HashMap::new();
    for (&(pid, gpu), &ns) in per_gpu {
        let Some(&owner) = owners.get(&pid) else {
            continue;
        };
        let whole = on_own_whole_card(watched, Some(&owner), gpu);
        let (Owner::Allocation(i), outside) = card_owner(watched, owner, gpu) else {
            continue;
        };
        let e = sums.entry((pid, i)).or_default();
        e.0 += ns;
        if outside {
            e.2 += ns;
        } else if !whole {
            e.1 += ns;
        }
    }
    let mut rows: Vec<TimeRow> = sums
        .into_iter()
        .map(
            |((pid, allocation), (all_ns, policed_ns, outside_ns))| TimeRow {
                pid,
                allocation,
                all_ns,
                policed_ns,
                outside_ns,
            },
        )
        .collect();
    rows.sort_by_key(|r| (r.allocation, r.pid));
    rows
}

/// The memory rule and the unknown-process rule: which processes to act on, given the
/// allocations, each pid's device memory (all GPUs together) and its owner. Unknown host
/// processes come back as actions too (the caller reports them; it never kills them).
#[cfg(test)]
pub(crate) fn decide(
    watched: &[Watched],
    memory: &HashMap<i32, u64>,
    owners: &HashMap<i32, Owner>,
    tolerance: impl Into<Tolerance>,
) -> Vec<Action> {
    let mut charges: Vec<Charge> = memory
        .iter()
        .filter_map(|(&pid, &used)| {
            owners.get(&pid).map(|&owner| Charge {
                pid,
                owner,
                outside: false,
                used,
            })
        })
        .collect();
    charges.sort_by_key(|c| c.pid);
    decide_charges(watched, &charges, tolerance)
}

/// [`decide`] over charges (see [`card_charges`]): each allocation's charges against its
/// limit, and a multi-GPU allocation's memory on cards outside its group against nothing.
pub(crate) fn decide_charges(
    watched: &[Watched],
    charges: &[Charge],
    tolerance: impl Into<Tolerance>,
) -> Vec<Action> {
    let tolerance = tolerance.into();
    // Per allocation: its charges, then (second half) its charges outside its group.
    let mut groups: Vec<Vec<(i32, u64)>> = vec![Vec::new(); 2 * watched.len()];
    let mut actions = Vec::new();
    for c in charges {
        let (pid, used) = (c.pid, c.used);
        match c.owner {
            Owner::Allocation(i) => {
                groups[i + if c.outside { watched.len() } else { 0 }].push((pid, used))
            }
            // Left alone (see [`Owner::Mps`]); the backstop logs it once.
            Owner::Mps => {}
            Owner::Forged => actions.push(Action {
                pid,
                allocation: None,
                unconnected: true,
                reason: Reason::Forged { used },
            }),
            Owner::UnknownHost | Owner::UnknownContainer => actions.push(Action {
                pid,
                allocation: None,
                unconnected: true,
                reason: Reason::Unknown {
                    container: c.owner == Owner::UnknownContainer,
                    used,
                },
            }),
        }
    }
    for (slot, group) in groups.into_iter().enumerate() {
        let outside = slot >= watched.len();
        let w = &watched[slot % watched.len()];
        let total: u64 = group.iter().map(|(_, u)| u).sum();
        // A whole-card allocation's memory here is only what it holds on cards it does not
        // own (see [`card_charges`]), where it may hold nothing; so is a multi-GPU
        // allocation's on cards outside its group.
        let allowed = if w.share < 100 && !outside {
            tolerance.allowed(w.limit, group.len())
        } else {
            0
        };
        if total <= allowed {
            continue;
        }
        let connected: HashSet<i32> = w.pids.iter().map(|p| p.pid).collect();
        let mut order = group.clone();
        // Those that went around the arbiter first, then the largest.
        order.sort_by_key(|(pid, used)| (connected.contains(pid), std::cmp::Reverse(*used), *pid));
        let mut left = total;
        for (pid, used) in order {
            if left <= allowed {
                break;
            }
            left -= used;
            actions.push(Action {
                pid,
                allocation: Some(w.id.clone()),
                unconnected: !connected.contains(&pid),
                reason: Reason::Memory {
                    used,
                    total,
                    allowed,
                },
            });
        }
    }
    actions
}

/// What the card holds for each connected process beyond what its connections reserved: the
/// arbiter charges it to the allocation, so its ledger is what the card holds for it. The
/// interposer reserves a fixed estimate per context (300 MiB, what the simulated card charges
/// by default); a real context can cost more (300-600 MiB on common cards, more with large modules
/// loaded), the driver rounds allocations up, and without this a process whose allocations
/// fit the estimate could take the card past the limit and be killed by the memory rule. With
/// it, the next reservation that would not fit on the card is refused instead.
///
/// Pure: fed, each poll, (process, NVML's bytes for it, the most its connections held since
/// the last poll). The two figures are read at different instants: the card first, the ledger
/// after it, and a poll descheduled in between (a loaded host) would otherwise see a process
/// that freed and released meanwhile with more on the card than it holds; the peak held since
/// the last poll covers every instant the card figure can be from. An excess is charged only
/// as far as two polls in a row saw it (the smaller of the two): a stream-ordered free is
/// released when it is enqueued and leaves the card when the stream reaches it, so a card
/// can hold freed memory for a while. It is recomputed every poll, so
/// it follows the card down as well as up (the unused part of a reservation is never given
/// back: the process may still use it without asking).
#[derive(Debug)]
pub(crate) struct ExcessBook<K = ProcId> {
    last: HashMap<K, u64>,
}

impl<K> Default for ExcessBook<K> {
    fn default() -> Self {
        Self {
            last: HashMap::new(),
        }
    }
}

/// What the backstop's [`ExcessBook`] is keyed by: the process and, for a slice of a
/// multi-GPU allocation, the slice's card.
pub(crate) type ExcessKey = (ProcId, Option<u32>);

impl<K: Copy + Eq + std::hash::Hash> ExcessBook<K> {
    /// This poll's figures; returns the excess to charge per process (absent: none). Forgets
    /// processes not listed.
    pub(crate) fn observe(&mut self, seen: &[(K, u64, u64)]) -> HashMap<K, u64> {
        let now: HashMap<K, u64> = seen
            .iter()
            .map(|&(id, card, held)| (id, card.saturating_sub(held)))
            .collect();
        let charge = now
            .iter()
            .filter_map(|(id, &x)| {
                let both = x.min(self.last.get(id).copied().unwrap_or(0));
                (both > 0).then_some((*id, both))
            })
            .collect();
        self.last = now;
        charge
    }
}
