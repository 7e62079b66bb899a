//! Compute leases through the real arbiter's tenant socket.

mod common;

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use tessera_protocol::client::TenantClient;
use tessera_protocol::{CreateAllocation, GpuSelector, TenantReply, TenantRequest};

fn lease(c: &mut TenantClient) -> (u64, u64) {
    match c.call(&TenantRequest::LeaseAcquire).unwrap() {
        TenantReply::LeaseGranted {
            lease_id,
            duration_ns,
        } => (lease_id, duration_ns),
        other => panic!("{other:?}"),
    }
}

/// Asks for a lease on another thread; the receiver yields (lease, when granted, client).
fn lease_async(mut c: TenantClient) -> mpsc::Receiver<((u64, u64), Instant, TenantClient)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let l = lease(&mut c);
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
    let (la, dur) = lease(&mut ca);
    assert!(
        (10_000_000..=100_000_000).contains(&dur),
        "lease length {dur}"
    );

    // B waits while A holds the GPU; memory requests on other connections are unaffected.
    let rb = lease_async(arb.tenant(&tb));
    let mut other = arb.tenant(&ta);
    assert_eq!(other.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
    assert!(
        rb.recv_timeout(Duration::from_millis(5)).is_err(),
        "granted while A holds it"
    );
    // A hands back early: B gets the GPU at once.
    let sent = Instant::now();
    ca.send(&TenantRequest::LeaseRelease {
        lease_id: la,
        busy_ns: 1_000_000,
        early: true,
    })
    .unwrap();
    let ((lb, _), granted, mut cb) = rb.recv_timeout(Duration::from_secs(2)).unwrap();
    let handover = granted - sent;
    assert!(
        handover < Duration::from_millis(50),
        "hand-over took {handover:?}"
    );

    // A waits; B never releases: revoked after deadline + grace, then A is served.
    let ra = lease_async(ca);
    let ((la2, _), _, ca) = ra.recv_timeout(Duration::from_secs(2)).expect("revocation");
    assert!(la2 > lb);
    // B's late release is ignored; B asks again and waits behind A.
    cb.send(&TenantRequest::LeaseRelease {
        lease_id: lb,
        busy_ns: 0,
        early: false,
    })
    .unwrap();
    let rb = lease_async(cb);
    assert!(rb.recv_timeout(Duration::from_millis(5)).is_err());
    // A's process dies while holding the lease: B is served immediately.
    let killed = Instant::now();
    drop(ca);
    let (_, granted, _cb) = rb.recv_timeout(Duration::from_secs(2)).unwrap();
    assert!(
        granted - killed < Duration::from_millis(50),
        "took {:?}",
        granted - killed
    );

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
    let (tb, _) = admin.create(mk(50)).unwrap();
    let mut ca = arb.tenant(&ta);
    let (la, _) = lease(&mut ca);
    // B asks and then its connection closes while waiting.
    let cb = arb.tenant(&tb);
    tessera_protocol::frame::write_frame(&mut cb.stream(), &TenantRequest::LeaseAcquire).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    drop(cb);
    std::thread::sleep(Duration::from_millis(20));
    // A releases and asks again: it is served at once (nobody else is waiting).
    ca.send(&TenantRequest::LeaseRelease {
        lease_id: la,
        busy_ns: 5_000_000,
        early: false,
    })
    .unwrap();
    let start = Instant::now();
    lease(&mut ca);
    assert!(
        start.elapsed() < Duration::from_millis(50),
        "took {:?}",
        start.elapsed()
    );
}
