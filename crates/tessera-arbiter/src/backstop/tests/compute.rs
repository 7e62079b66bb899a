//! The compute book: GPU time against leases, the slack, debts and the kill rule.

use super::*;

fn policy() -> Policy {
    Policy {
        interval: Duration::from_millis(250),
        memory_tolerance: Tolerance::default(),
        enforce: Enforce::Kill,
        unknown: Unknown::Kill,
        compute_threshold: Duration::from_millis(500),
        compute_slack: 0.05,
        compute_tolerance: Duration::ZERO,
    }
}

/// One observation of an allocation alone on its GPU.
fn observe1(
    book: &mut ComputeBook,
    id: &str,
    used_ns: u64,
    leased_total: u64,
    elapsed: u64,
    pol: &Policy,
    may_act: bool,
) -> ComputeVerdict {
    let u = ComputeUse {
        id,
        used_ns,
        leased_total,
        capped: false,
    };
    book.observe_gpu(&[u], elapsed, pol, may_act)[0]
}

#[test]
fn honest_use_within_leases_builds_no_debt() {
    let mut book = ComputeBook::default();
    let pol = policy();
    let mut leased = 0;
    assert!(
        !observe1(&mut book, "a", 0, leased, 250 * MS, &pol, true).over,
        "first sight sets the start"
    );
    // Kernel time reported when kernels end: up to one lease behind or ahead each poll.
    let mut charged = 0;
    for i in 0..400u64 {
        leased += 250 * MS;
        let used = if i % 2 == 0 { 150 * MS } else { 350 * MS };
        let v = observe1(&mut book, "a", used, leased, 250 * MS, &pol, true);
        assert!(!v.over, "poll {i}: {v:?}");
        assert!(v.unleased_ns <= 100 * MS, "poll {i}: {v:?}");
        charged += v.charge_ns;
    }
    assert_eq!(
        charged, 0,
        "late kernel time pays back earlier lease time, nothing is charged"
    );
}

#[test]
fn gpu_time_without_leases_is_charged_and_past_the_threshold_the_process_goes() {
    let mut book = ComputeBook::default();
    let pol = policy();
    observe1(&mut book, "a", 0, 0, 250 * MS, &pol, true);
    // Half the GPU, no lease at all: 125 ms per poll, less 12.5 ms of slack.
    let mut over_at = None;
    for i in 1..=10 {
        let v = observe1(&mut book, "a", 125 * MS, 0, 250 * MS, &pol, true);
        assert_eq!(v.charge_ns, 112_500_000);
        assert_eq!(
            v.forgiven_ns, 12_500_000,
            "the slack, counted against a cap"
        );
        if v.over {
            over_at = Some(i);
            break;
        }
    }
    // 5 polls: 562.5 ms > 500 ms, 1.25 s after the bypass began.
    assert_eq!(over_at, Some(5));
    // The debt starts again after an action.
    assert!(!observe1(&mut book, "a", 125 * MS, 0, 250 * MS, &pol, true).over);
}

#[test]
fn a_tenant_that_leases_is_charged_for_drift_but_not_killed_and_warm_up_holds_kills() {
    let mut book = ComputeBook::default();
    let pol = policy();
    observe1(&mut book, "a", 0, 0, 250 * MS, &pol, true);
    // Leases cover only 150 of every 250 ms of its GPU time (say, revoked leases whose
    // kernels finish late): the debt grows and is charged, but it mostly leases: no kill.
    let (mut leased, mut charged) = (0, 0);
    for i in 0..20 {
        leased += 150 * MS;
        let v = observe1(&mut book, "a", 250 * MS, leased, 250 * MS, &pol, true);
        assert!(!v.over, "poll {i}: {v:?}");
        charged += v.charge_ns;
    }
    assert_eq!(
        charged,
        20 * 87_500_000,
        "every unleased ms beyond the slack is charged"
    );
    // No lease at all, but within the warm-up after a start: charged, no kill.
    let mut b = ComputeBook::default();
    observe1(&mut b, "b", 0, 0, 250 * MS, &pol, false);
    for _ in 0..20 {
        let v = observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, false);
        assert!(!v.over && v.charge_ns > 0);
    }
    // Warm-up over: its debt was forgiven (charged, not counted towards a kill); new
    // unleased time is, and passes the 500 ms threshold on the third poll (237.5 ms each).
    assert!(!observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, true).over);
    assert!(!observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, true).over);
    assert!(observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, true).over);
}

