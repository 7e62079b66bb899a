use super::*;

const MIB: u64 = 1 << 20;
const MS: u64 = 1_000_000;

/// The start time of every process of the fake system unless [`Fake::starts`] says else.
const START: u64 = 1000;

fn w(id: &str, limit: u64, pids: &[i32]) -> Watched {
    Watched {
        id: id.into(),
        limit,
        pids: pids
            .iter()
            .map(|&pid| ProcId { pid, start: START })
            .collect(),
        token: format!("tok-{id}"),
        share: 50,
        whole_gpus: Vec::new(),
        gpu: None,
        group: None,
    }
}

/// A process on GPU 0.
fn p(pid: i32, used: u64) -> GpuProcess {
    GpuProcess { pid, gpu: 0, used }
}

/// A process on GPU `gpu`.
fn on(gpu: u32, pid: i32, used: u64) -> GpuProcess {
    GpuProcess { pid, gpu, used }
}

/// A fake system: parents, the origin of each pid (host unless listed), start times
/// ([`START`] unless listed; `None`: no process has that pid) and cgroups.
#[derive(Default)]
struct Fake {
    parents: HashMap<i32, i32>,
    containers: HashMap<i32, Option<String>>,
    starts: HashMap<i32, Option<u64>>,
    cgroups: HashMap<i32, String>,
    /// The inode of the identity file a pid shows (none unless listed).
    files: HashMap<i32, FileKey>,
    /// Pids whose mount table shows the plugin's mount at the identity path.
    mounted: HashSet<i32>,
    /// Executable names (none unless listed).
    exes: HashMap<i32, String>,
}

impl ProcView for Fake {
    fn parent(&self, pid: i32) -> Option<i32> {
        self.parents.get(&pid).copied()
    }
    fn start_time(&self, pid: i32) -> Option<u64> {
        self.starts.get(&pid).copied().unwrap_or(Some(START))
    }
    fn cgroup(&self, pid: i32) -> Option<String> {
        self.cgroups.get(&pid).cloned()
    }
    fn identity_file(&self, pid: i32) -> Option<FileKey> {
        self.files.get(&pid).copied()
    }
    fn identity_mounted(&self, pid: i32) -> bool {
        self.mounted.contains(&pid)
    }
    fn exe_name(&self, pid: i32) -> Option<String> {
        self.exes.get(&pid).cloned()
    }
    fn origin(&self, pid: i32) -> Origin {
        match self.containers.get(&pid) {
            Some(token) => Origin::Container {
                token: token.clone(),
            },
            None => Origin::Host,
        }
    }
}

fn run(
    watched: &[Watched],
    procs: &[GpuProcess],
    view: &Fake,
    tol: impl Into<Tolerance>,
) -> Vec<Action> {
    let memory = memory_per_pid(procs);
    let pids: Vec<i32> = memory.keys().copied().collect();
    let owners = attribute(watched, &pids, view, &mut Cgroups::default());
    // The path `poll` takes: per-card charges (equal to the per-pid sums of
    // `policed_memory` for allocations that span one card).
    let tol: Tolerance = tol.into();
    let charges = card_charges(watched, procs, &owners);
    let by_pid = decide(
        watched,
        &policed_memory(watched, procs, &owners),
        &owners,
        tol,
    );
    let acts = decide_charges(watched, &charges, tol);
    if watched.iter().all(|w| w.group.is_none()) {
        assert_eq!(
            acts, by_pid,
            "per-card charges change nothing without GPU groups"
        );
    }
    acts.into_iter()
        .filter(|a| {
            !matches!(
                a.reason,
                Reason::Unknown {
                    container: false,
                    ..
                }
            )
        })
        .collect()
}

fn total(a: &Action) -> u64 {
    match a.reason {
        Reason::Memory { total, .. } => total,
        _ => panic!("not a memory action: {a:?}"),
    }
}

#[test]
fn within_the_limit_plus_tolerance_nothing_happens() {
    let a = [w("a", 1000 * MIB, &[10, 11])];
    // 1000 MiB allocated plus 2 x 100 MiB of context beyond the estimate: allowed only
    // where the operator allows 100 MiB per process.
    let procs = [p(10, 600 * MIB), p(11, 600 * MIB)];
    let per_process = |b| Tolerance {
        per_allocation: 0,
        per_process: b,
    };
    assert!(run(&a, &procs, &Fake::default(), per_process(100 * MIB)).is_empty());
    assert_eq!(
        run(&a, &procs, &Fake::default(), per_process(99 * MIB)).len(),
        1
    );
    // The default: one slack per allocation.
    assert!(run(&a, &procs, &Fake::default(), 200 * MIB).is_empty());
    assert_eq!(run(&a, &procs, &Fake::default(), 199 * MIB).len(), 1);
}

#[test]
fn the_slack_is_per_allocation_whatever_the_number_of_processes() {
    // 64 processes of a 1 GiB allocation each holding 316 MiB (a context and 16 MiB):
    // the old 512 MiB per process allowed 33 GiB; one slack allows limit + 64 MiB.
    let pids: Vec<i32> = (1..=64).collect();
    let a = [w("a", GIB, &pids)];
    let procs: Vec<GpuProcess> = pids.iter().map(|&i| p(i, 316 * MIB)).collect();
    let acts = run(&a, &procs, &Fake::default(), DEFAULT_MEMORY_SLACK);
    let left = 64 - acts.len() as u64;
    assert!(
        left * 316 * MIB <= GIB + DEFAULT_MEMORY_SLACK,
        "{left} processes left"
    );
    assert_eq!(left, 3, "no more are killed than needed");
    // Three such processes are within it: an honest allocation is left alone.
    let procs: Vec<GpuProcess> = (1..=3).map(|i| p(i, 316 * MIB)).collect();
    assert!(run(&a, &procs, &Fake::default(), DEFAULT_MEMORY_SLACK).is_empty());
}

