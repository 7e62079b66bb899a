//! What the kubelet plugins need from the arbiter, and calls to its admin socket from async
//! code.
//!
//! [`Arbiter`] is the handful of admin calls the plugins make (the device plugin's `Allocate`
//! logic and PodResources clean-up, the DRA driver's prepare and unprepare); [`AdminClient`]
//! implements it, and unit tests use the in-memory [`fake`] (feature `fake`). The
//! admin client is blocking, so [`with_admin`] runs each use on tokio's blocking pool over a
//! fresh connection: an arbiter restart between two uses costs nothing, and a wedged arbiter
//! is bounded by the client's own timeout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tessera_protocol::client::{AdminClient, ClientError};
use tessera_protocol::{AllocationStatus, CreateAllocation, GpuInfo};

/// The arbiter's admin calls the plugins make (blocking, like [`AdminClient`]).
pub trait Arbiter {
    /// The arbiter's GPUs.
    fn gpus(&mut self) -> Result<Vec<GpuInfo>, ClientError>;
    /// Every allocation.
    fn list(&mut self) -> Result<Vec<AllocationStatus>, ClientError>;
    /// Creates an allocation; returns its secret token and status.
    fn create(&mut self, req: CreateAllocation) -> Result<(String, AllocationStatus), ClientError>;
    /// Creates one allocation spanning several GPUs (one slice per request, all or none);
    /// returns the group token and the slices in order.
    fn create_group(
        &mut self,
        slices: Vec<CreateAllocation>,
    ) -> Result<(String, Vec<AllocationStatus>), ClientError>;

    /// Creates an allocation in `tier` (the operator's choice). Without an implementation only
    /// best-effort ones can be made: asking for latency fails, never falls back.
    fn create_tiered(
        &mut self,
        req: CreateAllocation,
        tier: tessera_protocol::Tier,
    ) -> Result<(String, AllocationStatus), ClientError> {
        match tier {
            tessera_protocol::Tier::BestEffort => self.create(req),
            tessera_protocol::Tier::Latency => Err(ClientError::Unexpected(
                "this arbiter connection cannot create latency allocations".into(),
            )),
        }
    }
    /// Deletes an allocation.
    fn delete(&mut self, id: &str) -> Result<(), ClientError>;
    /// Merges labels into an allocation's labels.
    fn update_labels(
        &mut self,
        id: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<AllocationStatus, ClientError>;
}

impl Arbiter for AdminClient {
    fn gpus(&mut self) -> Result<Vec<GpuInfo>, ClientError> {
        AdminClient::gpus(self)
    }
    fn list(&mut self) -> Result<Vec<AllocationStatus>, ClientError> {
        AdminClient::list(self)
    }
    fn create(&mut self, req: CreateAllocation) -> Result<(String, AllocationStatus), ClientError> {
        AdminClient::create(self, req)
    }
    fn create_group(
        &mut self,
        slices: Vec<CreateAllocation>,
    ) -> Result<(String, Vec<AllocationStatus>), ClientError> {
        AdminClient::create_group(self, slices, None)
    }

    fn create_tiered(
        &mut self,
        req: CreateAllocation,
        tier: tessera_protocol::Tier,
    ) -> Result<(String, AllocationStatus), ClientError> {
        AdminClient::create_tiered(self, req, None, tier)
    }
    fn delete(&mut self, id: &str) -> Result<(), ClientError> {
        AdminClient::delete(self, id)
    }
    fn update_labels(
        &mut self,
        id: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<AllocationStatus, ClientError> {
        AdminClient::update_labels(self, id, labels)
    }
}

/// Errors talking to the arbiter.
#[derive(Debug, thiserror::Error)]
pub enum ArbiterError {
    /// The admin call failed (connect, transport or an admin error reply).
    #[error("arbiter at {path}: {source}")]
    Client {
        /// Admin socket.
        path: PathBuf,
        /// Cause.
        source: ClientError,
    },
    /// The blocking task died.
    #[error("arbiter call task failed: {0}")]
    Task(String),
}

impl ArbiterError {
    /// An admin call's failure on the arbiter at `path`.
    pub fn client(path: &Path, source: ClientError) -> Self {
        ArbiterError::Client {
            path: path.to_path_buf(),
            source,
        }
    }

