//! VMM accounting, end to end: a real `cuda-bindings` client (`tests/python/vmm_client.py`)
//! walks `cuMemCreate` / `cuMemMap` / `cuMemUnmap` / `cuMemRelease` /
//! `cuMemRetainAllocationHandle` in every order, one step at a time, and after each step the
//! arbiter's ledger must equal what the simulated GPU really holds for the process (the
//! simulator keeps released-but-mapped memory, as the driver does). The idiom
//! `create -> map -> set access -> release` used to escape the limit: the bytes were uncounted
//! at `cuMemRelease` while the mapping kept the memory.

mod common;

use std::time::Duration;

use common::*;

const OOM: i64 = 2;

/// A tenant with a 1 GiB limit (plus room for its context) running the VMM client.
struct Vmm {
    bed: Bed,
    id: String,
    client: Served,
}

/// A tenant of `bed` (its own allocation of 1 GiB plus room for its context: contexts count
/// against the limit) running the VMM client; (id, client).
fn tenant(bed: &Bed) -> (String, Served) {
    let (token, id) = bed.create(GIB + CONTEXT);
    (
        id,
        Served::start_script(bed.tenant_command(&python(), &token), "vmm_client.py", &[]),
    )
}

/// Runs one step on `client`; its result code.
fn rc(client: &mut Served, cmd: &str) -> i64 {
    let a = client.ask(cmd);
    a["rc"]
        .as_i64()
        .unwrap_or_else(|| panic!("{cmd}: bad answer {a}"))
}

impl Vmm {
    fn start() -> Self {
        let bed = Bed::new();
        let (id, client) = tenant(&bed);
        Self { bed, id, client }
    }

    /// Runs one step; it must succeed.
    fn step(&mut self, cmd: &str) {
        let rc = self.rc(cmd);
        assert_eq!(rc, 0, "{cmd} failed with {rc}");
    }

    /// Runs one step; its result code.
    fn rc(&mut self, cmd: &str) -> i64 {
        rc(&mut self.client, cmd)
    }

    /// Asserts that the arbiter counts `mib` for the tenant and that the simulated GPU really
    /// holds that much (the client's memory query after each step has flushed every release).
    #[track_caller]
    fn holds(&self, mib: u64, when: &str) {
        // Plus the client's context.
        let card = mib * MIB + self.bed.context_bytes();
        assert_eq!(
            self.bed.sim_used(),
            card,
            "{when}: the simulated GPU holds {mib} MiB"
        );
        assert_eq!(
            self.bed.used(&self.id),
            mib * MIB + CONTEXT,
            "{when}: the arbiter counts what the GPU holds"
        );
    }

    /// Ends the client; nothing may stay counted or held.
    fn finish(self) {
        let Vmm { bed, id, client } = self;
        assert!(client.exit().success());
        wait_until(Duration::from_secs(2), || bed.used(&id) == 0)
            .expect("nothing left in the ledger after exit");
        assert_eq!(bed.sim_used(), 0);
    }
}

#[test]
fn create_map_release_unmap_stays_counted_until_the_unmap() {
    let mut t = Vmm::start();
    t.step("create h 512");
    t.step("reserve r 512");
    t.step("map r 0 h 512");
    t.holds(512, "created and mapped");
    t.step("release h");
    t.holds(512, "released while mapped");
    t.step("unmap r 0 512");
    t.holds(0, "unmapped after the release");
    t.step("free_va r");
    t.finish();
}

#[test]
fn create_map_unmap_release_stays_counted_until_the_release() {
    let mut t = Vmm::start();
    t.step("create h 512");
    t.step("reserve r 512");
    t.step("map r 0 h 512");
    t.step("unmap r 0 512");
    t.holds(512, "unmapped, not released");
    t.step("release h");
    t.holds(0, "released after the unmap");
    t.step("free_va r");
    t.finish();
}

#[test]
fn a_retained_handle_needs_its_own_release() {
    let mut t = Vmm::start();
    t.step("create h 256");
    t.step("reserve r 256");
    t.step("map r 0 h 256");
    t.step("retain h2 r 0");
    t.step("unmap r 0 256");
    t.step("release h");
    t.holds(256, "one release of two references");
    t.step("release h2");
    t.holds(0, "both references released, nothing mapped");
    t.step("free_va r");
    t.finish();
}

#[test]
fn a_handle_retained_after_its_release_keeps_it_past_the_unmap() {
    let mut t = Vmm::start();
    t.step("create h 256");
    t.step("reserve r 256");
    t.step("map r 0 h 256");
    t.step("release h");
    t.step("retain h2 r 128");
    t.step("unmap r 0 256");
    t.holds(256, "the retained reference keeps it");
    t.step("release h2");
    t.holds(0, "last reference released");
    t.step("free_va r");
    t.finish();
}

#[test]
fn two_mappings_of_one_handle_unmapped_one_by_one() {
    let mut t = Vmm::start();
    t.step("create h 256");
    t.step("reserve r 512");
    t.step("map r 0 h 256");
    t.step("map r 256 h 256");
    t.step("release h");
    t.holds(256, "released, mapped twice");
    t.step("unmap r 256 256");
    t.holds(256, "one mapping left");
    t.step("unmap r 0 256");
    t.holds(0, "both mappings gone");
    t.step("free_va r");
    t.finish();
}

