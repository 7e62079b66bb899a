//! The execution engine of each simulated device, shared by every process.
//!
//! `engine<N>` in the state folder is both the lock and the counters: a kernel runs while its
//! stream worker holds `flock(LOCK_EX)` on its own descriptor of the file (so kernels of any two
//! processes, or two streams of one process, never overlap), and the holder records the busy time
//! in the file's words before unlocking. Layout (u64 words, native endian):
//! `[0]` cumulative busy ns, `[1]` start of the running kernel (monotonic ns, 0 when idle),
//! `[2]` pid running it, `[3]` a change counter (odd while the holder updates `[1]`, `[2]` and
//! the pid slots, so a lock-free reader can tell a torn read and retry), then [`BUCKETS`] pairs `(bucket index, busy ns)` of
//! [`BUCKET_NS`]-wide time buckets, a ring used for utilization over the last second, then
//! [`PID_SLOTS`] pairs `(pid, busy ns)`: each process's cumulative busy time on the device, what
//! NVML's per-process utilization is computed from, then the running kernel's length (ns, 0
//! when unknown), then the time-slicing turn (the context that ran last and how long it has
//! run) and, per pid slot, how many of that process's kernels wait for the engine.
//!
//! **Time-slicing** (an engine made [`Engine::with_timeslice`], `TESSERA_SIM_TIMESLICE`): a
//! GPU without MPS runs one context at a time and switches between contexts that have work
//! every time slice (see [`crate::timeslice`]). A kernel then runs in chunks of at most one
//! slice while another context waits (alone, it runs on, on one clock, and stops after the
//! slice in which another context starts waiting), the lock taken for each chunk; between chunks the rules say whose turn it is, and a
//! worker whose turn it is not lets go and waits. A context is a process (its pid). Without
//! time-slicing a kernel holds the engine from start to end, first come first served.
//!
//! Busy time is a kernel's own length, not the wall time its stream worker took: a card runs a
//! kernel for its duration whatever the host does, and NVML's utilization is the "percent of
//! time over the past sample period during which one or more kernels was executing on the GPU"
//! (NVML API reference, `nvmlUtilization_t`). The worker holds the engine until it wakes, so a
//! host that descheduled it (on a loaded machine, for 100 ms and more) leaves the device idle
//! after the kernel, as a card would be while its host stalls; counting that wall time made a
//! 1 ms kernel read as 138 ms of its process's GPU time.
//!
//! Pids are host pids ([`crate::driver::host_pid`]), as NVML reports them, also for a process
//! in a container. Pid slots are claimed by the holder under the flock: its own slot, else a
//! free one, else one whose pid is dead ([`crate::ledger::process_alive`]: `kill(pid, 0)` fails
//! with `ESRCH`, or, from a container, the pid has no live record). When all are held by live
//! processes the kernel's time still counts for the device, but not for its process, which
//! then shows no per-process utilization (until a slot frees up). Files of an older, shorter
//! layout grow on open, the new slots zero (free).

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
/// Per-process busy-time slots (more processes on one device than this is not a workload the
/// simulator models).
pub const PID_SLOTS: usize = 64;
const HEADER_WORDS: usize = 4;
const PIDS_AT: usize = HEADER_WORDS + 2 * BUCKETS;
const KERNEL_NS_AT: usize = PIDS_AT + 2 * PID_SLOTS;
/// The time-slicing turn ([`crate::timeslice::Turn`]): the context that ran last, how long.
const TURN_AT: usize = KERNEL_NS_AT + 1;
/// Per pid slot: how many of that process's kernels wait for the engine (time-slicing only).
const WAITING_AT: usize = TURN_AT + 2;
/// When the last time-sliced chunk ended (monotonic ns): a switch to another context lasts
/// its `switch_ns` from then, however late the next context's worker woke.
const LAST_END_AT: usize = WAITING_AT + PID_SLOTS;
const FILE_WORDS: usize = LAST_END_AT + 1;
/// A pid slot's pid word while a process claims it.
const CLAIMING: u64 = u64::MAX;
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
    /// The state folder (whose driver names this process, see [`crate::driver`]).
    dir: PathBuf,
    file: File,
    words: *const AtomicU64,
    /// Time-slicing between contexts; `None`: each kernel runs whole, in turn.
    slicing: Option<crate::timeslice::Params>,
    /// `TESSERA_SIM_ENGINE_TRACE`: a file each run on the engine is appended to, one line
    /// `pid start_ns end_ns ran_ns` (monotonic clock), for timelines.
    trace: Option<File>,
}

