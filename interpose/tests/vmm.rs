//! VMM accounting, end to end: a real `cuda-bindings` client (`tests/python/vmm_client.py`)
//! walks `cuMemCreate` / `cuMemMap` / `cuMemUnmap` / `cuMemRelease` /
//! `cuMemRetainAllocationHandle` in every order, one step at a time, and after each step the
//! arbiter's ledger must equal what the simulated GPU really holds for the process (the
//! simulator keeps released-but-mapped memory, as the driver does). The idiom
//! `create -> map -> set access -> release` used to escape the limit: the bytes were uncounted
//! at `cuMemRelease` while the mapping kept the memory. Memory shared between processes
//! (exported as a POSIX descriptor, imported elsewhere) is charged to every holder's
//! allocation, one test per ordering, with the simulated card and NVML as the truth.

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
    (id, client(bed, &token))
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
        wait_until(Duration::from_secs(30), || bed.used(&id) == 0)
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

// ---- shared memory across processes ----------------------------------------------------
//
// X creates and exports (a POSIX file descriptor); Y imports it (opening /proc/X/fd/N) and
// maps it. The driver keeps the memory while any process holds a handle or a mapping of it,
// so the simulated card (the truth here) keeps it too, and each holder's allocation pays.

/// The VMM client under an allocation's token (one more process of it).
fn client(bed: &Bed, token: &str) -> Served {
    Served::start_script(bed.tenant_command(&python(), token), "vmm_client.py", &[])
}

/// Runs one step on `c`; it must succeed.
#[track_caller]
fn ok(c: &mut Served, cmd: &str) {
    let rc = rc(c, cmd);
    assert_eq!(rc, 0, "{cmd} failed with {rc}");
}

/// X creates `mib` as `name` and exports it; the import command for another process.
fn create_and_export(x: &mut Served, name: &str, mib: u64) -> String {
    ok(x, &format!("create {name} {mib}"));
    let a = x.ask(&format!("export {name}"));
    assert_eq!(a["rc"], 0, "export {name}: {a}");
    format!("import {name} {} {}", x.pid, a["fd"])
}

/// What allocation `id` is charged beyond its one process's context.
fn held(bed: &Bed, id: &str) -> u64 {
    bed.used(id) - CONTEXT
}

/// The memory NVML shows for process `pid` on GPU 0, without its contexts.
fn shown(bed: &Bed, pid: i32) -> u64 {
    tessera_sim_state::read_processes(&bed.sim_dir)
        .unwrap()
        .iter()
        .find(|p| p.pid as i32 == pid)
        .map_or(0, |p| p.mem_bytes[0] - p.context_bytes[0])
}

#[test]
fn an_importer_keeps_what_it_maps_after_the_exporter_releases_and_sixteen_rounds_stop_at_the_limit()
{
    // The escape: X and Y, two processes of one 1 GiB allocation. Each round X creates 512 MiB,
    // exports it, Y imports and maps it, X releases its handle (never mapped). Uncounted, Y
    // ended with 8 GiB mapped, and the simulated card gave the memory back at X's release.
    let bed = Bed::new();
    let (token, id) = bed.create(GIB + 2 * CONTEXT);
    let (mut x, mut y) = (client(&bed, &token), client(&bed, &token));
    let contexts = 2 * bed.context_bytes();
    let mut mapped = 0;
    let mut refused = 0;
    for round in 0..16 {
        let import = create_and_export(&mut x, &format!("h{round}"), 512);
        match rc(&mut y, &import) {
            0 => {
                ok(&mut y, &format!("reserve r{round} 512"));
                ok(&mut y, &format!("map r{round} 0 h{round} 512"));
                mapped += 512 * MIB;
            }
            OOM => refused += 1,
            other => panic!("round {round}: import answered {other}"),
        }
        ok(&mut x, &format!("release h{round}"));
        assert!(
            bed.sim_used() <= GIB + contexts,
            "round {round}: the card holds {} bytes",
            bed.sim_used()
        );
        assert_eq!(
            bed.sim_used(),
            mapped + contexts,
            "round {round}: the card keeps what Y maps after X released it"
        );
        // X's release after a refusal goes back on the pressure channel, which the arbiter
        // books on its own time.
        wait_until(Duration::from_secs(30), || {
            bed.used(&id) == mapped + 2 * CONTEXT
        });
        assert_eq!(
            bed.used(&id),
            mapped + 2 * CONTEXT,
            "round {round}: charged to Y (and both contexts)"
        );
        assert_eq!(
            (shown(&bed, x.pid), shown(&bed, y.pid)),
            (0, mapped),
            "round {round}: NVML shows it for Y, which holds it"
        );
    }
    assert_eq!(
        (mapped, refused),
        (512 * MIB, 15),
        "one round fits; every further import is refused before passing the limit"
    );
    assert_eq!(bed.status(&id).enforced, 0, "refused, not killed");
    // Y killed, its mapping in place: the card and the allocation get the memory back.
    y.child.kill_and_reap();
    wait_until(Duration::from_secs(30), || bed.used(&id) == CONTEXT)
        .expect("nothing charged but X's context");
    assert_eq!(
        bed.sim_used(),
        bed.context_bytes(),
        "only X's context is left"
    );
    assert!(x.exit().success());
}

