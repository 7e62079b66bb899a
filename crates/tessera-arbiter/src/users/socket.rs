//! The user socket's server: the admin protocol, each request authorized for the caller the
//! kernel names (see [`crate::users`]). Its handshakes have the admin socket's deadline,
//! `Hello` size limit and pending caps (its own counters).

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use tessera_protocol::{
    AdminErrorKind, AdminReply, AdminRequest, CreateAllocation, FrameDecoder, PROTOCOL_VERSION,
    ProcessOwner, RefusalKind, ServerHello, SocketKind, Tier,
};
use tokio::net::UnixStream;

use super::Users;
use super::caller::Caller;
use crate::admission::{self, Admission, PendingSlot};
use crate::state::{Arbiter, By};
use crate::wire::{self, WireError};

/// Labels under this prefix steer the backstop and the plugins (whole-card groups, GPU groups,
/// pod names): only the operator sets them.
const RESERVED_LABELS: &str = "tessera.dev/";

/// Errors of user connections (each closes that connection only).
#[derive(Debug, thiserror::Error)]
pub(crate) enum UserSocketError {
    /// Framing, handshake or transport failure.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The peer may not use the socket.
    #[error("refused: {0}")]
    Refused(String),
}

/// A new user-socket connection: counted as pending (or closed at once over the caps) until
/// its handshake ends, then served to its end on the runtime.
pub(crate) fn accept(
    arb: Arc<Arbiter>,
    adm: &Arc<Admission>,
    users: Arc<Users>,
    stream: UnixStream,
) {
    admission::accept_pending(adm, stream, |stream, slot, timeout| {
        serve(arb, stream, slot, timeout, users)
    });
}

async fn serve(
    arb: Arc<Arbiter>,
    mut stream: UnixStream,
    slot: PendingSlot,
    timeout: Duration,
    users: Arc<Users>,
) {
    let who = match stream.peer_cred() {
        Ok(c) => format!("user uid {} pid {}", c.uid(), c.pid().unwrap_or(0)),
        Err(_) => "user client".to_owned(),
    };
    match serve_inner(&arb, &mut stream, slot, timeout, &users).await {
        Ok(()) | Err(UserSocketError::Wire(WireError::Closed)) => {}
        Err(e) => {
            admission::drain_a_little(&stream);
            tracing::info!("{who}: closed: {e}");
        }
    }
}

async fn refuse(
    stream: &mut UnixStream,
    kind: RefusalKind,
    reason: String,
) -> Result<(), UserSocketError> {
    let msg = ServerHello::refusal(kind, reason.clone(), PROTOCOL_VERSION);
    crate::admin::send(stream, &msg).await?;
    Err(UserSocketError::Refused(reason))
}

async fn serve_inner(
    arb: &Arbiter,
    stream: &mut UnixStream,
    slot: PendingSlot,
    timeout: Duration,
    users: &Users,
) -> Result<(), UserSocketError> {
    // The admin socket's handshake; a tenant's refusal is logged as this socket's refusals are.
    match crate::admin::handshake(stream, slot, timeout, SocketKind::User).await {
        Ok(true) => {}
        Ok(false) => return Ok(()),
        Err(WireError::WrongRole(reason)) => {
            return Err(UserSocketError::Refused(reason.to_owned()));
        }
        Err(e) => return Err(e.into()),
    }
    let caller = match Caller::of(stream) {
        Ok(c) => c,
        Err(e) => return refuse(stream, RefusalKind::Forbidden, format!("{e}")).await,
    };
    if !caller.in_group(users.gid) {
        let reason = format!(
            "uid {} is not in the arbiter's users group (gid {}); ask the operator to add you",
            caller.uid, users.gid
        );
        return refuse(stream, RefusalKind::Forbidden, reason).await;
    }
    crate::admin::send(stream, &crate::admin::welcome()).await?;
    let by = By::user(caller.uid, users.quota(caller.uid));
    let mut dec = FrameDecoder::new();
    loop {
        let req: AdminRequest = wire::read_msg(stream, &mut dec).await?;
        let reply = match authorize(&caller, &req) {
            Ok(()) => crate::admin::handle(arb, req, &by).await,
            Err(message) => {
                tracing::info!("uid {}: refused: {message}", caller.uid);
                AdminReply::Error {
                    kind: AdminErrorKind::PermissionDenied,
                    message,
                }
            }
        };
        crate::admin::send(stream, &reply).await?;
    }
}

