//! The latency tier: revocation, priority, the ceiling, the linger.

use super::*;
use crate::scheduler::latency::Revocation;

/// A best-effort tenant (1, conn 10) holding a lease and a latency tenant (2, conn 20,
/// share 40) registered.
fn best_effort_holding() -> (GpuScheduler, Grant) {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 60, None, 0);
    s.add_allocation(2, 40, None, 0);
    s.set_tier(2, Tier::Latency).unwrap();
    let g = s.acquire(1, 10, 0).unwrap()[0];
    (s, g)
}

#[test]
fn a_latency_request_revokes_the_best_effort_lease_at_once() {
    let (mut s, be) = best_effort_holding();
    assert_eq!(
        be.max_inflight_ns, None,
        "no process of the latency allocation has asked yet"
    );
    assert!(s.take_revocations().is_empty());
    // 5 ms into a 20 ms lease the latency tenant asks: it is granted now, not at 20 ms.
    let g = s.acquire(2, 20, 5 * MS).unwrap();
    assert_eq!(g.len(), 1, "granted at once");
    assert_eq!(g[0].conn, 20);
    assert_eq!(
        g[0].max_inflight_ns, None,
        "a latency holder is not bounded"
    );
    assert_eq!(
        s.take_revocations(),
        vec![Revocation {
            conn: 10,
            lease_id: be.lease_id
        }]
    );
    assert!(s.take_revocations().is_empty(), "told once");
    // The revoked holder's late release ends its drain and leaves the GPU where it is; it
    // was charged the 5 ms it held and the 1 ms it drained.
    assert!(s.release(10, be.lease_id, 5 * MS, true, 6 * MS).is_empty());
    assert_eq!(s.current(), Some((20, g[0].lease_id)));
    assert_eq!(s.alloc_stats(1, 6 * MS).unwrap().gpu_ns, 6 * MS);
    assert_eq!(s.alloc_stats(1, 7 * MS).unwrap().gpu_ns, 6 * MS);
    // The best-effort tenant asks again and gets the GPU when the request is done.
    assert!(s.acquire(1, 10, 6 * MS).unwrap().is_empty());
    let next = s.release(20, g[0].lease_id, 8 * MS, true, 13 * MS);
    assert_eq!(next.len(), 1);
    assert_eq!(
        next[0].conn, 10,
        "work-conserving: the rest goes to best-effort"
    );
    assert_eq!(next[0].max_inflight_ns, Some(MS));
}

#[test]
fn a_latency_holder_is_granted_as_one_and_a_best_effort_holder_is_not() {
    let (mut s, be) = best_effort_holding();
    assert!(!be.latency);
    let g = s.acquire(2, 20, 5 * MS).unwrap();
    assert_eq!(g[0].conn, 20);
    assert!(g[0].latency, "tells the holder to hand back at its drain");
    // Best-effort again once the request is done: bounded, not a latency grant.
    assert!(s.acquire(1, 10, 6 * MS).unwrap().is_empty());
    let next = s.release(20, g[0].lease_id, 2 * MS, true, 8 * MS);
    assert_eq!((next[0].conn, next[0].latency), (10, false));
}