#[test]
fn unused_leases_bank_at_most_one_interval() {
    let mut book = ComputeBook::default();
    let pol = policy();
    observe1(&mut book, "a", 0, 0, 250 * MS, &pol, true);
    // Ten idle leased seconds...
    observe1(&mut book, "a", 0, 10_000 * MS, 250 * MS, &pol, true);
    // ...do not pay for a bypass later: 250 ms of credit, then the debt grows.
    let mut polls = 0;
    while !observe1(&mut book, "a", 250 * MS, 10_000 * MS, 250 * MS, &pol, true).over {
        polls += 1;
        assert!(polls < 10);
    }
    assert_eq!(polls, 3, "(250 + 500) / 237.5 ms per poll");
}

#[test]
fn the_slack_is_shared_out_max_min_fairly_and_never_beyond_the_budget() {
    assert_eq!(share_out(&[1, 10, 10], 9), vec![1, 4, 4]);
    assert_eq!(share_out(&[10, 0, 3], 100), vec![10, 0, 3], "all met");
    assert_eq!(share_out(&[5, 5], 0), vec![0, 0]);
    assert_eq!(share_out(&[], 5), Vec::<i128>::new());
    let given = share_out(&[7; 10], 25);
    assert_eq!(given.iter().sum::<i128>(), 25);
    assert!(given.iter().all(|g| (2..=3).contains(g)), "{given:?}");
}

/// The names of `n` bypassing allocations.
fn bypasser_ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("b{i}")).collect()
}

/// One poll's GPU use: each of `ids` used `bypass` ns and never leased, and the last one,
/// "honest", used `used` ns against `leased` ns leased in all.
fn beside_honest(ids: &[String], bypass: u64, used: u64, leased: u64) -> Vec<ComputeUse<'_>> {
    let mut u: Vec<ComputeUse<'_>> = ids
        .iter()
        .map(|id| ComputeUse {
            id,
            used_ns: bypass,
            leased_total: 0,
            capped: false,
        })
        .collect();
    u.push(ComputeUse {
        id: "honest",
        used_ns: used,
        leased_total: leased,
        capped: false,
    });
    u
}

/// The policy, ten bypassers' names, and a book that has seen them and "honest" once, all
/// at zero.
fn ten_bypassers_seen() -> (Policy, ComputeBook, Vec<String>) {
    let (pol, mut book, ids) = (policy(), ComputeBook::default(), bypasser_ids(10));
    book.observe_gpu(&beside_honest(&ids, 0, 0, 0), 250 * MS, &pol, true);
    (pol, book, ids)
}

/// `v` (ten bypassers, then "honest"): "honest" is in debt, yet only the bypassers are
/// acted on.
fn only_the_bypassers_acted_on_beside_a_debt(v: &[ComputeVerdict]) {
    assert!(v[10].unleased_ns > 0, "in debt: {:?}", v[10]);
    assert!(v[..10].iter().all(|v| v.over), "{v:?}");
    assert!(!v[10].over, "the leasing tenant was acted on: {:?}", v[10]);
}

