//! The admin socket (mode 0600, never mounted into containers): one task per connection,
//! one reply per request, in order. Its handshakes have the same deadline, `Hello` size limit
//! and pending caps as the tenant socket's (its own counters).

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use tessera_protocol::{
    AdminReply, AdminRequest, FrameDecoder, PROTOCOL_VERSION, RefusalKind, Role, ServerHello,
    SocketKind, Tier,
};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

use crate::admission::{self, Admission, PendingSlot};
use crate::state::{Arbiter, By};
use crate::wire::{self, WireError};

/// Errors of admin connections (each closes that connection only).
#[derive(Debug, thiserror::Error)]
pub(crate) enum AdminError {
    /// Framing, handshake or transport failure.
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// A new admin connection: counted as pending (or closed at once over the caps) until its
/// handshake ends, then served to its end on the runtime.
pub(crate) fn accept(arb: Arc<Arbiter>, adm: &Arc<Admission>, stream: UnixStream) {
    admission::accept_pending(adm, stream, |stream, slot, timeout| {
        serve(arb, stream, slot, timeout)
    });
}

/// Serves one admin connection to its end; `slot` is released when the handshake ends.
pub(crate) async fn serve(
    arb: Arc<Arbiter>,
    mut stream: UnixStream,
    slot: PendingSlot,
    timeout: Duration,
) {
    let pid = stream.peer_cred().ok().and_then(|c| c.pid());
    let who = match pid {
        Some(p) => format!("admin client pid {p}"),
        None => "admin client".to_owned(),
    };
    match serve_inner(&arb, &mut stream, slot, timeout).await {
        Ok(()) | Err(AdminError::Wire(WireError::Closed)) => {}
        Err(e) => {
            admission::drain_a_little(&stream);
            tracing::info!("{who}: closed: {e}");
        }
    }
}

/// Writes one frame (the user socket's server too).
pub(crate) async fn send<T: serde::Serialize>(
    stream: &mut UnixStream,
    msg: &T,
) -> Result<(), WireError> {
    let mut out = Vec::new();
    wire::push_frame(&mut out, msg).map_err(WireError::from)?;
    stream
        .write_all(&out)
        .await
        .map_err(|e| WireError::Frame(e.into()))?;
    Ok(())
}

/// The admin protocol's handshake, the admin and the user socket's alike: the `Hello` under
/// the admission deadline (`slot` released once it is read), a probe answered with the
/// socket's kind, a tenant or another protocol version refused. `Ok(true)`: an admin client,
/// to be welcomed (the user socket checks the caller first); `Ok(false)`: nothing more to do
/// (a probe answered, or a newer connection took the slot).
pub(crate) async fn handshake(
    stream: &mut UnixStream,
    slot: PendingSlot,
    timeout: Duration,
    socket: SocketKind,
) -> Result<bool, WireError> {
    let Some(hello) = admission::read_hello_or_evicted(stream, &slot, timeout).await else {
        // A newer connection took its place.
        return Ok(false);
    };
    drop(slot);
    match hello {
        Ok(Role::Admin) => Ok(true),
        Ok(Role::Probe) => {
            let msg = ServerHello::Probed {
                version: PROTOCOL_VERSION,
                socket,
            };
            send(stream, &msg).await?;
            Ok(false)
        }
        Ok(Role::Tenant { .. } | Role::Companion { .. }) => {
            let reason = "tenants use the tenant socket";
            let msg = ServerHello::refusal(RefusalKind::WrongSocket, reason, PROTOCOL_VERSION);
            send(stream, &msg).await?;
            Err(WireError::WrongRole(reason))
        }
        Err(e @ WireError::BadVersion(v)) => {
            let msg = ServerHello::refusal(RefusalKind::Version, e.to_string(), v);
            send(stream, &msg).await?;
            Err(e)
        }
        Err(e) => Err(e),
    }
}

/// The answer to an admin client's `Hello` once it may go on.
pub(crate) fn welcome() -> ServerHello {
    ServerHello::Welcome {
        version: PROTOCOL_VERSION,
        allocation: None,
    }
}

async fn serve_inner(
    arb: &Arbiter,
    stream: &mut UnixStream,
    slot: PendingSlot,
    timeout: Duration,
) -> Result<(), AdminError> {
    if !handshake(stream, slot, timeout, SocketKind::Admin).await? {
        return Ok(());
    }
    send(stream, &welcome()).await?;
    // The peer's uid is recorded as the creator of what it creates (`tessera status`'s OWNER).
    let by = By::operator(stream.peer_cred().ok().map(|c| c.uid()));
    let mut dec = FrameDecoder::new();
    loop {
        let req: AdminRequest = wire::read_msg(stream, &mut dec).await?;
        let reply = handle(arb, req, &by).await;
        send(stream, &reply).await?;
    }
}

async fn create(
    arb: &Arbiter,
    c: tessera_protocol::CreateAllocation,
    owner: Option<tessera_protocol::ProcessOwner>,
    tier: tessera_protocol::Tier,
    by: &By,
) -> AdminReply {
    let (gpu, limit, share, cap) = (c.gpu.clone(), c.memory_limit, c.share, c.cap);
    let mut made = arb.create_tiered_by(c.clone(), owner, tier, by).await;
    if refused_for_room(&made) && reap_exited(arb).await {
        made = arb.create_tiered_by(c, owner, tier, by).await;
    }
    match made {
        Ok((token, allocation)) => {
            if let Some(o) = owner {
                crate::reaper::watch_owner(arb, o);
            }
            let cap = cap.map_or("no cap".to_owned(), |c| format!("cap {c}%"));
            let mut owned = owner.map_or(String::new(), |o| format!(", owned by pid {}", o.pid));
            if let Some(uid) = by.uid {
                owned.push_str(&format!(", uid {uid}"));
            }
            tracing::info!(
                "created allocation {} on GPU {} ({}, share {share}, {cap}, {tier}{owned})",
                allocation.id,
                allocation.gpu_index,
                tessera_protocol::size::human(limit)
            );
            AdminReply::Created { token, allocation }
        }
        Err(e) => {
            // A user over their quota is no fault of the arbiter's: not a warning.
            if by.quota.is_some() {
                tracing::info!("refused to create an allocation on {gpu}: {e}");
            } else {
                tracing::warn!("refused to create an allocation on {gpu}: {e}");
            }
            AdminReply::Error {
                kind: e.kind(),
                message: e.to_string(),
            }
        }
    }
}

async fn create_group(
    arb: &Arbiter,
    slices: Vec<tessera_protocol::CreateAllocation>,
    owner: Option<tessera_protocol::ProcessOwner>,
    by: &By,
) -> AdminReply {
    let n = slices.len();
    let mut made = arb.create_group_by(slices.clone(), owner, by).await;
    if refused_for_room(&made) && reap_exited(arb).await {
        made = arb.create_group_by(slices, owner, by).await;
    }
    match made {
        Ok((token, allocations)) => {
            if let Some(o) = owner {
                crate::reaper::watch_owner(arb, o);
            }
            let parts: Vec<String> = allocations
                .iter()
                .map(|a| {
                    format!(
                        "{} on GPU {} ({}, share {})",
                        a.id,
                        a.gpu_index,
                        tessera_protocol::size::human(a.memory_limit),
                        a.share
                    )
                })
                .collect();
            tracing::info!("created a {n}-GPU allocation: {}", parts.join(", "));
            AdminReply::CreatedGroup { token, allocations }
        }
        Err(e) => {
            tracing::warn!("refused to create a {n}-GPU allocation: {e}");
            AdminReply::Error {
                kind: e.kind(),
                message: e.to_string(),
            }
        }
    }
}

fn error(e: crate::state::StateError) -> AdminReply {
    AdminReply::Error {
        kind: e.kind(),
        message: e.to_string(),
    }
}

/// Whether a create was refused for want of room: the GPU's memory or shares, or the caller's
/// quota (the one `Forbidden` a create gives).
fn refused_for_room<T>(made: &Result<T, crate::state::StateError>) -> bool {
    use crate::state::StateError;
    matches!(
        made,
        Err(StateError::Exhausted(_) | StateError::Forbidden(_))
    )
}

/// Deletes, before a create is refused, the owned allocations whose processes have all exited
/// (the reaper's rule, looked at now rather than when its task next runs): a command of
/// `tessera run --exec` is its allocation's owner, and the next command a script starts the
/// moment it exits must find that room free, not refused while the reaper's task has yet to
/// run. True when it deleted any (the create is then tried again, once).
async fn reap_exited(arb: &Arbiter) -> bool {
    crate::reaper::reap(arb, std::path::Path::new("/proc")).await > 0
}

/// Serves one request for `by` (the operator on the admin socket; a user on the user socket,
/// whose request [`crate::users::socket::authorize`] let through).
pub(crate) async fn handle(arb: &Arbiter, req: AdminRequest, by: &By) -> AdminReply {
    match req {
        AdminRequest::ListGpus => AdminReply::Gpus(arb.gpus().to_vec()),
        AdminRequest::Create(c) => create(arb, c, None, Tier::BestEffort, by).await,
        AdminRequest::CreateOwned { create: c, owner } => {
            create(arb, c, Some(owner), Tier::BestEffort, by).await
        }
        AdminRequest::CreateTiered {
            create: c,
            owner,
            tier,
        } => create(arb, c, owner, tier, by).await,
        AdminRequest::CreateGroup { slices, owner } => create_group(arb, slices, owner, by).await,
        AdminRequest::List => AdminReply::Allocations(arb.list().await),
        AdminRequest::LastKill { id } => match arb.last_kill(&id, by) {
            Ok(k) => AdminReply::LastKill(k),
            Err(e) => error(e),
        },
        AdminRequest::UpdateLabels { id, labels } => {
            match arb.update_labels_by(&id, labels, by).await {
                Ok(a) => {
                    tracing::info!("labels of allocation {id} updated");
                    AdminReply::Updated(a)
                }
                Err(e) => AdminReply::Error {
                    kind: e.kind(),
                    message: e.to_string(),
                },
            }
        }
        AdminRequest::Delete { id } => match arb.delete_by(&id, by).await {
            Ok(()) => {
                let uid = by.uid.map_or(String::new(), |u| format!(" (uid {u})"));
                tracing::info!("deleted allocation {id}{uid}");
                AdminReply::Deleted
            }
            Err(e) => AdminReply::Error {
                kind: e.kind(),
                message: e.to_string(),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use tessera_protocol::{CreateAllocation, GpuSelector, ProcessOwner};

    use super::*;

    fn create_60gib(owner: Option<ProcessOwner>) -> AdminRequest {
        AdminRequest::CreateTiered {
            create: CreateAllocation {
                gpu: GpuSelector::Index(0),
                memory_limit: 60 << 30,
                share: 10,
                cap: None,
                labels: Default::default(),
            },
            owner,
            tier: Tier::BestEffort,
        }
    }

    /// An owned allocation made in the second the arbiter started is not taken for one restored
    /// from disk once the wall clock's second has turned: the reaper deletes it when its owner
    /// is gone (the start second was the current one less the whole seconds since, so an
    /// allocation made at x.99 s, looked at at x+1.01 s, waited out a 10 s restart grace, and a
    /// script's next `tessera run --exec` was refused for its room).
    #[tokio::test]
    async fn an_allocation_made_after_the_start_is_not_taken_for_a_restored_one() {
        let dir = tempfile::tempdir().unwrap();
        let arb = crate::state::test_arbiter(dir.path(), 1);
        let (mut child, owner) = crate::owner::test_owner();
        let made = handle(&arb, create_60gib(Some(owner)), &By::OPERATOR).await;
        assert!(matches!(made, AdminReply::Created { .. }), "{made:?}");
        let created = arb.list().await[0].created_unix;
        child.kill().unwrap();
        child.wait().unwrap();
        while crate::state::now_unix() <= created {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            arb.now_ns() < crate::reaper::RECONNECT_GRACE.as_nanos() as u64,
            "within the restart grace"
        );
        assert_eq!(
            crate::reaper::reap(&arb, std::path::Path::new("/proc")).await,
            1
        );
        assert!(arb.list().await.is_empty());
    }

    /// A create refused for room first deletes the owned allocations whose processes have all
    /// exited, then tries again: no reaper task runs here, so only the create's own look can
    /// free the room. While the owner runs, the refusal stands and nothing is deleted.
    #[tokio::test]
    async fn a_create_refused_for_room_first_reaps_the_owners_that_exited() {
        let dir = tempfile::tempdir().unwrap();
        let arb = crate::state::test_arbiter(dir.path(), 1);
        let (mut child, owner) = crate::owner::test_owner();
        let first = handle(&arb, create_60gib(Some(owner)), &By::OPERATOR).await;
        let AdminReply::Created { allocation, .. } = first else {
            panic!("{first:?}");
        };
        let refused = handle(&arb, create_60gib(None), &By::OPERATOR).await;
        assert!(
            matches!(
                refused,
                AdminReply::Error {
                    kind: tessera_protocol::AdminErrorKind::Exhausted,
                    ..
                }
            ),
            "{refused:?}"
        );
        assert_eq!(arb.list().await.len(), 1);
        child.kill().unwrap();
        child.wait().unwrap();
        let second = handle(&arb, create_60gib(None), &By::OPERATOR).await;
        assert!(matches!(second, AdminReply::Created { .. }), "{second:?}");
        let ids: Vec<String> = arb.list().await.into_iter().map(|a| a.id).collect();
        assert_eq!(ids.len(), 1);
        assert_ne!(
            ids[0], allocation.id,
            "the exited owner's allocation is gone"
        );
    }
}
