//! NodePrepareResources / NodeUnprepareResources for one claim, over the shared
//! [`Arbiter`] trait, free of gRPC and of the API server.
//!
//! The arbiter's allocations are the checkpoint: each carries the claim's uid
//! ([`LABEL_CLAIM_UID`]) and its result's index, and the claim's CDI spec is written last, as
//! the commit mark. So:
//! - [`prepare`] finds a spec and one live allocation per result, matching the plan: it
//!   answers the same devices and creates nothing (the kubelet retries, or restarted);
//! - otherwise it removes what a half-done prepare left (allocations of the claim, its spec),
//!   creates every allocation or none, writes the identity file, then the spec;
//! - [`unprepare`] deletes the claim's allocations, identity file and spec; each absent part
//!   is fine, so it can be repeated.
//!
//! A plugin restart loses nothing (the arbiter and the files survive it); an arbiter restart
//! loses nothing either (its state folder holds the allocations and tokens).

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use tessera_node::arbiter::Arbiter;
use tessera_node::identity::{self, IdentityError};
use tessera_node::labels::{LABEL_OWNER, OWNER_DRA};
use tessera_protocol::client::ClientError;
use tessera_protocol::identity::Identity;
use tessera_protocol::{
    AdminErrorKind, AllocationStatus, CreateAllocation, GpuSelector, LABEL_NAMESPACE,
};

use crate::cdi::{self, CdiError, Wiring};
use crate::claim::{Kind, Planned, spans_gpus};
use crate::instances::{self, MigError, MigHandle};

/// The claim's uid.
pub const LABEL_CLAIM_UID: &str = "tessera.dev/claim-uid";
/// `namespace/name` of the claim (what `tessera status` shows).
pub use tessera_protocol::LABEL_CLAIM;
/// The result's index in the claim's results for this driver.
pub(crate) const LABEL_RESULT: &str = "tessera.dev/claim-result";
/// The result's device in the ResourceSlice (what [`crate::publish`] must not change the
/// counters of while the allocation lives).
pub(crate) const LABEL_DEVICE: &str = "tessera.dev/claim-device";

/// Why a claim could not be prepared or unprepared.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PrepareError {
    /// An admin call failed.
    #[error("arbiter: {0}")]
    Arbiter(#[from] ClientError),
    /// The identity file could not be written.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// The CDI spec could not be written or removed.
    #[error(transparent)]
    Cdi(#[from] CdiError),
    /// A MIG instance could not be made, shared or removed.
    #[error(transparent)]
    Mig(#[from] MigError),
}

/// Fixed settings.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// Folder of the CDI specs the runtime reads (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// Host folder of the identity files.
    pub identity_dir: PathBuf,
    /// Container wiring.
    pub wiring: Wiring,
    /// The CDI kind of the node's NVIDIA spec (`nvidia.com/gpu`, devices named by UUID).
    pub nvidia_kind: String,
    /// MIG control (makes and removes the instances of dynamic MIG devices).
    pub mig: MigHandle,
    /// The MIG instances' checkpoint ([`crate::instances`]).
    pub mig_checkpoint: PathBuf,
}

/// One prepared device, as the response lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreparedDevice {
    /// The claim's request.
    pub request: String,
    /// Pool.
    pub pool: String,
    /// Device.
    pub device: String,
    /// The scheduler's share id.
    pub share_id: Option<String>,
    /// CDI ids: Tessera's, then the NVIDIA one.
    pub cdi_ids: Vec<String>,
}

/// Namespace and name of a claim.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClaimRef<'a> {
    /// Namespace.
    pub namespace: &'a str,
    /// Name.
    pub name: &'a str,
    /// Uid.
    pub uid: &'a str,
}

fn devices(uid: &str, plans: &[Planned], nvidia_kind: &str) -> Vec<PreparedDevice> {
    plans
        .iter()
        .enumerate()
        .map(|(i, p)| PreparedDevice {
            request: p.request.clone(),
            pool: p.pool.clone(),
            device: p.device.clone(),
            share_id: p.share_id.clone(),
            cdi_ids: vec![
                cdi::device_id(uid, i),
                format!("{nvidia_kind}={}", nvidia_device(p)),
            ],
        })
        .collect()
}

/// The device of the node's NVIDIA CDI spec a result needs: its GPU, or for a dynamic MIG
/// partition the parent's (a static spec has no entry for an instance made at prepare; the
/// parent's device nodes are what it runs on, and our spec's `CUDA_VISIBLE_DEVICES` narrows
/// it to the instance). A static instance is named by its MIG UUID, as `nvidia-ctk cdi
/// generate --device-name-strategy=uuid` names existing instances.
fn nvidia_device(p: &Planned) -> &str {
    match &p.kind {
        Kind::Partition(w) => &w.parent,
        _ => &p.uuid,
    }
}

