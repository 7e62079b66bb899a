//! Unit tests of the ledger's rules (properties against a simple model are in `properties`).

use std::sync::Arc;

use parking_lot::Mutex;

use super::*;

const MIB: u64 = 1 << 20;

#[test]
fn held_undrained_counts_a_live_connections_bytes_and_excess_and_nothing_draining() {
    let mut l = Ledger::new();
    l.open(1, 1024 * MIB);
    l.attach(1, 10).unwrap();
    l.reserve(1, 10, 200 * MIB).unwrap();
    l.set_excess(1, 10, 50 * MIB).unwrap();
    assert_eq!(l.held_undrained(1, 10), 250 * MIB);
    assert_eq!(l.held_undrained(1, 99), 0, "an unknown connection");
    assert_eq!(l.held_undrained(2, 10), 0, "an unknown account");
    // Once draining, its bytes show in `draining` instead: never counted twice.
    l.begin_drain(1, 10).unwrap();
    assert_eq!(l.held_undrained(1, 10), 0);
    assert_eq!(l.draining(1), 250 * MIB);
}

#[test]
fn a_draining_connection_stays_counted_is_not_pressed_and_goes_at_its_detach() {
    let mut l = Ledger::new();
    l.open(1, 1024 * MIB);
    l.attach(1, 10).unwrap();
    l.attach(1, 11).unwrap();
    l.reserve(1, 10, 600 * MIB).unwrap();
    l.set_excess(1, 10, 100 * MIB).unwrap();
    l.reserve(1, 11, 100 * MIB).unwrap();
    assert_eq!(l.others_holding(1, 11), vec![10]);
    assert_eq!(l.begin_drain(1, 10).unwrap(), 700 * MIB);
    assert_eq!(l.draining(1), 700 * MIB);
    assert!(l.others_holding(1, 11).is_empty(), "nobody answers for it");
    // The card still holds its memory: a sibling does not get it yet.
    assert!(matches!(
        l.reserve(1, 11, 300 * MIB).unwrap(),
        Reservation::Denied { in_use, .. } if in_use == 800 * MIB
    ));
    // Deleting the allocation keeps the account until the drain ends.
    assert!(!l.close(1).unwrap());
    assert_eq!(l.detach(1, 11).unwrap(), 100 * MIB);
    assert_eq!(l.usage(1).unwrap().in_use, 700 * MIB);
    assert_eq!(l.detach(1, 10).unwrap(), 600 * MIB);
    assert!(l.usage(1).is_none());
    assert_eq!(l.draining(1), 0);
    assert!(l.begin_drain(1, 10).is_err());
}

#[test]
fn a_draining_connection_released_early_frees_once_and_its_detach_frees_nothing() {
    let mut l = Ledger::new();
    l.open(1, 1024 * MIB);
    l.attach(1, 10).unwrap();
    l.attach(1, 11).unwrap();
    l.reserve(1, 10, 600 * MIB).unwrap();
    l.set_excess(1, 10, 100 * MIB).unwrap();
    // Not draining: a live connection's bytes are never taken this way.
    assert_eq!(l.release_drained(1, 10).unwrap(), 0);
    assert_eq!(l.usage(1).unwrap().in_use, 700 * MIB);
    l.begin_drain(1, 10).unwrap();
    assert_eq!(l.release_drained(1, 10).unwrap(), 700 * MIB);
    assert_eq!((l.usage(1).unwrap().in_use, l.draining(1)), (0, 0));
    // A second release (the connection's own thread) frees nothing more.
    assert_eq!(l.release_drained(1, 10).unwrap(), 0);
    assert_eq!(l.begin_drain(1, 10).unwrap(), 0);
    // The room is the sibling's now.
    assert!(matches!(
        l.reserve(1, 11, 1024 * MIB).unwrap(),
        Reservation::Granted { .. }
    ));
    assert_eq!(l.detach(1, 10).unwrap(), 0);
    assert_eq!(l.usage(1).unwrap().in_use, 1024 * MIB);
    assert!(l.release_drained(1, 10).is_err(), "gone with its detach");
}

