//! mem_share: how processes of one allocation share its memory limit, measured on the
//! simulated GPU.
//!
//! Starts the real `tessera-arbiter` on a simulated 80 GiB GPU (in a temp folder) and runs
//! `mem_tenant` processes under one `tessera run --memory` of 4 GiB plus room for the eight
//! processes' contexts (so they share one limit; contexts count against it, 300 MiB each), then
//! the same load without Tessera. Prints one table:
//! - hand-off: two processes take turns allocating 3 GiB (each allocation starts after the
//!   other's free returned; two do not fit): refusals must be 0;
//! - churn: 8 processes allocate a chunk and free it at once, chunks sized so 6 fit and 7 do
//!   not: refusals (target under 1%), grants per process (min..max, the spread);
//! - for each: the arbiter's ledger peak and the card's peak (the simulated GPU's own count of
//!   bytes allocated by all processes) against the limit, sampled every millisecond.
//!
//! Build and run: `cargo build --release --workspace && target/release/mem_share`
//! (`--seconds S` sets the churn length, default 10; `--rounds N` the hand-off's, default 1000).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tessera_benches::{SimNode, need};
use tessera_sim_state::clock::monotonic_ns;

const GIB: u64 = 1 << 30;
/// What each process's context takes out of the limit (the interposer's reservation, what the
/// simulated card charges).
const CONTEXT: u64 = 300 << 20;
/// 4 GiB to share, plus the contexts of the eight churning processes.
const LIMIT: u64 = 4 * GIB + 8 * CONTEXT;

struct Args {
    seconds: u64,
    rounds: u64,
}

fn parse_args() -> Args {
    let usage = "usage: mem_share [--seconds S] [--rounds N]";
    let mut a = Args {
        seconds: 10,
        rounds: 1000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().and_then(|v| v.parse::<u64>().ok());
        match (flag.as_str(), value) {
            ("--seconds", Some(v)) if v > 0 => a.seconds = v,
            ("--rounds", Some(v)) if v > 0 => a.rounds = v,
            _ => {
                eprintln!("mem_share: bad argument {flag}\n{usage}");
                std::process::exit(2);
            }
        }
    }
    a
}

/// What one scenario measured.
struct Outcome {
    grants: Vec<u64>,
    refusals: u64,
    ledger_peak: u64,
    card_peak: u64,
    wall: Duration,
}

struct Bench {
    node: SimNode,
    tessera: PathBuf,
    tenant: PathBuf,
    interposer: PathBuf,
}

impl Bench {
    /// Runs the shell script `script` (which starts `mem_tenant` processes as `$T`) under one
    /// `tessera run --memory LIMIT`, or bare when `tessera` is false; samples the ledger and the
    /// card until it ends; parses the JSON line of each process.
    fn run(&self, tessera: bool, script: &str) -> Outcome {
        let mut cmd = if tessera {
            let mut c = self.node.command(&self.tessera);
            c.args([
                "run",
                "--memory",
                &format!("{}MiB", LIMIT >> 20),
                "--interposer",
            ])
            .arg(&self.interposer)
            .arg("--");
            c
        } else {
            self.node.command(Path::new("/bin/sh"))
        };
        if tessera {
            cmd.arg("/bin/sh");
        }
        let mut child: Child = cmd
            .args(["-c", script])
            .env("T", &self.tenant)
            .env("D", self.node.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the tenants");
        let mut out = child.stdout.take().expect("piped");
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let mut admin = self.node.admin();
        let (mut ledger_peak, mut card_peak) = (0u64, 0u64);
        let t = Instant::now();
        loop {
            if let Some(st) = child.try_wait().expect("wait") {
                if !st.success() {
                    eprintln!("mem_share: the tenants failed ({st})");
                    std::process::exit(1);
                }
                break;
            }
            if tessera && let Ok(list) = admin.list() {
                ledger_peak = ledger_peak.max(list.iter().map(|a| a.memory_used).sum());
            }
            card_peak = card_peak
                .max(tessera_sim_state::device_memory_used(&self.node.sim_dir, 0).unwrap_or(0));
            std::thread::sleep(Duration::from_millis(1));
        }
        let wall = t.elapsed();
        let text = reader.join().expect("reader");
        let (mut grants, mut refusals) = (Vec::new(), 0);
        for line in text.lines().filter(|l| l.starts_with('{')) {
            grants.push(field(line, "grants"));
            refusals += field(line, "refusals");
        }
        Outcome {
            grants,
            refusals,
            ledger_peak,
            card_peak,
            wall,
        }
    }
}

/// The value of `"key":N` in a `mem_tenant` JSON line.
fn field(line: &str, key: &str) -> u64 {
    tessera_benches::tenant_field(line, key).unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / GIB as f64)
}

