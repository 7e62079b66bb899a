//! The pure rules of [`super`]: caps, evictions, budgets, companions (no sockets).

use super::*;

fn limits() -> Limits {
    Limits {
        handshake_timeout: Duration::from_secs(1),
        pending: 4,
        pending_per_group: 3,
        pending_per_pid: 2,
        per_allocation: 4,
        admitted: 5,
        guaranteed: 1,
    }
}

fn g(n: u32) -> Group {
    Group::Cgroup(format!("/kubepods/pod{n}"))
}

fn evicted(s: &PendingSlot) -> bool {
    s.evict.evicted.load(Ordering::Acquire)
}

#[test]
fn the_pid_cap_refuses_and_a_full_container_drops_its_own_oldest() {
    let adm = Admission::new(limits());
    let a1 = adm.begin(g(1000), Some(10)).unwrap();
    let a2 = adm.begin(g(1000), Some(10)).unwrap();
    assert_eq!(
        adm.begin(g(1000), Some(10)).unwrap_err(),
        AdmissionError::PendingPid(2)
    );
    let b1 = adm.begin(g(1000), Some(11)).unwrap();
    // The container is full: its newest connection takes the place of its oldest.
    let b2 = adm.begin(g(1000), Some(12)).unwrap();
    assert!(evicted(&a1) && !evicted(&a2) && !evicted(&b1));
    assert_eq!(adm.current().0, 3);
    // The global cap: the fullest container loses its oldest, not the newcomer's.
    let c1 = adm.begin(g(0), Some(20)).unwrap();
    assert_eq!(adm.current().0, 4);
    let c2 = adm.begin(g(0), Some(21)).unwrap();
    assert!(evicted(&a2) && !evicted(&c1));
    assert_eq!(adm.current().0, 4);
    let c = adm.counts();
    assert_eq!(
        (c.refused_pid, c.evicted_group, c.evicted_pending),
        (1, 1, 1)
    );
    // An evicted slot's drop does not count twice; the maps forget peers at zero.
    drop((a1, a2, b1, b2, c1, c2));
    assert_eq!(adm.current(), (0, 0));
    let p = adm.pending.lock();
    assert!(p.by_pid.is_empty() && p.by_group.is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_evicted_slot_is_told_so() {
    let adm = Admission::new(limits());
    let old = adm.begin(g(1), Some(1)).unwrap();
    let _b = adm.begin(g(1), Some(2)).unwrap();
    let _c = adm.begin(g(1), Some(3)).unwrap();
    let _d = adm.begin(g(1), Some(4)).unwrap();
    // On tokio's paused clock: told at once, no time passing.
    let t0 = tokio::time::Instant::now();
    let woke = tokio::time::timeout(Duration::from_secs(5), old.evicted()).await;
    assert!(woke.is_ok());
    assert_eq!(t0.elapsed(), Duration::ZERO);
}

/// A `Hello` frame of this protocol version.
fn hello_frame(role: Role) -> Vec<u8> {
    let mut out = Vec::new();
    let hello = tessera_protocol::Hello {
        magic: tessera_protocol::MAGIC,
        version: PROTOCOL_VERSION,
        role,
    };
    wire::push_frame(&mut out, &hello).unwrap();
    out
}

// The handshake deadline, on tokio's paused clock (`start_paused`: time moves only when every
// task waits, straight to the next timer), so each case takes no real time and its instants
// are exact.

#[tokio::test(start_paused = true)]
async fn a_silent_client_is_timed_out_exactly_at_the_handshake_deadline() {
    let adm = Admission::new(limits());
    let slot = adm.begin(g(1), Some(1)).unwrap();
    let (_client, mut server) = tokio::io::duplex(64);
    let t0 = tokio::time::Instant::now();
    let r = read_hello_or_evicted(&mut server, &slot, limits().handshake_timeout).await;
    assert!(
        matches!(r, Some(Err(WireError::Timeout(d))) if d == Duration::from_secs(1)),
        "{r:?}"
    );
    assert_eq!(t0.elapsed(), Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_hello_a_moment_before_the_deadline_is_read() {
    use tokio::io::AsyncWriteExt;
    let adm = Admission::new(limits());
    let slot = adm.begin(g(1), Some(1)).unwrap();
    let (mut client, mut server) = tokio::io::duplex(64);
    let late = async {
        tokio::time::sleep(Duration::from_millis(999)).await;
        client.write_all(&hello_frame(Role::Admin)).await.unwrap();
    };
    let (r, ()) = tokio::join!(
        read_hello_or_evicted(&mut server, &slot, limits().handshake_timeout),
        late
    );
    assert!(matches!(r, Some(Ok(Role::Admin))), "{r:?}");
}

#[tokio::test(start_paused = true)]
async fn an_eviction_ends_the_wait_for_a_hello_before_the_deadline() {
    let adm = Admission::new(limits());
    let old = adm.begin(g(1), Some(1)).unwrap();
    let (_client, mut server) = tokio::io::duplex(64);
    let t0 = tokio::time::Instant::now();
    // 300 ms in, its container's fourth connection takes the oldest one's place.
    let newer = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        (2..=4)
            .map(|pid| adm.begin(g(1), Some(pid)).unwrap())
            .collect::<Vec<_>>()
    };
    let (r, _newer) = tokio::join!(
        read_hello_or_evicted(&mut server, &old, limits().handshake_timeout),
        newer
    );
    assert!(r.is_none(), "{r:?}");
    assert_eq!(t0.elapsed(), Duration::from_millis(300));
}

#[tokio::test(start_paused = true)]
async fn a_held_connection_is_closed_unanswered_at_the_deadline_and_its_place_given_back() {
    use tokio::io::AsyncReadExt;
    let adm = Admission::with_budget(
        limits(),
        BudgetParams {
            burst: 1,
            per_sec: 1,
            max_buckets: 8,
        },
    );
    // The pod has spent its budget of closes (a real second refills it; none passes here).
    assert!(adm.spend(&g(1), Instant::now()));
    let (server, mut client) = UnixStream::pair().unwrap();
    let pending = adm.begin(g(1), Some(1)).unwrap();
    let t0 = tokio::time::Instant::now();
    let held = tokio::spawn({
        let adm = Arc::clone(&adm);
        async move { park::close_or_hold(&adm, server, pending, &g(1)).await }
    });
    tokio::task::yield_now().await;
    assert_eq!((adm.parked(), adm.current().0), (1, 0), "held, not pending");
    let mut buf = [0u8; 8];
    assert_eq!(client.read(&mut buf).await.unwrap(), 0, "closed, no answer");
    assert_eq!(t0.elapsed(), limits().handshake_timeout);
    held.await.unwrap();
    assert_eq!(adm.parked(), 0);
}

#[test]
fn every_allocation_keeps_its_guaranteed_room_whatever_the_others_hold() {
    let adm = Admission::new(limits());
    // Three allocations: the pool is 5 - 3 x 1 = 2.
    let a: Vec<_> = (0..3).map(|_| adm.admit(1, Some(10), 3).unwrap()).collect();
    assert_eq!(
        adm.admit(1, Some(10), 3).unwrap_err(),
        AdmissionError::Admitted(3, 1)
    );
    // Allocation 1 filled the pool; 2 and 3 still get their guaranteed place.
    let b = adm.admit(2, Some(20), 3).unwrap();
    let c = adm.admit(3, Some(30), 3).unwrap();
    assert!(adm.admit(2, Some(20), 3).is_err());
    assert_eq!(adm.counts().refused_admitted, 2);
    drop(a);
    assert_eq!(adm.current(), (0, 2));
    assert_eq!(adm.admitted.lock().pooled, 0);
    // The per-allocation cap holds even with room in the pool.
    let adm = Admission::new(Limits {
        per_allocation: 2,
        ..limits()
    });
    let _x = [
        adm.admit(1, None, 1).unwrap(),
        adm.admit(1, None, 1).unwrap(),
    ];
    assert_eq!(
        adm.admit(1, None, 1).unwrap_err(),
        AdmissionError::Allocation(2)
    );
    drop((b, c));
}

#[test]
fn an_admitted_pid_has_companion_places_past_a_full_container() {
    let adm = Admission::new(limits());
    let _mem = adm.admit(1, Some(10), 1).unwrap();
    let flood: Vec<_> = (0..3)
        .map(|i| adm.begin(g(0), Some(100 + i)).unwrap())
        .collect();
    let companions: Vec<_> = (0..COMPANION_PENDING)
        .map(|_| adm.begin(g(0), Some(10)).unwrap())
        .collect();
    // The companions evicted nobody and are not counted in the caps.
    assert!(flood.iter().all(|s| !evicted(s)));
    assert_eq!(adm.current().0, 3);
    drop(companions);
    assert!(adm.pending.lock().companions.is_empty());
    // Companions per memory connection are capped, and free on drop.
    let c: Vec<_> = (0..COMPANIONS_PER_CONNECTION)
        .map(|_| adm.admit_companion(7).unwrap())
        .collect();
    assert_eq!(
        adm.admit_companion(7).unwrap_err(),
        AdmissionError::Companions(COMPANIONS_PER_CONNECTION)
    );
    drop(c);
    assert!(adm.admit_companion(7).is_ok());
}

#[test]
fn a_pod_past_its_budget_of_closes_has_its_connections_held_and_its_neighbour_does_not() {
    let adm = Admission::with_budget(
        limits(),
        BudgetParams {
            burst: 3,
            per_sec: 10,
            max_buckets: 8,
        },
    );
    let t0 = Instant::now();
    assert!((0..3).all(|_| adm.spend(&g(1), t0)));
    assert!(!adm.spend(&g(1), t0));
    // The neighbour, and the peers nobody could name, close theirs at once.
    assert!(adm.spend(&g(2), t0) && adm.spend(&Group::Unknown, t0));
    assert_eq!(adm.counts().held_budget, 1);
    // One more close 100 ms later, not before.
    assert!(!adm.spend(&g(1), t0 + Duration::from_millis(99)));
    assert!(adm.spend(&g(1), t0 + Duration::from_millis(100)));
    // The budget is about closes only: a pod past it still starts handshakes.
    assert!(adm.begin(g(1), Some(1)).is_ok());
}

#[test]
fn over_the_global_cap_a_tie_evicts_the_pod_with_the_oldest_connection() {
    // Eight one-connection pods and the newcomer's: the global cap evicts the oldest.
    let adm = Admission::new(Limits {
        pending: 4,
        pending_per_group: 4,
        pending_per_pid: 4,
        ..limits()
    });
    let old: Vec<_> = (0..4)
        .map(|i| adm.begin(g(i), Some(i as i32)).unwrap())
        .collect();
    let newcomer = adm.begin(g(10), Some(10)).unwrap();
    assert!(evicted(&old[0]) && !evicted(&newcomer));
    // The next flood connection evicts the next oldest, never the newcomer's.
    let _next = adm.begin(g(20), Some(20)).unwrap();
    assert!(evicted(&old[1]) && !evicted(&newcomer));
}

#[test]
fn connections_over_the_budget_are_held_within_the_pending_caps() {
    let adm = Admission::new(Limits {
        pending: 3,
        pending_per_group: 2,
        ..limits()
    });
    let a = [adm.park(&g(1)).unwrap(), adm.park(&g(1)).unwrap()];
    assert!(adm.park(&g(1)).is_none(), "the pod's cap");
    let b = adm.park(&g(2)).unwrap();
    assert!(adm.park(&g(3)).is_none(), "the global cap");
    assert_eq!(adm.parked(), 3);
    // Held places are not pending ones: the pending caps are untouched.
    assert_eq!(adm.current().0, 0);
    drop(a);
    assert!(adm.park(&g(3)).is_some());
    drop(b);
    assert_eq!(adm.parked(), 0);
}
