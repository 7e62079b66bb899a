//! Length-prefixed frames: a little-endian `u32` payload length, then a `postcard` payload.
//!
//! The length is checked against [`MAX_FRAME_LEN`] before any payload is read, so a hostile
//! peer cannot make the reader allocate more than that.

use std::io::{self, Read, Write};

use serde::{Serialize, de::DeserializeOwned};

/// Largest payload accepted, in bytes. Every message is far smaller; anything bigger is garbage.
pub const MAX_FRAME_LEN: usize = 64 * 1024;

/// Length of the frame header.
pub const HEADER_LEN: usize = 4;

/// Errors from reading or writing frames.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The socket failed or closed mid-frame.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the connection cleanly between frames.
    #[error("connection closed by peer")]
    Closed,
    /// The announced payload is larger than [`MAX_FRAME_LEN`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_LEN} byte limit")]
    TooLarge(usize),
    /// The payload is not a valid message.
    #[error("malformed frame: {0}")]
    Malformed(#[from] postcard::Error),
    /// The payload holds a valid message followed by bytes that belong to none: a frame of
    /// another message type (e.g. an admin request on the tenant socket) can otherwise decode
    /// as a shorter message of this one.
    #[error("malformed frame: {0} trailing byte(s) after the message")]
    Trailing(usize),
    /// The announced payload is larger than the reader's own limit (below [`MAX_FRAME_LEN`]).
    #[error("frame of {len} bytes exceeds this connection's {limit} byte limit")]
    OverLimit {
        /// Announced payload length.
        len: usize,
        /// The reader's limit.
        limit: usize,
    },
}

/// Encodes `msg` as one frame (header + payload).
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut buf = vec![0u8; HEADER_LEN];
    let mut buf = postcard::to_extend(msg, std::mem::take(&mut buf))?;
    let len = buf.len() - HEADER_LEN;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge(len));
    }
    buf[..HEADER_LEN].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(buf)
}

/// Decodes one payload (without header); the message must use every byte of it.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, FrameError> {
    let (msg, rest) = postcard::take_from_bytes(payload)?;
    if !rest.is_empty() {
        return Err(FrameError::Trailing(rest.len()));
    }
    Ok(msg)
}

/// Writes `msg` as one frame with a single `write_all`, so frames from one thread never interleave.
pub fn write_frame<W: Write, T: Serialize>(w: &mut W, msg: &T) -> Result<(), FrameError> {
    let buf = encode(msg)?;
    w.write_all(&buf)?;
    Ok(())
}

/// Reads one frame and decodes it. Blocks until a whole frame arrived.
pub fn read_frame<R: Read, T: DeserializeOwned>(r: &mut R) -> Result<T, FrameError> {
    let mut header = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge(len));
    }
    // Small frames are the norm; a stack buffer keeps the hot path allocation-free.
    let mut small = [0u8; 256];
    let mut big;
    let payload: &mut [u8] = if len <= small.len() {
        &mut small[..len]
    } else {
        big = vec![0u8; len];
        &mut big
    };
    r.read_exact(payload)?;
    decode(payload)
}

/// Incremental decoder for non-blocking or async readers: feed bytes as they come,
/// take whole frames out. Partial frames stay buffered.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Largest payload accepted by this decoder.
    limit: usize,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::with_limit(MAX_FRAME_LEN)
    }
}

impl FrameDecoder {
    /// A decoder with an empty buffer, accepting frames up to [`MAX_FRAME_LEN`].
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder that refuses payloads over `limit` bytes (capped at [`MAX_FRAME_LEN`]): a
    /// reader whose messages are all small bounds what an unfinished frame can make it buffer.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            buf: Vec::new(),
            limit: limit.min(MAX_FRAME_LEN),
        }
    }

    /// Appends received bytes.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes buffered and not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Bytes still missing before the next frame is whole: the rest of its header, or of its
    /// payload once the header is in (0 when a whole frame is buffered). A reader that must not
    /// take bytes past one frame reads at most this many.
    pub fn needed(&self) -> usize {
        if self.buf.len() < HEADER_LEN {
            return HEADER_LEN - self.buf.len();
        }
        let len = u32::from_le_bytes(self.buf[..HEADER_LEN].try_into().expect("4 bytes")) as usize;
        (HEADER_LEN + len).saturating_sub(self.buf.len())
    }

    /// Returns the next whole frame's message, `Ok(None)` if more bytes are needed.
    /// An error means the stream is unusable and the connection should be closed.
    // Not an `Iterator`: each call may fail and the target type varies per call.
    #[allow(clippy::should_implement_trait)]
    pub fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>, FrameError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_le_bytes(self.buf[..HEADER_LEN].try_into().expect("4 bytes")) as usize;
        if len > MAX_FRAME_LEN {
            return Err(FrameError::TooLarge(len));
        }
        if len > self.limit {
            return Err(FrameError::OverLimit {
                len,
                limit: self.limit,
            });
        }
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let msg = decode(&self.buf[HEADER_LEN..HEADER_LEN + len]);
        self.buf.drain(..HEADER_LEN + len);
        msg.map(Some)
    }
}
