//! Per-process records and global memory accounting.
//!
//! Each process using the simulated GPUs owns `procs/<pid>`: a fixed array of u64 words (memory
//! in use, engine busy ns, context count, context memory and shown shared VMM memory per device), mapped shared so updates are plain
//! atomic adds. The owner holds an open-file-description (OFD) write lock on it for its whole
//! life; the kernel drops it when the process dies (SIGKILL included), so a reader that finds the
//! lock free knows the record is dead. OFD locks (unlike classic `fcntl` locks) are not released
//! when another descriptor of the same file is closed, so any reader, in any library of the same
//! process, may open the file. A fork child closes its inherited descriptor (see `atfork_child`)
//! so a parent's death stays visible, and makes its own record on first use.
//!
//! A record is named by its process's pid on the host ([`crate::driver::host_pid`]), which is
//! what NVML reports, also for a process in a container (whose own `getpid()` may be 1).
//!
//! A process with a second copy of the library (`dlmopen(LM_ID_NEWLM, ..)`), which has a ledger
//! of its own, gets a second record `procs/<pid>.<n>`; readers sum a pid's records, as NVML
//! reports all of a process's memory whichever copy of the driver took it.
//!
//! Allocation check-and-add runs under `flock(mem.lock)` plus an in-process mutex, so the card is
//! never overcommitted; a holder killed inside loses the flock with its life, so no deadlock.
//!
//! Context memory: a real context costs device memory that NVML counts but no allocation
//! returned. A process's first context on a device charges [`Ledger::with_context_memory`] bytes
//! and every further one [`Ledger::with_further_context_memory`] (each checked against the card
//! like an allocation): a process with `n` contexts on a device holds `first + (n - 1) *
//! further` for them. Each closing returns its part; a dead process's charge goes with its
//! record, like the rest of its memory.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::MAX_GPUS;
use crate::generation::Generation;
use crate::shared::SharedHold;

const MAGIC: u64 = 0x5445_5353_5245_4331; // "TESSREC1"
const HEADER_WORDS: usize = 2;
const GPU_WORDS: usize = 6;
const RECORD_WORDS: usize = HEADER_WORDS + MAX_GPUS * GPU_WORDS;
const RECORD_BYTES: usize = RECORD_WORDS * 8;
const W_MEM: usize = 0;
const W_BUSY: usize = 1;
const W_CTX: usize = 2;
const W_CTX_MEM: usize = 3;
/// Shared VMM memory NVML shows for this process (see [`crate::shared`]); the card counts each
/// shared allocation once, from its file, not from these words.
const W_SHARED: usize = 4;
/// The MIG device this process's memory on the GPU is in ([`crate::mig::tag`]; 0: the whole
/// GPU): a CUDA process sees at most one MIG device of a GPU, so one word says which.
const W_MIG: usize = 5;

/// Errors of the ledger.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("out of memory on GPU {gpu}: requested {requested} bytes, {free} free")]
    OutOfMemory { gpu: u32, requested: u64, free: u64 },
    #[error("GPU {0} does not exist")]
    NoSuchGpu(u32),
    #[error("state folder I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LedgerError + '_ {
    move |source| LedgerError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What one live process holds, as read from its record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUsage {
    pub pid: u32,
    /// Device memory in use, bytes, per device ordinal: allocations plus context memory, as
    /// NVML counts it.
    pub mem_bytes: [u64; MAX_GPUS],
    /// The part of `mem_bytes` its contexts cost, per device ordinal.
    pub context_bytes: [u64; MAX_GPUS],
    /// The part of `mem_bytes` that is shared VMM memory (created and still held, or imported
    /// and mapped): the card counts such an allocation once however many processes show it.
    pub shared_bytes: [u64; MAX_GPUS],
    /// Cumulative engine busy time of this process's kernels, ns, per device ordinal.
    pub busy_ns: [u64; MAX_GPUS],
    /// Number of contexts this process holds per device.
    pub contexts: [u64; MAX_GPUS],
    /// The MIG device it runs on per GPU ([`crate::mig::tag`]; 0: the whole GPU).
    pub mig_tag: [u64; MAX_GPUS],
}

impl ProcessUsage {
    /// Whether this process uses device `gpu` at all (memory or a context).
    pub fn uses(&self, gpu: u32) -> bool {
        let g = gpu as usize;
        g < MAX_GPUS && (self.mem_bytes[g] > 0 || self.contexts[g] > 0)
    }
}

