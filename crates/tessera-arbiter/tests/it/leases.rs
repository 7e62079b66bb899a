//! Compute leases through the real arbiter's tenant socket.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::*;
use tessera_protocol::client::TenantClient;
use tessera_protocol::{CreateAllocation, GpuSelector, TenantReply, TenantRequest, Tier};

fn lease(c: &mut TenantClient) -> (u64, u64) {
    match c.call(&TenantRequest::LeaseAcquire).unwrap() {
        TenantReply::LeaseGranted {
            lease_id,
            duration_ns,
        } => (lease_id, duration_ns),
        other => panic!("{other:?}"),
    }
}

/// A latency holder's lease: granted as such (it hands back at its drain), or a panic.
fn latency_lease(c: &mut TenantClient) -> (u64, u64) {
    match c.call(&TenantRequest::LeaseAcquireTiered).unwrap() {
        TenantReply::LeaseGrantedLatency {
            lease_id,
            duration_ns,
        } => (lease_id, duration_ns),
        other => panic!("{other:?}"),
    }
}

/// Asks for a lease on another thread; the receiver yields (lease, when granted, client).
fn lease_async(c: TenantClient) -> mpsc::Receiver<((u64, u64), Instant, TenantClient)> {
    lease_async_with(c, lease)
}

/// [`lease_async`] with `ask` asking.
fn lease_async_with(
    mut c: TenantClient,
    ask: fn(&mut TenantClient) -> (u64, u64),
) -> mpsc::Receiver<((u64, u64), Instant, TenantClient)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let l = ask(&mut c);
        let _ = tx.send((l, Instant::now(), c));
    });
    rx
}

#[test]
fn one_lease_per_gpu_early_release_hands_over_and_revocation_and_close() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let mk = |share| CreateAllocation {
        gpu: GpuSelector::Index(0),
        memory_limit: GIB,
        share,
        cap: None,
        labels: BTreeMap::new(),
    };
    let (ta, a) = admin.create(mk(50)).unwrap();
    let (tb, b) = admin.create(mk(50)).unwrap();
    let mut ca = arb.tenant(&ta);
    let asked = Instant::now();
    let (la, dur) = lease(&mut ca);
    assert!(
        (10_000_000..=100_000_000).contains(&dur),
        "lease length {dur}"
    );
    // A lease ends when its holder hands it back or when it runs out (the daemon then revokes
    // it): a grant to someone else that comes before both is two holders at once. `asked` is
    // before the real grant, so `asked + dur` is no later than the real deadline.
    let one_holder = |granted: Instant, released: Instant, asked: Instant, dur: u64, what: &str| {
        assert!(
            granted >= released || granted >= asked + Duration::from_nanos(dur),
            "{what}: granted while the other held the GPU"
        );
    };

    // B waits while A holds the GPU; memory requests on other connections are unaffected.
    let rb = lease_async(arb.tenant(&tb));
    let mut other = arb.tenant(&ta);
    assert_eq!(other.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
    // A hands back early: B gets the GPU (how soon is measured by `compute_share --only idle`).
    let sent = Instant::now();
    ca.send(&TenantRequest::LeaseRelease {
        lease_id: la,
        busy_ns: 1_000_000,
        early: true,
    })
    .unwrap();
    let ((lb, dur_b), granted, mut cb) = rb.recv_timeout(Duration::from_secs(10)).unwrap();
    one_holder(granted, sent, asked, dur, "B");
    println!("hand-over after an early release: {:?}", granted - sent);

    // A waits; B never releases: revoked after deadline + grace, then A is served.
    let asked_a = Instant::now();
    let ra = lease_async(ca);
    let ((la2, dur2), a_granted, ca) = ra
        .recv_timeout(Duration::from_secs(10))
        .expect("revocation");
    assert!(la2 > lb);
    assert!(
        a_granted >= sent + Duration::from_nanos(dur_b),
        "A was served before B's lease ran out"
    );
    // B's late release is ignored; B asks again and waits behind A.
    cb.send(&TenantRequest::LeaseRelease {
        lease_id: lb,
        busy_ns: 0,
        early: false,
    })
    .unwrap();
    let rb = lease_async(cb);
    // A's process dies while holding the lease: B is served.
    let killed = Instant::now();
    drop(ca);
    let ((lb2, _), granted, _cb) = rb.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(lb2 > la2);
    // B's grant came after A's death or A's deadline (A's grant came after `asked_a`).
    one_holder(granted, killed, asked_a, dur2, "B again");
    println!("served after the holder died: {:?}", granted - killed);

    // GPU time is accounted per allocation.
    let list = admin.list().unwrap();
    let time = |id: &str| list.iter().find(|x| x.id == id).unwrap().gpu_time_10s_ns;
    assert!(time(&a.id) >= 1_000_000, "A: {}", time(&a.id));
    assert!(
        time(&b.id) >= 20_000_000,
        "B was charged its revoked lease: {}",
        time(&b.id)
    );
}

