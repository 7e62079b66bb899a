//! `tessera status` against the real arbiter.

use crate::run_support::*;
use tessera_protocol::{CreateAllocation, GpuSelector, TenantRequest};

#[test]
fn status_table_and_json_show_every_allocation() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let gpus = admin.gpus().unwrap();
    let mk = |gpu, limit, share, cap| CreateAllocation {
        gpu: GpuSelector::Index(gpu),
        memory_limit: limit,
        share,
        cap,
        labels: Default::default(),
    };
    let (token, a) = admin.create(mk(0, 4 * GIB, 30, Some(30))).unwrap();
    let (_, b) = admin.create(mk(0, 2 * GIB, 70, None)).unwrap();
    let mut t1 = tessera_protocol::client::TenantClient::connect(&arb.socket, &token).unwrap();
    let mut t2 = tessera_protocol::client::TenantClient::connect(&arb.socket, &token).unwrap();
    t1.call(&TenantRequest::Reserve { bytes: 1024 * MIB })
        .unwrap();
    t2.call(&TenantRequest::Reserve { bytes: 512 * MIB })
        .unwrap();

    let out = arb.tessera(&["status"]).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    println!("{table}");
    assert!(
        table.contains(&format!("GPU 0  {}  {}", gpus[0].name, gpus[0].uuid)),
        "{table}"
    );
    assert!(table.contains("GPU 1"), "{table}");
    assert!(table.contains("shares 100 of 100 promised"), "{table}");
    let row_a = table.lines().find(|l| l.contains(&a.id)).unwrap();
    assert!(row_a.contains("1.50 GiB / 4.00 GiB"), "{row_a}");
    // Both connections come from this test process: one process.
    assert!(row_a.contains("| 1 "), "{row_a}");
    assert!(row_a.contains("30%"), "{row_a}");
    let row_b = table.lines().find(|l| l.contains(&b.id)).unwrap();
    assert!(row_b.contains("0 B / 2.00 GiB"), "{row_b}");
    assert!(table.contains("no allocations"), "GPU 1 is empty: {table}");

    let out = arb.tessera(&["status", "--json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let g0 = &v["gpus"][0];
    assert_eq!(g0["index"], 0);
    assert_eq!(g0["uuid"], gpus[0].uuid.as_str());
    assert_eq!(g0["memory_total"], 80 * GIB);
    assert_eq!(g0["memory_promised"], 6 * GIB);
    assert_eq!(g0["shares_promised"], 100);
    let allocs = g0["allocations"].as_array().unwrap();
    assert_eq!(allocs.len(), 2);
    assert_eq!(allocs[0]["id"], a.id.as_str());
    assert_eq!(allocs[0]["memory_limit"], 4 * GIB);
    assert_eq!(allocs[0]["memory_used"], 1536 * MIB);
    assert_eq!(allocs[0]["share"], 30);
    assert_eq!(allocs[0]["cap"], 30);
    assert_eq!(allocs[0]["gpu_time_10s_ns"], 0);
    assert_eq!(allocs[1]["cap"], serde_json::Value::Null);
    assert_eq!(v["gpus"][1]["allocations"].as_array().unwrap().len(), 0);
    assert_eq!(v["unplaced"].as_array().unwrap().len(), 0);
}

#[test]
fn status_without_arbiter_exits_3() {
    let out = std::process::Command::new(tessera())
        .args(["status", "--admin-socket", "/nonexistent/admin.sock"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/admin.sock"), "{err}");
}

/// The labels the device plugin writes once PodResources names the pod.
fn pod_labels(ns: &str, pod: &str, container: &str) -> std::collections::BTreeMap<String, String> {
    [
        (tessera_protocol::LABEL_NAMESPACE, ns),
        (tessera_protocol::LABEL_POD, pod),
        (tessera_protocol::LABEL_CONTAINER, container),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// 1 GiB on GPU 0 at `share`, labelled as pod `team/train-0`, container `main`.
fn train_0(share: u32) -> CreateAllocation {
    let mut req = tessera_testkit::allocation(0, GIB, share, None);
    req.labels = pod_labels("team", "train-0", "main");
    req
}

#[test]
fn status_names_pods_from_labels() {
    let arb = Arbiter::start();
    let (_, a) = arb.admin().create(train_0(10)).unwrap();
    let out = arb.tessera(&["status"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let table = String::from_utf8(out.stdout).unwrap();
    let at = table.lines().position(|l| l.contains(&a.id)).unwrap();
    assert!(
        table
            .lines()
            .nth(at + 1)
            .unwrap()
            .contains("pod team/train-0/main"),
        "{table}"
    );
    let out = arb.tessera(&["status", "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["gpus"][0]["allocations"][0]["pod"], "team/train-0/main");
}

/// Starts `tessera status --watch 0.2`, reads two whole frames (fresh data in the second),
/// sends `sig`, and expects exit code 0 with the cursor shown again.
fn watch_until(sig: libc::c_int) {
    use std::io::Read;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};
    const CLEAR: &str = "\x1b[H\x1b[2J";

    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (_, a) = admin.create(train_0(30)).unwrap();
    let mut child = arb
        .tessera(&["status", "--watch", "0.2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = Arc::new(Mutex::new(Vec::new()));
    let mut pipe = child.stdout.take().unwrap();
    let sink = out.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    let text = || String::from_utf8_lossy(&out.lock().unwrap()).into_owned();
    let wait_for = |what: &str, cond: &dyn Fn(&str) -> bool| {
        let start = Instant::now();
        loop {
            let t = text();
            if cond(&t) {
                return t;
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "timed out waiting for {what}:\n{t}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // Frame 1 complete once frame 2 has started.
    let t = wait_for("two frames", &|t| t.matches(CLEAR).count() >= 2);
    let first = t.split(CLEAR).nth(1).unwrap();
    assert!(first.contains("Every 0.2s: tessera status"), "{first}");
    assert!(first.contains("GPU % (10s)"), "{first}");
    assert!(
        first.contains(&a.id) && first.contains("pod team/train-0/main"),
        "{first}"
    );
    // The pod moves (its units handed to another): a later frame shows the new name.
    admin
        .update_labels(&a.id, pod_labels("team", "train-1", "main"))
        .unwrap();
    let t = wait_for("a frame with the new pod name", &|t| {
        let frames: Vec<&str> = t.split(CLEAR).collect();
        // Only whole frames (one more has started after it).
        frames.len() >= 3
            && frames[..frames.len() - 1]
                .iter()
                .any(|f| f.contains("train-1"))
    });
    assert!(t.matches(CLEAR).count() >= 3, "{t}");

    // SAFETY: kill has no memory preconditions; the pid is our own live child.
    unsafe { libc::kill(child.id() as i32, sig) };
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "tessera status --watch ignored signal {sig}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    reader.join().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(0), "signal {sig}: {status:?} {err}");
    let t = text();
    assert!(t.starts_with("\x1b[?25l"), "cursor hidden first: {t:?}");
    assert!(t.ends_with("\x1b[?25h\n"), "cursor shown at the end: {t:?}");
}

#[test]
fn status_watch_redraws_and_exits_0_on_sigint() {
    watch_until(libc::SIGINT);
}

#[test]
fn status_watch_exits_0_on_sigterm() {
    watch_until(libc::SIGTERM);
}

#[test]
fn status_watch_rejects_a_tiny_interval() {
    let out = std::process::Command::new(tessera())
        .args(["status", "--watch", "0.01"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = std::process::Command::new(tessera())
        .args(["status", "--watch", "1", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "--json and --watch conflict");
}
