//! The real `tessera-arbiter` binary, driven over its sockets.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use crate::common::*;
use tessera_protocol::client::{AdminClient, ClientError, TenantClient};
use tessera_protocol::frame;
use tessera_protocol::{
    AdminErrorKind, AdminRequest, CreateAllocation, GpuSelector, Hello, PROTOCOL_VERSION,
    RefusalKind, Role, ServerHello, TenantReply, TenantRequest,
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
        Err(ClientError::Refused {
            kind: RefusalKind::UnknownToken,
            reason,
        }) => assert!(reason.contains("unknown"), "{reason}"),
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
    // A second arbiter on the same sockets (with a state directory of its own) refuses to
    // start (exit 4) and leaves them alone.
    let mut second = spec(arb.dir.path());
    second.state_dir = arb.dir.path().join("state-2");
    let out = second.command().output().unwrap();
    assert_eq!(
        code(out.status),
        4,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("another arbiter"));
    arb.admin().list().unwrap();
}

/// Issue 20: two arbiters on one state directory would each promise the same cards.
#[test]
fn a_second_arbiter_on_the_same_state_dir_exits_6_and_an_unwritable_one_exits_5() {
    let arb = Arbiter::start();
    let (token, id) = create(&mut arb.admin(), 0, GIB, 50);
    // Its own sockets, the first one's state directory.
    let mut second = spec(arb.dir.path());
    second.socket = arb.dir.path().join("second.sock");
    second.admin_socket = arb.dir.path().join("second-admin.sock");
    let out = second.command().output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(code(out.status), 6, "{err}");
    assert!(
        err.contains(&arb.state_dir.display().to_string())
            && err.contains(&format!("pid {}", arb.pid())),
        "names the folder and its holder: {err}"
    );
    assert!(!second.socket.exists() && !second.admin_socket.exists());
    // The first one serves on, its allocation intact.
    assert_eq!(arb.admin().list().unwrap()[0].id, id);
    arb.tenant(&token);

    // An unwritable state directory stops the start (procfs refuses new files even to root),
    // before any socket is bound.
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec(dir.path());
    spec.state_dir = "/proc/self".into();
    let out = spec.command().output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(code(out.status), 5, "{err}");
    assert!(err.contains("state directory /proc/self"), "{err}");
    assert!(!spec.socket.exists());
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
fn logs_are_json_lines_on_request_and_a_bad_rust_log_exits_2() {
    let arb = Arbiter::start_with_args(&["--log-format", "json"]);
    let mut admin = arb.admin();
    create(&mut admin, 0, GIB, 10);
    let log = arb.log_text();
    let mut messages = Vec::new();
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: not JSON: {line}"));
        assert!(
            v["level"].is_string() && v["timestamp"].is_string(),
            "{line}"
        );
        messages.push(
            v["fields"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    assert!(
        messages.iter().any(|m| m.starts_with("created allocation")),
        "{messages:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let out = arbiter_command(dir.path())
        .env("RUST_LOG", "tessera_arbiter=loud")
        .output()
        .unwrap();
    assert_eq!(code(out.status), 2);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("RUST_LOG"), "{err}");
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
fn killed_process_frees_its_memory() {
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
    let socket = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
    let mut child = cmd.spawn().unwrap();
    // The child holds the same socket (the kernel says so), so closing our copy closes
    // nothing the arbiter can see: no wait for an event that cannot come.
    let child_fd = format!("/proc/{}/fd/3", child.id());
    wait_until(Duration::from_secs(10), || {
        std::fs::read_link(&child_fd).is_ok_and(|l| l == socket)
    })
    .expect("the child never held the connection");
    drop(c);
    assert_eq!(
        used(&mut admin, &id),
        300 * MIB,
        "the child still holds the connection"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    // How fast is a figure (`cargo test -p tessera-interpose --test memory sigkill`), not a test.
    let took = wait_until(Duration::from_secs(10), || used(&mut admin, &id) == 0)
        .expect("memory of the killed process was never released");
    println!("released {took:?} after the kill");
}

fn expect_closed(mut s: UnixStream) {
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

/// A tenant connection plus its pressure channel, subscribed with a fresh ticket.
fn with_channel(arb: &Arbiter, token: &str) -> (TenantClient, TenantClient) {
    let mut mem = arb.tenant(token);
    let TenantReply::Ticket { ticket } = mem.call(&TenantRequest::Ticket).unwrap() else {
        panic!("no ticket");
    };
    let mut ch = arb.tenant(token);
    assert_eq!(
        ch.call(&TenantRequest::Subscribe { ticket }).unwrap(),
        TenantReply::Subscribed
    );
    (mem, ch)
}

/// On `ch`'s own thread: reads one `Pressure`, waits `after`, answers it giving back `bytes`;
/// the join returns the channel.
fn answer_pressure(
    mut ch: TenantClient,
    after: Duration,
    bytes: u64,
) -> std::thread::JoinHandle<TenantClient> {
    std::thread::spawn(move || {
        let TenantReply::Pressure { seq } = frame::read_frame(&mut ch.stream()).unwrap() else {
            panic!("expected a pressure");
        };
        std::thread::sleep(after);
        ch.send(&TenantRequest::Relinquish { seq, bytes }).unwrap();
        ch
    })
}

/// On `ch`'s own thread: after `after`, gives `bytes` back unasked (a watcher's give-back
/// that the arbiter reads late); the join returns the channel.
fn give_back_later(
    mut ch: TenantClient,
    after: Duration,
    bytes: u64,
) -> std::thread::JoinHandle<TenantClient> {
    std::thread::spawn(move || {
        std::thread::sleep(after);
        ch.send(&TenantRequest::Relinquish { seq: 0, bytes })
            .unwrap();
        ch
    })
}

#[test]
fn pressure_takes_credit_back_before_a_refusal_and_forged_channel_frames_close_only_their_connection()
 {
    // A generous wait for the pressed process to answer (50 ms by default): the answering
    // thread below may be scheduled late on a loaded machine, and the test is about what
    // happens with the answer, not how fast it comes.
    let arb = Arbiter::start_with_args(&["--memory-wait-ms", "2000"]);
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, 1000 * MIB, 50);
    let (other_token, other_id) = create(&mut admin, 0, 1000 * MIB, 10);
    let (mut a, a_ch) = with_channel(&arb, &token);
    // 600 MiB plus credit: half of the 400 MiB left at most, so 100 MiB as asked.
    assert_eq!(
        a.call(&TenantRequest::ReserveCredit {
            bytes: 600 * MIB,
            extra: 100 * MIB,
            given_back: 0
        })
        .unwrap(),
        TenantReply::Granted {
            bytes: 700 * MIB,
            in_use: 700 * MIB
        }
    );
    // B needs 400 MiB: only with A's unused 100 MiB back. A's channel answers the pressure.
    let answer = answer_pressure(a_ch, Duration::ZERO, 100 * MIB);
    let mut b = arb.tenant(&token);
    assert_eq!(
        b.call(&TenantRequest::Reserve { bytes: 400 * MIB })
            .unwrap(),
        TenantReply::Reserved { in_use: 1000 * MIB }
    );
    let a_ch = answer.join().unwrap();
    assert_eq!(used(&mut admin, &id), 1000 * MIB);

    // A process that really holds its bytes cannot be pressed out of them: refused after a
    // bounded wait (A's channel answers with nothing to give). A was pressed just now: it is
    // pressed again once it may keep credit again (before that it has nothing to give).
    std::thread::sleep(tessera_arbiter::pressure::STILL_PRESSED);
    let answer = answer_pressure(a_ch, Duration::ZERO, 0);
    let t = std::time::Instant::now();
    assert_eq!(
        b.call(&TenantRequest::Reserve { bytes: MIB }).unwrap(),
        TenantReply::Denied {
            limit: 1000 * MIB,
            in_use: 1000 * MIB
        }
    );
    // Refused once the wait is over (the pressed process could still free memory until
    // then), not held for ever.
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "refusal took {:?}",
        t.elapsed()
    );
    let mut a_ch = answer.join().unwrap();

    // Forgeries. A ticket that was never issued:
    let mut c = arb.tenant(&token);
    c.send(&TenantRequest::Subscribe { ticket: 12345 }).unwrap();
    expect_closed(c.stream().try_clone().unwrap());
    // A ticket of another allocation's connection:
    let TenantReply::Ticket { ticket } = a.call(&TenantRequest::Ticket).unwrap() else {
        panic!()
    };
    let mut stranger = arb.tenant(&other_token);
    stranger.send(&TenantRequest::Subscribe { ticket }).unwrap();
    expect_closed(stranger.stream().try_clone().unwrap());
    // Relinquish on a connection that is no channel:
    let mut d = arb.tenant(&token);
    d.send(&TenantRequest::Relinquish {
        seq: 0,
        bytes: 400 * MIB,
    })
    .unwrap();
    expect_closed(d.stream().try_clone().unwrap());
    // A channel that claims to give back more than its process holds is a liar: the channel
    // is closed and nothing is freed (never B's bytes, and not A's either).
    a_ch.send(&TenantRequest::Relinquish {
        seq: 0,
        bytes: 100 * GIB,
    })
    .unwrap();
    assert_eof(a_ch.stream().try_clone().unwrap());
    assert_eq!(used(&mut admin, &id), 1000 * MIB);
    // Everyone else was served throughout.
    assert_eq!(b.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
    assert_eq!(used(&mut admin, &other_id), 0);
    a.send(&TenantRequest::Release { bytes: 600 * MIB })
        .unwrap();
    assert_eq!(
        a.call(&TenantRequest::ReserveCredit {
            bytes: 600 * MIB,
            extra: 0,
            given_back: 2
        })
        .unwrap(),
        TenantReply::Granted {
            bytes: 600 * MIB,
            in_use: 1000 * MIB
        }
    );
    assert!(
        arb.log_text().contains("protocol violation #1"),
        "{}",
        arb.log_text()
    );
}

#[test]
fn a_reservation_waits_for_its_own_give_back_however_late_the_arbiter_reads_it() {
    // Seen beside a CPU hog: a process gave bytes back on its pressure channel and asked for
    // memory again on its memory connection; the arbiter read the channel's frame after the
    // memory wait (50 ms by default, kept here) and refused the process what it had just
    // given back. Here the frame is sent 300 ms after the reservation says it was.
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, 1000 * MIB, 50);
    let (mut a, a_ch) = with_channel(&arb, &token);
    assert_eq!(
        a.call(&TenantRequest::ReserveCredit {
            bytes: 1000 * MIB,
            extra: 0,
            given_back: 0
        })
        .unwrap(),
        TenantReply::Granted {
            bytes: 1000 * MIB,
            in_use: 1000 * MIB
        }
    );
    let late = give_back_later(a_ch, Duration::from_millis(300), 400 * MIB);
    assert_eq!(
        a.call(&TenantRequest::ReserveCredit {
            bytes: 400 * MIB,
            extra: 0,
            given_back: 1
        })
        .unwrap(),
        TenantReply::Granted {
            bytes: 400 * MIB,
            in_use: 1000 * MIB
        },
        "refused what it had given back"
    );
    let _a_ch = late.join().unwrap();
    assert_eq!(used(&mut admin, &id), 1000 * MIB);
}

#[test]
fn a_sibling_answering_the_pressure_late_still_gives_its_credit_back_and_a_silent_one_costs_one_long_wait()
 {
    // Seen beside a CPU hog: a process was refused 300 MiB because its sibling's answer to the
    // pressure (its 32 MiB of unused credit) came after the 50 ms memory wait. The memory wait
    // is the default here; the answer comes 300 ms late.
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, 1000 * MIB, 50);
    let (mut a, a_ch) = with_channel(&arb, &token);
    assert_eq!(
        a.call(&TenantRequest::ReserveCredit {
            bytes: 600 * MIB,
            extra: 100 * MIB,
            given_back: 0
        })
        .unwrap(),
        TenantReply::Granted {
            bytes: 700 * MIB,
            in_use: 700 * MIB
        }
    );
    let answer = answer_pressure(a_ch, Duration::from_millis(300), 100 * MIB);
    let mut b = arb.tenant(&token);
    assert_eq!(
        b.call(&TenantRequest::Reserve { bytes: 400 * MIB })
            .unwrap(),
        TenantReply::Reserved { in_use: 1000 * MIB },
        "refused the credit a sibling was giving back"
    );
    let _a_ch = answer.join().unwrap();
    // A takes credit again and its process stops (its channel never answers): B is refused,
    // the first time after the longer wait for an answer, then after the memory wait alone.
    b.send(&TenantRequest::Release { bytes: 400 * MIB })
        .unwrap();
    assert_eq!(b.call(&TenantRequest::Ping).unwrap(), TenantReply::Pong);
    assert_eq!(
        a.call(&TenantRequest::ReserveCredit {
            bytes: 300 * MIB,
            extra: 100 * MIB,
            given_back: 1
        })
        .unwrap(),
        TenantReply::Granted {
            bytes: 350 * MIB,
            in_use: 950 * MIB
        }
    );
    for round in ["first", "second"] {
        let t = std::time::Instant::now();
        assert_eq!(
            b.call(&TenantRequest::Reserve { bytes: 100 * MIB })
                .unwrap(),
            TenantReply::Denied {
                limit: 1000 * MIB,
                in_use: 950 * MIB
            },
            "{round} refusal"
        );
        eprintln!(
            "{round} refusal beside a silent sibling after {:?}",
            t.elapsed()
        );
    }
    assert_eq!(used(&mut admin, &id), 950 * MIB);
}

#[test]
fn mem_info_counts_what_the_process_gave_back_however_late_the_arbiter_reads_it() {
    // Seen beside a CPU hog: a process freed 600 MiB, its watcher gave 568 MiB of the credit
    // back on the pressure channel, and its cuMemGetInfo, asked on the memory connection, was
    // answered before the arbiter read the channel: 568 MiB short of what was free. Here the
    // frame is sent 300 ms after the query says it was.
    let arb = Arbiter::start();
    let mut admin = arb.admin();
    let (token, id) = create(&mut admin, 0, 1000 * MIB, 50);
    let (mut a, a_ch) = with_channel(&arb, &token);
    assert!(matches!(
        a.call(&TenantRequest::ReserveCredit {
            bytes: 700 * MIB,
            extra: 0,
            given_back: 0
        })
        .unwrap(),
        TenantReply::Granted { .. }
    ));
    let late = give_back_later(a_ch, Duration::from_millis(300), 400 * MIB);
    assert_eq!(
        a.call(&TenantRequest::MemInfoAfter { given_back: 1 })
            .unwrap(),
        TenantReply::MemInfo {
            limit: 1000 * MIB,
            in_use: 300 * MIB
        },
        "the bytes given back are not in use"
    );
    let _a_ch = late.join().unwrap();
    // A process that claims a give-back it never sent delays only its own answer (a bounded
    // wait), and is answered what the ledger holds.
    let (mut b, _b_ch) = with_channel(&arb, &token);
    assert_eq!(
        b.call(&TenantRequest::MemInfoAfter { given_back: 9 })
            .unwrap(),
        TenantReply::MemInfo {
            limit: 1000 * MIB,
            in_use: 300 * MIB
        }
    );
    // The query of a process that gave nothing back is not held up by another's claim.
    assert_eq!(mem_info(&arb, &token), (1000 * MIB, 300 * MIB));
    assert_eq!(used(&mut admin, &id), 300 * MIB);
}

/// The arbiter closed `s`: EOF comes (whatever was in flight before it is skipped), no hang.
fn assert_eof(mut s: UnixStream) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    let r = s.read_to_end(&mut buf);
    assert!(r.is_ok(), "connection not closed: {r:?}");
}

/// The allocation's `(limit, in_use)` as a new connection's `MemInfo` sees it.
fn mem_info(arb: &Arbiter, token: &str) -> (u64, u64) {
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
        // The record is named (its index, and its id, which the duplicate case shares with #0).
        assert!(err.contains("allocation #1"), "{name}: {err}");
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
