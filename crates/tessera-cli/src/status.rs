//! `tessera status`: every allocation per GPU, as a table like `nvidia-smi` or as JSON.
//!
//! The JSON (`--json`) is a stable interface, documented in docs/arbiter.md:
//! `{"gpus": [{index, uuid, name, memory_total, memory_promised, shares_promised,
//! allocations: [{id, memory_limit, memory_used, processes, share, cap, gpu_time_10s_ns,
//! gpu_percent_10s, labels, pod, claim, group, created_unix, enforced, owner_pid, orphaned,
//! tier, owner_uid, owner}]}],
//! "unplaced": [...]}`, where `unplaced`
//! lists allocations whose GPU is not on the node any more (same fields plus `gpu_uuid`), and
//! `pod` is `namespace/pod/container` from the labels the device plugin writes (or null), and
//! `claim` the DRA claim's `namespace/name` from the DRA plugin's label (or null), and `group`
//! the multi-GPU allocation it is one GPU's slice of (or null), `owner_uid` the uid that
//! created it and `owner` that user's name (null when the arbiter did not record it). The
//! table names the owner on a line under each allocation's row (the 78 columns have no room
//! for a column).
//!
//! `--watch [SECONDS]` redraws the table in place every SECONDS (2 by default) until Ctrl-C or
//! SIGTERM, with GPU use as a percentage of the GPU over the last 10 s.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;
use tessera_protocol::Tier;
pub(crate) use tessera_protocol::size::human_fixed as human;

use serde::Serialize;
use tessera_protocol::client::{AdminClient, ClientError};
use tessera_protocol::{
    AllocationStatus, GpuInfo, LABEL_CLAIM, LABEL_CONTAINER, LABEL_NAMESPACE, LABEL_POD,
};

use tessera_protocol::group::LABEL_GPU_GROUP;

use crate::CliError;
use crate::signals::StopSignals;

/// Arguments of `tessera status`.
#[derive(Debug, clap::Args)]
pub(crate) struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long, conflicts_with = "watch")]
    pub json: bool,
    /// Redraw in place every SECONDS (default 2) until Ctrl-C, like `watch nvidia-smi`.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
    pub watch: Option<f64>,
    /// The arbiter's admin or user socket (a user sees every allocation and its owner).
    #[command(flatten)]
    pub sockets: crate::endpoint::SocketArgs,
}

/// GPU time window of `gpu_time_10s_ns`.
const WINDOW_NS: f64 = 10e9;

/// One allocation in the JSON output.
#[derive(Debug, Serialize, PartialEq)]
pub(crate) struct AllocationJson {
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
    /// `namespace/pod/container` when the device plugin has named it.
    pub pod: Option<String>,
    /// `namespace/name` of the DRA claim it serves.
    pub claim: Option<String>,
    /// The multi-GPU allocation it is one GPU's slice of (the group id: its first slice's
    /// id), or null.
    pub group: Option<String>,
    /// Creation time, Unix seconds.
    pub created_unix: u64,
    /// Processes the arbiter's memory backstop killed or reported.
    pub enforced: u64,
    /// Pid of the process that owns it (`tessera run`), if one does.
    pub owner_pid: Option<i32>,
    /// Its owner is gone: the arbiter deletes it once none of its processes is left.
    pub orphaned: bool,
    /// Service tier: `latency` or `best-effort`.
    pub tier: String,
    /// The uid that created it (the kernel's word, recorded by the arbiter), or null.
    pub owner_uid: Option<u32>,
    /// That user's name (its uid when the system has no name for it), or null.
    pub owner: Option<String>,
}

/// One GPU in the JSON output.
#[derive(Debug, Serialize, PartialEq)]
pub(crate) struct GpuJson {
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
pub(crate) struct StatusJson {
    /// Every GPU of the node.
    pub gpus: Vec<GpuJson>,
    /// Allocations on GPUs the node no longer has.
    pub unplaced: Vec<AllocationJson>,
}

/// `namespace/pod/container` from the allocation's labels; `None` until the pod is known.
/// Parts the labels lack are left out.
pub(crate) fn pod_name(labels: &BTreeMap<String, String>) -> Option<String> {
    labels.get(LABEL_POD).filter(|p| !p.is_empty())?;
    let parts: Vec<&str> = [LABEL_NAMESPACE, LABEL_POD, LABEL_CONTAINER]
        .iter()
        .filter_map(|k| labels.get(*k).map(String::as_str))
        .filter(|v| !v.is_empty())
        .collect();
    Some(parts.join("/"))
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
        pod: pod_name(&a.labels),
        claim: a.labels.get(LABEL_CLAIM).filter(|c| !c.is_empty()).cloned(),
        group: a.labels.get(LABEL_GPU_GROUP).cloned(),
        created_unix: a.created_unix,
        enforced: a.enforced,
        owner_pid: a.owner.map(|o| o.pid),
        orphaned: a.orphaned,
        tier: a.tier.as_str().to_owned(),
        owner_uid: a.owner_uid,
        owner: a
            .owner_uid
            .map(|u| crate::endpoint::user_name(u).unwrap_or_else(|| u.to_string())),
    }
}

