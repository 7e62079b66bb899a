//! Child processes that never outlive their test, exit codes, bounded waits.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::ops::{Deref, DerefMut};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
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

/// A child started by [`spawn_first_line`], once it has printed its first line.
#[derive(Debug)]
pub struct FirstLine {
    /// The child, killed and reaped when dropped.
    pub child: KillOnDrop,
    /// Its stdin, when the command piped it: dropping it closes the child's input.
    pub stdin: Option<ChildStdin>,
    /// The first line it printed, newline included (empty when it closed its output first).
    pub line: String,
}

/// Spawns `cmd` with its stdout piped and reads the first line the child prints (a child that
/// says it is ready, or reports what it did first). The child is killed on drop from the start,
/// so a test that fails while reading leaves no process behind. Its stdout is closed after that
/// line; stdin is as `cmd` set it (taken out when piped).
pub fn spawn_first_line(cmd: &mut Command) -> FirstLine {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().expect("stdout is piped");
    let child = KillOnDrop::new(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .unwrap_or_else(|e| panic!("reading the first line of {cmd:?}: {e}"));
    FirstLine { child, stdin, line }
}
