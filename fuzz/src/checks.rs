//! Invariants of the wire protocol and the identity file, checked on arbitrary input.
//!
//! Shared by the coverage-guided targets in `fuzz/` (one binary per target, each a thin
//! wrapper around one `check_*` function) and by the bounded, seeded pass that runs with the
//! workspace tests (`crates/tessera-protocol/tests/it/fuzz_props.rs`, which includes this file
//! by path). Each `check_*` function panics when an invariant is broken, and only then.
//!
//! The invariants compare *messages*, not bytes: postcard accepts non-canonical input
//! (over-long varints such as `80 00` for 0, and a map with a key repeated keeps only the
//! last value), so a decoded message may re-encode to fewer bytes than were consumed, but
//! never to more, and its re-encoding is a fixed point. They also hold whether or not the
//! decoder accepts trailing bytes after a message: what `frame::decode` accepts is compared
//! with the prefix that `postcard::take_from_bytes` consumes.

use std::fmt::Debug;
use std::io::Cursor;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tessera_protocol::frame::{self, FrameDecoder, FrameError, HEADER_LEN, MAX_FRAME_LEN};
use tessera_protocol::identity::{Identity, IdentityError, MAX_IDENTITY_LEN};
use tessera_protocol::{
    AdminErrorKind, AdminReply, AdminRequest, AllocationStatus, AllocationView, CreateAllocation,
    GpuInfo, GpuSelector, Hello, ProcessOwner, RefusalKind, Role, ServerHello, TenantReply,
    TenantRequest, Tier,
};

/// What every message type on the wire is.
pub(super) trait Msg: Serialize + DeserializeOwned + PartialEq + Debug + Clone {}
impl<T: Serialize + DeserializeOwned + PartialEq + Debug + Clone> Msg for T {}

/// The targets, by name (the folder names under `fuzz/corpus/`).
pub(super) const TARGETS: &[&str] = &[
    "frame_stream",
    "hello",
    "server_hello",
    "tenant_request",
    "tenant_reply",
    "admin_request",
    "admin_reply",
    "identity",
];

/// Runs target `name` on `data` (panics on a broken invariant or an unknown name).
pub(super) fn run_target(name: &str, data: &[u8]) {
    match name {
        "frame_stream" => check_frame_stream(data),
        "hello" => check_payload::<Hello>(data),
        "server_hello" => check_payload::<ServerHello>(data),
        "tenant_request" => check_payload::<TenantRequest>(data),
        "tenant_reply" => check_payload::<TenantReply>(data),
        "admin_request" => check_payload::<AdminRequest>(data),
        "admin_reply" => check_payload::<AdminReply>(data),
        "identity" => check_identity(data),
        other => panic!("unknown target {other}"),
    }
}

/// One payload (no header), decoded as a `T` the way the arbiter and the interposer do.
///
/// Invariants: no panic; `frame::decode` accepts only what `postcard::take_from_bytes`
/// accepts, with the same message, and accepts every input that postcard consumes whole;
/// what decodes passes [`check_round_trip`] with the consumed prefix's length.
pub(super) fn check_payload<T: Msg>(payload: &[u8]) {
    let decoded = frame::decode::<T>(payload);
    let prefix = postcard::take_from_bytes::<T>(payload);
    match (decoded, prefix) {
        (Ok(msg), Ok((pmsg, rest))) => {
            assert_eq!(msg, pmsg, "frame::decode and postcard disagree");
            check_round_trip(&msg, payload.len() - rest.len());
        }
        (Ok(msg), Err(e)) => panic!("frame::decode accepted {msg:?}, postcard refuses: {e}"),
        (Err(e), Ok((pmsg, rest))) => {
            // Only trailing bytes may make the framed decoder stricter than postcard.
            assert!(
                !rest.is_empty(),
                "frame::decode refused a whole {pmsg:?}: {e}"
            );
            check_round_trip(&pmsg, payload.len() - rest.len());
        }
        (Err(_), Err(_)) => {}
    }
}

