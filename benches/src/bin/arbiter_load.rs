//! arbiter_load: the arbiter under many tenants and under a connection flood.
//!
//! Starts the real `tessera-arbiter` on a simulated 80 GiB GPU and measures:
//! 1. 1, 100 and 1,000 concurrent honest tenants (one thread and one tenant connection each):
//!    Reserve + one-way Release pairs and lease round trips (LeaseAcquire -> LeaseGranted,
//!    then a one-way LeaseRelease): p50/p99 latency, the arbiter's peak RSS and threads.
//! 2. 10,000 idle authenticated connections: the arbiter's RSS per connection, and a
//!    Reserve round trip among them; then 1,000 admitted connections each holding an unfinished
//!    frame just under the tenant frame limit (the worst an admitted connection can buffer).
//! 3. The flood: two child processes keep tens of thousands of unauthenticated connections
//!    coming (idle, trickling one byte at a time, unfinished 64 KiB frames, unfinished hellos)
//!    for 20 s against the default caps, while an honest tenant keeps reserving and a new
//!    tenant connects every 2 s: the arbiter's peak RSS and threads, whether it lived, the honest
//!    pairs that succeeded, and how long a new tenant took to be admitted.
//!
//! 4. A flood per cap: for each admission cap, the flood that fills it (token-less handshakes
//!    from one process, from one container, from one container past a raised per-container cap;
//!    admitted connections from one allocation, from four), and what an honest tenant saw
//!    meanwhile: a new tenant's admission (connect + first Reserve, five times), and a
//!    `compute_tenant` started under `tessera run` during the flood (kernels run, killed or
//!    not). `--caps-only` runs just this part.
//!
//! Build and run: `cargo build --release -p tessera-benches -p tessera-arbiter -p tessera-cli
//! -p tessera-interpose && target/release/arbiter_load` (`--scale F` multiplies every count and
//! the flood's length, e.g. 0.1 for a quick look).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tessera_benches::{SimNode, exit_with_parent, number_flag};
use tessera_protocol::client::{ClientError, TenantClient};
use tessera_protocol::{CreateAllocation, GpuSelector, TenantReply, TenantRequest};
use tessera_testkit::flood::raise_nofile;

const WHO: &str = "arbiter_load";
const MIB: u64 = 1 << 20;

fn status_field(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    status_field(pid, "VmRSS:")
}

