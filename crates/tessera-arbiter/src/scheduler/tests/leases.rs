//! Leases: length, early release, revocation of overdue leases and their drains, charges,
//! closed connections, counters.

use super::*;

#[test]
fn early_release_grants_the_waiter_at_once_and_shortens_leases() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 50, None, 0);
    s.add_allocation(2, 50, None, 0);
    let g1 = s.acquire(1, 10, 0).unwrap();
    assert_eq!(g1.len(), 1);
    assert_eq!(g1[0].duration_ns, 20 * MS);
    assert!(s.acquire(2, 20, MS).unwrap().is_empty(), "GPU busy");
    // Holder goes idle after 3 ms and hands back: the waiter gets it at that instant.
    let g2 = s.release(10, g1[0].lease_id, 3 * MS, true, 3 * MS);
    assert_eq!(g2.len(), 1);
    assert_eq!(g2[0].conn, 20);
    assert_eq!(s.current(), Some((20, g2[0].lease_id)));
    // A stale or foreign release changes nothing.
    assert!(s.release(10, g1[0].lease_id, 0, true, 4 * MS).is_empty());
    assert!(s.release(10, g2[0].lease_id, 0, true, 4 * MS).is_empty());
    assert_eq!(s.current(), Some((20, g2[0].lease_id)));
    // The early holder's next lease is shorter (but at least the minimum).
    s.release(20, g2[0].lease_id, 20 * MS, false, 23 * MS);
    let g3 = s.acquire(1, 10, 23 * MS).unwrap();
    assert_eq!(g3[0].duration_ns, 10 * MS);
}

#[test]
fn leases_grow_when_used_fully_and_shrink_under_contention() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 50, None, 0);
    let mut now = 0;
    let mut last = 0;
    for _ in 0..20 {
        let g = s.acquire(1, 10, now).unwrap()[0];
        now += g.duration_ns;
        s.release(10, g.lease_id, g.duration_ns, false, now);
        assert!(g.duration_ns >= last);
        last = g.duration_ns;
    }
    assert_eq!(last, 100 * MS, "a lone full user reaches the longest lease");
    // Another allocation arrives: while both are busy, leases are at most the contended
    // length, so the split stays fine-grained.
    s.add_allocation(2, 50, None, now);
    let g1 = s.acquire(1, 10, now).unwrap()[0];
    assert_eq!(
        g1.duration_ns,
        100 * MS,
        "nobody else was there at grant time"
    );
    assert!(s.acquire(2, 20, now + MS).unwrap().is_empty());
    now += g1.duration_ns;
    let g2 = s.release(10, g1.lease_id, g1.duration_ns, false, now);
    assert_eq!(g2.len(), 1, "allocation 2 is further behind: it is served");
    assert_eq!(g2[0].conn, 20);
    assert_eq!(g2[0].duration_ns, 20 * MS);
    assert!(s.acquire(1, 10, now).unwrap().is_empty());
    now += 20 * MS;
    // Allocation 2 is still behind (1 just had 100 ms): the GPU waits for its next
    // request rather than going back to 1.
    assert!(
        s.release(20, g2[0].lease_id, 20 * MS, false, now)
            .is_empty()
    );
    let g3 = s.acquire(2, 20, now + MS / 10).unwrap();
    assert_eq!(g3.len(), 1);
    assert_eq!((g3[0].conn, g3[0].duration_ns), (20, 20 * MS));
    // Without a re-request within the window, the waiter gets it.
    now += MS / 10 + 20 * MS;
    assert!(
        s.release(20, g3[0].lease_id, 20 * MS, false, now)
            .is_empty()
    );
    assert_eq!(s.next_wakeup(now), Some(now + 2 * MS));
    let g4 = s.tick(now + 2 * MS);
    assert_eq!(
        (g4[0].conn, g4[0].duration_ns),
        (10, 20 * MS),
        "contended length"
    );
}

#[test]
fn overdue_lease_is_revoked_and_charged_in_full() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 50, None, 0);
    s.add_allocation(2, 50, None, 0);
    let g1 = s.acquire(1, 10, 0).unwrap()[0];
    assert!(s.acquire(2, 20, 0).unwrap().is_empty());
    // Deadline 20 ms + grace 50 ms.
    assert_eq!(s.next_wakeup(MS), Some(70 * MS));
    assert!(s.tick(69 * MS).is_empty());
    let g2 = s.tick(70 * MS);
    assert_eq!(g2.len(), 1);
    assert_eq!(g2[0].conn, 20);
    assert_eq!(
        s.gpu_time(1, 70 * MS),
        70 * MS,
        "charged the whole time it held the GPU"
    );
    // Its late release ends its drain: the millisecond since is charged as well.
    assert!(
        s.release(10, g1.lease_id, 5 * MS, false, 71 * MS)
            .is_empty()
    );
    assert_eq!(s.gpu_time(1, 71 * MS), 71 * MS);
    assert_eq!(s.gpu_time(1, 90 * MS), 71 * MS, "and nothing after it");
}