#[test]
fn a_process_excess_on_the_card_counts_until_it_is_cleared_or_its_connection_goes() {
    let mut l = Ledger::new();
    l.open(1, 1024 * MIB);
    l.attach(1, 10).unwrap();
    l.attach(1, 11).unwrap();
    // Conn 10 reserved a 300 MiB context estimate; the card holds 500 MiB for it.
    l.reserve(1, 10, 300 * MIB).unwrap();
    assert_eq!(l.set_excess(1, 10, 200 * MIB).unwrap(), 500 * MIB);
    // 600 MiB fitted the estimate (900), not the card (1100).
    assert!(matches!(
        l.reserve(1, 11, 600 * MIB).unwrap(),
        Reservation::Denied { .. }
    ));
    assert!(matches!(
        l.reserve(1, 11, 524 * MIB).unwrap(),
        Reservation::Granted { in_use } if in_use == 1024 * MIB
    ));
    // A new figure replaces the old; over the limit is accepted (the memory exists).
    assert_eq!(l.set_excess(1, 10, 250 * MIB).unwrap(), 1074 * MIB);
    assert_eq!(l.set_excess(1, 10, 0).unwrap(), 824 * MIB);
    l.set_excess(1, 10, 100 * MIB).unwrap();
    // The connection's bytes and its excess go together.
    assert_eq!(l.detach(1, 10).unwrap(), 300 * MIB);
    assert_eq!(l.usage(1).unwrap().in_use, 524 * MIB);
    assert!(matches!(
        l.set_excess(1, 10, MIB),
        Err(LedgerError::UnknownConnection { .. })
    ));
}

#[test]
fn reserve_within_limit_and_deny_past_it() {
    let mut l = Ledger::new();
    l.open(1, 100 * MIB);
    l.attach(1, 10).unwrap();
    assert_eq!(
        l.reserve(1, 10, 60 * MIB).unwrap(),
        Reservation::Granted { in_use: 60 * MIB }
    );
    assert_eq!(
        l.reserve(1, 10, 41 * MIB).unwrap(),
        Reservation::Denied {
            limit: 100 * MIB,
            in_use: 60 * MIB
        }
    );
    assert_eq!(
        l.reserve(1, 10, 40 * MIB).unwrap(),
        Reservation::Granted { in_use: 100 * MIB }
    );
    assert_eq!(l.usage(1).unwrap().in_use, 100 * MIB);
}

#[test]
fn reserve_never_overflows() {
    let mut l = Ledger::new();
    l.open(1, u64::MAX);
    l.attach(1, 1).unwrap();
    assert!(matches!(
        l.reserve(1, 1, u64::MAX - 1).unwrap(),
        Reservation::Granted { .. }
    ));
    assert!(matches!(
        l.reserve(1, 1, 2).unwrap(),
        Reservation::Denied { .. }
    ));
    assert_eq!(l.usage(1).unwrap().in_use, u64::MAX - 1);
}

#[test]
fn limit_is_shared_by_all_connections_of_an_account() {
    let mut l = Ledger::new();
    l.open(7, 10);
    l.attach(7, 1).unwrap();
    l.attach(7, 2).unwrap();
    assert!(matches!(
        l.reserve(7, 1, 6).unwrap(),
        Reservation::Granted { in_use: 6 }
    ));
    assert_eq!(
        l.reserve(7, 2, 5).unwrap(),
        Reservation::Denied {
            limit: 10,
            in_use: 6
        }
    );
    assert!(matches!(
        l.reserve(7, 2, 4).unwrap(),
        Reservation::Granted { in_use: 10 }
    ));
    // Another account is independent.
    l.open(8, 10);
    l.attach(8, 3).unwrap();
    assert!(matches!(
        l.reserve(8, 3, 10).unwrap(),
        Reservation::Granted { in_use: 10 }
    ));
}

