//! MIG instances behind prepared claims: created at the first prepare that needs one, shared
//! by reference count, destroyed at the last unprepare (MIG then turned off on that GPU), and
//! reconciled with a checkpoint when the plugin starts.
//!
//! The checkpoint (`mig.json` in the plugin's state folder) records each instance in one of
//! two states, NVIDIA's crash-recovery states (kubernetes-sigs/dra-driver-nvidia-gpu
//! `cmd/gpu-kubelet-plugin/device_state.go`, `checkpoint.go`: `PrepareStarted` written before
//! anything is created, `PrepareCompleted` once it is):
//! - [`State::PrepareStarted`]: written before the GPU instance is created. Found at start, the
//!   create may or may not have happened and no prepare answered with it: whatever sits at that
//!   placement is destroyed and the record dropped (the kubelet retries the prepare);
//! - [`State::PrepareCompleted`]: the instance exists with this MIG UUID and these claims use
//!   it. Found at start, it is adopted (left as it is) if NVML still shows it.
//!
//! Instances on a dynamic GPU that the checkpoint does not know are destroyed at start: nothing
//! this plugin prepared uses them, and they would hold slices the scheduler believes free.
//! Static GPUs are never touched.
//!
//! The NVML side is the [`MigControl`] trait (the real one over NVML in
//! [`tessera_node::nvml_mig`]; a fake in the tests). Creation is what NVML documents: MIG mode
//! on (Hopper switches without a reset; `NVML_ERROR_IN_USE` while contexts exist), the GPU
//! instance at the exact placement (`nvmlDeviceCreateGpuInstanceWithPlacement`), then one
//! compute instance spanning it (`nvmlGpuInstanceCreateComputeInstance`), then the MIG
//! device's UUID.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::mig::Placement;

/// The checkpoint's file name in the state folder.
pub(crate) const CHECKPOINT: &str = "mig.json";

/// Errors of MIG control or of the checkpoint.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MigError {
    /// An NVML call failed.
    #[error("NVML {call} on {gpu}: {message}")]
    Nvml {
        /// The call.
        call: &'static str,
        /// The parent GPU.
        gpu: String,
        /// NVML's error.
        message: String,
    },
    /// The checkpoint could not be read or written.
    #[error("MIG checkpoint {path}: {message}")]
    Checkpoint {
        /// Path.
        path: PathBuf,
        /// Cause.
        message: String,
    },
    /// Another profile's instance holds the placement (the scheduler's counters forbid this:
    /// a stale slice or an operator's instance).
    #[error("{gpu}: placement {start} is held by a {held} instance, {wanted} was asked for")]
    Conflict {
        /// The parent GPU.
        gpu: String,
        /// The placement's first memory slice.
        start: u32,
        /// What holds it.
        held: String,
        /// What was asked for.
        wanted: String,
    },
}

/// An instance NVML shows on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LiveInstance {
    /// GPU instance id.
    pub gpu_instance: u32,
    /// GPU-instance profile id.
    pub profile_id: u32,
    /// Placement.
    pub placement: Placement,
    /// The MIG device's UUID (`MIG-...`).
    pub uuid: String,
}

/// MIG control of the node's GPUs (parents named by UUID).
pub(crate) trait MigControl {
    /// Whether MIG mode is on (current mode).
    fn mig_enabled(&mut self, parent: &str) -> Result<bool, MigError>;
    /// Turns MIG mode on or off.
    fn set_mig(&mut self, parent: &str, on: bool) -> Result<(), MigError>;
    /// The GPU instances on `parent` (each with its compute instance's MIG device).
    fn instances(&mut self, parent: &str) -> Result<Vec<LiveInstance>, MigError>;
    /// Creates a GPU instance of `profile_id` at `placement` and one compute instance filling
    /// it; returns it with its MIG UUID.
    fn create(
        &mut self,
        parent: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<LiveInstance, MigError>;
    /// Destroys GPU instance `gpu_instance`'s compute instances, then it.
    fn destroy(&mut self, parent: &str, gpu_instance: u32) -> Result<(), MigError>;
}

/// The node's [`MigControl`], shared by the prepares (which run one at a time).
#[derive(Clone)]
pub(crate) struct MigHandle(pub std::sync::Arc<std::sync::Mutex<Box<dyn MigControl + Send>>>);

impl std::fmt::Debug for MigHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MigHandle")
    }
}