#[test]
fn a_descendant_that_never_connected_is_charged_to_its_ancestor_and_killed_first() {
    let a = [w("a", 1000 * MIB, &[10])];
    // 10 -> 20 -> 30: 30 started without the interposer and took 4 GiB.
    let view = Fake {
        parents: HashMap::from([(30, 20), (20, 10)]),
        ..Default::default()
    };
    let procs = [p(10, 900 * MIB), p(30, 4096 * MIB), p(99, 8192 * MIB)];
    let acts = run(&a, &procs, &view, 0);
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!((acts[0].pid, acts[0].unconnected), (30, true));
    assert_eq!(total(&acts[0]), 4996 * MIB);
    // 99 is a host process of nobody: only reported (filtered out by `run`).
}

#[test]
fn connected_processes_go_largest_first_until_the_rest_fits() {
    let a = [w("a", 1000 * MIB, &[1, 2, 3])];
    let procs = [p(1, 300 * MIB), p(2, 700 * MIB), p(3, 400 * MIB)];
    let acts = run(&a, &procs, &Fake::default(), 0);
    assert_eq!(acts.iter().map(|a| a.pid).collect::<Vec<_>>(), vec![2]);
}

#[test]
fn memory_on_several_gpus_is_summed_and_allocations_are_independent() {
    let a = [w("a", 1000 * MIB, &[1]), w("b", 1000 * MIB, &[2])];
    let procs = [p(1, 600 * MIB), p(1, 600 * MIB), p(2, 900 * MIB)];
    let acts = run(&a, &procs, &Fake::default(), 0);
    assert_eq!(acts.len(), 1);
    assert_eq!((acts[0].pid, acts[0].allocation.as_deref()), (1, Some("a")));
}

#[test]
fn a_parent_cycle_ends() {
    let a = [w("a", MIB, &[1])];
    let view = Fake {
        parents: HashMap::from([(5, 6), (6, 5)]),
        ..Default::default()
    };
    assert!(run(&a, &[p(5, 10 * MIB)], &view, 0).is_empty());
}

#[test]
fn a_container_process_that_never_connected_is_attributed_by_its_identity_file() {
    let a = [w("a", GIB, &[]), w("b", GIB, &[])];
    let view = Fake {
        containers: HashMap::from([
            (40, Some("tok-a".into())),
            (41, Some("tok-a".into())),
            (50, Some("tok-b".into())),
        ]),
        ..Default::default()
    };
    // Two processes of container a hold 3 GiB together; b holds 100 MiB.
    let procs = [p(40, 2 * GIB), p(41, GIB), p(50, 100 * MIB)];
    let acts = run(&a, &procs, &view, 0);
    // The largest goes; the 1 GiB left fits.
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!(
        (
            acts[0].pid,
            acts[0].allocation.as_deref(),
            acts[0].unconnected
        ),
        (40, Some("a"), true)
    );
}

const GIB: u64 = 1 << 30;

#[test]
fn unknown_processes_are_told_apart_by_where_they_run() {
    let a = [w("a", GIB, &[1])];
    let view = Fake {
        containers: HashMap::from([
            (60, None),                  // a container without any identity
            (61, Some("forged".into())), // an identity naming no allocation
        ]),
        ..Default::default()
    };
    let procs = [
        p(1, 10 * MIB),
        p(60, 10 * MIB),
        p(61, 10 * MIB),
        p(70, 10 * MIB),
    ];
    let memory = memory_per_pid(&procs);
    let owners = attribute(&a, &[1, 60, 61, 70], &view, &mut Cgroups::default());
    assert_eq!(owners[&1], Owner::Allocation(0));
    assert_eq!(owners[&60], Owner::UnknownContainer);
    // A file naming no allocation is a forgery, not another plugin's pod.
    assert_eq!(owners[&61], Owner::Forged);
    assert_eq!(owners[&70], Owner::UnknownHost);
    let acts = decide(&a, &memory, &owners, 0);
    let unknown: Vec<(i32, &str)> = acts
        .iter()
        .map(|x| match x.reason {
            Reason::Unknown { container, .. } => {
                (x.pid, if container { "container" } else { "host" })
            }
            Reason::Forged { .. } => (x.pid, "forged"),
            _ => panic!("{x:?}"),
        })
        .collect();
    assert_eq!(
        unknown,
        vec![(60, "container"), (61, "forged"), (70, "host")]
    );
}

/// A whole-card allocation holding the cards `gpus`.
fn whole(id: &str, pids: &[i32], gpus: &[u32]) -> Watched {
    let mut x = w(id, 80 * GIB, pids);
    x.share = 100;
    x.whole_gpus = gpus.to_vec();
    x
}

#[test]
fn a_whole_card_is_not_policed_on_its_own_cards() {
    // A pod holding cards 1 and 2 (one group) fills both: nothing to police there.
    let a = [whole("a", &[1], &[1, 2])];
    let procs = [on(1, 1, 80 * GIB), on(2, 1, 80 * GIB)];
    assert!(run(&a, &procs, &Fake::default(), 0).is_empty());
}

