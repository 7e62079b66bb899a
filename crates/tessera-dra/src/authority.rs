//! The kubelet's registration calls, made acceptable to the plugin's HTTP/2 server.
//!
//! The kubelet's plugin watcher dials the registration socket by its bare path
//! (`pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`, `dial`: no
//! `WithAuthority`), so grpc-go sends the path, percent-encoded, as `:authority`
//! (`google.golang.org/grpc` `clientconn.go`, `initAuthority` / `encodeAuthority`): for example
//! `%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.tessera.dev-reg.sock`. The `h2` crate under
//! tonic refuses that authority (a `%` in a host) and resets the stream with `PROTOCOL_ERROR`
//! (hyperium/h2 PR 487, open), so a real kubelet never got the plugin's `GetInfo` and never
//! registered it. (The kubelet's other clients set `localhost`: the DRA calls dial `unix:` targets,
//! the device manager passes `WithAuthority("localhost")`.)
//!
//! [`relay`] sits between the socket and the server: it passes the client's HTTP/2 frames through,
//! decoding each header block (HEADERS and its CONTINUATIONs) and encoding it again with an
//! `:authority` that is not a valid URI authority replaced by `localhost`. Every header block is
//! re-encoded, not only the rewritten ones, so the server's HPACK table follows this encoder's.
//! The server's frames go back untouched. Nothing here reads or trusts the authority: the plugin
//! serves one socket, root's alone.

use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The client connection preface (RFC 9113, 3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The server's SETTINGS_MAX_FRAME_SIZE as long as it does not raise it (RFC 9113, 6.5.2):
/// re-encoded blocks are cut to it.
const MAX_FRAME: usize = 16_384;
/// The largest frame payload or header block accepted from a client (the registration calls
/// are a few hundred bytes).
const MAX_BLOCK: usize = 1 << 20;

/// Why a relayed connection was closed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RelayError {
    /// Reading or writing a side failed.
    #[error("registration connection: {0}")]
    Io(#[from] std::io::Error),
    /// The client did not speak HTTP/2 as RFC 9113 says.
    #[error("registration connection: {0}")]
    Protocol(&'static str),
    /// A header block did not decode.
    #[error("registration connection: header block: {0:?}")]
    Hpack(loona_hpack::decoder::DecoderError),
}

/// A HEADERS frame waiting for its CONTINUATIONs.
struct OpenBlock {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

/// One client's frames, rewritten as they pass. Pure: bytes in, bytes out.
pub(crate) struct Rewriter {
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    open: Option<OpenBlock>,
}

impl Rewriter {
    pub(crate) fn new() -> Self {
        Rewriter {
            decoder: Decoder::new(),
            encoder: Encoder::new(),
            open: None,
        }
    }

    /// Takes one frame (`header` is its 9 octets, `payload` the rest); appends what goes on
    /// to the server to `out`.
    pub(crate) fn frame(
        &mut self,
        header: &[u8; 9],
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), RelayError> {
        let (kind, flags) = (header[3], header[4]);
        let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
        match (kind, &mut self.open) {
            (CONTINUATION, Some(open)) if open.stream == stream => {
                if open.block.len() + payload.len() > MAX_BLOCK {
                    return Err(RelayError::Protocol("header block too large"));
                }
                open.block.extend_from_slice(payload);
                if flags & END_HEADERS != 0 {
                    let Some(o) = self.open.take() else {
                        return Err(RelayError::Protocol("lost header block"));
                    };
                    self.emit(o.stream, o.flags, o.priority, &o.block, out)?;
                }
                Ok(())
            }
            // RFC 9113, 6.10: nothing may come between a HEADERS and its CONTINUATIONs.
            (_, Some(_)) | (CONTINUATION, None) => {
                Err(RelayError::Protocol("frame out of place in a header block"))
            }
            (HEADERS, None) => {
                let mut p = payload;
                let mut pad = 0usize;
                if flags & PADDED != 0 {
                    let (&n, rest) = p
                        .split_first()
                        .ok_or(RelayError::Protocol("short HEADERS"))?;
                    pad = usize::from(n);
                    p = rest;
                }
                let mut priority = None;
                if flags & PRIORITY != 0 {
                    if p.len() < 5 {
                        return Err(RelayError::Protocol("short HEADERS"));
                    }
                    let mut pr = [0u8; 5];
                    pr.copy_from_slice(&p[..5]);
                    priority = Some(pr);
                    p = &p[5..];
                }
                if pad > p.len() {
                    return Err(RelayError::Protocol("padding longer than HEADERS"));
                }
                let block = &p[..p.len() - pad];
                if flags & END_HEADERS != 0 {
                    self.emit(stream, flags, priority, block, out)
                } else {
                    self.open = Some(OpenBlock {
                        stream,
                        flags,
                        priority,
                        block: block.to_vec(),
                    });
                    Ok(())
                }
            }
            _ => {
                out.extend_from_slice(header);
                out.extend_from_slice(payload);
                Ok(())
            }
        }
    }

    /// Decodes a whole header block, mends its authority, and writes it as HEADERS (and
    /// CONTINUATIONs past [`MAX_FRAME`]) without padding.
    fn emit(
        &mut self,
        stream: u32,
        flags: u8,
        priority: Option<[u8; 5]>,
        block: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), RelayError> {
        let mut fields = self.decoder.decode(block).map_err(RelayError::Hpack)?;
        for (name, value) in &mut fields {
            if name.as_slice() == b":authority" && !valid_authority(value) {
                *value = b"localhost".to_vec();
            }
        }
        let encoded = self
            .encoder
            .encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut first = Vec::with_capacity(encoded.len() + 5);
        if let Some(pr) = priority {
            first.extend_from_slice(&pr);
        }
        let room = MAX_FRAME - first.len();
        let (head, mut rest) = encoded.split_at(encoded.len().min(room));
        first.extend_from_slice(head);
        let keep = flags & (END_STREAM | PRIORITY);
        let end = if rest.is_empty() { END_HEADERS } else { 0 };
        push_frame(out, HEADERS, keep | end, stream, &first);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
            rest = tail;
            let end = if rest.is_empty() { END_HEADERS } else { 0 };
            push_frame(out, CONTINUATION, end, stream, chunk);
        }
        Ok(())
    }
}

/// Whether the `http` crate (as h2 uses it) takes `value` as an authority.
fn valid_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

fn push_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    // Payloads here are at most MAX_FRAME (2^14) octets: the 24-bit length cannot overflow.
    let len = payload.len() as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Relays one connection: `client` (the kubelet's socket) to `server` (tonic's end of a pipe),
/// rewriting header blocks; the server's bytes go back as they are. Returns when either side
/// closes or the client breaks the protocol.
pub(crate) async fn relay<C, S>(client: C, server: S) -> Result<(), RelayError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut sr, mut sw) = tokio::io::split(server);
    let up = async {
        let mut preface = [0u8; PREFACE.len()];
        cr.read_exact(&mut preface).await?;
        if preface != PREFACE {
            return Err(RelayError::Protocol("not an HTTP/2 client preface"));
        }
        sw.write_all(&preface).await?;
        let mut rw = Rewriter::new();
        let mut out = Vec::new();
        loop {
            let mut header = [0u8; 9];
            match cr.read_exact(&mut header).await {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(e.into()),
            }
            let len =
                usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
            if len > MAX_BLOCK {
                return Err(RelayError::Protocol("frame too large"));
            }
            let mut payload = vec![0u8; len];
            cr.read_exact(&mut payload).await?;
            out.clear();
            rw.frame(&header, &payload, &mut out)?;
            sw.write_all(&out).await?;
        }
        sw.shutdown().await?;
        Ok::<(), RelayError>(())
    };
    let down = async {
        tokio::io::copy(&mut sr, &mut cw).await?;
        cw.shutdown().await?;
        Ok::<(), RelayError>(())
    };
    // The client done sending (its end shut) still gets the server's last answers: the server
    // sees the shutdown and closes. The server closing, or a broken client, ends it all.
    tokio::pin!(up, down);
    tokio::select! {
        r = &mut up => {
            r?;
            down.await
        }
        r = &mut down => r,
    }
}