#[test]
fn the_same_rounds_with_the_descriptor_passed_over_a_unix_socket_stop_at_the_limit_unkilled() {
    // The escape as the issue ran it, in C: the descriptor travels by SCM_RIGHTS, the exporter
    // releases and closes its copy after each round, 16 rounds of 512 MiB under 1 GiB.
    let bed = Bed::new();
    let (token, id) = bed.create(GIB + 2 * CONTEXT);
    let exe = build_c(&bed, "vmm_share");
    let path = bed.dir.path().join("share.sock");
    let start = |role: &str| {
        let mut c = bed
            .tenant_command(&exe, &token)
            .args([role, path.to_str().unwrap(), "16", "512"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = std::io::BufRead::lines(std::io::BufReader::new(c.stdout.take().unwrap()));
        (tessera_testkit::KillOnDrop::new(c), out)
    };
    let (mut x, mut x_out) = start("export");
    assert_eq!(x_out.next().unwrap().unwrap(), "listening");
    let (mut y, y_out) = start("import");
    let lines: Vec<String> = y_out.map_while(Result::ok).take(17).collect();
    let mut want: Vec<String> = vec!["round 0 0 0".into()];
    want.extend((1..16).map(|i| format!("round {i} {OOM} -1")));
    want.push("done".into());
    assert_eq!(
        lines, want,
        "the first round maps; every further import is refused"
    );
    let released: Vec<String> = x_out.map_while(Result::ok).take(17).collect();
    assert!(
        released[..16].iter().all(|l| l.ends_with(" 0")),
        "{released:?}"
    );
    let contexts = 2 * bed.context_bytes();
    // Before and after three backstop polls, everything in place: Y holds its 512 MiB,
    // nothing else is left.
    assert_eq!(bed.sim_used(), 512 * MIB + contexts);
    bed.wait_backstop_polls(3);
    assert_eq!(bed.sim_used(), 512 * MIB + contexts);
    wait_until(Duration::from_secs(30), || {
        bed.used(&id) == 512 * MIB + 2 * CONTEXT
    });
    assert_eq!(
        bed.used(&id),
        512 * MIB + 2 * CONTEXT,
        "charged to the importer (and both contexts)"
    );
    assert_eq!(bed.status(&id).enforced, 0, "refused, not killed");
    assert!(alive(y.id()) && alive(x.id()), "{}", bed.arbiter_log());
    x.kill_and_reap();
    y.kill_and_reap();
}

#[test]
fn an_importer_mapping_before_the_exporter_maps_is_charged_to_its_own_allocation() {
    let bed = Bed::new();
    let (a_token, a) = bed.create(GIB + CONTEXT);
    let (b_token, b) = bed.create(GIB + CONTEXT);
    let (mut x, mut y) = (client(&bed, &a_token), client(&bed, &b_token));
    let contexts = 2 * bed.context_bytes();
    let import = create_and_export(&mut x, "h", 256);
    ok(&mut y, &import);
    ok(&mut y, "reserve r 256");
    ok(&mut y, "map r 0 h 256");
    assert_eq!((held(&bed, &a), held(&bed, &b)), (256 * MIB, 256 * MIB));
    ok(&mut x, "reserve r 256");
    ok(&mut x, "map r 0 h 256");
    assert_eq!(
        (held(&bed, &a), held(&bed, &b)),
        (256 * MIB, 256 * MIB),
        "the exporter's mapping adds nothing: its creation is charged"
    );
    assert_eq!(bed.sim_used(), 256 * MIB + contexts, "one copy on the card");
    ok(&mut x, "unmap r 0 256");
    ok(&mut x, "release h");
    assert_eq!(
        (held(&bed, &a), held(&bed, &b)),
        (0, 256 * MIB),
        "nothing of it is left on X's side"
    );
    assert_eq!(bed.sim_used(), 256 * MIB + contexts, "Y still holds it");
    ok(&mut y, "unmap r 0 256");
    assert_eq!(held(&bed, &b), 256 * MIB, "Y's handle still holds it");
    assert_eq!(bed.sim_used(), 256 * MIB + contexts);
    ok(&mut y, "release h");
    assert_eq!((held(&bed, &a), held(&bed, &b)), (0, 0));
    assert_eq!(
        bed.sim_used(),
        contexts,
        "the last holder let go: off the card"
    );
    assert!(x.exit().success() && y.exit().success());
}

#[test]
fn the_exporter_unmapping_after_the_importer_mapped_keeps_its_charge_until_its_release() {
    let bed = Bed::new();
    let (a_token, a) = bed.create(GIB + CONTEXT);
    let (b_token, b) = bed.create(GIB + CONTEXT);
    let (mut x, mut y) = (client(&bed, &a_token), client(&bed, &b_token));
    let contexts = 2 * bed.context_bytes();
    ok(&mut x, "create h 256");
    ok(&mut x, "reserve r 256");
    ok(&mut x, "map r 0 h 256");
    let a_ = x.ask("export h");
    let import = format!("import h {} {}", x.pid, a_["fd"]);
    ok(&mut y, &import);
    ok(&mut y, "reserve r 256");
    ok(&mut y, "map r 0 h 256");
    ok(&mut x, "unmap r 0 256");
    assert_eq!(
        (held(&bed, &a), held(&bed, &b)),
        (256 * MIB, 256 * MIB),
        "X unmapped but holds its handle"
    );
    ok(&mut x, "release h");
    assert_eq!((held(&bed, &a), held(&bed, &b)), (0, 256 * MIB));
    assert_eq!(bed.sim_used(), 256 * MIB + contexts, "Y's mapping keeps it");
    assert_eq!((shown(&bed, x.pid), shown(&bed, y.pid)), (0, 256 * MIB));
    ok(&mut y, "release h");
    assert_eq!(held(&bed, &b), 256 * MIB, "released but mapped");
    ok(&mut y, "unmap r 0 256");
    assert_eq!(held(&bed, &b), 0);
    assert_eq!(bed.sim_used(), contexts);
    assert!(x.exit().success() && y.exit().success());
}

#[test]
fn an_import_into_another_allocation_is_charged_there_once_and_refused_when_it_does_not_fit() {
    let bed = Bed::new();
    let (a_token, a) = bed.create(GIB + CONTEXT);
    let (b_token, b) = bed.create(GIB + CONTEXT);
    let (mut x, mut y) = (client(&bed, &a_token), client(&bed, &b_token));
    let contexts = 2 * bed.context_bytes();
    let import = create_and_export(&mut x, "h", 512);
    ok(&mut y, "create own 768");
    assert_eq!(rc(&mut y, &import), OOM, "768 + 512 MiB is past B's 1 GiB");
    assert_eq!(
        (held(&bed, &a), held(&bed, &b)),
        (512 * MIB, 768 * MIB),
        "the refusal charged nobody, and never A"
    );
    ok(&mut y, "release own");
    ok(&mut y, &import);
    // The same memory imported a second time by the same process counts once.
    ok(&mut y, &import.replacen(" h ", " h2 ", 1));
    ok(&mut y, "reserve r 1024");
    ok(&mut y, "map r 0 h 512");
    ok(&mut y, "map r 512 h2 512");
    assert_eq!((held(&bed, &a), held(&bed, &b)), (512 * MIB, 512 * MIB));
    assert_eq!(bed.sim_used(), 512 * MIB + contexts);
    assert_eq!(rc(&mut y, "alloc 768"), OOM, "B's limit holds the import");
    assert_eq!(rc(&mut y, "alloc 512"), 0);
    ok(&mut x, "release h");
    assert_eq!(held(&bed, &a), 0);
    ok(&mut y, "free_va r");
    ok(&mut y, "release h");
    assert_eq!(
        held(&bed, &b),
        512 * MIB,
        "the second import still holds it"
    );
    ok(&mut y, "release h2");
    assert_eq!((held(&bed, &a), held(&bed, &b)), (0, 0));
    assert_eq!(bed.sim_used(), contexts);
    assert!(x.exit().success() && y.exit().success());
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
    // NVML's truth before and after three backstop polls, mappings in place: exactly the
    // limit (plus the context every process has), so the interposer refused and the backstop
    // had nothing to do.
    for look in 0..2 {
        assert_eq!(
            bed.sim_used(),
            GIB + bed.context_bytes(),
            "the card holds the two mapped 512 MiB and the process's context, nothing else"
        );
        if look == 0 {
            bed.wait_backstop_polls(3);
        }
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