#[test]
fn a_whole_card_allocation_is_policed_on_cards_it_does_not_own() {
    // a holds card 1 wholly; its process also took 20 GiB on card 0, whose tenants it
    // would crowd out: over a limit of 0 there, whatever it holds on card 1.
    let a = [whole("a", &[1], &[1]), w("b", 8 * GIB, &[5])];
    let procs = [on(1, 1, 10 * GIB), on(0, 1, 20 * GIB), on(0, 5, GIB)];
    let acts = run(&a, &procs, &Fake::default(), 512 * MIB);
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!((acts[0].pid, acts[0].allocation.as_deref()), (1, Some("a")));
    assert_eq!(
        acts[0].reason,
        Reason::Memory {
            used: 20 * GIB,
            total: 20 * GIB,
            allowed: 0
        }
    );
    // Even a context's worth on a foreign card is over (no tolerance there).
    let procs = [on(1, 1, GIB), on(0, 1, MIB)];
    assert_eq!(run(&a, &procs, &Fake::default(), 512 * MIB).len(), 1);
    // A whole allocation whose card is gone owns nothing: policed everywhere.
    let gone = [whole("a", &[1], &[])];
    assert_eq!(run(&gone, &[on(1, 1, GIB)], &Fake::default(), 0).len(), 1);
}

/// Slice `id` of GPU group `group` on card `gpu`.
fn slice(id: &str, group: &str, gpu: u32, limit: u64, pids: &[i32]) -> Watched {
    let mut x = w(id, limit, pids);
    x.gpu = Some(gpu);
    x.group = Some(group.into());
    x
}

#[test]
fn a_multi_gpu_allocation_is_policed_per_card_never_summed() {
    // One process (connected for slice a) on both cards of a 10/20 GiB allocation.
    let g = [
        slice("a", "a", 0, 10 * GIB, &[1]),
        slice("b", "a", 1, 20 * GIB, &[]),
    ];
    let at_limits = [on(0, 1, 10 * GIB), on(1, 1, 20 * GIB)];
    assert!(run(&g, &at_limits, &Fake::default(), 0).is_empty());
    // Over on card 1 only: charged to b, card 0's figure is not added in.
    let over1 = [on(0, 1, 10 * GIB), on(1, 1, 20 * GIB + MIB)];
    let acts = run(&g, &over1, &Fake::default(), 0);
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!(acts[0].allocation.as_deref(), Some("b"));
    assert_eq!(total(&acts[0]), 20 * GIB + MIB);
    // Over on card 0 only: charged to a, however little card 1 holds.
    let over0 = [on(0, 1, 10 * GIB + MIB), on(1, 1, MIB)];
    let acts = run(&g, &over0, &Fake::default(), 0);
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!(acts[0].allocation.as_deref(), Some("a"));
    assert_eq!(total(&acts[0]), 10 * GIB + MIB);
    // Two processes, one per card (TP ranks), each at its card's limit: nothing.
    let g2 = [
        slice("a", "a", 0, 10 * GIB, &[1]),
        slice("b", "a", 1, 20 * GIB, &[2]),
    ];
    let ranks = [on(0, 1, 10 * GIB), on(1, 2, 20 * GIB)];
    assert!(run(&g2, &ranks, &Fake::default(), 0).is_empty());
}

#[test]
fn a_multi_gpu_tenant_cannot_use_a_card_outside_its_group_nor_charge_a_neighbour() {
    // Group a on cards 0 and 1; neighbour c on card 2 with room to spare.
    let g = [
        slice("a", "a", 0, 10 * GIB, &[1]),
        slice("b", "a", 1, 20 * GIB, &[]),
        w("c", 40 * GIB, &[9]),
    ];
    // The tenant's process takes memory on card 2: allowed nothing there, whatever room
    // its slices or the neighbour have; the neighbour is untouched.
    let procs = [on(0, 1, GIB), on(2, 1, MIB), on(2, 9, GIB)];
    let acts = run(&g, &procs, &Fake::default(), 512 * MIB);
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!((acts[0].pid, acts[0].allocation.as_deref()), (1, Some("a")));
    assert_eq!(
        acts[0].reason,
        Reason::Memory {
            used: MIB,
            total: MIB,
            allowed: 0
        }
    );
    // A process of the neighbour's on card 1 is the neighbour's (summed into c, as for
    // any one-card allocation), never charged to slice b.
    let procs = [on(1, 9, 41 * GIB)];
    let acts = run(&g, &procs, &Fake::default(), 0);
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!(acts[0].allocation.as_deref(), Some("c"));
}

#[test]
fn a_multi_gpu_allocations_gpu_time_is_charged_to_each_cards_slice() {
    let g = [slice("a", "a", 0, GIB, &[1]), slice("b", "a", 1, GIB, &[])];
    let owners = HashMap::from([(1, Owner::Allocation(0))]);
    let per_gpu = HashMap::from([((1, 0), 3 * MS), ((1, 1), 5 * MS), ((1, 7), 2 * MS)]);
    let rows = gpu_time_rows(&g, &per_gpu, &owners);
    // Card 0 and card 7 (outside the group: apart, no lease covers it) on a; card 1 on b.
    assert_eq!(
        rows,
        vec![
            TimeRow {
                pid: 1,
                allocation: 0,
                all_ns: 5 * MS,
                policed_ns: 3 * MS,
                outside_ns: 2 * MS,
            },
            TimeRow {
                pid: 1,
                allocation: 1,
                all_ns: 5 * MS,
                policed_ns: 5 * MS,
                outside_ns: 0,
            },
        ]
    );
}

