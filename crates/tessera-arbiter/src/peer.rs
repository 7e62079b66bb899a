//! Naming a process so that a later process given the same pid cannot pass for it: its pid and
//! start time ([`ProcId`]), and for a tenant connection a pidfd of the very process that
//! connected ([`Peer`], from `SO_PEERPIDFD`). Used by admission (who connected), the state (who
//! holds what) and the backstop (who is whose).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use tokio::io::unix::AsyncFd;

/// One process, named so that another process given the same pid later cannot pass for it:
/// its pid and its start time (clock ticks after boot, field 22 of `/proc/<pid>/stat`; two
/// processes holding one pid in turn cannot share a start time unless the kernel recycles
/// the pid within one tick, a full pass over `pid_max` in 10 ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ProcId {
    /// Host pid (in the arbiter's pid namespace).
    pub pid: i32,
    /// Start time, clock ticks after boot.
    pub start: u64,
}

/// The start time of `pid`, clock ticks after boot, from `/proc/<pid>/stat` (field 22; the
/// protocol's parser, the one allocation owners are named with too).
pub(crate) fn proc_start(pid: i32) -> Option<u64> {
    tessera_protocol::process::start_time(std::path::Path::new("/proc"), pid)
}

/// `SO_PEERPIDFD` (Linux 6.5, `asm-generic/socket.h`; not in the `libc` crate yet).
const SO_PEERPIDFD: libc::c_int = 77;

/// The process behind a tenant connection: its [`ProcId`], and a pidfd of it kept for the
/// connection's lifetime where the kernel gives one. The pidfd says exactly whether that very
/// process still lives (a pid reused at once, within the tick of its start time, cannot fool
/// it); the start time still names it to the pure rules.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    /// Pid and start time.
    pub id: ProcId,
    pidfd: Option<Arc<OwnedFd>>,
}

impl Peer {
    /// A peer known by pid and start time alone (kernels without `SO_PEERPIDFD`, tests).
    pub(crate) fn without_pidfd(id: ProcId) -> Self {
        Self { id, pidfd: None }
    }

    /// False once the process exited (known only with a pidfd; without one, true, and the
    /// start time checked at every use decides).
    pub(crate) fn is_alive(&self) -> bool {
        self.pidfd.as_ref().is_none_or(|fd| pidfd_alive(fd))
    }

    /// True once the process has exited, a zombie not yet reaped included (its files, sockets
    /// and driver handles are closed): its pidfd is readable, or without one its pid is gone or
    /// names a later process. False while it runs, and when this kernel cannot tell.
    pub(crate) fn has_exited(&self) -> bool {
        match &self.pidfd {
            Some(fd) => Exit::readable(fd, 0),
            None => match Exit::of(self.id) {
                Exit::Gone => true,
                Exit::Pidfd(fd) => Exit::readable(&fd, 0),
                Exit::Unknown => false,
            },
        }
    }
}

/// True while the pidfd's process exists (a zombie, not yet reaped, still holds its pid).
fn pidfd_alive(fd: &OwnedFd) -> bool {
    // SAFETY: signal 0 only checks that the pidfd's process still exists; no memory is passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    rc == 0
}

/// The process behind a connected Unix socket whose `SO_PEERCRED` pid is `pid`, or `None`
/// when it exited already. The kernel's `SO_PEERPIDFD` names the very process that connected,
/// so the start time read from `/proc` is checked to be its: read while that process is still
/// alive (its pid cannot be reused before it is reaped). On kernels without `SO_PEERPIDFD` the
/// start time is read alone (a process that connects and exits at once, its pid reused before
/// this runs, could then be mistaken for the new process).
pub(crate) fn peer_process(socket: std::os::fd::BorrowedFd<'_>, pid: i32) -> Option<Peer> {
    if pid <= 0 {
        return None;
    }
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `fd`, an int, on an open socket.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 || fd < 0 {
        return proc_start(pid).map(|start| Peer::without_pidfd(ProcId { pid, start }));
    }
    // SAFETY: getsockopt returned a new pidfd that we own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
    let start = proc_start(pid)?;
    pidfd_alive(&pidfd).then(|| Peer {
        id: ProcId { pid, start },
        pidfd: Some(Arc::new(pidfd)),
    })
}

