//! Blocking clients over a Unix socket: [`TenantClient`] for the interposer and
//! [`AdminClient`] for the CLI and the device plugin.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::frame::{self, FrameError};
use crate::message::*;

/// Errors of the blocking clients.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Could not connect to the socket.
    #[error("cannot connect to {path}: {source}")]
    Connect {
        /// Socket path.
        path: String,
        /// Cause.
        source: io::Error,
    },
    /// Framing or transport failure.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The server refused the handshake.
    #[error("refused by arbiter: {reason}")]
    Refused {
        /// What went wrong, for callers that must decide.
        kind: RefusalKind,
        /// The server's words.
        reason: String,
    },
    /// The server answered something that does not fit the request.
    #[error("unexpected reply from arbiter: {0}")]
    Unexpected(String),
    /// The admin API reported an error.
    #[error("{message}")]
    Admin {
        /// Class of failure.
        kind: AdminErrorKind,
        /// Reason.
        message: String,
    },
}

impl ClientError {
    /// The error for a refusing `hello` (a welcome is not one: [`ClientError::Unexpected`]).
    fn refused(hello: &ServerHello) -> Self {
        match hello.refused() {
            Some((kind, reason)) => Self::Refused {
                kind,
                reason: reason.to_owned(),
            },
            None => Self::Unexpected(format!("{hello:?}")),
        }
    }
}

fn connect(path: &Path, role: Role) -> Result<(UnixStream, ServerHello), ClientError> {
    let mut stream = UnixStream::connect(path).map_err(|source| ClientError::Connect {
        path: path.display().to_string(),
        source,
    })?;
    frame::write_frame(&mut stream, &Hello::new(role))?;
    let hello: ServerHello = frame::read_frame(&mut stream)?;
    Ok((stream, hello))
}

/// A tenant's connection (one per process).
#[derive(Debug)]
pub struct TenantClient {
    stream: UnixStream,
    allocation: AllocationView,
}

impl TenantClient {
    /// Connects and performs the handshake with `token`.
    pub fn connect(path: &Path, token: &str) -> Result<Self, ClientError> {
        let (stream, hello) = connect(
            path,
            Role::Tenant {
                token: token.to_owned(),
            },
        )?;
        match hello {
            ServerHello::Welcome {
                allocation: Some(allocation),
                ..
            } => Ok(Self { stream, allocation }),
            ServerHello::Welcome {
                allocation: None, ..
            } => Err(ClientError::Unexpected("welcome without allocation".into())),
            refused => Err(ClientError::refused(&refused)),
        }
    }

    /// The allocation this token belongs to.
    pub fn allocation(&self) -> &AllocationView {
        &self.allocation
    }

    /// The underlying socket (e.g. to set timeouts or close on fork).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Sends a request and waits for its reply.
    pub fn call(&mut self, req: &TenantRequest) -> Result<TenantReply, ClientError> {
        frame::write_frame(&mut self.stream, req)?;
        Ok(frame::read_frame(&mut self.stream)?)
    }

    /// Sends a one-way request (`Release`, `LeaseRelease`).
    pub fn send(&mut self, req: &TenantRequest) -> Result<(), ClientError> {
        Ok(frame::write_frame(&mut self.stream, req)?)
    }

    /// Reads one frame the arbiter sent unasked (`LeaseRevoked`, `Pressure`).
    pub fn recv(&mut self) -> Result<TenantReply, ClientError> {
        Ok(frame::read_frame(&mut self.stream)?)
    }
}

/// An admin connection.
#[derive(Debug)]
pub struct AdminClient {
    stream: UnixStream,
    /// A connection from [`AdminClient::connect_pipelined`] whose `Hello` went out with its
    /// first request and whose answer is still to be read (before the first reply).
    welcome_due: bool,
    /// The `Hello`, not yet written: it goes out in the same write as the first request.
    hello_due: Option<Vec<u8>>,
}

/// A wedged arbiter must not hang the CLI or the device plugin forever.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

impl AdminClient {
    /// Connects to the admin socket and completes the handshake.
    pub fn connect(path: &Path) -> Result<Self, ClientError> {
        let (stream, hello) = connect(path, Role::Admin)?;
        let _ = stream.set_read_timeout(Some(ADMIN_TIMEOUT));
        let _ = stream.set_write_timeout(Some(ADMIN_TIMEOUT));
        match hello {
            ServerHello::Welcome { .. } => Ok(Self {
                stream,
                welcome_due: false,
                hello_due: None,
            }),
            refused => Err(ClientError::refused(&refused)),
        }
    }