/// A message that came off the wire (`consumed` bytes of payload) re-encodes to at most
/// `consumed` bytes that decode to the same message, the re-encoding is a fixed point, and it
/// goes through a frame (blocking reader and incremental decoder) unchanged.
pub(super) fn check_round_trip<T: Msg>(msg: &T, consumed: usize) {
    let bytes = postcard::to_allocvec(msg).expect("a decoded message encodes");
    assert!(
        bytes.len() <= consumed,
        "{msg:?} re-encodes to {} bytes, longer than the {consumed} it was decoded from",
        bytes.len()
    );
    let again: T = frame::decode(&bytes).expect("a re-encoded message decodes");
    assert_eq!(&again, msg, "decode(encode(x)) != x");
    assert_eq!(
        postcard::to_allocvec(&again).unwrap(),
        bytes,
        "re-encoding is not a fixed point"
    );

    let framed = frame::encode(msg).expect("a message decoded from one frame fits one frame");
    assert_eq!(framed.len(), HEADER_LEN + bytes.len());
    assert_eq!(&framed[HEADER_LEN..], &bytes[..]);
    let read: T = frame::read_frame(&mut Cursor::new(&framed)).expect("read_frame");
    assert_eq!(&read, msg);
    let mut dec = FrameDecoder::new();
    dec.extend(&framed);
    assert_eq!(dec.next::<T>().expect("FrameDecoder").as_ref(), Some(msg));
    assert_eq!(dec.buffered(), 0);
}

/// How a stream of frames ended, for comparing the two readers.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// Clean end between frames.
    Closed,
    /// The stream stopped inside a header or a payload.
    Truncated,
    /// A header announced more than [`MAX_FRAME_LEN`].
    TooLarge(usize),
    /// A payload did not decode (the error's text).
    Bad(String),
}

fn end_of(e: FrameError) -> End {
    match e {
        FrameError::Closed => End::Closed,
        FrameError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => End::Truncated,
        FrameError::TooLarge(n) => End::TooLarge(n),
        FrameError::Io(e) => panic!("unexpected i/o error from an in-memory reader: {e}"),
        e => End::Bad(e.to_string()),
    }
}

/// A byte stream fed to [`FrameDecoder`] in arbitrary chunks.
///
/// Input: byte 0 picks the message type (one of the six, as the arbiter, interposer and CLI
/// decode them), byte 1 seeds the chunk sizes, the rest is the stream.
pub(super) fn check_frame_stream(data: &[u8]) {
    let (Some(&kind), Some(&seed)) = (data.first(), data.get(1)) else {
        return;
    };
    let stream = &data[2..];
    match kind % 6 {
        0 => stream_as::<Hello>(stream, seed),
        1 => stream_as::<ServerHello>(stream, seed),
        2 => stream_as::<TenantRequest>(stream, seed),
        3 => stream_as::<TenantReply>(stream, seed),
        4 => stream_as::<AdminRequest>(stream, seed),
        _ => stream_as::<AdminReply>(stream, seed),
    }
}

/// Invariants: no panic; after the decoder is drained (`next` returned `Ok(None)`) it buffers
/// less than one whole maximal frame (`HEADER_LEN + MAX_FRAME_LEN`), whatever the chunking;
/// it yields the same messages and the same end (clean, truncated, too large, malformed) as
/// the blocking `read_frame` on the whole stream; every message it yields passes
/// [`check_payload`] on its frame's payload.
pub(super) fn stream_as<T: Msg>(stream: &[u8], seed: u8) {
    // Reference: the blocking reader on the whole stream.
    let mut cur = Cursor::new(stream);
    let mut want = Vec::new();
    let want_end = loop {
        match frame::read_frame::<_, T>(&mut cur) {
            Ok(m) => want.push(m),
            Err(e) => break end_of(e),
        }
    };

    // The incremental decoder, fed in chunks of 1..=64 bytes (seed 0: the whole stream at once).
    let mut rng = u64::from(seed) | 0x9e37_79b9_7f4a_7c00;
    let mut dec = FrameDecoder::new();
    let mut got = Vec::new();
    let mut rest = stream;
    let mut got_end = None;
    'feed: while !rest.is_empty() {
        let n = if seed == 0 {
            rest.len()
        } else {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            1 + (rng % 64) as usize
        }
        .min(rest.len());
        let before = dec.buffered();
        dec.extend(&rest[..n]);
        assert_eq!(dec.buffered(), before + n);
        rest = &rest[n..];
        loop {
            match dec.next::<T>() {
                Ok(Some(m)) => got.push(m),
                Ok(None) => break,
                Err(e) => {
                    got_end = Some(end_of(e));
                    break 'feed;
                }
            }
        }
        assert!(
            dec.buffered() < HEADER_LEN + MAX_FRAME_LEN,
            "a drained decoder buffers {} bytes",
            dec.buffered()
        );
    }
    let got_end = got_end.unwrap_or(if dec.buffered() == 0 {
        End::Closed
    } else {
        End::Truncated
    });
    assert_eq!(
        got, want,
        "FrameDecoder and read_frame yield different messages"
    );
    assert_eq!(
        got_end, want_end,
        "FrameDecoder and read_frame end differently"
    );

    // Each frame's payload on its own.
    let mut off = 0;
    for _ in 0..got.len() {
        let len = u32::from_le_bytes(stream[off..off + HEADER_LEN].try_into().unwrap()) as usize;
        check_payload::<T>(&stream[off + HEADER_LEN..off + HEADER_LEN + len]);
        off += HEADER_LEN + len;
    }
}

