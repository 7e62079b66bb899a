//! A poll end to end (fake NVML readings, a recording killer), `/proc`, identities, kills.

use super::*;
use crate::peer::Peer;

#[test]
fn proc_parent_reads_this_process() {
    let me = std::process::id() as i32;
    // The view reads parent and start time from one read of the file.
    let (view, _) = ProcFs::new(std::path::Path::new("/proc/self/ns/mnt"));
    let parent = view.parent(me).expect("own stat");
    // SAFETY: getppid has no preconditions.
    assert_eq!(parent, unsafe { libc::getppid() });
    assert_eq!((view.parent(-5), view.start_time(-5)), (None, None));
    // We started after our parent, and a start time does not change; the view's agrees with
    // the protocol's reader (`proc_start`).
    let (mine, theirs) = (proc_start(me).unwrap(), proc_start(parent).unwrap());
    assert!(mine >= theirs, "{mine} {theirs}");
    assert_eq!(proc_start(me), Some(mine));
    assert_eq!(proc_start(-5), None);
    assert_eq!(view.start_time(me), Some(mine));
    assert!(proc_cgroup("self").is_some_and(|c| c.starts_with('/')));
}

#[test]
fn this_process_runs_on_the_host_and_has_no_identity() {
    let (view, err) = ProcFs::new(std::path::Path::new("/proc/self/ns/mnt"));
    assert!(err.is_none());
    assert_eq!(view.origin(std::process::id() as i32), Origin::Host);
    // An unreadable host namespace: a process without an identity is a host process.
    let (view, err) = ProcFs::new(std::path::Path::new("/nonexistent/ns/mnt"));
    assert!(err.is_some());
    assert_eq!(view.origin(std::process::id() as i32), Origin::Host);
    // Our root has no read-only identity file (and a gone pid has none either).
    assert_eq!(read_identity(-1), None);
}

/// GPU readings set by the test; `fail` makes every read fail, as a wedged NVML would.
#[derive(Default)]
struct FakeGpus {
    procs: std::sync::Mutex<Vec<GpuProcess>>,
    fail: std::sync::atomic::AtomicBool,
}

impl GpuSource for Arc<FakeGpus> {
    fn processes(
        &self,
        gpu: &tessera_protocol::GpuInfo,
    ) -> Result<Vec<GpuProcess>, GpuSourceError> {
        if self.fail.load(Ordering::Relaxed) {
            return Err(GpuSourceError::Other("NVML is gone".into()));
        }
        let all = self.procs.lock().unwrap();
        Ok(all.iter().copied().filter(|p| p.gpu == gpu.index).collect())
    }

    fn utilization(&self, _: &tessera_protocol::GpuInfo, _: u64) -> Option<Vec<UtilSample>> {
        Some(Vec::new())
    }
}

/// Records whom it was told to kill; kills nobody.
struct Recorder(Arc<std::sync::Mutex<Vec<i32>>>);

impl Killer for Recorder {
    fn hold(&self, pid: i32) -> Option<Held> {
        Some(Held::unchecked(pid))
    }

    fn kill(&self, target: &Held) -> bool {
        self.0.lock().unwrap().push(target.pid());
        true
    }
}

/// What [`bed`] makes: the arbiter, the allocation's id, the fake readings, whom the fake
/// killer was told to kill, and the backstop.
type Bed = (
    Arc<Arbiter>,
    String,
    Arc<FakeGpus>,
    Arc<std::sync::Mutex<Vec<i32>>>,
    Backstop,
);