fn is_ours(a: &AllocationStatus, uid: &str) -> bool {
    a.labels.get(LABEL_OWNER).map(String::as_str) == Some(OWNER_DRA)
        && a.labels.get(LABEL_CLAIM_UID).map(String::as_str) == Some(uid)
}

/// Whether `existing` (the claim's live allocations) is exactly what `plans` needs.
fn matches(existing: &[AllocationStatus], plans: &[Planned]) -> bool {
    existing.len() == plans.len()
        && plans.iter().enumerate().all(|(i, p)| {
            existing.iter().any(|a| {
                a.labels.get(LABEL_RESULT) == Some(&i.to_string())
                    && a.gpu_uuid == p.uuid
                    && a.share == p.share
                    && a.memory_limit == p.memory_limit
                    && a.tier == p.tier
            })
        })
}

fn delete_tolerant<A: Arbiter + ?Sized>(a: &mut A, id: &str) -> Result<(), ClientError> {
    match a.delete(id) {
        Ok(())
        | Err(ClientError::Admin {
            kind: AdminErrorKind::NotFound,
            ..
        }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Prepares claim `c` whose results for this node are `plans` (from [`crate::claim::plan`]):
/// first the MIG side ([`mig_side`]), then [`prepare_resolved`]; a failure after a MIG
/// instance was taken gives the claim's instances back.
pub(crate) fn prepare<A: Arbiter + ?Sized>(
    arbiter: &mut A,
    c: ClaimRef<'_>,
    plans: &[Planned],
    s: &Settings,
) -> Result<Vec<PreparedDevice>, PrepareError> {
    let took = plans.iter().any(|p| matches!(p.kind, Kind::Partition(_)));
    let resolved = match mig_side(c.uid, plans, s) {
        Ok(r) => r,
        Err(e) => {
            if took {
                let _ = s
                    .mig
                    .with(|m| instances::release(m, &s.mig_checkpoint, c.uid));
            }
            return Err(e);
        }
    };
    let out = prepare_resolved(arbiter, c, &resolved, s);
    if out.is_err()
        && took
        && let Err(e) = s
            .mig
            .with(|m| instances::release(m, &s.mig_checkpoint, c.uid))
    {
        tracing::warn!("claim {}: giving its MIG instances back: {e}", c.uid);
    }
    out
}

/// The MIG side of a prepare: a dynamic partition's instance made or shared (the plan's GPU
/// becomes its MIG UUID, the arbiter's scheduling domain for it); the whole device of a
/// dynamic GPU gets MIG off. Idempotent: a repeated prepare gets the same instance.
fn mig_side(uid: &str, plans: &[Planned], s: &Settings) -> Result<Vec<Planned>, PrepareError> {
    let mut out = plans.to_vec();
    for p in &mut out {
        match &p.kind {
            Kind::Plain => {}
            Kind::DynamicWhole => {
                let parent = p.uuid.clone();
                s.mig
                    .with(|m| instances::ensure_whole(m, &s.mig_checkpoint, &parent))?;
            }
            Kind::Partition(want) => {
                p.uuid = s
                    .mig
                    .with(|m| instances::acquire(m, &s.mig_checkpoint, uid, want))?;
            }
        }
    }
    Ok(out)
}

/// Prepares claim `c` whose plans name their final GPUs (MIG instances made).
fn prepare_resolved<A: Arbiter + ?Sized>(
    arbiter: &mut A,
    c: ClaimRef<'_>,
    plans: &[Planned],
    s: &Settings,
) -> Result<Vec<PreparedDevice>, PrepareError> {
    let all = arbiter.list()?;
    let existing: Vec<AllocationStatus> =
        all.iter().filter(|a| is_ours(a, c.uid)).cloned().collect();
    if cdi::read(&s.cdi_dir, c.uid)?.is_some() && matches(&existing, plans) {
        tracing::info!(
            "claim {}/{} ({}) already prepared",
            c.namespace,
            c.name,
            c.uid
        );
        return Ok(devices(c.uid, plans, &s.nvidia_kind));
    }
    // A half-done prepare (no spec: its response never reached the kubelet, so no container
    // uses it) or one for other results: start over.
    let mut live: HashSet<String> = all.iter().map(|a| a.id.clone()).collect();
    for a in &existing {
        tracing::info!(
            "claim {}: removing allocation {} of an unfinished prepare",
            c.uid,
            a.id
        );
        delete_tolerant(arbiter, &a.id)?;
        live.remove(&a.id);
    }
    cdi::remove(&s.cdi_dir, c.uid)?;
    if plans.is_empty() {
        return Ok(Vec::new());
    }

    let reqs: Vec<CreateAllocation> = plans
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let labels = BTreeMap::from([
                (LABEL_OWNER.to_owned(), OWNER_DRA.to_owned()),
                (LABEL_CLAIM_UID.to_owned(), c.uid.to_owned()),
                (
                    LABEL_CLAIM.to_owned(),
                    format!("{}/{}", c.namespace, c.name),
                ),
                (LABEL_RESULT.to_owned(), i.to_string()),
                (LABEL_DEVICE.to_owned(), p.device.clone()),
                (LABEL_NAMESPACE.to_owned(), c.namespace.to_owned()),
            ]);
            CreateAllocation {
                gpu: GpuSelector::Uuid(p.uuid.clone()),
                memory_limit: p.memory_limit,
                share: p.share,
                cap: None,
                labels,
            }
        })
        .collect();
    let mut made: Vec<(String, AllocationStatus)> = Vec::new();
    let mut failed = None;
    if spans_gpus(plans) {
        // Fractions of several GPUs: one multi-GPU allocation under one token, each GPU's
        // slice with its own limit and share (the interposer keeps one per device), created
        // whole or not at all (best-effort: the plan refuses a latency class here).
        match arbiter.create_group(reqs) {
            Ok((token, slices)) => made = slices.into_iter().map(|a| (token.clone(), a)).collect(),
            Err(e) => failed = Some(e),
        }
    } else {
        for (req, p) in reqs.into_iter().zip(plans) {
            match arbiter.create_tiered(req, p.tier) {
                Ok(x) => made.push(x),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
    }
    let undo = |arbiter: &mut A, made: &[(String, AllocationStatus)]| {
        for (_, a) in made {
            let _ = arbiter.delete(&a.id);
        }
    };
    if let Some(e) = failed {
        undo(arbiter, &made);
        return Err(e.into());
    }
    live.extend(made.iter().map(|(_, a)| a.id.clone()));
    identity::sweep(&s.identity_dir, &live);

    // One identity per claim: its first allocation's token (for a multi-GPU allocation, the
    // group token; for whole GPUs it only lets the backstop tell the claim's processes from
    // strangers).
    let (token, first) = &made[0];
    let fraction = plans.iter().any(|p| !p.whole);
    let id = Identity {
        token: token.clone(),
        socket: fraction.then(|| s.wiring.container_socket.clone()),
        allocation: Some(first.id.clone()),
    };
    let written = identity::write(&s.identity_dir, &first.id, &id)
        .map_err(PrepareError::from)
        .and_then(|path| {
            let results: Vec<(Planned, String)> = plans
                .iter()
                .cloned()
                .zip(made.iter().map(|(_, a)| a.id.clone()))
                .collect();
            let spec = cdi::spec(c.uid, &results, &path, &s.wiring);
            cdi::write(&s.cdi_dir, c.uid, &spec).map_err(PrepareError::from)
        });
    if let Err(e) = written {
        undo(arbiter, &made);
        live.retain(|l| !made.iter().any(|(_, a)| &a.id == l));
        identity::sweep(&s.identity_dir, &live);
        return Err(e);
    }
    for (_, a) in &made {
        tracing::info!(
            "claim {}/{}: allocation {} on {}: share {}, {} bytes",
            c.namespace,
            c.name,
            a.id,
            a.gpu_uuid,
            a.share,
            a.memory_limit
        );
    }
    Ok(devices(c.uid, plans, &s.nvidia_kind))
}

/// Unprepares claim `uid`: its allocations, identity file and spec go. Returns how many
/// allocations were deleted.
pub(crate) fn unprepare<A: Arbiter + ?Sized>(
    arbiter: &mut A,
    uid: &str,
    s: &Settings,
) -> Result<usize, PrepareError> {
    // The spec goes first: a runtime that reads it after this finds no stale wiring.
    cdi::remove(&s.cdi_dir, uid)?;
    let all = arbiter.list()?;
    let mut live: HashSet<String> = all.iter().map(|a| a.id.clone()).collect();
    let mut deleted = 0;
    for a in all.iter().filter(|a| is_ours(a, uid)) {
        delete_tolerant(arbiter, &a.id)?;
        live.remove(&a.id);
        deleted += 1;
    }
    identity::sweep(&s.identity_dir, &live);
    // The claim's MIG instances last: its containers are gone with its allocations.
    let destroyed = s
        .mig
        .with(|m| instances::release(m, &s.mig_checkpoint, uid))?;
    for u in destroyed {
        tracing::info!("claim {uid}: MIG instance {u} removed (its last claim)");
    }
    Ok(deleted)
}