/// Descriptors of live records, closed in fork children (lock-free: runs in `atfork`).
static RECORD_FDS: [AtomicI32; 8] = [const { AtomicI32::new(-1) }; 8];

extern "C" fn atfork_child() {
    for slot in &RECORD_FDS {
        let fd = slot.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: fd was a record descriptor this process owned; after fork the child closes
            // its copy so the parent's OFD lock dies with the parent.
            unsafe { libc::close(fd) };
        }
    }
}

fn register_atfork() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registering a plain extern "C" handler with no captured state.
        unsafe { libc::pthread_atfork(None, None, Some(atfork_child)) };
    });
}

struct Mine {
    pid: u32,
    /// The record's file name: the pid, or `<pid>.<n>` for a second copy in the same process.
    name: String,
    fd: RawFd,
    words: *const AtomicU64,
}

// SAFETY: `words` points into a MAP_SHARED mapping that lives as long as the process (never
// unmapped), and is only accessed through atomics.
unsafe impl Send for Mine {}

impl Mine {
    fn word(&self, idx: usize) -> &AtomicU64 {
        debug_assert!(idx < RECORD_WORDS);
        // SAFETY: idx < RECORD_WORDS and the mapping is RECORD_BYTES long and never unmapped.
        unsafe { &*self.words.add(idx) }
    }
}

/// This process's view of the shared memory ledger of one state folder.
pub struct Ledger {
    dir: PathBuf,
    totals: Vec<u64>,
    /// Per GPU, the MIG device this process runs on ([`Ledger::with_mig`]): (tag, bytes of
    /// its GPU instance); memory there is checked against the instance, not the card.
    mig: [(u64, u64); MAX_GPUS],
    context_bytes: u64,
    further_context_bytes: u64,
    mine: Mutex<Option<Mine>>,
    mem_lock: File,
    /// Bumped by every allocation before it raises a record, so readers sum the card at one
    /// instant (see [`crate::generation`]).
    generation: Generation,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("dir", &self.dir).finish()
    }
}

struct FlockGuard<'a>(&'a File);

impl<'a> FlockGuard<'a> {
    fn lock(f: &'a File) -> FlockGuard<'a> {
        loop {
            // SAFETY: flock on a descriptor we own.
            let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                break;
            }
        }
        FlockGuard(f)
    }
}

impl Drop for FlockGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: unlocking a descriptor we own.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Ledger {
    /// Opens the ledger of `dir` for devices of the given sizes (bytes, by ordinal). Creates the
    /// folder; the process record itself is made on first use.
    pub fn open(dir: &Path, totals: Vec<u64>) -> Result<Ledger, LedgerError> {
        crate::dirs::ensure_state_dir(dir).map_err(|e| LedgerError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let lock_path = dir.join("mem.lock");
        let mem_lock = OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        let generation = Generation::map(&mem_lock).map_err(io(&lock_path))?;
        register_atfork();
        // Learn this process's pid now (at cuInit), not first under the mem.lock flock: in a
        // container that may take a question to the machine's driver socket.
        crate::driver::identity(dir);
        Ok(Ledger {
            dir: dir.to_path_buf(),
            totals,
            mig: [(0, 0); MAX_GPUS],
            context_bytes: 0,
            further_context_bytes: 0,
            mine: Mutex::new(None),
            mem_lock,
            generation,
        })
    }

    /// Sets the device memory a process's first context on a device costs (0, the default,
    /// charges nothing).
    pub fn with_context_memory(mut self, bytes: u64) -> Ledger {
        self.context_bytes = bytes;
        self
    }

    /// Sets the device memory each further context of a process on the same device costs (0,
    /// the default, charges nothing).
    pub fn with_further_context_memory(mut self, bytes: u64) -> Ledger {
        self.further_context_bytes = bytes;
        self
    }

    /// Runs this process's work on `gpu` in MIG device `dev`: its memory there is counted
    /// against `dev`'s GPU instance (shared with that instance's other compute instances)
    /// and its record says which device it is on, for NVML.
    pub fn with_mig(mut self, dev: &crate::mig::MigDevice) -> Ledger {
        if let Some(slot) = self.mig.get_mut(dev.gpu as usize) {
            *slot = (dev.tag(), dev.memory_bytes);
        }
        self
    }

    /// What `n` contexts of one process on one device hold.
    fn contexts_cost(&self, n: u64) -> u64 {
        match n {
            0 => 0,
            n => self
                .context_bytes
                .saturating_add(self.further_context_bytes.saturating_mul(n - 1)),
        }
    }

    /// This process's pid on the host: its record's name (asked before any lock is taken).
    fn me(&self) -> u32 {
        crate::driver::host_pid(&self.dir)
    }

    /// The state folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn total(&self, gpu: u32) -> Result<u64, LedgerError> {
        self.totals
            .get(gpu as usize)
            .copied()
            .ok_or(LedgerError::NoSuchGpu(gpu))
    }

