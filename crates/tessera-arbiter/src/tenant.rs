//! The tenant socket: one task per connection (one connection per interposed process).
//!
//! Requests on a connection are handled in order. Replies to every request that arrived in
//! one read are written with one `write`, so a pipelining client pays one wake-up. Reserve and
//! Release touch only the in-memory ledger (one short mutex section), never the disk. When
//! the connection closes (the process exited, was killed, or sent garbage), everything it held
//! is released before the task ends.
//!
//! While a `LeaseAcquire` waits for its grant the task keeps watching the socket, so a process
//! that dies while waiting is noticed at once; frames that arrive meanwhile are buffered and
//! handled after the grant (at most [`MAX_PENDING_BYTES`]).

use std::sync::Arc;

use tessera_protocol::{FrameDecoder, Role, ServerHello, TenantReply, TenantRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::oneshot;

use crate::ledger::{ConnId, Reservation};
use crate::scheduler::Grant;
use crate::state::{Arbiter, TenantBinding};
use crate::wire::{self, READ_CHUNK, WireError};

/// Most bytes a connection may send while its `LeaseAcquire` waits.
pub const MAX_PENDING_BYTES: usize = 128 * 1024;

/// Errors of tenant connections (each closes that connection only).
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    /// Framing, handshake or transport failure.
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// Serves one tenant connection to its end, then releases what it held.
pub async fn serve(arb: Arc<Arbiter>, mut stream: UnixStream) {
    let conn = arb.next_conn();
    let pid = stream.peer_cred().ok().and_then(|c| c.pid());
    let mut dec = FrameDecoder::new();
    let who = match pid {
        Some(p) => format!("tenant conn {conn} (pid {p})"),
        None => format!("tenant conn {conn}"),
    };
    let binding = match handshake(&arb, &mut stream, &mut dec, conn, pid).await {
        Ok(b) => b,
        Err(e) => {
            crate::log!("{who}: closed at handshake: {e}");
            return;
        }
    };
    let result = serve_requests(&arb, &binding, &mut stream, &mut dec, conn).await;
    let freed = arb.detach_tenant(&binding, conn, pid);
    match (result, freed) {
        (Err(TenantError::Wire(WireError::Closed)), Ok(_)) | (Ok(()), Ok(_)) => {}
        (Err(e), Ok(freed)) => {
            crate::log!(
                "{who} of {}: closed: {e} (released {freed} bytes)",
                binding.view.id
            )
        }
        (_, Err(e)) => crate::log!("{who} of {}: ledger: {e}", binding.view.id),
    }
}

async fn handshake(
    arb: &Arbiter,
    stream: &mut UnixStream,
    dec: &mut FrameDecoder,
    conn: ConnId,
    pid: Option<i32>,
) -> Result<TenantBinding, TenantError> {
    let role = match wire::read_hello(stream, dec).await {
        Ok(r) => r,
        Err(e @ WireError::BadVersion(_)) => {
            refuse(stream, &e.to_string()).await;
            return Err(e.into());
        }
        Err(e) => return Err(e.into()),
    };
    let Role::Tenant { token } = role else {
        let reason = "admin clients use the admin socket";
        refuse(stream, reason).await;
        return Err(WireError::WrongRole(reason).into());
    };
    let Some(binding) = arb.attach_tenant(&token, conn, pid) else {
        let reason = "unknown allocation token";
        refuse(stream, reason).await;
        return Err(WireError::WrongRole(reason).into());
    };
    let welcome = ServerHello::Welcome {
        version: tessera_protocol::PROTOCOL_VERSION,
        allocation: Some(binding.view.clone()),
    };
    let mut out = Vec::new();
    let sent = async {
        wire::push_frame(&mut out, &welcome)?;
        stream
            .write_all(&out)
            .await
            .map_err(tessera_protocol::FrameError::Io)
    };
    if let Err(e) = sent.await {
        let _ = arb.detach_tenant(&binding, conn, pid);
        return Err(WireError::Frame(e).into());
    }
    Ok(binding)
}

async fn refuse(stream: &mut UnixStream, reason: &str) {
    let mut out = Vec::new();
    if wire::push_frame(
        &mut out,
        &ServerHello::Refused {
            reason: reason.to_owned(),
        },
    )
    .is_ok()
    {
        let _ = stream.write_all(&out).await;
    }
}

/// What handling one request asks the connection loop to do next.
enum Next {
    Continue,
    /// Wait for this lease grant before handling further frames.
    AwaitGrant(oneshot::Receiver<Grant>),
}

async fn serve_requests(
    arb: &Arbiter,
    b: &TenantBinding,
    stream: &mut UnixStream,
    dec: &mut FrameDecoder,
    conn: ConnId,
) -> Result<(), TenantError> {
    let mut buf = [0u8; READ_CHUNK];
    let mut out: Vec<u8> = Vec::with_capacity(256);
    loop {
        // Handle every whole frame already buffered.
        while let Some(req) = dec.next::<TenantRequest>().map_err(WireError::from)? {
            match handle(arb, b, conn, req, &mut out)? {
                Next::Continue => {}
                Next::AwaitGrant(rx) => {
                    flush(stream, &mut out).await?;
                    let g = await_grant(stream, dec, rx, &mut buf).await?;
                    let reply = TenantReply::LeaseGranted {
                        lease_id: g.lease_id,
                        duration_ns: g.duration_ns,
                    };
                    wire::push_frame(&mut out, &reply).map_err(WireError::from)?;
                }
            }
        }
        flush(stream, &mut out).await?;
        let n = stream
            .read(&mut buf)
            .await
            .map_err(|e| WireError::Frame(e.into()))?;
        if n == 0 {
            return if dec.buffered() == 0 {
                Err(WireError::Closed.into())
            } else {
                Err(WireError::Frame(tessera_protocol::FrameError::Io(
                    std::io::ErrorKind::UnexpectedEof.into(),
                ))
                .into())
            };
        }
        dec.extend(&buf[..n]);
    }
}

async fn flush(stream: &mut UnixStream, out: &mut Vec<u8>) -> Result<(), TenantError> {
    if !out.is_empty() {
        stream
            .write_all(out)
            .await
            .map_err(|e| WireError::Frame(e.into()))?;
        out.clear();
    }
    Ok(())
}

/// Waits for a grant while noticing the peer closing; bytes that arrive are kept in `dec`.
async fn await_grant(
    stream: &mut UnixStream,
    dec: &mut FrameDecoder,
    mut rx: oneshot::Receiver<Grant>,
    buf: &mut [u8],
) -> Result<Grant, TenantError> {
    loop {
        tokio::select! {
            g = &mut rx => {
                // The sender is dropped only when the allocation is removed under us.
                return g.map_err(|_| WireError::Closed.into());
            }
            r = stream.read(buf) => {
                let n = r.map_err(|e| WireError::Frame(e.into()))?;
                if n == 0 {
                    return Err(WireError::Closed.into());
                }
                dec.extend(&buf[..n]);
                if dec.buffered() > MAX_PENDING_BYTES {
                    return Err(WireError::Flood(dec.buffered()).into());
                }
            }
        }
    }
}

fn reply(out: &mut Vec<u8>, r: &TenantReply) -> Result<(), TenantError> {
    wire::push_frame(out, r).map_err(|e| WireError::from(e).into())
}

fn handle(
    arb: &Arbiter,
    b: &TenantBinding,
    conn: ConnId,
    req: TenantRequest,
    out: &mut Vec<u8>,
) -> Result<Next, TenantError> {
    let key = b.key;
    match req {
        TenantRequest::Reserve { bytes } => {
            let r = arb.with_ledger(|l| l.reserve(key, conn, bytes));
            let msg = match r {
                Ok(Reservation::Granted { in_use }) => TenantReply::Reserved { in_use },
                Ok(Reservation::Denied { limit, in_use }) => TenantReply::Denied { limit, in_use },
                Err(e) => TenantReply::Error {
                    message: e.to_string(),
                },
            };
            reply(out, &msg)?;
        }
        TenantRequest::Release { bytes } => {
            match arb.with_ledger(|l| l.release(key, conn, bytes)) {
                Ok(r) if r.excess > 0 => crate::log!(
                    "tenant conn {conn} of {}: released {bytes} bytes but held only {}",
                    b.view.id,
                    r.freed
                ),
                Ok(_) => {}
                Err(e) => crate::log!("tenant conn {conn} of {}: release: {e}", b.view.id),
            }
        }
        TenantRequest::Redeclare { bytes } => {
            let msg = match arb.with_ledger(|l| l.redeclare(key, conn, bytes)) {
                Ok(in_use) => TenantReply::Reserved { in_use },
                Err(e) => TenantReply::Error {
                    message: e.to_string(),
                },
            };
            reply(out, &msg)?;
        }
        TenantRequest::MemInfo => {
            let msg = match arb.with_ledger(|l| l.usage(key)) {
                Some(u) => TenantReply::MemInfo {
                    limit: u.limit,
                    in_use: u.in_use,
                },
                None => TenantReply::Error {
                    message: "allocation is gone".into(),
                },
            };
            reply(out, &msg)?;
        }
        TenantRequest::Ping => reply(out, &TenantReply::Pong)?,
        TenantRequest::LeaseAcquire => match b.scheduler.acquire(key, conn, arb.now_ns()) {
            Ok(rx) => return Ok(Next::AwaitGrant(rx)),
            Err(e) => reply(
                out,
                &TenantReply::Error {
                    message: e.to_string(),
                },
            )?,
        },
        TenantRequest::LeaseRelease {
            lease_id,
            busy_ns,
            early,
        } => {
            b.scheduler
                .release(conn, lease_id, busy_ns, early, arb.now_ns());
        }
    }
    Ok(Next::Continue)
}