/// Groups allocations under their GPUs.
pub(crate) fn build(gpus: &[GpuInfo], allocs: &[AllocationStatus]) -> StatusJson {
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

/// How the GPU time column is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimeColumn {
    /// Seconds over the last 10 s and the percentage (plain `tessera status`).
    SecondsAndPercent,
    /// The rate only, as a percentage of the GPU (`--watch`).
    Rate,
}

/// Renders the table.
pub(crate) fn table(s: &StatusJson) -> String {
    table_with(s, TimeColumn::SecondsAndPercent)
}

/// Renders the table with the chosen GPU time column.
pub(crate) fn table_with(s: &StatusJson, time: TimeColumn) -> String {
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
            match time {
                TimeColumn::SecondsAndPercent => "GPU TIME 10s",
                TimeColumn::Rate => "GPU % (10s)",
            },
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
            alloc_rows(&mut out, &cols, a, time);
        }
        rule(&mut out, &cols);
    }
    if !s.unplaced.is_empty() {
        line(&mut out, "Allocations on GPUs this node no longer has");
        rule(&mut out, &cols);
        for a in &s.unplaced {
            alloc_rows(&mut out, &cols, a, time);
        }
        rule(&mut out, &cols);
    }
    group_tables(&mut out, &cols, s, time);
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
    let orphaned: Vec<_> = s
        .gpus
        .iter()
        .flat_map(|g| &g.allocations)
        .chain(&s.unplaced)
        .filter(|a| a.orphaned)
        .collect();
    if !orphaned.is_empty() {
        for a in orphaned {
            let owner = a.owner_pid.map_or(String::new(), |p| format!(" (pid {p})"));
            line(
                &mut out,
                &format!(
                    "ORPHANED {}: its owner{owner} is gone; deleted once its {} process(es) \
                     end, or now with `tessera delete {} --force`",
                    a.id, a.processes, a.id
                ),
            );
        }
        rule(&mut out, &[WIDTH - 2]);
    }
    out
}

/// One table per multi-GPU allocation: a row per GPU it spans (each GPU's own limit, use,
/// share and time), so its slices, listed under their GPUs above, are also seen together.
fn group_tables(out: &mut String, cols: &[usize], s: &StatusJson, time: TimeColumn) {
    let mut groups: BTreeMap<&str, Vec<(u32, &AllocationJson)>> = BTreeMap::new();
    for g in &s.gpus {
        for a in &g.allocations {
            if let Some(id) = &a.group {
                groups.entry(id).or_default().push((g.index, a));
            }
        }
    }
    for (id, slices) in groups {
        line(
            out,
            &format!("Allocation {id} on {} GPUs (limits per GPU)", slices.len()),
        );
        rule(out, cols);
        for (index, a) in slices {
            let mut cells = alloc_cells(a, time);
            cells[0] = format!("GPU {index}");
            row(out, cols, &cells);
        }
        rule(out, cols);
    }
}

/// An allocation's row, and under it the pod (or DRA claim) it serves when known.
fn alloc_rows(out: &mut String, cols: &[usize], a: &AllocationJson, time: TimeColumn) {
    row(out, cols, &alloc_cells(a, time));
    if let Some(pod) = &a.pod {
        line(out, &fit(&format!("  pod {pod}"), WIDTH - 4));
    }
    if let Some(claim) = &a.claim {
        line(out, &fit(&format!("  claim {claim}"), WIDTH - 4));
    }
    if a.tier == Tier::Latency.as_str() {
        line(
            out,
            "  tier latency (served first; its share is also its ceiling)",
        );
    }
    if let (Some(name), Some(uid)) = (&a.owner, a.owner_uid) {
        line(out, &fit(&format!("  owner {name} (uid {uid})"), WIDTH - 4));
    }
}

/// `text` cut to `width` characters, keeping the end (a pod name's tail tells pods apart).
fn fit(text: &str, width: usize) -> String {
    let n = text.chars().count();
    if n <= width {
        return text.to_owned();
    }
    let tail: String = text.chars().skip(n - width + 1).collect();
    format!("~{tail}")
}