/// An arbiter with one 80 GiB GPU and one 1 GiB allocation whose tenant is this very test
/// process (connected, named by pid and start time); a backstop over fakes in `enforce`.
fn bed(dir: &std::path::Path, enforce: Enforce) -> Bed {
    let gpus = vec![tessera_protocol::GpuInfo {
        index: 0,
        uuid: "GPU-0".into(),
        name: "fake".into(),
        memory_total: 80 * GIB,
    }];
    let arb = Arbiter::new(
        gpus,
        crate::store::Store::open(dir).unwrap(),
        crate::scheduler::SchedulerParams::default(),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (token, view) = rt
        .block_on(arb.create(tessera_protocol::CreateAllocation {
            gpu: tessera_protocol::GpuSelector::Index(0),
            memory_limit: GIB,
            share: 10,
            cap: None,
            labels: Default::default(),
        }))
        .unwrap();
    let me = std::process::id() as i32;
    let peer = Peer::without_pidfd(ProcId {
        pid: me,
        start: proc_start(me).unwrap(),
    });
    arb.attach_tenant(&token, 1, Some(peer)).unwrap();
    let readings = Arc::new(FakeGpus::default());
    let killed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let policy = Policy {
        interval: Duration::from_millis(250),
        memory_tolerance: Tolerance::from(DEFAULT_MEMORY_SLACK),
        enforce,
        unknown: Unknown::Report,
        compute_threshold: Duration::from_millis(500),
        compute_slack: 0.05,
        compute_tolerance: Duration::ZERO,
    };
    let b = Backstop::with_io(
        Arc::clone(&arb),
        policy,
        Box::new(Arc::clone(&readings)),
        Box::new(Recorder(Arc::clone(&killed))),
        std::path::Path::new("/proc/self/ns/mnt"),
    );
    (arb, view.id, readings, killed, b)
}

fn on_gpu0(pid: i32, used: u64) -> GpuProcess {
    GpuProcess { pid, gpu: 0, used }
}

#[test]
fn a_poll_kills_the_process_that_takes_its_allocation_past_the_limit_and_no_other() {
    let dir = tempfile::tempdir().unwrap();
    let (arb, id, readings, killed, mut b) = bed(dir.path(), Enforce::Kill);
    let me = std::process::id() as i32;
    // Within the limit and its slack: nothing happens.
    *readings.procs.lock().unwrap() = vec![on_gpu0(me, GIB + DEFAULT_MEMORY_SLACK)];
    assert!(b.poll().is_empty());
    assert!(killed.lock().unwrap().is_empty());
    // One byte past it: this process (the allocation's only one) is killed, counted and
    // noted on the allocation for `tessera status`.
    *readings.procs.lock().unwrap() = vec![on_gpu0(me, GIB + DEFAULT_MEMORY_SLACK + 1)];
    let taken = b.poll();
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert!(
        matches!(taken[0].reason, Reason::Memory { .. }),
        "{taken:?}"
    );
    assert_eq!(taken[0].allocation.as_deref(), Some(id.as_str()));
    assert_eq!(*killed.lock().unwrap(), [me]);
    assert_eq!(b.counters.polls.load(Ordering::Relaxed), 2);
    assert_eq!(b.counters.killed.load(Ordering::Relaxed), 1);
    assert_eq!(b.counters.breaches.load(Ordering::Relaxed), 1);
    let snap = arb.snapshot();
    assert_eq!(snap.allocs[0].enforced, [1, 0], "one memory action noted");
}

#[test]
fn in_report_mode_a_poll_acts_without_killing() {
    let dir = tempfile::tempdir().unwrap();
    let (_arb, _, readings, killed, mut b) = bed(dir.path(), Enforce::Report);
    let me = std::process::id() as i32;
    *readings.procs.lock().unwrap() = vec![on_gpu0(me, 4 * GIB)];
    let taken = b.poll();
    assert_eq!(taken.len(), 1);
    assert!(killed.lock().unwrap().is_empty(), "report mode killed");
    assert_eq!(b.counters.killed.load(Ordering::Relaxed), 0);
    assert_eq!(b.counters.breaches.load(Ordering::Relaxed), 1);
}

#[test]
fn a_gpu_source_that_fails_is_counted_and_nobody_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let (_arb, _, readings, killed, mut b) = bed(dir.path(), Enforce::Kill);
    let me = std::process::id() as i32;
    *readings.procs.lock().unwrap() = vec![on_gpu0(me, 4 * GIB)];
    readings.fail.store(true, Ordering::Relaxed);
    assert!(b.poll().is_empty());
    assert!(b.poll().is_empty());
    assert_eq!(b.counters.failed_polls.load(Ordering::Relaxed), 2);
    assert!(killed.lock().unwrap().is_empty());
    // NVML comes back: the breach is acted on at the next poll.
    readings.fail.store(false, Ordering::Relaxed);
    assert_eq!(b.poll().len(), 1);
    assert_eq!(*killed.lock().unwrap(), [me]);
}