/// Environment variable naming the engine's trace file (see [`Engine`]'s `trace`).
pub const ENV_ENGINE_TRACE: &str = "TESSERA_SIM_ENGINE_TRACE";

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
        Engine::open_at(dir, engine_path(dir, gpu))
    }

    /// Opens the engine of MIG device `tag` ([`crate::mig::tag`]) on `gpu`: each compute
    /// instance has its own (`engine<N>.mig<GI>.<CI>`), so one instance's kernels never wait
    /// for another's, as MIG isolates them on a card.
    pub fn open_mig(dir: &Path, gpu: u32, tag: u64) -> Result<Engine, EngineError> {
        let (gi, ci) = crate::mig::untag(tag).unwrap_or((0, 0));
        Engine::open_at(dir, dir.join(format!("engine{gpu}.mig{gi}.{ci}")))
    }

    fn open_at(dir: &Path, path: PathBuf) -> Result<Engine, EngineError> {
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
        let trace = std::env::var_os(ENV_ENGINE_TRACE).and_then(|p| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(p)
                .ok()
        });
        Ok(Engine {
            dir: dir.to_owned(),
            file,
            words: map as *const AtomicU64,
            slicing: None,
            trace,
        })
    }

    /// The same engine, time-slicing between contexts with `params` (`None`: whole kernels
    /// in turn). Every process on a device should agree, as they share one engine file.
    pub fn with_timeslice(mut self, params: Option<crate::timeslice::Params>) -> Self {
        self.slicing = params;
        self
    }

    /// This process's pid on the host: its context and its slot.
    fn me(&self) -> u32 {
        crate::driver::host_pid(&self.dir)
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < FILE_WORDS);
        // SAFETY: i < FILE_WORDS; the mapping is FILE_BYTES long and lives as long as self.
        unsafe { &*self.words.add(i) }
    }

    /// Occupies the engine for `ns` nanoseconds (at most [`MAX_KERNEL_NS`]), waiting first for
    /// any kernel of any process to finish, or, time-slicing, in slices between the contexts
    /// that have work. Returns the (start, end) monotonic ns of the time from the kernel's
    /// first run to its end (with time-slicing it spans other contexts' slices, as an event
    /// pair around it does on a card); the busy time counted is the kernel's length (see the
    /// module notes).
    pub fn run(&self, ns: u64) -> (u64, u64) {
        // Known before the engine's lock is taken (a fork child may first ask the driver).
        let me = self.me();
        match self.slicing {
            Some(p) => self.run_sliced(me, ns, &p),
            None => {
                self.lock();
                let r = self.hold(ns.min(MAX_KERNEL_NS));
                self.unlock();
                r
            }
        }
    }

    fn lock(&self) {
        let fd = self.file.as_raw_fd();
        loop {
            // SAFETY: flock on our own descriptor.
            let rc = unsafe { libc::flock(fd, libc::LOCK_EX) };
            if rc == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                break;
            }
        }
    }

    fn unlock(&self) {
        // SAFETY: unlocking our own descriptor.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }

    /// Runs `ns` of a kernel holding the engine (caller holds the lock): marks it running,
    /// sleeps its length, counts it.
    fn hold(&self, ns: u64) -> (u64, u64) {
        self.hold_while(ns, ns, || false)
    }

    /// [`Engine::hold`] for up to `ns`, in steps of `step` on one clock (a late wake-up is
    /// not added to the next step), stopping after a step when `yield_now` says another
    /// context waits: a lone context runs on as a card runs it, with no host time lost
    /// between slices. Returns the (start, end) and the kernel time run.
    fn hold_while(&self, ns: u64, step: u64, yield_now: impl Fn() -> bool) -> (u64, u64) {
        self.hold_from(monotonic_ns(), ns, step, yield_now)
    }

    /// [`Engine::hold_while`] with the kernel's start at `start` (now or a little earlier:
    /// see [`Engine::run_sliced`]).
    fn hold_from(
        &self,
        start: u64,
        ns: u64,
        step: u64,
        yield_now: impl Fn() -> bool,
    ) -> (u64, u64) {
        // A holder killed while updating left the counter odd: even it again.
        let _ = self
            .word(3)
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                (v % 2 == 1).then_some(v + 1)
            });
        let start = start.min(monotonic_ns());
        self.word(3).fetch_add(1, Ordering::SeqCst);
        self.word(2).store(u64::from(self.me()), Ordering::SeqCst);
        self.word(KERNEL_NS_AT).store(ns, Ordering::SeqCst);
        self.word(1).store(start, Ordering::SeqCst);
        self.word(3).fetch_add(1, Ordering::SeqCst);
        let mut ran = 0;
        while ran < ns {
            ran += step.max(1).min(ns - ran);
            sleep_until(start + ran);
            if ran < ns && yield_now() {
                break;
            }
        }
        let end = monotonic_ns();
        self.word(LAST_END_AT).store(end, Ordering::SeqCst);
        self.word(3).fetch_add(1, Ordering::SeqCst);
        // The running kernel's length as far as it ran (a reader caps the running part by it).
        self.word(KERNEL_NS_AT).store(ran, Ordering::SeqCst);
        self.account(start, end.min(start + ran));
        if let Some(mut f) = self.trace.as_ref() {
            // One write of a short line to a file opened for appending: lines of several
            // processes never interleave.
            let line = format!("{} {start} {end} {ran}\n", self.me());
            let _ = std::io::Write::write_all(&mut f, line.as_bytes());
        }
        self.word(1).store(0, Ordering::SeqCst);
        self.word(3).fetch_add(1, Ordering::SeqCst);
        (start, end)
    }

    /// [`Engine::run`] time-sliced, for context `ctx` (a process's pid; tests name others).
    pub fn run_sliced(&self, ctx: u32, ns: u64, p: &crate::timeslice::Params) -> (u64, u64) {
        use crate::timeslice::{Step, Turn, step};
        let ns = ns.min(MAX_KERNEL_NS);
        let Some(slot) = self.pid_slot(ctx) else {
            // Every slot is a live process's: no turn to take part in; run whole, in turn.
            self.lock();
            let r = self.hold(ns);
            self.unlock();
            return r;
        };
        // Said without the lock: the holder sees it at its next slice, whoever gets the lock.
        let waiting = self.word(WAITING_AT + (slot - PIDS_AT) / 2);
        waiting.fetch_add(1, Ordering::SeqCst);
        let (mut remaining, mut first, mut end) = (ns, None, 0);
        while remaining > 0 {
            let asked = monotonic_ns();
            self.lock();
            let turn = Turn {
                last: self.word(TURN_AT).load(Ordering::SeqCst),
                used_ns: self.word(TURN_AT + 1).load(Ordering::SeqCst),
            };
            match step(
                p,
                &turn,
                u64::from(ctx),
                remaining,
                &self.waiting_contexts(),
            ) {
                Step::Wait => {
                    self.unlock();
                    // Its turn comes within a slice; look again soon.
                    fine_timer_slack();
                    std::thread::sleep(Duration::from_micros(20));
                }
                Step::Run {
                    switch_ns,
                    chunk_ns,
                } => {
                    // The switch: the engine saves one context and loads the next, running
                    // nobody's kernel meanwhile, from the moment the last chunk ended (or
                    // this one asked, if the engine was idle). Counted from when this worker
                    // got the lock, the host's wake-up latency was added to every switch.
                    let last_end = self.word(LAST_END_AT).load(Ordering::SeqCst);
                    let ready = asked.max(last_end) + switch_ns;
                    sleep_until(ready);
                    // The chunk starts when the engine was ready, even if this worker woke
                    // later (the host's wake-up latency is no card's): at most a chunk ago.
                    let from = ready.max(monotonic_ns().saturating_sub(chunk_ns));
                    // Alone, it runs on past its slice until another context waits.
                    let me = u64::from(ctx);
                    let others = || self.waiting_contexts().iter().any(|&c| c != me);
                    let (s, e) = if others() {
                        self.hold_from(from, chunk_ns, chunk_ns, || false)
                    } else {
                        self.hold_from(from, remaining, chunk_ns, others)
                    };
                    let chunk_ns = (self.word(KERNEL_NS_AT).load(Ordering::SeqCst)).min(remaining);
                    let mut next = turn;
                    next.ran(p, me, chunk_ns);
                    self.word(TURN_AT).store(next.last, Ordering::SeqCst);
                    self.word(TURN_AT + 1).store(next.used_ns, Ordering::SeqCst);
                    first.get_or_insert(s);
                    end = e;
                    remaining -= chunk_ns;
                    if remaining == 0 {
                        waiting.fetch_sub(1, Ordering::SeqCst);
                    }
                    self.unlock();
                }
            }
        }
        (first.unwrap_or(end), end)
    }

    /// The contexts (pids) with a kernel waiting for the engine, in slot-independent order
    /// (caller holds the lock); a process that died waiting is not one.
    fn waiting_contexts(&self) -> Vec<u64> {
        let mut out: Vec<u64> = (0..PID_SLOTS)
            .filter(|&i| self.word(WAITING_AT + i).load(Ordering::SeqCst) > 0)
            .map(|i| self.word(PIDS_AT + 2 * i).load(Ordering::SeqCst))
            .filter(|&pid| pid != 0 && pid != CLAIMING && !pid_dead(&self.dir, pid))
            .collect();
        out.sort_unstable();
        out
    }

    /// Adds [start, end) to the cumulative counter, this process's slot and the bucket ring
    /// (caller holds the lock).
    fn account(&self, start: u64, end: u64) {
        if let Some(slot) = self.pid_slot(self.me()) {
            self.word(slot + 1).fetch_add(end - start, Ordering::SeqCst);
        }
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
            self.word(slot + 1)
                .fetch_add(bucket_end - t, Ordering::Relaxed);
            t = bucket_end;
        }
    }
}