    /// The admin error class, if the arbiter answered with one.
    pub fn admin_kind(&self) -> Option<tessera_protocol::AdminErrorKind> {
        match self {
            ArbiterError::Client {
                source: ClientError::Admin { kind, .. },
                ..
            } => Some(*kind),
            _ => None,
        }
    }
}

/// Runs `f` with a connected admin client on the blocking pool.
pub async fn with_admin<T, F>(path: &Path, f: F) -> Result<T, ArbiterError>
where
    T: Send + 'static,
    F: FnOnce(&mut AdminClient) -> Result<T, ClientError> + Send + 'static,
{
    let owned = path.to_path_buf();
    let res = tokio::task::spawn_blocking(move || {
        let mut client = AdminClient::connect(&owned)?;
        f(&mut client)
    })
    .await
    .map_err(|e| ArbiterError::Task(e.to_string()))?;
    res.map_err(|source| ArbiterError::Client {
        path: path.to_path_buf(),
        source,
    })
}

/// An in-memory arbiter for unit tests: GPUs, allocations, a record of every call, and a
/// switch that makes the Nth create fail. Other crates' tests get it with the `fake` feature
/// (a dev-dependency on `tessera-node` with `features = ["fake"]`).
#[cfg(any(test, feature = "fake"))]
pub mod fake {
    use super::*;
    use tessera_protocol::{AdminErrorKind, GpuSelector};

    /// One call the fake received.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Call {
        /// `gpus`.
        Gpus,
        /// `list`.
        List,
        /// `create` on a GPU (its UUID) with this memory limit and share.
        Create {
            /// GPU UUID.
            gpu: String,
            /// Memory limit, bytes.
            memory_limit: u64,
            /// Compute weight.
            share: u32,
        },
        /// `delete` of an id.
        Delete(String),
        /// `update_labels` of an id.
        UpdateLabels(String),
    }

    /// The fake.
    #[derive(Debug, Default)]
    pub struct FakeArbiter {
        /// GPUs it knows.
        pub gpus: Vec<GpuInfo>,
        /// Live allocations with their tokens.
        pub allocations: Vec<(String, AllocationStatus)>,
        /// Every call, in order.
        pub calls: Vec<Call>,
        /// The create call (1-based, counted over the fake's life) that fails with `Exhausted`.
        pub fail_create: Option<usize>,
        creates: usize,
    }

    impl FakeArbiter {
        /// A fake with these GPUs (`GPU-x`, memory) and nothing allocated.
        pub fn with_gpus(gpus: &[(&str, u64)]) -> Self {
            FakeArbiter {
                gpus: gpus
                    .iter()
                    .enumerate()
                    .map(|(i, (uuid, mem))| GpuInfo {
                        index: i as u32,
                        uuid: (*uuid).to_owned(),
                        name: "fake".into(),
                        memory_total: *mem,
                    })
                    .collect(),
                ..Default::default()
            }
        }

        /// Ids of the live allocations.
        pub fn ids(&self) -> Vec<String> {
            self.allocations.iter().map(|(_, a)| a.id.clone()).collect()
        }

        /// The live allocation `id`.
        pub fn get(&self, id: &str) -> Option<&AllocationStatus> {
            self.allocations.iter().map(|(_, a)| a).find(|a| a.id == id)
        }

        fn not_found(id: &str) -> ClientError {
            ClientError::Admin {
                kind: AdminErrorKind::NotFound,
                message: format!("no allocation {id}"),
            }
        }
    }

    impl Arbiter for FakeArbiter {
        fn gpus(&mut self) -> Result<Vec<GpuInfo>, ClientError> {
            self.calls.push(Call::Gpus);
            Ok(self.gpus.clone())
        }

