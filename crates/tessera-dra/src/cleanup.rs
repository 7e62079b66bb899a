//! Pure rules: which prepared claims to unprepare because nothing uses them any more.
//!
//! The kubelet unprepares a claim when its last pod on the node stops. If that call never
//! comes (the plugin was down, the kubelet lost its checkpoint, the node was drained while
//! the plugin restarted), the claim's allocation would hold its share and memory forever. So
//! the plugin checks, on start and every `--claim-check` seconds, each claim it has prepared
//! (the arbiter's allocations with [`tessera_node::labels::OWNER_DRA`]) against the API server:
//!
//! - the claim is gone (404): released;
//! - a claim of that name exists with another uid (deleted and re-created): released;
//! - the claim lists no consumer in `status.reservedFor`, or is no longer allocated: released
//!   (the resource claim controller removes a pod from `reservedFor` only once it is deleted
//!   or has finished, so no container of it runs);
//! - any other answer (transport error, 403, 500): kept. An API outage must never free the
//!   limits of running pods; the next check decides.
//!
//! A claim found unreserved is read once more just before it is unprepared (a new pod may
//! have reserved it meanwhile); see [`crate::service::DraService::release_unused`].

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_node::labels::{LABEL_OWNER, OWNER_DRA};
use tessera_protocol::AllocationStatus;

use crate::prepare::{LABEL_CLAIM, LABEL_CLAIM_UID};

/// A claim this plugin prepared, as its allocations record it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreparedClaim {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Uid.
    pub uid: String,
}

/// The claims behind this plugin's allocations in `all`, one per uid, in uid order. An
/// allocation without a readable `namespace/name` label is skipped (it cannot be looked up).
pub(crate) fn prepared_claims(all: &[AllocationStatus]) -> Vec<PreparedClaim> {
    let mut out: BTreeMap<String, PreparedClaim> = BTreeMap::new();
    for a in all {
        if a.labels.get(LABEL_OWNER).map(String::as_str) != Some(OWNER_DRA) {
            continue;
        }
        let (Some(uid), Some(claim)) = (a.labels.get(LABEL_CLAIM_UID), a.labels.get(LABEL_CLAIM))
        else {
            continue;
        };
        let Some((namespace, name)) = claim.split_once('/') else {
            continue;
        };
        out.entry(uid.clone()).or_insert_with(|| PreparedClaim {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: uid.clone(),
        });
    }
    out.into_values().collect()
}

/// What the API server said about a prepared claim.
#[derive(Debug)]
pub(crate) enum Lookup<'a> {
    /// The claim of that namespace and name.
    Found(&'a ResourceClaim),
    /// 404: no claim of that name.
    NotFound,
    /// Anything else (no answer, a refusal, a server error).
    Failed,
}

/// Why a prepared claim is released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Release {
    /// The claim was deleted.
    Deleted,
    /// A claim of the same name with another uid replaced it.
    Recreated {
        /// The uid found now.
        found: String,
    },
    /// Allocated or not, no consumer holds it.
    NoConsumer,
    /// The claim was deallocated.
    Deallocated,
}

impl std::fmt::Display for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Release::Deleted => write!(f, "the claim was deleted"),
            Release::Recreated { found } => {
                write!(f, "the claim was re-created (uid {found} now)")
            }
            Release::NoConsumer => write!(f, "no pod reserves the claim"),
            Release::Deallocated => write!(f, "the claim is no longer allocated"),
        }
    }
}

/// Whether prepared claim `uid` is released, given `lookup`; `None` keeps it.
pub(crate) fn verdict(uid: &str, lookup: Lookup<'_>) -> Option<Release> {
    let claim = match lookup {
        Lookup::Found(c) => c,
        Lookup::NotFound => return Some(Release::Deleted),
        Lookup::Failed => return None,
    };
    let found = claim.metadata.uid.as_deref().unwrap_or_default();
    if found != uid {
        return Some(Release::Recreated {
            found: found.to_owned(),
        });
    }
    let status = claim.status.as_ref();
    if status.and_then(|s| s.allocation.as_ref()).is_none() {
        return Some(Release::Deallocated);
    }
    let consumers = status
        .and_then(|s| s.reserved_for.as_ref())
        .map_or(0, Vec::len);
    (consumers == 0).then_some(Release::NoConsumer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        AllocationResult, ResourceClaimConsumerReference, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn claim(uid: &str, allocated: bool, consumers: usize) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                ..Default::default()
            },
            status: Some(ResourceClaimStatus {
                allocation: allocated.then(AllocationResult::default),
                reserved_for: (consumers > 0).then(|| {
                    (0..consumers)
                        .map(|i| ResourceClaimConsumerReference {
                            resource: "pods".into(),
                            name: format!("p{i}"),
                            uid: format!("pod-{i}"),
                            api_group: None,
                        })
                        .collect()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn only_definite_answers_release_a_claim() {
        assert_eq!(verdict("u1", Lookup::Found(&claim("u1", true, 1))), None);
        assert_eq!(verdict("u1", Lookup::Found(&claim("u1", true, 2))), None);
        assert_eq!(verdict("u1", Lookup::NotFound), Some(Release::Deleted));
        assert_eq!(
            verdict("u1", Lookup::Found(&claim("u2", true, 1))),
            Some(Release::Recreated { found: "u2".into() })
        );
        assert_eq!(
            verdict("u1", Lookup::Found(&claim("u1", true, 0))),
            Some(Release::NoConsumer)
        );
        assert_eq!(
            verdict("u1", Lookup::Found(&claim("u1", false, 0))),
            Some(Release::Deallocated)
        );
        let mut bare = claim("u1", true, 0);
        bare.status = None;
        assert_eq!(
            verdict("u1", Lookup::Found(&bare)),
            Some(Release::Deallocated)
        );
        // An API outage or a refusal keeps every claim: running pods keep their limits.
        assert_eq!(verdict("u1", Lookup::Failed), None);
    }

    #[test]
    fn prepared_claims_come_from_this_plugins_allocations_only() {
        let alloc = |id: &str, labels: &[(&str, &str)]| AllocationStatus {
            id: id.into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        };
        let ours = |id: &str, uid: &str, claim: &str| {
            alloc(
                id,
                &[
                    (LABEL_OWNER, OWNER_DRA),
                    (LABEL_CLAIM_UID, uid),
                    (LABEL_CLAIM, claim),
                ],
            )
        };
        let all = [
            ours("a1", "u2", "team-a/two-gpus"),
            ours("a2", "u2", "team-a/two-gpus"),
            ours("a3", "u1", "team-b/one"),
            // The device plugin's: never touched here.
            alloc(
                "a4",
                &[
                    (LABEL_OWNER, tessera_node::labels::OWNER_DEVICE_PLUGIN),
                    (LABEL_CLAIM_UID, "u3"),
                ],
            ),
            // No readable claim name.
            alloc("a5", &[(LABEL_OWNER, OWNER_DRA), (LABEL_CLAIM_UID, "u4")]),
            ours("a6", "u5", "no-slash"),
        ];
        assert_eq!(
            prepared_claims(&all),
            [
                PreparedClaim {
                    namespace: "team-b".into(),
                    name: "one".into(),
                    uid: "u1".into()
                },
                PreparedClaim {
                    namespace: "team-a".into(),
                    name: "two-gpus".into(),
                    uid: "u2".into()
                },
            ]
        );
    }
}