    /// Creates this process's record (caller holds the mutex and the mem.lock flock, so a reader
    /// deleting dead records never races the rename).
    fn create_record(&self, me: u32) -> Result<Mine, LedgerError> {
        let procs = self.dir.join("procs");
        let name = free_record_name(&procs, me);
        let tmp = procs.join(format!(".new-{me}"));
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(io(&tmp))?;
        file.set_len(RECORD_BYTES as u64).map_err(io(&tmp))?;
        let mut lk = whole_file_lock(libc::F_WRLCK as i16);
        // SAFETY: F_OFD_SETLK with a valid, zero-pid flock struct on our own descriptor.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut lk) } != 0 {
            return Err(io(&tmp)(std::io::Error::last_os_error()));
        }
        let mut header = [0u8; 16];
        header[..8].copy_from_slice(&MAGIC.to_ne_bytes());
        header[8..].copy_from_slice(&u64::from(me).to_ne_bytes());
        file.write_all_at(&header, 0).map_err(io(&tmp))?;
        // SAFETY: mapping RECORD_BYTES of a file we just sized to RECORD_BYTES, shared.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                RECORD_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io(&tmp)(std::io::Error::last_os_error()));
        }
        let dest = procs.join(&name);
        std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
        let fd = file.into_raw_fd();
        for slot in &RECORD_FDS {
            if slot
                .compare_exchange(-1, fd, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                break;
            }
        }
        Ok(Mine {
            pid: me,
            name,
            fd,
            words: map as *const AtomicU64,
        })
    }

    /// Runs `f` on this process's record, creating it if needed (again after a fork).
    fn with_mine<T>(&self, f: impl FnOnce(&Mine) -> T) -> Result<T, LedgerError> {
        let me = self.me();
        let mut guard = self.mine.lock();
        if guard.as_ref().is_none_or(|m| m.pid != me) {
            let _flock = FlockGuard::lock(&self.mem_lock);
            *guard = Some(self.create_record(me)?);
        }
        Ok(f(guard.as_ref().expect("record just made")))
    }
}

/// What the process does on the card: allocations and frees, engine time, contexts, shared
/// memory held and shown.
impl Ledger {
    /// Reserves `bytes` of device memory on `gpu` if the card has room (counting every live
    /// process), else [`LedgerError::OutOfMemory`].
    pub fn try_alloc(&self, gpu: u32, bytes: u64) -> Result<(), LedgerError> {
        let me = self.me();
        let mut guard = self.mine.lock();
        let _flock = FlockGuard::lock(&self.mem_lock);
        let mine = self.charge(&mut guard, me, gpu, bytes)?;
        mine.word(HEADER_WORDS + gpu as usize * GPU_WORDS + W_MEM)
            .fetch_add(bytes, Ordering::SeqCst);
        Ok(())
    }