/// `n` share-1 allocations each using `each` ns around the gate per 250 ms poll, beside an
/// honest one whose GPU time matches its leases; `polls` polls. Returns every verdict of
/// the bypassers and the honest one's total charge and whether it was ever over.
fn bypassers_beside_an_honest_tenant(
    n: usize,
    each: u64,
    polls: usize,
) -> (Vec<Vec<ComputeVerdict>>, u64, bool) {
    let pol = policy();
    let mut book = ComputeBook::default();
    let ids = bypasser_ids(n);
    let mut leased = 0;
    let uses = |used: u64, leased: u64| beside_honest(&ids, used, 200 * MS, leased);
    book.observe_gpu(&uses(0, 0), 250 * MS, &pol, true);
    let (mut out, mut honest_charged, mut honest_over) = (Vec::new(), 0, false);
    for _ in 0..polls {
        leased += 200 * MS;
        let mut v = book.observe_gpu(&uses(each, leased), 250 * MS, &pol, true);
        let h = v.pop().unwrap();
        honest_charged += h.charge_ns;
        honest_over |= h.over;
        out.push(v);
    }
    (out, honest_charged, honest_over)
}

#[test]
fn ten_allocations_share_one_slack_per_gpu_and_the_rest_is_charged_and_counted() {
    // Each takes 4.9% of the GPU around the gate: under a 5% slack per allocation none
    // was ever charged; now the ten share 12.5 ms per 250 ms poll.
    let each = 12_250_000;
    let (polls, honest_charged, honest_over) = bypassers_beside_an_honest_tenant(10, each, 8);
    let first = &polls[0];
    let charged: u64 = first.iter().map(|v| v.charge_ns).sum();
    assert_eq!(
        charged,
        10 * each - 12_500_000,
        "only one slack forgiven for all ten: {first:?}"
    );
    assert!(
        first
            .iter()
            .all(|v| v.charge_ns == each - 1_250_000 && v.forgiven_ns == 1_250_000)
    );
    // Their debts together pass 500 ms on the fifth poll (5 x 110 ms), although each has
    // only 55 ms: all ten are acted on at once.
    let over_at = polls.iter().position(|p| p.iter().any(|v| v.over));
    assert_eq!(over_at, Some(4));
    assert!(polls[4].iter().all(|v| v.over), "{:?}", polls[4]);
    assert!(polls[4].iter().all(|v| v.unleased_ns == 55 * MS));
    // Their debts start again after the action.
    assert!(polls[5].iter().all(|v| !v.over && v.unleased_ns == 11 * MS));
    // The honest tenant uses what it leased: never charged, never acted on.
    assert_eq!(honest_charged, 0);
    assert!(!honest_over);
}

#[test]
fn a_lease_overrun_is_forgiven_whole_beside_bypassers() {
    let pol = policy();
    let mut book = ComputeBook::default();
    let ids = bypasser_ids(5);
    let mut leased = 0;
    let mut uses = |used: u64, overrun: u64| {
        leased += 100 * MS;
        beside_honest(&ids, used, 100 * MS + overrun, leased)
    };
    book.observe_gpu(&uses(0, 0), 250 * MS, &pol, true);
    for i in 0..20 {
        // 8 ms over its leases each poll, beyond an equal part of the slack (12.5 / 6 ms):
        // it leased, so its overrun is served first; the bypassers share the rest.
        let v = book.observe_gpu(&uses(20 * MS, 8 * MS), 250 * MS, &pol, true);
        let h = v[5];
        assert_eq!((h.charge_ns, h.over), (0, false), "poll {i}: {v:?}");
        let to_bypassers: u64 = v[..5].iter().map(|v| v.charge_ns).sum();
        assert_eq!(to_bypassers, 5 * 20 * MS - 4_500_000, "poll {i}");
    }
}

#[test]
fn a_leasing_tenant_in_debt_is_not_caught_up_in_its_neighbours_bypass() {
    // Seen in the ten-bypasser test before this rule: the share-90 tenant, flooded by
    // bypass kernels, drifted into debt while it leased, then had one interval with
    // hardly a lease (waiting on its drain); the bypassers' debts took the GPU past the
    // threshold and it was killed with them.
    let (pol, mut book, ids) = ten_bypassers_seen();
    let uses = |bypass: u64, used: u64, leased: u64| beside_honest(&ids, bypass, used, leased);
    // Three polls: it leases 150 ms and uses 250 (drift), the ten bypass 5 ms each.
    let mut leased = 0;
    for _ in 0..3 {
        leased += 150 * MS;
        let v = book.observe_gpu(&uses(5 * MS, 250 * MS, leased), 250 * MS, &pol, true);
        assert!(v.iter().all(|v| !v.over), "{v:?}");
    }
    // Then an interval with 5 ms of use and no lease, while the bypassers pass the
    // threshold together.
    let v = book.observe_gpu(&uses(60 * MS, 5 * MS, leased), 250 * MS, &pol, true);
    only_the_bypassers_acted_on_beside_a_debt(&v);
}

