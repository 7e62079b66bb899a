//! The simulated machine's kernel side: which pid each process has on the host.
//!
//! A real GPU's kernel driver knows every process by its pid in the host's PID namespace, so
//! NVML on the host (`nvmlDeviceGetComputeRunningProcesses`) reports host pids, also for
//! processes in containers; that is what Tessera's arbiter (host pids from `SO_PEERCRED`) and
//! its backstop compare with. A simulated driver inside a container sees only its own PID
//! namespace (`getpid()` is often 1 there), so it asks the machine instead: a process in the
//! host PID namespace (`tessera sim`, see [`spawn_detached`], or a thread, see [`Broker`])
//! serves `<state>/driver.sock`, and answers every connection with the connecting process's
//! pid taken from `SO_PEERCRED`, which the kernel translates into the server's namespace
//! (unix(7); `pid_vnr` of the peer). It reads nothing from the peer, so a peer can only ever
//! learn its own pid.
//!
//! Protocol: connect to `<state>/driver.sock` (a stream socket, mode 0666); the server writes
//! one line, `tessera-sim-driver 1 pid <PID>\n`, and closes. A peer outside the server's PID
//! namespace (pid 0 there) gets no line. Next to the socket the server writes
//! `<state>/driver.pidns`, the target of its `/proc/self/ns/pid` link (`pid:[4026531836]`).
//!
//! A process learns its pid once ([`identity`], cached, asked again in a fork child since its
//! pid differs): in the server's PID namespace (its own `/proc/self/ns/pid` reads the same) or
//! with no `driver.pidns` at all, it is `getpid()`, no socket involved; otherwise it asks, with
//! a deadline of [`ASK_TIMEOUT`] over the connect and the read (a hung server never hangs a
//! CUDA call), and on no answer falls back to `getpid()`, what the simulator always did, right
//! outside containers. Whatever the first answer is, it stays the process's identity for its
//! life: its records are named by it.
//!
//! Liveness ([`crate::ledger::process_alive`]): a process in the host namespace asks the kernel (`kill(pid,
//! 0)`); one in a container cannot (host pids mean nothing there) and looks for the live
//! record `procs/<pid>` instead (its owner holds an OFD lock on it while it lives).
//!
//! The state folder is trusted by everyone who uses it: a process that can write it can write
//! records too. What the server guarantees is narrower and holds against any peer: it names
//! only the peer's own pid, and never blocks on a peer.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The socket's name in the state folder.
pub const SOCKET_NAME: &str = "driver.sock";
/// The name of the file holding the server's PID namespace (`pid:[N]`).
pub const PIDNS_NAME: &str = "driver.pidns";
/// Serialises servers claiming the socket.
const LOCK_NAME: &str = "driver.lock";
/// How long a process waits for the server's answer (connect and read together).
pub const ASK_TIMEOUT: Duration = Duration::from_secs(1);
/// The answer's line, before the pid.
pub const ANSWER_PREFIX: &str = "tessera-sim-driver 1 pid ";
/// How often a server looks whether it should still serve (its socket is still its own; for a
/// detached one, the machine still runs).
const TICK_MS: libc::c_int = 250;

/// Errors of asking and serving.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no simulated driver serves {0} (no socket there, or nobody listens)")]
    Absent(PathBuf),
    #[error("the simulated driver at {path} did not answer within {timeout:?}")]
    Timeout { path: PathBuf, timeout: Duration },
    #[error("the simulated driver at {path} answered {answer:?}, not `{ANSWER_PREFIX}<pid>`")]
    BadAnswer { path: PathBuf, answer: String },
    #[error("a simulated driver already serves {0}")]
    AlreadyServed(PathBuf),
    #[error("{0}: too long for a Unix socket address (at most 107 bytes)")]
    PathTooLong(PathBuf),
    #[error(
        "the simulated driver is started as a process only from a single-threaded one \
         ({0} threads here)"
    )]
    Threaded(usize),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DriverError + '_ {
    move |source| DriverError::Io {
        path: path.to_owned(),
        source,
    }
}

fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// `<dir>/driver.sock`.
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join(SOCKET_NAME)
}

/// Who this process is on the simulated machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// Its pid on the host: what its records, engine slots and NVML carry.
    pub pid: u32,
    /// Whether pids of the machine are pids here too (the server's PID namespace, or no server:
    /// everyone uses their own), so `kill(pid, 0)` can tell whether one lives.
    pub local: bool,
}