#[test]
fn a_whole_card_allocations_gpu_time_is_policed_only_on_foreign_cards() {
    let a = [whole("a", &[1], &[1]), w("b", GIB, &[5])];
    let owners = attribute(&a, &[1, 5, 9], &Fake::default(), &mut Cgroups::default());
    let per_gpu = HashMap::from([
        ((1, 1), 900 * MS),
        ((1, 0), 300 * MS),
        ((5, 0), 200 * MS),
        ((9, 0), 50 * MS),
    ]);
    let (all, policed) = policed_gpu_time(&a, &per_gpu, &owners);
    assert_eq!(
        (all[&1], all[&5], all[&9]),
        (1200 * MS, 200 * MS, 50 * MS),
        "every ns is counted as busy"
    );
    assert_eq!(
        (policed[&1], policed[&5], policed[&9]),
        (300 * MS, 200 * MS, 50 * MS),
        "only card 1's time is a's own"
    );
}

#[test]
fn the_identity_file_beats_any_connection() {
    // A process whose container's read-only file names a is a's, even connected for b (and
    // a connection for b from a container of nobody cannot make it b's either).
    let a = [w("a", GIB, &[]), w("b", GIB, &[7, 8])];
    let view = Fake {
        containers: HashMap::from([(7, Some("tok-a".into())), (8, Some("forged".into()))]),
        ..Default::default()
    };
    let owners = attribute(&a, &[7, 8], &view, &mut Cgroups::default());
    assert_eq!(owners[&7], Owner::Allocation(0));
    assert_eq!(owners[&8], Owner::Forged);
}

#[test]
fn a_reused_pid_and_its_descendants_are_not_attributed_and_the_live_original_still_is() {
    // a's process 100 connected (start 1000) and exited; a host job got pid 100 later
    // (start 5000) and forked 101. a's live process 200 and its child 201 are a's.
    let a = [w("a", GIB, &[100, 200])];
    let view = Fake {
        parents: HashMap::from([(101, 100), (201, 200)]),
        starts: HashMap::from([(100, Some(5000))]),
        ..Default::default()
    };
    let owners = attribute(&a, &[100, 101, 200, 201], &view, &mut Cgroups::default());
    assert_eq!(owners[&100], Owner::UnknownHost);
    assert_eq!(owners[&101], Owner::UnknownHost);
    assert_eq!(owners[&200], Owner::Allocation(0));
    assert_eq!(owners[&201], Owner::Allocation(0));
    // The memory rule kills nothing on the host for a's limit: 2 GiB on the trap pid.
    let procs = [p(100, 2 * GIB), p(200, 100 * MIB)];
    assert!(run(&a, &procs, &view, 0).is_empty());
    // And the trap entry is gone from what the rules after attribution see.
    let mut live = a.to_vec();
    forget_exited(&mut live, &view);
    assert_eq!(
        live[0].pids,
        vec![ProcId {
            pid: 200,
            start: START
        }]
    );
}

#[test]
fn a_trap_pid_taken_by_a_neighbour_is_the_neighbours() {
    // b's honest process connected for b with pid 100 after a's connection of a former
    // pid 100 exited: it is b's alone, and b's limit is what counts.
    let mut a = [w("a", GIB, &[100]), w("b", 8 * GIB, &[])];
    a[1].pids.push(ProcId {
        pid: 100,
        start: 5000,
    });
    let view = Fake {
        starts: HashMap::from([(100, Some(5000))]),
        ..Default::default()
    };
    assert_eq!(
        attribute(&a, &[100], &view, &mut Cgroups::default())[&100],
        Owner::Allocation(1)
    );
    assert!(run(&a, &[p(100, 2 * GIB)], &view, 0).is_empty());
    // A connection whose process is gone altogether attributes nobody either.
    let view = Fake {
        starts: HashMap::from([(100, None)]),
        ..Default::default()
    };
    assert_eq!(
        attribute(&a, &[100], &view, &mut Cgroups::default())[&100],
        Owner::UnknownHost
    );
}

#[test]
fn a_containers_cgroup_is_learnt_from_its_identity_and_attributes_after() {
    let a = [w("a", GIB, &[]), w("b", GIB, &[])];
    let mut view = Fake {
        containers: HashMap::from([(40, Some("tok-a".into())), (41, None), (42, None)]),
        cgroups: HashMap::from([
            (40, "/kubepods/pod1/c1".into()),
            (41, "/kubepods/pod1/c1".into()),
            (42, "/kubepods/pod2/c2".into()),
            (43, "/kubepods/pod1/c1".into()),
        ]),
        ..Default::default()
    };
    let mut book = Cgroups::new(["/arbiter".to_owned()]);
    // Before any process of it showed its identity, 41 (no file: it chrooted away) is
    // nobody's.
    let owners = attribute(&a, &[41], &view, &mut book);
    assert_eq!(owners[&41], Owner::UnknownContainer);
    let owners = attribute(&a, &[40, 41, 42, 43], &view, &mut book);
    assert_eq!(owners[&40], Owner::Allocation(0));
    assert_eq!(owners[&41], Owner::Allocation(0), "same cgroup as 40");
    assert_eq!(owners[&42], Owner::UnknownContainer, "another container");
    // 43 runs on the host (its mount namespace is the host's): never a container's by
    // cgroup.
    assert_eq!(owners[&43], Owner::UnknownHost);
    assert_eq!(book.len(), 1);
    // The root and the arbiter's own cgroup are never learnt (a container sharing them
    // with the host would make host processes its own).
    view.cgroups.insert(40, "/".into());
    view.cgroups.insert(41, "/".into());
    let mut book = Cgroups::new(["/arbiter".to_owned()]);
    let owners = attribute(&a, &[40, 41], &view, &mut book);
    assert_eq!(owners[&41], Owner::UnknownContainer);
    view.cgroups.insert(40, "/arbiter".into());
    view.cgroups.insert(41, "/arbiter".into());
    let owners = attribute(&a, &[40, 41], &view, &mut book);
    assert_eq!(owners[&41], Owner::UnknownContainer);
    assert!(book.is_empty());
    // A cgroup where two allocations' identities show attributes nobody.
    view.cgroups.insert(40, "/c".into());
    view.cgroups.insert(41, "/c".into());
    view.cgroups.insert(44, "/c".into());
    view.containers.insert(44, Some("tok-b".into()));
    let owners = attribute(&a, &[40, 44, 41], &view, &mut book);
    assert_eq!(
        (owners[&40], owners[&44]),
        (Owner::Allocation(0), Owner::Allocation(1))
    );
    assert_eq!(owners[&41], Owner::UnknownContainer);
    // Dropped with the allocation.
    book.retain(&HashSet::new());
    view.cgroups.insert(44, "/d".into());
    attribute(&a, &[44], &view, &mut book);
    assert_eq!(book.len(), 2);
    book.retain(&HashSet::from(["a"]));
    assert_eq!(book.len(), 1, "the shared /c stays, b's /d goes");
}

