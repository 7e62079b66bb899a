//! The card's allocation generation: what makes a reading of the card one number, as a real
//! card's is.
//!
//! Readers (NVML's used memory and process list) sum the per-process records one by one. Frees
//! lower a record without any lock; allocations raise one under the `mem.lock` flock after
//! checking the card. A reader could then read process A's record before A frees, and process
//! B's after B allocated what A's free made room for: a sum the card never held (the hand-off
//! test saw 6 GiB on a card whose processes never held more than 3 GiB at once).
//!
//! So every allocation, under the flock and *before* it raises its record, adds one to a
//! generation word kept in the first 8 bytes of `mem.lock`. A reader reads the generation,
//! scans, and reads it again: equal, no record was raised during the scan, and since frees only
//! lower records, the sum is at most what the card held when the scan began. Not equal, it
//! scans again; a card so busy that a few scans in a row are spoilt is read under the flock
//! (shared), which holds allocations off for one scan.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Size of the generation word at the start of `mem.lock`.
const WORD: u64 = 8;

/// Optimistic scans a reader makes before it takes the flock.
const TRIES: usize = 4;

/// The generation word, mapped by a process that allocates.
pub(crate) struct Generation {
    word: *const AtomicU64,
}

// SAFETY: `word` points into a MAP_SHARED mapping of `mem.lock` that is never unmapped, and it
// is only accessed through atomics.
unsafe impl Send for Generation {}
// SAFETY: as above: shared access goes through the atomic only.
unsafe impl Sync for Generation {}

impl Generation {
    /// Maps the generation word of `lock` (the opened `mem.lock`), growing the file to hold it.
    pub(crate) fn map(lock: &File) -> std::io::Result<Generation> {
        // Never shrinks it (two processes opening at once both see 0 and both grow it to 8,
        // which leaves the content alone).
        if lock.metadata()?.len() < WORD {
            lock.set_len(WORD)?;
        }
        // SAFETY: mapping WORD bytes of a file at least WORD long, shared, read-write.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                WORD as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                lock.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Generation {
            word: map as *const AtomicU64,
        })
    }

    /// An allocation is about to raise a record (caller holds the mem.lock flock).
    pub(crate) fn bump(&self) {
        // SAFETY: the mapping is WORD bytes, 8-aligned (page start) and never unmapped.
        unsafe { &*self.word }.fetch_add(1, Ordering::SeqCst);
    }
}

/// The generation as a reader sees it (0 when no process allocated yet: no file, or too short).
fn read(lock: Option<&File>) -> u64 {
    let mut buf = [0u8; WORD as usize];
    match lock.map(|f| f.read_at(&mut buf, 0)) {
        Some(Ok(n)) if n == buf.len() => u64::from_ne_bytes(buf),
        _ => 0,
    }
}

/// Runs `scan` of the records of `dir` so that what it sums is what the card held at one
/// instant or less (see the module notes).
pub(crate) fn consistent<T, E>(dir: &Path, mut scan: impl FnMut() -> Result<T, E>) -> Result<T, E> {
    let lock = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(dir.join("mem.lock"))
        .ok();
    for _ in 0..TRIES {
        let before = read(lock.as_ref());
        let got = scan()?;
        if read(lock.as_ref()) == before {
            return Ok(got);
        }
    }
    let Some(lock) = lock else {
        // No lock file now, yet its generation moved: the folder was removed meanwhile.
        return scan();
    };
    loop {
        // SAFETY: flock on a descriptor we own.
        let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_SH) };
        if rc == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break;
        }
    }
    let got = scan();
    // SAFETY: unlocking a descriptor we own (closing it would too; said for clarity).
    unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_UN) };
    got
}

#[cfg(test)]
mod tests {
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
        let got = super::consistent(dir.path(), || {
            scans += 1;
            if scans <= super::TRIES {
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
        assert_eq!(got, Ok(super::TRIES + 1));
    }
}