#[test]
fn one_interval_without_a_lease_does_not_make_a_leasing_tenant_a_bypasser() {
    // Seen in a full test run: the share-90 tenant leased all it used, then its kernels,
    // stuck behind the bypass kernels, finished after its lease: 110 ms used, no lease in
    // that interval, its debt above zero for the first time, while ten bypassers passed
    // the threshold together.
    let (pol, mut book, ids) = ten_bypassers_seen();
    let uses = |bypass: u64, used: u64, leased: u64| beside_honest(&ids, bypass, used, leased);
    let mut leased = 0;
    for _ in 0..4 {
        leased += 240 * MS;
        book.observe_gpu(&uses(10 * MS, 240 * MS, leased), 250 * MS, &pol, true);
    }
    let v = book.observe_gpu(&uses(60 * MS, 110 * MS, leased), 250 * MS, &pol, true);
    only_the_bypassers_acted_on_beside_a_debt(&v);
}

#[test]
fn kernels_that_ran_late_on_leases_paid_before_do_not_make_a_tenant_a_bypasser() {
    // Seen once in the ten-bypasser test beside a CPU hog: the share-90 tenant's kernels
    // waited behind the bypass kernels while its leases ran (part of them idle), and ran
    // after them, mostly outside leases for seconds. Its debt and the bypassers' passed
    // the threshold together and it was killed with them, for time it had leased earlier.
    let (pol, mut book, ids) = ten_bypassers_seen();
    let uses = |bypass: u64, used: u64, leased: u64| beside_honest(&ids, bypass, used, leased);
    let mut leased = 0;
    // 10 s: it holds the GPU's leases but its kernels get only 150 ms of each 250.
    for _ in 0..40 {
        leased += 250 * MS;
        let v = book.observe_gpu(&uses(0, 150 * MS, leased), 250 * MS, &pol, true);
        assert!(v.iter().all(|v| !v.over), "{v:?}");
    }
    // 2.5 s: its queued kernels run, 240 ms a poll, beside 40 ms of lease, while the ten
    // bypass 10 ms each.
    let (mut honest_charged, mut bypassers_over) = (0, false);
    for poll in 0..10 {
        leased += 40 * MS;
        let v = book.observe_gpu(&uses(10 * MS, 240 * MS, leased), 250 * MS, &pol, true);
        assert!(
            !v[10].over,
            "poll {poll}: the tenant that leased was acted on: {v:?}"
        );
        honest_charged += v[10].charge_ns;
        bypassers_over |= v[..10].iter().all(|v| v.over);
    }
    // Its drift beyond the slack is charged to its share; the bypassers are acted on.
    assert!(honest_charged > 0, "the drift was not charged");
    assert!(bypassers_over, "the bypassers were never acted on");
}

#[test]
fn leases_held_before_buy_no_bypass_later() {
    // Attack: lease honestly for 10 s (bank lease time), then launch around the gate with
    // no lease at all. The long sums tip at the first poll of the bypass; its debt is
    // over the 500 ms threshold at the third, as without the banked leases.
    let pol = policy();
    let mut book = ComputeBook::default();
    let mut leased = 0;
    observe1(&mut book, "banker", 0, leased, 250 * MS, &pol, true);
    for _ in 0..40 {
        leased += 100 * MS;
        let v = observe1(&mut book, "banker", 100 * MS, leased, 250 * MS, &pol, true);
        assert!(!v.over, "{v:?}");
    }
    let over_at = (1..=10)
        .find(|_| observe1(&mut book, "banker", 250 * MS, leased, 250 * MS, &pol, true).over);
    assert_eq!(over_at, Some(3));
}