fn row(name: &str, o: &Outcome, tessera: bool) -> [String; 6] {
    let total = o.grants.iter().sum::<u64>() + o.refusals;
    let (min, max) = (
        o.grants.iter().min().copied().unwrap_or(0),
        o.grants.iter().max().copied().unwrap_or(0),
    );
    [
        name.to_owned(),
        format!("{total} in {:.1} s", o.wall.as_secs_f64()),
        format!(
            "{} ({:.3}%)",
            o.refusals,
            100.0 * o.refusals as f64 / total.max(1) as f64
        ),
        format!("{min}..{max}"),
        if tessera {
            gib(o.ledger_peak)
        } else {
            "-".into()
        },
        format!("{} (limit {})", gib(o.card_peak), gib(LIMIT)),
    ]
}

fn main() {
    let args = parse_args();
    let bench = Bench {
        tessera: need("mem_share", "tessera"),
        tenant: need("mem_share", "mem_tenant"),
        interposer: need("mem_share", "libtessera_interpose.so"),
        node: SimNode::start("mem_share", "1x80GiB"),
    };
    let handoff = format!(
        "mkfifo \"$D/ab\" \"$D/ba\" || exit 1; \
         \"$T\" handoff --first --rounds {r} --bytes {b} --in \"$D/ba\" --out \"$D/ab\" & \
         \"$T\" handoff --second --rounds {r} --bytes {b} --in \"$D/ab\" --out \"$D/ba\"; wait",
        r = args.rounds,
        b = 3 * GIB
    );
    // Six chunks fit under the limit, seven do not.
    let chunk = 4 * GIB * 2 / 13;
    let churn = |start: u64| {
        format!(
            "for i in 1 2 3 4 5 6 7 8; do \"$T\" churn --bytes {chunk} --seconds {s} --start-ns {start} & done; wait",
            s = args.seconds
        )
    };
    let mut rows = Vec::new();
    eprintln!("mem_share: hand-off, {} rounds each way ...", args.rounds);
    let o = bench.run(true, &handoff);
    rows.push(row("hand-off 2 x 3 GiB, Tessera", &o, true));
    let _ = std::fs::remove_file(bench.node.dir.path().join("ab"));
    let _ = std::fs::remove_file(bench.node.dir.path().join("ba"));
    eprintln!("mem_share: churn with Tessera, {} s ...", args.seconds);
    let o = bench.run(true, &churn(monotonic_ns() + 500_000_000));
    rows.push(row(
        &format!("churn 8 x {} MiB, Tessera", chunk >> 20),
        &o,
        true,
    ));
    eprintln!("mem_share: churn without Tessera, {} s ...", args.seconds);
    let o = bench.run(false, &churn(monotonic_ns() + 200_000_000));
    rows.push(row(
        &format!("churn 8 x {} MiB, no limit", chunk >> 20),
        &o,
        false,
    ));

    println!(
        "Tessera memory sharing between processes of one allocation: 4 GiB and their 8 contexts (simulated GPU)"
    );
    let head = [
        "scenario",
        "allocations",
        "refused",
        "grants/process",
        "ledger peak",
        "card peak",
    ];
    let widths: Vec<usize> = (0..6)
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain([head[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
    };
    println!("{}", line(&head.map(str::to_owned)));
    for r in &rows {
        println!("{}", line(r));
    }
}