#[test]
fn the_cgroup_book_is_bounded() {
    let mut book = Cgroups::default();
    for i in 0..CGROUPS_MAX + 10 {
        book.learn(Some(format!("/c{i}")), "a");
    }
    assert_eq!(book.len(), CGROUPS_MAX);
    assert_eq!(book.owner(&format!("/c{}", CGROUPS_MAX + 5)), None);
}

fn policy() -> Policy {
    Policy {
        interval: Duration::from_millis(250),
        memory_tolerance: Tolerance::default(),
        enforce: Enforce::Kill,
        unknown: Unknown::Kill,
        compute_threshold: Duration::from_millis(500),
        compute_slack: 0.05,
        compute_tolerance: Duration::ZERO,
    }
}

/// One observation of an allocation alone on its GPU.
fn observe1(
    book: &mut ComputeBook,
    id: &str,
    used_ns: u64,
    leased_total: u64,
    elapsed: u64,
    pol: &Policy,
    may_act: bool,
) -> ComputeVerdict {
    let u = ComputeUse {
        id,
        used_ns,
        leased_total,
    };
    book.observe_gpu(&[u], elapsed, pol, may_act)[0]
}

#[test]
fn honest_use_within_leases_builds_no_debt() {
    let mut book = ComputeBook::default();
    let pol = policy();
    let mut leased = 0;
    assert!(
        !observe1(&mut book, "a", 0, leased, 250 * MS, &pol, true).over,
        "first sight sets the start"
    );
    // Kernel time reported when kernels end: up to one lease behind or ahead each poll.
    let mut charged = 0;
    for i in 0..400u64 {
        leased += 250 * MS;
        let used = if i % 2 == 0 { 150 * MS } else { 350 * MS };
        let v = observe1(&mut book, "a", used, leased, 250 * MS, &pol, true);
        assert!(!v.over, "poll {i}: {v:?}");
        assert!(v.unleased_ns <= 100 * MS, "poll {i}: {v:?}");
        charged += v.charge_ns;
    }
    assert_eq!(
        charged, 0,
        "late kernel time pays back earlier lease time, nothing is charged"
    );
}

#[test]
fn gpu_time_without_leases_is_charged_and_past_the_threshold_the_process_goes() {
    let mut book = ComputeBook::default();
    let pol = policy();
    observe1(&mut book, "a", 0, 0, 250 * MS, &pol, true);
    // Half the GPU, no lease at all: 125 ms per poll, less 12.5 ms of slack.
    let mut over_at = None;
    for i in 1..=10 {
        let v = observe1(&mut book, "a", 125 * MS, 0, 250 * MS, &pol, true);
        assert_eq!(v.charge_ns, 112_500_000);
        assert_eq!(
            v.forgiven_ns, 12_500_000,
            "the slack, counted against a cap"
        );
        if v.over {
            over_at = Some(i);
            break;
        }
    }
    // 5 polls: 562.5 ms > 500 ms, 1.25 s after the bypass began.
    assert_eq!(over_at, Some(5));
    // The debt starts again after an action.
    assert!(!observe1(&mut book, "a", 125 * MS, 0, 250 * MS, &pol, true).over);
}

#[test]
fn a_tenant_that_leases_is_charged_for_drift_but_not_killed_and_warm_up_holds_kills() {
    let mut book = ComputeBook::default();
    let pol = policy();
    observe1(&mut book, "a", 0, 0, 250 * MS, &pol, true);
    // Leases cover only 150 of every 250 ms of its GPU time (say, revoked leases whose
    // kernels finish late): the debt grows and is charged, but it mostly leases: no kill.
    let (mut leased, mut charged) = (0, 0);
    for i in 0..20 {
        leased += 150 * MS;
        let v = observe1(&mut book, "a", 250 * MS, leased, 250 * MS, &pol, true);
        assert!(!v.over, "poll {i}: {v:?}");
        charged += v.charge_ns;
    }
    assert_eq!(
        charged,
        20 * 87_500_000,
        "every unleased ms beyond the slack is charged"
    );
    // No lease at all, but within the warm-up after a start: charged, no kill.
    let mut b = ComputeBook::default();
    observe1(&mut b, "b", 0, 0, 250 * MS, &pol, false);
    for _ in 0..20 {
        let v = observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, false);
        assert!(!v.over && v.charge_ns > 0);
    }
    // Warm-up over: its debt was forgiven (charged, not counted towards a kill); new
    // unleased time is, and passes the 500 ms threshold on the third poll (237.5 ms each).
    assert!(!observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, true).over);
    assert!(!observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, true).over);
    assert!(observe1(&mut b, "b", 250 * MS, 0, 250 * MS, &pol, true).over);
}

