//! One allocation spanning several simulated GPUs, end to end: the real arbiter, the built
//! interposer and a C client that uses several devices from one process.

mod common;

use std::time::Duration;

use common::*;
use tessera_protocol::CreateAllocation;

const OOM: i64 = 2;

/// A 2-GPU allocation of `limits` (GPU 0, GPU 1), share 30 each; returns (token, ids).
fn group(bed: &Bed, limits: [u64; 2]) -> (String, Vec<String>) {
    let slices: Vec<CreateAllocation> = limits
        .iter()
        .enumerate()
        .map(|(i, &m)| tessera_testkit::allocation(i as u32, m, 30, None))
        .collect();
    let (token, allocs) = bed.admin().create_group(slices, None).unwrap();
    (token, allocs.into_iter().map(|a| a.id).collect())
}

/// The numbers after `prefix` on the line that starts with it.
fn nums(out: &str, prefix: &str) -> Vec<i64> {
    let line = out
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in:\n{out}"));
    line[prefix.len()..]
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

#[test]
fn one_process_on_both_devices_is_refused_at_each_devices_own_limit() {
    let bed = Bed::with_gpus("2x80GiB", &[]);
    let (token, ids) = group(&bed, [10 * GIB, 20 * GIB]);
    let prog = build_c(&bed, "multi_gpu");
    let (st, out, err) = run(bed
        .tenant_command(&prog, &token)
        .args(["2", &GIB.to_string()]));
    assert!(st.success(), "{out}\n{err}");
    for (d, limit) in [(0, 10 * GIB), (1, 20 * GIB)] {
        // cuMemGetInfo and cuDeviceTotalMem answer each device's own limit.
        let info = nums(&out, &format!("dev {d} info "));
        assert_eq!(info[1] as u64, limit, "dev {d} total: {out}");
        assert_eq!(info[0] as u64, limit - CONTEXT, "dev {d} free: {out}");
        assert_eq!(info[2] as u64, limit, "dev {d} cuDeviceTotalMem: {out}");
        // NVML answers per device too, whichever context is current (device 0's here).
        assert_eq!(nums(&out, &format!("nvml {d} "))[0] as u64, limit, "{out}");
        // Whole chunks up to that limit and not one more: the other device's room never
        // counts here.
        let got = nums(&out, &format!("dev {d} got "));
        assert_eq!(got[0] as u64, (limit - CONTEXT) / GIB, "dev {d}: {out}");
        assert_eq!(got[1], OOM, "dev {d} refused with OUT_OF_MEMORY: {out}");
        // Its first chunk, freed while device 0 was current, went back to its own device.
        assert_eq!(nums(&out, &format!("freed {d} "))[0], 0, "{out}");
        let after = nums(&out, &format!("dev {d} after "))[0] as u64;
        assert_eq!(
            after,
            limit - CONTEXT - ((limit - CONTEXT) / GIB - 1) * GIB,
            "{out}"
        );
    }
    // Everything released once the process is gone (the arbiter sees its sockets close).
    for id in &ids {
        let gone = tessera_testkit::process::wait_until(std::time::Duration::from_secs(10), || {
            bed.used(id) == 0
        });
        assert!(gone.is_some(), "slice {id} still holds {}", bed.used(id));
    }
}

#[test]
fn two_processes_one_per_device_are_each_held_to_their_devices_limit() {
    let bed = Bed::with_gpus("2x80GiB", &[]);
    let (token, _ids) = group(&bed, [10 * GIB, 20 * GIB]);
    let prog = build_c(&bed, "multi_gpu");
    let uuids: Vec<String> = bed
        .admin()
        .gpus()
        .unwrap()
        .into_iter()
        .map(|g| g.uuid)
        .collect();
    // As TP ranks run: each sees only its own GPU, as its ordinal 0.
    let mut ranks: Vec<_> = [0usize, 1]
        .iter()
        .map(|&r| {
            let mut cmd = bed.tenant_command(&prog, &token);
            cmd.env("CUDA_VISIBLE_DEVICES", &uuids[r])
                .args(["1", &GIB.to_string()])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let outs: Vec<String> = ranks
        .drain(..)
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success());
            String::from_utf8_lossy(&o.stdout).into_owned()
        })
        .collect();
    for (r, limit) in [(0, 10 * GIB), (1, 20 * GIB)] {
        let out = &outs[r];
        assert_eq!(nums(out, "dev 0 info ")[1] as u64, limit, "rank {r}: {out}");
        let got = nums(out, "dev 0 got ");
        assert_eq!(got[0] as u64, (limit - CONTEXT) / GIB, "rank {r}: {out}");
        assert_eq!(got[1], OOM, "rank {r}: {out}");
    }
}

