//! Memory rows: how soon a SIGKILLed tenant's memory is free again, and how many allocations
//! eight processes hammering one allocation's limit get.
//!
//! - Reclaim after SIGKILL: a client holds 600 MiB (and its context) and is SIGKILLed. No
//!   control: kill to the simulated card's own count back at 0 (its files closed). Tessera: the
//!   same client under the interposer with an allocation's token, kill to the arbiter's ledger
//!   at 0 for the allocation, which comes only once the card has let the memory go (the
//!   drain's rule, `crates/tessera-arbiter/src/drain.rs`): from then on another tenant gets it.
//!   Both sides poll with no sleep; the kills alternate between the two, `KILLS` per repeat,
//!   and a repeat is the median of its kills.
//! - Hammer: eight `mem_tenant churn` processes allocate a chunk and free it at once for
//!   `HAMMER_SECONDS`, chunks sized so six fit under the limit and seven do not (`mem_share`'s
//!   churn). No control: bare, the 80 GiB card as the only limit. Tessera: the eight under one
//!   `tessera run --memory` of 4 GiB plus their contexts. The two alternate, one run each per
//!   repeat; the card is sampled every millisecond in both (the sample takes the card's lock),
//!   and in the Tessera runs a sample above the
//!   limit is an over-limit event (there must be none).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tessera_benches::{SimNode, need, tenant_field};
use tessera_protocol::CreateAllocation;
use tessera_protocol::node::{ENV_SOCKET, ENV_TOKEN};
use tessera_sim_state::clock::monotonic_ns;

use crate::{Args, Row, median_range};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// What one context costs on the simulated card (the node's `MODELED_CONTEXT_MEMORY`).
const CONTEXT: u64 = 300 * MIB;
/// What the killed client holds besides its context.
const HELD: u64 = 600 * MIB;
/// Kills per variant in one repeat.
const KILLS: usize = 7;
/// Reclaim target, ms (issue 36: at or under 1 ms here; it was 1.87, HAMi-core's 0.98).
const RECLAIM_TARGET_MS: f64 = 1.0;
/// Length of one hammer run.
const HAMMER_SECONDS: u64 = 10;
/// The hammer's processes.
const HAMMERS: u64 = 8;
/// The hammer's shared limit: 4 GiB and the contexts of its processes.
const HAMMER_LIMIT: u64 = 4 * GIB + HAMMERS * CONTEXT;
/// Hammer target: Tessera's count at least this part of no control's.
const HAMMER_TARGET: f64 = 0.9;
/// Longest wait for a figure that should come within milliseconds (a hang is a failure).
const STUCK: Duration = Duration::from_secs(10);

struct Bed {
    node: SimNode,
    client: PathBuf,
    tessera: PathBuf,
    interposer: PathBuf,
    token: String,
    id: String,
}

impl Bed {
    fn start() -> Self {
        let node = SimNode::start("speed", "1x80GiB");
        let (token, id) = node
            .admin()
            .create(CreateAllocation {
                gpu: tessera_protocol::GpuSelector::Index(0),
                memory_limit: 2 * GIB,
                share: 10,
                cap: None,
                labels: Default::default(),
            })
            .unwrap_or_else(|e| {
                eprintln!("speed: cannot create the reclaim allocation: {e}");
                std::process::exit(1);
            });
        Self {
            client: need("speed", "mem_tenant"),
            tessera: need("speed", "tessera"),
            interposer: need("speed", "libtessera_interpose.so"),
            node,
            token,
            id: id.id,
        }
    }

    /// The client that allocates [`HELD`] and holds it, bare or under the interposer.
    fn holder(&self, tessera: bool) -> Child {
        let mut c = self.node.command(&self.client);
        c.args(["hold", "--bytes", &HELD.to_string(), "--seconds", "60"]);
        if tessera {
            c.env("LD_PRELOAD", &self.interposer)
                .env(ENV_TOKEN, &self.token)
                .env(ENV_SOCKET, &self.node.socket);
        }
        c.stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start the holder")
    }

    /// The card's bytes in use (the simulated GPU's own count).
    fn card(&self) -> u64 {
        tessera_sim_state::device_memory_used(&self.node.sim_dir, 0).unwrap_or(u64::MAX)
    }

    /// The arbiter's bytes in use for the reclaim allocation.
    fn ledger(&self, admin: &mut tessera_protocol::client::AdminClient) -> u64 {
        admin
            .list()
            .ok()
            .and_then(|l| l.into_iter().find(|a| a.id == self.id))
            .map_or(u64::MAX, |a| a.memory_used)
    }

    /// One kill: the holder started, holding exactly its bytes (its credit given back), then
    /// SIGKILLed; ms from the kill to `free` reading 0.
    fn reclaim(&self, tessera: bool) -> f64 {
        let mut admin = self.node.admin();
        let mut child = self.holder(tessera);
        let held = HELD + CONTEXT;
        let ready = |admin: &mut tessera_protocol::client::AdminClient| {
            self.card() == held && (!tessera || self.ledger(admin) == held)
        };
        if !within(|| ready(&mut admin)) {
            let ledger = self.ledger(&mut admin);
            fail(&format!(
                "the holder to hold its memory (card {}, ledger {ledger}, want {held})",
                self.card()
            ));
        }
        child.kill().expect("SIGKILL the holder");
        let t = Instant::now();
        if tessera {
            until(|| self.ledger(&mut admin) == 0, "the ledger to let go");
        } else {
            until(|| self.card() == 0, "the card to let go");
        }
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let _ = child.wait();
        // The next kill starts from an empty card and ledger.
        until(
            || self.card() == 0 && self.ledger(&mut admin) == 0,
            "an empty card",
        );
        ms
    }

