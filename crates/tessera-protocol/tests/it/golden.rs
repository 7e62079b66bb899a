//! The tenant wire format, pinned byte for byte.
//!
//! An interposer is loaded into long-running processes and baked into container images, so an
//! older interposer keeps talking to a newer arbiter for as long as those run. Every frame it
//! can send or receive is pinned here as the exact bytes this protocol version puts on the
//! socket. If one of these fails, the change broke installed interposers: append a new variant
//! or bump `PROTOCOL_VERSION` instead of editing these bytes.

use std::fmt::Debug;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tessera_protocol::frame;
use tessera_protocol::{
    AllocationView, Hello, MAGIC, PROTOCOL_VERSION, RefusalKind, Role, ServerHello, TenantReply,
    TenantRequest,
};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// `msg` encodes to `golden` (a whole frame: 4-byte little-endian length, then postcard), and
/// `golden`'s payload decodes back to `msg`.
fn pinned<T: Serialize + DeserializeOwned + PartialEq + Debug>(msg: T, golden: &str) {
    let bytes = frame::encode(&msg).unwrap();
    assert_eq!(hex(&bytes), golden, "encoding of {msg:?} changed");
    let raw = unhex(golden);
    let len = u32::from_le_bytes(raw[..4].try_into().unwrap()) as usize;
    assert_eq!(len, raw.len() - 4, "length header of {msg:?}");
    let back: T = frame::decode(&raw[4..]).unwrap();
    assert_eq!(back, msg);
}

#[test]
fn protocol_constants_are_pinned() {
    assert_eq!(MAGIC, 0x5445_5353);
    assert_eq!(PROTOCOL_VERSION, 2);
}

#[test]
fn hellos_both_ways_are_pinned() {
    pinned(
        Hello::new(Role::Tenant {
            token: "0123456789abcdef".into(),
        }),
        "18000000d3a695a20502001030313233343536373839616263646566",
    );
    pinned(Hello::new(Role::Admin), "07000000d3a695a2050201");
    pinned(
        Hello::new(Role::Companion {
            token: "ab".into(),
            ticket: 300,
        }),
        // Variant 2 (appended), the token, the ticket as a varint.
        "0c000000d3a695a2050202026162ac02",
    );
    pinned(
        ServerHello::Welcome {
            version: 1,
            allocation: Some(AllocationView {
                id: "0a1b2c3d".into(),
                gpu_index: 1,
                gpu_uuid: "GPU-1".into(),
                memory_limit: 24 << 30,
                share: 30,
                cap: Some(50),
            }),
        },
        "1b00000000010108306131623263336401054750552d3180808080601e0132",
    );
    // The form every version reads: these bytes must never change, so a client of any version
    // can say why a server of another version refused it.
    pinned(
        ServerHello::Refused {
            reason: "bad token".into(),
        },
        "0b000000010962616420746f6b656e",
    );
    pinned(
        ServerHello::Rejected {
            kind: RefusalKind::UnknownToken,
            reason: "bad token".into(),
        },
        "0c00000002020962616420746f6b656e",
    );
}

#[test]
fn a_refusal_across_versions_is_the_form_every_version_reads() {
    let old_client = PROTOCOL_VERSION - 1;
    let across = ServerHello::refusal(RefusalKind::Version, "protocol version 1", old_client);
    assert_eq!(
        across,
        ServerHello::Refused {
            reason: "protocol version 1".into()
        }
    );
    // Whatever the kind, a client of another version gets the old form.
    let across = ServerHello::refusal(RefusalKind::UnknownToken, "bad token", old_client + 7);
    assert!(matches!(across, ServerHello::Refused { .. }));
    assert_eq!(across.refused(), Some((RefusalKind::Version, "bad token")));
    let same = ServerHello::refusal(RefusalKind::Full, "full", PROTOCOL_VERSION);
    assert_eq!(same.refused(), Some((RefusalKind::Full, "full")));
    let welcome = ServerHello::Welcome {
        version: PROTOCOL_VERSION,
        allocation: None,
    };
    assert_eq!(welcome.refused(), None);
}

