//! Child cgroups (v2) that tests and benchmarks put processes in, so that the arbiter sees them
//! as different containers: it reads a peer's cgroup from `/proc/<pid>/cgroup`, the way it does
//! for pods.
//!
//! A [`TestCgroups`] is a folder of its own under this process's cgroup on the cgroup v2
//! mount (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid host), named after the
//! caller and this pid so that concurrent tests never share one. Its children hold no
//! controllers, so the v2 "no internal processes" rule does not stand in the way. Dropped, it
//! kills what is left in its children and removes them.
//!
//! Creating cgroups needs root (or a delegated subtree): where that is not possible the helpers
//! panic with what is missing. A test that measures cgroup isolation must not pass without it.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Where the cgroup v2 hierarchy is mounted, from `/proc/self/mountinfo` (field 9 is the
/// filesystem type, field 5 the mount point).
pub fn v2_mount() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let mount = left.split_whitespace().nth(4)?;
        (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount))
    })
}

/// This process's cgroup v2 path (the `0::` line of `/proc/self/cgroup`).
fn own_path() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_owned)
}

/// A test-owned folder of child cgroups (see the module docs); removed when dropped.
#[derive(Debug)]
pub struct TestCgroups {
    /// Its folder on the cgroup v2 mount.
    dir: PathBuf,
    /// Its path as `/proc/<pid>/cgroup` names it.
    rel: String,
    children: Vec<PathBuf>,
}

/// One child cgroup of a [`TestCgroups`].
#[derive(Debug, Clone)]
pub struct Cgroup {
    dir: PathBuf,
    rel: String,
}

impl TestCgroups {
    /// Creates `<mount><own cgroup>/tessera-<name>-<pid>-<n>`; panics, saying what is missing,
    /// when there is no cgroup v2 mount or the folder cannot be created (not root, read-only).
    pub fn new(name: &str) -> Self {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let mount = v2_mount().unwrap_or_else(|| {
            panic!(
                "no cgroup v2 mount in /proc/self/mountinfo: this test puts processes in \
                 cgroups of their own and needs cgroup v2 (unified or hybrid)"
            )
        });
        let own = own_path().unwrap_or_else(|| {
            panic!("/proc/self/cgroup has no cgroup v2 (0::) line: cannot place child cgroups")
        });
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let leaf = format!("tessera-{name}-{}-{n}", std::process::id());
        let rel = format!("{}/{leaf}", own.trim_end_matches('/'));
        let dir = mount.join(rel.trim_start_matches('/'));
        std::fs::create_dir(&dir).unwrap_or_else(|e| {
            panic!(
                "cannot create the cgroup {}: {e}. This test needs root (or a delegated cgroup \
                 v2 subtree) to put processes in cgroups of their own",
                dir.display()
            )
        });
        Self {
            dir,
            rel,
            children: Vec::new(),
        }
    }

    /// Creates the child cgroup `name`.
    pub fn child(&mut self, name: &str) -> Cgroup {
        let dir = self.dir.join(name);
        std::fs::create_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot create the cgroup {}: {e}", dir.display()));
        self.children.push(dir.clone());
        Cgroup {
            dir,
            rel: format!("{}/{name}", self.rel),
        }
    }
}

impl Cgroup {
    /// Its folder on the cgroup v2 mount.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its path as `/proc/<pid>/cgroup` names it (`0::<path>`).
    pub fn path(&self) -> &str {
        &self.rel
    }

    /// Makes the process `cmd` starts join this cgroup before it executes its program, so that
    /// everything it does (its first connection included) happens inside. Panics when the
    /// cgroup's `cgroup.procs` cannot be opened.
    pub fn join_at_exec(&self, cmd: &mut Command) {
        let procs = self.dir.join("cgroup.procs");
        // Opened here, not in the child: between fork and exec only async-signal-safe calls
        // are allowed (write(2) is; opening a path through std allocates). Close-on-exec, so
        // the program never holds it.
        let fd: OwnedFd = std::fs::OpenOptions::new()
            .write(true)
            .open(&procs)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", procs.display()))
            .into();
        // SAFETY: the closure runs in the forked child before exec and only calls write(2) on
        // a descriptor the parent opened (kept alive by the closure); "0" moves the writing
        // process itself.
        unsafe {
            cmd.pre_exec(move || {
                let rc = libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1);
                if rc == 1 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }

    /// The pids in it now.
    pub fn procs(&self) -> Vec<i32> {
        std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Moves process `pid` into it.
    pub fn add(&self, pid: u32) {
        let procs = self.dir.join("cgroup.procs");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&procs)
            .and_then(|mut f| f.write_all(pid.to_string().as_bytes()))
            .unwrap_or_else(|e| panic!("cannot move pid {pid} into {}: {e}", procs.display()));
    }
}

impl Drop for TestCgroups {
    fn drop(&mut self) {
        for dir in self.children.iter().rev() {
            let cg = Cgroup {
                dir: dir.clone(),
                rel: String::new(),
            };
            // `cgroup.kill` (Linux 5.14) kills everything left at once; older kernels: each pid.
            if std::fs::write(dir.join("cgroup.kill"), b"1").is_err() {
                for pid in cg.procs() {
                    // SAFETY: kill(2) on a process this test placed in its own cgroup.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            // A killed process leaves its cgroup once it is reaped; its parent (this process,
            // usually) may reap it later, so the removal is retried for a while and then left.
            let start = Instant::now();
            while std::fs::remove_dir(dir).is_err() && start.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