impl Engine {
    /// The first word of `pid`'s busy-time slot, claiming one if it has none; `None` when every
    /// slot belongs to a live process. Lock-free (a compare-and-swap claims a slot), so a
    /// kernel can say it waits for the engine without taking the engine's lock, which its
    /// holder may take again at once after each slice.
    fn pid_slot(&self, pid: u32) -> Option<usize> {
        let slots = || (0..PID_SLOTS).map(|i| PIDS_AT + 2 * i);
        let mine = u64::from(pid);
        if let Some(s) = slots().find(|&s| self.word(s).load(Ordering::SeqCst) == mine) {
            return Some(s);
        }
        for s in slots() {
            let cur = self.word(s).load(Ordering::SeqCst);
            if (cur == 0 || (cur != CLAIMING && pid_dead(&self.dir, cur)))
                && self
                    .word(s)
                    .compare_exchange(cur, CLAIMING, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                // Busy time first, then the pid: a lock-free reader never credits the dead
                // owner's total to the new one (it skips a slot being claimed). A dead owner's
                // waiting kernels are gone with it.
                self.word(s + 1).store(0, Ordering::SeqCst);
                self.word(WAITING_AT + (s - PIDS_AT) / 2)
                    .store(0, Ordering::SeqCst);
                self.word(s).store(mine, Ordering::SeqCst);
                return Some(s);
            }
        }
        None
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `open`, no references outlive self.
        unsafe { libc::munmap(self.words as *mut libc::c_void, FILE_BYTES) };
    }
}