    /// Checks that `bytes` more fit on `gpu` (caller holds the mutex, passed as `guard`, and
    /// the mem.lock flock, and adds the bytes to a word of the returned record of `me`).
    fn charge<'g>(
        &self,
        guard: &'g mut Option<Mine>,
        me: u32,
        gpu: u32,
        bytes: u64,
    ) -> Result<&'g Mine, LedgerError> {
        let total = self.total(gpu)?;
        if guard.as_ref().is_none_or(|m| m.pid != me) {
            *guard = Some(self.create_record(me)?);
        }
        let (tag, instance_bytes) = self.mig.get(gpu as usize).copied().unwrap_or((0, 0));
        let (total, used) = match tag {
            0 => (total, card_used(&self.dir, gpu, true)?),
            _ => (instance_bytes, instance_used(&self.dir, gpu, tag, true)?),
        };
        let free = total.saturating_sub(used);
        if bytes > free {
            return Err(LedgerError::OutOfMemory {
                gpu,
                requested: bytes,
                free,
            });
        }
        // Before the caller raises its record: a reader that then reads the raised record
        // sees the generation move and reads again (see [`crate::generation`]).
        self.generation.bump();
        let mine = guard.as_ref().expect("record just made");
        if tag != 0 {
            mine.word(HEADER_WORDS + gpu as usize * GPU_WORDS + W_MIG)
                .store(tag, Ordering::SeqCst);
        }
        Ok(mine)
    }

    /// Returns `bytes` of device memory on `gpu` (no-op in a fork child that never allocated).
    pub fn free(&self, gpu: u32, bytes: u64) {
        if gpu as usize >= MAX_GPUS {
            return;
        }
        let me = self.me();
        let guard = self.mine.lock();
        if let Some(m) = guard.as_ref().filter(|m| m.pid == me) {
            let w = m.word(HEADER_WORDS + gpu as usize * GPU_WORDS + W_MEM);
            let _ = w.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                Some(v.saturating_sub(bytes))
            });
        }
    }

    /// Adds engine busy time of this process's kernels on `gpu`.
    pub fn add_busy(&self, gpu: u32, ns: u64) -> Result<(), LedgerError> {
        if gpu as usize >= MAX_GPUS {
            return Err(LedgerError::NoSuchGpu(gpu));
        }
        self.with_mine(|m| {
            m.word(HEADER_WORDS + gpu as usize * GPU_WORDS + W_BUSY)
                .fetch_add(ns, Ordering::Relaxed);
        })
    }

    /// Counts a context of this process on `gpu` opening (`true`) or closing (`false`), so NVML
    /// lists processes that hold a context but no memory. Opening charges the first or a
    /// further context's memory ([`LedgerError::OutOfMemory`] when the card has no room for it,
    /// and then nothing is counted); closing returns what the last one opened cost.
    pub fn context_changed(&self, gpu: u32, opened: bool) -> Result<(), LedgerError> {
        if gpu as usize >= MAX_GPUS {
            return Err(LedgerError::NoSuchGpu(gpu));
        }
        let base = HEADER_WORDS + gpu as usize * GPU_WORDS;
        if !opened {
            // Closing never needs the flock: returning memory cannot overcommit the card.
            return self.with_mine(|m| {
                if let Ok(prev) =
                    m.word(base + W_CTX)
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
                {
                    m.word(base + W_CTX_MEM)
                        .store(self.contexts_cost(prev - 1), Ordering::SeqCst);
                }
            });
        }
        let me = self.me();
        let mut guard = self.mine.lock();
        let open = guard
            .as_ref()
            .filter(|m| m.pid == me)
            .map_or(0, |m| m.word(base + W_CTX).load(Ordering::SeqCst));
        let cost = self.contexts_cost(open + 1) - self.contexts_cost(open);
        let mine = if cost > 0 {
            let _flock = FlockGuard::lock(&self.mem_lock);
            let mine = self.charge(&mut guard, me, gpu, cost)?;
            mine.word(base + W_CTX_MEM)
                .store(self.contexts_cost(open + 1), Ordering::SeqCst);
            mine
        } else {
            if guard.as_ref().is_none_or(|m| m.pid != me) {
                let _flock = FlockGuard::lock(&self.mem_lock);
                *guard = Some(self.create_record(me)?);
            }
            guard.as_ref().expect("record just made")
        };
        mine.word(base + W_CTX).fetch_add(1, Ordering::SeqCst);
        if let Some(&(tag, _)) = self.mig.get(gpu as usize).filter(|m| m.0 != 0) {
            mine.word(base + W_MIG).store(tag, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Takes this process's hold of the shared VMM allocation `key` (`bytes` on `gpu`): the
    /// card is charged when no process holds it yet ([`LedgerError::OutOfMemory`] when it has
    /// no room), and keeps it while any hold lives, in any process.
    pub fn hold_shared(&self, gpu: u32, key: u64, bytes: u64) -> Result<SharedHold, LedgerError> {
        let me = self.me();
        let mut guard = self.mine.lock();
        let _flock = FlockGuard::lock(&self.mem_lock);
        if !crate::shared::is_held(&self.dir, key) {
            self.charge(&mut guard, me, gpu, bytes)?;
        }
        let dir = self.dir.join("vmm");
        crate::shared::hold(&self.dir, key, gpu, bytes).map_err(io(&dir))
    }

    /// Drops a hold taken by [`Ledger::hold_shared`] (under the mem.lock flock, so a process
    /// taking a hold at the same time either joins this one or charges the card anew).
    pub fn release_shared(&self, hold: SharedHold) {
        let _guard = self.mine.lock();
        let _flock = FlockGuard::lock(&self.mem_lock);
        drop(hold);
    }

    /// Shows (`on`) or stops showing `bytes` of shared VMM memory on `gpu` in this process's
    /// NVML figure; the card's own figure is not changed (see [`Ledger::hold_shared`]).
    pub fn show_shared(&self, gpu: u32, bytes: u64, on: bool) -> Result<(), LedgerError> {
        if gpu as usize >= MAX_GPUS {
            return Err(LedgerError::NoSuchGpu(gpu));
        }
        self.with_mine(|m| {
            let w = m.word(HEADER_WORDS + gpu as usize * GPU_WORDS + W_SHARED);
            if on {
                w.fetch_add(bytes, Ordering::SeqCst);
            } else {
                let _ = w.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                    Some(v.saturating_sub(bytes))
                });
            }
        })
    }

    /// Bytes this process's allocations hold on `gpu` (context memory not included).
    pub fn my_mem(&self, gpu: u32) -> u64 {
        let me = self.me();
        let guard = self.mine.lock();
        match guard.as_ref().filter(|m| m.pid == me) {
            Some(m) if (gpu as usize) < MAX_GPUS => m
                .word(HEADER_WORDS + gpu as usize * GPU_WORDS + W_MEM)
                .load(Ordering::SeqCst),
            _ => 0,
        }
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        let me = self.me();
        let guard = self.mine.lock();
        if let Some(m) = guard.as_ref().filter(|m| m.pid == me) {
            for slot in &RECORD_FDS {
                let _ = slot.compare_exchange(m.fd, -1, Ordering::SeqCst, Ordering::SeqCst);
            }
            let _ = std::fs::remove_file(self.dir.join("procs").join(&m.name));
            // SAFETY: closing our own record descriptor; the mapping stays (never unmapped).
            unsafe { libc::close(m.fd) };
        }
    }
}

