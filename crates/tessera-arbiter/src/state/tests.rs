use super::*;
use tessera_protocol::{CreateAllocation, GpuSelector, LABEL_WHOLE_GROUP};

const GIB: u64 = 1 << 30;

#[test]
fn a_whole_card_allocation_holds_its_card_and_its_groups_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = test_gpus(4);
    let arb = Arbiter::new(
        gpus,
        Store::open(dir.path()).unwrap(),
        SchedulerParams::default(),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let make = |gpu: u32, share: u32, group: Option<&str>| {
        let req = CreateAllocation {
            gpu: GpuSelector::Index(gpu),
            memory_limit: GIB,
            share,
            cap: None,
            labels: group
                .map(|g| (LABEL_WHOLE_GROUP.to_owned(), g.to_owned()))
                .into_iter()
                .collect(),
        };
        rt.block_on(arb.create(req)).unwrap().1.id
    };
    let (a, b) = (make(0, 100, Some("GPU-0")), make(1, 100, Some("GPU-0")));
    let c = make(2, 100, None);
    // A fraction carrying the label (an operator's mistake) holds no card.
    let d = make(3, 50, Some("GPU-0"));
    let watched = arb.watched();
    let of = |id: &str| {
        watched
            .iter()
            .find(|w| w.id == id)
            .unwrap()
            .whole_gpus
            .clone()
    };
    assert_eq!(of(&a), [0, 1]);
    assert_eq!(of(&b), [0, 1]);
    assert_eq!(of(&c), [2]);
    assert!(of(&d).is_empty());
}

