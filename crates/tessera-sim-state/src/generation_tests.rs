//! Tests of a reading of the card being one instant's ([`crate::generation`]) through the
//! ledger's readers: apart from both, so neither imports the other for its tests.

use std::cell::Cell;
use std::rc::Rc;

use crate::ledger::{Ledger, device_memory_used, read_processes, tests_after_record};

const GIB: u64 = 1 << 30;

/// Process A holds 3 GiB, frees them, and B allocates 3 GiB, between the moment a reader read
/// A's record and the moment it reads B's (what a preempted reader on a loaded host sees):
/// the reading must not sum A's old bytes and B's new ones.
fn hand_off_inside_a_reading(read: impl Fn(&std::path::Path) -> u64) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    // Two copies of the ledger in one process keep two records (`<pid>` and `<pid>.1`),
    // as two processes do.
    let one = Rc::new(Ledger::open(dir.path(), vec![80 * GIB]).unwrap());
    let two = Rc::new(Ledger::open(dir.path(), vec![80 * GIB]).unwrap());
    one.try_alloc(0, 1).unwrap();
    two.try_alloc(0, 1).unwrap();
    one.free(0, 1);
    two.free(0, 1);
    // The reader meets the records in directory order: the first one it meets holds.
    let me = std::process::id().to_string();
    let first = std::fs::read_dir(dir.path().join("procs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .find(|n| !n.starts_with('.'))
        .unwrap();
    let (a, b) = if first == me { (one, two) } else { (two, one) };
    a.try_alloc(0, 3 * GIB).unwrap();
    let handed = Rc::new(Cell::new(false));
    let hook = {
        let (a, b, handed, first) = (Rc::clone(&a), Rc::clone(&b), Rc::clone(&handed), first);
        move |name: &str| {
            if name == first && !handed.replace(true) {
                a.free(0, 3 * GIB);
                b.try_alloc(0, 3 * GIB).unwrap();
            }
        }
    };
    let got = tests_after_record(hook, || read(dir.path()));
    assert!(handed.get(), "the reader never met the first record");
    got
}

#[test]
fn the_cards_used_memory_never_sums_one_records_old_bytes_and_anothers_new_ones() {
    let used = hand_off_inside_a_reading(|d| device_memory_used(d, 0).unwrap());
    assert_eq!(used, 3 * GIB, "the card held 3 GiB at every instant");
}

#[test]
fn the_process_list_never_sums_one_records_old_bytes_and_anothers_new_ones() {
    let listed = hand_off_inside_a_reading(|d| {
        read_processes(d)
            .unwrap()
            .iter()
            .map(|p| p.mem_bytes[0])
            .sum()
    });
    assert_eq!(listed, 3 * GIB, "the processes held 3 GiB at every instant");
}

#[test]
fn a_card_too_busy_for_clean_readings_is_read_under_the_flock() {
    let dir = tempfile::tempdir().unwrap();
    let l = Ledger::open(dir.path(), vec![GIB]).unwrap();
    let mut scans = 0;
    let got = crate::generation::consistent(dir.path(), || {
        scans += 1;
        if scans <= crate::generation::TRIES {
            // Every optimistic reading is spoilt by an allocation.
            l.try_alloc(0, 1).unwrap();
        } else {
            // Under the (shared) flock now: an allocation elsewhere would wait for it.
            let f = std::fs::File::open(dir.path().join("mem.lock")).unwrap();
            // SAFETY: a non-blocking exclusive flock try on a descriptor we own.
            let rc = unsafe {
                libc::flock(
                    std::os::fd::AsRawFd::as_raw_fd(&f),
                    libc::LOCK_EX | libc::LOCK_NB,
                )
            };
            assert_eq!(rc, -1, "the last reading holds the flock");
        }
        Ok::<_, ()>(scans)
    });
    assert_eq!(got, Ok(crate::generation::TRIES + 1));
}