#[test]
fn racing_reservations_from_threads_never_pass_the_limit() {
    let limit = 1000u64;
    let ledger = Arc::new(Mutex::new(Ledger::new()));
    {
        let mut l = ledger.lock();
        l.open(1, limit);
        for conn in 0..8 {
            l.attach(1, conn).unwrap();
        }
    }
    let handles: Vec<_> = (0..8u64)
        .map(|conn| {
            let ledger = Arc::clone(&ledger);
            std::thread::spawn(move || {
                let mut granted = 0u64;
                for i in 0..1000u64 {
                    let bytes = 1 + (i + conn) % 7;
                    let r = ledger.lock().reserve(1, conn, bytes).unwrap();
                    match r {
                        Reservation::Granted { in_use } => {
                            assert!(in_use <= limit);
                            granted += bytes;
                            if i % 3 == 0 {
                                ledger.lock().release(1, conn, bytes).unwrap();
                                granted -= bytes;
                            }
                        }
                        Reservation::Denied { in_use, .. } => assert!(in_use <= limit),
                    }
                }
                granted
            })
        })
        .collect();
    let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    let mut l = ledger.lock();
    let usage = l.usage(1).unwrap();
    assert_eq!(
        usage.in_use, total,
        "ledger equals the sum of what threads hold"
    );
    assert!(usage.in_use <= limit);
    for conn in 0..8 {
        l.detach(1, conn).unwrap();
    }
    assert_eq!(l.usage(1).unwrap().in_use, 0);
}

#[test]
fn credit_is_given_only_from_room_nobody_needs() {
    let mut l = Ledger::new();
    l.open(1, 100);
    l.attach(1, 1).unwrap();
    l.attach(1, 2).unwrap();
    // 40 + at most half of the 60 left: 30.
    assert_eq!(
        l.reserve_credit(1, 1, 40, 1000).unwrap(),
        Credit::Granted {
            bytes: 70,
            in_use: 70
        }
    );
    assert_eq!(
        l.reserve_credit(1, 2, 31, 0).unwrap(),
        Credit::Denied {
            limit: 100,
            in_use: 70
        }
    );
    assert_eq!(
        l.reserve_credit(1, 2, 30, 10).unwrap(),
        Credit::Granted {
            bytes: 30,
            in_use: 100
        }
    );
    assert_eq!(l.others_holding(1, 1), vec![2]);
    l.release(1, 2, 30).unwrap();
    assert!(
        l.others_holding(1, 1).is_empty(),
        "a connection holding nothing has no credit"
    );
    assert_eq!(
        l.reserve_credit(1, 2, u64::MAX, 1).unwrap(),
        Credit::Denied {
            limit: 100,
            in_use: 70
        }
    );
}

/// The racers' false out-of-memory: a reservation that did not fit presses the processes
/// holding bytes; a process that held nothing then (a new one, its context not reserved
/// yet) is granted its request *and credit* from the room the answers made, and the
/// waiter's retry no longer fits beside that credit, which nobody presses back.
#[test]
fn no_credit_is_given_while_a_reservation_waits_for_room() {
    let (w, sibling, new) = (1, 2, 3);
    let mut l = Ledger::new();
    l.open(1, 1000);
    for c in [w, sibling, new] {
        l.attach(1, c).unwrap();
    }
    l.reserve(1, w, 600).unwrap();
    // 100 of the sibling's 300 are unused credit.
    l.reserve(1, sibling, 300).unwrap();
    assert!(matches!(
        l.reserve_credit(1, w, 120, 32).unwrap(),
        Credit::Denied { in_use: 900, .. }
    ));
    l.begin_wait(1, w, 120).unwrap();
    assert!(l.others_waiting(1, sibling) && !l.others_waiting(1, w));
    // Pressed: the sibling (the only one holding bytes) gives its credit back.
    assert_eq!(l.others_holding(1, w), vec![sibling]);
    l.release(1, sibling, 100).unwrap();
    // The new process asks for its context with a granule of credit on top: it gets the
    // context only (before: 60 and half the 140 left, 130, and the waiter 20 short).
    assert_eq!(
        l.reserve_credit(1, new, 60, 128).unwrap(),
        Credit::Granted {
            bytes: 60,
            in_use: 860
        }
    );
    assert!(matches!(
        l.reserve_credit(1, w, 120, 32).unwrap(),
        Credit::Granted { bytes: 120, .. }
    ));
    l.end_wait(1, w);
    assert!(!l.others_waiting(1, sibling));
    // Nobody waits: credit again, from half the room left (10 of 20).
    assert_eq!(
        l.reserve_credit(1, new, 0, 128).unwrap(),
        Credit::Granted {
            bytes: 10,
            in_use: 990
        }
    );
    // A connection that goes ends its wait; ending one twice, or of a gone account, is
    // harmless; a stranger cannot wait.
    l.begin_wait(1, sibling, 50).unwrap();
    l.detach(1, sibling).unwrap();
    assert!(!l.others_waiting(1, w));
    l.end_wait(1, sibling);
    l.end_wait(9, w);
    assert!(matches!(
        l.begin_wait(1, 42, 1),
        Err(LedgerError::UnknownConnection { .. })
    ));
}

