//! `tessera status`: every allocation per GPU, as a table like `nvidia-smi` or as JSON.
//!
//! The JSON (`--json`) is a stable interface, documented in docs/arbiter.md:
//! `{"gpus": [{index, uuid, name, memory_total, memory_promised, shares_promised,
//! allocations: [{id, memory_limit, memory_used, processes, share, cap, gpu_time_10s_ns,
//! gpu_percent_10s, labels, created_unix, enforced}]}], "unplaced": [...]}`, where `unplaced` lists
//! allocations whose GPU is not on the node any more (same fields plus `gpu_uuid`).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use serde::Serialize;
use tessera_protocol::client::AdminClient;
use tessera_protocol::{AllocationStatus, GpuInfo};

use crate::run::{DEFAULT_ADMIN_SOCKET, classify};

/// Arguments of `tessera status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Arbiter admin socket.
    #[arg(long, env = "TESSERA_ADMIN_SOCKET", default_value = DEFAULT_ADMIN_SOCKET)]
    pub admin_socket: PathBuf,
}

/// GPU time window of `gpu_time_10s_ns`.
const WINDOW_NS: f64 = 10e9;

/// One allocation in the JSON output.
#[derive(Debug, Serialize, PartialEq)]
pub struct AllocationJson {
    /// Public id.
    pub id: String,
    /// GPU UUID (only for `unplaced` entries).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_uuid: Option<String>,
    /// Limit, bytes.
    pub memory_limit: u64,
    /// In use, bytes.
    pub memory_used: u64,
    /// Connected processes.
    pub processes: u32,
    /// Compute weight.
    pub share: u32,
    /// Cap, percent, or null.
    pub cap: Option<u32>,
    /// GPU time over the last 10 s, ns.
    pub gpu_time_10s_ns: u64,
    /// The same as a percentage of the GPU.
    pub gpu_percent_10s: f64,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Creation time, Unix seconds.
    pub created_unix: u64,
    /// Processes the arbiter's memory backstop killed or reported.
    pub enforced: u64,
}

/// One GPU in the JSON output.
#[derive(Debug, Serialize, PartialEq)]
pub struct GpuJson {
    /// NVML index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Memory, bytes.
    pub memory_total: u64,
    /// Sum of the memory limits of its allocations, bytes.
    pub memory_promised: u64,
    /// Sum of the shares of its allocations (at most 100).
    pub shares_promised: u32,
    /// Its allocations, oldest first.
    pub allocations: Vec<AllocationJson>,
}

/// The whole JSON document.
#[derive(Debug, Serialize, PartialEq)]
pub struct StatusJson {
    /// Every GPU of the node.
    pub gpus: Vec<GpuJson>,
    /// Allocations on GPUs the node no longer has.
    pub unplaced: Vec<AllocationJson>,
}

fn alloc_json(a: &AllocationStatus, with_gpu: bool) -> AllocationJson {
    AllocationJson {
        id: a.id.clone(),
        gpu_uuid: with_gpu.then(|| a.gpu_uuid.clone()),
        memory_limit: a.memory_limit,
        memory_used: a.memory_used,
        processes: a.processes,
        share: a.share,
        cap: a.cap,
        gpu_time_10s_ns: a.gpu_time_10s_ns,
        gpu_percent_10s: (a.gpu_time_10s_ns as f64 / WINDOW_NS * 1000.0).round() / 10.0,
        labels: a.labels.clone(),
        created_unix: a.created_unix,
        enforced: a.enforced,
    }
}

/// Groups allocations under their GPUs.
pub fn build(gpus: &[GpuInfo], allocs: &[AllocationStatus]) -> StatusJson {
    let gpus_json = gpus
        .iter()
        .map(|g| {
            let mine: Vec<_> = allocs.iter().filter(|a| a.gpu_uuid == g.uuid).collect();
            GpuJson {
                index: g.index,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                memory_total: g.memory_total,
                memory_promised: mine.iter().map(|a| a.memory_limit).sum(),
                shares_promised: mine.iter().map(|a| a.share).sum(),
                allocations: mine.iter().map(|a| alloc_json(a, false)).collect(),
            }
        })
        .collect();
    let unplaced = allocs
        .iter()
        .filter(|a| !gpus.iter().any(|g| g.uuid == a.gpu_uuid))
        .map(|a| alloc_json(a, true))
        .collect();
    StatusJson {
        gpus: gpus_json,
        unplaced,
    }
}

