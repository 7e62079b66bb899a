//! The plugin's own Prometheus metrics (`tessera_plugin_*`, listed in docs/metrics.md), served
//! at `/metrics` in the Prometheus text format by `tessera-exporter`.
//!
//! The counters are bumped where things happen (registration, `Allocate`, stale clean-up, pod
//! labels); the unit gauge follows the GPU snapshot. Rendering walks the registry on each
//! scrape, so a scrape costs nothing between scrapes.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Where the metrics are served unless `--metrics-addr` says otherwise (the arbiter uses
/// 9464, dcgm-exporter 9400).
pub const DEFAULT_ADDR: &str = "127.0.0.1:9465";

/// Errors of the metrics endpoint.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// `--metrics-addr` is neither `none` nor an address.
    #[error("--metrics-addr {0:?} must be IP:PORT (port 0 picks one) or none")]
    BadAddr(String),
    /// The listening socket could not be made.
    #[error("cannot serve metrics on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
}

/// Parses `--metrics-addr` (`tessera_exporter::parse_addr`): `none` turns the endpoint off; a
/// bare IPv6 address before the port is accepted (`$(POD_IP):9465` on IPv6 clusters).
pub fn parse_addr(text: &str) -> Result<Option<SocketAddr>, MetricsError> {
    tessera_exporter::parse_addr(text).map_err(|_| MetricsError::BadAddr(text.to_owned()))
}

/// Why `Allocate` was refused: the `reason` label of `tessera_plugin_allocation_refusals_total`.
/// A closed set, so the series stay few.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Unit ids that are malformed, repeated or spread over GPUs that are not whole.
    BadUnits,
    /// A GPU that is not on this node (any more).
    UnknownGpu,
    /// A GPU marked unhealthy (XID).
    UnhealthyGpu,
    /// The arbiter had no room (memory or shares already promised).
    Exhausted,
    /// The arbiter refused or could not be reached.
    Arbiter,
    /// The identity file could not be written.
    Internal,
}

impl Refusal {
    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Refusal::BadUnits => "bad_units",
            Refusal::UnknownGpu => "unknown_gpu",
            Refusal::UnhealthyGpu => "unhealthy_gpu",
            Refusal::Exhausted => "arbiter_exhausted",
            Refusal::Arbiter => "arbiter_error",
            Refusal::Internal => "internal",
        }
    }
}

type Labels = [(&'static str, &'static str); 1];

/// The plugin's metrics. Cheap to share (`Arc`); every handle is atomic.
pub(crate) struct PluginMetrics {
    registry: Registry,
    registrations: Counter,
    allocations: Counter,
    refusals: Family<Labels, Counter>,
    units: Family<Labels, Gauge>,
    stale_cleanups: Counter,
    pod_labels: Counter,
    mixed_tiers: Counter,
}

impl std::fmt::Debug for PluginMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginMetrics").finish_non_exhaustive()
    }
}

impl Default for PluginMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl PluginMetrics {
    /// Every metric registered, at zero. The registered names leave out the `_total` and
    /// `_info` suffixes, which the encoder adds.
    pub(crate) fn new() -> Self {
        let mut registry = Registry::default();
        let registrations = Counter::default();
        registry.register(
            "tessera_plugin_registrations",
            "Successful registrations with the kubelet",
            registrations.clone(),
        );
        let allocations = Counter::default();
        registry.register(
            "tessera_plugin_allocations",
            "Allocate container requests served",
            allocations.clone(),
        );
        let refusals = Family::<Labels, Counter>::default();
        registry.register(
            "tessera_plugin_allocation_refusals",
            "Allocate calls refused, by reason",
            refusals.clone(),
        );
        let units = Family::<Labels, Gauge>::default();
        registry.register(
            "tessera_plugin_units",
            "Units advertised to the kubelet, by health state",
            units.clone(),
        );
        let stale_cleanups = Counter::default();
        registry.register(
            "tessera_plugin_stale_cleanups",
            "Allocations deleted because no container held their units",
            stale_cleanups.clone(),
        );
        let pod_labels = Counter::default();
        registry.register(
            "tessera_plugin_pod_labels",
            "Allocations whose namespace/pod/container labels were written",
            pod_labels.clone(),
        );
        let mixed_tiers = Counter::default();
        registry.register(
            "tessera_plugin_mixed_tier_deletions",
            "Allocations deleted because their container asked for both the best-effort and the latency resource",
            mixed_tiers.clone(),
        );
        registry.register(
            "tessera_plugin_build",
            "Build information",
            Info::new([("version", env!("CARGO_PKG_VERSION"))]),
        );
        // Both states are always present, so a dashboard sees 0 rather than no data.
        units.get_or_create(&[("state", "healthy")]).set(0);
        units.get_or_create(&[("state", "unhealthy")]).set(0);
        Self {
            registry,
            registrations,
            allocations,
            refusals,
            units,
            stale_cleanups,
            pod_labels,
            mixed_tiers,
        }
    }