#[test]
fn best_effort_is_bounded_only_while_a_latency_process_is_there_and_a_best_effort_request_revokes_nothing()
 {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 50, None, 0);
    s.add_allocation(2, 50, None, 0);
    let g = s.acquire(1, 10, 0).unwrap()[0];
    assert_eq!(g.max_inflight_ns, None);
    assert!(s.acquire(2, 20, MS).unwrap().is_empty(), "waits its turn");
    assert!(s.take_revocations().is_empty());
    // A latency allocation that no process of it uses bounds nobody.
    s.add_allocation(3, 10, None, MS);
    s.set_tier(3, Tier::Latency).unwrap();
    let g2 = s.release(10, g.lease_id, 20 * MS, false, 20 * MS);
    assert_eq!(g2[0].conn, 20);
    assert_eq!(
        g2[0].max_inflight_ns, None,
        "the latency allocation is unused"
    );
    // Its process asks (revoking 20's lease) and hands back early: from then on, while its
    // connection is open, every best-effort grant is bounded.
    assert!(s.acquire(1, 10, 21 * MS).unwrap().is_empty());
    let lat = s.acquire(3, 30, 22 * MS).unwrap();
    assert_eq!(lat[0].conn, 30);
    assert_eq!(s.take_revocations()[0].conn, 20);
    let g3 = s.release(30, lat[0].lease_id, MS, true, 23 * MS);
    assert_eq!(g3[0].conn, 10);
    assert_eq!(
        g3[0].max_inflight_ns,
        Some(MS),
        "a latency process is there"
    );
    // Its connection closes: the next grant is unbounded again.
    assert!(s.acquire(2, 20, 24 * MS).unwrap().is_empty());
    assert!(s.connection_closed(30, 25 * MS).is_empty());
    let g4 = s.release(10, g3[0].lease_id, MS, true, 26 * MS);
    assert_eq!(g4[0].conn, 20);
    assert_eq!(g4[0].max_inflight_ns, None, "its process is gone");
    // In use again, then removed: that lifts the bound too.
    assert!(s.acquire(3, 31, 27 * MS).unwrap()[0].conn == 31);
    assert!(s.acquire(1, 10, 28 * MS).unwrap().is_empty());
    let lat2 = s.current().unwrap();
    let g5 = s.release(lat2.0, lat2.1, MS, true, 29 * MS);
    assert_eq!(g5[0].max_inflight_ns, Some(MS));
    s.remove_allocation(3, 30 * MS);
    s.acquire(2, 20, 31 * MS).unwrap();
    let g6 = s.release(g5[0].conn, g5[0].lease_id, MS, true, 32 * MS);
    assert_eq!(g6[0].max_inflight_ns, None);
    assert_eq!(
        s.set_tier(9, Tier::Latency),
        Err(SchedulerError::UnknownAllocation(9))
    );
}

#[test]
fn a_latency_request_goes_before_best_effort_waiters_and_the_rerequest_hold() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    s.add_allocation(1, 50, None, 0);
    s.add_allocation(2, 50, None, 0);
    s.add_allocation(3, 5, None, 0);
    s.set_tier(3, Tier::Latency).unwrap();
    let g = s.acquire(1, 10, 0).unwrap()[0];
    assert!(s.acquire(2, 20, MS).unwrap().is_empty());
    // Lease 1 ends used to its end: the GPU would be held for 1's re-request, but a
    // latency request that arrives meanwhile is served first, with a share of only 5.
    let next = s.release(10, g.lease_id, g.duration_ns, false, g.duration_ns);
    let be2 = next[0];
    assert_eq!(be2.conn, 20);
    assert!(s.acquire(1, 10, g.duration_ns).unwrap().is_empty());
    let lat = s.acquire(3, 30, g.duration_ns + MS).unwrap();
    assert_eq!(lat[0].conn, 30, "served before both best-effort tenants");
    assert_eq!(s.take_revocations()[0].conn, 20);
}

#[test]
fn two_latency_tenants_do_not_revoke_each_other() {
    let mut s = GpuScheduler::new(SchedulerParams::default());
    for k in [1, 2] {
        s.add_allocation(k, 30, None, 0);
        s.set_tier(k, Tier::Latency).unwrap();
    }
    let g = s.acquire(1, 10, 0).unwrap()[0];
    assert!(
        s.acquire(2, 20, MS).unwrap().is_empty(),
        "waits for the other"
    );
    assert!(s.take_revocations().is_empty());
    let next = s.release(10, g.lease_id, 3 * MS, true, 4 * MS);
    assert_eq!(next[0].conn, 20);
}

/// A latency tenant that saturates the GPU (always asks again) beside a saturating
/// best-effort one: `shares` (latency share, best-effort share).
fn saturating_latency(latency_share: u32) -> Sim {
    let mut sim = Sim::new();
    sim.alloc(1, latency_share, None);
    sim.s.set_tier(1, Tier::Latency).unwrap();
    sim.alloc(2, 100, None);
    sim.join(1, 10);
    sim.join(2, 20);
    sim.run(10 * S);
    sim
}