#[test]
fn unused_leases_bank_at_most_one_interval() {
    let mut book = ComputeBook::default();
    let pol = policy();
    observe1(&mut book, "a", 0, 0, 250 * MS, &pol, true);
    // Ten idle leased seconds...
    observe1(&mut book, "a", 0, 10_000 * MS, 250 * MS, &pol, true);
    // ...do not pay for a bypass later: 250 ms of credit, then the debt grows.
    let mut polls = 0;
    while !observe1(&mut book, "a", 250 * MS, 10_000 * MS, 250 * MS, &pol, true).over {
        polls += 1;
        assert!(polls < 10);
    }
    assert_eq!(polls, 3, "(250 + 500) / 237.5 ms per poll");
}

#[test]
fn the_slack_is_shared_out_max_min_fairly_and_never_beyond_the_budget() {
    assert_eq!(share_out(&[1, 10, 10], 9), vec![1, 4, 4]);
    assert_eq!(share_out(&[10, 0, 3], 100), vec![10, 0, 3], "all met");
    assert_eq!(share_out(&[5, 5], 0), vec![0, 0]);
    assert_eq!(share_out(&[], 5), Vec::<i128>::new());
    let given = share_out(&[7; 10], 25);
    assert_eq!(given.iter().sum::<i128>(), 25);
    assert!(given.iter().all(|g| (2..=3).contains(g)), "{given:?}");
}

/// The names of `n` bypassing allocations.
fn bypasser_ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("b{i}")).collect()
}

/// One poll's GPU use: each of `ids` used `bypass` ns and never leased, and the last one,
/// "honest", used `used` ns against `leased` ns leased in all.
fn beside_honest(ids: &[String], bypass: u64, used: u64, leased: u64) -> Vec<ComputeUse<'_>> {
    let mut u: Vec<ComputeUse<'_>> = ids
        .iter()
        .map(|id| ComputeUse {
            id,
            used_ns: bypass,
            leased_total: 0,
        })
        .collect();
    u.push(ComputeUse {
        id: "honest",
        used_ns: used,
        leased_total: leased,
    });
    u
}

/// The policy, ten bypassers' names, and a book that has seen them and "honest" once, all
/// at zero.
fn ten_bypassers_seen() -> (Policy, ComputeBook, Vec<String>) {
    let (pol, mut book, ids) = (policy(), ComputeBook::default(), bypasser_ids(10));
    book.observe_gpu(&beside_honest(&ids, 0, 0, 0), 250 * MS, &pol, true);
    (pol, book, ids)
}

/// `v` (ten bypassers, then "honest"): "honest" is in debt, yet only the bypassers are
/// acted on.
fn only_the_bypassers_acted_on_beside_a_debt(v: &[ComputeVerdict]) {
    assert!(v[10].unleased_ns > 0, "in debt: {:?}", v[10]);
    assert!(v[..10].iter().all(|v| v.over), "{v:?}");
    assert!(!v[10].over, "the leasing tenant was acted on: {:?}", v[10]);
}

/// `n` share-1 allocations each using `each` ns around the gate per 250 ms poll, beside an
/// honest one whose GPU time matches its leases; `polls` polls. Returns every verdict of
/// the bypassers and the honest one's total charge and whether it was ever over.
fn bypassers_beside_an_honest_tenant(
    n: usize,
    each: u64,
    polls: usize,
) -> (Vec<Vec<ComputeVerdict>>, u64, bool) {
    let pol = policy();
    let mut book = ComputeBook::default();
    let ids = bypasser_ids(n);
    let mut leased = 0;
    let uses = |used: u64, leased: u64| beside_honest(&ids, used, 200 * MS, leased);
    book.observe_gpu(&uses(0, 0), 250 * MS, &pol, true);
    let (mut out, mut honest_charged, mut honest_over) = (Vec::new(), 0, false);
    for _ in 0..polls {
        leased += 200 * MS;
        let mut v = book.observe_gpu(&uses(each, leased), 250 * MS, &pol, true);
        let h = v.pop().unwrap();
        honest_charged += h.charge_ns;
        honest_over |= h.over;
        out.push(v);
    }
    (out, honest_charged, honest_over)
}

#[test]
fn ten_allocations_share_one_slack_per_gpu_and_the_rest_is_charged_and_counted() {
    // Each takes 4.9% of the GPU around the gate: under a 5% slack per allocation none
    // was ever charged; now the ten share 12.5 ms per 250 ms poll.
    let each = 12_250_000;
    let (polls, honest_charged, honest_over) = bypassers_beside_an_honest_tenant(10, each, 8);
    let first = &polls[0];
    let charged: u64 = first.iter().map(|v| v.charge_ns).sum();
    assert_eq!(
        charged,
        10 * each - 12_500_000,
        "only one slack forgiven for all ten: {first:?}"
    );
    assert!(
        first
            .iter()
            .all(|v| v.charge_ns == each - 1_250_000 && v.forgiven_ns == 1_250_000)
    );
    // Their debts together pass 500 ms on the fifth poll (5 x 110 ms), although each has
    // only 55 ms: all ten are acted on at once.
    let over_at = polls.iter().position(|p| p.iter().any(|v| v.over));
    assert_eq!(over_at, Some(4));
    assert!(polls[4].iter().all(|v| v.over), "{:?}", polls[4]);
    assert!(polls[4].iter().all(|v| v.unleased_ns == 55 * MS));
    // Their debts start again after the action.
    assert!(polls[5].iter().all(|v| !v.over && v.unleased_ns == 11 * MS));
    // The honest tenant uses what it leased: never charged, never acted on.
    assert_eq!(honest_charged, 0);
    assert!(!honest_over);
}