    /// One successful registration.
    pub(crate) fn registered(&self) {
        self.registrations.inc();
    }

    /// `n` container requests of one `Allocate` served.
    pub(crate) fn allocated(&self, n: usize) {
        self.allocations.inc_by(n as u64);
    }

    /// One refused `Allocate`.
    pub(crate) fn refused(&self, why: Refusal) {
        self.refusals
            .get_or_create(&[("reason", why.as_str())])
            .inc();
    }

    /// The units now advertised.
    pub(crate) fn set_units(&self, healthy: usize, unhealthy: usize) {
        self.units
            .get_or_create(&[("state", "healthy")])
            .set(i64::try_from(healthy).unwrap_or(i64::MAX));
        self.units
            .get_or_create(&[("state", "unhealthy")])
            .set(i64::try_from(unhealthy).unwrap_or(i64::MAX));
    }

    /// `n` stale allocations deleted.
    pub(crate) fn cleaned_up(&self, n: usize) {
        self.stale_cleanups.inc_by(n as u64);
    }

    /// One allocation of a container holding both resources deleted.
    pub(crate) fn mixed_tier_deleted(&self) {
        self.mixed_tiers.inc();
    }

    /// One allocation's pod labels written.
    pub(crate) fn labelled(&self) {
        self.pod_labels.inc();
    }

    /// The exposition text (Prometheus text format 0.0.4).
    pub(crate) fn render(&self) -> String {
        let mut out = String::with_capacity(2048);
        // Writing into a String cannot fail.
        let _ = prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

/// Binds the metrics address; `None` when the endpoint is off.
pub(crate) async fn bind(addr: Option<SocketAddr>) -> Result<Option<TcpListener>, MetricsError> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    TcpListener::bind(addr)
        .await
        .map(Some)
        .map_err(|source| MetricsError::Bind { addr, source })
}

/// Serves `/metrics` on `listener` until `stop` turns true (`tessera_exporter::serve`:
/// bounded scrapers, a deadline per connection).
pub(crate) async fn serve(
    listener: TcpListener,
    metrics: Arc<PluginMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let text: tessera_exporter::Render = Arc::new(move || metrics.render());
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    tessera_exporter::serve(listener, text, stopped).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(parse_addr("none").unwrap(), None);
        assert_eq!(
            parse_addr("127.0.0.1:9465").unwrap(),
            Some("127.0.0.1:9465".parse().unwrap())
        );
        assert_eq!(
            parse_addr("fd00::5:9465").unwrap(),
            Some("[fd00::5]:9465".parse().unwrap())
        );
        assert_eq!(
            parse_addr("[::1]:0").unwrap(),
            Some("[::1]:0".parse().unwrap())
        );
        for bad in ["", "9465", "localhost:9465", "1.2.3.4:99999", "1.2.3.4"] {
            assert!(parse_addr(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn exposition_names_and_values() {
        let m = PluginMetrics::new();
        m.registered();
        m.allocated(2);
        m.refused(Refusal::BadUnits);
        m.refused(Refusal::BadUnits);
        m.set_units(100, 100);
        m.cleaned_up(1);
        m.labelled();
        let text = m.render();
        for line in [
            "# TYPE tessera_plugin_registrations_total counter",
            "tessera_plugin_registrations_total 1",
            "tessera_plugin_allocations_total 2",
            "tessera_plugin_allocation_refusals_total{reason=\"bad_units\"} 2",
            "tessera_plugin_units{state=\"healthy\"} 100",
            "tessera_plugin_units{state=\"unhealthy\"} 100",
            "tessera_plugin_stale_cleanups_total 1",
            "tessera_plugin_pod_labels_total 1",
            "# TYPE tessera_plugin_build_info gauge",
            &format!(
                "tessera_plugin_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            ),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(!text.contains("# EOF"), "{text}");
    }
}
