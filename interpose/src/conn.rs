//! One blocking connection to the arbiter's tenant socket.
//!
//! This is the protocol crate's framing (`u32` little-endian length + postcard), written over
//! `send(MSG_NOSIGNAL)` rather than `write(2)`: a write to a dead arbiter must not raise
//! `SIGPIPE` in the application (whose signal handlers we never touch). Frames are encoded on
//! the stack, and a reply usually arrives in a single `recv`. Sockets are `SOCK_CLOEXEC` (the
//! standard library opens them that way), so an `exec`ed child never inherits the connection.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tessera_protocol::frame::HEADER_LEN;
use tessera_protocol::{
    AllocationView, Hello, MAX_FRAME_LEN, Role, ServerHello, TenantReply, TenantRequest,
};

/// Errors of the arbiter connection.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The socket could not be reached.
    #[error("cannot connect to {path}: {source}")]
    Connect {
        /// Socket path.
        path: String,
        /// Cause.
        source: io::Error,
    },
    /// The socket failed, timed out or closed.
    #[error("arbiter connection: {0}")]
    Io(#[from] io::Error),
    /// The arbiter closed the connection.
    #[error("arbiter closed the connection")]
    Closed,
    /// A frame could not be encoded.
    #[error("bad frame: {0}")]
    Codec(#[source] postcard::Error),
    /// A frame from the arbiter could not be decoded (or had bytes past its message).
    #[error("bad frame: {0}")]
    Decode(#[source] tessera_protocol::FrameError),
    /// A frame was well formed but not what the protocol allows here (its length, or a reply
    /// of the wrong kind).
    #[error("bad frame: {0}")]
    Frame(String),
    /// The arbiter refused the handshake (bad token, deleted allocation, version).
    #[error("arbiter refused: {0}")]
    Refused(String),
    /// A one-way send could not complete without blocking.
    #[error("send would block")]
    WouldBlock,
}

const SEND_BUF: usize = 1024;

/// A connected, handshaken tenant connection.
#[derive(Debug)]
pub struct Conn {
    stream: UnixStream,
    rbuf: Vec<u8>,
    rlen: usize,
}

impl Conn {
    /// Connects, sends `Hello` with `token`, and returns the connection and the allocation.
    /// `timeout` bounds every later send and receive on this connection (`None`: none).
    pub fn connect(
        path: &Path,
        token: &str,
        timeout: Option<Duration>,
    ) -> Result<(Self, AllocationView), ConnError> {
        let role = Role::Tenant {
            token: token.to_owned(),
        };
        Self::connect_as(path, role, timeout)
    }

    /// Like [`Conn::connect`], with any tenant role (a [`Role::Companion`] for the lease
    /// connection).
    pub fn connect_as(
        path: &Path,
        role: Role,
        timeout: Option<Duration>,
    ) -> Result<(Self, AllocationView), ConnError> {
        let _no_cancel = NoCancel::new();
        let stream = UnixStream::connect(path).map_err(|source| ConnError::Connect {
            path: path.display().to_string(),
            source,
        })?;
        // The handshake is always bounded, whatever the caller wants later.
        let hs = Some(timeout.unwrap_or(Duration::from_secs(5)));
        stream.set_read_timeout(hs)?;
        stream.set_write_timeout(hs)?;
        let mut conn = Self {
            stream,
            rbuf: vec![0; 1024],
            rlen: 0,
        };
        conn.send_blocking(&Hello::new(role))?;
        let hello: ServerHello = conn.recv()?;
        conn.stream.set_read_timeout(timeout)?;
        conn.stream.set_write_timeout(timeout)?;
        match hello {
            ServerHello::Welcome {
                allocation: Some(a),
                ..
            } => Ok((conn, a)),
            ServerHello::Welcome {
                allocation: None, ..
            } => Err(ConnError::Frame("welcome without allocation".into())),
            ServerHello::Refused { reason } | ServerHello::Rejected { reason, .. } => {
                Err(ConnError::Refused(reason))
            }
            // The answer to a probe, which a tenant never sends.
            ServerHello::Probed { .. } => Err(ConnError::Frame("a probe's answer".into())),
        }
    }

    /// The socket's file descriptor (closed by hand in a forked child).
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Sends a request and waits for its reply.
    pub fn call(&mut self, req: &TenantRequest) -> Result<TenantReply, ConnError> {
        self.call_after_release(0, req)
    }

    /// Sends `Release { release }` (when non-zero) and `req` in one `send`, then waits for the
    /// reply to `req`: a free's release rides along with the next request instead of waking
    /// the arbiter on its own.
    pub fn call_after_release(
        &mut self,
        release: u64,
        req: &TenantRequest,
    ) -> Result<TenantReply, ConnError> {
        let _no_cancel = NoCancel::new();
        let mut buf = [0u8; 2 * SEND_BUF];
        let mut len = 0;
        if release > 0 {
            len = encode_into(&TenantRequest::Release { bytes: release }, &mut buf)?;
        }
        len += encode_into(req, &mut buf[len..])?;
        self.send_all(&buf[..len])?;
        self.recv()
    }

    /// Sends a one-way request without ever blocking: if the socket buffer is full (a wedged
    /// arbiter), the caller drops the connection and re-declares after reconnecting.
    pub fn send_nowait(&mut self, req: &TenantRequest) -> Result<(), ConnError> {
        let (buf, len) = encode(req)?;
        // SAFETY: `buf` is valid for `len` bytes and the fd is open for the life of `self`.
        let n = unsafe {
            libc::send(
                self.fd(),
                buf.as_ptr().cast(),
                len,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n == len as isize {
            return Ok(());
        }
        if n < 0 {
            let e = io::Error::last_os_error();
            return Err(if e.kind() == io::ErrorKind::WouldBlock {
                ConnError::WouldBlock
            } else {
                ConnError::Io(e)
            });
        }
        // A partial frame poisons the stream; the caller must drop the connection.
        Err(ConnError::WouldBlock)
    }

    /// Receives one reply (or an unasked frame, on a pressure channel).
    pub fn recv_reply(&mut self) -> Result<TenantReply, ConnError> {
        let _no_cancel = NoCancel::new();
        self.recv()
    }

    /// One `recv(2)` into the free end of the read buffer (callers keep room there), with
    /// `flags`; its return value (bytes, 0 at end of stream, -1 with `errno`).
    fn recv_more(&mut self, flags: libc::c_int) -> isize {
        let room = &mut self.rbuf[self.rlen..];
        // SAFETY: `room` is valid writable memory of its length; the fd is open while `self`
        // owns the stream.
        unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                room.as_mut_ptr().cast(),
                room.len(),
                flags,
            )
        }
    }

    /// A frame the arbiter sent unasked (`LeaseRevoked`), if one has arrived: never blocks.
    pub fn try_recv_reply(&mut self) -> Result<Option<TenantReply>, ConnError> {
        if !self.has_buffered_frame() {
            if self.rbuf.len() < self.rlen + 256 {
                self.rbuf.resize(self.rlen + 256, 0);
            }
            let n = self.recv_more(libc::MSG_DONTWAIT);
            if n == 0 {
                return Err(ConnError::Closed);
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                    _ => Err(e.into()),
                };
            }
            self.rlen += n as usize;
            if !self.has_buffered_frame() {
                return Ok(None);
            }
        }
        self.recv().map(Some)
    }

    /// True when a whole frame is already buffered (read from the socket, not yet decoded).
    pub fn has_buffered_frame(&self) -> bool {
        self.rlen >= HEADER_LEN && {
            let len =
                u32::from_le_bytes(self.rbuf[..HEADER_LEN].try_into().expect("4 bytes")) as usize;
            self.rlen >= HEADER_LEN + len
        }
    }

    /// Sends one frame, blocking until it is written (bounded by the connection's timeout).
    pub fn send_blocking<T: Serialize>(&mut self, msg: &T) -> Result<(), ConnError> {
        let (buf, len) = encode(msg)?;
        self.send_all(&buf[..len])
    }

    fn send_all(&mut self, buf: &[u8]) -> Result<(), ConnError> {
        let len = buf.len();
        let mut off = 0;
        while off < len {
            // SAFETY: `buf[off..len]` is valid and the fd is open for the life of `self`.
            let n = unsafe {
                libc::send(
                    self.fd(),
                    buf[off..].as_ptr().cast(),
                    len - off,
                    libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            off += n as usize;
        }
        Ok(())
    }

    /// Receives one frame. Bytes past it (there should be none: one request is outstanding at
    /// a time) stay buffered for the next call.
    fn recv<T: DeserializeOwned>(&mut self) -> Result<T, ConnError> {
        loop {
            if self.rlen >= HEADER_LEN {
                let len = u32::from_le_bytes(self.rbuf[..HEADER_LEN].try_into().expect("4 bytes"))
                    as usize;
                if len > MAX_FRAME_LEN {
                    return Err(ConnError::Frame(format!("frame of {len} bytes")));
                }
                let total = HEADER_LEN + len;
                if self.rbuf.len() < total {
                    self.rbuf.resize(total, 0);
                }
                if self.rlen >= total {
                    // The protocol's decoder: the message must use every byte of its frame.
                    let msg = tessera_protocol::frame::decode(&self.rbuf[HEADER_LEN..total])
                        .map_err(ConnError::Decode);
                    self.rbuf.copy_within(total..self.rlen, 0);
                    self.rlen -= total;
                    return msg;
                }
            }
            let n = self.recv_more(0);
            if n == 0 {
                return Err(ConnError::Closed);
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            self.rlen += n as usize;
        }
    }
}

/// Holds off `pthread_cancel` for a blocking call made on an application thread: `send` and
/// `recv` are cancellation points, and a cancellation acted on there would unwind through Rust
/// frames (an abort) and leave the connection with half a frame. A pending cancellation is
/// acted on at the thread's next cancellation point after the call.
struct NoCancel(libc::c_int);

impl NoCancel {
    fn new() -> Self {
        let mut old = 0;
        // SAFETY: affects only the calling thread; `old` is a valid out-pointer.
        unsafe { crate::ffi::pthread_setcancelstate(crate::ffi::PTHREAD_CANCEL_DISABLE, &mut old) };
        Self(old)
    }
}

impl Drop for NoCancel {
    fn drop(&mut self) {
        let mut prev = 0;
        // SAFETY: restores the state saved by `new` on the same thread (the guard never leaves
        // the function that made it); `prev` is a valid out-pointer.
        unsafe { crate::ffi::pthread_setcancelstate(self.0, &mut prev) };
    }
}

/// Encodes one frame on the stack.
fn encode<T: Serialize>(msg: &T) -> Result<([u8; SEND_BUF], usize), ConnError> {
    let mut buf = [0u8; SEND_BUF];
    let len = encode_into(msg, &mut buf)?;
    Ok((buf, len))
}

/// Encodes one frame at the start of `buf`; returns its length.
fn encode_into<T: Serialize>(msg: &T, buf: &mut [u8]) -> Result<usize, ConnError> {
    if buf.len() < HEADER_LEN {
        return Err(ConnError::Frame("no room for a frame".into()));
    }
    let len = postcard::to_slice(msg, &mut buf[HEADER_LEN..])
        .map_err(ConnError::Codec)?
        .len();
    buf[..HEADER_LEN].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(HEADER_LEN + len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_protocol::frame;

    #[test]
    fn encoding_matches_the_protocol_crate() {
        for req in [
            TenantRequest::Reserve { bytes: 600 << 20 },
            TenantRequest::Release { bytes: 1 },
            TenantRequest::LeaseRelease {
                lease_id: 9,
                busy_ns: 12345,
                early: true,
            },
        ] {
            let (buf, len) = encode(&req).unwrap();
            assert_eq!(&buf[..len], &frame::encode(&req).unwrap()[..]);
        }
    }

    #[test]
    fn oversized_messages_are_an_error_not_a_crash() {
        let hello = Hello::new(Role::Tenant {
            token: "x".repeat(4000),
        });
        assert!(matches!(encode(&hello), Err(ConnError::Codec(_))));
    }

    #[test]
    fn a_reply_with_bytes_past_its_message_is_an_error() {
        use std::io::Write;
        let (here, mut there) = UnixStream::pair().unwrap();
        let mut conn = Conn {
            stream: here,
            rbuf: vec![0; 1024],
            rlen: 0,
        };
        let mut frame = frame::encode(&TenantReply::Pong).unwrap();
        frame.push(0xAA);
        let len = (frame.len() - HEADER_LEN) as u32;
        frame[..HEADER_LEN].copy_from_slice(&len.to_le_bytes());
        there.write_all(&frame).unwrap();
        let got: Result<TenantReply, _> = conn.recv();
        assert!(
            matches!(
                got,
                Err(ConnError::Decode(tessera_protocol::FrameError::Trailing(1)))
            ),
            "{got:?}"
        );
        // A clean frame after it is read as usual.
        there
            .write_all(&frame::encode(&TenantReply::Pong).unwrap())
            .unwrap();
        assert!(matches!(conn.recv::<TenantReply>(), Ok(TenantReply::Pong)));
    }
}
