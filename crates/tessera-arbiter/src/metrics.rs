//! Prometheus metrics: `GET /metrics` on `--metrics-addr` (names, types and labels in
//! docs/metrics.md).
//!
//! Everything per allocation and per GPU is read from the arbiter's state when a scrape comes
//! ([`ArbiterCollector`]): a deleted allocation's series are gone at the next scrape, and the
//! tenant fast path keeps no metric of its own beyond a few relaxed atomic increments: refusals
//! ([`crate::stats::AllocCounters`]) and requests by type ([`RequestStats`]). GPU time, waits and leases are
//! counted by the schedulers under the lock they already hold.
//!
//! The text is produced by the `prometheus-client` crate (Prometheus text format 0.0.4); the
//! HTTP side is `tessera-exporter`'s bounded server on the daemon's runtime, so a slow or
//! broken scraper costs at most a few tasks and never touches a tenant's thread.

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeMetric, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;

use crate::admission::Admission;
use crate::state::Arbiter;
use crate::stats::{AllocSample, EnforceReason, GpuSample, RequestKind, RequestStats, Snapshot};

/// Default address of the metrics endpoint (dcgm-exporter uses 9400).
pub(crate) const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9464";

/// Errors of the metrics endpoint.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// `--metrics-addr` is neither `none` nor an address.
    #[error("metrics address {0:?} is not HOST:PORT or `none`")]
    BadAddress(String),
    /// The listening socket could not be bound.
    #[error("cannot listen for metrics on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
}

/// `--metrics-addr`: where `/metrics` is served, or nowhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsAddr {
    /// `none`: no endpoint.
    Off,
    /// Listen here (port 0: any free port, logged).
    At(SocketAddr),
}

impl FromStr for MetricsAddr {
    type Err = MetricsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match tessera_exporter::parse_addr(s) {
            Ok(None) => Ok(Self::Off),
            Ok(Some(a)) => Ok(Self::At(a)),
            Err(_) => Err(MetricsError::BadAddress(s.to_owned())),
        }
    }
}

/// The arbiter's metrics, read from its state at every scrape.
#[derive(Debug)]
pub(crate) struct ArbiterCollector {
    arb: Arc<Arbiter>,
    tenant_admission: Option<Arc<Admission>>,
    backstop: Option<Arc<crate::backstop::Counters>>,
}

impl ArbiterCollector {
    /// A collector of `arb`; `tenant_admission` gives the connection count (absent: 0).
    pub(crate) fn new(arb: Arc<Arbiter>, tenant_admission: Option<Arc<Admission>>) -> Self {
        Self {
            arb,
            tenant_admission,
            backstop: None,
        }
    }

    /// Also exposes the backstop's `counters` (its polls: a test waits for them before it
    /// says the backstop left something alone).
    pub(crate) fn with_backstop(mut self, counters: Arc<crate::backstop::Counters>) -> Self {
        self.backstop = Some(counters);
        self
    }
}

/// Labels of one allocation's series.
fn alloc_labels(a: &AllocSample) -> Vec<(&'static str, String)> {
    let mut l = vec![
        ("allocation", a.id.clone()),
        ("gpu", a.gpu_index.to_string()),
        ("gpu_uuid", a.gpu_uuid.clone()),
    ];
    for (name, v) in ["namespace", "pod", "container"].into_iter().zip(&a.pod) {
        if let Some(v) = v {
            l.push((name, v.clone()));
        }
    }
    l
}

fn gpu_labels(g: &GpuSample) -> Vec<(&'static str, String)> {
    vec![("gpu", g.index.to_string()), ("gpu_uuid", g.uuid.clone())]
}

const NS: f64 = 1e9;