fn alloc_cells(a: &AllocationJson, time: TimeColumn) -> [String; 6] {
    let gpu = match time {
        TimeColumn::SecondsAndPercent => format!(
            "{:.2} s {:>5.1}%",
            a.gpu_time_10s_ns as f64 / 1e9,
            a.gpu_percent_10s
        ),
        TimeColumn::Rate => format!("{:>5.1}%", a.gpu_percent_10s),
    };
    [
        a.id.clone(),
        format!("{} / {}", human(a.memory_used), human(a.memory_limit)),
        a.processes.to_string(),
        a.share.to_string(),
        a.cap.map_or("-".into(), |c| format!("{c}%")),
        gpu,
    ]
}

/// One look at the arbiter, over a fresh connection (a restarted arbiter is simply found
/// again by the next look).
fn fetch(sock: &std::path::Path) -> Result<StatusJson, ClientError> {
    let mut admin = AdminClient::connect(sock)?;
    let gpus = admin.gpus()?;
    let allocs = admin.list()?;
    Ok(build(&gpus, &allocs))
}

/// Clears the screen and moves the cursor home, as `watch` does before each frame.
pub(crate) const CLEAR: &str = "\x1b[H\x1b[2J";
/// Hides the cursor while frames are drawn.
const HIDE_CURSOR: &str = "\x1b[?25l";
/// Shows it again: the terminal as it was.
pub(crate) const SHOW_CURSOR: &str = "\x1b[?25h";

/// `HH:MM:SS` (UTC) of a Unix time.
fn clock(unix: u64) -> String {
    let s = unix % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// One `--watch` frame: the header line and the table (or why there is none), starting with
/// [`CLEAR`]. `now_unix` is a parameter so frames can be checked.
pub(crate) fn frame(status: Result<&StatusJson, String>, every: Duration, now_unix: u64) -> String {
    let mut out = String::from(CLEAR);
    let _ = writeln!(
        out,
        "Every {:.1}s: tessera status    {} UTC    (Ctrl-C to quit)",
        every.as_secs_f64(),
        clock(now_unix)
    );
    match status {
        Ok(s) => out.push_str(&table_with(s, TimeColumn::Rate)),
        Err(e) => {
            let _ = writeln!(out, "arbiter unreachable: {e}");
        }
    }
    out
}

/// `--watch`: a frame every `every` until SIGINT or SIGTERM; exits 0 with the cursor shown.
fn watch(sock: &std::path::Path, every: Duration) -> Result<u8, CliError> {
    use std::io::Write as _;
    // Blocked before the first frame, so a signal at any moment ends the loop cleanly.
    let signals = StopSignals::block().map_err(CliError::Signals)?;
    // The first look decides: no arbiter at all is the same error as plain `status`.
    let first = fetch(sock).map_err(|e| CliError::arbiter(e, sock))?;
    let mut stdout = std::io::stdout().lock();
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    };
    let mut text = format!("{HIDE_CURSOR}{}", frame(Ok(&first), every, now()));
    loop {
        // A closed pipe (`| head`) ends the watch like Ctrl-C.
        if stdout
            .write_all(text.as_bytes())
            .and_then(|()| stdout.flush())
            .is_err()
        {
            break;
        }
        if signals.wait(every).is_some() {
            break;
        }
        let s = fetch(sock).map_err(|e| e.to_string());
        text = frame(s.as_ref().map_err(Clone::clone), every, now());
    }
    let _ = writeln!(stdout, "{SHOW_CURSOR}");
    let _ = stdout.flush();
    Ok(0)
}