/// The server's end of one relayed connection (what tonic serves).
pub(crate) struct Relayed(tokio::io::DuplexStream);

impl tonic::transport::server::Connected for Relayed {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Relayed {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Relayed {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The connections of `listener`, each relayed (a task per connection) to the stream's item.
pub(crate) fn incoming(
    listener: tokio::net::UnixListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<Relayed>> {
    tokio_stream::StreamExt::map(
        tokio_stream::wrappers::UnixListenerStream::new(listener),
        |conn| {
            let conn = conn?;
            let (near, far) = tokio::io::duplex(64 * 1024);
            tokio::spawn(async move {
                if let Err(e) = relay(conn, near).await {
                    tracing::debug!("{e}");
                }
            });
            Ok(Relayed(far))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header block grpc-go sends for `GetInfo` on the registration socket.
    fn kubelet_block(enc: &mut Encoder<'static>, authority: &[u8]) -> Vec<u8> {
        enc.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"user-agent", b"grpc-go/1.79.3"),
            (b"te", b"trailers"),
        ])
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> ([u8; 9], Vec<u8>) {
        let mut v = Vec::new();
        push_frame(&mut v, kind, flags, stream, payload);
        let mut h = [0u8; 9];
        h.copy_from_slice(&v[..9]);
        (h, v[9..].to_vec())
    }

    /// Splits relayed bytes into (kind, flags, stream, payload) frames.
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut v = Vec::new();
        while !b.is_empty() {
            let len = usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
            let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
            v.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        v
    }

    const PATH: &[u8] = b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.tessera.dev-reg.sock";

    #[test]
    fn the_kubelets_path_authority_is_refused_by_http_and_becomes_localhost() {
        assert!(
            !valid_authority(PATH),
            "h2 would take it: the relay is not needed"
        );
        let mut client = Encoder::new();
        let mut rw = Rewriter::new();
        let mut server = Decoder::new();
        // Two calls on one connection: the second block leans on the first's HPACK table.
        for stream in [1u32, 3] {
            let (h, p) = frame(
                HEADERS,
                END_HEADERS,
                stream,
                &kubelet_block(&mut client, PATH),
            );
            let mut out = Vec::new();
            rw.frame(&h, &p, &mut out).unwrap();
            let f = frames(&out);
            assert_eq!(f.len(), 1);
            assert_eq!(
                (f[0].0, f[0].1 & END_HEADERS, f[0].2),
                (HEADERS, END_HEADERS, stream)
            );
            let fields = server.decode(&f[0].3).unwrap();
            let get = |n: &[u8]| fields.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
            assert_eq!(get(b":authority").unwrap(), b"localhost");
            assert_eq!(
                get(b":path").unwrap(),
                b"/pluginregistration.Registration/GetInfo"
            );
            assert_eq!(get(b"te").unwrap(), b"trailers");
            assert_eq!(fields.len(), 7);
        }
    }

    #[test]
    fn a_valid_authority_padding_priority_and_continuations_pass_as_one_block() {
        let mut client = Encoder::new();
        let block = kubelet_block(&mut client, b"localhost");
        // PADDED + PRIORITY, the block cut in two, the rest in a CONTINUATION.
        let mut payload = vec![3u8];
        payload.extend_from_slice(&[0, 0, 0, 0, 15]);
        payload.extend_from_slice(&block[..10]);
        payload.extend_from_slice(&[0, 0, 0]);
        let (h, p) = frame(HEADERS, PADDED | PRIORITY | END_STREAM, 5, &payload);
        let mut rw = Rewriter::new();
        let mut out = Vec::new();
        rw.frame(&h, &p, &mut out).unwrap();
        assert!(out.is_empty(), "held until the block ends");
        let (h, p) = frame(CONTINUATION, END_HEADERS, 5, &block[10..]);
        rw.frame(&h, &p, &mut out).unwrap();
        let f = frames(&out);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].1, END_HEADERS | END_STREAM | PRIORITY);
        assert_eq!(&f[0].3[..5], &[0, 0, 0, 0, 15]);
        let fields = Decoder::new().decode(&f[0].3[5..]).unwrap();
        assert!(fields.contains(&(b":authority".to_vec(), b"localhost".to_vec())));
    }