#[test]
fn a_process_that_freed_after_the_card_was_read_is_seen_holding_what_the_card_showed() {
    // The backstop reads the card, then the ledger. A process that frees 600 MiB and
    // releases it in between (the poll descheduled on a loaded host) shows 600 MiB more on
    // the card than it holds now; twice in a row, that was charged to it as excess and its
    // next cuMemGetInfo came back 600 MiB short. The ledger side is the most it held since
    // the last poll, so the card figure is within it.
    let dir = tempfile::tempdir().unwrap();
    let arb = two_gpu_arbiter(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (token, _) = rt.block_on(arb.create(slice_req(0, GIB, 50))).unwrap();
    let me = crate::peer::ProcId {
        pid: std::process::id() as i32,
        start: 1,
    };
    let b = arb
        .attach_tenant(&token, 7, Some(crate::peer::Peer::without_pidfd(me)))
        .unwrap();
    const MIB: u64 = 1 << 20;
    let held = || -> Vec<(crate::peer::ProcId, u64)> {
        arb.connected_processes()
            .into_iter()
            .map(|(_, id, _, held, _)| (id, held))
            .collect()
    };
    arb.with_ledger(|l| l.reserve(b.key, 7, 300 * MIB)).unwrap();
    assert_eq!(held(), [(me, 300 * MIB)]);
    for _ in 0..2 {
        arb.with_ledger(|l| l.reserve(b.key, 7, 600 * MIB)).unwrap();
        arb.with_ledger(|l| l.release(b.key, 7, 600 * MIB)).unwrap();
        assert_eq!(held(), [(me, 900 * MIB)], "the card may have shown 900 MiB");
    }
    // Nothing held and released since the last look: what it holds.
    assert_eq!(held(), [(me, 300 * MIB)]);
}

fn two_gpu_arbiter(dir: &std::path::Path) -> Arc<Arbiter> {
    let gpus = test_gpus(2);
    Arbiter::new(gpus, Store::open(dir).unwrap(), SchedulerParams::default()).unwrap()
}

fn slice_req(gpu: u32, limit: u64, share: u32) -> CreateAllocation {
    CreateAllocation {
        gpu: GpuSelector::Index(gpu),
        memory_limit: limit,
        share,
        cap: None,
        labels: BTreeMap::new(),
    }
}

#[test]
fn a_group_is_one_slice_per_gpu_under_one_token_with_per_gpu_limits() {
    use tessera_protocol::group::{LABEL_GPU_GROUP, slice_token};
    let dir = tempfile::tempdir().unwrap();
    let arb = two_gpu_arbiter(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (token, slices) = rt
        .block_on(arb.create_group(
            vec![slice_req(0, 10 * GIB, 30), slice_req(1, 20 * GIB, 30)],
            None,
        ))
        .unwrap();
    assert_eq!(slices.len(), 2);
    assert_eq!((slices[0].gpu_index, slices[0].memory_limit), (0, 10 * GIB));
    assert_eq!((slices[1].gpu_index, slices[1].memory_limit), (1, 20 * GIB));
    for s in &slices {
        assert_eq!(s.labels[LABEL_GPU_GROUP], slices[0].id);
    }
    // The group token opens GPU 0's slice; GPU 1's is reached only through its derived
    // token, and a token for a GPU outside the group opens nothing.
    let a = arb.attach_tenant(&token, 1, None).unwrap();
    assert_eq!(a.view.id, slices[0].id);
    let b = arb
        .attach_tenant(&slice_token(&token, "GPU-1"), 2, None)
        .unwrap();
    assert_eq!(
        (b.view.id.as_str(), b.view.memory_limit),
        (slices[1].id.as_str(), 20 * GIB)
    );
    assert!(
        arb.attach_tenant(&slice_token(&token, "GPU-7"), 3, None)
            .is_none()
    );
    // The first slice answers its own GPU's slice token too (how an interposer learns it is
    // in a group).
    assert_eq!(
        arb.attach_tenant(&slice_token(&token, "GPU-0"), 5, None)
            .map(|b| b.view.id),
        Some(slices[0].id.clone())
    );
    // Separate ledgers: each refuses at its own limit.
    let granted = |key, conn, bytes| {
        arb.with_ledger(|l| {
            matches!(
                l.reserve(key, conn, bytes),
                Ok(crate::ledger::Reservation::Granted { .. })
            )
        })
    };
    assert!(granted(a.key, 1, 10 * GIB));
    assert!(!granted(a.key, 1, 1));
    assert!(granted(b.key, 2, 20 * GIB));
    assert!(!granted(b.key, 2, 1));
    // The backstop sees the slices per card, in one group.
    let w = arb.watched();
    let of = |id: &str| w.iter().find(|x| x.id == id).unwrap().clone();
    assert_eq!(
        (of(&slices[0].id).gpu, of(&slices[1].id).gpu),
        (Some(0), Some(1))
    );
    assert_eq!(
        of(&slices[1].id).group.as_deref(),
        Some(slices[0].id.as_str())
    );
    // It survives a restart (one record per slice, derived token included).
    drop((a, b));
    drop(arb);
    let again = two_gpu_arbiter(dir.path());
    assert!(
        again
            .attach_tenant(&slice_token(&token, "gpu-1"), 4, None)
            .is_some()
    );
}

#[test]
fn a_group_is_created_whole_or_not_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let arb = two_gpu_arbiter(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(arb.create(slice_req(1, GIB, 80))).unwrap();
    // GPU 1 has 20 shares left: the whole group is refused and GPU 0 keeps its shares.
    let e = rt
        .block_on(arb.create_group(vec![slice_req(0, GIB, 30), slice_req(1, GIB, 30)], None))
        .unwrap_err();
    assert!(matches!(e, StateError::Exhausted(_)), "{e}");
    assert_eq!(arb.allocation_count(), 1);
    let e = rt
        .block_on(arb.create_group(vec![slice_req(0, GIB, 10), slice_req(0, GIB, 10)], None))
        .unwrap_err();
    assert!(e.to_string().contains("asked twice"), "{e}");
    let e = rt.block_on(arb.create_group(Vec::new(), None)).unwrap_err();
    assert!(matches!(e, StateError::Invalid(_)), "{e}");
    assert_eq!(arb.allocation_count(), 1);
}