/// Sleeps until `deadline` on the monotonic clock (never less: a sleep may wake early).
fn sleep_until(deadline: u64) {
    fine_timer_slack();
    loop {
        let now = monotonic_ns();
        if now >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_nanos(deadline - now));
    }
}

/// Makes this thread's sleeps end when asked (once per thread). Linux lets a sleep of a
/// normal thread run up to its timer slack late, 50 us by default: every slice of a kernel and
/// every switch between contexts then ran 50-60 us long on the wall clock while the busy time
/// counted stayed exact, so two saturating contexts kept the engine busy only 82% of the
/// time (400 ms of kernels in 490 ms on this 2-core VM, against the 410 ms the 50 us switches
/// model), an idle a card does not have, which inflated every interleaved latency.
fn fine_timer_slack() {
    thread_local! {
        static SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    SET.with(|set| {
        if !set.replace(true) {
            // SAFETY: PR_SET_TIMERSLACK takes an integer argument and affects only the
            // calling thread.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
        }
    });
}

/// Whether no process `pid` (a host pid) exists, as far as this process can tell.
fn pid_dead(dir: &Path, pid: u64) -> bool {
    !crate::ledger::process_alive(dir, pid)
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
        running_part(&w, monotonic_ns())
    } else {
        0
    };
    w[0] + running
}