fn whole_file_lock(kind: i16) -> libc::flock {
    // SAFETY: flock is a plain C struct; all-zero is valid (whole file, pid 0 as OFD requires).
    let mut lk: libc::flock = unsafe { std::mem::zeroed() };
    lk.l_type = kind;
    lk.l_whence = libc::SEEK_SET as i16;
    lk
}

/// The name of a new record of `pid`: the pid itself unless a live record holds it, which can
/// only be another copy of this library in this very process (its own ledger, its own OFD
/// lock), whose record must not be replaced; then `<pid>.1`, `<pid>.2`, ... (caller holds the
/// mem.lock flock, so two copies never pick the same name).
fn free_record_name(procs: &Path, pid: u32) -> String {
    let live = |name: &str| {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(procs.join(name))
            .is_ok_and(|f| is_alive(&f))
    };
    let mut name = pid.to_string();
    let mut n = 0u32;
    while live(&name) {
        n += 1;
        name = format!("{pid}.{n}");
    }
    name
}

/// Whether process `pid` (a host pid, as records and engine slots hold) lives, as far as this
/// process can tell (see the module notes). A pid that is no pid (above `i32::MAX`) is dead.
pub fn process_alive(dir: &Path, pid: u64) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if crate::driver::identity(dir).local {
        // SAFETY: signal 0 only checks the pid exists; nothing is sent.
        let rc = unsafe { libc::kill(p, 0) };
        // A pid we may not signal still exists.
        rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    } else {
        record_alive(dir, pid as u32)
    }
}

/// Whether process `pid` (a host pid) has a live record in `dir`: how a process that cannot
/// ask the kernel about host pids (one in a container) tells whether another one lives. Every
/// process that opened a context or took memory has one.
pub(crate) fn record_alive(dir: &Path, pid: u32) -> bool {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(dir.join("procs").join(pid.to_string()))
        .is_ok_and(|f| is_alive(&f))
}

/// The pid a record's file name belongs to (`<pid>` or `<pid>.<n>`).
fn record_pid(name: &str) -> Option<u32> {
    let (pid, copy) = match name.split_once('.') {
        Some((pid, copy)) => (pid, Some(copy)),
        None => (name, None),
    };
    if copy.is_some_and(|c| c.parse::<u32>().is_err()) {
        return None;
    }
    pid.parse().ok()
}

