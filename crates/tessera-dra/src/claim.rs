//! Pure rules: what a ResourceClaim's allocation asks of this node, as arbiter allocations.
//!
//! Only the claim's `(namespace, name, uid)` arrive over gRPC; the allocation the scheduler
//! wrote (`status.allocation.devices.results`) comes from the API server. [`plan`] checks it
//! against what the kubelet said and against this node's GPUs, and turns each result for
//! driver [`DRIVER`] into one [`Planned`] allocation:
//! - `consumedCapacity.shares` is the compute share (1..=100) and
//!   `consumedCapacity.memory` the memory limit (bytes, at most the card);
//! - a result without `consumedCapacity`, or with all 100 shares, is the whole GPU: share 100,
//!   the card's memory, no interposer (nobody else can be placed on it by shares);
//! - a capacity the result does not name is the slice's default for it ([`DEFAULT_SHARES`],
//!   the configured default memory), as the scheduler fills it in: with consumable capacity it
//!   writes every capacity of the device into `consumedCapacity`, a capacity the request does
//!   not name at its `requestPolicy.default` (k8s.io/dynamic-resource-allocation v0.36.3
//!   `structured/internal/incubating/consumable_capacity.go`, `fillEmptyRequest`). So a claim
//!   that names only memory ("20 GiB of any GPU") is a fraction with the default share, not the
//!   whole card.
//!
//! A claim is either one fraction or whole GPUs: a container has one identity (one
//! allocation the interposer enforces), so two fractions in one claim are refused.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::quantity::{self, QuantityError};

/// The DRA driver name.
pub(crate) const DRIVER: &str = "gpu.tessera.dev";
/// Capacity name of the compute share (percent of the GPU's time).
pub(crate) const CAPACITY_SHARES: &str = "shares";
/// Capacity name of the memory limit (bytes).
pub(crate) const CAPACITY_MEMORY: &str = "memory";
/// Shares a whole GPU has.
pub(crate) const SHARES_PER_GPU: u64 = 100;
/// Shares of a claim that names none (the slice's `requestPolicy.default` for `shares`): a
/// claim that asks only for memory is a fraction with this compute weight (as `tessera run
/// --share` defaults to 10), and a whole GPU is asked for as `shares: 100`. Below 100 on
/// purpose: with a default of 100 the scheduler reserves every share of the card for a
/// memory-only claim, and nothing else can be placed on it.
pub(crate) const DEFAULT_SHARES: u64 = 10;

/// A GPU of this node as the claims name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeGpu {
    /// Device name in the ResourceSlice (`gpu-<index>`).
    pub device: String,
    /// UUID.
    pub uuid: String,
    /// Card memory, bytes.
    pub memory_total: u64,
    /// Why it is unhealthy (a fatal XID), if it is: nothing new is prepared on it.
    pub unhealthy: Option<String>,
    /// What preparing it involves besides the arbiter ([`crate::mig`]).
    pub kind: Kind,
}

/// What preparing a device involves besides the arbiter allocation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Kind {
    /// A whole GPU without MIG, or an existing (static) MIG instance named by its UUID.
    #[default]
    Plain,
    /// The whole device of a dynamic MIG GPU: MIG must be off on it
    /// ([`crate::instances::ensure_whole`]).
    DynamicWhole,
    /// A dynamic MIG partition: its instance is made or shared at prepare
    /// ([`crate::instances::acquire`]), and the allocation's GPU is that instance's MIG UUID
    /// (`uuid` is the parent's until then).
    Partition(crate::instances::Want),
}

