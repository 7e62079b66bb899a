//! `tessera status` against the real arbiter.

mod run_support;

use run_support::*;
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
