//! Versions, bad input, labels, deleted allocations and restarts.

use super::*;
use tessera_protocol::AdminReply;

pub(super) fn expect_closed(mut s: UnixStream) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    // Either straight EOF, or a Refused frame and then EOF; never a hang.
    let r = s.read_to_end(&mut buf);
    assert!(r.is_ok(), "connection not closed: {r:?}");
    if !buf.is_empty() {
        let hello: ServerHello = frame::read_frame(&mut &buf[..]).unwrap();
        assert!(hello.refused().is_some(), "{hello:?}");
    }
}

/// A client of another protocol version is told why in the one form every version decodes
/// (an old interposer or CLI can then log the reason); a client of this version gets the kind.
#[test]
fn a_client_of_another_version_reads_why_it_was_refused() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, _) = create(&mut admin, 0, GIB, 10);
    for socket in [&arb.socket, &arb.admin_socket] {
        for role in [
            Role::Admin,
            Role::Tenant {
                token: token.clone(),
            },
        ] {
            let mut s = UnixStream::connect(socket).unwrap();
            let other = PROTOCOL_VERSION + 1;
            s.write_all(&hello_bytes(tessera_protocol::MAGIC, other, role.clone()))
                .unwrap();
            let r: ServerHello = frame::read_frame(&mut s).unwrap();
            match &r {
                ServerHello::Refused { reason } => {
                    assert!(reason.contains(&format!("version {other}")), "{reason}");
                }
                other => panic!("{socket:?} {role:?}: {other:?}"),
            }
            assert_eq!(r.refused().map(|(k, _)| k), Some(RefusalKind::Version));
        }
    }
    let mut s = UnixStream::connect(&arb.socket).unwrap();
    let bad = Role::Tenant { token: "00".into() };
    s.write_all(&hello_bytes(tessera_protocol::MAGIC, PROTOCOL_VERSION, bad))
        .unwrap();
    let r: ServerHello = frame::read_frame(&mut s).unwrap();
    assert_eq!(
        r.refused().map(|(k, _)| k),
        Some(RefusalKind::UnknownToken),
        "{r:?}"
    );
}

/// A pipelined admin connection (`tessera run`'s: the hello and the requests in one write)
/// gets its welcome and then its replies in order; requests the arbiter reads before its
/// welcome are not lost. A refused one (the tenant socket takes no admin) reads the refusal
/// as its first request's error, and nothing it sent was done.
#[test]
fn a_pipelined_admin_connection_is_answered_in_order_and_a_refusal_does_nothing() {
    let arb = Arbiter::start();
    let (_, id) = create(&mut arb.admin(), 0, GIB, 10);
    let mut admin = AdminClient::connect_pipelined(&arb.admin_socket).unwrap();
    admin
        .send(&AdminRequest::LastKill { id: id.clone() })
        .unwrap();
    admin
        .send(&AdminRequest::Delete { id: id.clone() })
        .unwrap();
    admin.send(&AdminRequest::List).unwrap();
    assert!(matches!(admin.recv().unwrap(), AdminReply::LastKill(None)));
    assert!(matches!(admin.recv().unwrap(), AdminReply::Deleted));
    assert!(matches!(admin.recv().unwrap(), AdminReply::Allocations(a) if a.is_empty()));
    // The same connection goes on as any other.
    let (_, id) = create(&mut admin, 0, GIB, 10);
    let mut wrong = AdminClient::connect_pipelined(&arb.socket).unwrap();
    wrong
        .send(&AdminRequest::Delete { id: id.clone() })
        .unwrap();
    match wrong.recv() {
        Err(ClientError::Refused { kind, .. }) => assert_eq!(kind, RefusalKind::WrongSocket),
        other => panic!("{other:?}"),
    }
    let left = arb.admin().list().unwrap();
    assert_eq!(left.iter().map(|a| &a.id).collect::<Vec<_>>(), [&id]);
}

pub(super) fn hello_bytes(magic: u32, version: u32, role: Role) -> Vec<u8> {
    frame::encode(&Hello {
        magic,
        version,
        role,
    })
    .unwrap()
}