#[test]
fn a_leasing_tenant_is_never_acted_on_for_a_neighbour_that_bypasses() {
    let pol = policy();
    let mut book = ComputeBook::default();
    let mut leased = 0;
    let mut polls = 0;
    let uses = |leased: u64| {
        [
            // Leases cover 150 of its 250 ms (drift): debt, but mostly leased.
            ComputeUse {
                id: "drifter",
                used_ns: 250 * MS,
                leased_total: leased,
                capped: false,
            },
            ComputeUse {
                id: "bypasser",
                used_ns: 50 * MS,
                leased_total: 0,
                capped: false,
            },
        ]
    };
    book.observe_gpu(&uses(0), 250 * MS, &pol, true);
    loop {
        leased += 150 * MS;
        let v = book.observe_gpu(&uses(leased), 250 * MS, &pol, true);
        polls += 1;
        assert!(!v[0].over, "poll {polls}: {v:?}");
        assert!(v[0].charge_ns > 0, "the drift is charged");
        if v[1].over {
            break;
        }
        assert!(polls < 20, "the bypasser was never acted on");
    }
    // The bypasser alone counts: 50 ms a poll less at most all of the slack, past 500 ms.
    assert!((11..=14).contains(&polls), "{polls}");
}

#[test]
fn a_processes_excess_on_the_card_is_charged_once_two_polls_saw_it_and_follows_the_card() {
    let (a, b) = (ProcId { pid: 10, start: 1 }, ProcId { pid: 11, start: 1 });
    const MIB: u64 = 1 << 20;
    let mut book = ExcessBook::default();
    // a: a 500 MiB context on the card, 300 MiB reserved for it; b: within its reservation.
    let first = book.observe(&[(a, 500 * MIB, 300 * MIB), (b, 100 * MIB, 400 * MIB)]);
    assert!(first.is_empty(), "one poll is not enough: {first:?}");
    let second = book.observe(&[(a, 500 * MIB, 300 * MIB), (b, 100 * MIB, 400 * MIB)]);
    assert_eq!(second, HashMap::from([(a, 200 * MIB)]));
    // A moment's excess (b between a free and its release) is not charged.
    let third = book.observe(&[(a, 500 * MIB, 300 * MIB), (b, 450 * MIB, 400 * MIB)]);
    assert_eq!(third, HashMap::from([(a, 200 * MIB)]));
    // a's context shrank on the card (or it reserved more): the charge follows down.
    let fourth = book.observe(&[(a, 400 * MIB, 300 * MIB), (b, 100 * MIB, 400 * MIB)]);
    assert_eq!(fourth, HashMap::from([(a, 100 * MIB)]));
    // A pid given to another process starts from nothing.
    let c = ProcId { pid: 10, start: 2 };
    assert!(book.observe(&[(c, 900 * MIB, 0)]).is_empty());
}

#[test]
fn the_culprit_is_unconnected_first_then_the_busiest() {
    let connected = HashSet::from([1, 2]);
    assert_eq!(
        compute_culprit(&[(1, 50), (2, 90), (3, 10)], &connected),
        Some((3, 10))
    );
    assert_eq!(
        compute_culprit(&[(1, 50), (2, 90)], &connected),
        Some((2, 90))
    );
    assert_eq!(compute_culprit(&[(1, 0)], &connected), None);
}

/// [`policy`] with NVML's tolerance at `tolerance`.
fn policy_tolerating(tolerance: Duration) -> Policy {
    Policy {
        compute_tolerance: tolerance,
        ..policy()
    }
}