#[test]
fn waiting_process_that_dies_is_forgotten() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let mk = |share| CreateAllocation {
        gpu: GpuSelector::Index(1),
        memory_limit: GIB,
        share,
        cap: None,
        labels: BTreeMap::new(),
    };
    let (ta, _) = admin.create(mk(50)).unwrap();
    let (tb, b) = admin.create(mk(50)).unwrap();
    let mut ca = arb.tenant(&ta);
    let (la, _) = lease(&mut ca);
    // B asks and then its connection closes while waiting.
    let cb = arb.tenant(&tb);
    tessera_protocol::frame::write_frame(&mut cb.stream(), &TenantRequest::LeaseAcquire).unwrap();
    drop(cb);
    // The arbiter has seen the close once B's allocation has no process left: it forgets the
    // waiter before it forgets the process.
    wait_until(Duration::from_secs(10), || {
        admin
            .list()
            .unwrap()
            .iter()
            .find(|x| x.id == b.id)
            .unwrap()
            .processes
            == 0
    })
    .expect("the arbiter never saw B's connection close");
    // A releases and asks again: it gets the next lease (ids count up per GPU), so none went to
    // the dead waiter.
    ca.send(&TenantRequest::LeaseRelease {
        lease_id: la,
        busy_ns: 5_000_000,
        early: false,
    })
    .unwrap();
    let (next, _) = lease(&mut ca);
    assert_eq!(next, la + 1, "a lease went to the closed waiter");
}

