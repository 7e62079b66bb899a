//! Attribution and the memory rule.

use super::*;

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