    #[test]
    fn other_frames_pass_untouched_and_broken_sequences_close_the_connection() {
        let mut rw = Rewriter::new();
        let (h, p) = frame(0x0, END_STREAM, 1, b"\0\0\0\0\0");
        let mut out = Vec::new();
        rw.frame(&h, &p, &mut out).unwrap();
        assert_eq!(&out[..9], &h);
        assert_eq!(&out[9..], &p[..]);
        // A CONTINUATION with no HEADERS before it.
        let (h, p) = frame(CONTINUATION, END_HEADERS, 1, b"");
        assert!(rw.frame(&h, &p, &mut out).is_err());
        // A DATA frame inside an open header block.
        let mut rw = Rewriter::new();
        let (h, p) = frame(HEADERS, 0, 1, b"\x82");
        rw.frame(&h, &p, &mut out).unwrap();
        let (h, p) = frame(0x0, 0, 1, b"");
        assert!(rw.frame(&h, &p, &mut out).is_err());
        // Padding longer than the frame.
        let mut rw = Rewriter::new();
        let (h, p) = frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 0x82]);
        assert!(rw.frame(&h, &p, &mut out).is_err());
        // A block that does not decode.
        let (h, p) = frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff]);
        assert!(Rewriter::new().frame(&h, &p, &mut out).is_err());
    }

    #[tokio::test]
    async fn a_client_that_shuts_its_end_still_gets_the_servers_answer() {
        let (client, near_client) = tokio::io::duplex(4096);
        let (near_server, mut server) = tokio::io::duplex(4096);
        let relayed = tokio::spawn(relay(near_client, near_server));
        let (mut cr, mut cw) = tokio::io::split(client);
        let mut sent = PREFACE.to_vec();
        push_frame(&mut sent, 0x4, 0, 0, b""); // an empty SETTINGS
        cw.write_all(&sent).await.unwrap();
        cw.shutdown().await.unwrap();
        // The server reads all of it (to the client's shutdown), then answers and closes.
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, sent);
        server.write_all(b"answer").await.unwrap();
        drop(server);
        let mut back = Vec::new();
        cr.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"answer");
        relayed.await.unwrap().unwrap();
    }
}
