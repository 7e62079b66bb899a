//! Start-up rows: what the interposer, the arbiter and `tessera run` add to a process's start.
//!
//! Every row times whole processes (spawn to exit) on one simulated node, the variants of a row
//! interleaved one process at a time so that the machine's load hits them alike; a repeat is
//! the median of `BATCH` processes per variant, and a row prints the median [range] of the
//! repeats' medians.
//!
//! - A client's start-up: `mem_tenant hold --bytes 1MiB --seconds 0` (driver init, the primary
//!   context, 1 MiB allocated, exit), bare against under the interposer with an allocation's
//!   token (its first context reserves at the arbiter).
//! - `/bin/true` with `LD_PRELOAD` of the interposer and no CUDA use, against bare.
//! - `tessera run` around the same client (creates the allocation, runs it, deletes it) against
//!   the bare client; and `tessera run --exec` (creates it and becomes the client; the arbiter
//!   deletes it after the client's exit).
//! - The client under the interposer right after `AFTER_RUNS` `tessera run`s of `/bin/true`
//!   ended, against the same client on a quiet arbiter.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use tessera_benches::{SimNode, need};
use tessera_protocol::CreateAllocation;
use tessera_protocol::node::{ENV_SOCKET, ENV_TOKEN};

use crate::{Args, Row, median_range};

/// Processes per variant in one repeat.
const BATCH: usize = 20;
/// `tessera run`s that end just before the timed start-up of the last row.
const AFTER_RUNS: usize = 4;
/// The client's allocation.
const CLIENT_BYTES: &str = "1048576";
/// Today's added start-up (issue 36) and HAMi-core's, ms: the target is at most half of the
/// first and at most the second.
const TODAY_ADDED_MS: f64 = 1.59;
const HAMI_ADDED_MS: f64 = 0.88;

/// What the rows start.
struct Bed {
    node: SimNode,
    client: PathBuf,
    tessera: PathBuf,
    interposer: PathBuf,
    token: String,
}

impl Bed {
    fn start() -> Self {
        let node = SimNode::start("speed", "1x80GiB");
        let client = need("speed", "mem_tenant");
        let tessera = need("speed", "tessera");
        let interposer = need("speed", "libtessera_interpose.so");
        let (token, _) = node
            .admin()
            .create(CreateAllocation {
                gpu: tessera_protocol::GpuSelector::Index(0),
                memory_limit: 8 << 30,
                share: 10,
                cap: None,
                labels: Default::default(),
            })
            .unwrap_or_else(|e| {
                eprintln!("speed: cannot create the client's allocation: {e}");
                std::process::exit(1);
            });
        Self {
            node,
            client,
            tessera,
            interposer,
            token,
        }
    }

    /// The client, bare, on the node's simulated GPU.
    fn client(&self) -> Command {
        let mut c = self.node.command(&self.client);
        c.args(["hold", "--bytes", CLIENT_BYTES, "--seconds", "0"]);
        c
    }

    /// The client under the interposer with the allocation's token.
    fn client_preloaded(&self) -> Command {
        let mut c = self.client();
        c.env("LD_PRELOAD", &self.interposer)
            .env(ENV_TOKEN, &self.token)
            .env(ENV_SOCKET, &self.node.socket);
        c
    }

    /// `tessera run` around `program args`.
    fn tessera_run(&self, program: &Path, args: &[&str]) -> Command {
        self.tessera_run_with(&[], program, args)
    }

    /// `tessera run FLAGS` around `program args`.
    fn tessera_run_with(&self, flags: &[&str], program: &Path, args: &[&str]) -> Command {
        let mut c = self.node.command(&self.tessera);
        c.arg("run")
            .args(flags)
            .args(["--memory", "1GiB", "--interposer"])
            .arg(&self.interposer)
            .arg("--")
            .arg(program)
            .args(args);
        c
    }

    fn true_bare(&self) -> Command {
        let mut c = Command::new("/bin/true");
        c.env_clear().env("PATH", "/usr/bin:/bin");
        c
    }

    fn true_preloaded(&self) -> Command {
        let mut c = self.true_bare();
        c.env("LD_PRELOAD", &self.interposer);
        c
    }
}

