//! soak: honest tenants under the memory backstop for a long while, on the simulated GPU. The
//! backstop must never act on them.
//!
//! Starts the real `tessera-arbiter` with the backstop at its strictest (a poll every 50 ms, its
//! default allowance of the limit plus one 64 MiB slack per allocation, whatever its number of
//! processes: each process's 300 MiB context is inside the limit; memory, compute and
//! unknown-process rules all on) and keeps, for `--minutes M` (default 10), under `tessera run`:
//! - 8 processes churning 630 MiB chunks at the limit of one allocation of 4 GiB plus their
//!   eight contexts (they wait for each other's frees), restarted every minute (so processes
//!   keep coming and going);
//! - 2 processes handing 3 GiB back and forth under another 4 GiB allocation;
//! - 4 allocations of 1 GiB whose process holds its context and the rest of the limit, exactly
//!   the limit, all along;
//! - 2 tenants launching kernels (compute sharing runs alongside, and the backstop compares
//!   their GPU time with their leases);
//! - 1 process cycling the VMM idiom (create, map, release at once, unmap) at a 1 GiB limit;
//! - 1 process forking children that each allocate and free 256 MiB;
//! - 1 shell double-forking short-lived tenants (each a context and 128 MiB for 0.2 s, ten a
//!   second, reparented to `tessera run`, the child subreaper), so pids are recycled fast under
//!   an allocation the backstop attributes by its owner.
//!
//! At the end prints the minutes, the allocations made, refusals, and the backstop's actions
//! (`enforced` of every allocation): the result is honest only if that is 0.
//!
//! Build and run: `cargo build --release --workspace && target/release/soak [--minutes M]`.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tessera_benches::{SimNode, need};

const GIB: u64 = 1 << 30;
/// What each process's context takes out of its limit (the interposer's reservation, what the
/// simulated card charges).
const CONTEXT: u64 = 300 << 20;

struct Load<'a> {
    node: &'a SimNode,
    tessera: &'a Path,
    interposer: &'a Path,
    tenant: &'a Path,
}

impl Load<'_> {
    /// One `tessera run` group at share 9: the eleven groups together promise 99 of the GPU's
    /// 100 shares.
    fn run(&self, memory: &str, script: &str) -> Child {
        self.node
            .command(self.tessera)
            .args(["run", "--memory", memory, "--share", "9", "--interposer"])
            .arg(self.interposer)
            .args(["--", "/bin/sh", "-c", script])
            .env("T", self.tenant)
            .env("D", self.node.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start tenants")
    }
}

/// Sums `"key":N` over the JSON lines a group printed.
fn sum(out: &str, key: &str) -> u64 {
    out.lines()
        .filter_map(|l| tessera_benches::tenant_field(l, key))
        .sum()
}

fn finish(mut c: Child) -> String {
    let mut s = String::new();
    if let Some(mut o) = c.stdout.take() {
        let _ = o.read_to_string(&mut s);
    }
    let st = c.wait().expect("wait");
    if !st.success() {
        eprintln!("soak: a tenant group failed ({st})");
        std::process::exit(1);
    }
    s
}

