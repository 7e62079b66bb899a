//! What the backstop reads of a process from `/proc`: parent, start time, cgroup, mount
//! namespace and the container's identity file.

#[allow(unused_imports)]
use super::*;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use tessera_protocol::process::read_proc_file;

/// The cgroup v2 path of `pid`: the `0::` line of `/proc/<pid>/cgroup`.
pub(crate) fn proc_cgroup(pid: &str) -> Option<String> {
    let text = read_proc_file(Path::new(&format!("/proc/{pid}/cgroup"))).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_owned)
}

/// What a process's identity path shows (read once per mount namespace and poll).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Shown {
    /// The token of a read-only file that reads as an identity.
    token: Option<String>,
    /// The file's inode when it reads as an identity, read-only or not.
    file: Option<FileKey>,
    /// The mount table has a mount at the identity path.
    mounted: bool,
}

/// [`ProcView`] over `/proc`.
#[derive(Debug)]
pub(crate) struct ProcFs {
    /// The host's mount namespace (`readlink` of it), e.g. of `/proc/1/ns/mnt` with `hostPID`.
    host_mnt: Option<std::path::PathBuf>,
    /// What the identity path shows per mount namespace, for one poll (the processes of a
    /// container share one).
    cache: std::cell::RefCell<HashMap<std::path::PathBuf, Shown>>,
    /// Parent and start time per pid (`/proc/<pid>/stat`, read once a poll: a connected
    /// process's liveness and the walk from a GPU process up to its connected ancestor asked
    /// for the same file up to four times, half the poll's time with 64 processes).
    stats: std::cell::RefCell<HashMap<i32, Option<(i32, u64)>>>,
}

/// Parent (field 4) and start time (field 22) of `pid` from one read of `/proc/<pid>/stat`.
fn parent_and_start(pid: i32) -> Option<(i32, u64)> {
    let stat = read_proc_file(Path::new(&format!("/proc/{pid}/stat"))).ok()?;
    // From field 3 (state) on.
    let mut rest = tessera_protocol::process::stat_fields(&stat)?;
    let parent = rest.nth(1)?.parse().ok()?;
    let start = rest.nth(17)?.parse().ok()?;
    Some((parent, start))
}

impl ProcFs {
    /// A view whose host mount namespace is the one `host_ns` (a `/proc/<pid>/ns/mnt` link)
    /// names. When it cannot be read (no `hostPID`, no `CAP_SYS_PTRACE`), containers are
    /// still recognised by their identity file, but a process without one is taken for a
    /// host process (reported, never killed): failing closed there would kill the host's own
    /// GPU tools. The error is returned for the log.
    pub(crate) fn new(host_ns: &std::path::Path) -> (Self, Option<std::io::Error>) {
        let (host_mnt, err) = match std::fs::read_link(host_ns) {
            Ok(l) => (Some(l), None),
            Err(e) => (None, Some(e)),
        };
        (
            Self {
                host_mnt,
                cache: Default::default(),
                stats: Default::default(),
            },
            err,
        )
    }

    /// Clears the per-poll cache (a pid and a namespace may be reused between polls).
    pub(crate) fn clear(&self) {
        self.cache.borrow_mut().clear();
        self.stats.borrow_mut().clear();
    }

    /// [`parent_and_start`] of `pid`, once a poll.
    fn stat(&self, pid: i32) -> Option<(i32, u64)> {
        *self
            .stats
            .borrow_mut()
            .entry(pid)
            .or_insert_with(|| parent_and_start(pid))
    }

    /// What `pid`'s identity path shows; `None` for a host process or one gone.
    fn shown(&self, pid: i32) -> Option<Shown> {
        let ns = std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok()?;
        if self.host_mnt.as_ref() == Some(&ns) {
            return None;
        }
        Some(
            self.cache
                .borrow_mut()
                .entry(ns)
                .or_insert_with(|| read_shown(pid))
                .clone(),
        )
    }
}

impl ProcView for ProcFs {
    fn parent(&self, pid: i32) -> Option<i32> {
        self.stat(pid).map(|(parent, _)| parent)
    }

    fn start_time(&self, pid: i32) -> Option<u64> {
        self.stat(pid).map(|(_, start)| start)
    }

    fn cgroup(&self, pid: i32) -> Option<String> {
        proc_cgroup(&pid.to_string())
    }