/// Bytes for people: `512 B`, `1.50 KiB`, `4.00 GiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (unit, size) in UNITS {
        if bytes >= size {
            return format!("{:.2} {unit}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

const WIDTH: usize = 78;

fn rule(out: &mut String, cols: &[usize]) {
    out.push('+');
    for c in cols {
        out.push_str(&"-".repeat(*c));
        out.push('+');
    }
    out.push('\n');
}

fn line(out: &mut String, text: &str) {
    let _ = writeln!(out, "| {text:<w$} |", w = WIDTH - 4);
}

fn row(out: &mut String, cols: &[usize], cells: &[String]) {
    out.push('|');
    for (c, cell) in cols.iter().zip(cells) {
        let _ = write!(out, " {cell:<w$} |", w = c - 2);
    }
    out.push('\n');
}

/// Renders the table.
pub fn table(s: &StatusJson) -> String {
    let cols = [10, 25, 7, 7, 6, 16];
    let mut out = String::new();
    rule(&mut out, &[WIDTH - 2]);
    if s.gpus.is_empty() {
        line(&mut out, "No GPU on this node");
        rule(&mut out, &[WIDTH - 2]);
    }
    for g in &s.gpus {
        line(
            &mut out,
            &format!("GPU {}  {}  {}", g.index, g.name, g.uuid),
        );
        line(
            &mut out,
            &format!(
                "memory {} total, {} promised    shares {} of 100 promised",
                human(g.memory_total),
                human(g.memory_promised),
                g.shares_promised
            ),
        );
        rule(&mut out, &cols);
        let head = [
            "ALLOC",
            "MEMORY USED / LIMIT",
            "PROCS",
            "SHARE",
            "CAP",
            "GPU TIME 10s",
        ];
        row(&mut out, &cols, &head.map(String::from));
        rule(&mut out, &cols);
        if g.allocations.is_empty() {
            row(
                &mut out,
                &cols,
                &["-", "no allocations", "", "", "", ""].map(String::from),
            );
        }
        for a in &g.allocations {
            row(&mut out, &cols, &alloc_cells(a));
        }
        rule(&mut out, &cols);
    }
    if !s.unplaced.is_empty() {
        line(&mut out, "Allocations on GPUs this node no longer has");
        rule(&mut out, &cols);
        for a in &s.unplaced {
            row(&mut out, &cols, &alloc_cells(a));
        }
        rule(&mut out, &cols);
    }
    let enforced: Vec<_> = s
        .gpus
        .iter()
        .flat_map(|g| &g.allocations)
        .chain(&s.unplaced)
        .filter(|a| a.enforced > 0)
        .collect();
    if !enforced.is_empty() {
        for a in enforced {
            line(
                &mut out,
                &format!(
                    "ENFORCED {}: {} process(es) killed or reported (arbiter log)",
                    a.id, a.enforced
                ),
            );
        }
        rule(&mut out, &[WIDTH - 2]);
    }
    out
}

fn alloc_cells(a: &AllocationJson) -> [String; 6] {
    [
        a.id.clone(),
        format!("{} / {}", human(a.memory_used), human(a.memory_limit)),
        a.processes.to_string(),
        a.share.to_string(),
        a.cap.map_or("-".into(), |c| format!("{c}%")),
        format!(
            "{:.2} s {:>5.1}%",
            a.gpu_time_10s_ns as f64 / 1e9,
            a.gpu_percent_10s
        ),
    ]
}

/// Runs `tessera status`; returns the process exit code.
pub fn main(args: StatusArgs) -> anyhow::Result<u8> {
    let sock = &args.admin_socket;
    let mut admin = AdminClient::connect(sock).map_err(|e| classify(e, sock))?;
    let gpus = admin.gpus().map_err(|e| classify(e, sock))?;
    let allocs = admin.list().map_err(|e| classify(e, sock))?;
    let s = build(&gpus, &allocs);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{}", table(&s));
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(i: u32) -> GpuInfo {
        GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            name: "Tessera Sim GPU 80GiB".into(),
            memory_total: 80 << 30,
        }
    }

    fn alloc(id: &str, uuid: &str, share: u32) -> AllocationStatus {
        AllocationStatus {
            id: id.into(),
            gpu_index: 0,
            gpu_uuid: uuid.into(),
            memory_limit: 4 << 30,
            memory_used: 3 << 29,
            processes: 2,
            share,
            cap: Some(share),
            gpu_time_10s_ns: 2_950_000_000,
            labels: BTreeMap::new(),
            created_unix: 5,
            enforced: 0,
            gpu_time_total_ns: 0,
            throttled_total_ns: 0,
            oom_refusals: 0,
            leases: 0,
        }
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1536), "1.50 KiB");
        assert_eq!(human(4 << 30), "4.00 GiB");
    }

    #[test]
    fn groups_allocations_under_gpus_and_totals_promises() {
        let s = build(
            &[gpu(0), gpu(1)],
            &[
                alloc("a", "GPU-0", 30),
                alloc("b", "GPU-0", 20),
                alloc("c", "GPU-9", 5),
            ],
        );
        assert_eq!(s.gpus[0].allocations.len(), 2);
        assert_eq!(s.gpus[0].shares_promised, 50);
        assert_eq!(s.gpus[0].memory_promised, 8 << 30);
        assert!(s.gpus[1].allocations.is_empty());
        assert_eq!(s.unplaced.len(), 1);
        assert_eq!(s.unplaced[0].gpu_uuid.as_deref(), Some("GPU-9"));
        assert_eq!(s.gpus[0].allocations[0].gpu_percent_10s, 29.5);
        let v: serde_json::Value = serde_json::to_value(&s).unwrap();
        assert_eq!(v["gpus"][0]["allocations"][0]["cap"], 30);
        assert!(v["gpus"][0]["allocations"][0].get("gpu_uuid").is_none());
    }

    #[test]
    fn backstop_actions_are_listed_under_the_table() {
        let gpus = [GpuInfo {
            index: 0,
            uuid: "GPU-a".into(),
            name: "Sim".into(),
            memory_total: 80 << 30,
        }];
        let mut a = alloc("c108be5a", "GPU-a", 20);
        let quiet = table(&build(&gpus, std::slice::from_ref(&a)));
        assert!(!quiet.contains("ENFORCED"), "{quiet}");
        a.enforced = 2;
        let t = table(&build(&gpus, &[a]));
        assert!(
            t.contains("ENFORCED c108be5a: 2 process(es) killed or reported"),
            "{t}"
        );
        assert!(t.lines().all(|l| l.chars().count() == WIDTH), "{t}");
    }

    #[test]
    fn table_lines_have_one_width() {
        let s = build(&[gpu(0), gpu(1)], &[alloc("a1b2c3d4", "GPU-0", 30)]);
        let t = table(&s);
        assert!(t.contains("a1b2c3d4"));
        assert!(t.contains("1.50 GiB / 4.00 GiB"));
        assert!(t.contains("no allocations"));
        for l in t.lines() {
            assert_eq!(l.chars().count(), WIDTH, "{l:?}");
        }
    }
}