/// How much of the running kernel (started at `w[1]`) has run by `now`: at most its length.
fn running_part(w: &[u64], now: u64) -> u64 {
    let ran = now.saturating_sub(w[1]);
    match w[KERNEL_NS_AT] {
        0 => ran,
        ns => ran.min(ns),
    }
}

/// Cumulative engine busy time of each process on `gpu`, ns, including its running kernel, as
/// `(pid, busy ns)`, taken at one instant (monotonic ns, also returned). Processes without a
/// slot (see the module notes) are missing.
pub fn process_busy_ns(dir: &Path, gpu: u32) -> (u64, Vec<(u32, u64)>) {
    let Ok(file) = File::open(engine_path(dir, gpu)) else {
        return (monotonic_ns(), Vec::new());
    };
    let counter = || {
        let mut b = [0u8; 8];
        file.read_exact_at(&mut b, 3 * 8)
            .ok()
            .map(|()| u64::from_ne_bytes(b))
    };
    // A read while the holder moves a kernel's time into its slot could count it twice or not
    // at all: retry until the change counter is even and unchanged around the read (a holder
    // killed mid-update leaves it odd until the next kernel; then take what is there).
    for attempt in 0..200 {
        let before = counter();
        let Some(w) = read_words(dir, gpu) else {
            return (monotonic_ns(), Vec::new());
        };
        let now = monotonic_ns();
        let stable = before.is_some_and(|b| b % 2 == 0) && counter() == before;
        if !stable && attempt < 199 {
            std::thread::yield_now();
            continue;
        }
        let mut out: Vec<(u32, u64)> = (0..PID_SLOTS)
            .map(|i| (w[PIDS_AT + 2 * i] as u32, w[PIDS_AT + 2 * i + 1]))
            .filter(|&(pid, _)| pid != 0 && pid != CLAIMING as u32)
            .collect();
        // A holder killed mid-kernel leaves its start behind; its kernel ran no further.
        if w[1] != 0 && !pid_dead(dir, w[2]) {
            let running = running_part(&w, now);
            match out.iter_mut().find(|(pid, _)| u64::from(*pid) == w[2]) {
                Some(entry) => entry.1 += running,
                None => out.push((w[2] as u32, running)),
            }
        }
        return (now, out);
    }
    (monotonic_ns(), Vec::new())
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
        busy += running_part(&w, now).min(now.saturating_sub(from));
    }
    (busy as f64 / window_ns as f64).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two contexts (this process and its parent, both alive), each with one 20 ms kernel
    /// started together: their (start, end) spans and the device's busy time after both.
    fn two_kernels(slicing: Option<crate::timeslice::Params>) -> [(u64, u64); 2] {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: getppid has no preconditions.
        let ctxs = [std::process::id(), unsafe { libc::getppid() } as u32];
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let spans: Vec<(u64, u64)> = ctxs
            .map(|ctx| {
                let (dir, barrier) = (dir.path().to_owned(), barrier.clone());
                std::thread::spawn(move || {
                    let e = Engine::open(&dir, 0).unwrap().with_timeslice(slicing);
                    barrier.wait();
                    match slicing {
                        Some(p) => e.run_sliced(ctx, 20_000_000, &p),
                        None => e.run(20_000_000),
                    }
                })
            })
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        assert_eq!(
            device_busy_ns(dir.path(), 0),
            40_000_000,
            "busy is the kernels' length"
        );
        [spans[0], spans[1]]
    }

    #[test]
    fn time_slicing_interleaves_two_contexts_and_whole_kernels_do_not() {
        let [a, b] = two_kernels(Some(crate::timeslice::Params::default()));
        // Each kernel ran across the other's slices: their spans overlap, as an event pair
        // around each would show on a card.
        assert!(a.0 < b.1 && b.0 < a.1, "spans {a:?} {b:?} do not overlap");
        // First come first served: one runs whole, then the other.
        let [a, b] = two_kernels(None);
        assert!(
            a.1 <= b.0 || b.1 <= a.0,
            "whole kernels overlapped: {a:?} {b:?}"
        );
    }

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
        assert!(
            t0.elapsed() >= Duration::from_millis(195),
            "kernels overlapped"
        );
        assert!(spans[0].1 <= spans[1].0 || spans[1].1 <= spans[0].0);
        let busy = device_busy_ns(&d, 0);
        assert!((200_000_000..300_000_000).contains(&busy), "busy {busy}");
        let u = device_utilization(&d, 0, Duration::from_secs(1));
        assert!(u > 0.15 && u <= 1.0, "utilization {u}");
        assert_eq!(device_busy_ns(&d, 1), 0);
        let (_, per_pid) = process_busy_ns(&d, 0);
        assert_eq!(per_pid.len(), 1);
        assert_eq!(per_pid[0].0, std::process::id());
        assert!(
            (200_000_000..300_000_000).contains(&per_pid[0].1),
            "{per_pid:?}"
        );
    }

    #[test]
    fn running_kernel_counts_for_its_process() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let t = std::thread::spawn(move || Engine::open(&d, 0).unwrap().run(300_000_000));
        std::thread::sleep(Duration::from_millis(150));
        let (_, per_pid) = process_busy_ns(dir.path(), 0);
        t.join().unwrap();
        assert_eq!(per_pid.len(), 1);
        assert!(
            (50_000_000..300_000_000).contains(&per_pid[0].1),
            "{per_pid:?}"
        );
    }

    #[test]
    fn a_kernel_counts_its_length_not_a_stalled_workers_wall_time() {
        let dir = tempfile::tempdir().unwrap();
        let e = Engine::open(dir.path(), 0).unwrap();
        e.run(2_000_000);
        let done = device_busy_ns(dir.path(), 0);
        assert!((2_000_000..=2_000_000).contains(&done), "busy {done}");
        // A 1 ms kernel whose worker has not woken for 200 ms (a descheduled host thread): it
        // ran for 1 ms, then the device idled.
        e.word(2)
            .store(u64::from(std::process::id()), Ordering::SeqCst);
        e.word(KERNEL_NS_AT).store(1_000_000, Ordering::SeqCst);
        e.word(1)
            .store(monotonic_ns() - 200_000_000, Ordering::SeqCst);
        assert_eq!(device_busy_ns(dir.path(), 0), done + 1_000_000);
        let (_, per_pid) = process_busy_ns(dir.path(), 0);
        assert_eq!(per_pid, vec![(std::process::id(), done + 1_000_000)]);
        let u = device_utilization(dir.path(), 0, Duration::from_secs(1));
        assert!(u <= 0.0031, "utilization {u}");
    }

    #[test]
    fn dead_pids_slots_are_reclaimed_and_a_full_table_still_runs() {
        let dir = tempfile::tempdir().unwrap();
        let e = Engine::open(dir.path(), 0).unwrap();
        // Every slot held by a live process that is not us (pid 1, init, never dies).
        for i in 0..PID_SLOTS {
            e.word(PIDS_AT + 2 * i).store(1, Ordering::SeqCst);
        }
        e.run(1_000_000);
        assert!(
            device_busy_ns(dir.path(), 0) >= 1_000_000,
            "the device still counts"
        );
        let (_, per_pid) = process_busy_ns(dir.path(), 0);
        assert!(per_pid.iter().all(|&(pid, _)| pid == 1));
        // A dead process's slot (a pid above any pid_max) is taken over, its total reset.
        e.word(PIDS_AT + 2 * 7)
            .store(u64::from(i32::MAX as u32 - 1), Ordering::SeqCst);
        e.word(PIDS_AT + 2 * 7 + 1)
            .store(123_456_789_000, Ordering::SeqCst);
        e.run(1_000_000);
        let (_, per_pid) = process_busy_ns(dir.path(), 0);
        let me = per_pid
            .iter()
            .find(|&&(pid, _)| pid == std::process::id())
            .unwrap();
        assert!((1_000_000..100_000_000).contains(&me.1), "{me:?}");
    }
}