impl MigHandle {
    /// Wraps `ctl`.
    pub(crate) fn new(ctl: impl MigControl + Send + 'static) -> Self {
        Self(std::sync::Arc::new(std::sync::Mutex::new(Box::new(ctl))))
    }

    /// Runs `f` with the control (a poisoned lock is taken over: the checkpoint, not memory,
    /// is the state).
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut dyn MigControl) -> T) -> T {
        let mut g = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(g.as_mut())
    }
}

/// A node without MIG control: every call is refused (nothing asks for one when no GPU is
/// published with dynamic MIG).
#[derive(Debug, Clone, Copy)]
pub(crate) struct NoMig;

impl MigControl for NoMig {
    fn mig_enabled(&mut self, _: &str) -> Result<bool, MigError> {
        Ok(false)
    }
    fn set_mig(&mut self, gpu: &str, _: bool) -> Result<(), MigError> {
        Err(no_mig("set MIG mode", gpu))
    }
    fn instances(&mut self, _: &str) -> Result<Vec<LiveInstance>, MigError> {
        Ok(Vec::new())
    }
    fn create(&mut self, gpu: &str, _: u32, _: Placement) -> Result<LiveInstance, MigError> {
        Err(no_mig("create a MIG instance", gpu))
    }
    fn destroy(&mut self, gpu: &str, _: u32) -> Result<(), MigError> {
        Err(no_mig("destroy a MIG instance", gpu))
    }
}

fn no_mig(call: &'static str, gpu: &str) -> MigError {
    MigError::Nvml {
        call,
        gpu: gpu.to_owned(),
        message: "no MIG control on this node (no GPU published with dynamic MIG)".into(),
    }
}

/// NVML's MIG control ([`tessera_node::nvml_mig`]).
impl MigControl for tessera_node::nvml_mig::MigNvml {
    fn mig_enabled(&mut self, parent: &str) -> Result<bool, MigError> {
        tessera_node::nvml_mig::MigNvml::mig_enabled(self, parent).map_err(|e| nvml_err(parent, e))
    }
    fn set_mig(&mut self, parent: &str, on: bool) -> Result<(), MigError> {
        tessera_node::nvml_mig::MigNvml::set_mig(self, parent, on).map_err(|e| nvml_err(parent, e))
    }
    fn instances(&mut self, parent: &str) -> Result<Vec<LiveInstance>, MigError> {
        let all = tessera_node::nvml_mig::MigNvml::instances(self, parent)
            .map_err(|e| nvml_err(parent, e))?;
        Ok(all.into_iter().map(live).collect())
    }
    fn create(
        &mut self,
        parent: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<LiveInstance, MigError> {
        tessera_node::nvml_mig::MigNvml::create(
            self,
            parent,
            profile_id,
            placement.start,
            placement.size,
        )
        .map(live)
        .map_err(|e| nvml_err(parent, e))
    }
    fn destroy(&mut self, parent: &str, gpu_instance: u32) -> Result<(), MigError> {
        tessera_node::nvml_mig::MigNvml::destroy(self, parent, gpu_instance)
            .map_err(|e| nvml_err(parent, e))
    }
}

fn live(i: tessera_node::nvml_mig::InstanceInfo) -> LiveInstance {
    LiveInstance {
        gpu_instance: i.id,
        profile_id: i.profile_id,
        placement: Placement {
            start: i.placement.0,
            size: i.placement.1,
        },
        // A GPU instance without a compute instance has no MIG device: no UUID to match.
        uuid: i.uuid.unwrap_or_default(),
    }
}

fn nvml_err(gpu: &str, e: tessera_node::nvml_mig::MigNvmlError) -> MigError {
    MigError::Nvml {
        call: "MIG",
        gpu: gpu.to_owned(),
        message: e.to_string(),
    }
}

/// A record's crash-recovery state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum State {
    /// About to create: nothing answered with it yet.
    PrepareStarted,
    /// Created; claims use it.
    PrepareCompleted,
}