#[test]
fn a_forged_identity_in_a_user_namespace_is_its_parents_allocations_or_stopped() {
    // Pod a: 10 (its shell, a's own file) started 11, which covered the file in a user and
    // mount namespace of its own with one naming no allocation, and holds 4 GiB of a 1 GiB
    // limit. 20 did the same as the first process of its container (no parent with an
    // identity); 30 covered the plugin's mount with an empty folder (no file at all).
    let a = [w("a", GIB, &[]), w("b", GIB, &[])];
    let view = Fake {
        parents: HashMap::from([(11, 10), (10, 9), (20, 19), (30, 29)]),
        containers: HashMap::from([
            (10, Some("tok-a".into())),
            (11, Some("made-up".into())),
            (20, Some("made-up".into())),
            (30, None),
        ]),
        mounted: HashSet::from([30]),
        ..Default::default()
    };
    let owners = attribute(&a, &[11, 20, 30], &view, &mut Cgroups::default());
    assert_eq!(owners[&11], Owner::Allocation(0), "its parent's identity");
    assert_eq!(owners[&20], Owner::Forged);
    assert_eq!(owners[&30], Owner::Forged, "the plugin's mount is covered");
    // 11 is charged to a and goes as a's memory breach; 20 and 30 as forgers, whatever
    // `--unknown-processes` says (see `a_forger_is_killed_even_where_unknown_processes_are_only_reported`).
    let acts = run(&a, &[p(11, 4 * GIB), p(20, GIB), p(30, GIB)], &view, 0);
    let mut got: Vec<(i32, Option<&str>, bool)> = acts
        .iter()
        .map(|x| {
            let forged = matches!(x.reason, Reason::Forged { .. });
            (x.pid, x.allocation.as_deref(), forged)
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![(11, Some("a"), false), (20, None, true), (30, None, true)],
        "{acts:?}"
    );
}

#[test]
fn only_the_plugins_own_file_proves_an_identity() {
    // Two containers show b's token read-only: 40 through the plugin's file for b (inode
    // (1, 2)), 41 through a copy of its own (a stolen token). Only 40 is b's; 41 is not
    // charged to b (where it would get b's processes killed) but stopped as a forger.
    let a = [w("a", GIB, &[]), w("b", GIB, &[41])];
    let view = Fake {
        containers: HashMap::from([(40, Some("tok-b".into())), (41, Some("tok-b".into()))]),
        files: HashMap::from([(40, (1, 2)), (41, (1, 3))]),
        ..Default::default()
    };
    let files = IdentityFiles::from_entries([((1, 2), "b".to_owned()), ((1, 4), "a".to_owned())]);
    let owners = attribute_with(&a, &[40, 41], &view, &mut Cgroups::default(), &files);
    assert_eq!(owners[&40], Owner::Allocation(1));
    assert_eq!(owners[&41], Owner::Forged, "connected for b, yet not b's");
    // The plugin's file for a, showing b's token (an inode of a's naming b): b's? no one's.
    let view = Fake {
        containers: HashMap::from([(42, Some("tok-b".into()))]),
        files: HashMap::from([(42, (1, 4))]),
        ..Default::default()
    };
    let owners = attribute_with(&a, &[42], &view, &mut Cgroups::default(), &files);
    assert_eq!(owners[&42], Owner::Forged);
    // Without a folder to check against, the read-only file naming b counts, as before.
    let owners = attribute(&a, &[42], &view, &mut Cgroups::default());
    assert_eq!(owners[&42], Owner::Allocation(1));
}

#[test]
fn the_identity_folder_is_indexed_by_inode_and_names_the_allocation() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("alloc1.00ff"), "token=x\n").unwrap();
    std::fs::write(dir.path().join(".alloc2.00ff.tmp"), "token=y\n").unwrap();
    std::fs::create_dir(dir.path().join("alloc3.dir")).unwrap();
    let files = read_identity_files(dir.path());
    let meta = std::fs::metadata(dir.path().join("alloc1.00ff")).unwrap();
    use std::os::unix::fs::MetadataExt;
    let key = (meta.dev(), meta.ino());
    assert!(files.vouches(Some(key), "alloc1"));
    assert!(!files.vouches(Some(key), "alloc2"));
    assert!(!files.vouches(None, "alloc1"));
    // A folder that cannot be read vouches for nobody.
    let none = read_identity_files(&dir.path().join("missing"));
    assert!(!none.vouches(Some(key), "alloc1"));
}

