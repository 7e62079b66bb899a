//! The real `tessera-arbiter` binary, driven over its sockets.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use tessera_protocol::client::{AdminClient, ClientError, TenantClient};
use tessera_protocol::frame;
use tessera_protocol::{
    AdminErrorKind, CreateAllocation, GpuSelector, Hello, Role, ServerHello, TenantReply,
    TenantRequest,
};

fn create(admin: &mut AdminClient, gpu: u32, limit: u64, share: u32) -> (String, String) {
    let (token, a) = admin
        .create(CreateAllocation {
            gpu: GpuSelector::Index(gpu),
            memory_limit: limit,
            share,
            cap: None,
            labels: BTreeMap::new(),
        })
        .unwrap();
    (token, a.id)
}

fn admin_err(
    r: Result<(String, tessera_protocol::AllocationStatus), ClientError>,
) -> AdminErrorKind {
    match r {
        Err(ClientError::Admin { kind, .. }) => kind,
        other => panic!("expected an admin error, got {other:?}"),
    }
}

fn used(admin: &mut AdminClient, id: &str) -> u64 {
    admin
        .list()
        .unwrap()
        .into_iter()
        .find(|a| a.id == id)
        .unwrap()
        .memory_used
}

#[test]
fn create_list_delete_and_validation() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let gpus = admin.gpus().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0].memory_total, 80 * GIB);
    assert!(gpus[1].uuid.starts_with("GPU-"));

    let mut labels = BTreeMap::new();
    labels.insert("pod".to_string(), "default/a".to_string());
    let (token, a) = admin
        .create(CreateAllocation {
            gpu: GpuSelector::Index(0),
            memory_limit: 4 * GIB,
            share: 30,
            cap: Some(30),
            labels: labels.clone(),
        })
        .unwrap();
    assert_eq!(token.len(), 64);
    assert!(token.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(a.id.len(), 8);
    assert_eq!(
        (a.gpu_index, a.memory_limit, a.share, a.cap),
        (0, 4 * GIB, 30, Some(30))
    );
    assert_eq!(a.labels, labels);
    let (_, b) = admin
        .create(CreateAllocation {
            gpu: GpuSelector::Uuid(gpus[1].uuid.clone()),
            memory_limit: 80 * GIB,
            share: 100,
            cap: None,
            labels: BTreeMap::new(),
        })
        .unwrap();
    assert_eq!(b.gpu_index, 1);
    let list = admin.list().unwrap();
    assert_eq!(
        list.iter().map(|x| x.id.as_str()).collect::<Vec<_>>(),
        [&a.id, &b.id]
    );
    assert_eq!((list[0].memory_used, list[0].processes), (0, 0));

    let mk = |gpu, limit, share, cap| CreateAllocation {
        gpu,
        memory_limit: limit,
        share,
        cap,
        labels: BTreeMap::new(),
    };
    use AdminErrorKind::*;
    assert_eq!(
        admin_err(admin.create(mk(GpuSelector::Index(7), GIB, 10, None))),
        InvalidArgument
    );
    assert_eq!(
        admin_err(admin.create(mk(GpuSelector::Uuid("GPU-nope".into()), GIB, 10, None))),
        InvalidArgument
    );
    assert_eq!(
        admin_err(admin.create(mk(GpuSelector::Index(0), GIB, 0, None))),
        InvalidArgument
    );
    assert_eq!(
        admin_err(admin.create(mk(GpuSelector::Index(0), GIB, 101, None))),
        InvalidArgument
    );
    assert_eq!(
        admin_err(admin.create(mk(GpuSelector::Index(0), GIB, 10, Some(0)))),
        InvalidArgument
    );
    assert_eq!(
        admin_err(admin.create(mk(GpuSelector::Index(0), 81 * GIB, 10, None))),
        InvalidArgument
    );
    // Shares: 30 taken, 71 more would pass 100.
    match admin.create(mk(GpuSelector::Index(0), GIB, 71, None)) {
        Err(ClientError::Admin {
            kind: Exhausted,
            message,
        }) => {
            assert!(message.contains("70 of 100 shares left"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // Memory: 4 GiB promised, 77 GiB more would pass 80.
    assert_eq!(
        admin_err(admin.create(mk(GpuSelector::Index(0), 77 * GIB, 10, None))),
        Exhausted
    );
    assert_eq!(
        admin_err(admin.create(mk(GpuSelector::Index(1), GIB, 1, None))),
        Exhausted
    );
    // Exactly filling the GPU is fine.
    let (_, c) = admin
        .create(mk(GpuSelector::Index(0), 76 * GIB, 70, None))
        .unwrap();

    let t = arb.tenant(&token);
    assert_eq!(t.allocation().id, a.id);
    assert_eq!(t.allocation().memory_limit, 4 * GIB);
    drop(t);

    admin.delete(&a.id).unwrap();
    match admin.delete(&a.id) {
        Err(ClientError::Admin { kind: NotFound, .. }) => {}
        other => panic!("{other:?}"),
    }
    match TenantClient::connect(&arb.socket, &token) {
        Err(ClientError::Refused(reason)) => assert!(reason.contains("unknown"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let ids: Vec<_> = admin.list().unwrap().into_iter().map(|x| x.id).collect();
    // Ordered by GPU, then creation.
    assert_eq!(ids, [c.id.clone(), b.id.clone()]);
    // The freed share can be promised again.
    admin
        .create(mk(GpuSelector::Index(0), GIB, 30, None))
        .unwrap();
}

#[test]
fn sockets_have_the_documented_modes_and_stale_files_are_replaced() {
    let dir = tempfile::tempdir().unwrap();
    // A stale socket file from a dead arbiter.
    let stale = std::os::unix::net::UnixListener::bind(dir.path().join("tessera.sock")).unwrap();
    drop(stale);
    let arb = Arbiter::start_in(dir);
    let mode = |p: &std::path::Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&arb.socket), 0o666);
    assert_eq!(mode(&arb.admin_socket), 0o600);
    assert_eq!(mode(&arb.state_dir), 0o700);
    // A second arbiter on the same sockets refuses to start (exit 4) and leaves them alone.
    let out = arbiter_command(arb.dir.path()).output().unwrap();
    assert_eq!(
        code(out.status),
        4,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("another arbiter"));
    arb.admin().list().unwrap();
}

#[test]
fn missing_nvml_exits_3_and_corrupt_state_exits_5() {
    let dir = tempfile::tempdir().unwrap();
    let out = arbiter_command(dir.path())
        .arg("--nvml-lib")
        .arg("/nonexistent/libnvidia-ml.so.1")
        .output()
        .unwrap();
    assert_eq!(code(out.status), 3);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot load NVML"), "{err}");

    fs::create_dir_all(dir.path().join("state")).unwrap();
    fs::write(dir.path().join("state/allocations.json"), b"{ torn").unwrap();
    let out = arbiter_command(dir.path()).output().unwrap();
    assert_eq!(
        code(out.status),
        5,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        fs::read(dir.path().join("state/allocations.json")).unwrap(),
        b"{ torn"
    );
    assert!(!dir.path().join("tessera.sock").exists());
}

#[test]
fn racing_reserves_from_8_connections_never_pass_the_limit() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let limit = 64 * MIB;
    let (token, id) = create(&mut admin, 0, limit, 50);
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let barrier = Arc::clone(&barrier);
            let mut c = arb.tenant(&token);
            std::thread::spawn(move || {
                barrier.wait();
                let mut held: Vec<u64> = Vec::new();
                let mut denied = 0;
                for i in 0..1000u64 {
                    let bytes = MIB * (1 + (i * 7 + t as u64) % 5);
                    match c.call(&TenantRequest::Reserve { bytes }).unwrap() {
                        TenantReply::Reserved { in_use } => {
                            assert!(in_use <= limit, "in_use {in_use} passed the limit");
                            held.push(bytes);
                        }
                        TenantReply::Denied { limit: l, in_use } => {
                            assert_eq!(l, limit);
                            assert!(in_use <= limit);
                            denied += 1;
                        }
                        other => panic!("{other:?}"),
                    }
                    // Free now and then so the race stays at the limit.
                    if i % 4 == 3
                        && let Some(b) = held.pop()
                    {
                        c.send(&TenantRequest::Release { bytes: b }).unwrap();
                    }
                }
                // A round trip after the releases: they were handled in order before it.
                match c.call(&TenantRequest::MemInfo).unwrap() {
                    TenantReply::MemInfo { limit: l, in_use } => {
                        assert_eq!(l, limit);
                        assert!(in_use <= limit);
                    }
                    other => panic!("{other:?}"),
                }
                (c, held.iter().sum::<u64>(), denied)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let total: u64 = results.iter().map(|r| r.1).sum();
    let denied: u32 = results.iter().map(|r| r.2).sum();
    assert!(denied > 0, "the test must actually reach the limit");
    assert!(total <= limit);
    assert_eq!(
        used(&mut admin, &id),
        total,
        "ledger equals what the connections hold"
    );
    let status = admin.list().unwrap();
    assert_eq!(
        status[0].processes, 1,
        "all connections come from this test process"
    );
    drop(results);
    let waited = wait_until(Duration::from_secs(5), || used(&mut admin, &id) == 0);
    assert!(waited.is_some(), "ledger not zero after disconnects");
}

#[test]
fn killed_process_frees_its_memory_within_100ms() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, GIB, 10);
    let mut c = arb.tenant(&token);
    assert!(matches!(
        c.call(&TenantRequest::Reserve { bytes: 300 * MIB }).unwrap(),
        TenantReply::Reserved { in_use } if in_use == 300 * MIB
    ));
    // Hand the connection to a child process (as fd 3), close ours, then SIGKILL the child:
    // the arbiter sees the socket close exactly as when a tenant dies.
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let fd = c.stream().as_raw_fd();
    let mut cmd = std::process::Command::new("sleep");
    cmd.arg("60");
    // SAFETY: dup2 and fcntl are async-signal-safe; the child gets the socket as fd 3 without
    // close-on-exec (dup2 clears it on the copy; when the socket already is fd 3, fcntl does).
    unsafe {
        cmd.pre_exec(move || {
            let r = if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, 3)
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    drop(c);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        used(&mut admin, &id),
        300 * MIB,
        "the child still holds the connection"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let took = wait_until(Duration::from_secs(2), || used(&mut admin, &id) == 0)
        .expect("memory of the killed process was never released");
    assert!(took < Duration::from_millis(100), "released after {took:?}");
}

fn expect_closed(mut s: UnixStream) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    // Either straight EOF, or a Refused frame and then EOF; never a hang.
    let r = s.read_to_end(&mut buf);
    assert!(r.is_ok(), "connection not closed: {r:?}");
    if !buf.is_empty() {
        let hello: ServerHello = frame::read_frame(&mut &buf[..]).unwrap();
        assert!(matches!(hello, ServerHello::Refused { .. }), "{hello:?}");
    }
}

fn hello_bytes(magic: u32, version: u32, role: Role) -> Vec<u8> {
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
    let mut truncated = hello_bytes(tessera_protocol::MAGIC, 1, tenant.clone());
    truncated.truncate(truncated.len() - 3);
    let mut bad_request = hello_bytes(tessera_protocol::MAGIC, 1, tenant.clone());
    bad_request.extend([3, 0, 0, 0, 0xff, 0xff, 0xff]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
        ("oversized", oversized),
        ("truncated", truncated),
        ("wrong magic", hello_bytes(0x1234_5678, 1, tenant.clone())),
        (
            "wrong version",
            hello_bytes(tessera_protocol::MAGIC, 99, tenant.clone()),
        ),
        (
            "bad token",
            hello_bytes(
                tessera_protocol::MAGIC,
                1,
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
    s.write_all(&hello_bytes(tessera_protocol::MAGIC, 1, Role::Admin))
        .unwrap();
    let r: ServerHello = frame::read_frame(&mut s).unwrap();
    assert!(
        matches!(r, ServerHello::Refused { .. }),
        "admin role on the tenant socket"
    );
    match TenantClient::connect(&arb.admin_socket, &token) {
        Err(ClientError::Refused(_)) => {}
        other => panic!("tenant role on the admin socket: {other:?}"),
    }
    let log = arb.log_text();
    assert!(log.contains("not a Tessera client"), "{log}");
    assert!(log.contains("exceeds"), "{log}");
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

/// A tenant connection plus its pressure channel, subscribed with a fresh ticket.
fn with_channel(arb: &Arbiter, token: &str) -> (TenantClient, TenantClient) {
    let mut mem = arb.tenant(token);
    let TenantReply::Ticket { ticket } = mem.call(&TenantRequest::Ticket).unwrap() else {
        panic!("no ticket");
    };
    let mut ch = arb.tenant(token);
    assert_eq!(ch.call(&TenantRequest::Subscribe { ticket }).unwrap(), TenantReply::Subscribed);
    (mem, ch)
}

#[test]
fn pressure_takes_credit_back_before_a_refusal_and_forged_channel_frames_close_only_their_connection() {
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, 1000 * MIB, 50);
    let (other_token, other_id) = create(&mut admin, 0, 1000 * MIB, 10);
    let (mut a, mut a_ch) = with_channel(&arb, &token);
    // 600 MiB plus credit: half of the 400 MiB left at most, so 100 MiB as asked.
    assert_eq!(
        a.call(&TenantRequest::ReserveCredit { bytes: 600 * MIB, extra: 100 * MIB, given_back: 0 }).unwrap(),
        TenantReply::Granted { bytes: 700 * MIB, in_use: 700 * MIB }
    );
    // B needs 400 MiB: only with A's unused 100 MiB back. A's channel answers the pressure.
    let answer = std::thread::spawn(move || {
        let TenantReply::Pressure { seq } = frame::read_frame(&mut a_ch.stream()).unwrap() else {
            panic!("expected a pressure");
        };
        a_ch.send(&TenantRequest::Relinquish { seq, bytes: 100 * MIB }).unwrap();
        a_ch
    });
    let mut b = arb.tenant(&token);
    assert_eq!(
        b.call(&TenantRequest::Reserve { bytes: 400 * MIB }).unwrap(),
        TenantReply::Reserved { in_use: 1000 * MIB }
    );
    let mut a_ch = answer.join().unwrap();
    assert_eq!(used(&mut admin, &id), 1000 * MIB);

    // A process that really holds its bytes cannot be pressed out of them: refused after a
    // bounded wait (A's channel answers with nothing to give).
    let answer = std::thread::spawn(move || {
        let TenantReply::Pressure { seq } = frame::read_frame(&mut a_ch.stream()).unwrap() else {
            panic!("expected a pressure");
        };
        a_ch.send(&TenantRequest::Relinquish { seq, bytes: 0 }).unwrap();
        a_ch
    });
    let t = std::time::Instant::now();
    assert_eq!(
        b.call(&TenantRequest::Reserve { bytes: MIB }).unwrap(),
        TenantReply::Denied { limit: 1000 * MIB, in_use: 1000 * MIB }
    );
    assert!(t.elapsed() < Duration::from_secs(1), "refusal took {:?}", t.elapsed());
    let mut a_ch = answer.join().unwrap();

    // Forgeries. A ticket that was never issued:
    let mut c = arb.tenant(&token);
    c.send(&TenantRequest::Subscribe { ticket: 12345 }).unwrap();
    expect_closed(c.stream().try_clone().unwrap());
    // A ticket of another allocation's connection:
    let TenantReply::Ticket { ticket } = a.call(&TenantRequest::Ticket).unwrap() else { panic!() };
    let mut stranger = arb.tenant(&other_token);
    stranger.send(&TenantRequest::Subscribe { ticket }).unwrap();
    expect_closed(stranger.stream().try_clone().unwrap());
    // Relinquish on a connection that is no channel:
    let mut d = arb.tenant(&token);
    d.send(&TenantRequest::Relinquish { seq: 0, bytes: 400 * MIB }).unwrap();
    expect_closed(d.stream().try_clone().unwrap());
    // A channel that claims to give back more than its process holds frees only that
    // process's bytes, never B's.
    a_ch.send(&TenantRequest::Relinquish { seq: 0, bytes: 100 * GIB }).unwrap();
    wait_until(Duration::from_secs(5), || used(&mut admin, &id) == 400 * MIB).expect("only A's bytes freed");
    // Everyone else was served throughout.
    assert_eq!(b.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
    assert_eq!(used(&mut admin, &other_id), 0);
    assert_eq!(
        a.call(&TenantRequest::ReserveCredit { bytes: 600 * MIB, extra: 0, given_back: 2 }).unwrap(),
        TenantReply::Granted { bytes: 600 * MIB, in_use: 1000 * MIB }
    );
}