/// Whether the record behind `file` still has a live owner.
fn is_alive(file: &File) -> bool {
    let mut lk = whole_file_lock(libc::F_WRLCK as i16);
    // SAFETY: F_OFD_GETLK with a valid, zero-pid flock struct on an open descriptor.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut lk) };
    rc == 0 && lk.l_type != libc::F_UNLCK as i16
}

/// Reads the records of live processes; with `delete_dead`, removes dead ones (only callers
/// holding the mem.lock flock may delete, so a new record's rename cannot be lost).
fn scan(dir: &Path, delete_dead: bool) -> Result<Vec<ProcessUsage>, LedgerError> {
    let procs = dir.join("procs");
    let entries = match std::fs::read_dir(&procs) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(&procs)(e)),
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(record_pid) else {
            continue;
        };
        let path = entry.path();
        let Ok(file) = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        else {
            continue;
        };
        if !is_alive(&file) {
            if delete_dead {
                let _ = std::fs::remove_file(&path);
            }
            continue;
        }
        let mut buf = [0u8; RECORD_BYTES];
        if file.read_exact_at(&mut buf, 0).is_err() {
            continue;
        }
        #[cfg(test)]
        tests::after_record(&name.to_string_lossy());
        let word = |i: usize| u64::from_ne_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap());
        if word(0) != MAGIC {
            continue;
        }
        let mut u = ProcessUsage {
            pid,
            mem_bytes: [0; MAX_GPUS],
            context_bytes: [0; MAX_GPUS],
            shared_bytes: [0; MAX_GPUS],
            busy_ns: [0; MAX_GPUS],
            contexts: [0; MAX_GPUS],
            mig_tag: [0; MAX_GPUS],
        };
        for g in 0..MAX_GPUS {
            let base = HEADER_WORDS + g * GPU_WORDS;
            u.context_bytes[g] = word(base + W_CTX_MEM);
            u.shared_bytes[g] = word(base + W_SHARED);
            u.mem_bytes[g] = word(base + W_MEM) + u.context_bytes[g] + u.shared_bytes[g];
            u.busy_ns[g] = word(base + W_BUSY);
            u.contexts[g] = word(base + W_CTX);
            u.mig_tag[g] = word(base + W_MIG);
        }
        // A second copy of the library in the same process: one process, one sum (per MIG
        // device: copies on two instances are listed on each, as NVML lists a process per
        // device it runs on).
        match out
            .iter_mut()
            .find(|o: &&mut ProcessUsage| o.pid == pid && o.mig_tag == u.mig_tag)
        {
            Some(o) => {
                for g in 0..MAX_GPUS {
                    o.mem_bytes[g] += u.mem_bytes[g];
                    o.context_bytes[g] += u.context_bytes[g];
                    o.shared_bytes[g] += u.shared_bytes[g];
                    o.busy_ns[g] += u.busy_ns[g];
                    o.contexts[g] += u.contexts[g];
                }
            }
            None => out.push(u),
        }
    }
    out.sort_by_key(|u| u.pid);
    Ok(out)
}

/// Every live process using the simulated GPUs of `dir`, with its memory and busy time, as
/// the card held them at one instant (or less, when some freed meanwhile).
pub fn read_processes(dir: &Path) -> Result<Vec<ProcessUsage>, LedgerError> {
    crate::generation::consistent(dir, || scan(dir, false))
}

/// Device memory in use on `gpu`, bytes, summed over live processes: what the card held at one
/// instant (or less, when some freed meanwhile).
pub fn device_memory_used(dir: &Path, gpu: u32) -> Result<u64, LedgerError> {
    if gpu as usize >= MAX_GPUS {
        return Err(LedgerError::NoSuchGpu(gpu));
    }
    crate::generation::consistent(dir, || card_used(dir, gpu, false))
}

/// What the card holds on `gpu`: every live process's own memory, plus each held shared VMM
/// allocation once (not once per process showing it).
fn card_used(dir: &Path, gpu: u32, delete_dead: bool) -> Result<u64, LedgerError> {
    let g = gpu as usize;
    let own: u64 = scan(dir, delete_dead)?
        .iter()
        .map(|p| p.mem_bytes[g] - p.shared_bytes[g])
        .sum();
    Ok(own + crate::shared::held_bytes(dir, delete_dead)[g])
}

/// Device memory in use in the GPU instance of MIG device `tag` ([`crate::mig::tag`]) on
/// `gpu`, bytes, at one instant: what NVML shows for a MIG device.
pub fn instance_memory_used(dir: &Path, gpu: u32, tag: u64) -> Result<u64, LedgerError> {
    if gpu as usize >= MAX_GPUS {
        return Err(LedgerError::NoSuchGpu(gpu));
    }
    crate::generation::consistent(dir, || instance_used(dir, gpu, tag, false))
}