#[test]
fn a_lease_overrun_is_forgiven_whole_beside_bypassers() {
    let pol = policy();
    let mut book = ComputeBook::default();
    let ids = bypasser_ids(5);
    let mut leased = 0;
    let mut uses = |used: u64, overrun: u64| {
        leased += 100 * MS;
        beside_honest(&ids, used, 100 * MS + overrun, leased)
    };
    book.observe_gpu(&uses(0, 0), 250 * MS, &pol, true);
    for i in 0..20 {
        // 8 ms over its leases each poll, beyond an equal part of the slack (12.5 / 6 ms):
        // it leased, so its overrun is served first; the bypassers share the rest.
        let v = book.observe_gpu(&uses(20 * MS, 8 * MS), 250 * MS, &pol, true);
        let h = v[5];
        assert_eq!((h.charge_ns, h.over), (0, false), "poll {i}: {v:?}");
        let to_bypassers: u64 = v[..5].iter().map(|v| v.charge_ns).sum();
        assert_eq!(to_bypassers, 5 * 20 * MS - 4_500_000, "poll {i}");
    }
}

#[test]
fn a_leasing_tenant_in_debt_is_not_caught_up_in_its_neighbours_bypass() {
    // Seen in the ten-bypasser test before this rule: the share-90 tenant, flooded by
    // bypass kernels, drifted into debt while it leased, then had one interval with
    // hardly a lease (waiting on its drain); the bypassers' debts took the GPU past the
    // threshold and it was killed with them.
    let (pol, mut book, ids) = ten_bypassers_seen();
    let uses = |bypass: u64, used: u64, leased: u64| beside_honest(&ids, bypass, used, leased);
    // Three polls: it leases 150 ms and uses 250 (drift), the ten bypass 5 ms each.
    let mut leased = 0;
    for _ in 0..3 {
        leased += 150 * MS;
        let v = book.observe_gpu(&uses(5 * MS, 250 * MS, leased), 250 * MS, &pol, true);
        assert!(v.iter().all(|v| !v.over), "{v:?}");
    }
    // Then an interval with 5 ms of use and no lease, while the bypassers pass the
    // threshold together.
    let v = book.observe_gpu(&uses(60 * MS, 5 * MS, leased), 250 * MS, &pol, true);
    only_the_bypassers_acted_on_beside_a_debt(&v);
}

#[test]
fn one_interval_without_a_lease_does_not_make_a_leasing_tenant_a_bypasser() {
    // Seen in a full test run: the share-90 tenant leased all it used, then its kernels,
    // stuck behind the bypass kernels, finished after its lease: 110 ms used, no lease in
    // that interval, its debt above zero for the first time, while ten bypassers passed
    // the threshold together.
    let (pol, mut book, ids) = ten_bypassers_seen();
    let uses = |bypass: u64, used: u64, leased: u64| beside_honest(&ids, bypass, used, leased);
    let mut leased = 0;
    for _ in 0..4 {
        leased += 240 * MS;
        book.observe_gpu(&uses(10 * MS, 240 * MS, leased), 250 * MS, &pol, true);
    }
    let v = book.observe_gpu(&uses(60 * MS, 110 * MS, leased), 250 * MS, &pol, true);
    only_the_bypassers_acted_on_beside_a_debt(&v);
}

#[test]
fn kernels_that_ran_late_on_leases_paid_before_do_not_make_a_tenant_a_bypasser() {
    // Seen once in the ten-bypasser test beside a CPU hog: the share-90 tenant's kernels
    // waited behind the bypass kernels while its leases ran (part of them idle), and ran
    // after them, mostly outside leases for seconds. Its debt and the bypassers' passed
    // the threshold together and it was killed with them, for time it had leased earlier.
    let (pol, mut book, ids) = ten_bypassers_seen();
    let uses = |bypass: u64, used: u64, leased: u64| beside_honest(&ids, bypass, used, leased);
    let mut leased = 0;
    // 10 s: it holds the GPU's leases but its kernels get only 150 ms of each 250.
    for _ in 0..40 {
        leased += 250 * MS;
        let v = book.observe_gpu(&uses(0, 150 * MS, leased), 250 * MS, &pol, true);
        assert!(v.iter().all(|v| !v.over), "{v:?}");
    }
    // 2.5 s: its queued kernels run, 240 ms a poll, beside 40 ms of lease, while the ten
    // bypass 10 ms each.
    let (mut honest_charged, mut bypassers_over) = (0, false);
    for poll in 0..10 {
        leased += 40 * MS;
        let v = book.observe_gpu(&uses(10 * MS, 240 * MS, leased), 250 * MS, &pol, true);
        assert!(
            !v[10].over,
            "poll {poll}: the tenant that leased was acted on: {v:?}"
        );
        honest_charged += v[10].charge_ns;
        bypassers_over |= v[..10].iter().all(|v| v.over);
    }
    // Its drift beyond the slack is charged to its share; the bypassers are acted on.
    assert!(honest_charged > 0, "the drift was not charged");
    assert!(bypassers_over, "the bypassers were never acted on");
}

