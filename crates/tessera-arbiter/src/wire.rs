//! Async framing helpers shared by the two socket servers.
//!
//! The first frame of a connection (its `Hello`) is read exactly, into a fixed buffer of
//! [`HELLO_FRAME_LIMIT`] bytes, under one deadline: an unauthenticated peer costs little and not
//! for long. Later frames go through the protocol's [`FrameDecoder`] (which refuses frames over
//! its limit, so a connection buffers at most one frame plus one read); replies are encoded into
//! a reused buffer so the hot path allocates nothing once warm.

#![forbid(unsafe_code)]

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tessera_protocol::frame::HEADER_LEN;
use tessera_protocol::{FrameDecoder, FrameError, Hello, MAGIC, PROTOCOL_VERSION, Role};

use tokio::io::{AsyncRead, AsyncReadExt};

/// How long a new connection may take to send its whole `Hello` (one deadline, not per read:
/// a peer that trickles a byte at a time is dropped all the same).
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(1);

/// Largest `Hello` payload read. A tenant's is about 75 bytes (magic, version, a 64-hex-digit
/// token); an unauthenticated peer makes the arbiter buffer at most this much.
pub(crate) const HELLO_FRAME_LIMIT: usize = 512;

/// Bytes read per `read` call.
pub(crate) const READ_CHUNK: usize = 4096;

/// Why a connection is being closed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    /// The peer closed (normal end).
    #[error("closed by peer")]
    Closed,
    /// Bad framing or payload.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The peer sent nothing in time.
    #[error("no hello within {} ms", .0.as_millis())]
    Timeout(Duration),
    /// The first frame announces more than a `Hello` can be.
    #[error("hello of {0} bytes exceeds the {HELLO_FRAME_LIMIT} byte limit")]
    HelloTooLarge(usize),
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

/// How much one `read` may take from the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Take {
    /// As much as the buffer holds (later frames: fewer system calls).
    Chunk,
    /// Never past the end of the frame being read (the hello: what follows it is left in the
    /// socket for whoever serves the connection next).
    Exact,
}

/// Gives `chunk`, the result of one `read`, to `dec`. An empty chunk is the peer's end of
/// stream: a clean close between frames, a truncated frame otherwise.
pub(crate) fn feed(dec: &mut FrameDecoder, chunk: &[u8]) -> Result<(), WireError> {
    if chunk.is_empty() {
        return Err(if dec.buffered() == 0 {
            WireError::Closed
        } else {
            FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()).into()
        });
    }
    dec.extend(chunk);
    Ok(())
}

/// The one frame read loop: reads through `buf` into `dec` until one whole message is decoded.
async fn read_with<R, T>(
    r: &mut R,
    dec: &mut FrameDecoder,
    buf: &mut [u8],
    take: Take,
) -> Result<T, WireError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    loop {
        if let Some(msg) = dec.next()? {
            return Ok(msg);
        }
        let want = match take {
            Take::Chunk => buf.len(),
            Take::Exact => dec.needed().min(buf.len()),
        };
        let n = r.read(&mut buf[..want]).await.map_err(FrameError::Io)?;
        feed(dec, &buf[..n])?;
    }
}

/// Reads into `dec` until one whole message is decoded.
pub(crate) async fn read_msg<R, T>(r: &mut R, dec: &mut FrameDecoder) -> Result<T, WireError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut buf = [0u8; READ_CHUNK];
    read_with(r, dec, &mut buf, Take::Chunk).await
}

/// Checks a `Hello`'s magic and version.
pub(crate) fn check_hello(hello: Hello) -> Result<Role, WireError> {
    if hello.magic != MAGIC {
        return Err(WireError::BadMagic(hello.magic));
    }
    if hello.version != PROTOCOL_VERSION {
        return Err(WireError::BadVersion(hello.version));
    }
    Ok(hello.role)
}

/// Reads exactly the first frame and decodes it as a `Hello`, refusing a length over
/// [`HELLO_FRAME_LIMIT`] from the header. Bytes after the frame stay in the socket for whoever
/// serves the connection next (a tenant may pipeline requests behind its hello).
pub(crate) async fn read_small_hello<R: AsyncRead + Unpin>(r: &mut R) -> Result<Hello, WireError> {
    let mut dec = FrameDecoder::with_limit(HELLO_FRAME_LIMIT);
    let mut buf = [0u8; HEADER_LEN + HELLO_FRAME_LIMIT];
    read_with(r, &mut dec, &mut buf, Take::Exact)
        .await
        .map_err(|e| match e {
            WireError::Frame(FrameError::OverLimit { len, .. } | FrameError::TooLarge(len)) => {
                WireError::HelloTooLarge(len)
            }
            e => e,
        })
}

/// Reads and checks the `Hello` (magic, version); the whole handshake gets `timeout`.
pub(crate) async fn read_hello<R: AsyncRead + Unpin>(
    r: &mut R,
    timeout: Duration,
) -> Result<Role, WireError> {
    let hello = tokio::time::timeout(timeout, read_small_hello(r))
        .await
        .map_err(|_| WireError::Timeout(timeout))??;
    check_hello(hello)
}

/// Appends `msg` as one frame to `out`.
pub(crate) fn push_frame<T: Serialize>(out: &mut Vec<u8>, msg: &T) -> Result<(), FrameError> {
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
        let err = read_hello(&mut &bytes[..], HANDSHAKE_TIMEOUT)
            .await
            .unwrap_err();
        assert!(matches!(err, WireError::BadMagic(0xdead_beef)));
        let mut h = Hello::new(Role::Admin);
        h.version = 99;
        let bytes = frame::encode(&h).unwrap();
        let err = read_hello(&mut &bytes[..], HANDSHAKE_TIMEOUT)
            .await
            .unwrap_err();
        assert!(matches!(err, WireError::BadVersion(99)));
        let bytes = frame::encode(&Hello::new(Role::Admin)).unwrap();
        assert_eq!(
            read_hello(&mut &bytes[..], HANDSHAKE_TIMEOUT)
                .await
                .unwrap(),
            Role::Admin
        );
    }

    #[tokio::test]
    async fn a_hello_is_read_alone_and_a_large_first_frame_is_refused_from_its_header() {
        let mut bytes = frame::encode(&Hello::new(Role::Admin)).unwrap();
        let hello_len = bytes.len();
        bytes.extend(frame::encode(&TenantReply::Pong).unwrap());
        let mut r = &bytes[..];
        read_small_hello(&mut r).await.unwrap();
        // What follows the hello is left for the connection's server.
        assert_eq!(r.len(), bytes.len() - hello_len);
        let big = ((HELLO_FRAME_LIMIT + 1) as u32).to_le_bytes();
        let err = read_small_hello(&mut &big[..]).await.unwrap_err();
        assert!(matches!(err, WireError::HelloTooLarge(513)), "{err}");
        // A trickle is bounded by one deadline for the whole hello.
        let (mut client, mut server) = tokio::io::duplex(64);
        let started = std::time::Instant::now();
        let trickle = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for b in frame::encode(&Hello::new(Role::Admin)).unwrap() {
                if client.write_all(&[b]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        });
        let err = read_hello(&mut server, Duration::from_millis(100))
            .await
            .unwrap_err();
        // A timeout although every byte came within 30 ms: the deadline is for the whole hello,
        // and it is not early (a loaded machine only makes it late).
        assert!(matches!(err, WireError::Timeout(_)), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(100));
        trickle.abort();
    }
}
