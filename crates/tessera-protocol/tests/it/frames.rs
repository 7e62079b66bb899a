//! Framing against partial, oversized and garbage input.

use std::io::Cursor;

use tessera_protocol::frame::{self, FrameDecoder, FrameError, HEADER_LEN, MAX_FRAME_LEN};
use tessera_protocol::{Hello, Role, TenantReply, TenantRequest};

#[test]
fn round_trip_blocking() {
    let mut buf = Vec::new();
    frame::write_frame(&mut buf, &TenantRequest::Reserve { bytes: 600 << 20 }).unwrap();
    frame::write_frame(&mut buf, &TenantRequest::Release { bytes: 7 }).unwrap();
    let mut cur = Cursor::new(buf);
    let a: TenantRequest = frame::read_frame(&mut cur).unwrap();
    let b: TenantRequest = frame::read_frame(&mut cur).unwrap();
    assert_eq!(a, TenantRequest::Reserve { bytes: 600 << 20 });
    assert_eq!(b, TenantRequest::Release { bytes: 7 });
    assert!(matches!(
        frame::read_frame::<_, TenantRequest>(&mut cur),
        Err(FrameError::Closed)
    ));
}

#[test]
fn decoder_handles_byte_by_byte_input() {
    let hello = Hello::new(Role::Tenant {
        token: "ab".repeat(32),
    });
    let mut bytes = frame::encode(&hello).unwrap();
    bytes.extend(frame::encode(&Hello::new(Role::Admin)).unwrap());
    let mut dec = FrameDecoder::new();
    let mut got = Vec::new();
    for b in &bytes {
        dec.extend(std::slice::from_ref(b));
        while let Some(h) = dec.next::<Hello>().unwrap() {
            got.push(h);
        }
    }
    assert_eq!(got, vec![hello, Hello::new(Role::Admin)]);
    assert_eq!(dec.buffered(), 0);
}

#[test]
fn truncated_frame_is_an_error_not_a_hang() {
    let bytes = frame::encode(&TenantReply::Reserved { in_use: 1 << 40 }).unwrap();
    let mut cur = Cursor::new(&bytes[..bytes.len() - 1]);
    let err = frame::read_frame::<_, TenantReply>(&mut cur).unwrap_err();
    assert!(matches!(err, FrameError::Io(_)), "{err:?}");
    let mut cur = Cursor::new(&bytes[..2]);
    assert!(matches!(
        frame::read_frame::<_, TenantReply>(&mut cur),
        Err(FrameError::Io(_))
    ));
}

#[test]
fn oversized_frame_is_refused_before_reading_payload() {
    let len = (MAX_FRAME_LEN as u32 + 1).to_le_bytes();
    let mut cur = Cursor::new(len.to_vec());
    assert!(matches!(
        frame::read_frame::<_, TenantRequest>(&mut cur),
        Err(FrameError::TooLarge(n)) if n == MAX_FRAME_LEN + 1
    ));
    let mut dec = FrameDecoder::new();
    dec.extend(&u32::MAX.to_le_bytes());
    assert!(matches!(
        dec.next::<TenantRequest>(),
        Err(FrameError::TooLarge(_))
    ));
    // Encoding refuses too.
    let huge = Role::Tenant {
        token: "x".repeat(MAX_FRAME_LEN + 10),
    };
    assert!(matches!(frame::encode(&huge), Err(FrameError::TooLarge(_))));
}

#[test]
fn a_decoder_with_a_limit_refuses_larger_frames_from_the_header() {
    let mut dec = FrameDecoder::with_limit(16);
    // A whole small frame passes.
    dec.extend(&frame::encode(&TenantRequest::Ping).unwrap());
    assert_eq!(
        dec.next::<TenantRequest>().unwrap(),
        Some(TenantRequest::Ping)
    );
    // A 17-byte frame is refused from its header alone, before its payload arrives.
    dec.extend(&17u32.to_le_bytes());
    assert!(matches!(
        dec.next::<TenantRequest>(),
        Err(FrameError::OverLimit { len: 17, limit: 16 })
    ));
    // The limit never goes above MAX_FRAME_LEN.
    let mut dec = FrameDecoder::with_limit(usize::MAX);
    dec.extend(&(MAX_FRAME_LEN as u32 + 1).to_le_bytes());
    assert!(matches!(
        dec.next::<TenantRequest>(),
        Err(FrameError::TooLarge(_))
    ));
}

#[test]
fn garbage_payload_is_malformed() {
    let mut bytes = 5u32.to_le_bytes().to_vec();
    bytes.extend([0xff, 0xff, 0xff, 0xff, 0xff]);
    let mut cur = Cursor::new(bytes.clone());
    assert!(matches!(
        frame::read_frame::<_, TenantRequest>(&mut cur),
        Err(FrameError::Malformed(_))
    ));
    let mut dec = FrameDecoder::new();
    dec.extend(&bytes);
    assert!(matches!(
        dec.next::<TenantRequest>(),
        Err(FrameError::Malformed(_))
    ));
    assert_eq!(HEADER_LEN, 4);
}

#[test]
fn hello_carries_magic_and_version() {
    let h = Hello::new(Role::Admin);
    assert_eq!(h.magic, tessera_protocol::MAGIC);
    assert_eq!(h.version, tessera_protocol::PROTOCOL_VERSION);
}

#[test]
fn bytes_after_the_message_are_an_error() {
    let mut bytes = frame::encode(&TenantRequest::Reserve { bytes: 1 }).unwrap();
    bytes.push(0);
    let len = (bytes.len() - HEADER_LEN) as u32;
    bytes[..HEADER_LEN].copy_from_slice(&len.to_le_bytes());
    let err = frame::read_frame::<_, TenantRequest>(&mut Cursor::new(&bytes)).unwrap_err();
    assert!(matches!(err, FrameError::Trailing(1)), "{err:?}");
    let mut dec = FrameDecoder::new();
    dec.extend(&bytes);
    assert!(matches!(
        dec.next::<TenantRequest>(),
        Err(FrameError::Trailing(1))
    ));
    // An admin request of the same variant index is no tenant request.
    let delete = frame::encode(&tessera_protocol::AdminRequest::Delete {
        id: "abcd0001".into(),
    })
    .unwrap();
    assert!(matches!(
        frame::read_frame::<_, TenantRequest>(&mut Cursor::new(&delete)),
        Err(FrameError::Trailing(_))
    ));
}

#[test]
fn needed_counts_the_bytes_to_the_end_of_the_next_frame() {
    let bytes = frame::encode(&TenantRequest::Reserve { bytes: 1 << 20 }).unwrap();
    let mut dec = FrameDecoder::new();
    assert_eq!(dec.needed(), HEADER_LEN);
    // Reading exactly `needed` bytes at a time ends on the frame boundary, never past it.
    let mut at = 0;
    while dec.needed() > 0 {
        let n = dec.needed().min(2);
        dec.extend(&bytes[at..at + n]);
        at += n;
    }
    assert_eq!(at, bytes.len());
    assert_eq!(
        dec.next::<TenantRequest>().unwrap(),
        Some(TenantRequest::Reserve { bytes: 1 << 20 })
    );
    assert_eq!(dec.needed(), HEADER_LEN);
}