#[test]
fn one_unmap_covering_two_mappings_releases_both_handles() {
    let mut t = Vmm::start();
    t.step("create a 256");
    t.step("create b 256");
    t.step("reserve r 512");
    t.step("map r 0 a 256");
    t.step("map r 256 b 256");
    t.step("release a");
    t.step("release b");
    t.holds(512, "both released while mapped");
    t.step("unmap r 0 512");
    t.holds(0, "one unmap covered both mappings");
    t.step("free_va r");
    t.finish();
}

#[test]
fn released_but_mapped_memory_still_holds_the_limit() {
    let mut t = Vmm::start();
    t.step("create h 768");
    t.step("reserve r 768");
    t.step("map r 0 h 768");
    t.step("release h");
    assert_eq!(
        t.rc("alloc 512"),
        OOM,
        "768 MiB still mapped + 512 MiB is past the 1 GiB limit"
    );
    t.holds(768, "the refused allocation took nothing");
    t.step("unmap r 0 768");
    assert_eq!(t.rc("alloc 512"), 0, "fits once the mapping is gone");
    t.holds(0, "all gone");
    t.step("free_va r");
    t.finish();
}

#[test]
fn freeing_the_address_range_unmaps_what_is_left() {
    let mut t = Vmm::start();
    t.step("create h 256");
    t.step("reserve r 256");
    t.step("map r 0 h 256");
    t.step("release h");
    t.holds(256, "released while mapped");
    t.step("free_va r");
    t.holds(0, "cuMemAddressFree unmapped it");
    t.finish();
}

#[test]
fn an_imported_handle_is_counted_once_by_its_creator() {
    let mut a = Vmm::start();
    a.step("create h 512");
    let fd = a.client.ask("export h")["fd"].as_i64().unwrap();
    assert!(fd >= 0);
    // B: another allocation, another process, on the same simulated GPU and arbiter.
    let (b_id, mut b) = tenant(&a.bed);
    let b_step = |b: &mut Served, cmd: &str| assert_eq!(rc(b, cmd), 0, "B: {cmd}");
    b_step(&mut b, &format!("import h {} {fd}", a.client.pid));
    b_step(&mut b, "reserve r 512");
    b_step(&mut b, "map r 0 h 512");
    let used = |id: &str| a.bed.used(id);
    assert_eq!(
        (used(&a.id), used(&b_id)),
        (512 * MIB + CONTEXT, CONTEXT),
        "charged to the creator only (each has its context)"
    );
    let contexts = 2 * a.bed.context_bytes();
    assert_eq!(
        a.bed.sim_used(),
        512 * MIB + contexts,
        "one copy of the memory on the GPU"
    );
    b_step(&mut b, "release h");
    assert_eq!(
        rc(&mut b, "alloc 1024"),
        0,
        "the importer can still take its whole limit"
    );
    b_step(&mut b, "unmap r 0 512");
    assert_eq!(
        (used(&a.id), used(&b_id)),
        (512 * MIB + CONTEXT, CONTEXT),
        "unmapping a foreign handle releases nothing"
    );
    b_step(&mut b, "free_va r");
    assert!(b.exit().success());
    a.step("release h");
    a.holds(0, "released by its creator");
    wait_until(Duration::from_secs(2), || a.bed.used(&b_id) == 0).expect("B's context went");
    a.finish();
}

#[test]
fn the_release_at_once_idiom_is_refused_at_create_and_the_card_never_holds_more_than_the_limit() {
    let bed = Bed::new();
    let (token, id) = bed.create(GIB + CONTEXT);
    let exe = build_c(&bed, "vmm_release");
    let mut c = bed
        .tenant_command(&exe, &token)
        .args(["4096", "512", "512", "512"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = c.id();
    let mut c_out = std::io::BufRead::lines(std::io::BufReader::new(c.stdout.take().unwrap()));
    let mut c = tessera_testkit::KillOnDrop::new(c);
    let mut line = || c_out.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(
        line(),
        "create 4096 2",
        "4 GiB under a 1 GiB limit is refused at cuMemCreate"
    );
    assert_eq!(line(), "create 512 0");
    assert_eq!(line(), "mapped 512 0");
    assert_eq!(line(), "create 512 0");
    assert_eq!(
        line(),
        "mapped 512 0",
        "released at once, mapped: the limit is full"
    );
    assert_eq!(
        line(),
        "create 512 2",
        "released-but-mapped memory still counts"
    );
    assert_eq!(line(), "done");
    // NVML's truth over five backstop polls, mappings in place: exactly the limit (plus the
    // context every process has), so the
    // interposer refused and the backstop had nothing to do.
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_millis(1250) {
        assert_eq!(
            bed.sim_used(),
            GIB + bed.context_bytes(),
            "the card holds the two mapped 512 MiB and the process's context, nothing else"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(alive(pid), "refused, not killed\n{}", bed.arbiter_log());
    assert_eq!(
        bed.used(&id),
        GIB + CONTEXT,
        "the arbiter counts what the card holds"
    );
    assert_eq!(bed.status(&id).enforced, 0);
    assert!(
        !bed.arbiter_log().contains("backstop: pid"),
        "{}",
        bed.arbiter_log()
    );
    c.kill_and_reap();
}
