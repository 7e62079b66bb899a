//! Child processes that never outlive their test, exit codes, bounded waits.

#![forbid(unsafe_code)]

use std::ops::{Deref, DerefMut};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// A child killed (and reaped) when dropped, so a failing test leaves no process behind.
#[derive(Debug)]
pub struct KillOnDrop(Option<Child>);

impl KillOnDrop {
    pub fn new(child: Child) -> Self {
        Self(Some(child))
    }

    /// SIGKILLs and reaps the child now; nothing happens if that was done already.
    pub fn kill_and_reap(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the child is still held (not killed or taken out yet).
    pub fn is_held(&self) -> bool {
        self.0.is_some()
    }

    /// Takes the child out without killing it (e.g. once it has exited and been reaped).
    pub fn take(&mut self) -> Option<Child> {
        self.0.take()
    }
}

impl Deref for KillOnDrop {
    type Target = Child;
    fn deref(&self) -> &Child {
        self.0.as_ref().expect("child already killed")
    }
}

impl DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().expect("child already killed")
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        self.kill_and_reap();
    }
}

/// Exit code of a status, or 128 + signal (as a shell reports it).
pub fn code(s: ExitStatus) -> i32 {
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}

/// Polls `f` until it returns true or `timeout` passes; returns how long it took.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    None
}

/// Waits up to `timeout` for `child` to exit.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let mut status = None;
    wait_until(timeout, || {
        status = child.try_wait().expect("try_wait on our own child");
        status.is_some()
    });
    status
}