#[test]
fn a_revoked_lease_counts_as_leased_while_its_holder_drains_it() {
    // The holder's kernels, stuck behind a neighbour's, still run after the revocation;
    // they are the lease's work until the holder says its drain is over.
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 90, None, 0);
    s.add_allocation(2, 10, None, 0);
    let g1 = s.acquire(1, 10, 0).unwrap()[0];
    assert!(s.acquire(2, 20, 0).unwrap().is_empty());
    // Revoked at its deadline (20 ms) plus the grace (50 ms); the waiter gets the GPU.
    assert_eq!(s.tick(70 * MS)[0].conn, 20);
    assert_eq!(s.leased_total(1, 570 * MS), Some(570 * MS), "drain counted");
    assert_eq!(
        s.alloc_stats(1, 570 * MS).unwrap().gpu_ns,
        570 * MS,
        "and charged"
    );
    s.release(10, g1.lease_id, 600 * MS, false, 600 * MS);
    assert_eq!(
        s.leased_total(1, 2_000 * MS),
        Some(600 * MS),
        "ends at the release"
    );
    assert_eq!(s.gpu_time(1, 2_000 * MS), 600 * MS);
    // A release of the same lease again, or of another connection, changes nothing.
    s.release(10, g1.lease_id, 0, false, 2_000 * MS);
    s.release(30, g1.lease_id, 0, false, 2_000 * MS);
    assert_eq!(s.leased_total(1, 2_100 * MS), Some(600 * MS));
}

#[test]
fn a_holder_that_never_releases_a_revoked_lease_counts_only_the_drain_bound() {
    // Around the gate, a tenant could hold a revoked lease open to have its bypass counted
    // as leased: it gets the bound at most, charged to its share like a lease.
    let mut s = GpuScheduler::new(SchedulerParams::default());
    let bound = SchedulerParams::default().revoked_drain_ns;
    s.add_allocation(1, 50, None, 0);
    s.add_allocation(2, 50, None, 0);
    s.acquire(1, 10, 0).unwrap();
    s.acquire(2, 20, 0).unwrap();
    s.tick(70 * MS);
    let later = 70 * MS + bound + 10_000 * MS;
    assert_eq!(s.leased_total(1, later), Some(70 * MS + bound));
    s.tick(later);
    assert_eq!(s.alloc_stats(1, later).unwrap().gpu_ns, 70 * MS + bound);
    assert_eq!(
        s.leased_total(1, later + 1_000 * MS),
        Some(70 * MS + bound),
        "settled once"
    );
    // The same tick ended the other's lease, overdue by then: asking again ends its
    // drain (its release was lost), charged up to the request.
    let t = later + 100 * MS;
    let before = s.gpu_time(2, t);
    s.acquire(2, 20, t).unwrap();
    assert_eq!(s.gpu_time(2, t), before + 100 * MS);
}

#[test]
fn charge_is_at_least_the_time_held() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 50, None, 0);
    let g = s.acquire(1, 10, 0).unwrap()[0];
    // Under-reporting does not lower the charge; overrun raises it.
    s.release(10, g.lease_id, 0, false, 20 * MS);
    assert_eq!(s.gpu_time(1, 20 * MS), 20 * MS);
    let g = s.acquire(1, 10, 20 * MS).unwrap()[0];
    s.release(10, g.lease_id, 40 * MS, false, 45 * MS);
    assert_eq!(s.gpu_time(1, 45 * MS), 60 * MS);
}

#[test]
fn closed_connection_releases_its_lease_and_its_wait() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 50, None, 0);
    s.add_allocation(2, 50, None, 0);
    s.add_allocation(3, 50, None, 0);
    s.acquire(1, 10, 0).unwrap();
    s.acquire(2, 20, 0).unwrap();
    s.acquire(3, 30, 0).unwrap();
    assert_eq!(s.waiting(), 2);
    // The waiter dies first, then the holder: the lease goes to the survivor.
    assert!(s.connection_closed(20, MS).is_empty());
    let g = s.connection_closed(10, 2 * MS);
    assert_eq!(g.len(), 1);
    assert_eq!(g[0].conn, 30);
    assert_eq!(s.gpu_time(1, 2 * MS), 2 * MS);
    assert_eq!(s.waiting(), 0);
}

