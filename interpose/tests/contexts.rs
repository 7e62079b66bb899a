//! Contexts count against the limit, with the simulated NVML as the truth: each process's
//! context is reserved through the arbiter before the driver makes it, so however many
//! processes an allocation runs, the card's figure for it (the NVML used memory of its
//! processes) stays within its limit plus the backstop's one slack, processes that do not fit
//! are refused with `CUDA_ERROR_OUT_OF_MEMORY` (and run on), and a neighbour keeps what it was
//! promised. The clients (`tests/c/ctx_client.c`) hold their contexts until stdin closes.

mod common;

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use common::*;

const OOM: i64 = 2;
/// The backstop's default allowance beyond an allocation's limit (`--backstop-slack-mib`).
const SLACK: u64 = 64 * MIB;

/// One client holding its contexts.
struct Client {
    child: tessera_testkit::KillOnDrop,
    out: Lines<BufReader<ChildStdout>>,
    /// `(step, result)` of each line before `ready`: `primary`, `alloc`, `create`.
    steps: Vec<(String, i64)>,
    /// The `routes` line.
    routes: String,
}

impl Client {
    fn start(bed: &Bed, exe: &std::path::Path, token: &str, contexts: u32, bytes: u64) -> Child {
        bed.tenant_command(exe, token)
            .args([contexts.to_string(), bytes.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Reads the client's lines up to `ready`.
    fn ready(mut child: Child) -> Client {
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut c = Client {
            child: tessera_testkit::KillOnDrop::new(child),
            out,
            steps: Vec::new(),
            routes: String::new(),
        };
        loop {
            let line = c.line();
            if line == "ready" {
                return c;
            }
            if line.starts_with("routes") {
                c.routes = line;
                continue;
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            let rc = words
                .last()
                .and_then(|w| w.parse().ok())
                .unwrap_or_else(|| panic!("bad line {line:?}"));
            c.steps.push((words[0].to_owned(), rc));
        }
    }

    fn line(&mut self) -> String {
        match self.out.next() {
            Some(Ok(l)) => l,
            other => panic!("client ended early: {other:?}"),
        }
    }

    fn rc(&self, step: &str) -> Option<i64> {
        self.steps.iter().find(|(s, _)| s == step).map(|(_, r)| *r)
    }

    /// Allocates `bytes` more in the client's primary context; the driver's answer.
    fn alloc(&mut self, bytes: u64) -> i64 {
        writeln!(self.child.stdin.as_mut().unwrap(), "alloc {bytes}").unwrap();
        let line = self.line();
        line.strip_prefix("got ")
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("bad line {line:?}"))
    }

    /// Closes stdin (the client lets go of everything) and reads what it reported.
    fn finish(mut self) -> Vec<String> {
        drop(self.child.stdin.take());
        let lines: Vec<String> = self.out.by_ref().map_while(Result::ok).collect();
        let st = self.child.wait().unwrap();
        assert!(st.success(), "the client crashed: {st} {lines:?}");
        lines
    }
}

/// `n` processes of one 1 GiB allocation, each making a context and allocating 16 MiB, all at
/// once: exactly as many as fit run, the others are refused at context creation with
/// `CUDA_ERROR_OUT_OF_MEMORY` and carry on; the card never holds more than the limit plus the
/// slack; nobody is killed.
fn crowd(n: usize) {
    let bed = Bed::with_arbiter_args(&["--backstop-interval-ms", "50"]);
    let (token, id) = bed.create(GIB);
    let exe = build_c(&bed, "ctx_client");
    let t = Instant::now();
    let started: Vec<Child> = (0..n)
        .map(|_| Client::start(&bed, &exe, &token, 1, 16 * MIB))
        .collect();
    let clients: Vec<Client> = started.into_iter().map(Client::ready).collect();
    eprintln!("{n} clients ready after {:?}", t.elapsed());
    let (mut fit, mut refused_ctx, mut refused_alloc) = (0u64, 0u64, 0u64);
    for c in &clients {
        match (c.rc("primary"), c.rc("alloc")) {
            (Some(0), Some(0)) => fit += 1,
            (Some(0), Some(OOM)) => refused_alloc += 1,
            (Some(OOM), None) => refused_ctx += 1,
            other => panic!("unexpected results {other:?}: {:?}", c.steps),
        }
    }
    let each = CONTEXT + 16 * MIB;
    eprintln!(
        "{n} processes: {fit} fit, {refused_ctx} refused a context, {refused_alloc} an allocation"
    );
    assert_eq!(fit, GIB / each, "as many as fit run, no more, no fewer");
    assert_eq!(fit + refused_ctx + refused_alloc, n as u64);
    // NVML's figure for the allocation (all its processes), before and after three backstop
    // polls (it looked, and left them alone).
    for look in 0..2 {
        let card = bed.sim_used();
        assert!(
            card <= GIB + SLACK,
            "the card holds {card} for a 1 GiB allocation"
        );
        assert_eq!(
            card,
            fit * each,
            "the card holds the contexts and allocations that fit"
        );
        if look == 0 {
            bed.wait_backstop_polls(3);
        }
    }
    assert!(bed.used(&id) <= GIB);
    assert_eq!(bed.status(&id).enforced, 0, "{}", bed.arbiter_log());
    for c in clients {
        c.finish();
    }
    assert!(
        !bed.arbiter_log().contains("backstop: pid"),
        "an honest process was acted on\n{}",
        bed.arbiter_log()
    );
    wait_until(Duration::from_secs(5), || bed.used(&id) == 0).expect("ledger back to zero");
    assert_eq!(bed.sim_used(), 0);
}

#[test]
fn sixteen_processes_under_one_gib_stay_within_the_limit_plus_the_slack() {
    crowd(16);
}

#[test]
fn sixty_four_processes_under_one_gib_stay_within_the_limit_plus_the_slack() {
    crowd(64);
}

#[test]
fn fifty_context_only_processes_leave_a_neighbour_its_promised_memory() {
    // A 16 GiB card: tenant A's 1 GiB allocation runs 50 processes that only make a context;
    // tenant B was promised 8 GiB and takes all of it.
    let bed = Bed::with_gpus("1x16GiB", &["--backstop-interval-ms", "50"]);
    let (token_a, id_a) = bed.create(GIB);
    let (token_b, id_b) = bed.create(8 * GIB);
    let exe = build_c(&bed, "ctx_client");
    let started: Vec<Child> = (0..50)
        .map(|_| Client::start(&bed, &exe, &token_a, 1, 0))
        .collect();
    let crowd: Vec<Client> = started.into_iter().map(Client::ready).collect();
    let made = crowd.iter().filter(|c| c.rc("primary") == Some(0)).count() as u64;
    assert!(
        crowd
            .iter()
            .all(|c| matches!(c.rc("primary"), Some(0 | OOM))),
        "every process either made its context or was refused"
    );
    assert_eq!(made, GIB / CONTEXT, "A's contexts fill its limit, no more");
    let a_card = bed.sim_used();
    assert!(
        a_card <= GIB + SLACK,
        "A's processes hold {a_card} on the card"
    );
    // B: its context and the rest of its promise.
    let b = Client::ready(Client::start(&bed, &exe, &token_b, 1, 8 * GIB - CONTEXT));
    assert_eq!(
        (b.rc("primary"), b.rc("alloc")),
        (Some(0), Some(0)),
        "B gets all it was promised: {:?}",
        b.steps
    );
    assert_eq!(bed.sim_used(), a_card + 8 * GIB);
    assert_eq!(bed.used(&id_b), 8 * GIB);
    assert_eq!(bed.used(&id_a), made * CONTEXT);
    b.finish();
    for c in crowd {
        c.finish();
    }
    assert!(
        !bed.arbiter_log().contains("backstop: pid"),
        "{}",
        bed.arbiter_log()
    );
}

#[test]
fn sixty_four_contexts_in_one_process_are_charged_by_the_driver_and_the_interposer() {
    let bed = Bed::with_arbiter_args(&["--backstop-interval-ms", "50"]);
    // Room for exactly 64 contexts; the client tries 65.
    let limit = 64 * CONTEXT;
    let (token, id) = bed.create(limit);
    let exe = build_c(&bed, "ctx_client");
    let c = Client::ready(Client::start(&bed, &exe, &token, 65, 0));
    assert_eq!(
        c.routes, "routes dlsym=interposer gpa=interposer destroy=interposer",
        "every route to context creation reaches the hooks"
    );
    let creates: Vec<i64> = c
        .steps
        .iter()
        .filter(|(s, _)| s == "create")
        .map(|(_, r)| *r)
        .collect();
    assert_eq!(c.rc("primary"), Some(0));
    assert_eq!(creates.len(), 64, "{:?}", c.steps);
    assert!(creates[..63].iter().all(|&r| r == 0), "{creates:?}");
    assert_eq!(creates[63], OOM, "the 65th context does not fit the limit");
    assert_eq!(bed.used(&id), limit, "the interposer charged each context");
    // The simulated driver charges each one too (a further context costs what the first
    // does); the refused one left no trace.
    assert_eq!(bed.sim_used(), 64 * bed.context_bytes());
    let lines = c.finish();
    assert_eq!(
        lines,
        vec![
            "destroyed 63 0".to_owned(),
            format!("free {}", limit - CONTEXT),
            "released 0".to_owned(),
        ],
        "each destroyed context gave its cost back; the primary one's stays until released"
    );
    wait_until(Duration::from_secs(5), || bed.used(&id) == 0).expect("ledger back to zero");
    assert_eq!(bed.sim_used(), 0);
}

#[test]
fn free_memory_inside_the_tenant_is_net_of_its_contexts() {
    // Three contexts (the primary and two more) and 16 MiB under 1 GiB: cuMemGetInfo and NVML
    // (through dlsym) both say what is left for allocations, the contexts taken out.
    let bed = Bed::new();
    let (token, _id) = bed.create(GIB);
    let exe = build_c(&bed, "ctx_client");
    let c = Client::ready(Client::start(&bed, &exe, &token, 3, 16 * MIB));
    assert_eq!(c.rc("primary"), Some(0));
    assert_eq!(c.rc("alloc"), Some(0));
    let left = (GIB - 3 * CONTEXT - 16 * MIB) as i64;
    assert_eq!(c.rc("memfree"), Some(left), "cuMemGetInfo: {:?}", c.steps);
    assert_eq!(c.rc("nvmlfree"), Some(left), "NVML: {:?}", c.steps);
    c.finish();
}

#[test]
fn a_context_bigger_than_the_estimate_is_charged_its_size_on_the_card() {
    // The simulated card charges 500 MiB per context; the interposer reserves 300 MiB. The
    // arbiter reads the difference from NVML and charges it, so an allocation that fits the
    // estimate but not the card is refused (without the correction it was granted, the card
    // held 1100 MiB for a 1 GiB allocation and the backstop killed the process).
    let bed = Bed::with_context_memory("500MiB", &["--backstop-interval-ms", "50"]);
    let (token, id) = bed.create(GIB);
    let exe = build_c(&bed, "ctx_client");
    let mut c = Client::ready(Client::start(&bed, &exe, &token, 1, 0));
    assert_eq!(c.rc("primary"), Some(0));
    assert_eq!(bed.sim_used(), 500 * MIB);
    wait_until(Duration::from_secs(5), || bed.used(&id) >= 500 * MIB)
        .unwrap_or_else(|| panic!("ledger at {}, the card at 500 MiB", bed.used(&id)));
    assert!(bed.used(&id) <= 500 * MIB + SLACK);
    assert_eq!(c.alloc(600 * MIB), OOM, "fits 300 + 600, not 500 + 600");
    assert_eq!(c.alloc(500 * MIB), 0, "500 + 500 fits");
    assert!(bed.sim_used() <= GIB + SLACK);
    bed.wait_backstop_polls(3);
    assert!(bed.sim_used() <= GIB + SLACK);
    assert_eq!(bed.status(&id).enforced, 0, "{}", bed.arbiter_log());
    c.finish();
    wait_until(Duration::from_secs(5), || bed.used(&id) == 0).expect("ledger back to zero");
}

#[test]
fn green_contexts_are_reserved_like_contexts() {
    // Room for three contexts; the client asks for four green contexts (CUDA 12.4), through
    // the linked symbol and cuGetProcAddress in turn: three are made and charged by the
    // interposer and by the simulated driver, the fourth is refused before the driver is asked.
    let bed = Bed::with_arbiter_args(&["--backstop-interval-ms", "50"]);
    let (token, id) = bed.create(3 * CONTEXT);
    let exe = build_c(&bed, "green_client");
    let c = Client::ready(Client::start(&bed, &exe, &token, 4, 0));
    assert_eq!(c.routes, "routes gpa=interposer");
    let greens: Vec<i64> = c
        .steps
        .iter()
        .filter(|(s, _)| s == "green")
        .map(|(_, r)| *r)
        .collect();
    assert_eq!(c.rc("desc"), Some(0), "{:?}", c.steps);
    assert_eq!(greens, vec![0, 0, 0, OOM], "{:?}", c.steps);
    assert_eq!(bed.used(&id), 3 * CONTEXT);
    assert_eq!(bed.sim_used(), 3 * bed.context_bytes());
    assert_eq!(c.finish(), vec!["destroyed 3 0".to_owned()]);
    wait_until(Duration::from_secs(5), || bed.used(&id) == 0).expect("ledger back to zero");
    assert_eq!(bed.sim_used(), 0);
    assert!(
        !bed.arbiter_log().contains("backstop: pid"),
        "{}",
        bed.arbiter_log()
    );
}

#[test]
fn a_context_the_limit_has_no_room_for_is_refused_and_the_process_runs_on() {
    // An allocation smaller than one context: the process gets CUDA_ERROR_OUT_OF_MEMORY from
    // cuDevicePrimaryCtxRetain, no crash, and the card holds nothing for it.
    let bed = Bed::new();
    let (token, id) = bed.create(CONTEXT - MIB);
    let exe = build_c(&bed, "ctx_client");
    let mut c = Client::ready(Client::start(&bed, &exe, &token, 2, MIB));
    assert_eq!(c.steps, vec![("primary".to_owned(), OOM)]);
    assert_eq!(bed.sim_used(), 0);
    assert_eq!(bed.used(&id), 0);
    writeln!(c.child.stdin.as_mut().unwrap(), "go").unwrap();
    assert_eq!(c.finish(), vec!["destroyed 0 0".to_owned()]);
}
