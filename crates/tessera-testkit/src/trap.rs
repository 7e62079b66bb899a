//! The pid-reuse trap of issue 20, for the tests that prove it closed: a tenant connection kept
//! open after the process that made it exited ([`set`]), and a way to start a process at that
//! pid once it is free ([`at_pid`]).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_protocol::{Hello, Role, frame};

use crate::process::KillOnDrop;

/// The trap builder, run with the system `python3` (standard library only).
const SCRIPT: &str = include_str!("trap.py");

/// A connection for an allocation whose connecting process is gone, held open by its parent.
#[derive(Debug)]
pub struct Trap {
    /// The pid of the process that connected and exited.
    pub pid: i32,
    /// Bytes of the arbiter's answer to the hello the child read (a `Welcome` frame).
    pub answer: usize,
    holder: KillOnDrop,
    stdin: ChildStdin,
}

/// Sets the trap: a child connects to `socket` with `token`, passes the connected socket to
/// its parent over `SCM_RIGHTS` and exits; the parent keeps it open. `cmd` is how to run
/// `python3` (e.g. with a tenant's environment); its arguments are added here.
pub fn set(mut cmd: Command, socket: &Path, token: &str) -> Trap {
    let hello = frame::encode(&Hello::new(Role::Tenant {
        token: token.to_owned(),
    }))
    .expect("a hello encodes");
    let hex: String = hello.iter().map(|b| format!("{b:02x}")).collect();
    let mut child = cmd
        .arg("-c")
        .arg(SCRIPT)
        .arg(socket)
        .arg(hex)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 is needed for the trap");
    let stdin = child.stdin.take().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // {"trap": PID, "answer": N}: two integers, read without a JSON parser.
    let nums: Vec<i64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(nums.len(), 2, "trap output: {line:?}");
    Trap {
        pid: nums[0] as i32,
        answer: nums[1] as usize,
        holder: KillOnDrop::new(child),
        stdin,
    }
}

impl Trap {
    /// Closes the held connection and waits for the holder to exit.
    pub fn release(mut self) {
        let _ = writeln!(self.stdin, "done");
        let _ = self.stdin.flush();
        let status = self.holder.wait().unwrap();
        assert!(status.success(), "trap holder: {status:?}");
    }
}

/// Starts what `start` makes (it returns the thing and the pid it runs at) until it runs at
/// `pid`, a pid that was handed out and freed; the misses are dropped (make them kill on drop).
/// As root the kernel is asked for the pid (`/proc/sys/kernel/ns_last_pid`, retried when
/// another process forks in between); otherwise processes are forked until the pid counter
/// wraps to just below it (a full wrap of `pid_max` takes a few seconds to a minute).
pub fn at_pid<T>(pid: i32, mut start: impl FnMut() -> (T, i32)) -> T {
    let ns_last = Path::new("/proc/sys/kernel/ns_last_pid");
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        assert!(Instant::now() < deadline, "pid {pid} never came back");
        if std::fs::write(ns_last, (pid - 1).to_string()).is_err() {
            loop {
                assert!(Instant::now() < deadline, "pid {pid} never came back");
                let mut c = Command::new("true").spawn().unwrap();
                let got = c.id() as i32;
                c.wait().unwrap();
                if (pid - 8..pid).contains(&got) {
                    break;
                }
            }
        }
        let (t, got) = start();
        if got == pid {
            return t;
        }
    }
}