/// The identity of this process, packed: `getpid()` (high 32 bits; 0: none yet), local (bit
/// 31), host pid (low 31 bits). Inherited by a fork child, whose `getpid()` differs.
static CACHE: AtomicU64 = AtomicU64::new(0);
/// The `getpid()` of the process one of whose threads is resolving (0: none). A value of
/// another pid is a parent's, copied by `fork` mid-resolution: nobody resolves here.
static RESOLVING: AtomicU32 = AtomicU32::new(0);

fn unpack(v: u64, me: u32) -> Option<Identity> {
    (v != 0 && (v >> 32) as u32 == me).then_some(Identity {
        pid: (v & 0x7fff_ffff) as u32,
        local: v & 0x8000_0000 != 0,
    })
}

/// In a fork child: forget the parent's identity (lock-free: runs in `atfork`). The cache's
/// `getpid()` key says the same, but a child whose pid a dead ancestor had (pids wrap) would
/// take that ancestor's entry.
extern "C" fn atfork_child() {
    CACHE.store(0, Ordering::SeqCst);
    RESOLVING.store(0, Ordering::SeqCst);
}

/// This process's identity on the machine of state folder `dir`: asked once per process (once
/// more in each fork child), then cached (see the module notes).
pub fn identity(dir: &Path) -> Identity {
    static ATFORK: std::sync::Once = std::sync::Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registering a plain extern "C" handler with no captured state.
        unsafe { libc::pthread_atfork(None, None, Some(atfork_child)) };
    });
    let me = std::process::id();
    loop {
        if let Some(id) = unpack(CACHE.load(Ordering::Acquire), me) {
            return id;
        }
        let claimed = RESOLVING.fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
            (r != me).then_some(me)
        });
        if claimed.is_err() {
            // Another thread of this process asks; its answer is everyone's.
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        /// Lets others resolve again however this thread leaves (a panic included).
        struct Done;
        impl Drop for Done {
            fn drop(&mut self) {
                RESOLVING.store(0, Ordering::Release);
            }
        }
        let _done = Done;
        let id = resolve(dir, me);
        let packed = (u64::from(me) << 32)
            | if id.local { 0x8000_0000 } else { 0 }
            | u64::from(id.pid & 0x7fff_ffff);
        CACHE.store(packed, Ordering::Release);
        return id;
    }
}

/// This process's pid on the host ([`identity`]): what the simulated driver records it by.
pub fn host_pid(dir: &Path) -> u32 {
    identity(dir).pid
}

/// The target of this process's `/proc/self/ns/pid` link (`pid:[N]`), if readable.
fn own_pidns() -> Option<String> {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

fn resolve(dir: &Path, me: u32) -> Identity {
    let local = Identity {
        pid: me,
        local: true,
    };
    let Ok(server_ns) = std::fs::read_to_string(dir.join(PIDNS_NAME)) else {
        // No server has run here: everyone is known by their own pid.
        return local;
    };
    let mine = own_pidns();
    if mine.as_deref() == Some(server_ns.trim()) {
        return local;
    }
    match ask(dir, ASK_TIMEOUT) {
        Ok(pid) => Identity {
            pid,
            // Without /proc the namespaces are unknown: the same pid says the same one.
            local: mine.is_none() && pid == me,
        },
        Err(e) => {
            use std::io::Write;
            // Written, not printed: a closed stderr must not panic a CUDA call.
            let _ = writeln!(
                std::io::stderr(),
                "tessera-sim: {e}; this process (in PID namespace {}, the driver's is {}) is \
                 known by its own pid {me}, which the host cannot match",
                mine.as_deref().unwrap_or("unknown"),
                server_ns.trim()
            );
            local
        }
    }
}

/// A `sockaddr_un` for `path`, and its length.
fn sockaddr(path: &Path) -> Result<(libc::sockaddr_un, libc::socklen_t), DriverError> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_un is a plain C struct; all-zero is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(DriverError::PathTooLong(path.to_owned()));
    }
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

/// Milliseconds left until `deadline`, for `poll` (at least 1 while any time is left).
fn poll_ms(deadline: Instant) -> Option<libc::c_int> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return None;
    }
    Some(left.as_millis().clamp(1, 60_000) as libc::c_int)
}