/// A process that is not waiting gets no room a waiting sibling could take now: the process
/// that just gave its chunk back (a sibling waited) does not take it back with its next
/// reservation ahead of the waiter. Room a waiter cannot use, or room enough for both, is
/// given as before; and waiters among themselves take what fits.
#[test]
fn a_newcomer_leaves_a_waiter_the_room_it_fits_in() {
    let (a, b, w, small) = (1, 2, 3, 4);
    let mut l = Ledger::new();
    l.open(1, 1000);
    for c in [a, b, w, small] {
        l.attach(1, c).unwrap();
    }
    l.reserve(1, a, 400).unwrap();
    l.reserve(1, b, 400).unwrap();
    // w wants 400: 200 free, so it waits.
    assert!(matches!(
        l.reserve(1, w, 400).unwrap(),
        Reservation::Denied { .. }
    ));
    l.begin_wait(1, w, 400).unwrap();
    // Its need does not fit the room: it blocks nobody (a small allocation still goes in).
    assert!(matches!(
        l.reserve_credit(1, small, 10, 0).unwrap(),
        Credit::Granted { bytes: 10, .. }
    ));
    l.release(1, small, 10).unwrap();
    // a frees its 400 (given back because w waited) and asks again at once: refused, the
    // room is w's now; w then gets it.
    l.release(1, a, 400).unwrap();
    assert!(matches!(
        l.reserve_credit(1, a, 400, 0).unwrap(),
        Credit::Denied { in_use: 400, .. }
    ));
    assert!(matches!(
        l.reserve(1, a, 400).unwrap(),
        Reservation::Denied { in_use: 400, .. }
    ));
    // Room for both the waiter and the newcomer: no yielding.
    assert!(matches!(
        l.reserve(1, small, 100).unwrap(),
        Reservation::Granted { in_use: 500 }
    ));
    l.release(1, small, 100).unwrap();
    // a waits too now; among waiters, whoever comes first takes what fits.
    l.begin_wait(1, a, 400).unwrap();
    assert!(matches!(
        l.reserve_credit(1, a, 400, 0).unwrap(),
        Credit::Granted { bytes: 400, .. }
    ));
    l.end_wait(1, a);
    assert!(matches!(
        l.reserve_credit(1, w, 400, 0).unwrap(),
        Credit::Denied { .. }
    ));
    l.release(1, b, 400).unwrap();
    assert!(matches!(
        l.reserve_credit(1, w, 400, 0).unwrap(),
        Credit::Granted { bytes: 400, .. }
    ));
    l.end_wait(1, w);
    // Nobody waits: a newcomer gets room again.
    assert!(matches!(
        l.reserve(1, small, 200).unwrap(),
        Reservation::Granted { in_use: 1000 }
    ));
}

