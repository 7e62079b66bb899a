//! Tests of the tenant service's pure parts: scheduling classes and waits for draining bytes.

use super::*;

/// A reservation that fits once a killed sibling's bytes go, asked before that sibling's
/// connection thread read the end of its stream (its bytes held, not yet draining):
/// granted once they are released, not refused after the memory wait. Beside a sibling
/// that lives, the same request is refused after the memory wait.
#[test]
fn a_reservation_waits_for_an_exited_siblings_bytes_not_yet_draining() {
    use crate::peer::{Peer, ProcId, proc_start};
    use std::time::Duration;
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let (arb, token) = crate::state::test_arbiter_with_allocation(dir.path(), 1, 1 << 30);
    arb.set_memory_wait(Duration::from_millis(20));
    let proc_of = |pid: u32| ProcId {
        pid: pid as i32,
        start: proc_start(pid as i32).unwrap(),
    };
    let me = arb
        .attach_tenant(
            &token,
            7,
            Some(Peer::without_pidfd(proc_of(std::process::id()))),
        )
        .unwrap();
    let (sock, _other) = UnixStream::pair().unwrap();
    let ask = || {
        let t0 = Instant::now();
        let r = reserve_pressing(&arb, &me, (7, sock.as_raw_fd()), 400 * MIB, 0, |l| {
            l.reserve(me.key, 7, 400 * MIB).map(|r| match r {
                Reservation::Granted { in_use } => Credit::Granted {
                    bytes: 400 * MIB,
                    in_use,
                },
                Reservation::Denied { limit, in_use } => Credit::Denied { limit, in_use },
            })
        });
        (r.unwrap(), t0.elapsed())
    };

    let mut child = std::process::Command::new("sleep")
        .arg("10")
        .spawn()
        .unwrap();
    let sibling = proc_of(child.id());
    let other = arb
        .attach_tenant(&token, 8, Some(Peer::without_pidfd(sibling)))
        .unwrap();
    arb.with_ledger(|l| l.reserve(other.key, 8, 800 * MIB))
        .unwrap();
    let (r, took) = ask();
    assert!(
        matches!(r, Credit::Denied { .. }),
        "a live sibling's bytes: {r:?}"
    );
    assert!(
        took < crate::drain::DRAIN_BOUND,
        "refused after the memory wait, took {took:?}"
    );

    child.kill().unwrap();
    child.wait().unwrap();
    let (r, took) = std::thread::scope(|s| {
        s.spawn(|| {
            // The sibling's connection thread, late: it drains (no card: the exit is the
            // word), detaches and tells the waiters, as `serve` does at a close.
            std::thread::sleep(Duration::from_millis(300));
            crate::drain::after_close(&arb, &other, 8, Some(sibling));
            arb.detach_tenant(&other, 8, Some(sibling)).unwrap();
            arb.pressure().note_freed();
        });
        ask()
    });
    assert!(
        matches!(r, Credit::Granted { .. }),
        "an exited sibling's bytes: {r:?}"
    );
    assert!(
        took >= Duration::from_millis(250),
        "granted only once released: {took:?}"
    );
}

#[test]
fn connection_threads_run_sched_batch() {
    let policy = std::thread::spawn(|| {
        batch_scheduling();
        // SAFETY: no preconditions; pid 0 is the calling thread.
        unsafe { libc::sched_getscheduler(0) }
    })
    .join()
    .unwrap();
    assert_eq!(policy, libc::SCHED_BATCH);
    // Only the thread that asked changed.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER);
}

#[test]
fn a_lease_connection_thread_goes_back_to_normal_scheduling() {
    let policies = std::thread::spawn(|| {
        batch_scheduling();
        // SAFETY: no preconditions; pid 0 is the calling thread.
        let before = unsafe { libc::sched_getscheduler(0) };
        normal_scheduling();
        // SAFETY: as above.
        (before, unsafe { libc::sched_getscheduler(0) })
    })
    .join()
    .unwrap();
    assert_eq!(policies, (libc::SCHED_BATCH, libc::SCHED_OTHER));
}
