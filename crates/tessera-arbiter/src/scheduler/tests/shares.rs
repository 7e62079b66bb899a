//! Weighted fair queueing: shares split the GPU, processes of an allocation share its weight,
//! an idle tenant banks no credit.

use super::*;

#[test]
fn shares_30_70_split_within_2_points() {
    let mut sim = Sim::new();
    sim.alloc(1, 30, None);
    sim.alloc(2, 70, None);
    sim.join(1, 10);
    sim.join(2, 20);
    sim.run(10 * S);
    let (a, b) = (sim.fraction(1, 0, 10 * S), sim.fraction(2, 0, 10 * S));
    assert!((a - 30.0).abs() <= 2.0, "30% tenant got {a:.1}%");
    assert!((b - 70.0).abs() <= 2.0, "70% tenant got {b:.1}%");
    // Every 1 s window too.
    for w in 0..10 {
        let a = sim.fraction(1, w * S, (w + 1) * S);
        assert!((a - 30.0).abs() <= 3.0, "window {w}: {a:.1}%");
    }
}

#[test]
fn processes_of_one_allocation_share_its_weight() {
    let mut sim = Sim::new();
    sim.alloc(1, 50, None);
    sim.alloc(2, 50, None);
    // Allocation 1 runs three processes, allocation 2 one: still 50/50.
    sim.join(1, 10);
    sim.join(1, 11);
    sim.join(1, 12);
    sim.join(2, 20);
    sim.run(10 * S);
    let a = sim.fraction(1, 0, 10 * S);
    assert!(
        (a - 50.0).abs() <= 2.0,
        "three processes got {a:.1}% together"
    );
}

#[test]
fn shares_20_30_50_with_join_and_leave() {
    let mut sim = Sim::new();
    sim.alloc(1, 20, None);
    sim.alloc(2, 30, None);
    sim.alloc(3, 50, None);
    sim.join(1, 10);
    sim.join(2, 20);
    sim.run(3 * S);
    // Two tenants: 20:30 -> 40% / 60%.
    let a = sim.fraction(1, 0, 3 * S);
    assert!((a - 40.0).abs() <= 2.0, "20 vs 30 alone: {a:.1}%");
    sim.join(3, 30);
    sim.run(7 * S);
    for (key, want) in [(1, 20.0), (2, 30.0), (3, 50.0)] {
        let got = sim.fraction(key, 3 * S, 7 * S);
        assert!(
            (got - want).abs() <= 2.0,
            "allocation {key}: {got:.1}% vs {want}%"
        );
    }
    // The newcomer banked nothing: its first second is at its share, not above.
    let first = sim.fraction(3, 3 * S, 4 * S);
    assert!(
        first <= 53.0,
        "newcomer got {first:.1}% in its first second"
    );
    sim.leave(20);
    sim.run(10 * S);
    let a = sim.fraction(1, 7 * S, 10 * S);
    assert!(
        (a - 100.0 * 20.0 / 70.0).abs() <= 2.0,
        "after leave: {a:.1}%"
    );
    // Work-conserving: the GPU never idles while someone waits.
    let total: u64 = (1..=3).map(|k| sim.busy_of(k, 0, 10 * S)).sum();
    assert!(total as f64 >= 0.99 * (10 * S) as f64, "busy {total}");
}

#[test]
fn idle_tenant_banks_no_credit() {
    let mut sim = Sim::new();
    sim.alloc(1, 50, None);
    sim.alloc(2, 50, None);
    sim.join(1, 10);
    sim.run(5 * S);
    sim.join(2, 20);
    sim.run(6 * S);
    // At most its share (no catch-up for the idle 5 s); a little less is the wait for the
    // lone tenant's long lease to end when it joined.
    let b = sim.fraction(2, 5 * S, 6 * S);
    assert!(
        (40.0..=53.0).contains(&b),
        "late joiner got {b:.1}% (must not catch up)"
    );
    let b = sim.fraction(2, 6 * S - S / 2, 6 * S);
    assert!((b - 50.0).abs() <= 4.0, "then 50/50: {b:.1}%");
}