/// A waiter is its own allocation's business: a process of another allocation on the same
/// GPU is never made to leave it room (a tenant cannot get a neighbour refused by waiting).
#[test]
fn a_waiter_never_holds_back_another_allocation() {
    let (w, holder, neighbour) = (1, 2, 3);
    let mut l = Ledger::new();
    l.open(1, 1000);
    l.open(2, 1000);
    l.attach(1, w).unwrap();
    l.attach(1, holder).unwrap();
    l.attach(2, neighbour).unwrap();
    l.reserve(1, holder, 800).unwrap();
    l.begin_wait(1, w, 100).unwrap();
    // Allocation 1 has 200 free and a waiter that fits in it; allocation 2 is untouched.
    assert_eq!(
        l.reserve(2, neighbour, 950).unwrap(),
        Reservation::Granted { in_use: 950 }
    );
    assert!(matches!(
        l.reserve_credit(2, neighbour, 50, 0).unwrap(),
        Credit::Granted { bytes: 50, .. }
    ));
    // While inside allocation 1 a newcomer does leave the waiter its room.
    assert!(matches!(
        l.reserve(1, holder, 150).unwrap(),
        Reservation::Denied { in_use: 800, .. }
    ));
}

#[test]
fn release_of_more_than_held_is_refused_and_changes_nothing() {
    let mut l = Ledger::new();
    l.open(1, 100);
    l.attach(1, 1).unwrap();
    l.attach(1, 2).unwrap();
    l.reserve(1, 1, 30).unwrap();
    l.reserve(1, 2, 50).unwrap();
    assert_eq!(
        l.release(1, 1, 10).unwrap(),
        Released {
            freed: 10,
            in_use: 70,
        }
    );
    // Connection 1 holds 20: releasing 45 is a lie, refused whole.
    assert_eq!(
        l.release(1, 1, 45).unwrap_err(),
        LedgerError::OverRelease {
            held: 20,
            asked: 45
        }
    );
    assert_eq!(
        l.release(1, 1, u64::MAX).unwrap_err(),
        LedgerError::OverRelease {
            held: 20,
            asked: u64::MAX
        }
    );
    assert_eq!(l.held(1, 1), Some(20));
    assert_eq!(l.held(1, 2), Some(50));
    assert_eq!(l.usage(1).unwrap().in_use, 70);
}

#[test]
fn redeclare_may_pass_the_limit_and_blocks_reserves_until_below() {
    let mut l = Ledger::new();
    l.open(1, 100);
    l.attach(1, 1).unwrap();
    l.attach(1, 2).unwrap();
    assert_eq!(l.redeclare(1, 1, 80).unwrap(), 80);
    assert_eq!(l.redeclare(1, 2, 40).unwrap(), 120);
    // Idempotent: declaring again sets, never adds.
    assert_eq!(l.redeclare(1, 2, 40).unwrap(), 120);
    assert_eq!(
        l.reserve(1, 1, 1).unwrap(),
        Reservation::Denied {
            limit: 100,
            in_use: 120
        }
    );
    l.release(1, 2, 30).unwrap();
    assert_eq!(l.usage(1).unwrap().in_use, 90);
    assert!(matches!(
        l.reserve(1, 1, 10).unwrap(),
        Reservation::Granted { in_use: 100 }
    ));
}