    /// Connects to the admin socket without waiting for the handshake: the `Hello` goes out
    /// with the first request, in one write, and the arbiter's answer to it is read before the
    /// first reply (a refusal is then that request's error). One round trip less than
    /// [`AdminClient::connect`] (`tessera run`'s start-up): the arbiter reads exactly the
    /// `Hello` frame and leaves what follows in the socket for after its `Welcome`.
    pub fn connect_pipelined(path: &Path) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.display().to_string(),
            source,
        })?;
        let _ = stream.set_read_timeout(Some(ADMIN_TIMEOUT));
        let _ = stream.set_write_timeout(Some(ADMIN_TIMEOUT));
        Ok(Self {
            stream,
            welcome_due: false,
            hello_due: Some(frame::encode(&Hello::new(Role::Admin))?),
        })
    }

    /// Sends a request without reading its reply ([`AdminClient::recv`] reads it; replies
    /// come in the order the requests were sent).
    pub fn send(&mut self, req: &AdminRequest) -> Result<(), ClientError> {
        let mut out = match self.hello_due.take() {
            Some(hello) => {
                self.welcome_due = true;
                hello
            }
            None => Vec::new(),
        };
        out.extend(frame::encode(req)?);
        std::io::Write::write_all(&mut self.stream, &out).map_err(FrameError::Io)?;
        Ok(())
    }

    /// Reads the reply to the oldest request not answered yet; an `Error` reply is
    /// [`ClientError::Admin`], a refused handshake [`ClientError::Refused`].
    pub fn recv(&mut self) -> Result<AdminReply, ClientError> {
        if self.welcome_due {
            match frame::read_frame(&mut self.stream)? {
                ServerHello::Welcome { .. } => self.welcome_due = false,
                refused => return Err(ClientError::refused(&refused)),
            }
        }
        match frame::read_frame(&mut self.stream)? {
            AdminReply::Error { kind, message } => Err(ClientError::Admin { kind, message }),
            reply => Ok(reply),
        }
    }

    fn call(&mut self, req: &AdminRequest) -> Result<AdminReply, ClientError> {
        self.send(req)?;
        self.recv()
    }

    /// The node's GPUs.
    pub fn gpus(&mut self) -> Result<Vec<GpuInfo>, ClientError> {
        match self.call(&AdminRequest::ListGpus)? {
            AdminReply::Gpus(g) => Ok(g),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Creates an allocation; returns its token and status.
    pub fn create(
        &mut self,
        req: CreateAllocation,
    ) -> Result<(String, AllocationStatus), ClientError> {
        match self.call(&AdminRequest::Create(req))? {
            AdminReply::Created { token, allocation } => Ok((token, allocation)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Creates an allocation owned by process `owner` (see [`AdminRequest::CreateOwned`]).
    pub fn create_owned(
        &mut self,
        create: CreateAllocation,
        owner: ProcessOwner,
    ) -> Result<(String, AllocationStatus), ClientError> {
        match self.call(&AdminRequest::CreateOwned { create, owner })? {
            AdminReply::Created { token, allocation } => Ok((token, allocation)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Creates one allocation spanning several GPUs (see [`AdminRequest::CreateGroup`]);
    /// returns the group token and one status per GPU, in the order asked.
    pub fn create_group(
        &mut self,
        slices: Vec<CreateAllocation>,
        owner: Option<ProcessOwner>,
    ) -> Result<(String, Vec<AllocationStatus>), ClientError> {
        match self.call(&AdminRequest::CreateGroup { slices, owner })? {
            AdminReply::CreatedGroup { token, allocations } => Ok((token, allocations)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Creates an allocation in `tier`, owned by `owner` if given (see
    /// [`AdminRequest::CreateTiered`]).
    pub fn create_tiered(
        &mut self,
        create: CreateAllocation,
        owner: Option<ProcessOwner>,
        tier: crate::Tier,
    ) -> Result<(String, AllocationStatus), ClientError> {
        match self.call(&AdminRequest::CreateTiered {
            create,
            owner,
            tier,
        })? {
            AdminReply::Created { token, allocation } => Ok((token, allocation)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Every allocation with its use.
    pub fn list(&mut self) -> Result<Vec<AllocationStatus>, ClientError> {
        match self.call(&AdminRequest::List)? {
            AdminReply::Allocations(a) => Ok(a),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Deletes an allocation by id.
    pub fn delete(&mut self, id: &str) -> Result<(), ClientError> {
        match self.call(&AdminRequest::Delete { id: id.to_owned() })? {
            AdminReply::Deleted => Ok(()),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// The last process of allocation `id` the backstop killed, and why (`None`: none).
    pub fn last_kill(&mut self, id: &str) -> Result<Option<KillRecord>, ClientError> {
        match self.call(&AdminRequest::LastKill { id: id.to_owned() })? {
            AdminReply::LastKill(k) => Ok(k),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Merges `labels` into an allocation's labels (an empty value removes the key); returns
    /// the allocation as it is now.
    pub fn update_labels(
        &mut self,
        id: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<AllocationStatus, ClientError> {
        let req = AdminRequest::UpdateLabels {
            id: id.to_owned(),
            labels,
        };
        match self.call(&req)? {
            AdminReply::Updated(a) => Ok(a),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }
}
