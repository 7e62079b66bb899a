//! The `Allocate` logic, free of gRPC and of sockets: plain functions over the unit ids the
//! kubelet chose, the GPU snapshot and an [`Arbiter`]. `crate::server` decodes the request,
//! runs [`plan_in`] and then [`execute`] on the blocking pool, and maps an [`AllocateError`]
//! to a gRPC status.
//!
//! - [`plan_in`]: classifies each container's units (one GPU, or whole GPUs), refuses GPUs that
//!   are gone or unhealthy, and lists one arbiter allocation per fraction or per whole GPU.
//!   It makes no call, so a bad request is refused even while the arbiter is down.
//! - [`execute`]: deletes allocations whose units are being handed out again, creates every
//!   planned allocation or none (rollback), sweeps identity files of deleted allocations,
//!   writes each container's identity file and builds the container responses (with the
//!   GPUs' NVIDIA CDI devices when [`Settings::cdi_kind`] is set: [`crate::cdi`]).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};

use tessera_protocol::client::ClientError;
use tessera_protocol::identity::Identity;
use tessera_protocol::{AdminErrorKind, AllocationStatus, CreateAllocation, GpuSelector, Tier};

use crate::cdi;
use crate::proto::deviceplugin::{ContainerAllocateResponse, Mount};
use crate::units::{self, Claim, Pool, UnitsError};
use tessera_node::arbiter::Arbiter;
use tessera_node::cdi::CdiKind;
use tessera_node::health::GpuState;
use tessera_node::identity::{self, IdentityError};
use tessera_node::install::Installed;

/// The environment variables carrying into the container the allocation's secret token, the
/// tenant socket's path inside it and the public allocation id(s): the node contract's.
pub(crate) use tessera_protocol::node::{
    ENV_ALLOCATION_ID as ENV_ALLOCATION, ENV_SOCKET, ENV_TOKEN,
};
/// The NVIDIA container runtime's GPU selection (legacy mode; kept with CDI devices too).
pub(crate) const ENV_VISIBLE: &str = "NVIDIA_VISIBLE_DEVICES";
/// Where glibc's loader reads libraries to preload.
pub(crate) const CONTAINER_PRELOAD: &str = "/etc/ld.so.preload";
pub(crate) use tessera_protocol::identity::CONTAINER_IDENTITY_FILE;

/// Why an `Allocate` was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AllocateError {
    /// Unit ids that are malformed, repeated, or spread over GPUs that are not whole.
    #[error(transparent)]
    Units(#[from] UnitsError),
    /// A GPU that is not on this node (any more).
    #[error("GPU {0} is not on this node")]
    UnknownGpu(String),
    /// A GPU marked unhealthy.
    #[error("GPU {uuid} is unhealthy ({reason})")]
    UnhealthyGpu {
        /// The GPU.
        uuid: String,
        /// Why (an XID, ...).
        reason: String,
    },
    /// An admin call failed (the arbiter refused, or the connection broke).
    #[error("{0}")]
    Arbiter(#[source] ClientError),
    /// A container's identity file could not be written.
    #[error(transparent)]
    Identity(#[from] IdentityError),
}

/// Where things are on the host and in containers.
#[derive(Debug, Clone)]
pub(crate) struct Mounts {
    /// Host path of the arbiter's tenant socket; its folder is mounted into containers.
    pub tenant_socket: PathBuf,
    /// Folder the tenant socket's folder appears as in containers.
    pub container_socket_dir: PathBuf,
    /// The installed interposer on the host.
    pub installed: Installed,
    /// Path of the interposer inside containers (what the preload file names).
    pub container_lib_path: PathBuf,
    /// Host folder of the per-container identity files.
    pub host_identity_dir: PathBuf,
}

impl Mounts {
    /// The tenant socket's path inside containers.
    fn container_socket(&self) -> PathBuf {
        let name = self
            .tenant_socket
            .file_name()
            .map(Path::new)
            .unwrap_or(Path::new("tessera.sock"));
        self.container_socket_dir.join(name)
    }
}

/// The fixed settings `Allocate` works with.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// Units per GPU.
    pub per_gpu: u32,
    /// Extended resource name (also stored in allocation labels).
    pub resource_name: String,
    /// The unit numbers of each GPU this resource advertises.
    pub pool: Pool,
    /// The tier of every allocation made for this resource: the resource decides it, nothing
    /// in the container does.
    pub tier: Tier,
    /// Container wiring.
    pub mounts: Mounts,
    /// The CDI kind of the node's NVIDIA spec (`nvidia.com/gpu`, devices named by GPU UUID):
    /// each container's answer then names `<kind>=<uuid>` for each of its GPUs, so a runtime
    /// with CDI and without NVIDIA's runtime injects the driver. `None`: no CDI devices (the
    /// NVIDIA container runtime reads `NVIDIA_VISIBLE_DEVICES`).
    pub cdi_kind: Option<CdiKind>,
}

/// One arbiter allocation to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Planned {
    /// Index of the container request it serves.
    pub container: usize,
    /// The GPU.
    pub uuid: String,
    /// Its unit numbers on that GPU.
    pub units: BTreeSet<u32>,
}