/// NVML's per-process SM utilisation (percent) of tenants A (share 30) and B (share 70),
/// per 250 ms poll, as an H200 (driver 580) gave it while the two time-sliced bf16 matrix
/// products in 20 ms leases, 30/70 of the work (examples/gpu-check, 2026-12-04): whole
/// 200 ms sample periods go to one of them, or half to each.
const H200_POLLS: [(u64, u64); 33] = [
    (0, 95),
    (0, 95),
    (0, 97),
    (0, 95),
    (96, 0),
    (0, 95),
    (0, 97),
    (97, 0),
    (0, 97),
    (0, 96),
    (49, 49),
    (97, 0),
    (0, 97),
    (49, 48),
    (0, 95),
    (0, 97),
    (0, 97),
    (0, 97),
    (0, 96),
    (0, 97),
    (97, 0),
    (48, 48),
    (0, 97),
    (0, 96),
    (96, 0),
    (0, 97),
    (0, 97),
    (97, 0),
    (0, 96),
    (49, 49),
    (0, 96),
    (88, 0),
    (0, 0),
];

/// Replays [`H200_POLLS`] with leases of exactly 30 and 70 per cent of each poll; returns
/// the GPU time charged to A and B.
fn replay(pol: &Policy) -> (u64, u64) {
    let (mut book, poll) = (ComputeBook::default(), 250 * MS);
    let (mut leased_a, mut leased_b, mut charged) = (0, 0, (0, 0));
    for (i, &(a, b)) in std::iter::once(&(0, 0)).chain(&H200_POLLS).enumerate() {
        if i > 0 {
            leased_a += 75 * MS;
            leased_b += 175 * MS;
        }
        let uses = [
            ComputeUse {
                id: "a",
                used_ns: poll * a / 100,
                leased_total: leased_a,
                capped: false,
            },
            ComputeUse {
                id: "b",
                used_ns: poll * b / 100,
                leased_total: leased_b,
                capped: false,
            },
        ];
        let v = book.observe_gpu(&uses, poll, pol, true);
        assert!(
            !v[0].over && !v[1].over,
            "poll {i}: an honest tenant acted on"
        );
        charged.0 += v[0].charge_ns;
        charged.1 += v[1].charge_ns;
    }
    charged
}

#[test]
fn nvmls_lumps_are_not_charged_to_honest_tenants_within_the_tolerance() {
    assert_eq!(
        replay(&policy_tolerating(DEFAULT_COMPUTE_TOLERANCE)),
        (0, 0)
    );
    // Without it, B's lumps were charged: the split of work moved away from 30/70.
    let (_, b) = replay(&policy_tolerating(Duration::ZERO));
    assert!(b > 100 * MS, "charged to B without a tolerance: {b}");
}

#[test]
fn a_bypass_gets_no_tolerance_and_is_acted_on_as_before() {
    // An allocation that never leases and keeps the GPU 96% busy, alone on it.
    let pol = policy_tolerating(DEFAULT_COMPUTE_TOLERANCE);
    let (mut book, poll) = (ComputeBook::default(), 250 * MS);
    let (mut charged, mut over_at) = (0, None);
    for i in 0..12u64 {
        let u = ComputeUse {
            id: "x",
            used_ns: poll * 96 / 100,
            leased_total: 0,
            capped: false,
        };
        let v = book.observe_gpu(&[u], poll, &pol, true);
        charged += v[0].charge_ns;
        if v[0].over && over_at.is_none() {
            over_at = Some(i);
        }
    }
    // Debt past the 500 ms threshold at the third observed poll (the first sets the
    // starting point), as with no tolerance: the kill rule reads the whole debt.
    assert_eq!(over_at, Some(3));
    // It never leased, so it gets no tolerance: everything beyond the slack is charged,
    // 11 polls of 240 ms less the slack's 12.5 ms each (as with no tolerance at all).
    assert_eq!(charged, 11 * 2275 * MS / 10);
}