fn threads(pid: u32) -> u64 {
    status_field(pid, "Threads:")
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

fn create(node: &SimNode, limit: u64) -> String {
    node.admin()
        .create(CreateAllocation {
            gpu: GpuSelector::Index(0),
            memory_limit: limit,
            share: 10,
            cap: None,
            labels: Default::default(),
        })
        .expect("create")
        .0
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

/// Samples the arbiter's RSS and threads every 20 ms until `stop`; returns the peaks.
fn sampler(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(u64, u64)> {
    std::thread::spawn(move || {
        let (mut rss, mut thr) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            rss = rss.max(rss_kib(pid));
            thr = thr.max(threads(pid));
            std::thread::sleep(Duration::from_millis(20));
        }
        (rss, thr)
    })
}

struct Honest {
    tenants: usize,
    reserve: Vec<Duration>,
    lease: Vec<Duration>,
    rss_kib: u64,
    threads: u64,
    secs: f64,
}

/// `n` tenants, each doing `pairs` Reserve/Release pairs, then `leases` lease round trips.
fn honest(n: usize, pairs: usize, leases: usize) -> Honest {
    let node = SimNode::start(WHO, "1x80GiB");
    let pid = node.arbiter_pid();
    let token = create(&node, 64 << 30);
    let stop = Arc::new(AtomicBool::new(false));
    let peaks = sampler(pid, Arc::clone(&stop));
    let barrier = Arc::new(Barrier::new(n));
    let started = Instant::now();
    let workers: Vec<_> = (0..n)
        .map(|_| {
            let (socket, token, barrier) =
                (node.socket.clone(), token.clone(), Arc::clone(&barrier));
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || {
                    // Connections over the per-pid cap on pending handshakes are closed at once:
                    // retry, as the interposer does.
                    let mut t = loop {
                        match TenantClient::connect(&socket, &token) {
                            Ok(t) => break t,
                            Err(ClientError::Refused { reason, .. }) => panic!("refused: {reason}"),
                            Err(_) => std::thread::sleep(Duration::from_millis(5)),
                        }
                    };
                    barrier.wait();
                    let mut reserve = Vec::with_capacity(pairs);
                    for _ in 0..pairs {
                        let t0 = Instant::now();
                        match t
                            .call(&TenantRequest::Reserve { bytes: MIB })
                            .expect("reserve")
                        {
                            TenantReply::Reserved { .. } => {}
                            other => panic!("{other:?}"),
                        }
                        t.send(&TenantRequest::Release { bytes: MIB })
                            .expect("release");
                        reserve.push(t0.elapsed());
                    }
                    barrier.wait();
                    let mut lease = Vec::with_capacity(leases);
                    for _ in 0..leases {
                        let t0 = Instant::now();
                        let lease_id = match t.call(&TenantRequest::LeaseAcquire).expect("lease") {
                            TenantReply::LeaseGranted { lease_id, .. } => lease_id,
                            other => panic!("{other:?}"),
                        };
                        t.send(&TenantRequest::LeaseRelease {
                            lease_id,
                            busy_ns: 0,
                            early: true,
                        })
                        .expect("lease release");
                        lease.push(t0.elapsed());
                    }
                    (reserve, lease)
                })
                .expect("thread")
        })
        .collect();
    let (mut reserve, mut lease) = (Vec::new(), Vec::new());
    for w in workers {
        let (r, l) = w.join().expect("tenant thread");
        reserve.extend(r);
        lease.extend(l);
    }
    let secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let (rss_kib, threads) = peaks.join().unwrap();
    reserve.sort();
    lease.sort();
    Honest {
        tenants: n,
        reserve,
        lease,
        rss_kib,
        threads,
        secs,
    }
}

/// Connects `n` tenants and keeps them; optionally each sends an unfinished frame of `partial`
/// bytes (header included). Returns (RSS before, RSS after, threads after, connections, a
/// Reserve round trip p50 among them).
fn idle(node: &SimNode, token: &str, n: usize, partial: usize) -> (u64, u64, u64, Duration) {
    let pid = node.arbiter_pid();
    std::thread::sleep(Duration::from_millis(300));
    let before = rss_kib(pid);
    let mut frame = ((partial.saturating_sub(4)) as u32 + 1)
        .to_le_bytes()
        .to_vec();
    frame.resize(partial, 0);
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let t = loop {
            match TenantClient::connect(&node.socket, token) {
                Ok(t) => break t,
                Err(e) => {
                    eprintln!("{WHO}: connection {i}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        if partial > 0 {
            t.stream().write_all(&frame).expect("partial frame");
        }
        held.push(t);
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_kib(pid);
    let thr = threads(pid);
    let mut probe = TenantClient::connect(&node.socket, token).expect("probe");
    let mut lat: Vec<Duration> = (0..2000)
        .map(|_| {
            let t0 = Instant::now();
            probe
                .call(&TenantRequest::Reserve { bytes: MIB })
                .expect("reserve");
            probe
                .send(&TenantRequest::Release { bytes: MIB })
                .expect("release");
            t0.elapsed()
        })
        .collect();
    lat.sort();
    drop(held);
    (before, after, thr, percentile(&lat, 0.5))
}

struct Flood {
    connects: u64,
    rss_kib: u64,
    threads: u64,
    lived: bool,
    pairs_ok: u64,
    pairs_failed: u64,
    pair_p99: Duration,
    pair_max: Duration,
    admissions: Vec<Duration>,
    admissions_failed: usize,
}

fn flood(per_child: usize, secs: f64) -> Flood {
    let node = SimNode::start(WHO, "1x80GiB");
    let pid = node.arbiter_pid();
    let token = create(&node, 64 << 30);
    let mut honest = TenantClient::connect(&node.socket, &token).expect("honest tenant");
    let _ = honest
        .stream()
        .set_read_timeout(Some(Duration::from_secs(5)));
    let stop = Arc::new(AtomicBool::new(false));
    let peaks = sampler(pid, Arc::clone(&stop));
    let exe = std::env::current_exe().expect("current_exe");
    let children: Vec<_> = (0..2)
        .map(|_| {
            let mut cmd = Command::new(&exe);
            exit_with_parent(&mut cmd);
            cmd.arg("--flood-child")
                .arg(&node.socket)
                .arg(per_child.to_string())
                .arg(secs.to_string())
                .stdout(Stdio::piped())
                .spawn()
                .expect("flood child")
        })
        .collect();
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    // A new tenant every 2 s, retried until admitted (at most 10 s).
    let newcomers = {
        let (socket, token, stop) = (node.socket.clone(), token.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let (mut took, mut gave_up) = (Vec::new(), 0);
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(2));
                let t0 = Instant::now();
                loop {
                    match TenantClient::connect(&socket, &token) {
                        Ok(mut t) => {
                            if t.call(&TenantRequest::Ping).is_ok() {
                                took.push(t0.elapsed());
                            } else {
                                gave_up += 1;
                            }
                            break;
                        }
                        Err(ClientError::Refused { .. } | ClientError::Frame(_))
                            if t0.elapsed() < Duration::from_secs(10) =>
                        {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                        Err(_) => {
                            gave_up += 1;
                            break;
                        }
                    }
                }
            }
            (took, gave_up)
        })
    };
    let started = Instant::now();
    let mut pairs = Vec::new();
    while started.elapsed() < Duration::from_secs_f64(secs) {
        let t0 = Instant::now();
        let r = honest
            .call(&TenantRequest::Reserve { bytes: MIB })
            .and_then(|_| honest.send(&TenantRequest::Release { bytes: MIB }));
        match r {
            Ok(()) => {
                ok.fetch_add(1, Ordering::Relaxed);
                pairs.push(t0.elapsed());
            }
            Err(_) => {
                failed.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut connects = 0;
    for c in children {
        let out = c.wait_with_output().expect("flood child");
        let text = String::from_utf8_lossy(&out.stdout);
        connects += text
            .split("connects=")
            .nth(1)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    stop.store(true, Ordering::Relaxed);
    let (admissions, admissions_failed) = newcomers.join().unwrap();
    let (rss_kib, threads) = peaks.join().unwrap();
    let lived = alive(pid) && node.admin().list().is_ok();
    pairs.sort();
    Flood {
        connects,
        rss_kib,
        threads,
        lived,
        pairs_ok: ok.load(Ordering::Relaxed),
        pairs_failed: failed.load(Ordering::Relaxed),
        pair_p99: percentile(&pairs, 0.99),
        pair_max: pairs.last().copied().unwrap_or_default(),
        admissions,
        admissions_failed,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--flood-child") {
        let socket = PathBuf::from(&args[2]);
        let pause = args.get(5).and_then(|v| v.parse().ok()).unwrap_or(10);
        let c = tessera_testkit::flood::flood_paced(
            &socket,
            args[3].parse().expect("count"),
            args[4].parse().expect("seconds"),
            400,
            Duration::from_millis(pause),
        );
        println!("connects={}", c.connects);
        return;
    }
    if args.iter().any(|a| a == "--caps-only") {
        raise_nofile();
        cap_floods();
        return;
    }
    let scale = number_flag(WHO, "--scale", 1.0);
    let count = |n: f64| ((n * scale).round() as usize).max(1);
    let nofile = raise_nofile();
    println!("arbiter_load (scale {scale}; open files {nofile})");

    println!();
    println!("honest tenants: Reserve+Release pairs and lease round trips");
    println!(
        "{:>8} {:>8} {:>12} {:>12} {:>8} {:>12} {:>12} {:>10} {:>8} {:>7}",
        "tenants",
        "pairs",
        "pair p50 us",
        "pair p99 us",
        "leases",
        "lease p50 us",
        "lease p99 us",
        "RSS MiB",
        "threads",
        "secs"
    );
    for n in [1, 100, 1000] {
        let n = count(n as f64).min(1000);
        let pairs = (20_000 / n).max(20);
        let leases = (5_000 / n).max(5);
        let h = honest(n, pairs, leases);
        println!(
            "{:>8} {:>8} {:>12} {:>12} {:>8} {:>12} {:>12} {:>10.1} {:>8} {:>7.1}",
            h.tenants,
            h.reserve.len(),
            us(percentile(&h.reserve, 0.5)),
            us(percentile(&h.reserve, 0.99)),
            h.lease.len(),
            us(percentile(&h.lease, 0.5)),
            us(percentile(&h.lease, 0.99)),
            h.rss_kib as f64 / 1024.0,
            h.threads,
            h.secs
        );
    }

    println!();
    println!("admitted connections: arbiter RSS per connection");
    println!(
        "{:>12} {:>26} {:>12} {:>12} {:>12} {:>8} {:>16}",
        "connections",
        "each holding",
        "RSS before",
        "RSS after",
        "KiB/conn",
        "threads",
        "pair p50 us"
    );
    // Each admitted connection costs the arbiter two descriptors (it inherits this limit).
    let fit = (nofile.saturating_sub(1600) / 2) as usize;
    let idle_n = count(10_000.0).min(fit);
    if idle_n < count(10_000.0) {
        println!("(idle connections scaled down to {idle_n}: open files limited to {nofile})");
    }
    for (n, partial, what) in [
        (idle_n, 0, "nothing"),
        (count(1000.0), 4 + 1023, "an unfinished 1 KiB frame"),
    ] {
        // A fresh arbiter per row: freed thread stacks and heap are kept for reuse.
        let node = SimNode::start_with(
            WHO,
            "1x80GiB",
            &[
                "--max-tenant-connections",
                "12000",
                "--max-connections-per-allocation",
                "12000",
            ],
        );
        let token = create(&node, 64 << 30);
        let (before, after, thr, p50) = idle(&node, &token, n, partial);
        println!(
            "{:>12} {:>26} {:>8.1} MiB {:>8.1} MiB {:>12.1} {:>8} {:>16}",
            n,
            what,
            before as f64 / 1024.0,
            after as f64 / 1024.0,
            after.saturating_sub(before) as f64 / n as f64,
            thr,
            us(p50)
        );
    }

    println!();
    let per_child = count(15_000.0);
    let secs = 20.0 * scale.min(1.0);
    println!(
        "flood: 2 processes x {per_child} unauthenticated connections kept coming for {secs} s \
         (default caps)"
    );
    let f = flood(per_child, secs);
    let mut adm = f.admissions.clone();
    adm.sort();
    println!(
        "{:>12} {:>12} {:>8} {:>6} {:>10} {:>10} {:>12} {:>12} {:>18} {:>14}",
        "connections",
        "peak RSS",
        "threads",
        "lived",
        "pairs ok",
        "failed",
        "pair p99 us",
        "pair max us",
        "admitted (n/fail)",
        "admission max"
    );
    println!(
        "{:>12} {:>8.1} MiB {:>8} {:>6} {:>10} {:>10} {:>12} {:>12} {:>18} {:>11.1} ms",
        f.connects,
        f.rss_kib as f64 / 1024.0,
        f.threads,
        if f.lived { "yes" } else { "NO" },
        f.pairs_ok,
        f.pairs_failed,
        us(f.pair_p99),
        us(f.pair_max),
        format!("{}/{}", adm.len(), f.admissions_failed),
        adm.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    );

    cap_floods();
}

/// One flood of the per-cap table.
struct CapFlood {
    /// The cap it fills.
    cap: &'static str,
    /// What floods.
    what: &'static str,
    /// Extra arbiter arguments.
    args: &'static [&'static str],
    /// Token-less flood: processes x connections each (0: none).
    processes: usize,
    per_process: usize,
    /// Admitted flood: allocations x connections each (0: none).
    allocations: usize,
    per_allocation: usize,
}

/// What an honest tenant saw during one flood.
struct CapSeen {
    held: usize,
    admissions: Vec<Duration>,
    admission_failures: usize,
    launches: u64,
    killed: bool,
    exit: String,
}

fn flood_children(
    node: &SimNode,
    processes: usize,
    n: usize,
    secs: f64,
) -> Vec<std::process::Child> {
    let exe = std::env::current_exe().expect("current_exe");
    (0..processes)
        .map(|_| {
            let mut cmd = Command::new(&exe);
            exit_with_parent(&mut cmd);
            cmd.arg("--flood-child")
                .arg(&node.socket)
                .arg(n.to_string())
                .arg(secs.to_string())
                .arg("1")
                .stdout(Stdio::null())
                .spawn()
                .expect("flood child")
        })
        .collect()
}

/// A new tenant's admission: connect (retried while closed or refused, up to 5 s) and its first
/// Reserve answered.
fn admission(socket: &std::path::Path, token: &str) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if let Ok(mut t) = TenantClient::connect(socket, token)
            && matches!(
                t.call(&TenantRequest::Reserve { bytes: MIB }),
                Ok(TenantReply::Reserved { .. })
            )
        {
            return Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

fn cap_flood(f: &CapFlood) -> CapSeen {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    let node = SimNode::start_with(WHO, "1x80GiB", f.args);
    let honest = create(&node, 8 << 30);
    let children = flood_children(&node, f.processes, f.per_process, 8.0);
    let mut held = Vec::new();
    for _ in 0..f.allocations {
        let token = create(&node, 1 << 30);
        for _ in 0..f.per_allocation {
            match TenantClient::connect(&node.socket, &token) {
                Ok(c) => held.push(c),
                Err(_) => break,
            }
        }
    }
    // Let the token-less flood reach its cap.
    std::thread::sleep(Duration::from_millis(1500));
    let need = |name| tessera_benches::need(WHO, name);
    let mut tenant = node.command(&need("tessera"));
    tenant
        .args(["run", "--memory", "1GiB", "--share", "50", "--interposer"])
        .arg(need("libtessera_interpose.so"))
        .arg("--")
        .arg(need("compute_tenant"))
        .args(["--kernel-us", "1000", "--seconds", "3"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    exit_with_parent(&mut tenant);
    let mut tenant = tenant.spawn().expect("compute tenant");
    let out = tenant.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        std::io::BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("launches ").and_then(|n| n.parse().ok()))
            .unwrap_or(0u64)
    });
    let mut admissions = Vec::new();
    let mut admission_failures = 0;
    for _ in 0..5 {
        match admission(&node.socket, &honest) {
            Some(d) => admissions.push(d),
            None => admission_failures += 1,
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let status = tenant.wait().expect("compute tenant");
    let launches = reader.join().unwrap_or(0);
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    admissions.sort();
    CapSeen {
        held: held.len(),
        admissions,
        admission_failures,
        launches,
        killed: status.signal() == Some(libc::SIGKILL),
        exit: match (status.code(), status.signal()) {
            (Some(c), _) => c.to_string(),
            (None, Some(s)) => format!("signal {s}"),
            _ => "?".into(),
        },
    }
}

fn cap_floods() {
    let floods = [
        CapFlood {
            cap: "pending per pid (32)",
            what: "1 process x 64 token-less",
            args: &[],
            processes: 1,
            per_process: 64,
            allocations: 0,
            per_allocation: 0,
        },
        CapFlood {
            cap: "pending per container (128)",
            what: "6 processes x 32 token-less",
            args: &[],
            processes: 6,
            per_process: 32,
            allocations: 0,
            per_allocation: 0,
        },
        CapFlood {
            cap: "pending in total (256)",
            what: "12 processes x 32 token-less",
            args: &["--max-pending-per-container", "1000"],
            processes: 12,
            per_process: 32,
            allocations: 0,
            per_allocation: 0,
        },
        CapFlood {
            cap: "admitted per allocation (1024)",
            what: "1 allocation x 1100 admitted",
            args: &[],
            processes: 0,
            per_process: 0,
            allocations: 1,
            per_allocation: 1100,
        },
        CapFlood {
            cap: "admitted in total (4096)",
            what: "4 allocations x 1100 admitted",
            args: &[],
            processes: 0,
            per_process: 0,
            allocations: 4,
            per_allocation: 1100,
        },
    ];
    println!();
    println!(
        "a flood per cap (token-less floods reconnect every 1 ms); meanwhile a new tenant is \
         admitted 5 times and a compute_tenant under `tessera run` runs 1 ms kernels for 3 s"
    );
    println!(
        "{:<32} {:<32} {:>8} {:>13} {:>14} {:>10} {:>7} {:>6}",
        "cap", "flood", "admitted", "admission p50", "admission max", "kernels", "killed", "exit"
    );
    for f in &floods {
        let s = cap_flood(f);
        let ms = |d: Option<&Duration>| {
            d.map_or("-".to_owned(), |d| {
                format!("{:.1} ms", d.as_secs_f64() * 1e3)
            })
        };
        println!(
            "{:<32} {:<32} {:>8} {:>13} {:>14} {:>10} {:>7} {:>6}",
            f.cap,
            f.what,
            format!(
                "{}/{}",
                s.admissions.len(),
                s.admissions.len() + s.admission_failures
            ),
            ms(s.admissions.get(s.admissions.len() / 2)),
            ms(s.admissions.last()),
            s.launches,
            if s.killed { "YES" } else { "no" },
            s.exit,
        );
        if s.held > 0 {
            println!(
                "{:<32} (the flood held {} admitted connections)",
                "", s.held
            );
        }
    }
}