    fn origin(&self, pid: i32) -> Origin {
        // Gone, not ours to look at, or in the host's namespace: nothing to attribute it by.
        let Some(shown) = self.shown(pid) else {
            return Origin::Host;
        };
        match (shown.token, &self.host_mnt) {
            // The host's namespace is unknown (see [`ProcFs::new`]): a process without a
            // Tessera identity may be a host process, and host processes are never killed.
            (None, None) => Origin::Host,
            (token, _) => Origin::Container { token },
        }
    }

    fn identity_file(&self, pid: i32) -> Option<FileKey> {
        self.shown(pid)?.file
    }

    fn identity_mounted(&self, pid: i32) -> bool {
        self.shown(pid).is_some_and(|s| s.mounted)
    }

    fn exe_name(&self, pid: i32) -> Option<String> {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
        let name = exe.file_name()?.to_str()?;
        // A binary replaced on disk since it started reads "<name> (deleted)".
        Some(name.trim_end_matches(" (deleted)").to_owned())
    }
}

/// What `pid`'s identity path shows: the file (see [`open_identity`]) and whether its mount
/// table has a mount there.
fn read_shown(pid: i32) -> Shown {
    let mut shown = Shown {
        mounted: identity_mounted(pid),
        ..Shown::default()
    };
    let Some((file, read_only)) = open_identity(pid) else {
        return shown;
    };
    let Ok(meta) = file.metadata() else {
        return shown;
    };
    let Ok(identity) = Identity::read_from(file) else {
        return shown;
    };
    shown.file = Some((meta.dev(), meta.ino()));
    // A file the container could write proves nothing (a plugin mounts its file read-only).
    shown.token = read_only.then_some(identity.token);
    shown
}

/// True when `/proc/<pid>/mountinfo` lists a mount at the identity path (field 5, the mount
/// point relative to the process's root).
fn identity_mounted(pid: i32) -> bool {
    let Ok(text) = read_proc_file(Path::new(&format!("/proc/{pid}/mountinfo"))) else {
        return false;
    };
    text.lines()
        .any(|l| l.split(' ').nth(4) == Some(CONTAINER_IDENTITY_FILE))
}

/// Reads a container's identity file through `/proc/<pid>/root` (no symlink followed);
/// only a read-only one.
#[cfg(test)]
pub(crate) fn read_identity(pid: i32) -> Option<Identity> {
    let (file, read_only) = open_identity(pid)?;
    if !read_only {
        return None;
    }
    Identity::read_from(file).ok()
}

/// Opens the identity path in `pid`'s root without following any symlink inside the container
/// (an absolute link would resolve on the host); a regular file only, and whether its mount is
/// read-only.
fn open_identity(pid: i32) -> Option<(std::fs::File, bool)> {
    let root = CString::new(format!("/proc/{pid}/root")).ok()?;
    // SAFETY: a valid C string; the descriptor returned is owned below.
    let dir = unsafe {
        libc::open(
            root.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if dir < 0 {
        return None;
    }
    // SAFETY: `dir` is a descriptor we just opened and own.
    let dir = unsafe { OwnedFd::from_raw_fd(dir) };
    let rel = CString::new(CONTAINER_IDENTITY_FILE.trim_start_matches('/')).ok()?;
    // SAFETY: open_how is plain integers; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u64;
    how.resolve = libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_BENEATH;
    // SAFETY: openat2 reads `how` (size given) and the C string `rel`; `dir` is open.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: openat2 returned a new descriptor we own.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    // SAFETY: fstatvfs fills the zeroed struct for an open descriptor.
    let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut vfs) } != 0 {
        return None;
    }
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    Some((file, vfs.f_flag & libc::ST_RDONLY != 0))
}

/// Most identity files indexed (a node has one per container; more are not read).
const IDENTITY_FILES_MAX: usize = 65_536;

/// The identity files in `dir` (each named `<allocation id>.<random>`, see the device plugin's
/// `identity` module), by inode. A folder that cannot be read vouches for nothing: fail
/// closed, every container's identity then proves nothing and the other rules decide.
pub(crate) fn read_identity_files(dir: &std::path::Path) -> IdentityFiles {
    let entries = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .take(IDENTITY_FILES_MAX)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            if name.starts_with('.') {
                return None;
            }
            let (id, _) = name.split_once('.')?;
            let meta = std::fs::symlink_metadata(e.path()).ok()?;
            meta.is_file()
                .then(|| ((meta.dev(), meta.ino()), id.to_owned()))
        });
    IdentityFiles::from_entries(entries)
}