/// What the GPU instance of MIG device `tag` on `gpu` holds: the own memory of every live
/// process on any compute instance of that GPU instance (shared VMM memory is the card's).
fn instance_used(dir: &Path, gpu: u32, tag: u64, delete_dead: bool) -> Result<u64, LedgerError> {
    let g = gpu as usize;
    let gi = crate::mig::untag(tag).map(|(gi, _)| gi);
    Ok(scan(dir, delete_dead)?
        .iter()
        .filter(|p| crate::mig::untag(p.mig_tag[g]).map(|(gi, _)| gi) == gi)
        .map(|p| p.mem_bytes[g] - p.shared_bytes[g])
        .sum())
}

/// Runs `f` with `hook` called after each record a scan in this thread reads (by file name);
/// how a test puts another process's allocation inside a reading.
#[cfg(test)]
pub(crate) fn tests_after_record<T>(hook: impl FnMut(&str) + 'static, f: impl FnOnce() -> T) -> T {
    tests::AFTER_RECORD.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
    let got = f();
    tests::AFTER_RECORD.with(|h| *h.borrow_mut() = None);
    got
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    type Hook = Box<dyn FnMut(&str)>;

    thread_local! {
        pub(crate) static AFTER_RECORD: std::cell::RefCell<Option<Hook>> =
            const { std::cell::RefCell::new(None) };
    }

    /// Calls this thread's hook, if any; taken out meanwhile, so a scan the hook itself causes
    /// (an allocation checks the card) does not call it again.
    pub(crate) fn after_record(name: &str) {
        if let Some(mut hook) = AFTER_RECORD.with(|h| h.borrow_mut().take()) {
            hook(name);
            AFTER_RECORD.with(|h| *h.borrow_mut() = Some(hook));
        }
    }

    #[test]
    fn alloc_free_and_oom() {
        let dir = tempfile::tempdir().unwrap();
        let l = Ledger::open(dir.path(), vec![1000, 50]).unwrap();
        l.try_alloc(0, 600).unwrap();
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 600);
        let err = l.try_alloc(0, 401).unwrap_err();
        assert!(matches!(err, LedgerError::OutOfMemory { free: 400, .. }));
        l.try_alloc(0, 400).unwrap();
        l.free(0, 1000);
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 0);
        l.try_alloc(1, 50).unwrap();
        assert!(l.try_alloc(2, 1).is_err());
        l.add_busy(1, 77).unwrap();
        let procs = read_processes(dir.path()).unwrap();
        assert_eq!(procs.len(), 1);
        assert_eq!(procs[0].pid, std::process::id());
        assert_eq!(procs[0].busy_ns[1], 77);
        assert_eq!(procs[0].mem_bytes[1], 50);
    }

    #[test]
    fn a_second_copy_in_the_same_process_keeps_its_own_record_and_both_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        // Two ledgers of one folder in one process: what two copies of libcuda.so.1 loaded
        // into two link-map namespaces have.
        let first = Ledger::open(dir.path(), vec![1000]).unwrap();
        let second = Ledger::open(dir.path(), vec![1000]).unwrap();
        first.try_alloc(0, 64).unwrap();
        second.try_alloc(0, 400).unwrap();
        assert_eq!(
            device_memory_used(dir.path(), 0).unwrap(),
            464,
            "neither record replaced the other"
        );
        let procs = read_processes(dir.path()).unwrap();
        assert_eq!(procs.len(), 1, "one process: {procs:?}");
        assert_eq!(
            (procs[0].pid, procs[0].mem_bytes[0]),
            (std::process::id(), 464)
        );
        assert!(
            second.try_alloc(0, 537).is_err(),
            "the card's room counts both copies"
        );
        drop(second);
        assert_eq!(
            device_memory_used(dir.path(), 0).unwrap(),
            64,
            "the second copy's record only went"
        );
        assert_eq!(record_pid("12.3"), Some(12));
        assert_eq!(record_pid("12.x"), None);
        assert_eq!(record_pid(".new-12"), None);
    }

    #[test]
    fn first_context_charges_context_memory_and_last_returns_it() {
        let dir = tempfile::tempdir().unwrap();
        let l = Ledger::open(dir.path(), vec![1000, 1000])
            .unwrap()
            .with_context_memory(300);
        l.context_changed(0, true).unwrap();
        l.context_changed(0, true).unwrap();
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 300);
        let procs = read_processes(dir.path()).unwrap();
        assert_eq!(
            (procs[0].mem_bytes[0], procs[0].context_bytes[0]),
            (300, 300)
        );
        assert_eq!(procs[0].contexts[0], 2);
        // Context memory counts against the card like allocations.
        assert!(matches!(
            l.try_alloc(0, 701),
            Err(LedgerError::OutOfMemory { free: 700, .. })
        ));
        l.try_alloc(0, 700).unwrap();
        assert_eq!(l.my_mem(0), 700);
        l.context_changed(0, false).unwrap();
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 1000);
        l.context_changed(0, false).unwrap();
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 700);
        // No room for a context: it fails and nothing is counted.
        l.try_alloc(1, 800).unwrap();
        assert!(matches!(
            l.context_changed(1, true),
            Err(LedgerError::OutOfMemory { requested: 300, .. })
        ));
        let procs = read_processes(dir.path()).unwrap();
        assert_eq!((procs[0].contexts[1], procs[0].mem_bytes[1]), (0, 800));
    }

    #[test]
    fn shared_memory_is_counted_once_on_the_card_and_shown_per_holder() {
        let dir = tempfile::tempdir().unwrap();
        let l = Ledger::open(dir.path(), vec![1000]).unwrap();
        let creator = l.hold_shared(0, 42, 600).unwrap();
        l.show_shared(0, 600, true).unwrap();
        // A second holder (an importer) joins without a new charge.
        let importer = l.hold_shared(0, 42, 600).unwrap();
        l.show_shared(0, 600, true).unwrap();
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 600);
        assert_eq!(read_processes(dir.path()).unwrap()[0].mem_bytes[0], 1200);
        assert!(matches!(
            l.try_alloc(0, 401),
            Err(LedgerError::OutOfMemory { free: 400, .. })
        ));
        assert!(
            l.hold_shared(0, 43, 401).is_err(),
            "a new shared allocation needs room"
        );
        l.release_shared(creator);
        l.show_shared(0, 600, false).unwrap();
        assert_eq!(
            device_memory_used(dir.path(), 0).unwrap(),
            600,
            "the importer's hold keeps the memory on the card"
        );
        l.release_shared(importer);
        l.show_shared(0, 600, false).unwrap();
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 0);
        l.try_alloc(0, 1000).unwrap();
    }

    #[test]
    fn every_further_context_charges_its_own_memory() {
        let dir = tempfile::tempdir().unwrap();
        let l = Ledger::open(dir.path(), vec![1000])
            .unwrap()
            .with_context_memory(300)
            .with_further_context_memory(100);
        for _ in 0..3 {
            l.context_changed(0, true).unwrap();
        }
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 300 + 2 * 100);
        // 500 held: a fourth context fits (100), then the card is full for a fifth.
        l.context_changed(0, true).unwrap();
        l.try_alloc(0, 400).unwrap();
        assert!(matches!(
            l.context_changed(0, true),
            Err(LedgerError::OutOfMemory {
                requested: 100,
                free: 0,
                ..
            })
        ));
        let procs = read_processes(dir.path()).unwrap();
        assert_eq!((procs[0].contexts[0], procs[0].context_bytes[0]), (4, 600));
        for left in [500, 400, 300, 0] {
            l.context_changed(0, false).unwrap();
            assert_eq!(
                read_processes(dir.path()).unwrap()[0].context_bytes[0],
                left
            );
        }
        // A close with nothing open changes nothing.
        l.context_changed(0, false).unwrap();
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 400);
    }

    #[test]
    fn dead_record_is_ignored_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        crate::dirs::ensure_state_dir(dir.path()).unwrap();
        // A record nobody holds a lock on: what a SIGKILLed process leaves.
        let mut buf = vec![0u8; RECORD_BYTES];
        buf[..8].copy_from_slice(&MAGIC.to_ne_bytes());
        buf[16..24].copy_from_slice(&999u64.to_ne_bytes());
        let stale = dir.path().join("procs").join("4000000");
        std::fs::write(&stale, &buf).unwrap();
        assert_eq!(device_memory_used(dir.path(), 0).unwrap(), 0);
        let l = Ledger::open(dir.path(), vec![1000]).unwrap();
        l.try_alloc(0, 1000).unwrap();
        assert!(!stale.exists());
    }
}