#[test]
fn leases_held_before_buy_no_bypass_later() {
    // Attack: lease honestly for 10 s (bank lease time), then launch around the gate with
    // no lease at all. The long sums tip at the first poll of the bypass; its debt is
    // over the 500 ms threshold at the third, as without the banked leases.
    let pol = policy();
    let mut book = ComputeBook::default();
    let mut leased = 0;
    observe1(&mut book, "banker", 0, leased, 250 * MS, &pol, true);
    for _ in 0..40 {
        leased += 100 * MS;
        let v = observe1(&mut book, "banker", 100 * MS, leased, 250 * MS, &pol, true);
        assert!(!v.over, "{v:?}");
    }
    let over_at = (1..=10)
        .find(|_| observe1(&mut book, "banker", 250 * MS, leased, 250 * MS, &pol, true).over);
    assert_eq!(over_at, Some(3));
}

#[test]
fn a_leasing_tenant_is_never_acted_on_for_a_neighbour_that_bypasses() {
    let pol = policy();
    let mut book = ComputeBook::default();
    let mut leased = 0;
    let mut polls = 0;
    let uses = |leased: u64| {
        [
            // Leases cover 150 of its 250 ms (drift): debt, but mostly leased.
            ComputeUse {
                id: "drifter",
                used_ns: 250 * MS,
                leased_total: leased,
            },
            ComputeUse {
                id: "bypasser",
                used_ns: 50 * MS,
                leased_total: 0,
            },
        ]
    };
    book.observe_gpu(&uses(0), 250 * MS, &pol, true);
    loop {
        leased += 150 * MS;
        let v = book.observe_gpu(&uses(leased), 250 * MS, &pol, true);
        polls += 1;
        assert!(!v[0].over, "poll {polls}: {v:?}");
        assert!(v[0].charge_ns > 0, "the drift is charged");
        if v[1].over {
            break;
        }
        assert!(polls < 20, "the bypasser was never acted on");
    }
    // The bypasser alone counts: 50 ms a poll less at most all of the slack, past 500 ms.
    assert!((11..=14).contains(&polls), "{polls}");
}

#[test]
fn a_processes_excess_on_the_card_is_charged_once_two_polls_saw_it_and_follows_the_card() {
    let (a, b) = (ProcId { pid: 10, start: 1 }, ProcId { pid: 11, start: 1 });
    const MIB: u64 = 1 << 20;
    let mut book = ExcessBook::default();
    // a: a 500 MiB context on the card, 300 MiB reserved for it; b: within its reservation.
    let first = book.observe(&[(a, 500 * MIB, 300 * MIB), (b, 100 * MIB, 400 * MIB)]);
    assert!(first.is_empty(), "one poll is not enough: {first:?}");
    let second = book.observe(&[(a, 500 * MIB, 300 * MIB), (b, 100 * MIB, 400 * MIB)]);
    assert_eq!(second, HashMap::from([(a, 200 * MIB)]));
    // A moment's excess (b between a free and its release) is not charged.
    let third = book.observe(&[(a, 500 * MIB, 300 * MIB), (b, 450 * MIB, 400 * MIB)]);
    assert_eq!(third, HashMap::from([(a, 200 * MIB)]));
    // a's context shrank on the card (or it reserved more): the charge follows down.
    let fourth = book.observe(&[(a, 400 * MIB, 300 * MIB), (b, 100 * MIB, 400 * MIB)]);
    assert_eq!(fourth, HashMap::from([(a, 100 * MIB)]));
    // A pid given to another process starts from nothing.
    let c = ProcId { pid: 10, start: 2 };
    assert!(book.observe(&[(c, 900 * MIB, 0)]).is_empty());
}

#[test]
fn the_culprit_is_unconnected_first_then_the_busiest() {
    let connected = HashSet::from([1, 2]);
    assert_eq!(
        compute_culprit(&[(1, 50), (2, 90), (3, 10)], &connected),
        Some((3, 10))
    );
    assert_eq!(
        compute_culprit(&[(1, 50), (2, 90)], &connected),
        Some((2, 90))
    );
    assert_eq!(compute_culprit(&[(1, 0)], &connected), None);
}

#[test]
fn proc_parent_reads_this_process() {
    let me = std::process::id() as i32;
    let parent = proc_parent(me).expect("own stat");
    // SAFETY: getppid has no preconditions.
    assert_eq!(parent, unsafe { libc::getppid() });
    assert_eq!(proc_parent(-5), None);
    // We started after our parent, and a start time does not change.
    let (mine, theirs) = (proc_start(me).unwrap(), proc_start(parent).unwrap());
    assert!(mine >= theirs, "{mine} {theirs}");
    assert_eq!(proc_start(me), Some(mine));
    assert_eq!(proc_start(-5), None);
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
    fn device_count(&self) -> Result<u32, GpuSourceError> {
        if self.fail.load(Ordering::Relaxed) {
            return Err(GpuSourceError::Other("NVML is gone".into()));
        }
        Ok(1)
    }

    fn processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, GpuSourceError> {
        let all = self.procs.lock().unwrap();
        Ok(all.iter().copied().filter(|p| p.gpu == gpu).collect())
    }

    fn utilization(&self, _: u32, _: u64) -> Option<Vec<UtilSample>> {
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