        fn list(&mut self) -> Result<Vec<AllocationStatus>, ClientError> {
            self.calls.push(Call::List);
            Ok(self.allocations.iter().map(|(_, a)| a.clone()).collect())
        }

        fn create(
            &mut self,
            req: CreateAllocation,
        ) -> Result<(String, AllocationStatus), ClientError> {
            let GpuSelector::Uuid(uuid) = &req.gpu else {
                panic!("the plugin selects GPUs by UUID: {:?}", req.gpu);
            };
            self.calls.push(Call::Create {
                gpu: uuid.clone(),
                memory_limit: req.memory_limit,
                share: req.share,
            });
            self.creates += 1;
            if self.fail_create == Some(self.creates) {
                return Err(ClientError::Admin {
                    kind: AdminErrorKind::Exhausted,
                    message: "no room on the fake".into(),
                });
            }
            let gpu = self
                .gpus
                .iter()
                .find(|g| &g.uuid == uuid)
                .expect("create on a known GPU");
            let status = AllocationStatus {
                id: format!("a{}", self.creates),
                gpu_index: gpu.index,
                gpu_uuid: uuid.clone(),
                memory_limit: req.memory_limit,
                share: req.share,
                cap: req.cap,
                labels: req.labels,
                ..Default::default()
            };
            let token = format!("token-{}", self.creates);
            self.allocations.push((token.clone(), status.clone()));
            Ok((token, status))
        }

        /// As the arbiter: every slice or none, labelled with the group (the first slice's
        /// id), under the first slice's token.
        fn create_group(
            &mut self,
            slices: Vec<CreateAllocation>,
        ) -> Result<(String, Vec<AllocationStatus>), ClientError> {
            let mut made: Vec<(String, AllocationStatus)> = Vec::new();
            for req in slices {
                match self.create(req) {
                    Ok(x) => made.push(x),
                    Err(e) => {
                        let ids: Vec<String> = made.iter().map(|(_, a)| a.id.clone()).collect();
                        self.allocations.retain(|(_, a)| !ids.contains(&a.id));
                        return Err(e);
                    }
                }
            }
            let group = made[0].1.id.clone();
            for (_, a) in self.allocations.iter_mut() {
                if made.iter().any(|(_, m)| m.id == a.id) {
                    a.labels.insert(
                        tessera_protocol::group::LABEL_GPU_GROUP.to_owned(),
                        group.clone(),
                    );
                }
            }
            let token = made[0].0.clone();
            let ids: Vec<String> = made.into_iter().map(|(_, a)| a.id).collect();
            let statuses = ids.iter().filter_map(|id| self.get(id).cloned()).collect();
            Ok((token, statuses))
        }

        fn create_tiered(
            &mut self,
            req: CreateAllocation,
            tier: tessera_protocol::Tier,
        ) -> Result<(String, AllocationStatus), ClientError> {
            let (token, mut status) = self.create(req)?;
            status.tier = tier;
            if let Some(last) = self.allocations.last_mut() {
                last.1.tier = tier;
            }
            Ok((token, status))
        }

        fn delete(&mut self, id: &str) -> Result<(), ClientError> {
            self.calls.push(Call::Delete(id.to_owned()));
            let before = self.allocations.len();
            self.allocations.retain(|(_, a)| a.id != id);
            if self.allocations.len() == before {
                return Err(Self::not_found(id));
            }
            Ok(())
        }

        fn update_labels(
            &mut self,
            id: &str,
            labels: BTreeMap<String, String>,
        ) -> Result<AllocationStatus, ClientError> {
            self.calls.push(Call::UpdateLabels(id.to_owned()));
            let (_, a) = self
                .allocations
                .iter_mut()
                .find(|(_, a)| a.id == id)
                .ok_or_else(|| Self::not_found(id))?;
            for (k, v) in labels {
                if v.is_empty() {
                    a.labels.remove(&k);
                } else {
                    a.labels.insert(k, v);
                }
            }
            Ok(a.clone())
        }
    }
}