/// What a user may not ask whatever the allocation: an owner other than their own process
/// (it would tie someone else's processes to their allocation), a tier (the operator's), a
/// reserved label. Whose allocation it is, and the quota, the state checks under its lock.
pub(crate) fn authorize(caller: &Caller, req: &AdminRequest) -> Result<(), String> {
    let owner_ok = |owner: &Option<ProcessOwner>| match owner {
        Some(o) if !caller.is(o) => Err(format!(
            "an allocation on the user socket may be owned only by the process that asks (pid \
             {}), not pid {}",
            caller.process.pid, o.pid
        )),
        _ => Ok(()),
    };
    let labels_ok = |labels: &std::collections::BTreeMap<String, String>| match labels
        .keys()
        .find(|k| k.starts_with(RESERVED_LABELS))
    {
        Some(k) => Err(format!(
            "label {k:?}: labels under {RESERVED_LABELS} are the operator's"
        )),
        None => Ok(()),
    };
    let create_ok = |c: &CreateAllocation| labels_ok(&c.labels);
    match req {
        AdminRequest::ListGpus
        | AdminRequest::List
        | AdminRequest::Delete { .. }
        | AdminRequest::LastKill { .. } => Ok(()),
        AdminRequest::UpdateLabels { labels, .. } => labels_ok(labels),
        AdminRequest::Create(c) => create_ok(c),
        AdminRequest::CreateOwned { create, owner } => {
            owner_ok(&Some(*owner))?;
            create_ok(create)
        }
        AdminRequest::CreateTiered {
            create,
            owner,
            tier,
        } => {
            if *tier != Tier::BestEffort {
                return Err(format!(
                    "the {tier} tier is the operator's to give (the admin socket); the user \
                     socket creates best-effort allocations"
                ));
            }
            owner_ok(owner)?;
            create_ok(create)
        }
        AdminRequest::CreateGroup { slices, owner } => {
            owner_ok(owner)?;
            slices.iter().try_for_each(create_ok)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::ProcId;

    fn alloc(labels: &[(&str, &str)]) -> CreateAllocation {
        CreateAllocation {
            gpu: tessera_protocol::GpuSelector::Index(0),
            memory_limit: 1 << 30,
            share: 10,
            cap: None,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn a_user_owns_by_their_own_process_in_the_best_effort_tier_without_reserved_labels() {
        let c = Caller {
            uid: 61001,
            gid: 61001,
            groups: vec![61000],
            process: ProcId { pid: 42, start: 7 },
        };
        let me = ProcessOwner {
            pid: 42,
            start_time: 7,
        };
        let other = ProcessOwner {
            pid: 43,
            start_time: 7,
        };
        let tiered = |owner, tier| AdminRequest::CreateTiered {
            create: alloc(&[("created-by", "tessera run")]),
            owner,
            tier,
        };
        authorize(&c, &tiered(Some(me), Tier::BestEffort)).unwrap();
        authorize(&c, &tiered(None, Tier::BestEffort)).unwrap();
        let e = authorize(&c, &tiered(Some(other), Tier::BestEffort)).unwrap_err();
        assert!(e.contains("owned only by the process that asks"), "{e}");
        let e = authorize(&c, &tiered(Some(me), Tier::Latency)).unwrap_err();
        assert!(e.contains("operator's"), "{e}");
        let e = authorize(
            &c,
            &AdminRequest::Create(alloc(&[(tessera_protocol::LABEL_WHOLE_GROUP, "GPU-x")])),
        )
        .unwrap_err();
        assert!(e.contains("tessera.dev/"), "{e}");
        let group = AdminRequest::CreateGroup {
            slices: vec![alloc(&[]), alloc(&[])],
            owner: Some(other),
        };
        assert!(authorize(&c, &group).is_err());
        authorize(&c, &AdminRequest::List).unwrap();
    }
}