/// Asks the server of `dir` for this process's host pid, waiting at most `timeout` in all
/// (uncached: [`identity`] is what the simulated libraries use).
pub fn ask(dir: &Path, timeout: Duration) -> Result<u32, DriverError> {
    let path = socket_path(dir);
    let deadline = Instant::now() + timeout;
    let timed_out = || DriverError::Timeout {
        path: path.clone(),
        timeout,
    };
    let (addr, len) = sockaddr(&path)?;
    // SAFETY: socket() with constant arguments; the result is checked.
    let raw = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if raw < 0 {
        return Err(io(&path)(last_error()));
    }
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    loop {
        // SAFETY: connect with a valid sockaddr_un of `len` bytes on our own socket.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&raw const addr).cast::<libc::sockaddr>(),
                len,
            )
        };
        if rc == 0 {
            break;
        }
        let e = last_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            // The backlog is full: a server that accepts nothing. Try again until the deadline.
            Some(libc::EAGAIN) => {
                if poll_ms(deadline).is_none() {
                    return Err(timed_out());
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Some(libc::ENOENT) | Some(libc::ECONNREFUSED) | Some(libc::ENOTDIR) => {
                return Err(DriverError::Absent(path));
            }
            _ => return Err(io(&path)(e)),
        }
    }
    let mut buf = [0u8; 64];
    let mut got = 0;
    while got < buf.len() && !buf[..got].contains(&b'\n') {
        let Some(ms) = poll_ms(deadline) else {
            return Err(timed_out());
        };
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 && last_error().raw_os_error() != Some(libc::EINTR) {
            return Err(io(&path)(last_error()));
        }
        if rc <= 0 {
            continue;
        }
        let tail = &mut buf[got..];
        // SAFETY: reading at most `tail.len()` bytes into the unused tail of `buf`.
        let n = unsafe { libc::read(fd.as_raw_fd(), tail.as_mut_ptr().cast(), tail.len()) };
        match n {
            0 => break,
            n if n > 0 => got += n as usize,
            _ => {
                let e = last_error();
                if !matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN)) {
                    return Err(io(&path)(e));
                }
            }
        }
    }
    parse_answer(&buf[..got]).ok_or_else(|| DriverError::BadAnswer {
        path,
        answer: String::from_utf8_lossy(&buf[..got]).into_owned(),
    })
}

/// The pid of a whole answer line.
fn parse_answer(bytes: &[u8]) -> Option<u32> {
    std::str::from_utf8(bytes)
        .ok()?
        .strip_suffix('\n')?
        .strip_prefix(ANSWER_PREFIX)?
        .parse::<u32>()
        .ok()
        .filter(|&p| p > 0 && p <= i32::MAX as u32)
}

/// An exclusive `flock` on `<dir>/driver.lock`, held while alive.
struct DriverLock {
    /// Never read: owning the descriptor is what keeps the lock.
    _file: File,
}

impl DriverLock {
    /// Takes the lock, making its file unless `create` is false (a server leaving a folder
    /// that may be gone: it must not make files there again).
    fn take(dir: &Path, create: bool) -> Result<DriverLock, DriverError> {
        let path = dir.join(LOCK_NAME);
        let file = OpenOptions::new()
            .create(create)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o644)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(io(&path))?;
        loop {
            // SAFETY: flock on our own descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(DriverLock { _file: file });
            }
            let e = last_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(io(&path)(e));
            }
        }
    }
}

/// A listening socket renamed into place as `<dir>/driver.sock`, and which file it is there.
struct Claimed {
    dir: PathBuf,
    listener: UnixListener,
    /// (device, inode) of the socket file: another server's rename replaces it.
    id: (u64, u64),
}

impl Claimed {
    /// Whether `driver.sock` is still this server's socket.
    fn ours(&self) -> bool {
        std::fs::symlink_metadata(socket_path(&self.dir))
            .is_ok_and(|m| (m.dev(), m.ino()) == self.id)
    }

    /// Removes the socket and the namespace file, unless another server took the socket over.
    fn retire(&self) {
        let Ok(_lock) = DriverLock::take(&self.dir, false) else {
            return;
        };
        if self.ours() {
            let _ = std::fs::remove_file(socket_path(&self.dir));
            let _ = std::fs::remove_file(self.dir.join(PIDNS_NAME));
        }
    }
}