/// One family: a descriptor and one series per item.
/// Values are `u64` for bytes and counts (written as integers), `f64` for seconds and ratios.
fn family<T, L, V>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    kind: MetricType,
    items: &[T],
    series: impl Fn(&T) -> (L, V),
) -> Result<(), std::fmt::Error>
where
    L: prometheus_client::encoding::EncodeLabelSet,
    V: EncodeGaugeValue + EncodeCounterValue + std::fmt::Debug,
{
    let mut m = enc.encode_descriptor(name, help, unit.as_ref(), kind)?;
    for it in items {
        let (labels, v) = series(it);
        let e = m.encode_family(&labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(e)?,
            _ => ConstGauge::new(v).encode(e)?,
        }
    }
    Ok(())
}

/// Encodes `snap` and the request statistics (the whole exposition but the build info).
pub(crate) fn encode_snapshot(
    enc: &mut DescriptorEncoder,
    snap: &Snapshot,
    requests: &RequestStats,
) -> Result<(), std::fmt::Error> {
    use MetricType::{Counter, Gauge};
    let a = &snap.allocs;
    let al = alloc_labels;
    family(
        enc,
        "tessera_allocation_memory_limit",
        "Memory limit of the allocation.",
        Some(Unit::Bytes),
        Gauge,
        a,
        |x| (al(x), x.memory_limit),
    )?;
    family(
        enc,
        "tessera_allocation_memory_used",
        "Device memory reserved in the ledger by the allocation's processes.",
        Some(Unit::Bytes),
        Gauge,
        a,
        |x| (al(x), x.memory_used),
    )?;
    family(
        enc,
        "tessera_allocation_share_ratio",
        "Compute share of the allocation (share / 100).",
        None,
        Gauge,
        a,
        |x| (al(x), f64::from(x.share) / 100.0),
    )?;
    family(
        enc,
        "tessera_allocation_cap_ratio",
        "Compute cap of the allocation (cap / 100; 1 when uncapped).",
        None,
        Gauge,
        a,
        |x| (al(x), f64::from(x.cap.unwrap_or(100)) / 100.0),
    )?;
    family(
        enc,
        "tessera_allocation_latency_tier",
        "1 when the allocation is in the latency tier (served first within its share), 0 when best-effort.",
        None,
        Gauge,
        a,
        |x| {
            (
                al(x),
                f64::from(u8::from(x.tier == tessera_protocol::Tier::Latency)),
            )
        },
    )?;
    family(
        enc,
        "tessera_allocation_gpu",
        "GPU time charged to the allocation: its leases (the longer of time held and busy time reported) and GPU time used outside leases.",
        Some(Unit::Seconds),
        Counter,
        a,
        |x| (al(x), x.sched.gpu_ns as f64 / NS),
    )?;
    family(
        enc,
        "tessera_allocation_gpu_busy",
        "GPU time the allocation's processes used by NVML's per-process utilisation, as the \
         backstop reads it every interval (no tenant report involved; 0 with the backstop off).",
        Some(Unit::Seconds),
        Counter,
        a,
        |x| (al(x), x.gpu_busy_ns as f64 / NS),
    )?;
    family(
        enc,
        "tessera_allocation_throttled",
        "Time the allocation's processes waited for a compute lease, summed over processes.",
        Some(Unit::Seconds),
        Counter,
        a,
        |x| (al(x), x.sched.throttled_ns as f64 / NS),
    )?;
    family(
        enc,
        "tessera_allocation_leases",
        "Compute leases granted to the allocation's processes.",
        None,
        Counter,
        a,
        |x| (al(x), x.sched.leases),
    )?;
    family(
        enc,
        "tessera_allocation_oom_refusals",
        "Reservations refused at the memory limit (each an out-of-memory error in a tenant).",
        None,
        Counter,
        a,
        |x| (al(x), x.oom_refusals),
    )?;
    family(
        enc,
        "tessera_allocation_processes",
        "Processes connected for the allocation.",
        None,
        Gauge,
        a,
        |x| (al(x), u64::from(x.processes)),
    )?;
    let per_reason: Vec<(&AllocSample, EnforceReason)> = a
        .iter()
        .flat_map(|x| EnforceReason::ALL.map(|r| (x, r)))
        .collect();
    family(
        enc,
        "tessera_allocation_enforcement_actions",
        "Processes of the allocation the backstop killed or reported, by reason.",
        None,
        Counter,
        &per_reason,
        |(x, r)| {
            let mut l = al(x);
            l.push(("reason", r.as_str().to_owned()));
            (l, x.enforced[*r as usize])
        },
    )?;
    let present: Vec<&GpuSample> = snap
        .gpus
        .iter()
        .filter(|g| g.memory_total.is_some())
        .collect();
    let g = &snap.gpus;
    family(
        enc,
        "tessera_gpu_memory_total",
        "Memory of the GPU.",
        Some(Unit::Bytes),
        Gauge,
        &present,
        |x| (gpu_labels(x), x.memory_total.unwrap_or(0)),
    )?;
    family(
        enc,
        "tessera_gpu_memory_promised",
        "Memory promised to the GPU's allocations (sum of limits).",
        Some(Unit::Bytes),
        Gauge,
        g,
        |x| (gpu_labels(x), x.memory_promised),
    )?;
    family(
        enc,
        "tessera_gpu_shares_promised_ratio",
        "Compute shares promised on the GPU (sum of shares / 100).",
        None,
        Gauge,
        g,
        |x| (gpu_labels(x), f64::from(x.shares) / 100.0),
    )?;
    family(
        enc,
        "tessera_gpu_busy",
        "GPU time charged on the GPU (all allocations, deleted ones included).",
        Some(Unit::Seconds),
        Counter,
        g,
        |x| (gpu_labels(x), x.busy_ns as f64 / NS),
    )?;
    family(
        enc,
        "tessera_gpu_allocations",
        "Allocations on the GPU.",
        None,
        Gauge,
        g,
        |x| (gpu_labels(x), u64::from(x.allocations)),
    )?;
    family(
        enc,
        "tessera_gpu_healthy",
        "1 when the GPU was discovered at start-up, 0 when allocations name a GPU that is not present.",
        None,
        Gauge,
        g,
        |x| (gpu_labels(x), u64::from(x.memory_total.is_some())),
    )?;
    family(
        enc,
        "tessera_arbiter_tenant_connections",
        "Admitted tenant connections.",
        None,
        Gauge,
        &[snap.tenant_connections],
        |n| (Vec::<(&str, &str)>::new(), *n),
    )?;
    family(
        enc,
        "tessera_arbiter_requests",
        "Tenant requests handled, by type.",
        None,
        Counter,
        &RequestKind::ALL,
        |k| ([("type", k.as_str())], requests.count(*k)),
    )?;
    let mut m = enc.encode_descriptor(
        "tessera_arbiter_request_duration",
        "Time the arbiter took to handle a tenant request, by type (a lease request: until it was queued, not granted).",
        Some(&Unit::Seconds),
        MetricType::Histogram,
    )?;
    for k in RequestKind::ALL {
        let labels = [("type", k.as_str())];
        let mut e = m.encode_family(&labels)?;
        let (buckets, sum_ns) = requests.histogram(k);
        // The count is the sum of the buckets read here, so the exposition stays consistent
        // while requests are counted concurrently.
        let count = buckets.iter().map(|b| b.1).sum();
        e.encode_histogram::<NoLabelSet>(sum_ns as f64 / NS, count, &buckets, None)?;
    }
    Ok(())
}