/// A connected process's end, to wait for after its connection closed.
#[derive(Debug)]
pub(crate) enum Exit {
    /// A pidfd of the very process (checked against its start time after it was opened): it
    /// becomes readable when the process exited, its files (sockets, driver handles) closed.
    Pidfd(OwnedFd),
    /// The process exited already (its pid is gone, or names a later process).
    Gone,
    /// This kernel cannot tell (no `pidfd_open`): the caller asks the card alone.
    Unknown,
}

impl Exit {
    /// The end of process `id`. The pidfd is opened on the pid first and the start time read
    /// after: if it still matches, the pidfd's process is the one that connected (its pid
    /// could not have been reused while it was alive or a zombie).
    pub(crate) fn of(id: ProcId) -> Self {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, id.pid, 0) };
        if fd < 0 {
            return match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::ESRCH) => Exit::Gone,
                _ => Exit::Unknown,
            };
        }
        // SAFETY: pidfd_open returned a new descriptor that we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        if proc_start(id.pid) == Some(id.start) {
            Exit::Pidfd(fd)
        } else {
            Exit::Gone
        }
    }

    /// Waits up to `timeout` for the process to exit; true once it has (at once when gone or
    /// unknown).
    pub(crate) fn wait(&self, timeout: std::time::Duration) -> bool {
        let Exit::Pidfd(fd) = self else {
            return true;
        };
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        Self::readable(fd, ms)
    }

    /// Returns once the process has exited (at once when it is gone or this kernel cannot
    /// tell), without holding a thread: the pidfd is polled by tokio's reactor.
    pub(crate) async fn exited(self) {
        let Exit::Pidfd(fd) = self else {
            return;
        };
        // SAFETY: the AsyncFd takes the OwnedFd itself, so the descriptor stays open and names
        // the same pidfd until the AsyncFd is dropped.
        let registered =
            unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) };
        if let Ok(fd) = registered {
            // A pidfd reads as readable once its process has exited; an error ends the wait too
            // (the reaper's tick is the fallback).
            let _ = fd.readable().await;
        }
    }

    /// Whether pidfd `fd` becomes readable (its process exited) within `ms` milliseconds.
    fn readable(fd: &OwnedFd, ms: libc::c_int) -> bool {
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one valid pollfd on a descriptor the caller owns.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        // An error (EINTR) reads as "not yet": the caller asks again until its deadline.
        rc > 0
    }
}

/// A child process that sleeps until killed, and its [`ProcId`], for tests of what happens
/// when a process exits.
#[cfg(test)]
pub(crate) fn test_child() -> (std::process::Child, ProcId) {
    let child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let id = ProcId {
        pid,
        start: proc_start(pid).unwrap(),
    };
    (child, id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connected_peer_is_named_by_pid_and_start_time_while_it_lives() {
        use std::os::fd::AsFd;
        let (here, there) = std::os::unix::net::UnixStream::pair().unwrap();
        let me = std::process::id() as i32;
        let got = peer_process(here.as_fd(), me).expect("our own process is alive");
        assert_eq!(
            got.id,
            ProcId {
                pid: me,
                start: proc_start(me).unwrap()
            }
        );
        assert!(got.is_alive());
        assert!(peer_process(here.as_fd(), 0).is_none());
        drop(there);
    }

    #[test]
    fn the_exit_of_a_child_is_seen_when_it_ends_and_not_before() {
        let (mut child, id) = test_child();
        let exit = Exit::of(id);
        assert!(matches!(exit, Exit::Pidfd(_)), "{exit:?}");
        assert!(!exit.wait(std::time::Duration::from_millis(1)));
        child.kill().unwrap();
        // A zombie has exited: its files are closed.
        assert!(exit.wait(std::time::Duration::from_secs(10)));
        child.wait().unwrap();
        // Reaped: gone. A start time that is not the process's: a later holder of the pid.
        assert!(matches!(Exit::of(id), Exit::Gone));
        let me = std::process::id() as i32;
        let other = ProcId {
            pid: me,
            start: proc_start(me).unwrap() + 1,
        };
        assert!(matches!(Exit::of(other), Exit::Gone));
    }
}