/// The device name of GPU `index` (a DNS label, as the API requires).
pub(crate) fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// One arbiter allocation a claim needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Planned {
    /// The claim's request this result serves.
    pub request: String,
    /// Pool (this node's).
    pub pool: String,
    /// Device name.
    pub device: String,
    /// The scheduler's share id (for a device allocated more than once).
    pub share_id: Option<String>,
    /// GPU UUID.
    pub uuid: String,
    /// Compute share, 1..=100.
    pub share: u32,
    /// Memory limit, bytes.
    pub memory_limit: u64,
    /// The whole card: no interposer.
    pub whole: bool,
    /// Its tier: latency only when the claim's DeviceClass says so (see [`tier_of`]).
    pub tier: tessera_protocol::Tier,
    /// What preparing it involves besides the arbiter (the device's [`NodeGpu::kind`]).
    pub kind: Kind,
}

/// Why a claim cannot be prepared on this node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ClaimError {
    /// The API server's object is another claim than the kubelet's (deleted and re-created).
    #[error("claim {namespace}/{name} has uid {found}, the kubelet asked for {wanted}")]
    UidMismatch {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The kubelet's uid.
        wanted: String,
        /// The API server's.
        found: String,
    },
    /// A namespace, name or uid that is not of the form Kubernetes gives them (they become
    /// file names and URL paths here).
    #[error("claim reference {0:?} is not a Kubernetes name or uid")]
    BadRef(String),
    /// No allocation yet.
    #[error("claim is not allocated (no status.allocation)")]
    NotAllocated,
    /// A result for another node's pool.
    #[error("result for request {request} is in pool {pool}, this node's pool is {node}")]
    OtherPool {
        /// Request.
        request: String,
        /// Its pool.
        pool: String,
        /// Ours.
        node: String,
    },
    /// A device this node does not have.
    #[error("device {0} is not a GPU of this node")]
    UnknownDevice(String),
    /// A GPU marked unhealthy (tainted in the slice; a claim allocated before the taint).
    #[error("device {device} is unhealthy ({reason})")]
    Unhealthy {
        /// Device.
        device: String,
        /// Why.
        reason: String,
    },
    /// A quantity that is not a whole number.
    #[error("consumedCapacity.{capacity}: {source}")]
    Quantity {
        /// Capacity name.
        capacity: String,
        /// Cause.
        source: QuantityError,
    },
    /// Shares outside 1..=100.
    #[error("consumedCapacity.shares is {0}, 1 to 100 allowed")]
    Shares(u64),
    /// Memory of zero or over the card.
    #[error("consumedCapacity.memory is {memory} bytes, 1 to {total} (the card) allowed")]
    Memory {
        /// Asked.
        memory: u64,
        /// Card.
        total: u64,
    },
    /// A capacity this driver does not publish.
    #[error("consumedCapacity.{0} is not a capacity of {DRIVER}")]
    UnknownCapacity(String),
    /// A fraction beside whole GPUs, or two fractions of one GPU.
    #[error(
        "a claim may hold fractions of distinct GPUs (one multi-GPU allocation) or whole GPUs, \
         not {0} results mixing them or sharing a GPU"
    )]
    MixedResults(usize),
    /// A latency DeviceClass for fractions of several GPUs: a multi-GPU allocation has no tier
    /// yet, and running it best-effort would not be what the operator asked.
    #[error(
        "the DeviceClass asks for the latency tier on fractions of {0} GPUs: a multi-GPU \
         allocation is best-effort only"
    )]
    LatencyGroup(usize),
}

/// True when the claim's results are fractions of two or more distinct GPUs: they become one
/// multi-GPU allocation (see [`tessera_protocol::group`]; [`crate::prepare`] creates it). Whole GPUs keep one allocation
/// each (the container runs without limits on them), and so do several fractions of one GPU.
pub(crate) fn spans_gpus(plans: &[Planned]) -> bool {
    let uuids: HashSet<&str> = plans.iter().map(|p| p.uuid.as_str()).collect();
    plans.len() >= 2 && uuids.len() == plans.len() && plans.iter().all(|p| !p.whole)
}