#[test]
fn bad_input_on_either_socket_closes_only_that_connection() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, _) = create(&mut admin, 0, GIB, 10);
    let mut good = arb.tenant(&token);
    // A client that connects and says nothing must not block anyone.
    let _silent_t = UnixStream::connect(&arb.socket).unwrap();
    let _silent_a = UnixStream::connect(&arb.admin_socket).unwrap();
    let tenant = Role::Tenant {
        token: token.clone(),
    };
    let mut oversized = (tessera_protocol::MAX_FRAME_LEN as u32 + 1)
        .to_le_bytes()
        .to_vec();
    oversized.extend([0u8; 64]);
    let mut truncated = hello_bytes(tessera_protocol::MAGIC, PROTOCOL_VERSION, tenant.clone());
    truncated.truncate(truncated.len() - 3);
    let mut bad_request = hello_bytes(tessera_protocol::MAGIC, PROTOCOL_VERSION, tenant.clone());
    bad_request.extend([3, 0, 0, 0, 0xff, 0xff, 0xff]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
        ("oversized", oversized),
        ("truncated", truncated),
        (
            "wrong magic",
            hello_bytes(0x1234_5678, PROTOCOL_VERSION, tenant.clone()),
        ),
        (
            "wrong version",
            hello_bytes(tessera_protocol::MAGIC, 99, tenant.clone()),
        ),
        (
            "bad token",
            hello_bytes(
                tessera_protocol::MAGIC,
                PROTOCOL_VERSION,
                Role::Tenant { token: "00".into() },
            ),
        ),
        ("garbage after hello", bad_request),
    ];
    for socket in [&arb.socket, &arb.admin_socket] {
        for (name, bytes) in &cases {
            let mut s = UnixStream::connect(socket).unwrap();
            s.write_all(bytes).unwrap();
            if *name == "truncated" {
                s.shutdown(std::net::Shutdown::Write).unwrap();
            }
            if *name == "garbage after hello" && socket == &arb.socket {
                // The hello is answered, then the garbage closes the connection.
                let w: ServerHello = frame::read_frame(&mut s).unwrap();
                assert!(matches!(w, ServerHello::Welcome { .. }));
            }
            expect_closed(s);
            assert_eq!(
                good.call(&TenantRequest::Ping).unwrap(),
                TenantReply::Pong,
                "{name}"
            );
            assert_eq!(admin.list().unwrap().len(), 1, "{name}");
        }
    }
    // Roles on the wrong socket are refused.
    let mut s = UnixStream::connect(&arb.socket).unwrap();
    s.write_all(&hello_bytes(
        tessera_protocol::MAGIC,
        PROTOCOL_VERSION,
        Role::Admin,
    ))
    .unwrap();
    let r: ServerHello = frame::read_frame(&mut s).unwrap();
    assert!(
        matches!(
            r,
            ServerHello::Rejected {
                kind: RefusalKind::WrongSocket,
                ..
            }
        ),
        "admin role on the tenant socket: {r:?}"
    );
    match TenantClient::connect(&arb.admin_socket, &token) {
        Err(ClientError::Refused {
            kind: RefusalKind::WrongSocket,
            ..
        }) => {}
        other => panic!("tenant role on the admin socket: {other:?}"),
    }
    let log = arb.log_text();
    assert!(log.contains("not a Tessera client"), "{log}");
    assert!(log.contains("exceeds"), "{log}");
}

#[test]
fn labels_merge_persist_across_a_restart_and_stay_bounded() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let mut req = tessera_testkit::allocation(0, GIB, 10, None);
    req.labels = BTreeMap::from([("tessera.dev/units".into(), "0-9".into())]);
    let (_, a) = admin.create(req).unwrap();
    let pod = BTreeMap::from([
        ("namespace".to_owned(), "ml".to_owned()),
        ("pod".to_owned(), "trainer-0".to_owned()),
        ("container".to_owned(), "main".to_owned()),
    ]);
    let updated = admin.update_labels(&a.id, pod).unwrap();
    assert_eq!(updated.labels.len(), 4, "{:?}", updated.labels);
    assert_eq!(updated.labels["pod"], "trainer-0");
    assert_eq!(updated.labels["tessera.dev/units"], "0-9");
    // An empty value removes the key; the others stay.
    let updated = admin
        .update_labels(&a.id, BTreeMap::from([("container".into(), String::new())]))
        .unwrap();
    assert!(!updated.labels.contains_key("container"));
    assert_eq!(admin.list().unwrap()[0].labels, updated.labels);

    // Bounds: too many labels, a huge value, an empty key, an unknown id. Nothing changes.
    let many: BTreeMap<_, _> = (0..40).map(|i| (format!("k{i}"), "v".to_owned())).collect();
    let huge = BTreeMap::from([("pod".to_owned(), "x".repeat(5000))]);
    let empty_key = BTreeMap::from([(String::new(), "v".to_owned())]);
    for bad in [many, huge, empty_key] {
        match admin.update_labels(&a.id, bad) {
            Err(ClientError::Admin { kind, .. }) => {
                assert_eq!(kind, AdminErrorKind::InvalidArgument)
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }
    match admin.update_labels("deadbeef", BTreeMap::new()) {
        Err(ClientError::Admin { kind, .. }) => assert_eq!(kind, AdminErrorKind::NotFound),
        other => panic!("expected NotFound, got {other:?}"),
    }
    assert_eq!(admin.list().unwrap()[0].labels, updated.labels);

    // Persisted: a restarted arbiter lists the same labels.
    let (_, dir) = arb.stop_keep_dir();
    let arb = Arbiter::start_in(dir);
    assert_eq!(arb.admin().list().unwrap()[0].labels, updated.labels);
}

#[test]
fn deleted_allocation_denies_reserves_but_serves_releases() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, GIB, 10);
    let mut c = arb.tenant(&token);
    c.call(&TenantRequest::Reserve { bytes: 100 * MIB })
        .unwrap();
    admin.delete(&id).unwrap();
    assert_eq!(
        c.call(&TenantRequest::Reserve { bytes: MIB }).unwrap(),
        TenantReply::Denied {
            limit: GIB,
            in_use: 100 * MIB
        }
    );
    c.send(&TenantRequest::Release { bytes: 60 * MIB }).unwrap();
    assert_eq!(
        c.call(&TenantRequest::MemInfo).unwrap(),
        TenantReply::MemInfo {
            limit: GIB,
            in_use: 40 * MIB
        }
    );
    assert!(admin.list().unwrap().is_empty());
    // The share and memory are free for a new allocation at once.
    create(&mut admin, 0, 80 * GIB, 100);
}