/// Two busy tenants that use every lease to its end, in real time: both are served, and each is
/// charged at least the GPU time it reported (up to each lease's length). How closely the split follows the shares is a
/// figure, measured by `compute_share` (30/70 row); here it is only printed.
#[test]
fn busy_tenants_are_both_served_and_charged_what_they_used() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let mk = |share| CreateAllocation {
        gpu: GpuSelector::Index(0),
        memory_limit: GIB,
        share,
        cap: None,
        labels: BTreeMap::new(),
    };
    let (t30, a30) = admin.create(mk(30)).unwrap();
    let (t70, a70) = admin.create(mk(70)).unwrap();
    let run_for = Duration::from_secs(3);
    let handles: Vec<_> = [t30, t70]
        .into_iter()
        .map(|token| {
            let mut c = arb.tenant(&token);
            std::thread::spawn(move || {
                let start = Instant::now();
                let (mut busy, mut leases) = (0u64, 0u64);
                while start.elapsed() < run_for {
                    let (id, ns) = lease(&mut c);
                    let t = Instant::now();
                    std::thread::sleep(Duration::from_nanos(ns));
                    let busy_ns = t.elapsed().as_nanos() as u64;
                    // A release that comes after the lease was revoked (a slow machine) is not
                    // charged; the revoked lease is, for at least its length.
                    busy += busy_ns.min(ns);
                    leases += 1;
                    c.send(&TenantRequest::LeaseRelease {
                        lease_id: id,
                        busy_ns,
                        early: false,
                    })
                    .unwrap();
                }
                // A round trip after the last release: the arbiter has taken it in.
                assert_eq!(c.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
                (c, busy, leases)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let list = admin.list().unwrap();
    let status = |id: &str| list.iter().find(|x| x.id == id).unwrap().clone();
    let (s30, s70) = (status(&a30.id), status(&a70.id));
    for (s, (_, busy, leases)) in [&s30, &s70].into_iter().zip(&results) {
        assert!(*leases >= 1, "allocation {} was never served", s.id);
        assert_eq!(s.leases, *leases, "leases counted for {}", s.id);
        assert!(
            s.gpu_time_total_ns >= *busy,
            "{} charged {} ns for {busy} ns reported",
            s.id,
            s.gpu_time_total_ns
        );
    }
    let (c30, c70) = (s30.gpu_time_total_ns as f64, s70.gpu_time_total_ns as f64);
    println!(
        "charged split {:.1}/{:.1} (shares 30/70)",
        c30 / (c30 + c70) * 100.0,
        c70 / (c30 + c70) * 100.0
    );
}

/// A tenant capped at 30% alone on the GPU is granted no more than its cap allows, whatever the
/// machine's load (load only delays grants): at most the cap of the run plus one cap window and
/// one longest lease. The measured figure is `compute_share`'s cap row.
#[test]
fn a_capped_tenant_alone_is_granted_no_more_than_its_cap() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, _) = admin
        .create(CreateAllocation {
            gpu: GpuSelector::Index(1),
            memory_limit: GIB,
            share: 30,
            cap: Some(30),
            labels: BTreeMap::new(),
        })
        .unwrap();
    let mut c = arb.tenant(&token);
    let run_for = Duration::from_secs(3);
    let start = Instant::now();
    let mut granted = 0u64;
    while start.elapsed() < run_for {
        let (id, ns) = lease(&mut c);
        granted += ns;
        let t = Instant::now();
        std::thread::sleep(Duration::from_nanos(ns));
        c.send(&TenantRequest::LeaseRelease {
            lease_id: id,
            busy_ns: t.elapsed().as_nanos() as u64,
            early: false,
        })
        .unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let granted = granted as f64 / 1e9;
    let bound = 0.30 * (elapsed + 1.0) + 0.1;
    println!(
        "capped tenant granted {granted:.2} s in {elapsed:.2} s ({:.1}%)",
        granted / elapsed * 100.0
    );
    assert!(
        granted <= bound,
        "granted {granted:.2} s in {elapsed:.2} s, above the 30% cap's bound of {bound:.2} s"
    );
}

/// An early hand-back passes the GPU to the waiter, 100 times in a row, never to two holders at
/// once. How fast is `compute_share --only idle`'s figure.
#[test]
fn early_hand_back_passes_the_gpu_to_the_waiter() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let mk = |share| CreateAllocation {
        gpu: GpuSelector::Index(0),
        memory_limit: GIB,
        share,
        cap: None,
        labels: BTreeMap::new(),
    };
    let (ta, _) = admin.create(mk(50)).unwrap();
    let (tb, _) = admin.create(mk(50)).unwrap();
    let mut holder = arb.tenant(&ta);
    let mut waiter = arb.tenant(&tb);
    let mut last = 0;
    for _ in 0..100 {
        let asked = Instant::now();
        let (id, dur) = lease(&mut holder);
        assert!(id > last);
        let rx = lease_async(waiter);
        let sent = Instant::now();
        holder
            .send(&TenantRequest::LeaseRelease {
                lease_id: id,
                busy_ns: 1_000_000,
                early: true,
            })
            .unwrap();
        let ((wid, _), granted, w) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(wid > id);
        assert!(
            granted >= sent || granted >= asked + Duration::from_nanos(dur),
            "the waiter was granted while the holder held the GPU"
        );
        last = wid;
        waiter = w;
        waiter
            .send(&TenantRequest::LeaseRelease {
                lease_id: wid,
                busy_ns: 0,
                early: true,
            })
            .unwrap();
    }
}

fn alloc(share: u32) -> CreateAllocation {
    CreateAllocation {
        gpu: GpuSelector::Index(0),
        memory_limit: GIB,
        share,
        cap: None,
        labels: BTreeMap::new(),
    }
}

/// A best-effort tenant and a latency one (share 40) on GPU 0: (tokens, ids).
fn tiered(arb: &Arbiter) -> ([String; 2], [String; 2]) {
    let mut admin = arb.admin();
    let (tb, b) = admin.create(alloc(60)).unwrap();
    let (tl, l) = admin.create_tiered(alloc(40), None, Tier::Latency).unwrap();
    assert_eq!((b.tier, l.tier), (Tier::BestEffort, Tier::Latency));
    ([tb, tl], [b.id, l.id])
}

/// A process of the latency allocation `tl` that has asked for a lease once and handed it
/// back: while its connection (returned) is open, best-effort grants are bounded.
fn latency_process(arb: &Arbiter, tl: &str) -> TenantClient {
    let mut c = arb.tenant(tl);
    let (id, _) = latency_lease(&mut c);
    c.send(&TenantRequest::LeaseRelease {
        lease_id: id,
        busy_ns: 0,
        early: true,
    })
    .unwrap();
    c
}

#[test]
fn a_latency_request_revokes_the_best_effort_lease_at_once_and_best_effort_is_bounded() {
    let arb = Arbiter::start();
    let ([tb, tl], [b, l]) = tiered(&arb);
    let mut cb = arb.tenant(&tb);
    // With no process of the latency allocation there, a best-effort grant is unbounded.
    let (first, _) = lease(&mut cb);
    cb.send(&TenantRequest::LeaseRelease {
        lease_id: first,
        busy_ns: 0,
        early: true,
    })
    .unwrap();
    // With one there, a best-effort grant bounds its work in flight.
    let _service = latency_process(&arb, &tl);
    let (lb, dur) = match cb.call(&TenantRequest::LeaseAcquire).unwrap() {
        TenantReply::LeaseGrantedBounded {
            lease_id,
            duration_ns,
            max_inflight_ns,
        } => {
            assert_eq!(max_inflight_ns, 1_000_000, "the default bound");
            (lease_id, duration_ns)
        }
        other => panic!("{other:?}"),
    };
    // The latency tenant asks while the best-effort one holds: it is granted (an unbounded
    // lease, as a latency holder's), and the holder is told its lease is revoked.
    let asked = Instant::now();
    let rl = lease_async_with(arb.tenant(&tl), latency_lease);
    cb.stream()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(
        cb.recv().unwrap(),
        TenantReply::LeaseRevoked { lease_id: lb },
        "the holder is told"
    );
    let revoked = asked.elapsed();
    let ((ll, _), granted, mut cl) = rl.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(ll > lb);
    println!(
        "revoked after {revoked:?}, granted after {:?} (the lease had {} ms)",
        granted - asked,
        dur / 1_000_000
    );
    // The request done, an interposer from before `LeaseAcquireTiered` (it asks with
    // `LeaseAcquire`) is granted the reply it can read, latency or not (`lease` panics on any
    // other).
    cl.send(&TenantRequest::LeaseRelease {
        lease_id: ll,
        busy_ns: 0,
        early: true,
    })
    .unwrap();
    let mut old = arb.tenant(&tl);
    let (lo, _) = lease(&mut old);
    assert!(lo > ll);
    // Both are shown with their tier.
    let list = arb.admin().list().unwrap();
    let tier = |id: &str| list.iter().find(|x| x.id == id).unwrap().tier;
    assert_eq!((tier(&b), tier(&l)), (Tier::BestEffort, Tier::Latency));
}

#[test]
fn asking_as_a_tiered_interposer_does_not_make_a_best_effort_lease_a_latency_one() {
    // The attack: a best-effort process asks with `LeaseAcquireTiered`, hoping for a latency
    // holder's grant. The tier is the allocation's (the operator's), not the request's: it is
    // granted as any best-effort holder, and bounded beside a latency service.
    let arb = Arbiter::start();
    let ([tb, tl], _) = tiered(&arb);
    let mut cb = arb.tenant(&tb);
    let reply = cb.call(&TenantRequest::LeaseAcquireTiered).unwrap();
    let TenantReply::LeaseGranted { lease_id, .. } = reply else {
        panic!("{reply:?}");
    };
    cb.send(&TenantRequest::LeaseRelease {
        lease_id,
        busy_ns: 0,
        early: true,
    })
    .unwrap();
    let _service = latency_process(&arb, &tl);
    let reply = cb.call(&TenantRequest::LeaseAcquireTiered).unwrap();
    assert!(
        matches!(reply, TenantReply::LeaseGrantedBounded { .. }),
        "{reply:?}"
    );
}

#[test]
fn a_best_effort_tenant_cannot_make_itself_latency_from_its_socket() {
    let arb = Arbiter::start();
    let ([tb, tl], [b, _]) = tiered(&arb);
    let _service = latency_process(&arb, &tl);
    // The attack: the admin request that creates latency allocations, sent on the tenant
    // socket (the only socket a container has). It is not a tenant request: the connection
    // is closed, nothing is created, and the tier stays.
    let cb = arb.tenant(&tb);
    let before = arb.admin().list().unwrap().len();
    let mut frame = Vec::new();
    tessera_protocol::frame::write_frame(
        &mut frame,
        &tessera_protocol::AdminRequest::CreateTiered {
            create: alloc(100),
            owner: None,
            tier: Tier::Latency,
        },
    )
    .unwrap();
    use std::io::{Read, Write};
    let mut s = cb.stream().try_clone().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&frame).unwrap();
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap_or(0);
    assert!(
        n == 0
            || matches!(
                tessera_protocol::frame::read_frame::<_, TenantReply>(&mut &buf[..n]),
                Ok(TenantReply::Error { .. })
            ),
        "the arbiter served an admin request on the tenant socket: {:?}",
        &buf[..n]
    );
    drop(cb);
    let list = arb.admin().list().unwrap();
    assert_eq!(list.len(), before, "nothing was created");
    assert_eq!(
        list.iter().find(|x| x.id == b).unwrap().tier,
        Tier::BestEffort
    );
    // A new connection of the same tenant is still served as best-effort: bounded.
    let mut again = arb.tenant(&tb);
    assert!(matches!(
        again.call(&TenantRequest::LeaseAcquire).unwrap(),
        TenantReply::LeaseGrantedBounded { .. }
    ));
}