#[test]
fn a_fraction_using_a_card_it_was_not_given_is_stopped_however_much_of_its_limit_is_left() {
    // a: 40 GiB on card 0. Its process 10 holds 1 GiB there and 3.8 GiB on card 1, promised
    // to b: within a's limit summed, yet card 1 is not a's.
    let mut x = w("a", 40 * GIB, &[10]);
    x.gpu = Some(0);
    let mut y = w("b", 80 * GIB, &[20]);
    y.gpu = Some(1);
    let a = [x, y];
    let view = Fake::default();
    let procs = [on(0, 10, GIB), on(1, 10, 3_800 * MIB), on(1, 20, 70 * GIB)];
    let owners = attribute(&a, &[10, 20], &view, &mut Cgroups::default());
    let acts = decide_charges(&a, &card_charges(&a, &procs, &owners), 0);
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!(acts[0].pid, 10);
    assert_eq!(
        acts[0].reason,
        Reason::Memory {
            used: 3_800 * MIB,
            total: 3_800 * MIB,
            allowed: 0
        }
    );
    // Its GPU time on card 1 is apart from its own card's, which its leases cover.
    let per_gpu = HashMap::from([((10, 0), 5 * MS), ((10, 1), 7 * MS), ((20, 1), 9 * MS)]);
    let rows = gpu_time_rows(&a, &per_gpu, &owners);
    let row = rows.iter().find(|r| r.pid == 10).unwrap();
    assert_eq!(
        (row.all_ns, row.policed_ns, row.outside_ns),
        (12 * MS, 5 * MS, 7 * MS)
    );
    let row = rows.iter().find(|r| r.pid == 20).unwrap();
    assert_eq!(row.outside_ns, 0);
}

#[test]
fn a_forger_is_killed_even_where_unknown_processes_are_only_reported() {
    // The bed's policy reports unknown processes (`Unknown::Report`, what the chart ships):
    // an unknown container process is reported once, a forger is killed.
    let dir = tempfile::tempdir().unwrap();
    let (_arb, _id, _readings, killed, mut b) = bed(dir.path(), Enforce::Kill);
    let (unknown, forger) = (4_000_001, 4_000_002);
    b.held = HashMap::from([
        (unknown, Held::unchecked(unknown)),
        (forger, Held::unchecked(forger)),
    ]);
    let act = |pid, reason| Action {
        pid,
        allocation: None,
        unconnected: true,
        reason,
    };
    let unknown_act = act(
        unknown,
        Reason::Unknown {
            container: true,
            used: GIB,
        },
    );
    assert!(b.act(&unknown_act), "reported");
    assert!(!b.act(&unknown_act), "once");
    assert!(b.act(&act(forger, Reason::Forged { used: GIB })));
    assert_eq!(*killed.lock().unwrap(), [forger]);
}