/// What one `Allocate` will create.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Number of container requests (one response each).
    pub containers: usize,
    /// The allocations, in container order.
    pub allocations: Vec<Planned>,
    /// Containers that get whole GPUs, with their GPUs.
    pub whole: BTreeMap<usize, Vec<String>>,
}

/// Plans the allocations for each container's unit ids (`requests`, in request order) against
/// the node's GPUs, for a resource advertising `pool` of each GPU's units: a unit outside it
/// is refused before anything else. Makes no call.
pub(crate) fn plan_in(
    requests: &[Vec<String>],
    snapshot: &[GpuState],
    per_gpu: u32,
    pool: Pool,
) -> Result<Plan, AllocateError> {
    let mut out = Plan {
        containers: requests.len(),
        ..Plan::default()
    };
    for (i, ids) in requests.iter().enumerate() {
        pool.check(ids)?;
        let claim = units::classify(ids, per_gpu)?;
        let uuids = match &claim {
            Claim::Fraction { uuid, .. } => std::slice::from_ref(uuid),
            Claim::WholeGpus { uuids } => uuids.as_slice(),
        };
        for u in uuids {
            match snapshot.iter().find(|g| &g.uuid == u) {
                None => return Err(AllocateError::UnknownGpu(u.clone())),
                Some(GpuState {
                    unhealthy: Some(reason),
                    ..
                }) => {
                    return Err(AllocateError::UnhealthyGpu {
                        uuid: u.clone(),
                        reason: reason.clone(),
                    });
                }
                Some(_) => {}
            }
        }
        match claim {
            Claim::Fraction { uuid, units } => out.allocations.push(Planned {
                container: i,
                uuid,
                units: units.into_iter().collect(),
            }),
            Claim::WholeGpus { uuids } => {
                for uuid in &uuids {
                    out.allocations.push(Planned {
                        container: i,
                        uuid: uuid.clone(),
                        units: (0..per_gpu).collect(),
                    });
                }
                out.whole.insert(i, uuids);
            }
        }
    }
    Ok(out)
}

/// Makes the planned allocations (all or none) and answers one response per container.
pub(crate) fn execute<A: Arbiter + ?Sized>(
    arbiter: &mut A,
    plan: &Plan,
    settings: &Settings,
) -> Result<Vec<ContainerAllocateResponse>, AllocateError> {
    let made = create_all(
        arbiter,
        &plan.allocations,
        settings.per_gpu,
        &settings.resource_name,
        settings.tier,
        &settings.mounts.host_identity_dir,
    )
    .map_err(AllocateError::Arbiter)?;
    respond(plan, &made, &settings.mounts, settings.cdi_kind.as_ref())
}