#[test]
fn every_refusal_kind_is_pinned() {
    let kinds = [
        (RefusalKind::Version, "00", "version"),
        (RefusalKind::WrongSocket, "01", "wrong_socket"),
        (RefusalKind::UnknownToken, "02", "unknown_token"),
        (RefusalKind::BadTicket, "03", "bad_ticket"),
        (RefusalKind::Full, "04", "full"),
    ];
    for (kind, byte, name) in kinds {
        pinned(kind, &format!("01000000{byte}"));
        assert_eq!(kind.to_string(), name);
    }
}

#[test]
fn every_tenant_request_is_pinned() {
    pinned(
        TenantRequest::Reserve { bytes: 1 << 20 },
        "0400000000808040",
    );
    pinned(TenantRequest::Release { bytes: 4096 }, "03000000018020");
    pinned(TenantRequest::Redeclare { bytes: 300 }, "0300000002ac02");
    pinned(TenantRequest::MemInfo, "0100000003");
    pinned(TenantRequest::Ping, "0100000004");
    pinned(TenantRequest::LeaseAcquire, "0100000005");
    pinned(
        TenantRequest::LeaseRelease {
            lease_id: 7,
            busy_ns: 20_000_000,
            early: true,
        },
        "07000000060780dac40901",
    );
    pinned(
        TenantRequest::ReserveCredit {
            bytes: 1 << 20,
            extra: 64 << 20,
            given_back: 0,
        },
        "09000000078080408080802000",
    );
    pinned(TenantRequest::Ticket, "0100000008");
    pinned(
        TenantRequest::Subscribe { ticket: u64::MAX },
        "0b00000009ffffffffffffffffff01",
    );
    pinned(
        TenantRequest::Relinquish { seq: 3, bytes: 128 },
        "040000000a038001",
    );
    pinned(
        TenantRequest::MemInfoAfter { given_back: 2 },
        "020000000b02",
    );
    pinned(TenantRequest::LeaseAcquireTiered, "010000000c");
}

#[test]
fn every_tenant_reply_is_pinned() {
    pinned(
        TenantReply::Reserved { in_use: 1 << 20 },
        "0400000000808040",
    );
    pinned(
        TenantReply::Denied {
            limit: 1 << 30,
            in_use: 1 << 30,
        },
        "0b0000000180808080048080808004",
    );
    pinned(
        TenantReply::MemInfo {
            limit: 1 << 30,
            in_use: 0,
        },
        "0700000002808080800400",
    );
    pinned(TenantReply::Pong, "0100000003");
    pinned(
        TenantReply::LeaseGranted {
            lease_id: 7,
            duration_ns: 20_000_000,
        },
        "06000000040780dac409",
    );
    pinned(
        TenantReply::Error {
            message: "no".into(),
        },
        "0400000005026e6f",
    );
    pinned(
        TenantReply::Granted {
            bytes: 65 << 20,
            in_use: 1 << 30,
        },
        "0a000000068080c0208080808004",
    );
    pinned(TenantReply::Ticket { ticket: 42 }, "02000000072a");
    pinned(TenantReply::Subscribed, "0100000008");
    pinned(TenantReply::Pressure { seq: 9 }, "020000000909");
    // The latency tier's: a best-effort grant bounded in flight, and a revocation.
    pinned(
        TenantReply::LeaseGrantedBounded {
            lease_id: 7,
            duration_ns: 20_000_000,
            max_inflight_ns: 1_000_000,
        },
        "090000000a0780dac409c0843d",
    );
    pinned(TenantReply::LeaseRevoked { lease_id: 7 }, "020000000b07");
    // A latency holder's grant (appended after them).
    pinned(
        TenantReply::LeaseGrantedLatency {
            lease_id: 7,
            duration_ns: 20_000_000,
        },
        "060000000c0780dac409",
    );
}