#[test]
fn a_saturating_latency_tenant_gets_no_more_than_its_share_and_best_effort_the_rest() {
    for share in [20, 40, 70] {
        let sim = saturating_latency(share);
        let share = f64::from(share);
        // The ceiling, in every window of the cap window's length (1 s), with the window's
        // slack of 5 ms (0.5 points).
        for w in 0..10 {
            let l = sim.fraction(1, w * S, (w + 1) * S);
            assert!(
                l <= share + 0.5 + 1e-9,
                "share {share}: window {w}: {l:.2}%"
            );
        }
        let (l, b) = (sim.fraction(1, 0, 10 * S), sim.fraction(2, 0, 10 * S));
        // The guarantee: served first, it gets about its share...
        assert!(l >= share - 2.0, "share {share}: latency got {l:.2}%");
        // ...and best-effort all the rest (work-conserving: the GPU never idles).
        assert!(
            l + b >= 99.0,
            "share {share}: {l:.2} + {b:.2} leaves the GPU idle"
        );
    }
}

#[test]
fn a_latency_tenant_running_past_its_leases_stays_within_its_share_in_every_second() {
    // The attack on the ceiling: a saturating latency tenant whose work runs 1-20 ms past
    // every lease (charged, as the GPU was its). Every sliding 1 s window holds at most its
    // share plus a point.
    for over in [MS, 5 * MS, 20 * MS] {
        let mut sim = Sim::new();
        sim.alloc(1, 30, None);
        sim.s.set_tier(1, Tier::Latency).unwrap();
        sim.alloc(2, 70, None);
        sim.lateness.insert(1, (0, over));
        sim.join(1, 10);
        sim.join(2, 20);
        sim.run(10 * S);
        let mut from = 0;
        while from + S <= 10 * S {
            let w = sim.fraction(1, from, from + S);
            assert!(w <= 31.0, "{over} ns late: {w:.1}% in [{from}, +1 s)");
            from += 50 * MS;
        }
        let b = sim.fraction(2, 0, 10 * S);
        assert!(b >= 68.0, "{over} ns late: best-effort got {b:.1}%");
    }
}

fn lingering(linger: u64) -> GpuScheduler {
    let mut s = GpuScheduler::new(SchedulerParams {
        latency_linger_ns: linger,
        ..SchedulerParams::default()
    });
    s.add_allocation(1, 60, None, 0);
    s.add_allocation(2, 40, None, 0);
    s.set_tier(2, Tier::Latency).unwrap();
    s
}

#[test]
fn a_latency_linger_keeps_the_gpu_for_the_next_request_and_is_charged() {
    let mut s = lingering(MS);
    let lat = s.acquire(2, 20, 0).unwrap()[0];
    assert!(s.acquire(1, 10, 0).unwrap().is_empty(), "best-effort waits");
    // The request is done at 3 ms: the GPU stays held for the latency tenant 1 ms.
    assert!(s.release(20, lat.lease_id, 3 * MS, true, 3 * MS).is_empty());
    assert_eq!(s.next_wakeup(3 * MS), Some(4 * MS));
    assert!(s.tick(3 * MS + MS / 2).is_empty(), "held within the linger");
    // Its next request 0.6 ms later is granted at once, no best-effort work in between,
    // and the 0.6 ms it held the GPU idle is charged to it.
    let again = s.acquire(2, 20, 3 * MS + 600_000).unwrap();
    assert_eq!(again[0].conn, 20);
    assert!(s.take_revocations().is_empty(), "nothing to revoke");
    assert_eq!(
        s.alloc_stats(2, 3 * MS + 600_000).unwrap().gpu_ns,
        3 * MS + 600_000
    );
    // The next request does not come: best-effort gets the GPU when the linger ends,
    // and the whole linger is charged.
    assert!(
        s.release(20, again[0].lease_id, MS, true, 5 * MS)
            .is_empty()
    );
    let be = s.tick(6 * MS);
    assert_eq!(be[0].conn, 10, "granted at the linger's end");
    assert_eq!(be[0].max_inflight_ns, Some(MS));
    assert_eq!(s.alloc_stats(2, 6 * MS).unwrap().gpu_ns, 6 * MS);
    assert_eq!(s.leased_total(2, 6 * MS), Some(6 * MS));
    // A lease that ran to its end (not an early hand-back) and best-effort hand-backs
    // never linger; nor does anyone with the linger off.
    let g = s.release(10, be[0].lease_id, MS, true, 7 * MS);
    assert!(g.is_empty() && s.next_wakeup(7 * MS).is_none());
    let mut off = lingering(0);
    let lat = off.acquire(2, 20, 0).unwrap()[0];
    off.acquire(1, 10, 0).unwrap();
    let g = off.release(20, lat.lease_id, MS, true, MS);
    assert_eq!(g[0].conn, 10, "no linger: best-effort at once");
}