/// Runs `cmd` to its end; its wall time in ms. A failed process ends the benchmark: a row over
/// processes that did not do their work would measure nothing.
fn timed(mut cmd: Command) -> f64 {
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    let t = Instant::now();
    let status = cmd.status().expect("spawn");
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !status.success() {
        eprintln!("speed: {cmd:?} failed: {status}");
        std::process::exit(1);
    }
    ms
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Per repeat, `BATCH` rounds of every variant in turn; the per-repeat medians of each variant.
fn interleaved(repeats: usize, variants: &mut [&mut dyn FnMut() -> f64]) -> Vec<Vec<f64>> {
    let mut out = vec![Vec::with_capacity(repeats); variants.len()];
    for _ in 0..repeats {
        let mut batch = vec![Vec::with_capacity(BATCH); variants.len()];
        for _ in 0..BATCH {
            for (i, v) in variants.iter_mut().enumerate() {
                batch[i].push(v());
            }
        }
        for (i, b) in batch.iter_mut().enumerate() {
            out[i].push(median(b));
        }
    }
    out
}

/// A row from a baseline's and Tessera's per-repeat medians, with the added time in the
/// Tessera column and `met` when the added median is at most `limit_ms`.
fn added_row(figure: &str, base: &[f64], tessera: &[f64], limit_ms: f64, target: &str) -> Row {
    let (b, btext) = median_range(base, 2);
    let (t, ttext) = median_range(tessera, 2);
    let added = t - b;
    Row {
        figure: figure.to_owned(),
        baseline: format!("{btext} ms"),
        tessera: format!("{ttext} ms (+{added:.2} ms)"),
        target: target.to_owned(),
        met: added <= limit_ms,
    }
}

/// The start-up rows.
pub(crate) fn rows(args: &Args) -> Vec<Row> {
    let bed = Bed::start();
    // Warm the page cache and the arbiter before anything is timed.
    for _ in 0..3 {
        timed(bed.client());
        timed(bed.client_preloaded());
        timed(bed.tessera_run(
            &bed.client,
            &["hold", "--bytes", CLIENT_BYTES, "--seconds", "0"],
        ));
    }
    let client_args = ["hold", "--bytes", CLIENT_BYTES, "--seconds", "0"];
    let m = interleaved(
        args.repeats,
        &mut [
            &mut || timed(bed.client()),
            &mut || timed(bed.client_preloaded()),
            &mut || timed(bed.tessera_run(&bed.client, &client_args)),
            &mut || timed(bed.true_bare()),
            &mut || timed(bed.true_preloaded()),
            &mut || {
                // Not timed: the `tessera run`s whose ends the arbiter is still handling.
                for _ in 0..AFTER_RUNS {
                    timed(bed.tessera_run(Path::new("/bin/true"), &[]));
                }
                timed(bed.client_preloaded())
            },
            &mut || timed(bed.tessera_run_with(&["--exec"], &bed.client, &client_args)),
        ],
    );
    let limit = (TODAY_ADDED_MS / 2.0).min(HAMI_ADDED_MS);
    let (quiet, _) = median_range(&m[1], 2);
    vec![
        added_row(
            "start-up of a client (init, context, 1 MiB), interposer",
            &m[0],
            &m[1],
            limit,
            &format!(
                "added <= {limit:.2} ms (half of {TODAY_ADDED_MS}, <= HAMi-core's {HAMI_ADDED_MS})"
            ),
        ),
        added_row(
            "`/bin/true` under the interposer (no CUDA use)",
            &m[3],
            &m[4],
            0.2,
            "added <= 0.20 ms",
        ),
        added_row(
            "`tessera run` around the client (against the bare client)",
            &m[0],
            &m[2],
            2.0,
            "added <= 2.00 ms",
        ),
        added_row(
            "`tessera run --exec` around the client (against the bare client)",
            &m[0],
            &m[6],
            2.0,
            "added <= 2.00 ms",
        ),
        added_row(
            &format!(
                "client under the interposer right after {AFTER_RUNS} `tessera run`s ended (against it on a quiet arbiter)"
            ),
            &m[1],
            &m[5],
            // "No slowdown": within the noise of one such start-up, a tenth of it.
            quiet * 0.1,
            "added <= 10% of the quiet start-up",
        ),
    ]
}