/// The identity file parser on arbitrary text (non-UTF-8 input is refused before parsing by
/// both readers, `read_to_string`).
///
/// Invariants: no panic; an accepted file has a non-empty token and single-line, trimmed
/// values; it renders to at most one byte more than its text (the final newline), and the
/// rendering parses back to the same identity whenever it fits [`MAX_IDENTITY_LEN`];
/// refusals name a line that exists, and `TooLong` only for text over the limit.
pub(super) fn check_identity(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Identity::parse(text) {
        Ok(id) => {
            assert!(text.len() <= MAX_IDENTITY_LEN);
            assert!(!id.token.is_empty());
            let socket = id
                .socket
                .as_ref()
                .map(|s| s.to_str().expect("parsed from UTF-8"));
            for v in [Some(id.token.as_str()), socket, id.allocation.as_deref()]
                .into_iter()
                .flatten()
            {
                assert!(
                    !v.is_empty() && !v.contains('\n') && v.trim() == v,
                    "value {v:?}"
                );
            }
            let rendered = id.render();
            assert!(
                rendered.len() <= text.len() + 1,
                "{text:?} renders to {rendered:?}"
            );
            if rendered.len() <= MAX_IDENTITY_LEN {
                assert_eq!(
                    Identity::parse(&rendered).as_ref(),
                    Ok(&id),
                    "parse(render(x)) != x"
                );
            } else {
                // Known edge (docs/security.md, Fuzzing): a file of exactly the limit without a
                // final newline renders one byte over it.
                assert_eq!(Identity::parse(&rendered), Err(IdentityError::TooLong));
            }
        }
        Err(IdentityError::TooLong) => assert!(text.len() > MAX_IDENTITY_LEN),
        Err(IdentityError::BadLine(n) | IdentityError::UnknownKey(n, _)) => {
            assert!(n >= 1 && n <= text.lines().count(), "line {n} of {text:?}");
        }
        Err(IdentityError::NoToken) => {}
    }
}

/// One message of every variant of every type, with edge values: the seed corpus and the
/// structured part of the bounded pass.
pub(super) struct Samples {
    /// Client hellos.
    pub hello: Vec<Hello>,
    /// Server hellos.
    pub server_hello: Vec<ServerHello>,
    /// Tenant requests.
    pub tenant_request: Vec<TenantRequest>,
    /// Tenant replies.
    pub tenant_reply: Vec<TenantReply>,
    /// Admin requests.
    pub admin_request: Vec<AdminRequest>,
    /// Admin replies.
    pub admin_reply: Vec<AdminReply>,
    /// Identity files.
    pub identity: Vec<String>,
}

