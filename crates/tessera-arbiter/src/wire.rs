//! Async framing helpers shared by the two socket servers.
//!
//! Reading goes through the protocol's [`FrameDecoder`] (which refuses frames over 64 KiB, so
//! a connection buffers at most one frame plus one read); replies are encoded into a reused
//! buffer so the hot path allocates nothing once warm.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use std::io::Read;
use tessera_protocol::frame::HEADER_LEN;
use tessera_protocol::{FrameDecoder, FrameError, Hello, MAGIC, PROTOCOL_VERSION, Role};

use tokio::io::{AsyncRead, AsyncReadExt};

/// How long a new connection may take to send its `Hello`.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Bytes read per `read` call.
pub const READ_CHUNK: usize = 4096;

/// Why a connection is being closed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The peer closed (normal end).
    #[error("closed by peer")]
    Closed,
    /// Bad framing or payload.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The peer sent nothing in time.
    #[error("no hello within {0:?}")]
    Timeout(Duration),
    /// The hello does not carry Tessera's magic number.
    #[error("not a Tessera client (magic {0:#010x})")]
    BadMagic(u32),
    /// The peer speaks another protocol version.
    #[error("protocol version {0} (this arbiter speaks {PROTOCOL_VERSION})")]
    BadVersion(u32),
    /// The peer's role does not belong on this socket.
    #[error("{0}")]
    WrongRole(&'static str),
}

/// Reads into `dec` until one whole message is decoded.
pub async fn read_msg<R, T>(r: &mut R, dec: &mut FrameDecoder) -> Result<T, WireError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut buf = [0u8; READ_CHUNK];
    loop {
        if let Some(msg) = dec.next()? {
            return Ok(msg);
        }
        let n = r.read(&mut buf).await.map_err(FrameError::Io)?;
        if n == 0 {
            return Err(if dec.buffered() == 0 {
                WireError::Closed
            } else {
                FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()).into()
            });
        }
        dec.extend(&buf[..n]);
    }
}

/// Blocking twin of [`read_msg`] (tenant connections run on their own threads). A read
/// timeout set on the socket surfaces as [`WireError::Timeout`].
pub fn read_msg_blocking<R: Read, T: DeserializeOwned>(
    r: &mut R,
    dec: &mut FrameDecoder,
    timeout: Duration,
) -> Result<T, WireError> {
    let mut buf = [0u8; READ_CHUNK];
    loop {
        if let Some(msg) = dec.next()? {
            return Ok(msg);
        }
        let n = match r.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(WireError::Timeout(timeout));
            }
            Err(e) => return Err(FrameError::Io(e).into()),
        };
        if n == 0 {
            return Err(if dec.buffered() == 0 {
                WireError::Closed
            } else {
                FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()).into()
            });
        }
        dec.extend(&buf[..n]);
    }
}

/// Checks a `Hello`'s magic and version.
pub fn check_hello(hello: Hello) -> Result<Role, WireError> {
    if hello.magic != MAGIC {
        return Err(WireError::BadMagic(hello.magic));
    }
    if hello.version != PROTOCOL_VERSION {
        return Err(WireError::BadVersion(hello.version));
    }
    Ok(hello.role)
}

/// Reads and checks the `Hello` (magic, version), with a timeout.
pub async fn read_hello<R: AsyncRead + Unpin>(
    r: &mut R,
    dec: &mut FrameDecoder,
) -> Result<Role, WireError> {
    let hello: Hello = tokio::time::timeout(HANDSHAKE_TIMEOUT, read_msg(r, dec))
        .await
        .map_err(|_| WireError::Timeout(HANDSHAKE_TIMEOUT))??;
    check_hello(hello)
}

/// Appends `msg` as one frame to `out`.
pub fn push_frame<T: Serialize>(out: &mut Vec<u8>, msg: &T) -> Result<(), FrameError> {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    *out = postcard::to_extend(msg, std::mem::take(out))?;
    let len = out.len() - start - HEADER_LEN;
    if len > tessera_protocol::MAX_FRAME_LEN {
        out.truncate(start);
        return Err(FrameError::TooLarge(len));
    }
    out[start..start + HEADER_LEN].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use tessera_protocol::{TenantReply, frame};

    use super::*;

    #[test]
    fn push_frame_matches_the_protocol_encoder() {
        let mut out = Vec::new();
        push_frame(&mut out, &TenantReply::Reserved { in_use: 12345 }).unwrap();
        push_frame(&mut out, &TenantReply::Pong).unwrap();
        let mut want = frame::encode(&TenantReply::Reserved { in_use: 12345 }).unwrap();
        want.extend(frame::encode(&TenantReply::Pong).unwrap());
        assert_eq!(out, want);
    }

    #[tokio::test]
    async fn read_msg_reports_truncation_and_clean_close() {
        let bytes = frame::encode(&Hello::new(Role::Admin)).unwrap();
        let mut dec = FrameDecoder::new();
        let mut r = &bytes[..bytes.len() - 1];
        let err = read_msg::<_, Hello>(&mut r, &mut dec).await.unwrap_err();
        assert!(matches!(err, WireError::Frame(FrameError::Io(_))), "{err}");
        let mut dec = FrameDecoder::new();
        let mut r: &[u8] = &[];
        assert!(matches!(
            read_msg::<_, Hello>(&mut r, &mut dec).await,
            Err(WireError::Closed)
        ));
    }

    #[tokio::test]
    async fn read_hello_checks_magic_and_version() {
        let mut h = Hello::new(Role::Admin);
        h.magic = 0xdead_beef;
        let bytes = frame::encode(&h).unwrap();
        let err = read_hello(&mut &bytes[..], &mut FrameDecoder::new())
            .await
            .unwrap_err();
        assert!(matches!(err, WireError::BadMagic(0xdead_beef)));
        let mut h = Hello::new(Role::Admin);
        h.version = 99;
        let bytes = frame::encode(&h).unwrap();
        let err = read_hello(&mut &bytes[..], &mut FrameDecoder::new())
            .await
            .unwrap_err();
        assert!(matches!(err, WireError::BadVersion(99)));
        let bytes = frame::encode(&Hello::new(Role::Admin)).unwrap();
        assert_eq!(
            read_hello(&mut &bytes[..], &mut FrameDecoder::new())
                .await
                .unwrap(),
            Role::Admin
        );
    }
}