fn main() {
    let minutes = tessera_benches::number_flag("soak", "--minutes", 10.0);
    let (tessera, interposer) = (
        need("soak", "tessera"),
        need("soak", "libtessera_interpose.so"),
    );
    let (tenant, compute) = (need("soak", "mem_tenant"), need("soak", "compute_tenant"));
    let node = SimNode::start_with("soak", "1x80GiB", &["--backstop-interval-ms", "50"]);
    let load = Load {
        node: &node,
        tessera: &tessera,
        interposer: &interposer,
        tenant: &tenant,
    };
    let total = Duration::from_secs_f64(minutes * 60.0);
    let start = Instant::now();
    let secs = total.as_secs_f64();
    let holders: Vec<Child> = (0..4)
        .map(|_| {
            load.run(
                "1GiB",
                &format!("\"$T\" hold --bytes {} --seconds {secs}", GIB - CONTEXT),
            )
        })
        .collect();
    let compute_script = format!("\"{}\" --seconds {secs} > /dev/null", compute.display());
    let computes: Vec<Child> = (0..2)
        .map(|_| load.run("512MiB", &compute_script))
        .collect();
    let vmm = load.run(
        "1GiB",
        &format!("\"$T\" vmm --bytes {} --seconds {secs}", 512 << 20),
    );
    // The parent's context and one child's 256 MiB (a forked child makes no context).
    let forker = load.run(
        "768MiB",
        &format!("\"$T\" fork --bytes {} --seconds {secs}", 256 << 20),
    );
    // `( cmd & )`: the subshell exits at once, so each tenant is a grandchild of the shell that
    // `tessera run` adopts; none is waited for by the shell.
    let double_fork = load.run(
        "2GiB",
        &format!(
            "end=$(( $(date +%s) + {whole} )); n=0; \
             while [ \"$(date +%s)\" -lt \"$end\" ]; do \
               ( \"$T\" hold --bytes {b} --seconds 0.2 > /dev/null 2>&1 & ); n=$((n+1)); sleep 0.1; \
             done; echo \"{{\\\"grants\\\":$n}}\"",
            whole = secs as u64,
            b = 128 << 20
        ),
    );
    let rounds = (secs * 2000.0) as u64;
    let handoff = load.run(
        "4GiB",
        &format!(
            "mkfifo \"$D/ab\" \"$D/ba\" || exit 1; \
             \"$T\" handoff --first --rounds {rounds} --bytes {b} --in \"$D/ba\" --out \"$D/ab\" & \
             \"$T\" handoff --second --rounds {rounds} --bytes {b} --in \"$D/ab\" --out \"$D/ba\"; wait",
            b = 3 * GIB
        ),
    );
    let chunk = 4 * GIB * 2 / 13;
    let (mut grants, mut refusals, mut waves) = (0u64, 0u64, 0u32);
    while start.elapsed() + Duration::from_secs(5) < total {
        let left = (total - start.elapsed()).as_secs_f64().min(60.0) - 2.0;
        let churn = load.run(
            &format!("{}MiB", (4 * GIB + 8 * CONTEXT) >> 20),
            &format!(
                "for i in 1 2 3 4 5 6 7 8; do \"$T\" churn --bytes {chunk} --seconds {left:.1} & done; wait"
            ),
        );
        let out = finish(churn);
        grants += sum(&out, "grants");
        refusals += sum(&out, "refusals");
        waves += 1;
    }
    let mut handoff = handoff;
    // The hand-off runs as many rounds as it can; it is stopped with the soak.
    let _ = handoff.kill();
    let _ = handoff.wait();
    let (vmm_out, fork_out) = (finish(vmm), finish(forker));
    let double_fork_out = finish(double_fork);
    for mut c in holders.into_iter().chain(computes) {
        let _ = c.kill();
        let _ = c.wait();
    }
    let allocations = node.admin().list().unwrap_or_default();
    let enforced: u64 = allocations.iter().map(|a| a.enforced).sum();
    node.kill_gpu_processes();
    println!(
        "Tessera soak: honest tenants under the backstop (poll 50 ms, limit + 64 MiB per allocation, contexts inside the limit), simulated GPU"
    );
    println!(
        "duration            {:.1} min",
        start.elapsed().as_secs_f64() / 60.0
    );
    println!(
        "churn waves         {waves} x 8 processes at a 4 GiB (+ 8 contexts) limit: {grants} allocations, {refusals} refused"
    );
    println!(
        "VMM idiom           {} rounds of 512 MiB (create, map, release at once, unmap), {} refused",
        sum(&vmm_out, "grants"),
        sum(&vmm_out, "refusals")
    );
    println!(
        "forked children     {} (each allocated and freed 256 MiB), {} refused",
        sum(&fork_out, "grants"),
        sum(&fork_out, "refusals")
    );
    println!(
        "double-forked       {} short-lived tenants (a context and 128 MiB for 0.2 s each, adopted by tessera run)",
        sum(&double_fork_out, "grants")
    );
    println!(
        "alongside           hand-off 2 x 3 GiB, 4 processes holding their whole 1 GiB limit (context included), 2 kernel launchers"
    );
    println!("backstop actions    {enforced} (must be 0)");
    if enforced != 0 {
        std::process::exit(1);
    }
}