#[test]
fn a_device_outside_the_allocation_gets_nothing_and_a_neighbours_room_is_not_taken() {
    let bed = Bed::with_gpus("3x80GiB", &[]);
    let (token, ids) = group(&bed, [10 * GIB, 20 * GIB]);
    // A neighbour on GPU 2 with room to spare.
    let (_, neighbour) = bed
        .admin()
        .create(tessera_testkit::allocation(2, 40 * GIB, 30, None))
        .unwrap();
    let prog = build_c(&bed, "multi_gpu");
    let (st, out, err) = run(bed
        .tenant_command(&prog, &token)
        .args(["3", &GIB.to_string()]));
    assert!(st.success(), "{out}\n{err}");
    // Device 2 is not the tenant's: not even a context there (its cost cannot be reserved
    // on any slice), and nothing charged to the neighbour (nor to the tenant's own GPUs).
    assert_eq!(nums(&out, "dev 2 context "), [OOM], "{out}");
    assert!(!out.contains("dev 2 got"), "{out}");
    assert_eq!(bed.used(&neighbour.id), 0);
    assert_eq!(bed.status(&neighbour.id).oom_refusals, 0);
    assert_eq!(
        nums(&out, "dev 0 got ")[0] as u64,
        (10 * GIB - CONTEXT) / GIB,
        "{out}"
    );
    let _ = ids;
}

#[test]
fn vmm_memory_of_one_device_mapped_for_both_is_counted_on_the_device_that_holds_it() {
    let bed = Bed::with_gpus("2x80GiB", &[]);
    let (token, ids) = group(&bed, [10 * GIB, 20 * GIB]);
    let prog = build_c(&bed, "multi_vmm");
    let (st, out, err) = run(bed.tenant_command(&prog, &token).arg("2048"));
    assert!(st.success(), "{out}\n{err}");
    for step in ["create ", "mapped ", "released ", "peer ", "unmapped "] {
        assert_eq!(nums(&out, step), [0], "{step}: {out}\n{err}");
    }
    // Made while device 0 was current, for device 1, mapped and accessible from both: only
    // device 1's slice holds the 2 GiB (the 4 KiB peer-copy source is device 0's), and
    // unmapping (with device 0 current) gives them back to device 1.
    let free = |what: &str, d: usize| nums(&out, &format!("{what} {d} "))[0] as u64;
    assert_eq!(free("free", 0), 10 * GIB - CONTEXT - 4096, "{out}");
    assert_eq!(free("free", 1), 20 * GIB - CONTEXT - 2 * GIB, "{out}");
    assert_eq!(free("after", 0), 10 * GIB - CONTEXT - 4096, "{out}");
    assert_eq!(free("after", 1), 20 * GIB - CONTEXT, "{out}");
    let _ = ids;
}

#[test]
fn tessera_run_on_two_gpus_holds_each_to_the_limit_per_gpu_and_cleans_up() {
    let bed = Bed::with_gpus("2x80GiB", &[]);
    let prog = build_c(&bed, "multi_gpu");
    let mut cmd = bed.sim_command(&tessera_testkit::artifact("tessera"));
    cmd.args(["run", "--gpu", "0,1", "--memory", "4GiB", "--share", "30"])
        .arg("--interposer")
        .arg(interposer())
        .arg("--tenant-socket")
        .arg(&bed.socket)
        .arg("--admin-socket")
        .arg(&bed.admin_socket)
        .arg("--")
        .arg(&prog)
        .args(["2", &GIB.to_string()]);
    let (st, out, err) = run(&mut cmd);
    assert!(st.success(), "{out}\n{err}");
    for d in [0, 1] {
        assert_eq!(
            nums(&out, &format!("dev {d} info "))[1] as u64,
            4 * GIB,
            "{out}"
        );
        assert_eq!(
            nums(&out, &format!("dev {d} got ")),
            [((4 * GIB - CONTEXT) / GIB) as i64, OOM],
            "{out}"
        );
    }
    // Both slices are deleted when the command ends.
    assert!(bed.admin().list().unwrap().is_empty());
}