impl Collector for ArbiterCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut snap = self.arb.snapshot();
        snap.tenant_connections = self
            .tenant_admission
            .as_ref()
            .map_or(0, |a| a.current().1 as u64);
        encode_snapshot(&mut enc, &snap, self.arb.requests())?;
        // No series with the backstop off (`--backstop-interval-ms 0`).
        let polls: Vec<u64> = self
            .backstop
            .iter()
            .map(|c| c.polls.load(std::sync::atomic::Ordering::Relaxed))
            .collect();
        family(
            &mut enc,
            "tessera_arbiter_backstop_polls",
            "Polls of NVML the backstop has done (failed ones included).",
            None,
            MetricType::Counter,
            &polls,
            |n| (Vec::<(&str, &str)>::new(), *n),
        )?;
        let info = Info::new([("version", env!("CARGO_PKG_VERSION"))]);
        let m = enc.encode_descriptor(
            "tessera_arbiter_build",
            "Version of the running arbiter (always 1).",
            None,
            info.metric_type(),
        )?;
        info.encode(m)
    }
}

/// The registry of an arbiter's metrics.
#[cfg(test)]
pub(crate) fn registry(arb: Arc<Arbiter>, tenant_admission: Option<Arc<Admission>>) -> Registry {
    registry_of(ArbiterCollector::new(arb, tenant_admission))
}