/// One instance this plugin made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Record {
    /// The parent GPU's UUID.
    pub parent: String,
    /// Profile name (`1g.18gb`).
    pub profile: String,
    /// NVML profile id.
    pub profile_id: u32,
    /// Placement start (memory slice).
    pub start: u32,
    /// Placement size (memory slices).
    pub size: u32,
    /// State.
    pub state: State,
    /// GPU instance id, once created.
    pub gpu_instance: Option<u32>,
    /// MIG UUID, once created.
    pub uuid: Option<String>,
    /// Uids of the claims using it.
    pub claims: BTreeSet<String>,
}

/// The checkpoint: the instances this plugin made.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Checkpoint {
    /// Records.
    pub records: Vec<Record>,
}

impl Checkpoint {
    /// Reads `path`; a missing file is an empty checkpoint.
    pub(crate) fn load(path: &Path) -> Result<Self, MigError> {
        let err = |message: String| MigError::Checkpoint {
            path: path.to_path_buf(),
            message,
        };
        match std::fs::read(path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| err(e.to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// Writes `path` whole or not at all (a temporary file renamed over it, synced first).
    pub(crate) fn save(&self, path: &Path) -> Result<(), MigError> {
        let err = |message: String| MigError::Checkpoint {
            path: path.to_path_buf(),
            message,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
        }
        let tmp = path.with_extension("json.tmp");
        let body = serde_json::to_vec_pretty(self).map_err(|e| err(e.to_string()))?;
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        write().map_err(|e| err(e.to_string()))
    }
}

/// The instance a claim's result needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    /// Parent GPU UUID.
    pub parent: String,
    /// Profile name.
    pub profile: String,
    /// NVML profile id.
    pub profile_id: u32,
    /// Placement.
    pub placement: Placement,
}

/// Gives claim `uid` the instance `want` describes, creating it (and turning MIG on) if no
/// claim uses one there yet; returns its MIG UUID. Repeating it for the same claim is
/// harmless.
pub(crate) fn acquire<C: MigControl + ?Sized>(
    ctl: &mut C,
    checkpoint: &Path,
    uid: &str,
    want: &Want,
) -> Result<String, MigError> {
    let mut ck = Checkpoint::load(checkpoint)?;
    let at = |r: &Record| r.parent == want.parent && r.start == want.placement.start;
    if let Some(i) = ck.records.iter().position(at) {
        let r = &ck.records[i];
        if r.profile != want.profile {
            return Err(MigError::Conflict {
                gpu: want.parent.clone(),
                start: want.placement.start,
                held: r.profile.clone(),
                wanted: want.profile.clone(),
            });
        }
        let live = ctl.instances(&want.parent)?;
        if let (State::PrepareCompleted, Some(uuid)) = (r.state, &r.uuid)
            && live.iter().any(|l| &l.uuid == uuid)
        {
            let uuid = uuid.clone();
            ck.records[i].claims.insert(uid.to_owned());
            ck.save(checkpoint)?;
            return Ok(uuid);
        }
        // Started and never finished, or gone: start over at this placement.
        destroy_at(ctl, &want.parent, want.placement.start, &live)?;
        ck.records.remove(i);
        ck.save(checkpoint)?;
    }
    if !ctl.mig_enabled(&want.parent)? {
        tracing::info!("{}: turning MIG mode on", want.parent);
        ctl.set_mig(&want.parent, true)?;
    }
    // A leftover at this placement that the checkpoint does not know (an operator's, or one
    // from before a lost checkpoint) would make the create fail: refuse clearly instead.
    let live = ctl.instances(&want.parent)?;
    if let Some(l) = live.iter().find(|l| overlaps(l.placement, want.placement)) {
        return Err(MigError::Conflict {
            gpu: want.parent.clone(),
            start: want.placement.start,
            held: format!("unknown (GPU instance {}, {})", l.gpu_instance, l.uuid),
            wanted: want.profile.clone(),
        });
    }
    ck.records.push(Record {
        parent: want.parent.clone(),
        profile: want.profile.clone(),
        profile_id: want.profile_id,
        start: want.placement.start,
        size: want.placement.size,
        state: State::PrepareStarted,
        gpu_instance: None,
        uuid: None,
        claims: BTreeSet::from([uid.to_owned()]),
    });
    ck.save(checkpoint)?;
    match ctl.create(&want.parent, want.profile_id, want.placement) {
        Ok(live) => {
            let r = ck.records.last_mut().expect("just pushed");
            r.state = State::PrepareCompleted;
            r.gpu_instance = Some(live.gpu_instance);
            r.uuid = Some(live.uuid.clone());
            ck.save(checkpoint)?;
            tracing::info!(
                "{}: created MIG {} at {} ({})",
                want.parent,
                want.profile,
                want.placement.start,
                live.uuid
            );
            Ok(live.uuid)
        }
        Err(e) => {
            ck.records.pop();
            ck.save(checkpoint)?;
            mig_off_if_unused(ctl, &ck, &want.parent);
            Err(e)
        }
    }
}

fn overlaps(a: Placement, b: Placement) -> bool {
    a.start < b.start + b.size && b.start < a.start + a.size
}

fn destroy_at<C: MigControl + ?Sized>(
    ctl: &mut C,
    parent: &str,
    start: u32,
    live: &[LiveInstance],
) -> Result<(), MigError> {
    for l in live.iter().filter(|l| l.placement.start == start) {
        ctl.destroy(parent, l.gpu_instance)?;
    }
    Ok(())
}

/// Turns MIG off on `parent` when the checkpoint holds no instance of it; a GPU still busy
/// (`IN_USE`) keeps it on, logged, and the next release or start tries again.
fn mig_off_if_unused<C: MigControl + ?Sized>(ctl: &mut C, ck: &Checkpoint, parent: &str) {
    if ck.records.iter().any(|r| r.parent == parent) {
        return;
    }
    let result = ctl
        .instances(parent)
        .and_then(|live| match live.is_empty() {
            true => ctl.mig_enabled(parent),
            false => Ok(false),
        })
        .and_then(|on| {
            if on {
                ctl.set_mig(parent, false)
            } else {
                Ok(())
            }
        });
    if let Err(e) = result {
        tracing::warn!("{parent}: MIG mode left on: {e}");
    }
}

/// Drops claim `uid` from every instance; destroys those no claim uses any more and turns MIG
/// off on a GPU left with none. Returns the MIG UUIDs destroyed. Repeating it is harmless.
pub(crate) fn release<C: MigControl + ?Sized>(
    ctl: &mut C,
    checkpoint: &Path,
    uid: &str,
) -> Result<Vec<String>, MigError> {
    let mut ck = Checkpoint::load(checkpoint)?;
    if !ck.records.iter().any(|r| r.claims.contains(uid)) {
        return Ok(Vec::new());
    }
    let mut destroyed = Vec::new();
    let mut parents = BTreeSet::new();
    for r in &mut ck.records {
        r.claims.remove(uid);
    }
    let mut i = 0;
    while i < ck.records.len() {
        if !ck.records[i].claims.is_empty() {
            i += 1;
            continue;
        }
        let r = ck.records[i].clone();
        let live = ctl.instances(&r.parent)?;
        destroy_at(ctl, &r.parent, r.start, &live)?;
        destroyed.extend(r.uuid.clone());
        parents.insert(r.parent.clone());
        ck.records.remove(i);
        ck.save(checkpoint)?;
        tracing::info!("{}: destroyed MIG {} at {}", r.parent, r.profile, r.start);
    }
    ck.save(checkpoint)?;
    for p in parents {
        mig_off_if_unused(ctl, &ck, &p);
    }
    Ok(destroyed)
}

/// What [`reconcile`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Reconciled {
    /// MIG UUIDs adopted (checkpointed and alive).
    pub adopted: Vec<String>,
    /// GPU instances destroyed `(parent, gpu instance id)`: unknown, or a started create.
    pub destroyed: Vec<(String, u32)>,
    /// Records dropped because their instance is gone or no prepared claim uses them.
    pub dropped: usize,
}

/// At start: adopts the checkpoint's completed instances that NVML still shows and that a
/// claim in `prepared` (uids the arbiter still has allocations for) uses; destroys started
/// creates, instances no prepared claim uses, and the unknown instances of the dynamic GPUs
/// `parents`; turns MIG off on a dynamic GPU left with none.
pub(crate) fn reconcile<C: MigControl + ?Sized>(
    ctl: &mut C,
    checkpoint: &Path,
    parents: &[String],
    prepared: &BTreeSet<String>,
) -> Result<Reconciled, MigError> {
    let mut ck = Checkpoint::load(checkpoint)?;
    let mut out = Reconciled::default();
    let mut keep = Vec::new();
    for mut r in std::mem::take(&mut ck.records) {
        r.claims.retain(|c| prepared.contains(c));
        let alive = match (&r.uuid, r.state) {
            (Some(uuid), State::PrepareCompleted) => ctl
                .instances(&r.parent)?
                .into_iter()
                .any(|l| &l.uuid == uuid),
            _ => false,
        };
        if alive && !r.claims.is_empty() {
            out.adopted.extend(r.uuid.clone());
            keep.push(r);
        } else {
            out.dropped += 1;
        }
    }
    ck.records = keep;
    ck.save(checkpoint)?;
    for p in parents {
        let known: BTreeSet<&str> = ck
            .records
            .iter()
            .filter(|r| &r.parent == p)
            .filter_map(|r| r.uuid.as_deref())
            .collect();
        for l in ctl.instances(p)? {
            if !known.contains(l.uuid.as_str()) {
                tracing::info!("{p}: destroying MIG instance {} nothing uses", l.uuid);
                ctl.destroy(p, l.gpu_instance)?;
                out.destroyed.push((p.clone(), l.gpu_instance));
            }
        }
        mig_off_if_unused(ctl, &ck, p);
    }
    Ok(out)
}

/// Before a whole GPU of a dynamic GPU is prepared: MIG must be off, or CUDA shows no device.
/// The scheduler's counters keep MIG claims off a GPU whose whole device is allocated, so
/// nothing of this plugin's can be on it; an instance someone else made is refused.
pub(crate) fn ensure_whole<C: MigControl + ?Sized>(
    ctl: &mut C,
    checkpoint: &Path,
    parent: &str,
) -> Result<(), MigError> {
    let ck = Checkpoint::load(checkpoint)?;
    if let Some(r) = ck.records.iter().find(|r| r.parent == parent) {
        return Err(MigError::Conflict {
            gpu: parent.to_owned(),
            start: r.start,
            held: r.profile.clone(),
            wanted: "the whole GPU".into(),
        });
    }
    if !ctl.mig_enabled(parent)? {
        return Ok(());
    }
    if let Some(l) = ctl.instances(parent)?.first() {
        return Err(MigError::Conflict {
            gpu: parent.to_owned(),
            start: l.placement.start,
            held: format!("unknown (GPU instance {}, {})", l.gpu_instance, l.uuid),
            wanted: "the whole GPU".into(),
        });
    }
    ctl.set_mig(parent, false)
}

#[cfg(test)]
#[path = "instances_tests.rs"]
mod tests;