/// The samples.
pub(super) fn samples() -> Samples {
    let view = AllocationView {
        id: "a-1".into(),
        gpu_index: 0,
        gpu_uuid: "GPU-12345678-1234-1234-1234-123456789abc".into(),
        memory_limit: 8 << 30,
        share: 50,
        cap: Some(80),
    };
    let labels = [
        ("unit".to_string(), "gpu0-3".to_string()),
        ("k".into(), String::new()),
    ]
    .into_iter()
    .collect();
    let status = AllocationStatus {
        id: "a-1".into(),
        gpu_index: 1,
        gpu_uuid: "GPU-x".into(),
        memory_limit: u64::MAX,
        memory_used: 600 << 20,
        processes: 3,
        share: 100,
        cap: None,
        gpu_time_10s_ns: 9_999_999_999,
        labels,
        created_unix: 1_700_000_000,
        enforced: 2,
        gpu_time_total_ns: u64::MAX,
        throttled_total_ns: 123_456_789,
        oom_refusals: 7,
        leases: 1 << 40,
        owner: Some(ProcessOwner {
            pid: i32::MAX,
            start_time: u64::MAX,
        }),
        orphaned: true,
        tier: Tier::Latency,
        owner_uid: Some(61001),
    };
    let create = CreateAllocation {
        gpu: GpuSelector::Uuid("GPU-x".into()),
        memory_limit: 1 << 30,
        share: 1,
        cap: Some(100),
        labels: Default::default(),
    };
    Samples {
        hello: vec![
            Hello::new(Role::Tenant {
                token: "0123456789abcdef0123456789abcdef".into(),
            }),
            Hello::new(Role::Admin),
            Hello::new(Role::Companion {
                token: "0123456789abcdef0123456789abcdef".into(),
                ticket: u64::MAX,
            }),
            Hello {
                magic: 0,
                version: u32::MAX,
                role: Role::Tenant {
                    token: String::new(),
                },
            },
        ],
        server_hello: vec![
            ServerHello::Welcome {
                version: 1,
                allocation: Some(view.clone()),
            },
            ServerHello::Welcome {
                version: 1,
                allocation: None,
            },
            ServerHello::Welcome {
                version: 2,
                allocation: Some(AllocationView { cap: None, ..view }),
            },
            ServerHello::Refused {
                reason: "unknown token ✗".into(),
            },
            ServerHello::Rejected {
                kind: RefusalKind::Full,
                reason: "the arbiter already serves 5 tenant connections".into(),
            },
        ],
        tenant_request: vec![
            TenantRequest::Reserve { bytes: 600 << 20 },
            TenantRequest::Release { bytes: 1 },
            TenantRequest::Redeclare { bytes: u64::MAX },
            TenantRequest::MemInfo,
            TenantRequest::Ping,
            TenantRequest::LeaseAcquire,
            TenantRequest::LeaseRelease {
                lease_id: 7,
                busy_ns: 1_000_000,
                early: true,
            },
            TenantRequest::ReserveCredit {
                bytes: 1 << 20,
                extra: 64 << 20,
                given_back: 3,
            },
            TenantRequest::Ticket,
            TenantRequest::Subscribe {
                ticket: 0xdead_beef,
            },
            TenantRequest::Relinquish { seq: 4, bytes: 128 },
            TenantRequest::MemInfoAfter { given_back: 5 },
        ],
        tenant_reply: vec![
            TenantReply::Reserved { in_use: 1 << 40 },
            TenantReply::Denied {
                limit: 8 << 30,
                in_use: 8 << 30,
            },
            TenantReply::MemInfo {
                limit: 0,
                in_use: 0,
            },
            TenantReply::Pong,
            TenantReply::LeaseGranted {
                lease_id: 1,
                duration_ns: 5_000_000,
            },
            TenantReply::Error {
                message: "no such lease".into(),
            },
            TenantReply::Granted {
                bytes: 65 << 20,
                in_use: 1 << 30,
            },
            TenantReply::Ticket { ticket: u64::MAX },
            TenantReply::Subscribed,
            TenantReply::Pressure { seq: 127 },
            TenantReply::LeaseGrantedBounded {
                lease_id: 2,
                duration_ns: 20_000_000,
                max_inflight_ns: 1_000_000,
            },
            TenantReply::LeaseRevoked { lease_id: u64::MAX },
        ],
        admin_request: vec![
            AdminRequest::ListGpus,
            AdminRequest::Create(create.clone()),
            AdminRequest::Create(CreateAllocation {
                gpu: GpuSelector::Index(3),
                labels: status.labels.clone(),
                cap: None,
                ..create.clone()
            }),
            AdminRequest::List,
            AdminRequest::CreateOwned {
                create: create.clone(),
                owner: ProcessOwner {
                    pid: 1,
                    start_time: 0,
                },
            },
            AdminRequest::Delete { id: "a-1".into() },
            AdminRequest::UpdateLabels {
                id: "a-1".into(),
                labels: status.labels.clone(),
            },
            AdminRequest::CreateGroup {
                slices: vec![
                    create.clone(),
                    CreateAllocation {
                        gpu: GpuSelector::Uuid("GPU-b".into()),
                        ..create.clone()
                    },
                ],
                owner: None,
            },
            AdminRequest::CreateTiered {
                create: create.clone(),
                owner: None,
                tier: Tier::Latency,
            },
            AdminRequest::CreateTiered {
                create: create.clone(),
                owner: Some(ProcessOwner {
                    pid: 2,
                    start_time: 9,
                }),
                tier: Tier::BestEffort,
            },
        ],
        admin_reply: vec![
            AdminReply::Gpus(vec![
                GpuInfo {
                    index: 0,
                    uuid: "GPU-a".into(),
                    name: "NVIDIA H200".into(),
                    memory_total: 141 << 30,
                },
                GpuInfo {
                    index: 1,
                    uuid: "GPU-b".into(),
                    name: String::new(),
                    memory_total: 0,
                },
            ]),
            AdminReply::Gpus(Vec::new()),
            AdminReply::Created {
                token: "ab".repeat(16),
                allocation: status.clone(),
            },
            AdminReply::Updated(status.clone()),
            AdminReply::CreatedGroup {
                token: "cd".repeat(32),
                allocations: vec![status.clone(), status.clone()],
            },
            AdminReply::Allocations(vec![status.clone(), status]),
            AdminReply::Deleted,
            AdminReply::Error {
                kind: AdminErrorKind::InvalidArgument,
                message: "share 0".into(),
            },
            AdminReply::Error {
                kind: AdminErrorKind::NotFound,
                message: String::new(),
            },
            AdminReply::Error {
                kind: AdminErrorKind::Exhausted,
                message: "full".into(),
            },
            AdminReply::Error {
                kind: AdminErrorKind::Internal,
                message: "disk".into(),
            },
        ],
        identity: vec![
            "token=0123456789abcdef\nsocket=/run/tessera/tessera.sock\nallocation=a-1\n".into(),
            "# made by tessera-device-plugin\n\n token = xyz \r\nsocket=\n".into(),
            "token=a=b\nallocation=\ntoken=c\n".into(),
            "token\n".into(),
            "token=a\nlimit=80GiB\n".into(),
        ],
    }
}

