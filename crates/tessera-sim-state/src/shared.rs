//! Shareable VMM memory: one physical allocation that several processes may hold.
//!
//! The CUDA driver frees a `cuMemCreate` allocation only once every handle to it (in any
//! process, imports included) has been released and every mapping of it unmapped, whoever
//! created it (the `cuMemRelease` reference says so). So such memory cannot live in one
//! process's record: it would leave the card when its creator lets go while an importer still
//! maps it. Each one is a file `vmm/<key>` instead (device and size), and every process that
//! holds a handle or a mapping of it keeps an open-file-description read lock on that file. The
//! card counts the allocation once while any lock is held; the kernel drops a dead process's
//! lock, so memory held only by a killed process goes back to the card like its record does.
//!
//! The key is the inode of the memory's memfd (unique while the memory exists, and the same in
//! every process however the descriptor travelled: `SCM_RIGHTS`, fork, `/proc/<pid>/fd`).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::MAX_GPUS;

const MAGIC: u64 = 0x5445_5353_564d_4d31; // "TESSVMM1"
const BYTES: usize = 24;

/// A live hold of one shared allocation by this process: its read lock lives as long as this
/// (closing the descriptor drops the lock).
#[derive(Debug)]
pub struct SharedHold {
    /// Never read: owning the descriptor is what keeps the lock.
    _file: File,
}

/// The folder of shared allocation files.
fn folder(dir: &Path) -> std::path::PathBuf {
    dir.join("vmm")
}

fn lock(kind: i16) -> libc::flock {
    // SAFETY: flock is a plain C struct; all-zero is valid (whole file, pid 0 as OFD requires).
    let mut lk: libc::flock = unsafe { std::mem::zeroed() };
    lk.l_type = kind;
    lk.l_whence = libc::SEEK_SET as i16;
    lk
}

/// Whether some process holds `file`'s allocation (a read lock on another description).
fn held(file: &File) -> bool {
    let mut lk = lock(libc::F_WRLCK as i16);
    // SAFETY: F_OFD_GETLK with a valid, zero-pid flock struct on an open descriptor.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut lk) };
    rc == 0 && lk.l_type != libc::F_UNLCK as i16
}

fn open(path: &Path, create: bool) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
}

/// (device, bytes) of a shared allocation file, if well formed.
fn header(file: &File) -> Option<(u32, u64)> {
    let mut buf = [0u8; BYTES];
    file.read_exact_at(&mut buf, 0).ok()?;
    let word = |i: usize| u64::from_ne_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap());
    let gpu = u32::try_from(word(1))
        .ok()
        .filter(|g| (*g as usize) < MAX_GPUS)?;
    (word(0) == MAGIC).then_some((gpu, word(2)))
}

/// Whether shared allocation `key` is held by any live process (caller holds the mem.lock
/// flock, so no hold appears or goes through [`hold`] meanwhile).
pub(crate) fn is_held(dir: &Path, key: u64) -> bool {
    open(&folder(dir).join(key.to_string()), false).is_ok_and(|f| held(&f))
}

/// Takes a hold of shared allocation `key` (`gpu`, `bytes`): joins the existing file if some
/// process holds it, else writes a fresh one (the caller holds the mem.lock flock and has
/// checked the card has room for a new one).
pub(crate) fn hold(dir: &Path, key: u64, gpu: u32, bytes: u64) -> std::io::Result<SharedHold> {
    let folder = folder(dir);
    std::fs::create_dir_all(&folder)?;
    let path = folder.join(key.to_string());
    let file = open(&path, true)?;
    if !held(&file) {
        let mut buf = [0u8; BYTES];
        buf[..8].copy_from_slice(&MAGIC.to_ne_bytes());
        buf[8..16].copy_from_slice(&u64::from(gpu).to_ne_bytes());
        buf[16..].copy_from_slice(&bytes.to_ne_bytes());
        file.set_len(0)?;
        file.write_all_at(&buf, 0)?;
    }
    let mut lk = lock(libc::F_RDLCK as i16);
    // SAFETY: F_OFD_SETLK with a valid, zero-pid flock struct on our own descriptor.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut lk) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(SharedHold { _file: file })
}

/// Bytes of shared allocations held on each device, each counted once; with `delete_dead`,
/// removes files nobody holds (only under the mem.lock flock, so a new hold is never lost).
pub(crate) fn held_bytes(dir: &Path, delete_dead: bool) -> [u64; MAX_GPUS] {
    let mut out = [0u64; MAX_GPUS];
    let Ok(entries) = std::fs::read_dir(folder(dir)) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(file) = open(&path, false) else {
            continue;
        };
        if !held(&file) {
            if delete_dead {
                let _ = std::fs::remove_file(&path);
            }
            continue;
        }
        if let Some((gpu, bytes)) = header(&file) {
            out[gpu as usize] += bytes;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_once_while_any_hold_lives() {
        let dir = tempfile::tempdir().unwrap();
        let a = hold(dir.path(), 7, 1, 100).unwrap();
        let b = hold(dir.path(), 7, 1, 100).unwrap();
        assert_eq!(
            held_bytes(dir.path(), false)[1],
            100,
            "two holds, one allocation"
        );
        drop(a);
        assert!(is_held(dir.path(), 7));
        assert_eq!(
            held_bytes(dir.path(), false)[1],
            100,
            "the second hold keeps it"
        );
        drop(b);
        assert!(!is_held(dir.path(), 7));
        assert_eq!(held_bytes(dir.path(), true)[1], 0);
        assert!(!dir.path().join("vmm/7").exists(), "dead file removed");
    }
}