#[test]
fn unleased_time_is_charged_like_a_lease_and_leased_total_counts_the_running_lease() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 10, None, 0);
    s.add_allocation(2, 90, None, 0);
    assert_eq!(s.leased_total(1, 0), Some(0));
    assert_eq!(s.leased_total(9, 0), None);
    let g = s.acquire(2, 20, 0);
    assert_eq!(g.unwrap().len(), 1);
    assert_eq!(
        s.leased_total(2, 30 * MS),
        Some(30 * MS),
        "the running lease counts"
    );
    s.release(20, 1, 0, true, 40 * MS);
    assert_eq!(s.leased_total(2, 50 * MS), Some(40 * MS));
    // Allocation 1 used 500 ms around the gate: at share 10 that is 5 s of virtual time,
    // so allocation 2 (share 90, 40 ms charged) is served first from now on.
    s.charge_unleased(1, 500 * MS, 50 * MS);
    assert_eq!(s.gpu_time(1, 50 * MS), 500 * MS);
    assert_eq!(s.leased_total(1, 50 * MS), Some(0), "not a lease");
    // 2 holds a lease while 1 and a second process of 2 wait: at the hand-back the
    // second process of 2 is served although 1 asked first.
    assert_eq!(s.acquire(2, 20, 60 * MS).unwrap().len(), 1);
    assert!(s.acquire(1, 10, 61 * MS).unwrap().is_empty());
    assert!(s.acquire(2, 21, 62 * MS).unwrap().is_empty());
    let g = s.release(20, 2, 0, true, 70 * MS);
    assert_eq!(
        g[0].conn, 21,
        "the allocation that went around the gate waits"
    );
}

#[test]
fn stats_count_leases_waits_and_charged_time_and_only_grow() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 30, None, 0);
    s.add_allocation(2, 70, None, 0);
    let g1 = s.acquire(1, 10, 0).unwrap()[0];
    // 2 asks at 5 ms and waits while 1 holds the GPU.
    assert!(s.acquire(2, 20, 5 * MS).unwrap().is_empty());
    let mid = s.alloc_stats(2, 15 * MS).unwrap();
    assert_eq!(mid.throttled_ns, 10 * MS, "a wait in progress counts");
    assert_eq!(s.alloc_stats(1, 15 * MS).unwrap().gpu_ns, 15 * MS);
    assert_eq!(s.busy_total(15 * MS), 15 * MS);
    // 1 reports 22 ms busy at 20 ms: charged 22 ms; 2 is granted then.
    let g2 = s.release(10, g1.lease_id, 22 * MS, true, 20 * MS);
    assert_eq!(g2[0].conn, 20);
    let a = s.alloc_stats(1, 20 * MS).unwrap();
    let b = s.alloc_stats(2, 20 * MS).unwrap();
    assert_eq!((a.gpu_ns, a.leases, a.throttled_ns), (22 * MS, 1, 0));
    assert_eq!((b.gpu_ns, b.leases, b.throttled_ns), (0, 1, 15 * MS));
    // 1 waits 4 ms, then its connection closes: the wait still counts.
    assert!(s.acquire(1, 10, 21 * MS).unwrap().is_empty());
    s.connection_closed(10, 25 * MS);
    assert_eq!(s.alloc_stats(1, 30 * MS).unwrap().throttled_ns, 4 * MS);
    // Unleased time is GPU time too (not a lease).
    s.charge_unleased(1, 3 * MS, 30 * MS);
    let a = s.alloc_stats(1, 30 * MS).unwrap();
    assert_eq!((a.gpu_ns, a.leases), (25 * MS, 1));
    s.release(20, g2[0].lease_id, 0, true, 40 * MS);
    assert_eq!(s.alloc_stats(2, 40 * MS).unwrap().gpu_ns, 20 * MS);
    assert_eq!(s.busy_total(40 * MS), 45 * MS);
    // A removed allocation's time stays in the GPU's total.
    s.remove_allocation(2, 41 * MS);
    assert_eq!(s.alloc_stats(2, 41 * MS), None);
    assert_eq!(s.busy_total(41 * MS), 45 * MS);
}

#[test]
fn gpu_time_covers_the_last_10_seconds_only() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 50, None, 0);
    let g = s.acquire(1, 10, 0).unwrap()[0];
    s.release(10, g.lease_id, 20 * MS, false, 20 * MS);
    assert_eq!(s.gpu_time(1, 5 * S), 20 * MS);
    assert_eq!(s.gpu_time(1, 10 * S + 21 * MS), 0);
    assert_eq!(s.gpu_time(99, 0), 0);
    assert_eq!(
        s.acquire(99, 1, 0),
        Err(SchedulerError::UnknownAllocation(99))
    );
}