/// The seed corpus of target `name`: the samples, encoded as that target reads its input.
pub(super) fn seeds(name: &str) -> Vec<Vec<u8>> {
    fn payloads<T: Msg>(msgs: &[T]) -> Vec<Vec<u8>> {
        msgs.iter()
            .map(|m| postcard::to_allocvec(m).unwrap())
            .collect()
    }
    fn stream<T: Msg>(kind: u8, msgs: &[T]) -> Vec<Vec<u8>> {
        let mut all = vec![kind, 7];
        for m in msgs {
            all.extend(frame::encode(m).unwrap());
        }
        let mut first = vec![kind, 0];
        first.extend(frame::encode(&msgs[0]).unwrap());
        vec![all, first]
    }
    let s = samples();
    match name {
        "frame_stream" => [
            stream(0, &s.hello),
            stream(1, &s.server_hello),
            stream(2, &s.tenant_request),
            stream(3, &s.tenant_reply),
            stream(4, &s.admin_request),
            stream(5, &s.admin_reply),
        ]
        .concat(),
        "hello" => payloads(&s.hello),
        "server_hello" => payloads(&s.server_hello),
        "tenant_request" => payloads(&s.tenant_request),
        "tenant_reply" => payloads(&s.tenant_reply),
        "admin_request" => payloads(&s.admin_request),
        "admin_reply" => payloads(&s.admin_reply),
        "identity" => s.identity.iter().map(|t| t.as_bytes().to_vec()).collect(),
        other => panic!("unknown target {other}"),
    }
}
