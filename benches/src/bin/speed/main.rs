//! speed: issue 36's figures in one run, no control and Tessera side by side, each a median over
//! repeats (with its range), against its target, on the simulated GPU.
//!
//! Modules, one per group of rows (each starts what it measures in its own temp folder):
//! - `startup`: a client's start-up (init, context, 1 MiB), `/bin/true` under the interposer,
//!   `tessera run` around a client, a start-up right after `tessera run`s ended.
//! - `memory`: reclaim after SIGKILL, allocations of 8 processes hammering with no hold.
//! - `cap`: a 30% cap alone, and capped 30/70, as % of wall time.
//!
//! Build and run: `cargo build --release --workspace && target/release/speed`
//! (`--rows startup,memory,cap` picks groups; `--repeats N` sets the repeats, default 5).

mod cap;
mod memory;
mod startup;

/// One printed row: a figure, its no-control baseline where it has one, Tessera's, the target.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    /// What is measured.
    pub(crate) figure: String,
    /// No control (no interposer, no arbiter), median [range]; empty where none applies.
    pub(crate) baseline: String,
    /// Under Tessera, median [range].
    pub(crate) tessera: String,
    /// The target, in words.
    pub(crate) target: String,
    /// Whether this run met it.
    pub(crate) met: bool,
}

/// What every group gets from the command line.
#[derive(Debug, Clone)]
pub(crate) struct Args {
    pub(crate) repeats: usize,
}

/// Median and range of `xs` as `median [min-max]` with `digits` decimals; `xs` must not be empty.
pub(crate) fn median_range(xs: &[f64], digits: usize) -> (f64, String) {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let m = if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    let text = format!(
        "{m:.digits$} [{:.digits$}-{:.digits$}]",
        v[0],
        v[v.len() - 1]
    );
    (m, text)
}

fn parse_args() -> (Args, Vec<String>) {
    let usage = "usage: speed [--rows startup,memory,cap] [--repeats N]";
    let mut args = Args { repeats: 5 };
    let mut rows: Vec<String> = vec!["startup".into(), "memory".into(), "cap".into()];
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match (flag.as_str(), it.next()) {
            ("--repeats", Some(v)) if v.parse::<usize>().is_ok_and(|n| n > 0) => {
                args.repeats = v.parse().unwrap_or(5);
            }
            ("--rows", Some(v)) => rows = v.split(',').map(str::to_owned).collect(),
            _ => {
                eprintln!("{usage}");
                std::process::exit(2);
            }
        }
    }
    (args, rows)
}

fn main() {
    let (args, groups) = parse_args();
    let mut rows: Vec<Row> = Vec::new();
    for g in &groups {
        match g.as_str() {
            // Each group's module adds its arm here.
            "startup" => rows.extend(startup::rows(&args)),
            "memory" => rows.extend(memory::rows(&args)),
            "cap" => rows.extend(cap::rows(&args)),
            other => {
                eprintln!("speed: unknown group {other:?} (startup, memory, cap)");
                std::process::exit(2);
            }
        }
    }
    println!("| figure | no control | Tessera | target | met |\n|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {} |",
            r.figure,
            r.baseline,
            r.tessera,
            r.target,
            if r.met { "yes" } else { "NO" }
        );
    }
    let _ = &args;
}
