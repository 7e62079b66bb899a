//! pid_reuse: the backstop's kill against a reused pid, and what its pidfd holds cost.
//!
//! Each round starts process A (`sleep`), takes the backstop's hold on it
//! ([`tessera_arbiter::Held`], a pidfd) and then lets A die and be reaped, as a process
//! the backstop decided to kill may do between its poll and its kill. Process B is then started
//! on A's pid (`/proc/sys/kernel/ns_last_pid`, so root is needed), and A's kill is carried out:
//! once as the backstop did before (`kill(pid)`), once as it does now (through A's hold). Prints
//! how many rounds got the pid back and how many of those killed B each way, then what holds
//! cost: a new one (open, the liveness check, close) and one kept from an earlier poll (the
//! liveness check), medians of the rounds.
//!
//! Build and run: `cargo build --release -p tessera-benches && target/release/pid_reuse`
//! (`--rounds N`, default 200).

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use tessera_arbiter::{Killer, Sigkill};

fn sleeper() -> Child {
    Command::new("sleep").arg("60").spawn().expect("sleep runs")
}

/// Starts a process on `pid`, or `None` when another process took it first.
fn on_pid(pid: i32) -> Option<Child> {
    for _ in 0..20 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("writing /proc/sys/kernel/ns_last_pid needs root");
        let mut c = sleeper();
        if c.id() as i32 == pid {
            return Some(c);
        }
        let _ = c.kill();
        let _ = c.wait();
    }
    None
}

/// True when `c` was killed by a signal (it did not run its 60 s).
fn was_killed(c: &mut Child) -> bool {
    std::thread::sleep(Duration::from_millis(5));
    match c.try_wait().unwrap() {
        Some(_) => true,
        None => {
            let _ = c.kill();
            let _ = c.wait();
            false
        }
    }
}

fn main() {
    let mut rounds = 200usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rounds" => {
                rounds = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--rounds N")
            }
            other => {
                eprintln!("pid_reuse: unknown argument {other}");
                std::process::exit(2);
            }
        }
    }
    // (rounds that got the pid back, newcomers killed) per way: by pid, through the hold.
    let mut ways = [(0usize, 0usize); 2];
    let mut cost = Vec::with_capacity(rounds);
    let mut check = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        for (way, through_hold) in [(0, false), (1, true)] {
            let mut a = sleeper();
            let pid = a.id() as i32;
            // What a poll pays per process: open, check alive, close.
            let t = Instant::now();
            {
                let h = Sigkill.hold(pid).expect("a live process is held");
                assert!(!h.exited());
            }
            cost.push(t.elapsed());
            let held = Sigkill.hold(pid).expect("a live process is held");
            // What a poll pays for a process held since an earlier poll: the liveness check.
            let t = Instant::now();
            assert!(!held.exited());
            check.push(t.elapsed());
            a.kill().unwrap();
            a.wait().unwrap();
            let Some(mut b) = on_pid(pid) else { continue };
            ways[way].0 += 1;
            if through_hold {
                Sigkill.kill(&held);
            } else {
                // SAFETY: kill(2) has no memory preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            ways[way].1 += usize::from(was_killed(&mut b));
        }
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2)
            .copied()
            .unwrap_or_default()
            .as_secs_f64()
            * 1e6
    };
    let (open, live) = (median(&mut cost), median(&mut check));
    println!("pid_reuse: {rounds} rounds each way");
    println!(
        "| the kill of a process whose pid went to another | rounds with the pid reused | newcomer killed |"
    );
    println!("|---|---|---|");
    println!(
        "| by pid (the backstop before) | {} | {} |",
        ways[0].0, ways[0].1
    );
    println!(
        "| through the pidfd taken at the poll (now) | {} | {} |",
        ways[1].0, ways[1].1
    );
    println!(
        "a new hold (pidfd_open, liveness poll, close): median {open:.1} us over {} holds",
        cost.len()
    );
    println!(
        "a hold kept from an earlier poll (liveness poll): median {live:.2} us over {} checks",
        check.len()
    );
}