/// Runs `tessera status`; returns the process exit code.
pub(crate) fn main(args: StatusArgs) -> Result<u8, CliError> {
    let endpoint = args.sockets.endpoint();
    let sock = &endpoint.path;
    if let Some(secs) = args.watch {
        let every = Duration::try_from_secs_f64(secs)
            .ok()
            .filter(|d| *d >= Duration::from_millis(100))
            .ok_or_else(|| CliError::usage(format!("--watch {secs}: at least 0.1 seconds")))?;
        return watch(sock, every);
    }
    let s = fetch(sock).map_err(|e| CliError::arbiter(e, sock))?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&s).map_err(anyhow::Error::from)?
        );
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
            created_unix: 5,
            ..Default::default()
        }
    }

    #[test]
    fn pods_are_named_from_labels() {
        let mut l = BTreeMap::new();
        assert_eq!(pod_name(&l), None);
        l.insert(LABEL_NAMESPACE.to_string(), "team".to_string());
        assert_eq!(pod_name(&l), None, "no pod, no name");
        l.insert(LABEL_POD.to_string(), "train-0".to_string());
        assert_eq!(pod_name(&l).as_deref(), Some("team/train-0"));
        l.insert(LABEL_CONTAINER.to_string(), "main".to_string());
        assert_eq!(pod_name(&l).as_deref(), Some("team/train-0/main"));

        let mut a = alloc("a1b2c3d4", "GPU-0", 30);
        a.labels = l;
        let t = table(&build(&[gpu(0)], std::slice::from_ref(&a)));
        assert!(t.contains("pod team/train-0/main"), "{t}");
        // A long name is cut from the front and the table keeps its width.
        a.labels
            .insert(LABEL_POD.to_string(), format!("{}-end", "x".repeat(200)));
        let t = table(&build(&[gpu(0)], &[a]));
        assert!(t.contains("x-end/main |"), "{t}");
        assert!(t.lines().all(|l| l.chars().count() == WIDTH), "{t}");
    }

    #[test]
    fn dra_claims_are_named_from_their_label() {
        let mut a = alloc("a1b2c3d4", "GPU-0", 30);
        a.labels
            .insert(LABEL_CLAIM.to_string(), "team-a/train".to_string());
        let s = build(&[gpu(0)], std::slice::from_ref(&a));
        assert_eq!(
            s.gpus[0].allocations[0].claim.as_deref(),
            Some("team-a/train")
        );
        let t = table(&s);
        assert!(t.contains("claim team-a/train"), "{t}");
        let none = build(&[gpu(0)], &[alloc("a1b2c3d4", "GPU-0", 30)]);
        assert_eq!(none.gpus[0].allocations[0].claim, None);
    }

    #[test]
    fn the_tier_is_in_the_json_and_a_latency_one_in_the_table() {
        let mut a = alloc("a1b2c3d4", "GPU-0", 30);
        a.tier = Tier::Latency;
        let b = alloc("b1b2c3d4", "GPU-0", 20);
        let s = build(&[gpu(0)], &[a, b]);
        let tiers: Vec<&str> = s.gpus[0]
            .allocations
            .iter()
            .map(|x| x.tier.as_str())
            .collect();
        assert_eq!(tiers, ["latency", "best-effort"]);
        let t = table(&s);
        assert_eq!(t.matches("tier latency").count(), 1, "{t}");
    }

    #[test]
    fn watch_frames_show_the_rate_and_the_time() {
        let s = build(&[gpu(0)], &[alloc("a1b2c3d4", "GPU-0", 30)]);
        let f = frame(Ok(&s), Duration::from_secs(2), 86_400 + 3723);
        assert!(f.starts_with(CLEAR), "{f:?}");
        assert!(
            f.contains("Every 2.0s: tessera status    01:02:03 UTC"),
            "{f}"
        );
        assert!(f.contains("GPU % (10s)"), "{f}");
        let row = f.lines().find(|l| l.contains("a1b2c3d4")).unwrap();
        assert!(row.contains(" 29.5%"), "{row}");
        assert!(!row.contains("2.95 s"), "{row}");
        let f = frame(Err("gone".into()), Duration::from_millis(500), 0);
        assert!(
            f.contains("Every 0.5s") && f.contains("arbiter unreachable: gone"),
            "{f}"
        );
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
    fn a_multi_gpu_allocation_has_a_row_per_gpu_grouped() {
        let mut a = alloc("a1b2c3d4", "GPU-0", 30);
        let mut b = alloc("e5f6a7b8", "GPU-1", 30);
        b.memory_limit = 20 << 30;
        for x in [&mut a, &mut b] {
            x.labels.insert(LABEL_GPU_GROUP.into(), "a1b2c3d4".into());
        }
        let lone = alloc("0badcafe", "GPU-1", 10);
        let s = build(&[gpu(0), gpu(1)], &[a, b, lone]);
        assert_eq!(s.gpus[1].allocations[0].group.as_deref(), Some("a1b2c3d4"));
        assert_eq!(s.gpus[1].allocations[1].group, None);
        let t = table(&s);
        let at = t
            .find("Allocation a1b2c3d4 on 2 GPUs")
            .unwrap_or_else(|| panic!("{t}"));
        let group: Vec<&str> = t[at..].lines().filter(|l| l.contains("| GPU ")).collect();
        assert_eq!(group.len(), 2, "{t}");
        assert!(
            group[0].contains("| GPU 0 ") && group[0].contains("/ 4.00 GiB"),
            "{t}"
        );
        assert!(
            group[1].contains("| GPU 1 ") && group[1].contains("/ 20.00 GiB"),
            "{t}"
        );
        assert!(!t[at..].contains("0badcafe"), "{t}");
        for l in t.lines() {
            assert_eq!(l.chars().count(), WIDTH, "{l:?}");
        }
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