#[test]
fn the_backstop_polices_each_card_on_its_own_slice() {
    // Polled every 50 ms with no tolerance: an honest process holding 10 GiB on card 0 and
    // 20 GiB on card 1 (each slice at its limit, 30 GiB in all) is never touched: card 1's
    // memory is charged to card 1's slice, never summed into card 0's 10 GiB.
    let bed = Bed::with_gpus(
        "2x80GiB",
        &["--backstop-interval-ms", "50", "--backstop-slack-mib", "0"],
    );
    let (token, _ids) = group(&bed, [10 * GIB, 20 * GIB]);
    let prog = build_c(&bed, "multi_gpu");
    let (st, out, err) =
        run(bed
            .tenant_command(&prog, &token)
            .args(["2", &(512 * MIB).to_string(), "1500"]));
    assert!(
        st.success(),
        "killed? {st:?}\n{out}\n{err}\n{}",
        bed.arbiter_log()
    );
    assert!(out.contains("done"), "{out}");
    assert!(out.contains("holding"), "{out}");
    let log = bed.arbiter_log();
    assert!(!log.contains("backstop: pid"), "{log}");
}

#[test]
fn an_allocation_of_one_card_gets_no_context_on_another_card() {
    // A one-GPU allocation that sees both cards (its CUDA_VISIBLE_DEVICES widened, or a host
    // process) is refused a context on the card it was not given: nothing there, nothing
    // charged to the card's owner, its own card as before.
    let bed = Bed::with_gpus("2x80GiB", &[]);
    let (token, _id) = bed.create(10 * GIB);
    let (_, owner) = bed
        .admin()
        .create(tessera_testkit::allocation(1, 80 * GIB, 90, None))
        .unwrap();
    let prog = build_c(&bed, "multi_gpu");
    let (st, out, err) = run(bed
        .tenant_command(&prog, &token)
        .args(["2", &GIB.to_string()]));
    assert!(st.success(), "{out}\n{err}");
    assert_eq!(nums(&out, "dev 1 context "), [OOM], "{out}");
    assert!(!out.contains("dev 1 got"), "{out}");
    assert_eq!(bed.used(&owner.id), 0);
    assert_eq!(
        nums(&out, "dev 0 got ")[0] as u64,
        (10 * GIB - CONTEXT) / GIB,
        "{out}"
    );
}

#[test]
fn a_process_on_a_card_it_was_not_given_is_stopped_and_the_owner_gets_its_whole_limit() {
    // Issue 35: a 40 GiB allocation on card 0 whose child, without the interposer, takes
    // 3.8 GiB of card 1, fully promised to an 80 GiB allocation: within the first one's limit
    // summed, yet not its card. The backstop stops it; the owner then gets all of its 80 GiB.
    let bed = Bed::with_gpus("2x80GiB", &["--backstop-interval-ms", "100"]);
    let (token, id) = bed.create(40 * GIB);
    let (owner_token, _) = bed
        .admin()
        .create(tessera_testkit::allocation(1, 80 * GIB, 90, None))
        .unwrap();
    let mut parent = Served::start(bed.py_tenant(&token, &["serve"]));
    assert_eq!(parent.ask(&format!("alloc {}", 100 * MIB))["alloc"], 0);
    let spawned = parent.ask(&format!("spawn_bare {} 1", 3_800 * MIB));
    let child = spawned["child"].as_u64().unwrap() as u32;
    let took = wait_until(Duration::from_secs(30), || !alive(child)).unwrap_or_else(|| {
        panic!(
            "the process on card 1 was not stopped: {spawned}\n{}",
            bed.arbiter_log()
        )
    });
    eprintln!("a process on a card not its own: stopped {took:?} after its allocation returned");
    let line = format!("pid {child} of allocation {id} killed");
    wait_until(Duration::from_secs(30), || {
        bed.arbiter_log().contains(&line)
    })
    .unwrap_or_else(|| panic!("no log line\n{}", bed.arbiter_log()));
    // The owner of card 1 gets its whole limit (its context inside it).
    let prog = build_c(&bed, "multi_gpu");
    let (st, out, err) = run(bed
        .tenant_command(&prog, &owner_token)
        .env("CUDA_VISIBLE_DEVICES", "1")
        .args(["1", &GIB.to_string()]));
    assert!(st.success(), "{out}\n{err}");
    assert_eq!(
        nums(&out, "dev 0 got ")[0] as u64,
        (80 * GIB - CONTEXT) / GIB,
        "{out}"
    );
    // The honest parent on its own card is untouched.
    assert_eq!(parent.ask(&format!("alloc {}", 100 * MIB))["alloc"], 0);
    assert!(parent.exit().success());
}
