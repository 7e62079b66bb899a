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
pub(crate) const TRIES: usize = 4;

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
