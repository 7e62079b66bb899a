//! Carrying out a decision: the reason, the kill, the report.

#[allow(unused_imports)]
use super::*;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Why a process is acted on, with the evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reason {
    /// Its allocation's processes held too much device memory.
    Memory {
        /// Device memory the process held.
        used: u64,
        /// Device memory all the allocation's processes held.
        total: u64,
        /// What they may hold: the limit plus the tolerance ([`Tolerance::allowed`]).
        allowed: u64,
    },
    /// Its allocation used too much GPU time outside its leases.
    Compute {
        /// GPU time the process used in the last poll interval, ns.
        gpu_ns: u64,
        /// Unleased GPU time its allocation built up, ns.
        unleased_ns: u64,
    },
    /// It belongs to no allocation and claims an identity it does not have (see
    /// [`Owner::Forged`]).
    Forged {
        /// Device memory it held.
        used: u64,
    },
    /// It belongs to no allocation.
    Unknown {
        /// True in a container, false on the host.
        container: bool,
        /// Device memory it held.
        used: u64,
    },
}

/// One enforcement decision, with its evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Action {
    /// The process.
    pub pid: i32,
    /// Its allocation, if it has one.
    pub allocation: Option<String>,
    /// True when the process never connected to the arbiter (it went around the interposer).
    pub unconnected: bool,
    /// Why.
    pub reason: Reason,
}

/// `reason` for people (`tessera run` prints it), for an allocation on card `gpu` with memory
/// limit `limit`: a memory reason allowing less than the limit was about a card outside the
/// allocation (allowed 0), whose number the reason does not carry.
pub(crate) fn describe(reason: &Reason, gpu: u32, limit: u64) -> String {
    let outside = matches!(reason, Reason::Memory { allowed, .. } if *allowed < limit);
    let on = if outside {
        "on a GPU outside its allocation".to_owned()
    } else {
        format!("on GPU {gpu}")
    };
    match *reason {
        Reason::Memory {
            used,
            total,
            allowed,
        } if used == total => format!(
            "held {} {on}, allowed {} (the allocation's limit plus the tolerance)",
            human(used),
            human(allowed)
        ),
        Reason::Memory {
            used,
            total,
            allowed,
        } => format!(
            "held {} {on}; the allocation's processes held {}, allowed {} (its limit plus the \
             tolerance)",
            human(used),
            human(total),
            human(allowed)
        ),
        Reason::Compute {
            gpu_ns,
            unleased_ns,
        } => format!(
            "its allocation used {} ms of GPU time {on} outside its leases, past its slack; this \
             process {} ms in the last poll",
            unleased_ns / 1_000_000,
            gpu_ns / 1_000_000
        ),
        Reason::Unknown { used, .. } | Reason::Forged { used } => {
            format!("held {} {on} outside any allocation", human(used))
        }
    }
}

/// A hold on one process, taken when the backstop first looks at it: in production its pidfd
/// (`pidfd_open`), so a kill decided on what was read about it reaches that process or nobody,
/// never another that got its pid meanwhile (a pid is free for reuse once its process is reaped;
/// the pidfd names the process, not the number).
#[derive(Debug)]
pub struct Held {
    pid: i32,
    fd: Option<OwnedFd>,
}

impl Held {
    /// A hold without a descriptor (fakes; kernels before 5.3, where the kill goes by pid).
    pub(crate) fn unchecked(pid: i32) -> Self {
        Self { pid, fd: None }
    }

    /// Opens a pidfd on the process `pid` names now; `None` when there is none.
    pub(crate) fn open(pid: i32) -> Option<Self> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                // No pidfds on this kernel: the pid is all there is (and the start-time checks
                // of attribution the only guard, as before).
                Some(libc::ENOSYS) => Some(Self::unchecked(pid)),
                _ => None,
            };
        }
        // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Some(Self { pid, fd: Some(fd) })
    }

    /// The pid it was taken on.
    #[cfg(test)]
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// True when the process held has exited (its pidfd is readable). A hold without a
    /// descriptor cannot tell: false.
    pub fn exited(&self) -> bool {
        let Some(fd) = &self.fd else { return false };
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd, count 1, no wait.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP) != 0
    }

    /// Sends `SIGKILL` to the process held; false when it has exited.
    fn sigkill(&self) -> bool {
        match &self.fd {
            // SAFETY: pidfd_send_signal on a descriptor we own, no siginfo, no flags.
            Some(fd) => unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                ) == 0
            },
            // SAFETY: kill(2) has no memory preconditions (no pidfds on this kernel: see
            // [`Held::open`]).
            None => unsafe { libc::kill(self.pid, libc::SIGKILL) == 0 },
        }
    }
}