/// Checks the kubelet's `(namespace, name, uid)`: lower-case DNS characters only (names are
/// DNS subdomains, uids UUIDs), at most 253 bytes, so none can leave a folder or a URL path.
pub(crate) fn check_ref(namespace: &str, name: &str, uid: &str) -> Result<(), ClaimError> {
    for part in [namespace, name, uid] {
        let ok = !part.is_empty()
            && part.len() <= 253
            && !part.starts_with('.')
            && part
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !ok {
            return Err(ClaimError::BadRef(part.to_owned()));
        }
    }
    Ok(())
}

/// The allocations `claim` (as read from the API server) needs on this node: its results for
/// [`DRIVER`], in order. `uid` is the kubelet's; `pool` this node's; `default_memory` the
/// memory of a fraction whose result names no memory (the slice's documented default).
pub(crate) fn plan(
    claim: &ResourceClaim,
    uid: &str,
    pool: &str,
    gpus: &[NodeGpu],
    default_memory: u64,
) -> Result<Vec<Planned>, ClaimError> {
    let found = claim.metadata.uid.clone().unwrap_or_default();
    if found != uid {
        return Err(ClaimError::UidMismatch {
            namespace: claim.metadata.namespace.clone().unwrap_or_default(),
            name: claim.metadata.name.clone().unwrap_or_default(),
            wanted: uid.to_owned(),
            found,
        });
    }
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .ok_or(ClaimError::NotAllocated)?
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut out = Vec::new();
    for r in results.iter().filter(|r| r.driver == DRIVER) {
        if r.pool != pool {
            return Err(ClaimError::OtherPool {
                request: r.request.clone(),
                pool: r.pool.clone(),
                node: pool.to_owned(),
            });
        }
        let gpu = gpus
            .iter()
            .find(|g| g.device == r.device)
            .ok_or_else(|| ClaimError::UnknownDevice(r.device.clone()))?;
        if let Some(reason) = &gpu.unhealthy {
            return Err(ClaimError::Unhealthy {
                device: r.device.clone(),
                reason: reason.clone(),
            });
        }
        let (share, memory_limit, whole) =
            limits(r.consumed_capacity.as_ref(), gpu, default_memory)?;
        let config = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.config.as_deref())
            .unwrap_or_default();
        out.push(Planned {
            tier: tier_of(config, &r.request),
            request: r.request.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: r.share_id.clone(),
            uuid: gpu.uuid.clone(),
            share,
            memory_limit,
            whole,
            kind: gpu.kind.clone(),
        });
    }
    // Fractions of several GPUs are one multi-GPU allocation; anything else with a fraction
    // in it must be a single result.
    if out.len() > 1 && out.iter().any(|p| !p.whole) && !spans_gpus(&out) {
        return Err(ClaimError::MixedResults(out.len()));
    }
    if spans_gpus(&out)
        && out
            .iter()
            .any(|p| p.tier != tessera_protocol::Tier::BestEffort)
    {
        return Err(ClaimError::LatencyGroup(out.len()));
    }
    Ok(out)
}

/// The tier of the result serving `request`: `latency` when an opaque configuration of this
/// driver from the claim's DeviceClass (`source: FromClass`, written by the cluster's
/// operator) applying to it says `{"tier": "latency"}`. The same configuration in the claim
/// itself (`FromClaim`) is the workload's own and is ignored: a tenant never picks its tier.
pub(crate) fn tier_of(
    config: &[k8s_openapi::api::resource::v1::DeviceAllocationConfiguration],
    request: &str,
) -> tessera_protocol::Tier {
    let latency = config.iter().any(|c| {
        c.source == "FromClass"
            && c.requests
                .as_ref()
                .is_none_or(|rs| rs.is_empty() || rs.iter().any(|x| x == request))
            && c.opaque.as_ref().is_some_and(|o| {
                o.driver == DRIVER
                    && o.parameters.0.get("tier").and_then(|t| t.as_str()) == Some("latency")
            })
    });
    if latency {
        tessera_protocol::Tier::Latency
    } else {
        tessera_protocol::Tier::BestEffort
    }
}