#[test]
fn redeclare_never_lowers_a_holding_passes_the_limit_alone_or_wraps() {
    let mut l = Ledger::new();
    l.open(1, 100);
    l.attach(1, 1).unwrap();
    l.attach(1, 2).unwrap();
    l.reserve(1, 1, 60).unwrap();
    assert_eq!(
        l.redeclare(1, 1, 0).unwrap_err(),
        LedgerError::RedeclareBelow { held: 60, asked: 0 }
    );
    assert_eq!(
        l.redeclare(1, 2, 101).unwrap_err(),
        LedgerError::RedeclareAboveLimit {
            limit: 100,
            asked: 101
        }
    );
    assert!(l.redeclare(1, 2, u64::MAX).is_err());
    assert_eq!(l.usage(1).unwrap().in_use, 60);
    assert_eq!(l.held(1, 2), Some(0));
    // At the edge of u64: a total that would wrap is refused, nothing changes.
    l.open(2, u64::MAX);
    l.attach(2, 3).unwrap();
    l.attach(2, 4).unwrap();
    l.redeclare(2, 3, u64::MAX - 5).unwrap();
    assert_eq!(l.redeclare(2, 4, 10).unwrap_err(), LedgerError::Overflow(2));
    assert_eq!(l.usage(2).unwrap().in_use, u64::MAX - 5);
    assert_eq!(l.held(2, 4), Some(0));
}

#[test]
fn the_peak_is_the_most_held_since_it_was_last_taken() {
    let mut l = Ledger::new();
    l.open(1, 1024 * MIB);
    l.attach(1, 10).unwrap();
    assert_eq!(l.take_peak(1, 10), Some(0));
    l.reserve(1, 10, 300 * MIB).unwrap();
    // 600 MiB held and given back between two looks: the card may have shown it.
    l.reserve(1, 10, 600 * MIB).unwrap();
    l.release(1, 10, 600 * MIB).unwrap();
    assert_eq!(l.held(1, 10), Some(300 * MIB));
    assert_eq!(l.take_peak(1, 10), Some(900 * MIB));
    // Taken: the next look starts from what is held now.
    assert_eq!(l.take_peak(1, 10), Some(300 * MIB));
    l.release(1, 10, 100 * MIB).unwrap();
    assert_eq!(l.take_peak(1, 10), Some(300 * MIB));
    assert_eq!(l.take_peak(1, 10), Some(200 * MIB));
    // A redeclaration is held memory like any other; a detached connection has no peak.
    l.redeclare(1, 10, 500 * MIB).unwrap();
    assert_eq!(l.take_peak(1, 10), Some(500 * MIB));
    l.detach(1, 10).unwrap();
    assert_eq!(l.take_peak(1, 10), None);
    assert_eq!(l.take_peak(2, 10), None);
}

#[test]
fn detach_frees_everything_the_connection_held() {
    let mut l = Ledger::new();
    l.open(1, 100);
    l.attach(1, 1).unwrap();
    l.attach(1, 2).unwrap();
    l.reserve(1, 1, 30).unwrap();
    l.reserve(1, 2, 50).unwrap();
    assert_eq!(l.detach(1, 2).unwrap(), 50);
    let u = l.usage(1).unwrap();
    assert_eq!((u.in_use, u.connections), (30, 1));
    assert_eq!(
        l.reserve(1, 2, 1).unwrap_err(),
        LedgerError::UnknownConnection { key: 1, conn: 2 }
    );
    assert!(matches!(
        l.reserve(1, 1, 70).unwrap(),
        Reservation::Granted { in_use: 100 }
    ));
}

#[test]
fn closed_account_denies_reserves_serves_releases_and_drains() {
    let mut l = Ledger::new();
    l.open(1, 100);
    l.attach(1, 1).unwrap();
    l.reserve(1, 1, 40).unwrap();
    assert!(!l.close(1).unwrap(), "a connection is still attached");
    assert_eq!(
        l.reserve(1, 1, 1).unwrap(),
        Reservation::Denied {
            limit: 100,
            in_use: 40
        }
    );
    assert_eq!(l.attach(1, 2).unwrap_err(), LedgerError::Closed(1));
    assert_eq!(l.release(1, 1, 40).unwrap().in_use, 0);
    assert!(l.usage(1).unwrap().closed);
    l.detach(1, 1).unwrap();
    assert!(l.usage(1).is_none(), "drained account is gone");
    // Closing an idle account removes it at once.
    l.open(2, 5);
    assert!(l.close(2).unwrap());
    assert_eq!(l.close(2).unwrap_err(), LedgerError::UnknownAccount(2));
}