#[test]
fn a_latency_tenant_cannot_hold_the_gpu_beyond_its_share_by_lingering() {
    // The attack: a latency tenant (share 20) that runs 0.2 ms per lease, hands back early
    // and asks again just before each linger ends, to keep the GPU from a saturating
    // best-effort tenant. Every sliding 1 s window gives it (leases and lingers together)
    // at most its share plus the window's slack; best-effort gets the rest.
    let linger = 2 * MS;
    let mut s = lingering(linger);
    s.allocs.get_mut(&2).unwrap().share = 20;
    s.set_tier(2, Tier::Latency).unwrap();
    let (mut now, end) = (0u64, 10 * S);
    // Each holder's grant and when it came.
    let mut lat: Option<(Grant, u64)> = None;
    let mut be: Option<(Grant, u64)> = None;
    let mut lat_ask: Option<u64> = Some(0);
    // (from, to) of the time the GPU was the latency tenant's: leases and lingers.
    let mut held: Vec<(u64, u64)> = Vec::new();
    let mut be_busy = 0u64;
    let mut linger_from: Option<u64> = None;
    let take = |gs: Vec<Grant>,
                now: u64,
                lat: &mut Option<(Grant, u64)>,
                be: &mut Option<(Grant, u64)>| {
        for g in gs {
            if g.conn == 20 {
                *lat = Some((g, now));
            } else {
                *be = Some((g, now));
            }
        }
    };
    let g = s.acquire(1, 10, 0).unwrap();
    take(g, 0, &mut lat, &mut be);
    while now < end {
        // Revocations end the best-effort lease (its time so far was its busy time).
        for r in s.take_revocations() {
            assert_eq!(r.conn, 10);
            if let Some((b, granted)) = be.take() {
                be_busy += now - granted;
                assert_eq!(b.lease_id, r.lease_id);
                let g = s.acquire(1, 10, now).unwrap();
                take(g, now, &mut lat, &mut be);
            }
        }
        if lat.is_some()
            && let Some(from) = linger_from.take()
        {
            held.push((from, now));
        }
        let next = [
            lat.map(|(_, granted)| granted + 200_000),
            be.map(|(g, granted)| granted + g.duration_ns),
            lat_ask,
            s.next_wakeup(now),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(end)
        .max(now);
        now = next;
        if let Some((g, granted)) = lat
            && now >= granted + 200_000
        {
            lat = None;
            held.push((granted, now));
            linger_from = Some(now);
            let gs = s.release(20, g.lease_id, 200_000, true, now);
            // It asks again 1 ns before the linger would end.
            lat_ask = Some(now + linger - 1);
            if !gs.is_empty() {
                // No room left for a linger: the GPU went on at once.
                linger_from = None;
            }
            take(gs, now, &mut lat, &mut be);
        } else if let Some((g, granted)) = be
            && now >= granted + g.duration_ns
        {
            be = None;
            be_busy += g.duration_ns;
            let gs = s.release(10, g.lease_id, g.duration_ns, false, now);
            take(gs, now, &mut lat, &mut be);
            let gs = s.acquire(1, 10, now).unwrap();
            take(gs, now, &mut lat, &mut be);
        } else if lat_ask.is_some_and(|t| now >= t) {
            lat_ask = None;
            let gs = s.acquire(2, 20, now).unwrap();
            take(gs, now, &mut lat, &mut be);
        } else {
            let gs = s.tick(now);
            if be.is_none()
                && gs.iter().any(|g| g.conn == 10)
                && let Some(from) = linger_from.take()
            {
                held.push((from, now));
            }
            take(gs, now, &mut lat, &mut be);
        }
    }
    let in_window = |from: u64, to: u64| -> u64 {
        held.iter()
            .map(|&(a, b)| b.min(to).saturating_sub(a.max(from)))
            .sum()
    };
    let mut from = 0;
    while from + S <= end {
        let w = in_window(from, from + S) as f64 / S as f64 * 100.0;
        assert!(w <= 20.5 + 1e-9, "{w:.2}% in [{from}, +1 s)");
        from += 50 * MS;
    }
    let total = in_window(0, end) as f64 / end as f64 * 100.0;
    assert!(total >= 15.0, "the attack did hold the GPU: {total:.1}%");
    let b = be_busy as f64 / end as f64 * 100.0;
    assert!(b >= 78.0, "best-effort got {b:.1}%");
}