/// `(share, memory limit, whole)` of one result.
fn limits(
    consumed: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
    gpu: &NodeGpu,
    default_memory: u64,
) -> Result<(u32, u64, bool), ClaimError> {
    let Some(consumed) = consumed.filter(|c| !c.is_empty()) else {
        return Ok((100, gpu.memory_total, true));
    };
    if let Some(k) = consumed
        .keys()
        .find(|k| *k != CAPACITY_SHARES && *k != CAPACITY_MEMORY)
    {
        return Err(ClaimError::UnknownCapacity(k.clone()));
    }
    let get = |name: &str| -> Result<Option<u64>, ClaimError> {
        consumed
            .get(name)
            .map(|q| {
                quantity::parse(&q.0).map_err(|source| ClaimError::Quantity {
                    capacity: name.to_owned(),
                    source,
                })
            })
            .transpose()
    };
    // A result that names memory but not shares (the scheduler names both; another writer may
    // not) has the default share the slice publishes, as the scheduler would have written.
    let shares = get(CAPACITY_SHARES)?.unwrap_or(DEFAULT_SHARES);
    if !(1..=SHARES_PER_GPU).contains(&shares) {
        return Err(ClaimError::Shares(shares));
    }
    if shares == SHARES_PER_GPU {
        return Ok((100, gpu.memory_total, true));
    }
    let memory = get(CAPACITY_MEMORY)?.unwrap_or(default_memory);
    if memory == 0 || memory > gpu.memory_total {
        return Err(ClaimError::Memory {
            memory,
            total: gpu.memory_total,
        });
    }
    Ok((shares as u32, memory, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
        ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    const GIB: u64 = 1 << 30;

    fn config(
        source: &str,
        driver: &str,
        requests: Option<&[&str]>,
        params: serde_json::Value,
    ) -> k8s_openapi::api::resource::v1::DeviceAllocationConfiguration {
        k8s_openapi::api::resource::v1::DeviceAllocationConfiguration {
            source: source.into(),
            requests: requests.map(|r| r.iter().map(|x| x.to_string()).collect()),
            opaque: Some(k8s_openapi::api::resource::v1::OpaqueDeviceConfiguration {
                driver: driver.into(),
                parameters: k8s_openapi::apimachinery::pkg::runtime::RawExtension(params),
            }),
        }
    }

    #[test]
    fn the_tier_comes_from_the_device_class_only() {
        use tessera_protocol::Tier;
        let latency = serde_json::json!({"tier": "latency"});
        // The operator's DeviceClass says latency: for every request, or the named one.
        let class = config("FromClass", DRIVER, None, latency.clone());
        assert_eq!(tier_of(&[class], "gpu"), Tier::Latency);
        let named = config("FromClass", DRIVER, Some(&["gpu"]), latency.clone());
        assert_eq!(tier_of(std::slice::from_ref(&named), "gpu"), Tier::Latency);
        assert_eq!(tier_of(&[named], "other"), Tier::BestEffort);
        // The attack: the workload's own claim asks for latency. Ignored.
        let own = config("FromClaim", DRIVER, None, latency.clone());
        assert_eq!(tier_of(&[own], "gpu"), Tier::BestEffort);
        // Another driver's configuration, or another value: best-effort.
        let other = config("FromClass", "gpu.nvidia.com", None, latency);
        assert_eq!(tier_of(&[other], "gpu"), Tier::BestEffort);
        let odd = config(
            "FromClass",
            DRIVER,
            None,
            serde_json::json!({"tier": "urgent"}),
        );
        assert_eq!(tier_of(&[odd], "gpu"), Tier::BestEffort);
        assert_eq!(tier_of(&[], "gpu"), Tier::BestEffort);
    }

    fn gpus() -> Vec<NodeGpu> {
        (0..2)
            .map(|i| NodeGpu {
                device: device_name(i),
                uuid: format!("GPU-{i}"),
                memory_total: 80 * GIB,
                unhealthy: None,
                kind: Kind::Plain,
            })
            .collect()
    }

    fn result(device: &str, pool: &str, cap: &[(&str, &str)]) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            driver: DRIVER.into(),
            pool: pool.into(),
            device: device.into(),
            request: "gpu".into(),
            share_id: (!cap.is_empty()).then(|| "7f3c".into()),
            consumed_capacity: (!cap.is_empty()).then(|| {
                cap.iter()
                    .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
                    .collect()
            }),
            ..Default::default()
        }
    }

    fn claim(uid: &str, results: Vec<DeviceRequestAllocationResult>) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                name: Some("c".into()),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            status: Some(ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(results),
                        config: None,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn fractions_and_whole_gpus_become_shares_and_limits() {
        let c = claim(
            "u1",
            vec![result(
                "gpu-1",
                "node-a",
                &[("shares", "30"), ("memory", "20Gi")],
            )],
        );
        let p = plan(&c, "u1", "node-a", &gpus(), GIB).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(
            (p[0].uuid.as_str(), p[0].share, p[0].memory_limit),
            ("GPU-1", 30, 20 * GIB)
        );
        assert!(!p[0].whole);
        assert_eq!(p[0].share_id.as_deref(), Some("7f3c"));

        // No memory named: the documented default.
        let c = claim("u1", vec![result("gpu-0", "node-a", &[("shares", "10")])]);
        assert_eq!(
            plan(&c, "u1", "node-a", &gpus(), GIB).unwrap()[0].memory_limit,
            GIB
        );

        // No consumedCapacity, or all 100 shares: whole cards.
        for cap in [&[][..], &[("shares", "100"), ("memory", "1Gi")][..]] {
            let c = claim(
                "u1",
                vec![
                    result("gpu-0", "node-a", cap),
                    result("gpu-1", "node-a", cap),
                ],
            );
            let p = plan(&c, "u1", "node-a", &gpus(), GIB).unwrap();
            assert!(
                p.iter()
                    .all(|p| p.whole && p.share == 100 && p.memory_limit == 80 * GIB)
            );
        }

        // Results of other drivers are not ours.
        let mut other = result("gpu-0", "node-a", &[]);
        other.driver = "gpu.nvidia.com".into();
        assert!(
            plan(&claim("u1", vec![other]), "u1", "node-a", &gpus(), GIB)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_result_naming_only_memory_is_a_fraction_with_the_default_share() {
        // What the scheduler writes for `capacity.requests: {memory: 20Gi}` against the slice
        // (every capacity, the unnamed one at its default): 10 shares, 20 GiB.
        let c = claim(
            "u1",
            vec![result(
                "gpu-0",
                "node-a",
                &[("shares", "10"), ("memory", "20Gi")],
            )],
        );
        let p = &plan(&c, "u1", "node-a", &gpus(), GIB).unwrap()[0];
        assert_eq!((p.share, p.memory_limit, p.whole), (10, 20 * GIB, false));
        // A result that names only the memory is the same fraction, not the whole card.
        let c = claim("u1", vec![result("gpu-0", "node-a", &[("memory", "20Gi")])]);
        let p = &plan(&c, "u1", "node-a", &gpus(), GIB).unwrap()[0];
        assert_eq!(
            (u64::from(p.share), p.memory_limit, p.whole),
            (DEFAULT_SHARES, 20 * GIB, false)
        );
        const { assert!(DEFAULT_SHARES < SHARES_PER_GPU) };
    }

    #[test]
    fn claim_references_cannot_leave_their_folder_or_path() {
        assert!(check_ref("team-a", "train.0", "3f2a-11").is_ok());
        for (ns, name, uid) in [
            ("team-a", "x", "../../etc/passwd"),
            ("team-a", "x/y", "u"),
            ("a?b=c", "x", "u"),
            ("team-a", "x", ""),
            ("team-a", "..", "u"),
            ("Team", "x", "u"),
        ] {
            assert!(
                matches!(check_ref(ns, name, uid), Err(ClaimError::BadRef(_))),
                "{ns} {name} {uid}"
            );
        }
    }

    #[test]
    fn refuses_what_it_cannot_enforce_exactly() {
        let g = gpus();
        let one = |cap: &[(&str, &str)]| claim("u1", vec![result("gpu-0", "node-a", cap)]);
        let err = |c: &ResourceClaim| plan(c, "u1", "node-a", &g, GIB).unwrap_err();
        assert!(matches!(
            err(&one(&[("shares", "0")])),
            ClaimError::Shares(0)
        ));
        assert!(matches!(
            err(&one(&[("shares", "101")])),
            ClaimError::Shares(101)
        ));
        assert!(matches!(
            err(&one(&[("shares", "2"), ("memory", "81Gi")])),
            ClaimError::Memory { .. }
        ));
        assert!(matches!(
            err(&one(&[("shares", "2"), ("memory", "0")])),
            ClaimError::Memory { .. }
        ));
        assert!(matches!(
            err(&one(&[("shares", "2"), ("memory", "0.5")])),
            ClaimError::Quantity { .. }
        ));
        assert!(matches!(
            err(&one(&[("cores", "2")])),
            ClaimError::UnknownCapacity(_)
        ));
        assert!(matches!(
            plan(&one(&[]), "other-uid", "node-a", &g, GIB).unwrap_err(),
            ClaimError::UidMismatch { .. }
        ));
        assert!(matches!(
            plan(&one(&[]), "u1", "node-b", &g, GIB).unwrap_err(),
            ClaimError::OtherPool { .. }
        ));
        let mut sick = g.clone();
        sick[0].unhealthy = Some("XID 79".into());
        assert!(matches!(
            plan(&one(&[]), "u1", "node-a", &sick, GIB).unwrap_err(),
            ClaimError::Unhealthy { .. }
        ));
        let missing = claim("u1", vec![result("gpu-9", "node-a", &[])]);
        assert!(matches!(err(&missing), ClaimError::UnknownDevice(_)));
        let two = claim(
            "u1",
            vec![
                result("gpu-0", "node-a", &[("shares", "30")]),
                result("gpu-1", "node-a", &[]),
            ],
        );
        assert!(matches!(err(&two), ClaimError::MixedResults(2)));
        // Fractions of two GPUs are one multi-GPU allocation; two of one GPU are not.
        let tp = claim(
            "u1",
            vec![
                result("gpu-0", "node-a", &[("shares", "30")]),
                result("gpu-1", "node-a", &[("shares", "30")]),
            ],
        );
        let plans = plan(&tp, "u1", "node-a", &g, GIB).unwrap();
        assert_eq!(plans.len(), 2);
        assert!(spans_gpus(&plans));
        let same = claim(
            "u1",
            vec![
                result("gpu-0", "node-a", &[("shares", "30")]),
                result("gpu-0", "node-a", &[("shares", "30")]),
            ],
        );
        assert!(matches!(err(&same), ClaimError::MixedResults(2)));
        // The same two fractions under a latency DeviceClass are refused, not run best-effort.
        let mut latency_tp = tp.clone();
        let devices = latency_tp
            .status
            .as_mut()
            .unwrap()
            .allocation
            .as_mut()
            .unwrap();
        devices.devices.as_mut().unwrap().config = Some(vec![config(
            "FromClass",
            DRIVER,
            None,
            serde_json::json!({"tier": "latency"}),
        )]);
        assert!(matches!(err(&latency_tp), ClaimError::LatencyGroup(2)));
        let mut unallocated = one(&[]);
        unallocated.status = None;
        assert!(matches!(err(&unallocated), ClaimError::NotAllocated));
    }
}