/// Writes `text` to `<dir>/name` whole (a temporary file renamed over it).
fn write_whole(dir: &Path, name: &str, text: &str) -> Result<(), DriverError> {
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).map_err(io(&tmp))?;
    let dest = dir.join(name);
    std::fs::rename(&tmp, &dest).map_err(io(&dest))
}

/// Takes `<dir>/driver.sock` for a new server: refused while a live server answers there; a
/// stale socket (nobody listens, or a server that does not answer within [`ASK_TIMEOUT`]) is
/// replaced by renaming the new one over it, so a client never finds no file mid-way.
fn claim(dir: &Path) -> Result<Claimed, DriverError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let _lock = DriverLock::take(dir, true)?;
    let path = socket_path(dir);
    sockaddr(&path)?;
    if ask(dir, ASK_TIMEOUT).is_ok() {
        return Err(DriverError::AlreadyServed(path));
    }
    let tmp = dir.join(format!(".{SOCKET_NAME}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(io(&tmp))?;
    let claimed = (|| {
        listener.set_nonblocking(true).map_err(io(&tmp))?;
        // Any process may ask: it only ever learns its own pid.
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o666)).map_err(io(&tmp))?;
        // Unreadable: a value no process has, so every one asks.
        let ns = own_pidns().unwrap_or_else(|| "unknown".to_owned());
        write_whole(dir, PIDNS_NAME, &format!("{ns}\n"))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        let m = std::fs::symlink_metadata(&path).map_err(io(&path))?;
        Ok(Claimed {
            dir: dir.to_owned(),
            listener,
            id: (m.dev(), m.ino()),
        })
    })();
    if claimed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    claimed
}