/// Makes every planned allocation, or none: on a failure the ones already made are deleted
/// again. Returns `(token, status)` per plan, in plan order.
fn create_all<A: Arbiter + ?Sized>(
    c: &mut A,
    plans: &[Planned],
    per_gpu: u32,
    resource: &str,
    tier: Tier,
    identity_dir: &Path,
) -> Result<Vec<(String, AllocationStatus)>, ClientError> {
    let gpus = c.gpus()?;
    let mut live: HashSet<String> = HashSet::new();
    // Units the kubelet hands out again are free in its eyes: an allocation still holding
    // them belongs to a container that is gone (or to an Allocate the kubelet retried).
    let wanted: HashSet<String> = plans
        .iter()
        .flat_map(|p| p.units.iter().map(move |n| format!("{}-{n}", p.uuid)))
        .collect();
    for a in c.list()? {
        live.insert(a.id.clone());
        let Some(ids) = units::units_from_labels(&a.labels, resource) else {
            continue;
        };
        if ids.iter().any(|id| wanted.contains(id)) {
            tracing::info!(
                "deleting allocation {} (its units are being reassigned)",
                a.id
            );
            match c.delete(&a.id) {
                Ok(())
                | Err(ClientError::Admin {
                    kind: AdminErrorKind::NotFound,
                    ..
                }) => {
                    live.remove(&a.id);
                }
                Err(e) => return Err(e),
            }
        }
    }
    let mut made: Vec<(String, AllocationStatus)> = Vec::new();
    let mut result = Ok(());
    for p in plans {
        let Some(gpu) = gpus.iter().find(|g| g.uuid == p.uuid) else {
            result = Err(ClientError::Admin {
                kind: AdminErrorKind::InvalidArgument,
                message: format!("the arbiter does not know GPU {}", p.uuid),
            });
            break;
        };
        let n = p.units.len() as u32;
        let mut labels = units::allocation_labels(resource, &p.uuid, &p.units);
        if n == per_gpu {
            // The whole cards of one container form a group, named by its first card (held by
            // this container alone): the backstop lets the container use all of them, and
            // polices it on every other card.
            let first = plans
                .iter()
                .find(|q| q.container == p.container && q.units.len() as u32 == per_gpu);
            if let Some(first) = first {
                labels.insert(
                    tessera_protocol::LABEL_WHOLE_GROUP.to_owned(),
                    first.uuid.clone(),
                );
            }
        }
        let req = CreateAllocation {
            gpu: GpuSelector::Uuid(p.uuid.clone()),
            memory_limit: units::memory_for(n, per_gpu, gpu.memory_total),
            share: units::share_for(n, per_gpu),
            cap: None,
            labels,
        };
        // Best-effort keeps the plain create, which every arbiter version takes.
        let created = match tier {
            Tier::BestEffort => c.create(req),
            Tier::Latency => c.create_tiered(req, tier),
        };
        match created {
            Ok(x) => made.push(x),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if let Err(e) = result {
        for (_, a) in &made {
            let _ = c.delete(&a.id);
        }
        return Err(e);
    }
    // Identity files of allocations deleted since (here, or by the stale clean-up) go.
    live.extend(made.iter().map(|(_, a)| a.id.clone()));
    identity::sweep(identity_dir, &live);
    Ok(made)
}

/// One response per container from the allocations made for it (`made`, in plan order); with
/// `cdi`, each names its GPUs' NVIDIA CDI devices.
fn respond(
    plan: &Plan,
    made: &[(String, AllocationStatus)],
    m: &Mounts,
    cdi: Option<&CdiKind>,
) -> Result<Vec<ContainerAllocateResponse>, AllocateError> {
    let container_socket = m.container_socket();
    let mut container_responses = Vec::new();
    for i in 0..plan.containers {
        let mine: Vec<(&Planned, &(String, AllocationStatus))> = plan
            .allocations
            .iter()
            .zip(made)
            .filter(|(p, _)| p.container == i)
            .collect();
        let ids: Vec<&str> = mine.iter().map(|(_, (_, a))| a.id.as_str()).collect();
        let whole = plan.whole.get(&i);
        // The container's identity: its (first) allocation's token. For whole GPUs it only
        // lets the backstop know the container's processes are entitled to the cards.
        let identity = match mine.first() {
            Some((_, (token, a))) => {
                let id = Identity {
                    token: token.clone(),
                    socket: whole.is_none().then(|| container_socket.clone()),
                    allocation: Some(a.id.clone()),
                };
                Some(identity::write(&m.host_identity_dir, &a.id, &id)?)
            }
            None => None,
        };
        if let Some(uuids) = whole {
            // Whole GPUs: the container has the cards to itself; no interposer, no token.
            let envs = BTreeMap::from([
                (ENV_VISIBLE.to_owned(), uuids.join(",")),
                (ENV_ALLOCATION.to_owned(), ids.join(",")),
            ]);
            container_responses.push(ContainerAllocateResponse {
                envs: envs.into_iter().collect(),
                mounts: identity
                    .iter()
                    .map(|p| mount(Path::new(CONTAINER_IDENTITY_FILE), p))
                    .collect(),
                cdi_devices: cdi
                    .map(|k| cdi::devices(k, uuids.iter().map(String::as_str)))
                    .unwrap_or_default(),
                ..Default::default()
            });
        } else if let (Some((p, (token, a))), Some(identity)) = (mine.first(), &identity) {
            tracing::info!(
                "allocation {} on {}: {} units, {}",
                a.id,
                p.uuid,
                p.units.len(),
                tessera_protocol::size::human(a.memory_limit)
            );
            let mut r = fraction_response(m, &p.uuid, token, &a.id, identity);
            if let Some(k) = cdi {
                r.cdi_devices = cdi::devices(k, [p.uuid.as_str()]);
            }
            container_responses.push(r);
        }
    }
    Ok(container_responses)
}

fn mount(container: &Path, host: &Path) -> Mount {
    Mount {
        container_path: container.display().to_string(),
        host_path: host.display().to_string(),
        read_only: true,
    }
}

/// The container wiring for a fraction: token, socket, preload of the interposer, and the
/// identity file (`identity`: its host path), which the interposer trusts over the
/// environment (the environment variables stay for tools and for people).
fn fraction_response(
    m: &Mounts,
    uuid: &str,
    token: &str,
    id: &str,
    identity: &Path,
) -> ContainerAllocateResponse {
    let host_sock_dir = m.tenant_socket.parent().unwrap_or(Path::new("/"));
    let envs = BTreeMap::from([
        (ENV_TOKEN.to_owned(), token.to_owned()),
        (
            ENV_SOCKET.to_owned(),
            m.container_socket().display().to_string(),
        ),
        (ENV_VISIBLE.to_owned(), uuid.to_owned()),
        (ENV_ALLOCATION.to_owned(), id.to_owned()),
    ]);
    ContainerAllocateResponse {
        envs: envs.into_iter().collect(),
        mounts: vec![
            mount(&m.container_lib_path, &m.installed.lib_path),
            mount(Path::new(CONTAINER_PRELOAD), &m.installed.preload_path),
            mount(&m.container_socket_dir, host_sock_dir),
            mount(Path::new(CONTAINER_IDENTITY_FILE), identity),
        ],
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every unit of a GPU in the pool.
    fn plan(
        requests: &[Vec<String>],
        snapshot: &[GpuState],
        per_gpu: u32,
    ) -> Result<Plan, AllocateError> {
        plan_in(requests, snapshot, per_gpu, Pool::all(per_gpu))
    }

    /// [`plan_in`] then [`execute`], as the server does.
    fn allocate<A: Arbiter + ?Sized>(
        arbiter: &mut A,
        requests: &[Vec<String>],
        snapshot: &[GpuState],
        settings: &Settings,
    ) -> Result<Vec<ContainerAllocateResponse>, AllocateError> {
        let plan = plan_in(requests, snapshot, settings.per_gpu, settings.pool)?;
        execute(arbiter, &plan, settings)
    }
    use tessera_node::arbiter::fake::{Call, FakeArbiter};

    const R: &str = "tessera.dev/gpu-shares";
    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, uuid: &str, unhealthy: Option<&str>) -> GpuState {
        GpuState {
            index,
            uuid: uuid.into(),
            memory_total: 80 * GIB,
            unhealthy: unhealthy.map(str::to_owned),
        }
    }

    fn two_gpus() -> Vec<GpuState> {
        vec![gpu(0, "GPU-a", None), gpu(1, "GPU-b", None)]
    }

    fn fake() -> FakeArbiter {
        FakeArbiter::with_gpus(&[("GPU-a", 80 * GIB), ("GPU-b", 80 * GIB)])
    }

    fn mounts(identity_dir: &Path) -> Mounts {
        Mounts {
            tenant_socket: "/run/tessera/tenant/tessera.sock".into(),
            container_socket_dir: "/run/tessera".into(),
            installed: Installed {
                lib_path: "/var/lib/tessera/lib/libtessera_interpose-0.1.0-abcd1234.so".into(),
                preload_path: "/var/lib/tessera/lib/ld.so.preload-0.1.0-abcd1234".into(),
                tag: "0.1.0-abcd1234".into(),
                wrote_lib: false,
            },
            container_lib_path: "/usr/lib/tessera/libtessera_interpose.so".into(),
            host_identity_dir: identity_dir.to_owned(),
        }
    }

    fn settings(per_gpu: u32, identity_dir: &Path) -> Settings {
        Settings {
            per_gpu,
            resource_name: R.into(),
            pool: Pool::all(per_gpu),
            tier: Tier::BestEffort,
            mounts: mounts(identity_dir),
            cdi_kind: None,
        }
    }

    /// The names of an answer's CDI devices.
    fn cdi_names(r: &ContainerAllocateResponse) -> Vec<&str> {
        r.cdi_devices.iter().map(|d| d.name.as_str()).collect()
    }

    fn ids(uuid: &str, units: std::ops::Range<u32>) -> Vec<String> {
        units.map(|n| format!("{uuid}-{n}")).collect()
    }

    /// Names of the files in the identity folder, sorted.
    fn identity_files(dir: &Path) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut names: Vec<String> = entries
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn read_identity(path: &str) -> Identity {
        Identity::parse(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    #[test]
    fn fraction_plan_and_response_wiring() {
        let tmp = tempfile::tempdir().unwrap();
        let s = settings(100, tmp.path());
        let mut arb = fake();
        let requests = vec![ids("GPU-a", 0..30)];
        let plan = plan(&requests, &two_gpus(), 100).unwrap();
        assert_eq!(
            plan.allocations,
            vec![Planned {
                container: 0,
                uuid: "GPU-a".into(),
                units: (0..30).collect(),
            }]
        );
        assert!(plan.whole.is_empty());
        let out = execute(&mut arb, &plan, &s).unwrap();
        assert_eq!(
            arb.calls,
            vec![
                Call::Gpus,
                Call::List,
                Call::Create {
                    gpu: "GPU-a".into(),
                    memory_limit: 24 * GIB,
                    share: 30,
                },
            ]
        );
        assert_eq!(arb.get("a1").unwrap().labels[units::LABEL_UNITS], "0-29");
        assert_eq!(out.len(), 1);
        let r = &out[0];
        assert_eq!(r.envs[ENV_TOKEN], "token-1");
        assert_eq!(r.envs[ENV_SOCKET], "/run/tessera/tessera.sock");
        assert_eq!(r.envs[ENV_VISIBLE], "GPU-a");
        assert_eq!(r.envs[ENV_ALLOCATION], "a1");
        let container_paths: Vec<&str> =
            r.mounts.iter().map(|m| m.container_path.as_str()).collect();
        assert_eq!(
            container_paths,
            [
                "/usr/lib/tessera/libtessera_interpose.so",
                CONTAINER_PRELOAD,
                "/run/tessera",
                CONTAINER_IDENTITY_FILE,
            ]
        );
        assert!(r.mounts.iter().all(|m| m.read_only));
        assert_eq!(r.mounts[2].host_path, "/run/tessera/tenant");
        // The identity file the last mount names holds the token and the socket.
        let identity = read_identity(&r.mounts[3].host_path);
        assert_eq!(identity.token, "token-1");
        assert_eq!(
            identity.socket.as_deref(),
            Some(Path::new("/run/tessera/tessera.sock"))
        );
        assert_eq!(identity.allocation.as_deref(), Some("a1"));
        assert_eq!(identity_files(tmp.path()).len(), 1);
        // Without --nvidia-cdi-kind: no CDI devices, the NVIDIA runtime reads the variable.
        assert!(r.cdi_devices.is_empty(), "{:?}", r.cdi_devices);
    }

    #[test]
    fn each_container_gets_its_own_allocation_in_order() {
        let tmp = tempfile::tempdir().unwrap();
        let mut arb = fake();
        let requests = vec![ids("GPU-b", 0..50), ids("GPU-a", 10..20)];
        let out = allocate(&mut arb, &requests, &two_gpus(), &settings(100, tmp.path())).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].envs[ENV_VISIBLE], "GPU-b");
        assert_eq!(out[0].envs[ENV_ALLOCATION], "a1");
        assert_eq!(out[1].envs[ENV_VISIBLE], "GPU-a");
        assert_eq!(out[1].envs[ENV_TOKEN], "token-2");
        assert_eq!(arb.get("a1").unwrap().memory_limit, 40 * GIB);
        assert_eq!(arb.get("a2").unwrap().share, 10);
        assert_eq!(identity_files(tmp.path()).len(), 2);
    }

    #[test]
    fn whole_gpus_across_two_cards() {
        let tmp = tempfile::tempdir().unwrap();
        let mut arb = fake();
        let mut units = ids("GPU-b", 0..4);
        units.extend(ids("GPU-a", 0..4));
        let requests = vec![units];
        let plan = plan(&requests, &two_gpus(), 4).unwrap();
        assert_eq!(plan.allocations.len(), 2);
        assert_eq!(plan.whole[&0], ["GPU-a", "GPU-b"]);
        let out = execute(&mut arb, &plan, &settings(4, tmp.path())).unwrap();
        let creates: Vec<&Call> = arb
            .calls
            .iter()
            .filter(|c| matches!(c, Call::Create { .. }))
            .collect();
        assert_eq!(
            creates,
            [
                &Call::Create {
                    gpu: "GPU-a".into(),
                    memory_limit: 80 * GIB,
                    share: 100,
                },
                &Call::Create {
                    gpu: "GPU-b".into(),
                    memory_limit: 80 * GIB,
                    share: 100,
                },
            ]
        );
        assert_eq!(out.len(), 1);
        let r = &out[0];
        // The cards to itself: no token, no socket, no interposer; only the identity file.
        assert_eq!(r.envs[ENV_VISIBLE], "GPU-a,GPU-b");
        assert_eq!(r.envs[ENV_ALLOCATION], "a1,a2");
        assert!(!r.envs.contains_key(ENV_TOKEN) && !r.envs.contains_key(ENV_SOCKET));
        assert_eq!(r.mounts.len(), 1);
        assert_eq!(r.mounts[0].container_path, CONTAINER_IDENTITY_FILE);
        assert!(r.cdi_devices.is_empty(), "{:?}", r.cdi_devices);
        let identity = read_identity(&r.mounts[0].host_path);
        assert_eq!(identity.token, "token-1");
        assert_eq!(identity.socket, None);
        assert_eq!(identity.allocation.as_deref(), Some("a1"));
        // One group for both cards, so the backstop lets the container use both.
        let group =
            |id: &str| arb.get(id).unwrap().labels[tessera_protocol::LABEL_WHOLE_GROUP].clone();
        assert_eq!((group("a1"), group("a2")), ("GPU-a".into(), "GPU-a".into()));
    }

    #[test]
    fn units_spread_over_gpus_are_refused_before_any_call() {
        let tmp = tempfile::tempdir().unwrap();
        let mut arb = fake();
        let mut units = ids("GPU-a", 0..2);
        units.extend(ids("GPU-b", 0..2));
        let err = allocate(&mut arb, &[units], &two_gpus(), &settings(4, tmp.path())).unwrap_err();
        assert!(
            matches!(
                err,
                AllocateError::Units(UnitsError::SpreadNotWhole { gpus: 2, .. })
            ),
            "{err:?}"
        );
        assert!(arb.calls.is_empty());
        assert!(identity_files(tmp.path()).is_empty());
    }

    #[test]
    fn unknown_and_unhealthy_gpus_are_refused_before_any_call() {
        let tmp = tempfile::tempdir().unwrap();
        let s = settings(4, tmp.path());
        let snapshot = vec![gpu(0, "GPU-a", None), gpu(1, "GPU-b", Some("XID 79"))];
        let mut arb = fake();
        let err = allocate(&mut arb, &[ids("GPU-c", 0..1)], &snapshot, &s).unwrap_err();
        assert!(
            matches!(&err, AllocateError::UnknownGpu(u) if u == "GPU-c"),
            "{err:?}"
        );
        let err = allocate(&mut arb, &[ids("GPU-b", 0..1)], &snapshot, &s).unwrap_err();
        assert_eq!(err.to_string(), "GPU GPU-b is unhealthy (XID 79)");
        // One bad container refuses the whole request, healthy ones included.
        let requests = vec![ids("GPU-a", 0..1), ids("GPU-b", 0..1)];
        let err = allocate(&mut arb, &requests, &snapshot, &s).unwrap_err();
        assert!(matches!(err, AllocateError::UnhealthyGpu { .. }), "{err:?}");
        assert!(arb.calls.is_empty());
    }

    #[test]
    fn reassigned_units_delete_the_old_allocation_first() {
        let tmp = tempfile::tempdir().unwrap();
        let s = settings(100, tmp.path());
        let mut arb = fake();
        // A CLI allocation on the same GPU carries no unit labels: never ours to replace.
        let cli = CreateAllocation {
            gpu: GpuSelector::Uuid("GPU-a".into()),
            memory_limit: GIB,
            share: 1,
            cap: None,
            labels: BTreeMap::new(),
        };
        let (_, cli) = arb.create(cli).unwrap();
        allocate(&mut arb, &[ids("GPU-a", 0..10)], &two_gpus(), &s).unwrap();
        let old = identity_files(tmp.path());
        assert_eq!(old.len(), 1);
        assert!(old[0].starts_with("a2."), "{old:?}");
        arb.calls.clear();

        // The kubelet hands units 5..15 out again: the container holding 0..10 is gone.
        let out = allocate(&mut arb, &[ids("GPU-a", 5..15)], &two_gpus(), &s).unwrap();
        assert_eq!(
            arb.calls[..3],
            [Call::Gpus, Call::List, Call::Delete("a2".into())]
        );
        assert!(matches!(arb.calls[3], Call::Create { .. }));
        assert_eq!(arb.calls.len(), 4);
        assert_eq!(arb.ids(), [cli.id.clone(), "a3".into()]);
        assert_eq!(out[0].envs[ENV_ALLOCATION], "a3");
        // The old allocation's identity file went with it.
        let now = identity_files(tmp.path());
        assert_eq!(now.len(), 1);
        assert!(now[0].starts_with("a3."), "{now:?}");
    }

    #[test]
    fn a_failing_create_rolls_back_the_ones_already_made() {
        let tmp = tempfile::tempdir().unwrap();
        let s = settings(100, tmp.path());
        let mut arb = fake();
        arb.fail_create = Some(2);
        let requests = vec![
            ids("GPU-a", 0..10),
            ids("GPU-b", 0..10),
            ids("GPU-b", 10..20),
        ];
        let err = allocate(&mut arb, &requests, &two_gpus(), &s).unwrap_err();
        assert!(
            matches!(
                err,
                AllocateError::Arbiter(ClientError::Admin {
                    kind: AdminErrorKind::Exhausted,
                    ..
                })
            ),
            "{err:?}"
        );
        // The first was made and deleted again; the third was never tried.
        let creates = arb
            .calls
            .iter()
            .filter(|c| matches!(c, Call::Create { .. }))
            .count();
        assert_eq!(creates, 2);
        assert_eq!(arb.calls.last(), Some(&Call::Delete("a1".into())));
        assert!(arb.allocations.is_empty(), "{:?}", arb.ids());
        assert!(identity_files(tmp.path()).is_empty());
    }

    #[test]
    fn a_gpu_the_arbiter_does_not_know_leaves_nothing_behind() {
        let tmp = tempfile::tempdir().unwrap();
        let s = settings(100, tmp.path());
        let mut arb = FakeArbiter::with_gpus(&[("GPU-a", 80 * GIB)]);
        let requests = vec![ids("GPU-a", 0..10), ids("GPU-b", 0..10)];
        let err = allocate(&mut arb, &requests, &two_gpus(), &s).unwrap_err();
        match err {
            AllocateError::Arbiter(ClientError::Admin { kind, message }) => {
                assert_eq!(kind, AdminErrorKind::InvalidArgument);
                assert_eq!(message, "the arbiter does not know GPU GPU-b");
            }
            other => panic!("{other:?}"),
        }
        assert!(arb.allocations.is_empty());
        assert!(identity_files(tmp.path()).is_empty());
    }

    #[test]
    fn identity_files_of_allocations_deleted_elsewhere_are_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let s = settings(100, tmp.path());
        let mut arb = fake();
        allocate(&mut arb, &[ids("GPU-a", 0..10)], &two_gpus(), &s).unwrap();
        // Deleted by the stale clean-up (or `tessera delete`) in between.
        arb.delete("a1").unwrap();
        allocate(&mut arb, &[ids("GPU-b", 0..10)], &two_gpus(), &s).unwrap();
        let files = identity_files(tmp.path());
        assert_eq!(files.len(), 1);
        assert!(files[0].starts_with("a2."), "{files:?}");
    }

    #[test]
    fn an_unwritable_identity_folder_is_an_identity_error() {
        let tmp = tempfile::tempdir().unwrap();
        // A file where the folder should be.
        let blocked = tmp.path().join("identity");
        std::fs::write(&blocked, b"").unwrap();
        let mut arb = fake();
        let err = allocate(
            &mut arb,
            &[ids("GPU-a", 0..10)],
            &two_gpus(),
            &settings(100, &blocked),
        )
        .unwrap_err();
        assert!(matches!(err, AllocateError::Identity(_)), "{err:?}");
    }

    #[test]
    fn the_latency_pool_makes_latency_allocations_and_refuses_the_other_pools_units() {
        let tmp = tempfile::tempdir().unwrap();
        let (be_pool, lat_pool) = Pool::split(100, 30);
        let lat = Settings {
            resource_name: "tessera.dev/gpu-latency-shares".into(),
            pool: lat_pool,
            tier: Tier::Latency,
            ..settings(100, tmp.path())
        };
        let be = Settings {
            pool: be_pool,
            ..settings(100, tmp.path())
        };
        let mut arb = fake();
        let out = allocate(&mut arb, &[ids("GPU-a", 70..80)], &two_gpus(), &lat).unwrap();
        let id = &out[0].envs[ENV_ALLOCATION];
        assert_eq!(arb.get(id).unwrap().tier, Tier::Latency);
        assert_eq!(arb.get(id).unwrap().share, 10);
        let out = allocate(&mut arb, &[ids("GPU-a", 0..20)], &two_gpus(), &be).unwrap();
        let id = &out[0].envs[ENV_ALLOCATION];
        assert_eq!(arb.get(id).unwrap().tier, Tier::BestEffort);
        // A unit of the other pool, on either side, is refused before any call.
        let calls = arb.calls.len();
        for (s, units) in [(&lat, ids("GPU-b", 60..75)), (&be, ids("GPU-b", 65..75))] {
            let err = allocate(&mut arb, &[units], &two_gpus(), s).unwrap_err();
            assert!(
                matches!(err, AllocateError::Units(UnitsError::OtherPool { .. })),
                "{err:?}"
            );
        }
        assert_eq!(arb.calls.len(), calls);
    }

    #[test]
    fn the_nvidia_cdi_kind_names_each_gpu_of_the_container() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Settings {
            cdi_kind: Some("nvidia.com/gpu".parse().unwrap()),
            ..settings(4, tmp.path())
        };
        let mut arb = fake();
        // A fraction: its one GPU, next to the variable and the interposer's wiring.
        let out = allocate(&mut arb, &[ids("GPU-b", 0..1)], &two_gpus(), &s).unwrap();
        let r = &out[0];
        assert_eq!(cdi_names(r), ["nvidia.com/gpu=GPU-b"]);
        assert_eq!(r.envs[ENV_VISIBLE], "GPU-b");
        assert_eq!(r.mounts.len(), 4);
        // Whole GPU-b and GPU-a (the kubelet hands GPU-b's unit out again: the fraction is gone).
        let mut whole = ids("GPU-b", 0..4);
        whole.extend(ids("GPU-a", 0..4));
        let out = allocate(&mut arb, &[whole], &two_gpus(), &s).unwrap();
        let r = &out[0];
        // Whole GPUs: one device per card, as NVIDIA_VISIBLE_DEVICES lists them (kept).
        assert_eq!(
            cdi_names(r),
            ["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"]
        );
        assert_eq!(r.envs[ENV_VISIBLE], "GPU-a,GPU-b");
        assert_eq!(r.mounts.len(), 1);
        // Several containers in one request: each names its own GPU.
        let k = Settings {
            cdi_kind: Some("example.com/device".parse().unwrap()),
            ..s
        };
        let out = allocate(
            &mut arb,
            &[ids("GPU-b", 2..3), ids("GPU-a", 3..4)],
            &two_gpus(),
            &k,
        )
        .unwrap();
        assert_eq!(cdi_names(&out[0]), ["example.com/device=GPU-b"]);
        assert_eq!(cdi_names(&out[1]), ["example.com/device=GPU-a"]);
    }
}