/// How the backstop stops a process: by pidfd in production ([`Sigkill`]), a recorder in
/// tests.
pub trait Killer: Send {
    /// Takes hold of the process `pid` names now, before anything about it is read; `None`
    /// when there is none.
    fn hold(&self, pid: i32) -> Option<Held>;
    /// Kills the process held; false when it could not (it exited meanwhile).
    fn kill(&self, target: &Held) -> bool;
}

/// [`Killer`] by `pidfd_send_signal(2)` on a pidfd opened when the process was first looked at.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sigkill;

impl Killer for Sigkill {
    fn hold(&self, pid: i32) -> Option<Held> {
        Held::open(pid)
    }

    fn kill(&self, target: &Held) -> bool {
        target.sigkill()
    }
}

impl Backstop {
    /// Carries out one decision (kill or report, log, count). False when nothing was done
    /// (an unknown process the policy ignores, or one reported before).
    pub(super) fn act(&mut self, a: &Action) -> bool {
        let kill = match (&a.reason, self.policy.enforce) {
            (_, Enforce::Report) => false,
            (
                Reason::Unknown {
                    container: false, ..
                },
                _,
            ) => false,
            (
                Reason::Unknown {
                    container: true, ..
                },
                _,
            ) => self.policy.unknown == Unknown::Kill,
            // Not another plugin's pod that `--unknown-processes` spares: a tenant hiding.
            (Reason::Forged { .. }, _) => true,
            _ => true,
        };
        if let Reason::Unknown { container, .. } = a.reason {
            let young = !container
                && self
                    .unknown_since
                    .get(&a.pid)
                    .is_none_or(|t| t.elapsed() < HOST_GRACE);
            if young {
                return false;
            }
            let quiet = self.policy.unknown == Unknown::Ignore
                || (!container && !self.reported.insert(a.pid))
                || (container && !kill && !self.reported.insert(a.pid));
            if quiet {
                return false;
            }
            self.counters.unknown.fetch_add(1, Ordering::Relaxed);
        } else if let Reason::Forged { .. } = a.reason {
            // Under `--enforce report`, once per process like any unknown one.
            if !kill && !self.reported.insert(a.pid) {
                return false;
            }
            self.counters.unknown.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.breaches.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(id) = &a.allocation {
            let why = match a.reason {
                Reason::Compute { .. } => EnforceReason::ComputeBypass,
                _ => EnforceReason::MemoryOverLimit,
            };
            self.arb.note_enforced(id, why);
        }
        if kill && let Some(id) = &a.allocation {
            // Before the signal: `tessera run` asks as soon as it sees its command gone.
            let reason = &a.reason;
            self.arb
                .record_kill(id, a.pid, |gpu, limit| describe(reason, gpu, limit));
        }
        let verdict = if kill {
            let done = self.held.get(&a.pid).is_some_and(|h| self.killer.kill(h));
            if done {
                self.counters.killed.fetch_add(1, Ordering::Relaxed);
                "killed"
            } else {
                "could not be killed"
            }
        } else {
            "reported"
        };
        let how = if a.unconnected {
            "never connected to the arbiter"
        } else {
            "connected"
        };
        match (&a.reason, &a.allocation) {
            (
                Reason::Memory {
                    used,
                    total,
                    allowed,
                },
                Some(id),
            ) => tracing::warn!(
                "backstop: pid {} of allocation {id} {verdict}: it held {}, its \
                 allocation's processes {}, allowed {} (limit plus \
                 tolerance); it {how}",
                a.pid,
                human(*used),
                human(*total),
                human(*allowed)
            ),
            (
                Reason::Compute {
                    gpu_ns,
                    unleased_ns,
                },
                Some(id),
            ) => tracing::warn!(
                "backstop: pid {} of allocation {id} {verdict}: its allocation used {} ms of \
                 GPU time outside its leases beyond its part of the GPU's slack (threshold {} ms \
                 for the GPU's allocations together), this process {} ms in the last {} ms; it \
                 {how}",
                a.pid,
                unleased_ns / 1_000_000,
                self.policy.compute_threshold.as_millis(),
                gpu_ns / 1_000_000,
                self.policy.interval.as_millis()
            ),
            (Reason::Forged { used }, _) => tracing::warn!(
                "backstop: container process {} {verdict}: it uses a GPU ({}), belongs to no \
                 allocation and shows an identity no Tessera plugin gave it (a file naming no \
                 allocation, not the plugin's file, or the plugin's mount covered); it {how}",
                a.pid,
                human(*used),
            ),
            (Reason::Unknown { container, used }, _) => tracing::warn!(
                "backstop: unknown {} process {} {verdict}: it uses a GPU ({}) and \
                 belongs to no allocation{}",
                if *container { "container" } else { "host" },
                a.pid,
                human(*used),
                if *container {
                    " (no Tessera identity in its container)"
                } else {
                    ""
                }
            ),
            (_, None) => {}
        }
        true
    }
}
