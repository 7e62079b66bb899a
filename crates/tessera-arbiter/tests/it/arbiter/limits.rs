//! The limit against forged releases, redeclares and trailing bytes; a state file breaking the rules.

use super::wire::hello_bytes;
use super::*;

/// The arbiter closed `s`: EOF comes (whatever was in flight before it is skipped), no hang.
pub(super) fn assert_eof(mut s: UnixStream) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    let r = s.read_to_end(&mut buf);
    assert!(r.is_ok(), "connection not closed: {r:?}");
}

/// The allocation's `(limit, in_use)` as a new connection's `MemInfo` sees it.
pub(super) fn mem_info(arb: &Arbiter, token: &str) -> (u64, u64) {
    match arb.tenant(token).call(&TenantRequest::MemInfo).unwrap() {
        TenantReply::MemInfo { limit, in_use } => (limit, in_use),
        other => panic!("MemInfo answered {other:?}"),
    }
}

/// The limit holds: a new connection gets exactly the room left, not a byte more.
fn assert_limit_holds(arb: &Arbiter, token: &str, limit: u64, in_use: u64) {
    assert_eq!(mem_info(arb, token), (limit, in_use));
    let mut c = arb.tenant(token);
    assert_eq!(
        c.call(&TenantRequest::Reserve {
            bytes: limit - in_use + 1
        })
        .unwrap(),
        TenantReply::Denied { limit, in_use }
    );
    assert_eq!(
        c.call(&TenantRequest::Reserve {
            bytes: limit - in_use
        })
        .unwrap(),
        TenantReply::Reserved { in_use: limit }
    );
    assert_eq!(
        c.call(&TenantRequest::Reserve { bytes: 1 }).unwrap(),
        TenantReply::Denied {
            limit,
            in_use: limit
        }
    );
    c.send(&TenantRequest::Release {
        bytes: limit - in_use,
    })
    .unwrap();
    assert_eq!(c.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
}

#[test]
fn release_of_more_than_held_closes_the_connection_and_frees_nothing_of_others() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, GIB, 10);
    let mut honest = arb.tenant(&token);
    honest
        .call(&TenantRequest::Reserve { bytes: 300 * MIB })
        .unwrap();
    let mut liar = arb.tenant(&token);
    liar.call(&TenantRequest::Reserve { bytes: 200 * MIB })
        .unwrap();
    // 500 MiB would free 300 MiB of the honest process's bytes if the ledger believed it.
    liar.send(&TenantRequest::Release { bytes: 500 * MIB })
        .unwrap();
    assert_eof(liar.stream().try_clone().unwrap());
    // The liar's own 200 MiB go as when it exits; the honest 300 MiB stay.
    wait_until(Duration::from_secs(5), || {
        used(&mut admin, &id) == 300 * MIB
    })
    .expect("the liar's holding released on close");
    assert_limit_holds(&arb, &token, GIB, 300 * MIB);
    assert_eq!(
        honest.call(&TenantRequest::Ping).unwrap(),
        TenantReply::Pong
    );
    let log = arb.log_text();
    assert!(
        log.contains("protocol violation #1")
            && log.contains("released 500 MiB but held only 200 MiB"),
        "{log}"
    );
}

#[test]
fn redeclare_is_only_the_first_request_of_a_connection() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, GIB, 10);
    // Reserve, then "Redeclare 0" to forget it and reserve again: closed.
    let mut c = arb.tenant(&token);
    c.call(&TenantRequest::Reserve { bytes: 900 * MIB })
        .unwrap();
    c.send(&TenantRequest::Redeclare { bytes: 0 }).unwrap();
    assert_eof(c.stream().try_clone().unwrap());
    wait_until(Duration::from_secs(5), || used(&mut admin, &id) == 0).expect("released on close");
    // After any other request (even a Ping), too.
    let mut c = arb.tenant(&token);
    assert_eq!(c.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
    c.send(&TenantRequest::Redeclare { bytes: 100 * MIB })
        .unwrap();
    assert_eof(c.stream().try_clone().unwrap());
    // First is fine (a reconnecting process); a second one is not.
    let mut c = arb.tenant(&token);
    assert_eq!(
        c.call(&TenantRequest::Redeclare { bytes: 100 * MIB })
            .unwrap(),
        TenantReply::Reserved { in_use: 100 * MIB }
    );
    c.send(&TenantRequest::Redeclare { bytes: 100 * MIB })
        .unwrap();
    assert_eof(c.stream().try_clone().unwrap());
    wait_until(Duration::from_secs(5), || used(&mut admin, &id) == 0).expect("released on close");
    assert_limit_holds(&arb, &token, GIB, 0);
    assert!(
        arb.log_text().contains("protocol violation #3"),
        "{}",
        arb.log_text()
    );
}

#[test]
fn redeclare_near_u64_max_is_refused_and_the_limit_still_holds() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, GIB, 10);
    let mut first = arb.tenant(&token);
    assert_eq!(
        first
            .call(&TenantRequest::Redeclare { bytes: 512 * MIB })
            .unwrap(),
        TenantReply::Reserved { in_use: 512 * MIB }
    );
    // Each would wrap the allocation's total to a small number, or pass the limit alone.
    for bytes in [u64::MAX, u64::MAX - 512 * MIB + 1, u64::MAX - GIB, GIB + 1] {
        let mut c = arb.tenant(&token);
        c.send(&TenantRequest::Redeclare { bytes }).unwrap();
        assert_eof(c.stream().try_clone().unwrap());
        assert_eq!(used(&mut admin, &id), 512 * MIB, "after Redeclare {bytes}");
    }
    // A second connection still cannot pass the 1 GiB limit.
    assert_limit_holds(&arb, &token, GIB, 512 * MIB);
    assert_eq!(first.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
}

