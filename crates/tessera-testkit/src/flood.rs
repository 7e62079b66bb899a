//! A flood of unauthenticated connections against an arbiter socket, for the admission test and
//! the `arbiter_load` benchmark: idle ones, ones trickling a frame a byte at a time, and ones
//! holding an unfinished large frame or an unfinished hello.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Raises this process's open-file limit (a flood holds many sockets, and arbiters started
/// from here inherit it): to 65,536 where allowed, else the soft limit to the hard one.
/// Returns the soft limit (0 when it cannot be read).
pub fn raise_nofile() -> u64 {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `rl` is a valid rlimit to write into.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return 0;
    }
    let want: libc::rlim_t = 65_536;
    if rl.rlim_max < want {
        let up = libc::rlimit {
            rlim_cur: want,
            rlim_max: want,
        };
        // SAFETY: `up` is a valid rlimit; raising the hard limit needs CAP_SYS_RESOURCE and
        // simply fails without it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &up) } == 0 {
            return want;
        }
    }
    rl.rlim_cur = rl.rlim_max;
    // SAFETY: `rl` is a valid rlimit within the hard limit.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &rl) };
    rl.rlim_cur
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Connects and sends nothing.
    Idle,
    /// Sends one byte at a time.
    Trickle,
    /// Announces a 65,535-byte frame and sends most of it.
    BigFrame,
    /// Announces a frame just under the hello limit and never finishes it.
    SmallFrame,
}

/// What one flood did.
#[derive(Debug, Clone, Copy, Default)]
pub struct FloodCount {
    /// Connections opened.
    pub connects: u64,
    /// Connections the arbiter closed.
    pub closed: u64,
}

/// Keeps `n` unauthenticated connections of mixed kinds open against `socket` for `secs`,
/// reconnecting whatever the arbiter closes, at most `per_round` new connections every 10 ms
/// (paced, so a flood does not starve a small machine of the CPU the rest of the run needs).
pub fn flood(socket: &Path, n: usize, secs: f64, per_round: usize) -> FloodCount {
    flood_paced(socket, n, secs, per_round, Duration::from_millis(10))
}

/// As [`flood`], with `pause` between rounds (a hostile flooder reconnects as fast as it can).
pub fn flood_paced(
    socket: &Path,
    n: usize,
    secs: f64,
    per_round: usize,
    pause: Duration,
) -> FloodCount {
    raise_nofile();
    let kinds = [Kind::Idle, Kind::Trickle, Kind::BigFrame, Kind::SmallFrame];
    let mut conns: Vec<(Kind, Option<UnixStream>)> =
        (0..n).map(|i| (kinds[i % kinds.len()], None)).collect();
    let mut big = 65_535u32.to_le_bytes().to_vec();
    big.resize(4 + 65_000, 0xab);
    let mut small = 500u32.to_le_bytes().to_vec();
    small.resize(4 + 400, 0xcd);
    let mut count = FloodCount::default();
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut buf = [0u8; 256];
    while Instant::now() < deadline {
        let mut budget = per_round;
        for (kind, slot) in conns.iter_mut() {
            match slot {
                None if budget > 0 => {
                    budget -= 1;
                    let Ok(mut s) = UnixStream::connect(socket) else {
                        continue;
                    };
                    count.connects += 1;
                    s.set_nonblocking(true).expect("non-blocking flood socket");
                    let first: &[u8] = match kind {
                        Kind::Idle => &[],
                        // A 511-byte frame, whose payload then comes one byte per round.
                        Kind::Trickle => &[0xff, 0x01, 0, 0],
                        Kind::BigFrame => &big,
                        Kind::SmallFrame => &small,
                    };
                    let _ = s.write(first);
                    *slot = Some(s);
                }
                None => {}
                Some(s) => {
                    let gone = match s.read(&mut buf) {
                        Ok(0) => true,
                        Ok(_) => false,
                        Err(e) => e.kind() != ErrorKind::WouldBlock,
                    };
                    let gone = gone
                        || (*kind == Kind::Trickle
                            && matches!(s.write(&[0]), Err(e) if e.kind() != ErrorKind::WouldBlock));
                    if gone {
                        count.closed += 1;
                        *slot = None;
                    }
                }
            }
        }
        std::thread::sleep(pause);
    }
    count
}

/// The flood child binary's body (`tessera-flood SOCKET CONNECTIONS SECONDS [PAUSE_MS]`, see
/// [`spawn_child`]): keeps the connections coming for the given time and prints what the flood
/// did. A wrong argument is an error, so a child that cannot flood never passes for one that did.
pub fn child_main(args: &[String]) -> Result<FloodCount, String> {
    let [socket, n, secs, rest @ ..] = args else {
        return Err("usage: tessera-flood SOCKET CONNECTIONS SECONDS [PAUSE_MS]".into());
    };
    let num = |what: &str, v: &str| -> Result<f64, String> {
        v.parse::<f64>()
            .map_err(|e| format!("{what} {v:?}: {e}"))
            .and_then(|x| {
                if x.is_finite() && x >= 0.0 {
                    Ok(x)
                } else {
                    Err(format!("{what} {v:?} is not a count"))
                }
            })
    };
    let n = num("connections", n)? as usize;
    let secs = num("seconds", secs)?;
    let pause = match rest {
        [] => 10.0,
        [p] => num("pause", p)?,
        _ => return Err("too many arguments".into()),
    };
    let c = flood_paced(
        Path::new(socket),
        n,
        secs,
        150,
        Duration::from_millis(pause as u64),
    );
    println!("connects={} closed={}", c.connects, c.closed);
    Ok(c)
}

/// Starts a flood child (the `tessera-flood` binary: a process of its own, as a hostile
/// tenant's would be) keeping `n` connections open against `socket` for `secs`. Its stdout is
/// piped.
pub fn spawn_child(socket: &Path, n: usize, secs: f64) -> std::process::Child {
    spawn_child_paced(socket, n, secs, Duration::from_millis(10))
}

/// As [`spawn_child`], with `pause` between the flood's rounds.
pub fn spawn_child_paced(
    socket: &Path,
    n: usize,
    secs: f64,
    pause: Duration,
) -> std::process::Child {
    std::process::Command::new(crate::artifact("tessera-flood"))
        .arg(socket)
        .arg(n.to_string())
        .arg(secs.to_string())
        .arg(pause.as_millis().to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("flood child")
}