/// Answers one connection with its peer's pid (see the module notes); never blocks.
fn answer(fd: RawFd) {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of `len` bytes, on a connected Unix socket we own.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    // A peer outside this PID namespace shows as pid 0: it gets no answer and falls back.
    if rc != 0 || cred.pid <= 0 {
        return;
    }
    let line = format!("{ANSWER_PREFIX}{}\n", cred.pid);
    // SAFETY: sending from a live buffer of its length; MSG_DONTWAIT never blocks (the line
    // fits an empty socket buffer), MSG_NOSIGNAL raises no SIGPIPE for a peer gone already.
    unsafe {
        libc::send(
            fd,
            line.as_ptr().cast(),
            line.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
}

/// Serves until `wake` (a pipe's read end; -1: none) reports anything or `keep` says stop
/// (asked every [`TICK_MS`] and after each batch of connections), or the socket is no longer
/// this server's.
fn serve_loop(claimed: &Claimed, wake: RawFd, keep: impl Fn() -> bool) {
    let lfd = claimed.listener.as_raw_fd();
    loop {
        let mut fds = [
            libc::pollfd {
                fd: lfd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds (a negative fd is ignored by poll).
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, TICK_MS) };
        if rc < 0 && last_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            loop {
                match claimed.listener.accept() {
                    Ok((conn, _)) => answer(conn.as_raw_fd()),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    // Would block (none left), or a peer gone before it was accepted.
                    Err(_) => break,
                }
            }
        }
        if !keep() || !claimed.ours() {
            return;
        }
    }
}

/// A server of `<dir>/driver.sock` on a thread of this process (for a process in the host PID
/// namespace that lives as long as the machine: a test, a test bed). Dropping it stops the
/// thread and removes the socket, unless another server took it over.
#[derive(Debug)]
pub struct Broker {
    socket: PathBuf,
    /// The write end of the wake pipe: closing it stops the thread.
    stop: Option<OwnedFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Broker {
    /// Starts serving `dir`: [`DriverError::AlreadyServed`] while a live server answers there;
    /// a stale socket is replaced.
    pub fn serve(dir: &Path) -> Result<Broker, DriverError> {
        let claimed = claim(dir)?;
        let mut ends = [-1; 2];
        // SAFETY: pipe2 fills two descriptors; checked.
        if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            let e = last_error();
            claimed.retire();
            return Err(io(dir)(e));
        }
        // SAFETY: both are fresh descriptors nothing else owns.
        let (read, write) =
            unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
        let socket = socket_path(dir);
        let thread = std::thread::Builder::new()
            .name("tessera-sim-driver".into())
            .spawn(move || {
                serve_loop(&claimed, read.as_raw_fd(), || true);
                claimed.retire();
            })
            .map_err(io(&socket))?;
        Ok(Broker {
            socket,
            stop: Some(write),
            thread: Some(thread),
        })
    }

    /// The socket it serves.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What [`spawn_detached`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spawned {
    /// A live server answers there already (another `tessera sim` of the machine started it).
    AlreadyServed,
    /// A new server process serves it.
    Started,
}

/// Threads of this process.
fn thread_count() -> Result<usize, DriverError> {
    let tasks = Path::new("/proc/self/task");
    std::fs::read_dir(tasks)
        .map(|d| d.count())
        .map_err(io(tasks))
}

/// Serves `<dir>/driver.sock` from a detached process (its own session, a grandchild of this
/// one, so no command this process execs will ever wait for it), which lives as long as the
/// simulated machine of `dir` runs (some process holds `<dir>/machine`, see
/// [`crate::machine`]) and its socket is its own. The socket is listening when this returns.
/// For `tessera sim`, whose command replaces it (a thread would not survive the `exec`); only
/// from a single-threaded process ([`DriverError::Threaded`]), since the server runs on in a
/// fork child.
pub fn spawn_detached(dir: &Path) -> Result<Spawned, DriverError> {
    let threads = thread_count()?;
    if threads != 1 {
        return Err(DriverError::Threaded(threads));
    }
    let claimed = match claim(dir) {
        Ok(c) => c,
        Err(DriverError::AlreadyServed(_)) => return Ok(Spawned::AlreadyServed),
        Err(e) => return Err(e),
    };
    // SAFETY: this process has one thread (checked above), so the child may run any code.
    let child = unsafe { libc::fork() };
    match child {
        -1 => {
            let e = last_error();
            claimed.retire();
            Err(io(dir)(e))
        }
        0 => {
            // SAFETY: setsid and fork in a single-threaded child; _exit ends the intermediate
            // process without running anything of its parent's (atexit handlers, buffers).
            unsafe {
                libc::setsid();
                if libc::fork() == 0 {
                    run_detached(&claimed);
                }
                libc::_exit(0)
            }
        }
        pid => {
            let mut status = 0;
            // SAFETY: reaping our own child, which exits at once.
            while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
                && last_error().raw_os_error() == Some(libc::EINTR)
            {}
            // The grandchild serves; this process's copy of the socket closes here.
            Ok(Spawned::Started)
        }
    }
}

/// The detached server's life (a grandchild of [`spawn_detached`]'s caller); never returns.
fn run_detached(claimed: &Claimed) -> ! {
    let keep = claimed.listener.as_raw_fd();
    // SAFETY: PR_SET_NAME with a NUL-terminated name of at most 16 bytes (how `ps -o comm`
    // and `pgrep` know this process); chdir to "/" (no mount kept busy) and stdio to
    // /dev/null (no pipe of the caller kept open), with valid C strings; getrlimit fills a
    // live struct; each descriptor closed is one this process holds and owns no more (the
    // caller's machine hold among them, which must not keep the machine running), all but the
    // listening socket (closing a number that is no descriptor only fails).
    unsafe {
        libc::prctl(libc::PR_SET_NAME, c"tessera-simdrv".as_ptr());
        libc::chdir(c"/".as_ptr());
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            if null > 2 {
                libc::close(null);
            }
        }
        // Without /proc: every descriptor number up to the limit.
        let open: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_else(|_| {
                let mut lim = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
                (3..lim.rlim_cur.clamp(1024, 65_536) as RawFd).collect()
            });
        for fd in open.into_iter().filter(|&fd| fd > 2 && fd != keep) {
            libc::close(fd);
        }
    }
    let machine = File::open(claimed.dir.join("machine")).ok();
    serve_loop(claimed, -1, || {
        machine
            .as_ref()
            .is_some_and(|m| crate::machine::running(m).unwrap_or(false))
    });
    claimed.retire();
    // SAFETY: ending this process; nothing of it needs running.
    unsafe { libc::_exit(0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_broker_answers_each_peer_with_its_own_pid() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            ask(dir.path(), ASK_TIMEOUT),
            Err(DriverError::Absent(_))
        ));
        let broker = Broker::serve(dir.path()).unwrap();
        assert_eq!(broker.socket(), socket_path(dir.path()));
        assert_eq!(ask(dir.path(), ASK_TIMEOUT).unwrap(), std::process::id());
        // The namespace file is this process's: it is in the server's namespace.
        assert_eq!(
            std::fs::read_to_string(dir.path().join(PIDNS_NAME))
                .unwrap()
                .trim(),
            own_pidns().unwrap()
        );
        let id = identity(dir.path());
        assert_eq!((id.pid, id.local), (std::process::id(), true));
        // A second server is refused while the first answers.
        assert!(matches!(
            Broker::serve(dir.path()),
            Err(DriverError::AlreadyServed(_))
        ));
        // Another process asking learns its own pid, not ours.
        let out = std::process::Command::new("python3")
            .args([
                "-c",
                "import os,socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); \
                 print(os.getpid(), s.recv(64).decode().strip())",
            ])
            .arg(socket_path(dir.path()))
            .output()
            .expect("python3 runs");
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        let (pid, line) = text.trim().split_once(' ').unwrap();
        assert_ne!(pid, std::process::id().to_string());
        assert_eq!(line, format!("{ANSWER_PREFIX}{pid}"));
        drop(broker);
        assert!(!socket_path(dir.path()).exists(), "the socket goes with it");
        assert!(!dir.path().join(PIDNS_NAME).exists());
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_hung_one_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = socket_path(dir.path());
        // Nobody listens: what a killed server leaves.
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        assert!(matches!(
            ask(dir.path(), ASK_TIMEOUT),
            Err(DriverError::Absent(_))
        ));
        let broker = Broker::serve(dir.path()).unwrap();
        assert_eq!(ask(dir.path(), ASK_TIMEOUT).unwrap(), std::process::id());
        drop(broker);
        // A server that listens and never answers (stopped, wedged): the ask ends on time.
        let hung = UnixListener::bind(&path).unwrap();
        let t0 = Instant::now();
        let err = ask(dir.path(), Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, DriverError::Timeout { .. }), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        // ... and a new server takes its place.
        let broker = Broker::serve(dir.path()).unwrap();
        assert_eq!(ask(dir.path(), ASK_TIMEOUT).unwrap(), std::process::id());
        drop(hung);
        drop(broker);
    }

    #[test]
    fn answers_are_whole_lines_naming_a_pid() {
        assert_eq!(parse_answer(b"tessera-sim-driver 1 pid 42\n"), Some(42));
        assert_eq!(parse_answer(b"tessera-sim-driver 1 pid 42"), None);
        assert_eq!(parse_answer(b"tessera-sim-driver 1 pid 0\n"), None);
        assert_eq!(parse_answer(b"tessera-sim-driver 2 pid 42\n"), None);
        assert_eq!(parse_answer(b""), None);
        let long = Path::new("/").join("x".repeat(200));
        assert!(matches!(sockaddr(&long), Err(DriverError::PathTooLong(_))));
    }

    #[test]
    fn a_fork_child_is_asked_again() {
        let dir = tempfile::tempdir().unwrap();
        let parent = identity(dir.path());
        assert_eq!(parent.pid, std::process::id());
        let mut ends = [-1; 2];
        // SAFETY: pipe fills two descriptors.
        assert_eq!(unsafe { libc::pipe(ends.as_mut_ptr()) }, 0);
        // SAFETY: the child resolves its identity (getpid, a file read, an atomic) and writes a
        // pipe before _exit; glibc's fork leaves malloc usable in the child.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let pid = host_pid(dir.path()).to_ne_bytes();
            // SAFETY: writing four bytes from a live buffer, then ending the child.
            unsafe {
                libc::write(ends[1], pid.as_ptr().cast(), 4);
                libc::_exit(0);
            }
        }
        let mut pid = [0u8; 4];
        // SAFETY: reading four bytes into a live buffer; reaping our child; closing our pipe.
        unsafe {
            assert_eq!(libc::read(ends[0], pid.as_mut_ptr().cast(), 4), 4);
            libc::waitpid(child, std::ptr::null_mut(), 0);
            libc::close(ends[0]);
            libc::close(ends[1]);
        }
        assert_eq!(
            u32::from_ne_bytes(pid),
            child as u32,
            "a fork child is known by its own pid, not its parent's"
        );
        assert_eq!(host_pid(dir.path()), std::process::id());
    }
}