/// One observation of allocations on one GPU, `(id, used, leased_total, capped)` each.
fn observe_all(
    book: &mut ComputeBook,
    rows: &[(&str, u64, u64, bool)],
    pol: &Policy,
) -> Vec<ComputeVerdict> {
    let uses: Vec<ComputeUse<'_>> = rows
        .iter()
        .map(|&(id, used_ns, leased_total, capped)| ComputeUse {
            id,
            used_ns,
            leased_total,
            capped,
        })
        .collect();
    book.observe_gpu(&uses, 250 * MS, pol, true)
}

#[test]
fn a_capped_tenant_alone_gets_back_the_lease_time_it_left_idle_and_no_more() {
    let mut book = ComputeBook::default();
    let pol = policy_tolerating(Duration::from_millis(500));
    observe_all(&mut book, &[("capped", 0, 0, true)], &pol);
    // 75 ms leased per poll, 69 used (its own synchronises idle the GPU), reported as kernels
    // end: 60 in one poll, 78 in the next.
    let (mut leased, mut refunded, mut owed) = (0, 0, 0);
    for i in 0..40u64 {
        leased += 75 * MS;
        let used = if i % 2 == 0 { 60 * MS } else { 78 * MS };
        let v = observe_all(&mut book, &[("capped", used, leased, true)], &pol)[0];
        assert_eq!((v.charge_ns, v.over), (0, false), "poll {i}: {v:?}");
        refunded += v.refund_ns;
        owed = v.unleased_ns;
    }
    // 40 polls x 6 ms of idle: every ms of it back, none of the late kernels' time (the last
    // poll's 3 ms late is owed, to be paid from the next idle).
    assert_eq!((refunded, owed), (40 * 6 * MS + 3 * MS, 3 * MS));
}

#[test]
fn no_refund_beside_another_active_tenant_nor_to_an_uncapped_one() {
    let mut book = ComputeBook::default();
    let pol = policy();
    let first = [("capped", 0, 0, true), ("other", 0, 0, false)];
    observe_all(&mut book, &first, &pol);
    // The other tenant holds a lease in the interval: the capped one's idle may be NVML's
    // lumps giving its time to the other, so nothing is refunded.
    let v = observe_all(
        &mut book,
        &[
            ("capped", 10 * MS, 75 * MS, true),
            ("other", 100 * MS, 100 * MS, false),
        ],
        &pol,
    );
    assert_eq!((v[0].refund_ns, v[1].refund_ns), (0, 0));
    // The other goes quiet (no lease, no GPU time): the capped one is alone again.
    let v = observe_all(
        &mut book,
        &[
            ("capped", 10 * MS, 150 * MS, true),
            ("other", 0, 100 * MS, false),
        ],
        &pol,
    );
    assert_eq!(
        v[0].refund_ns,
        65 * MS,
        "this interval's idle only, not the 65 ms banked beside the other"
    );
    // An uncapped tenant alone banks its idle (one interval at most), as before.
    let mut book = ComputeBook::default();
    observe_all(&mut book, &[("free", 0, 0, false)], &pol);
    let v = observe_all(&mut book, &[("free", 0, 75 * MS, false)], &pol)[0];
    assert_eq!(v.refund_ns, 0);
}

#[test]
fn idle_refunded_to_a_cap_does_not_also_pay_for_a_bypass_later() {
    // Uncapped, 250 ms of idle lease is banked and pays for 250 ms outside leases; refunded
    // to a cap, it pays for nothing: the same bypass is charged whole.
    let charged = |capped: bool| {
        let mut book = ComputeBook::default();
        let pol = policy();
        observe_all(&mut book, &[("a", 0, 0, capped)], &pol);
        let idle = observe_all(&mut book, &[("a", 0, 250 * MS, capped)], &pol)[0];
        let bypass = observe_all(&mut book, &[("a", 250 * MS, 250 * MS, capped)], &pol)[0];
        (idle.refund_ns, bypass.charge_ns + bypass.forgiven_ns)
    };
    assert_eq!(charged(false), (0, 0));
    // 5% of 250 ms is the GPU's slack (forgiven, but counted against the cap): 250 ms in all.
    assert_eq!(charged(true), (250 * MS, 250 * MS));
}