    /// One hammer run: the count of allocations granted, and (Tessera) the card samples above
    /// the limit.
    fn hammer(&self, tessera: bool) -> (u64, u64) {
        let chunk = 4 * GIB * 2 / 13;
        let start = monotonic_ns() + 300_000_000;
        let script = format!(
            "for i in $(seq {HAMMERS}); do \"$T\" churn --bytes {chunk} --seconds {HAMMER_SECONDS} --start-ns {start} & done; wait"
        );
        let mut cmd = if tessera {
            let mut c = self.node.command(&self.tessera);
            c.args([
                "run",
                "--memory",
                &format!("{}MiB", HAMMER_LIMIT / MIB),
                "--interposer",
            ])
            .arg(&self.interposer)
            .args(["--", "/bin/sh"]);
            c
        } else {
            self.node.command(std::path::Path::new("/bin/sh"))
        };
        let mut child = cmd
            .args(["-c", &script])
            .env("T", &self.client)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the hammer");
        let mut out = child.stdout.take().expect("piped");
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let mut over = 0;
        loop {
            if let Some(st) = child.try_wait().expect("wait") {
                if !st.success() {
                    eprintln!("speed: the hammer failed ({st})");
                    std::process::exit(1);
                }
                break;
            }
            // Sampled in both variants, counted only under Tessera: a sample takes the
            // simulated card's lock, which the hammering processes contend for, so sampling
            // one side only loaded that side (before 2026-12-05: Tessera's).
            let used = self.card();
            if tessera && used > HAMMER_LIMIT {
                over += 1;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let text = reader.join().expect("reader");
        let grants = text
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| tenant_field(l, "grants").unwrap_or(0))
            .sum();
        (grants, over)
    }
}

/// Polls `done` with no sleep until it holds (true) or [`STUCK`] passed (false).
fn within(mut done: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while !done() {
        if t.elapsed() > STUCK {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

/// Ends the benchmark: it waited [`STUCK`] for `what`.
fn fail(what: &str) -> ! {
    eprintln!("speed: waited {STUCK:?} for {what}");
    std::process::exit(1);
}

/// Polls `done` with no sleep until it holds; exits the benchmark if it does not within
/// [`STUCK`].
fn until(mut done: impl FnMut() -> bool, what: &str) {
    let t = Instant::now();
    while !done() {
        if t.elapsed() > STUCK {
            eprintln!("speed: waited {STUCK:?} for {what}");
            std::process::exit(1);
        }
        std::thread::yield_now();
    }
}

fn median(xs: &[f64]) -> f64 {
    median_range(xs, 3).0
}

/// The memory rows.
pub(crate) fn rows(args: &Args) -> Vec<Row> {
    let bed = Bed::start();
    // Warm the page cache and the arbiter.
    bed.reclaim(false);
    bed.reclaim(true);
    let (mut bare, mut tess) = (Vec::new(), Vec::new());
    for _ in 0..args.repeats {
        let (mut b, mut t) = (Vec::new(), Vec::new());
        for _ in 0..KILLS {
            b.push(bed.reclaim(false));
            t.push(bed.reclaim(true));
        }
        bare.push(median(&b));
        tess.push(median(&t));
    }
    let (_, btext) = median_range(&bare, 2);
    let (t, ttext) = median_range(&tess, 2);
    let reclaim = Row {
        figure: format!(
            "reclaim after SIGKILL ({} MiB and a context; kill to free on the card / in the arbiter's ledger)",
            HELD / MIB
        ),
        baseline: format!("{btext} ms"),
        tessera: format!("{ttext} ms"),
        target: format!("<= {RECLAIM_TARGET_MS:.2} ms (was 1.87, HAMi-core 0.98)"),
        met: t <= RECLAIM_TARGET_MS,
    };
    let (mut bare, mut tess, mut over) = (Vec::new(), Vec::new(), 0);
    for _ in 0..args.repeats {
        bare.push(bed.hammer(false).0 as f64);
        let (n, o) = bed.hammer(true);
        tess.push(n as f64);
        over += o;
    }
    let (b, btext) = median_range(&bare, 0);
    let (t, ttext) = median_range(&tess, 0);
    let hammer = Row {
        figure: format!(
            "allocations in {HAMMER_SECONDS} s, {HAMMERS} processes hammering (allocate+free, no hold; 6 of 8 chunks fit)"
        ),
        baseline: btext,
        tessera: format!(
            "{ttext} ({:.2}x; {over} card samples over the limit)",
            t / b.max(1.0)
        ),
        target: format!(">= {HAMMER_TARGET:.2}x no control, 0 over the limit"),
        met: t >= HAMMER_TARGET * b && over == 0,
    };
    vec![reclaim, hammer]
}