#[test]
fn trailing_bytes_after_a_message_close_the_connection_on_both_sockets() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, GIB, 10);
    let tenant_hello = || {
        let mut s = UnixStream::connect(&arb.socket).unwrap();
        s.write_all(&hello_bytes(
            tessera_protocol::MAGIC,
            PROTOCOL_VERSION,
            Role::Tenant {
                token: token.clone(),
            },
        ))
        .unwrap();
        let w: ServerHello = frame::read_frame(&mut s).unwrap();
        assert!(matches!(w, ServerHello::Welcome { .. }), "{w:?}");
        s
    };
    // A Reserve with one byte too many.
    let mut s = tenant_hello();
    s.write_all(&frame::encode(&TenantRequest::Reserve { bytes: 100 * MIB }).unwrap())
        .unwrap();
    let r: TenantReply = frame::read_frame(&mut s).unwrap();
    assert_eq!(r, TenantReply::Reserved { in_use: 100 * MIB });
    let mut padded = frame::encode(&TenantRequest::Reserve { bytes: 100 * MIB }).unwrap();
    padded.push(0);
    let len = (padded.len() - frame::HEADER_LEN) as u32;
    padded[..frame::HEADER_LEN].copy_from_slice(&len.to_le_bytes());
    s.write_all(&padded).unwrap();
    assert_eof(s);
    wait_until(Duration::from_secs(5), || used(&mut admin, &id) == 0).expect("released on close");
    // An admin Delete on the tenant socket used to decode as MemInfo (same variant index).
    let mut s = tenant_hello();
    s.write_all(&frame::encode(&AdminRequest::Delete { id: id.clone() }).unwrap())
        .unwrap();
    assert_eof(s);
    // And on the admin socket: a List with a trailing byte.
    let mut s = UnixStream::connect(&arb.admin_socket).unwrap();
    s.write_all(&hello_bytes(
        tessera_protocol::MAGIC,
        PROTOCOL_VERSION,
        Role::Admin,
    ))
    .unwrap();
    let w: ServerHello = frame::read_frame(&mut s).unwrap();
    assert!(matches!(w, ServerHello::Welcome { .. }), "{w:?}");
    let mut padded = frame::encode(&AdminRequest::List).unwrap();
    padded.push(7);
    let len = (padded.len() - frame::HEADER_LEN) as u32;
    padded[..frame::HEADER_LEN].copy_from_slice(&len.to_le_bytes());
    s.write_all(&padded).unwrap();
    assert_eof(s);
    assert_eq!(admin.list().unwrap().len(), 1, "nothing deleted");
    assert_limit_holds(&arb, &token, GIB, 0);
    assert!(
        arb.log_text().contains("trailing byte"),
        "{}",
        arb.log_text()
    );
}

/// Runs the arbiter on `dir` expecting it to stop by itself; kills it after 20 s.
fn run_to_exit(dir: &std::path::Path) -> (i32, String) {
    let mut child = arbiter_command(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_until(Duration::from_secs(20), || {
        child.try_wait().unwrap().is_some()
    });
    if status.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    (
        code(out.status),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_state_file_breaking_the_rules_of_create_stops_the_arbiter_with_exit_5() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (_, id0) = create(&mut admin, 0, GIB, 10);
    let (_, id1) = create(&mut admin, 0, GIB, 10);
    drop(admin);
    let (status, dir) = arb.stop_keep_dir();
    assert_eq!(code(status), 0);
    let path = dir.path().join("state/allocations.json");
    let good: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit, &str); 5] = [
        (
            "share 1000",
            |v| v["allocations"][1]["share"] = 1000.into(),
            "share",
        ),
        (
            "limit 0",
            |v| v["allocations"][1]["memory_limit"] = 0.into(),
            "memory limit",
        ),
        ("cap 0", |v| v["allocations"][1]["cap"] = 0.into(), "cap 0"),
        (
            "duplicate ids",
            |v| v["allocations"][1]["id"] = v["allocations"][0]["id"].clone(),
            "same id",
        ),
        (
            "empty token",
            |v| v["allocations"][1]["token"] = "".into(),
            "token",
        ),
    ];
    for (name, edit, why) in cases {
        let mut v = good.clone();
        edit(&mut v);
        let bytes = serde_json::to_vec_pretty(&v).unwrap();
        fs::write(&path, &bytes).unwrap();
        let (code, err) = run_to_exit(dir.path());
        assert_eq!(code, 5, "{name}: {err}");
        assert_eq!(
            fs::read(&path).unwrap(),
            bytes,
            "{name}: file left untouched"
        );
        // The file and the record are named (by its id, which the duplicate case shares with
        // the first).
        assert!(err.contains("allocations.json"), "{name}: {err}");
        let named = if name == "duplicate ids" { &id0 } else { &id1 };
        assert!(err.contains(named.as_str()), "{name}: {err}");
        assert!(err.contains(why), "{name}: {err}");
        // One message: the cause is not repeated.
        assert_eq!(err.matches("is corrupt").count(), 1, "{name}: {err}");
        assert!(!dir.path().join("tessera.sock").exists(), "{name}");
    }
    // The untouched file still starts.
    fs::write(&path, serde_json::to_vec_pretty(&good).unwrap()).unwrap();
    let arb = Arbiter::start_in(dir);
    assert_eq!(arb.admin().list().unwrap().len(), 2);
}