#[test]
fn a_kill_through_a_hold_never_reaches_a_process_that_took_the_pid_later() {
    // Races a pid reuse against the kill: hold A, let it exit and be reaped, start B on A's
    // pid (ns_last_pid, as root), then kill through A's hold: B lives. A kill by pid, as the
    // backstop did before, would have killed B.
    fn spawn() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    }
    let mut a = spawn();
    let pid = a.id() as i32;
    let held = Sigkill.hold(pid).expect("a live process can be held");
    assert!(!held.exited());
    a.kill().unwrap();
    a.wait().unwrap();
    assert!(held.exited(), "the hold sees its process go");
    let mut b = None;
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("writing ns_last_pid needs root (the tests run as root)");
        let c = spawn();
        if c.id() as i32 == pid {
            b = Some(c);
            break;
        }
        let mut c = c;
        let _ = c.kill();
        let _ = c.wait();
    }
    let mut b = b.expect("no process got the pid back in 50 tries");
    assert!(!Sigkill.kill(&held), "the hold named A, which is gone");
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        b.try_wait().unwrap().is_none(),
        "B, on A's old pid, was killed"
    );
    // Its own hold reaches it.
    let hb = Sigkill.hold(pid).unwrap();
    assert!(Sigkill.kill(&hb));
    let st = b.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL));
}

#[test]
fn an_mps_daemon_nobody_owns_is_left_alone_and_a_tenants_of_that_name_is_not() {
    // 5: NVIDIA's MPS server in a pod of its own (no Tessera identity) holding 6 GiB; 6: its
    // control daemon on the host; 7: a tenant of a that named its binary like the server
    // (its container's identity says a); 8: a forger of that name.
    let a = [w("a", GIB, &[])];
    let server = "nvidia-cuda-mps-server".to_owned();
    let view = Fake {
        containers: HashMap::from([
            (5, None),
            (7, Some("tok-a".into())),
            (8, Some("made-up".into())),
        ]),
        exes: HashMap::from([
            (5, server.clone()),
            (6, "nvidia-cuda-mps-control".into()),
            (7, server.clone()),
            (8, server),
        ]),
        ..Default::default()
    };
    let owners = attribute(&a, &[5, 6, 7, 8], &view, &mut Cgroups::default());
    assert_eq!(owners[&5], Owner::Mps);
    assert_eq!(owners[&6], Owner::Mps);
    assert_eq!(owners[&7], Owner::Allocation(0));
    assert_eq!(owners[&8], Owner::Forged);
    let procs = [p(5, 6 * GIB), p(6, 10 * MIB), p(7, 2 * GIB), p(8, GIB)];
    let mut acts: Vec<i32> = run(&a, &procs, &view, 0).iter().map(|x| x.pid).collect();
    acts.sort();
    assert_eq!(acts, [7, 8], "the daemons are never acted on");
}

#[test]
fn a_kill_reads_as_the_arbiter_saw_it() {
    let r = Reason::Memory {
        used: 5 * GIB + 300 * (1 << 20),
        total: 5 * GIB + 300 * (1 << 20),
        allowed: 4 * GIB + 64 * (1 << 20),
    };
    assert_eq!(
        describe(&r, 0, 4 * GIB),
        "held 5.29 GiB on GPU 0, allowed 4.06 GiB (the allocation's limit plus the tolerance)"
    );
    let r = Reason::Memory {
        used: GIB,
        total: 3 * GIB,
        allowed: 0,
    };
    let text = describe(&r, 0, GIB);
    assert!(
        text.contains("on a GPU outside its allocation") && text.contains("held 3 GiB"),
        "{text}"
    );
}