#[test]
fn restart_keeps_allocations_and_tenants_redeclare() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (t1, id1) = create(&mut admin, 0, GIB, 40);
    let (t2, id2) = create(&mut admin, 1, 2 * GIB, 60);
    let mut c1 = arb.tenant(&t1);
    c1.call(&TenantRequest::Reserve { bytes: 700 * MIB })
        .unwrap();
    let before = admin.list().unwrap();
    drop(admin);
    let (status, dir) = arb.stop_keep_dir();
    assert_eq!(code(status), 0);
    assert!(
        !dir.path().join("tessera.sock").exists(),
        "sockets removed at shutdown"
    );
    // The server stopped the backstop's thread before exiting.
    let log: String = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    assert!(log.contains("backstop: stopped"), "{log}");
    assert!(!dir.path().join("admin.sock").exists());
    let state = dir.path().join("state/allocations.json");
    assert_eq!(
        fs::metadata(&state).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert!(
        fs::symlink_metadata(dir.path())
            .unwrap()
            .file_type()
            .is_dir()
    );
    // The old connection is dead.
    assert!(c1.call(&TenantRequest::Ping).is_err());

    let arb = Arbiter::start_in(dir);
    let mut admin = arb.admin();
    let after = admin.list().unwrap();
    assert_eq!(after.len(), 2);
    for (a, b) in before.iter().zip(&after) {
        assert_eq!(
            (&a.id, a.memory_limit, a.share, &a.labels),
            (&b.id, b.memory_limit, b.share, &b.labels)
        );
        assert_eq!(b.memory_used, 0);
    }
    // Tenants reconnect with their tokens and declare what they hold.
    let mut c1 = arb.tenant(&t1);
    let mut c1b = arb.tenant(&t1);
    let mut c2 = arb.tenant(&t2);
    assert_eq!(
        c1.call(&TenantRequest::Redeclare { bytes: 700 * MIB })
            .unwrap(),
        TenantReply::Reserved { in_use: 700 * MIB }
    );
    // Past the limit is accepted (the memory exists), then Reserves are refused until below.
    assert_eq!(
        c1b.call(&TenantRequest::Redeclare { bytes: 500 * MIB })
            .unwrap(),
        TenantReply::Reserved { in_use: 1200 * MIB }
    );
    c2.call(&TenantRequest::Redeclare { bytes: 5 * MIB })
        .unwrap();
    assert_eq!(used(&mut admin, &id1), 1200 * MIB);
    assert_eq!(used(&mut admin, &id2), 5 * MIB);
    assert!(matches!(
        c1.call(&TenantRequest::Reserve { bytes: 1 }).unwrap(),
        TenantReply::Denied { .. }
    ));
    c1b.send(&TenantRequest::Release { bytes: 500 * MIB })
        .unwrap();
    // One-way frames are ordered only within their own connection: sync on c1b first.
    assert_eq!(c1b.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
    assert!(matches!(
        c1.call(&TenantRequest::Reserve { bytes: 324 * MIB }).unwrap(),
        TenantReply::Reserved { in_use } if in_use == GIB
    ));
}
