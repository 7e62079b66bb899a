//! The execution engine of each simulated device, shared by every process.
//!
//! `engine<N>` in the state folder is both the lock and the counters: a kernel runs while its
//! stream worker holds `flock(LOCK_EX)` on its own descriptor of the file (so kernels of any two
//! processes, or two streams of one process, never overlap), and the holder records the busy time
//! in the file's words before unlocking. Layout (u64 words, native endian):
//! `[0]` cumulative busy ns, `[1]` start of the running kernel (monotonic ns, 0 when idle),
//! `[2]` pid running it, `[3]` reserved, then [`BUCKETS`] pairs `(bucket index, busy ns)` of
//! [`BUCKET_NS`]-wide time buckets, a ring used for utilization over the last second.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::monotonic_ns;

/// Width of one utilization bucket.
pub const BUCKET_NS: u64 = 10_000_000;
/// Buckets in the ring (1.28 s of history).
pub const BUCKETS: usize = 128;
const HEADER_WORDS: usize = 4;
const FILE_WORDS: usize = HEADER_WORDS + 2 * BUCKETS;
const FILE_BYTES: usize = FILE_WORDS * 8;
/// Longest time one kernel may hold the engine: a first parameter that is really a pointer
/// must not wedge the device for hours.
pub const MAX_KERNEL_NS: u64 = 10_000_000_000;

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("engine file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn engine_path(dir: &Path, gpu: u32) -> PathBuf {
    dir.join(format!("engine{gpu}"))
}

/// One holder's handle on a device engine (each stream worker opens its own).
pub struct Engine {
    file: File,
    words: *const AtomicU64,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

// SAFETY: `words` points into a MAP_SHARED mapping owned by this value, accessed via atomics.
unsafe impl Send for Engine {}

impl Engine {
    /// Opens (creating if needed) the engine of `gpu` in state folder `dir`.
    pub fn open(dir: &Path, gpu: u32) -> Result<Engine, EngineError> {
        let path = engine_path(dir, gpu);
        let err = |source| EngineError::Io {
            path: path.clone(),
            source,
        };
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(err)?;
        if file.metadata().map_err(err)?.len() < FILE_BYTES as u64 {
            file.set_len(FILE_BYTES as u64).map_err(err)?;
        }
        // SAFETY: mapping FILE_BYTES of a file at least that long, shared.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(err(std::io::Error::last_os_error()));
        }
        Ok(Engine {
            file,
            words: map as *const AtomicU64,
        })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < FILE_WORDS);
        // SAFETY: i < FILE_WORDS; the mapping is FILE_BYTES long and lives as long as self.
        unsafe { &*self.words.add(i) }
    }

    /// Occupies the engine for `ns` nanoseconds (at most [`MAX_KERNEL_NS`]), waiting first for
    /// any kernel of any process to finish. Returns the (start, end) monotonic ns of the time
    /// the engine was actually held.
    pub fn run(&self, ns: u64) -> (u64, u64) {
        let ns = ns.min(MAX_KERNEL_NS);
        let fd = self.file.as_raw_fd();
        loop {
            // SAFETY: flock on our own descriptor.
            let rc = unsafe { libc::flock(fd, libc::LOCK_EX) };
            if rc == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                break;
            }
        }
        let start = monotonic_ns();
        self.word(2).store(u64::from(std::process::id()), Ordering::Relaxed);
        self.word(1).store(start, Ordering::SeqCst);
        let deadline = start + ns;
        loop {
            let now = monotonic_ns();
            if now >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_nanos(deadline - now));
        }
        let end = monotonic_ns();
        self.account(start, end);
        self.word(1).store(0, Ordering::SeqCst);
        // SAFETY: unlocking our own descriptor.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
        (start, end)
    }

    /// Adds [start, end) to the cumulative counter and the bucket ring (caller holds the lock).
    fn account(&self, start: u64, end: u64) {
        self.word(0).fetch_add(end - start, Ordering::SeqCst);
        let horizon = end.saturating_sub(BUCKET_NS * BUCKETS as u64);
        let mut t = start.max(horizon);
        while t < end {
            let idx = t / BUCKET_NS;
            let bucket_end = ((idx + 1) * BUCKET_NS).min(end);
            let slot = HEADER_WORDS + 2 * (idx as usize % BUCKETS);
            if self.word(slot).load(Ordering::Relaxed) != idx {
                self.word(slot + 1).store(0, Ordering::Relaxed);
                self.word(slot).store(idx, Ordering::Relaxed);
            }
            self.word(slot + 1).fetch_add(bucket_end - t, Ordering::Relaxed);
            t = bucket_end;
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `open`, no references outlive self.
        unsafe { libc::munmap(self.words as *mut libc::c_void, FILE_BYTES) };
    }
}

fn read_words(dir: &Path, gpu: u32) -> Option<Vec<u64>> {
    let file = File::open(engine_path(dir, gpu)).ok()?;
    let mut buf = vec![0u8; FILE_BYTES];
    file.read_exact_at(&mut buf, 0).ok()?;
    Some(
        buf.chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .collect(),
    )
}

/// Cumulative engine busy time of `gpu`, ns, all processes, including the running kernel.
pub fn device_busy_ns(dir: &Path, gpu: u32) -> u64 {
    let Some(w) = read_words(dir, gpu) else {
        return 0;
    };
    let running = if w[1] != 0 {
        monotonic_ns().saturating_sub(w[1])
    } else {
        0
    };
    w[0] + running
}

/// Fraction (0..=1) of the last `window` (at most 1.28 s) during which `gpu` ran a kernel.
pub fn device_utilization(dir: &Path, gpu: u32, window: Duration) -> f64 {
    let Some(w) = read_words(dir, gpu) else {
        return 0.0;
    };
    let window_ns = (window.as_nanos() as u64).clamp(BUCKET_NS, BUCKET_NS * (BUCKETS as u64 - 1));
    let now = monotonic_ns();
    let from = now.saturating_sub(window_ns);
    let (first, last) = (from / BUCKET_NS, now / BUCKET_NS);
    let mut busy = 0u64;
    for b in 0..BUCKETS {
        let (idx, ns) = (w[HEADER_WORDS + 2 * b], w[HEADER_WORDS + 2 * b + 1]);
        if idx >= first && idx <= last {
            busy += ns;
        }
    }
    if w[1] != 0 {
        busy += now.saturating_sub(w[1].max(from));
    }
    (busy as f64 / window_ns as f64).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_serialises_and_accounts() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let t0 = std::time::Instant::now();
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let d = d.clone();
                std::thread::spawn(move || Engine::open(&d, 0).unwrap().run(100_000_000))
            })
            .collect();
        let spans: Vec<(u64, u64)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(t0.elapsed() >= Duration::from_millis(195), "kernels overlapped");
        assert!(spans[0].1 <= spans[1].0 || spans[1].1 <= spans[0].0);
        let busy = device_busy_ns(&d, 0);
        assert!((200_000_000..300_000_000).contains(&busy), "busy {busy}");
        let u = device_utilization(&d, 0, Duration::from_secs(1));
        assert!(u > 0.15 && u <= 1.0, "utilization {u}");
        assert_eq!(device_busy_ns(&d, 1), 0);
    }
}