/// The registry of `collector`.
pub(crate) fn registry_of(collector: ArbiterCollector) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(collector));
    r
}

/// The whole exposition of `registry`, Prometheus text format 0.0.4.
pub(crate) fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(64 * 1024);
    if prometheus_client::encoding::prometheus_text::encode(&mut out, registry).is_err() {
        // Only a formatter error gets here (never with a String); say so rather than serve
        // half an exposition.
        out.clear();
        let _ = writeln!(out, "# encoding failed");
    }
    out
}

/// Binds `addr` for [`serve`].
pub(crate) async fn bind(addr: SocketAddr) -> Result<TcpListener, MetricsError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes (`tessera_exporter::serve`:
/// bounded scrapers, a deadline per connection).
pub(crate) async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let text: tessera_exporter::Render = Arc::new(move || render(&registry));
    tessera_exporter::serve(listener, text, shutdown).await;
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::io::{Read, Write};
    use std::time::Duration;

    use tessera_protocol::{CreateAllocation, GpuSelector};

    use super::*;
    use crate::scheduler::SchedulerParams;
    use crate::store::Store;

    const GIB: u64 = 1 << 30;

    fn arbiter(dir: &std::path::Path) -> Arc<Arbiter> {
        let gpus = crate::state::test_gpus(2);
        Arbiter::new(gpus, Store::open(dir).unwrap(), SchedulerParams::default()).unwrap()
    }

    fn create(gpu: u32, share: u32, cap: Option<u32>, labels: &[(&str, &str)]) -> CreateAllocation {
        CreateAllocation {
            gpu: GpuSelector::Index(gpu),
            memory_limit: GIB,
            share,
            cap,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    /// The sample lines of an exposition whose name is `name`, as (labels, value).
    fn series<'t>(text: &'t str, name: &str) -> Vec<(&'t str, f64)> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (head, value) = l.rsplit_once(' ')?;
                let (n, labels) = match head.split_once('{') {
                    Some((n, rest)) => (n, rest.trim_end_matches('}')),
                    None => (head, ""),
                };
                (n == name).then(|| (labels, value.parse().unwrap()))
            })
            .collect()
    }

    fn one(text: &str, name: &str, labels_contain: &str) -> f64 {
        let s: Vec<_> = series(text, name)
            .into_iter()
            .filter(|(l, _)| l.contains(labels_contain))
            .collect();
        assert_eq!(s.len(), 1, "{name} {{{labels_contain}}} in:\n{text}");
        s[0].1
    }

    #[test]
    fn metrics_addr_parses_none_and_addresses() {
        assert_eq!("none".parse::<MetricsAddr>().unwrap(), MetricsAddr::Off);
        assert_eq!(
            DEFAULT_METRICS_ADDR.parse::<MetricsAddr>().unwrap(),
            MetricsAddr::At("127.0.0.1:9464".parse().unwrap())
        );
        // `$(POD_IP):9464` on an IPv6 cluster.
        assert_eq!(
            "fd00::5:9464".parse::<MetricsAddr>().unwrap(),
            MetricsAddr::At("[fd00::5]:9464".parse().unwrap())
        );
        assert!("localhost".parse::<MetricsAddr>().is_err());
    }

    #[test]
    fn every_series_has_its_name_labels_and_value_and_a_deleted_allocation_vanishes() {
        let dir = tempfile::tempdir().unwrap();
        let arb = arbiter(dir.path());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let pod = [
            (tessera_protocol::LABEL_NAMESPACE, "ml"),
            (tessera_protocol::LABEL_POD, "trainer-0"),
            (tessera_protocol::LABEL_CONTAINER, "main"),
        ];
        let (token_a, a) = rt.block_on(arb.create(create(0, 30, None, &pod))).unwrap();
        let (_, b) = rt
            .block_on(arb.create(create(0, 70, Some(50), &[])))
            .unwrap();
        let (_, c) = rt
            .block_on(arb.create_tiered(
                create(1, 10, None, &[]),
                None,
                tessera_protocol::Tier::Latency,
            ))
            .unwrap();
        // A tenant of A holds 100 MiB, is refused twice, and was killed once by the backstop.
        let bind = arb
            .attach_tenant(
                &token_a,
                1,
                Some(crate::peer::Peer::without_pidfd(crate::peer::ProcId {
                    pid: 4242,
                    start: 1,
                })),
            )
            .unwrap();
        arb.with_ledger(|l| l.reserve(bind.key, 1, 100 << 20))
            .unwrap();
        bind.counters.refused();
        bind.counters.refused();
        arb.note_enforced(&a.id, EnforceReason::MemoryOverLimit);
        arb.requests()
            .observe(RequestKind::Ping, Duration::from_micros(7));
        let registry = registry(Arc::clone(&arb), None);
        let text = render(&registry);

        let la = format!("allocation=\"{}\"", a.id);
        assert_eq!(
            one(&text, "tessera_allocation_memory_limit_bytes", &la),
            GIB as f64
        );
        assert_eq!(
            one(&text, "tessera_allocation_memory_used_bytes", &la),
            (100 << 20) as f64
        );
        assert_eq!(one(&text, "tessera_allocation_share_ratio", &la), 0.3);
        assert_eq!(one(&text, "tessera_allocation_cap_ratio", &la), 1.0);
        let lb = format!("allocation=\"{}\"", b.id);
        assert_eq!(one(&text, "tessera_allocation_cap_ratio", &lb), 0.5);
        let lc = format!("allocation=\"{}\"", c.id);
        assert_eq!(one(&text, "tessera_allocation_latency_tier", &la), 0.0);
        assert_eq!(one(&text, "tessera_allocation_latency_tier", &lc), 1.0);
        assert_eq!(
            one(&text, "tessera_allocation_oom_refusals_total", &la),
            2.0
        );
        assert_eq!(one(&text, "tessera_allocation_processes", &la), 1.0);
        assert_eq!(one(&text, "tessera_allocation_leases_total", &la), 0.0);
        assert_eq!(one(&text, "tessera_allocation_gpu_seconds_total", &la), 0.0);
        assert_eq!(
            one(&text, "tessera_allocation_throttled_seconds_total", &la),
            0.0
        );
        let enforced = format!(
            "{la},gpu=\"0\",gpu_uuid=\"GPU-0\",namespace=\"ml\",pod=\"trainer-0\",container=\"main\",reason=\"memory_over_limit\""
        );
        assert_eq!(
            one(
                &text,
                "tessera_allocation_enforcement_actions_total",
                &enforced
            ),
            1.0
        );
        assert_eq!(
            one(
                &text,
                "tessera_allocation_enforcement_actions_total",
                &format!(
                    "{la},gpu=\"0\",gpu_uuid=\"GPU-0\",namespace=\"ml\",pod=\"trainer-0\",container=\"main\",reason=\"compute_bypass\""
                )
            ),
            0.0
        );
        // B has no pod labels: none are written, not even empty ones.
        let (b_labels, _) = series(&text, "tessera_allocation_processes")
            .into_iter()
            .find(|(l, _)| l.contains(&lb))
            .unwrap();
        assert_eq!(b_labels, format!("{lb},gpu=\"0\",gpu_uuid=\"GPU-0\""));
        // Per GPU.
        assert_eq!(
            one(&text, "tessera_gpu_memory_total_bytes", "gpu=\"1\""),
            (80 * GIB) as f64
        );
        assert_eq!(
            one(&text, "tessera_gpu_memory_promised_bytes", "gpu=\"0\""),
            (2 * GIB) as f64
        );
        assert_eq!(
            one(&text, "tessera_gpu_shares_promised_ratio", "gpu=\"0\""),
            1.0
        );
        assert_eq!(one(&text, "tessera_gpu_allocations", "gpu=\"1\""), 1.0);
        assert_eq!(one(&text, "tessera_gpu_healthy", "gpu_uuid=\"GPU-1\""), 1.0);
        assert_eq!(
            one(&text, "tessera_gpu_busy_seconds_total", "gpu=\"0\""),
            0.0
        );
        // The arbiter itself.
        assert_eq!(
            one(&text, "tessera_arbiter_requests_total", "type=\"ping\""),
            1.0
        );
        assert_eq!(
            one(&text, "tessera_arbiter_requests_total", "type=\"reserve\""),
            0.0
        );
        assert_eq!(
            one(
                &text,
                "tessera_arbiter_request_duration_seconds_bucket",
                "type=\"ping\",le=\"1e-05\""
            ),
            1.0
        );
        assert_eq!(
            one(
                &text,
                "tessera_arbiter_request_duration_seconds_bucket",
                "type=\"ping\",le=\"5e-06\""
            ),
            0.0
        );
        assert_eq!(
            one(
                &text,
                "tessera_arbiter_request_duration_seconds_count",
                "type=\"ping\""
            ),
            1.0
        );
        assert_eq!(one(&text, "tessera_arbiter_tenant_connections", ""), 0.0);
        assert_eq!(
            one(
                &text,
                "tessera_arbiter_build_info",
                &format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))
            ),
            1.0
        );
        for name in [
            "tessera_allocation_gpu_seconds_total",
            "tessera_allocation_oom_refusals_total",
            "tessera_gpu_busy_seconds_total",
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} counter\n")),
                "{name} typed as a counter:\n{text}"
            );
        }

        // Deleted: every series of C goes, and so does A's, even with a process still
        // attached (the account drains, the series do not linger).
        rt.block_on(arb.delete(&c.id)).unwrap();
        rt.block_on(arb.delete(&a.id)).unwrap();
        let text = render(&registry);
        assert!(!text.contains(&c.id), "{text}");
        assert!(!text.contains(&a.id), "{text}");
        assert!(text.contains(&b.id));
        assert_eq!(one(&text, "tessera_gpu_allocations", "gpu=\"1\""), 0.0);
        assert_eq!(
            one(&text, "tessera_gpu_memory_promised_bytes", "gpu=\"0\""),
            GIB as f64
        );
    }

    /// Sends `request` to `addr` and returns the whole answer.
    fn http(addr: SocketAddr, request: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn the_endpoint_serves_metrics_and_404_elsewhere_and_survives_a_silent_client() {
        let dir = tempfile::tempdir().unwrap();
        let arb = arbiter(dir.path());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt.block_on(bind("127.0.0.1:0".parse().unwrap())).unwrap();
        let addr = listener.local_addr().unwrap();
        let reg = Arc::new(registry(arb, None));
        rt.spawn(serve(listener, reg, std::future::pending()));
        // Clients that connect and say nothing hold a slot each, not the server.
        let _silent: Vec<_> = (0..tessera_exporter::MAX_SCRAPERS - 3)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        let ok = http(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        );
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(
            ok.contains("content-type: text/plain; version=0.0.4"),
            "{ok}"
        );
        assert!(ok.contains("# TYPE tessera_gpu_healthy gauge"), "{ok}");
        let missing = http(
            addr,
            "GET /other HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        );
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = http(
            addr,
            "POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        );
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    }
}
