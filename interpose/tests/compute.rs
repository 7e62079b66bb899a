//! Compute sharing, end to end: real `cuda-bindings` processes launching kernels on the
//! simulated GPU (one engine shared by all processes), the real arbiter's lease scheduler, and
//! the interposer's launch gating. GPU time per process comes from the simulator's own engine
//! accounting (the ground truth), not from anything the interposer reports.

mod common;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Timing tests share two cores: run them one at a time within this binary.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits (generously) until `pid`'s kernels have run on the simulated engine: the tenant is
/// connected and launching, whatever the machine's load.
fn running_on_the_engine(bed: &Bed, pid: u32) {
    wait_until(Duration::from_secs(30), || {
        busy_by_pid(bed).get(&pid).is_some_and(|&ns| ns > 0)
    })
    .unwrap_or_else(|| panic!("{pid} never ran a kernel\n{}", bed.arbiter_log()));
}

fn busy_by_pid(bed: &Bed) -> HashMap<u32, u64> {
    tessera_sim_state::read_processes(&bed.sim_dir)
        .unwrap()
        .into_iter()
        .map(|p| (p.pid, p.busy_ns.first().copied().unwrap_or(0)))
        .collect()
}

/// The Python client under the interposer with `token`, output piped.
fn client(bed: &Bed, token: &str, args: &[&str]) -> Command {
    let mut cmd = bed.tenant_command(&python(), token);
    cmd.arg(script("compute_client.py"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn spawn_client(bed: &Bed, token: &str, args: &[&str]) -> Child {
    client(bed, token, args).spawn().unwrap()
}

/// Waits for a client; returns its JSON line. A failure shows the arbiter's log (a backstop
/// action would be there).
fn finish(bed: &Bed, c: Child) -> serde_json::Value {
    let out = c.wait_with_output().unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "client failed ({:?}): {so}\n{se}\narbiter log:\n{}",
        out.status,
        bed.arbiter_log()
    );
    last_json(&so, &se)
}

/// Engine busy ns of the processes whose pids are given, sampled while they run (the
/// simulator drops a process's record once it exited).
fn watch_busy(bed: &Bed, pids: &[u32], until: impl Fn() -> bool) -> HashMap<u32, u64> {
    let mut last: HashMap<u32, u64> = HashMap::new();
    while !until() {
        for (pid, busy) in busy_by_pid(bed) {
            if pids.contains(&pid) {
                last.insert(pid, busy);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    last
}

#[test]
fn two_shares_are_both_served_and_charged_what_they_ran() {
    let _serial = serial();
    let bed = Bed::new();
    let (a_token, a_id) = bed.create_with(GIB, 30, None);
    let (b_token, b_id) = bed.create_with(GIB, 70, None);
    let t0 = tessera_sim_state::device_busy_ns(&bed.sim_dir, 0);
    let start = Instant::now();
    let a = spawn_client(&bed, &a_token, &["kernel", "4", "2"]);
    let b = spawn_client(&bed, &b_token, &["kernel", "4", "2"]);
    let pids = [a.id(), b.id()];
    let busy = watch_busy(&bed, &pids, || !pids.iter().any(|&p| alive(p)));
    let wall = start.elapsed();
    let (ja, jb) = (finish(&bed, a), finish(&bed, b));
    let (ba, bb) = (busy[&pids[0]] as f64, busy[&pids[1]] as f64);
    let device = (tessera_sim_state::device_busy_ns(&bed.sim_dir, 0) - t0) as f64;
    let share_a = ba / (ba + bb);
    eprintln!(
        "30/70: A busy {:.2} s ({} launches), B busy {:.2} s ({} launches), A's fraction {share_a:.3}, \
         device busy {:.2} s of {:.2} s wall; arbiter charged A {:.2} s, B {:.2} s",
        ba / 1e9,
        ja["launches"],
        bb / 1e9,
        jb["launches"],
        device / 1e9,
        wall.as_secs_f64(),
        bed.status(&a_id).gpu_time_10s_ns as f64 / 1e9,
        bed.status(&b_id).gpu_time_10s_ns as f64 / 1e9,
    );
    // The split itself is a figure (`compute_share`, 30/70 row); here both are served and
    // charged for what they ran.
    for (id, busy) in [(&a_id, ba), (&b_id, bb)] {
        let st = bed.status(id);
        assert!(busy > 0.0 && st.leases >= 2, "{id} was not served: {st:?}");
        assert!(
            st.gpu_time_total_ns as f64 >= 0.9 * busy,
            "{id} ran {busy} ns but was charged {} ns",
            st.gpu_time_total_ns
        );
    }
}

#[test]
fn a_tenant_that_synchronises_after_every_launch_runs_beside_a_free_running_one() {
    // A waits for each kernel before launching the next, so its queue drains after every
    // launch: if a drain alone looked like idleness, A would hand its lease back each time
    // and B (launching freely) would take most of the GPU.
    let _serial = serial();
    let bed = Bed::new();
    let (a_token, _) = bed.create_with(GIB, 50, None);
    let (b_token, _) = bed.create_with(GIB, 50, None);
    let a = spawn_client(&bed, &a_token, &["sync", "3", "2"]);
    let b = spawn_client(&bed, &b_token, &["kernel", "3", "2"]);
    let pids = [a.id(), b.id()];
    let busy = watch_busy(&bed, &pids, || !pids.iter().any(|&p| alive(p)));
    let (ja, jb) = (finish(&bed, a), finish(&bed, b));
    let (ba, bb) = (busy[&pids[0]] as f64, busy[&pids[1]] as f64);
    let share_a = ba / (ba + bb);
    eprintln!(
        "sync-every-launch vs free-running, 50/50: A busy {:.2} s ({} launches), B busy {:.2} s \
         ({} launches), A's fraction {share_a:.3}",
        ba / 1e9,
        ja["launches"],
        bb / 1e9,
        jb["launches"],
    );
    // Its part is `compute_share --only sync`'s figure; here it ran and finished.
    assert!(
        ba > 0.0 && ja["launches"].as_u64().unwrap_or(0) > 0,
        "A never ran"
    );
}

#[test]
fn a_tenant_with_host_work_between_steps_runs_beside_a_free_running_one() {
    // A waits for each kernel, then works 0.6 ms on the host before the next launch (a
    // training loop reading its loss): longer than the shortest drain wait, so a fixed
    // threshold would hand the lease back at every step. The gap is learnt instead.
    let _serial = serial();
    let bed = Bed::new();
    let (a_token, _) = bed.create_with(GIB, 50, None);
    let (b_token, _) = bed.create_with(GIB, 50, None);
    let a = client(&bed, &a_token, &["sync_host", "3", "2"])
        .env("TESSERA_LOG", "debug")
        .spawn()
        .unwrap();
    let b = spawn_client(&bed, &b_token, &["kernel", "3", "2"]);
    let pids = [a.id(), b.id()];
    let busy = watch_busy(&bed, &pids, || !pids.iter().any(|&p| alive(p)));
    let out = a.wait_with_output().unwrap();
    let a_log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "A failed:\n{a_log}");
    let _ = finish(&bed, b);
    let leases: Vec<&str> = a_log.lines().filter(|l| l.contains("ms granted")).collect();
    let early = leases.iter().filter(|l| l.contains("early true")).count();
    let (ba, bb) = (busy[&pids[0]] as f64, busy[&pids[1]] as f64);
    let share_a = ba / (ba + bb);
    eprintln!(
        "sync + host work vs free-running, 50/50: A's fraction {share_a:.3}; {early} of A's {} leases handed back early",
        leases.len()
    );
    assert!(leases.len() >= 10, "A's leases were not logged:\n{a_log}");
    // How often A hands back early and its part of the GPU depend on the machine's timing:
    // `compute_share --only sync` measures them. Here: its leases were logged and it ran.
    assert!(ba > 0.0, "A never ran");
}

#[test]
fn a_capped_tenant_alone_stays_under_its_cap() {
    let _serial = serial();
    let bed = Bed::new();
    let (token, id) = bed.create_with(GIB, 30, Some(30));
    let start = Instant::now();
    let c = spawn_client(&bed, &token, &["kernel", "3", "2"]);
    let pid = c.id();
    let busy = watch_busy(&bed, &[pid], || !alive(pid));
    let j = finish(&bed, c);
    let wall = start.elapsed().as_secs_f64();
    let st = bed.status(&id);
    let (ran, charged) = (busy[&pid] as f64 / 1e9, st.gpu_time_total_ns as f64 / 1e9);
    eprintln!(
        "cap 30: busy {ran:.2} s over {:.2} s of launching ({wall:.2} s wall): {:.3}; arbiter charged {charged:.2} s",
        j["launched_for"],
        ran / j["launched_for"].as_f64().unwrap(),
    );
    // How close to 30% it gets is `compute_share`'s cap row. Here: it ran, it was charged what
    // it ran, and neither the charge nor the engine's work went past the cap over the time it
    // existed by more than a second (a late revocation on a loaded machine overruns a lease;
    // an uncapped tenant would take all of the ~3 s).
    assert!(
        ran > 0.0 && st.leases >= 2,
        "the capped tenant never ran: {st:?}"
    );
    assert!(
        charged >= 0.9 * ran,
        "ran {ran:.3} s, charged {charged:.3} s"
    );
    let ceiling = 0.30 * wall + 1.0;
    assert!(
        charged <= ceiling && ran <= ceiling,
        "capped at 30% of {wall:.2} s, charged {charged:.3} s, ran {ran:.3} s"
    );
}

#[test]
fn a_lone_tenant_runs_its_kernels() {
    let _serial = serial();
    let bed = Bed::new();
    let (token, _) = bed.create_with(GIB, 10, None);
    let c = spawn_client(&bed, &token, &["kernel", "2", "2"]);
    let pid = c.id();
    let busy = watch_busy(&bed, &[pid], || !alive(pid));
    let j = finish(&bed, c);
    let frac = busy[&pid] as f64 / 1e9 / j["launched_for"].as_f64().unwrap();
    eprintln!("lone tenant: GPU busy {frac:.3} of its launching time");
    // How busy is `compute_share`'s total row; here the gate let it run its kernels.
    assert!(
        j["launches"].as_u64().unwrap_or(0) > 0 && busy[&pid] > 0,
        "the lone tenant never ran: {j}"
    );
}

#[test]
fn every_launch_path_is_gated() {
    let _serial = serial();
    let bed = Bed::new();
    let exe = build_c(&bed, "launch_ptsz");
    for mode in ["kernel", "ex", "coop", "graph", "per_thread", "c_ptsz"] {
        let (token, id) = bed.create_with(GIB, 10, None);
        let c = if mode == "c_ptsz" {
            bed.tenant_command(&exe, &token)
                .args(["0.5", "2"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        } else {
            spawn_client(&bed, &token, &[mode, "0.5", "2"])
        };
        let pid = c.id();
        let busy = watch_busy(&bed, &[pid], || !alive(pid));
        let j = finish(&bed, c);
        if mode == "c_ptsz" {
            assert_eq!(
                j["resolved"], "cuLaunchKernel_ptsz",
                "flag 2 hands out the _ptsz wrapper"
            );
        }
        // Work only runs under leases: the time leased covers most of the engine time used
        // (an ungated path asks for no lease at all, so it would be charged next to nothing).
        // Not all of it: on a loaded host kernels overrun their leases (the backstop forgives
        // that within the GPU's slack or charges it), and 85% was seen beside a CPU hog.
        // The last lease's release may reach the arbiter after the process exited: waited for
        // (a few seconds only: the count is over the last 10 s).
        assert!(busy[&pid] > 0, "{mode}: no work ran");
        let covered = || bed.status(&id).gpu_time_10s_ns as f64 >= 0.5 * busy[&pid] as f64;
        let _ = wait_until(Duration::from_secs(3), covered);
        let charged = bed.status(&id).gpu_time_10s_ns;
        eprintln!(
            "{mode}: {} launches, engine busy {:.3} s, leased {:.3} s",
            j["launches"],
            busy[&pid] as f64 / 1e9,
            charged as f64 / 1e9
        );
        assert!(
            charged as f64 >= 0.5 * busy[&pid] as f64,
            "{mode}: {:.3} s of GPU time ran mostly outside leases (leased {:.3} s)",
            busy[&pid] as f64 / 1e9,
            charged as f64 / 1e9
        );
        bed.admin().delete(&id).unwrap();
    }
}

#[test]
fn a_graph_captured_beside_a_busy_lease_is_not_broken_by_the_lease_manager() {
    // While an application thread captures a CUDA graph in the global mode (torch.cuda.graph's
    // default), the lease manager keeps querying its events beside it: in that mode a query
    // from any thread ends the capture (the simulator enforces it as the card does), and on an
    // H200 torch.cuda.graph failed under Tessera in one run of two. The manager thread runs in
    // the relaxed mode.
    let _serial = serial();
    let bed = Bed::new();
    let (token, _) = bed.create_with(GIB, 50, None);
    let c = spawn_client(&bed, &token, &["capture_busy", "3", "1"]);
    let j = finish(&bed, c);
    eprintln!(
        "capture beside a lease: {} launches, {} captures, {} failed ({})",
        j["launches"], j["captures"], j["capture_failures"], j["capture_error"]
    );
    assert!(j["captures"].as_u64().unwrap() >= 20, "{j}");
    assert_eq!(j["capture_failures"], 0, "{j}\n{}", bed.arbiter_log());
}

#[test]
fn synchronous_calls_inside_a_lease_do_not_deadlock() {
    let _serial = serial();
    let bed = Bed::new();
    let (a_token, _) = bed.create_with(GIB, 50, None);
    let (b_token, _) = bed.create_with(GIB, 50, None);
    // A: 30 ms kernels, each followed by cuCtxSynchronize (leases end while it waits);
    // B: a steady stream of 2 ms kernels.
    let a = spawn_client(&bed, &a_token, &["sync", "2", "30"]);
    let b = spawn_client(&bed, &b_token, &["kernel", "2", "2"]);
    let pids = [a.id(), b.id()];
    let t = Instant::now();
    let busy = watch_busy(&bed, &pids, || {
        !pids.iter().any(|&p| alive(p)) || t.elapsed() > Duration::from_secs(30)
    });
    assert!(t.elapsed() < Duration::from_secs(30), "tenants hung");
    let (ja, jb) = (finish(&bed, a), finish(&bed, b));
    eprintln!(
        "sync: A {} launches busy {:.2} s; B {} launches busy {:.2} s",
        ja["launches"],
        busy[&pids[0]] as f64 / 1e9,
        jb["launches"],
        busy[&pids[1]] as f64 / 1e9
    );
    // Both progressed, A past synchronises inside its leases (launches after the first).
    // Their split is printed, and measured by `compute_share --only sync`; how much each got
    // depends on the machine's speed, not asserted here.
    let frac_a = busy[&pids[0]] as f64 / (busy[&pids[0]] + busy[&pids[1]]) as f64;
    eprintln!("sync: equal shares split {frac_a:.3} / {:.3}", 1.0 - frac_a);
    assert!(ja["launches"].as_u64().unwrap() >= 2, "{ja}");
    assert!(
        busy[&pids[0]] > 0 && busy[&pids[1]] > 0,
        "both must progress: {busy:?}"
    );
}

#[test]
fn every_synchronise_wakes_the_lease_manager() {
    // A returning synchronise tells the manager watching for a drain at once (that is what
    // makes an idle holder's hand-back prompt). Each variant, however resolved, must do it:
    // the interposer's per-lease debug line counts those wake-ups.
    let _serial = serial();
    let bed = Bed::new();
    let exe = build_c(&bed, "launch_ptsz");
    for mode in ["sync", "sync_stream", "sync_event", "c_ptsz"] {
        let (token, id) = bed.create_with(GIB, 10, None);
        let mut cmd = if mode == "c_ptsz" {
            let mut c = bed.tenant_command(&exe, &token);
            c.args(["0.3", "2", "sync"]);
            c
        } else {
            client(&bed, &token, &[mode, "0.3", "2"])
        };
        let (status, stdout, stderr) = run(cmd.env("TESSERA_LOG", "debug"));
        assert!(status.success(), "{mode}: {stdout}\n{stderr}");
        let j: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        if mode == "c_ptsz" {
            assert_eq!(
                j["resolved_sync"], "cuStreamSynchronize_ptsz",
                "flag 2 hands out the _ptsz wrapper"
            );
        }
        let launches = j["launches"].as_u64().unwrap();
        let wakes: Vec<u64> = stderr
            .lines()
            .filter_map(|l| l.split("synchronise wakes ").nth(1))
            .filter_map(|v| v.split(',').next()?.trim().parse().ok())
            .collect();
        let total: u64 = wakes.iter().sum();
        eprintln!(
            "{mode}: {launches} launches each synchronised, {} leases, {total} synchronise \
             wake-ups",
            wakes.len()
        );
        assert!(!wakes.is_empty(), "{mode}: no lease was logged:\n{stderr}");
        // Each kernel is waited for; a synchronise the hook misses wakes nothing (a missing
        // hook: none at all). How many fit in 0.3 s depends on the host's load (about 150 of
        // 2 ms on a quiet one, 19 beside a CPU hog), so the count is taken against the
        // client's own launches: 58-95% of them woke it beside one CPU hog, 21% beside a hog
        // and a CI run; a tenth is the floor.
        assert!(
            total * 10 >= launches && total >= 2,
            "{mode}: only {total} synchronise wake-ups for {launches} synchronised launches \
             in {} leases",
            wakes.len()
        );
        bed.admin().delete(&id).unwrap();
    }
}

#[test]
fn a_launcher_cancelled_while_waiting_for_a_lease_exits_cleanly() {
    // The first waiting launcher blocks in `recv` for the grant, a cancellation point: a
    // `pthread_cancel` acted on there would unwind through the interposer (an abort). It must
    // wait until the launch returned and the thread reached its own cancellation point.
    let _serial = serial();
    let bed = Bed::new();
    let exe = build_c(&bed, "cancel_launcher");
    let (a_token, _) = bed.create_with(GIB, 50, None);
    let (c_token, _) = bed.create_with(GIB, 50, None);
    let a = spawn_client(&bed, &a_token, &["kernel", "4", "2"]);
    running_on_the_engine(&bed, a.id());
    let (status, stdout, stderr) = run(bed.tenant_command(&exe, &c_token).args(["12", "40"]));
    let _ = finish(&bed, a);
    assert!(
        status.success(),
        "the client died: {status:?}\n{stdout}\n{stderr}"
    );
    let j: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    eprintln!("cancel: {j}");
    assert_eq!(
        j["cancelled"], 12,
        "every launcher thread ends by cancellation: {j}"
    );
    assert!(
        j["launches"].as_u64().unwrap() > 0,
        "the launchers never ran: {j}"
    );
}

#[test]
fn an_idle_holder_hands_back_early() {
    let _serial = serial();
    let bed = Bed::new();
    let (a_token, _) = bed.create_with(GIB, 50, None);
    let (b_token, _) = bed.create_with(GIB, 50, None);
    // A is alone for a second (its leases grow towards 100 ms), then stops launching but stays
    // alive. B then asks: without an early hand-back it would wait out A's lease.
    // Its per-lease debug lines say which leases it handed back early.
    let mut a = client(&bed, &a_token, &["kernel", "1", "2", "3"])
        .env("TESSERA_LOG", "debug")
        .spawn()
        .unwrap();
    let a_pid = a.id();
    let mut a_out = a.stdout.take().unwrap();
    let mut line = String::new();
    use std::io::Read;
    let mut byte = [0u8; 1];
    while !line.ends_with('\n') {
        assert_eq!(a_out.read(&mut byte).unwrap(), 1, "A ended early");
        line.push(byte[0] as char);
    }
    assert!(alive(a_pid), "A lingers holding no work");
    let b = spawn_client(&bed, &b_token, &["sync", "0.3", "2"]);
    let jb = finish(&bed, b);
    let first = jb["first_done_after"].as_f64().unwrap();
    eprintln!(
        "early hand-back: B's first 2 ms kernel done {:.1} ms after it started",
        first * 1e3
    );
    // How soon B ran is a figure (above, and `compute_share --only idle`'s reclaim latency);
    // here B was served, and A's own log shows it kept no lease idle: its last one was handed
    // back early, or was busy to its end (A stopped at a lease's end: nothing to hand back).
    assert!(jb["launches"].as_u64().unwrap_or(0) > 0, "{jb}");
    let out = a.wait_with_output().unwrap();
    let a_log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "A failed:\n{a_log}");
    let last = a_log
        .lines()
        .rfind(|l| l.contains("ms granted"))
        .unwrap_or_else(|| panic!("A's leases were not logged:\n{a_log}"));
    let ms = |key: &str| -> f64 {
        last.split(key)
            .nth(1)
            .and_then(|t| t.split(" ms").next())
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {last:?}"))
    };
    let (granted, busy) = (ms("): "), ms("busy "));
    assert!(
        last.contains("early true") || busy >= 0.9 * granted,
        "A held its last lease idle to its end ({busy} of {granted} ms busy):\n{a_log}"
    );
}

#[test]
fn launches_keep_running_while_the_arbiter_restarts() {
    let _serial = serial();
    let mut bed = Bed::new();
    let (token, id) = bed.create_with(GIB, 50, None);
    let c = spawn_client(&bed, &token, &["kernel", "3", "2"]);
    let pid = c.id();
    running_on_the_engine(&bed, pid);
    bed.kill_arbiter();
    std::thread::sleep(Duration::from_millis(500));
    bed.start_arbiter();
    let busy = watch_busy(&bed, &[pid], || !alive(pid));
    let j = finish(&bed, c);
    let launched_for = j["launched_for"].as_f64().unwrap();
    let frac = busy[&pid] as f64 / 1e9 / launched_for;
    // Leases resume after the restart: the new arbiter (its counts start with it) granted
    // the tenant leases and charged it.
    let st = bed.status(&id);
    let tail = j["finished_after"].as_f64().unwrap() - launched_for;
    eprintln!(
        "restart: {} launches, GPU busy {frac:.3}, {tail:.3} s of queued work at the end, charged by the new arbiter {:.2} s in {} leases",
        j["launches"],
        st.gpu_time_total_ns as f64 / 1e9,
        st.leases
    );
    // How busy it stayed is a figure (printed above); here it was served after the restart,
    // and the work queued during the outage was bounded (generously: a 3 s run on a loaded
    // machine, the bound is one-sided).
    assert!(
        busy[&pid] > 0 && st.leases >= 1 && st.gpu_time_total_ns > 0,
        "gating did not resume after the restart: {st:?}"
    );
    assert!(
        tail < 2.0,
        "work in flight was not bounded during the outage: {tail:.3} s queued"
    );
}

#[test]
fn a_tenant_that_launches_around_the_gate_is_killed_and_its_neighbour_is_not() {
    // Share 10 against a saturating share 90; the GPU time is compared over the first 10 s.
    // The bypasser runs up to 45 s and the test waits for its kill, which comes once it has
    // used 500 ms of unleased time beyond the GPU's slack (after a 2 s warm-up): at 5-8% of
    // the GPU against a 1% slack that is 40-70 ms a second, so about 10-15 s in. The share-10
    // process connects, then
    // launches through the real cuLaunchKernel (glibc's own dlsym), never asking for a lease:
    // the interposer cannot see it, the backstop does (NVML's per-process GPU time against
    // the leases the allocation was granted).
    let _serial = serial();
    // Whole kernels first come first served (the FIFO engine): the bypasser's kernels queue
    // behind the leaseholder's, and the fraction measures what the backstop lets through. On
    // a time-slicing engine, as on a card, a bypasser gets its round-robin part of the engine
    // (half, against one busy neighbour) until it is killed (docs/compute.md).
    // A 1% slack instead of 5%: on the simulated engine the bypasser takes 5-8% of the GPU,
    // about the default slack, where the kill would take minutes; the test is about the kill.
    let bed = Bed::with_arbiter_args(&["--compute-slack-percent", "1"]);
    let (low_token, low_id) = bed.create_with(GIB, 10, None);
    let (high_token, _) = bed.create_with(GIB, 90, None);
    let exe = build_c(&bed, "bypass_launch");
    let start = Instant::now();
    let high = client(&bed, &high_token, &["kernel", "45", "2"])
        .env(tessera_sim_state::ENV_TIMESLICE, "off")
        .spawn()
        .unwrap();
    let mut low = bed
        .tenant_command(&exe, &low_token)
        .env(tessera_sim_state::ENV_TIMESLICE, "off")
        .args(["45", "1000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pids = [low.id(), high.id()];
    let busy = watch_busy(&bed, &pids, || {
        start.elapsed() > Duration::from_secs(10) || !alive(pids[1])
    });
    let status = low.wait().unwrap();
    let out = std::io::read_to_string(low.stdout.take().unwrap()).unwrap_or_default();
    // The honest tenant would run on for the rest of its 45 s: its part is measured already.
    let mut high = high;
    let _ = high.kill();
    let _ = high.wait();
    let (bl, bh) = (
        busy.get(&pids[0]).copied().unwrap_or(0) as f64,
        busy[&pids[1]] as f64,
    );
    let share_low = bl / (bl + bh);
    use std::os::unix::process::ExitStatusExt;
    eprintln!(
        "compute bypass, share 10 vs 90, GPU time over the first 10 s: bypasser busy {:.2} s, honest busy {:.2} s, \
         bypasser's fraction {share_low:.3}; bypasser {status:?} after {:.1} s; arbiter charged \
         it {:.2} s",
        bl / 1e9,
        bh / 1e9,
        start.elapsed().as_secs_f64(),
        bed.status(&low_id).gpu_time_10s_ns as f64 / 1e9,
    );
    assert!(
        out.starts_with("bypassing"),
        "the client never went around the gate: {out}"
    );
    // Its part of the GPU until the kill is a figure (printed above; a loaded host slows the
    // honest tenant and so raises it: 31% was seen beside a CPU hog); here: killed, and only it.
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "{status:?}\n{}",
        bed.arbiter_log()
    );
    let log = bed.arbiter_log();
    assert!(log.contains("outside its leases"), "{log}");
    assert!(bed.status(&low_id).enforced >= 1, "counted");
    assert!(
        !log.contains(&format!("pid {} of allocation", pids[1])),
        "the honest neighbour was acted on\n{log}"
    );
}

#[test]
fn ten_allocations_bypassing_together_share_one_slack_and_are_killed() {
    // Ten share-1 allocations, each a process that connects and then launches only through
    // the real cuLaunchKernel (5 ms kernels: ten such processes cost little CPU), against a
    // saturating share-90 tenant. With a 5% slack per allocation each took just under it and
    // none was charged or killed (49% of the GPU together); with one slack per GPU what is
    // beyond it is charged and counts towards the kill rule for the GPU's bypassers together.
    let _serial = serial();
    let arbiter_started = Instant::now();
    let bed = Bed::new();
    let low: Vec<(String, String)> = (0..10).map(|_| bed.create_with(GIB, 1, None)).collect();
    let (high_token, _) = bed.create_with(GIB, 90, None);
    let exe = build_c(&bed, "bypass_launch");
    // The FIFO engine, as in the test above (why: there).
    let high = client(&bed, &high_token, &["kernel", "14", "2"])
        .env(tessera_sim_state::ENV_TIMESLICE, "off")
        .spawn()
        .unwrap();
    let high_pid = high.id();
    // The bypass starts once the honest tenant runs and the backstop's warm-up after the
    // arbiter's start (no compute kill in its first 2 s) is over, so it is policed throughout.
    let deadline = Instant::now() + Duration::from_secs(30);
    while busy_by_pid(&bed).get(&high_pid).copied().unwrap_or(0) == 0
        || arbiter_started.elapsed() < Duration::from_millis(2_500)
    {
        assert!(Instant::now() < deadline, "the share-90 tenant never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    let high_before = busy_by_pid(&bed)[&high_pid];
    let device_before = tessera_sim_state::device_busy_ns(&bed.sim_dir, 0);
    let start = Instant::now();
    let mut bypassers: Vec<Child> = low
        .iter()
        .map(|(token, _)| {
            bed.tenant_command(&exe, token)
                .env(tessera_sim_state::ENV_TIMESLICE, "off")
                .args(["10", "5000"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut pids: Vec<u32> = bypassers.iter().map(Child::id).collect();
    pids.push(high_pid);
    let busy = watch_busy(&bed, &pids, || start.elapsed() > Duration::from_secs(10));
    let device = tessera_sim_state::device_busy_ns(&bed.sim_dir, 0) - device_before;
    let charged: u64 = low
        .iter()
        .map(|(_, id)| bed.status(id).gpu_time_10s_ns)
        .sum();
    let statuses: Vec<_> = bypassers.iter_mut().map(|c| c.wait().unwrap()).collect();
    let outs: Vec<String> = bypassers
        .iter_mut()
        .map(|c| std::io::read_to_string(c.stdout.take().unwrap()).unwrap_or_default())
        .collect();
    finish(&bed, high);
    let low_busy: u64 = pids[..10]
        .iter()
        .map(|p| busy.get(p).copied().unwrap_or(0))
        .sum();
    let high_busy = busy[&high_pid] - high_before;
    let (low_frac, high_frac) = (
        low_busy as f64 / device as f64,
        high_busy as f64 / device as f64,
    );
    use std::os::unix::process::ExitStatusExt;
    let killed = statuses
        .iter()
        .filter(|s| s.signal() == Some(libc::SIGKILL))
        .count();
    eprintln!(
        "ten bypassers vs share 90 over 10 s: bypassers {:.2} s together ({low_frac:.3} of the \
         GPU's busy time), honest {:.2} s ({high_frac:.3}), device busy {:.2} s; {killed} of 10 \
         killed; arbiter charged the ten {:.2} s",
        low_busy as f64 / 1e9,
        high_busy as f64 / 1e9,
        device as f64 / 1e9,
        charged as f64 / 1e9
    );
    assert!(
        outs.iter().all(|o| o.starts_with("bypassing")),
        "a client never went around the gate: {outs:?}"
    );
    // The parts of the GPU are figures (printed above); here: the ten were charged for what
    // they ran beyond the slack and killed, and the honest tenant ran to its end (`finish`).
    assert!(charged > 0, "the ten were never charged");
    assert_eq!(killed, 10, "{statuses:?}\n{}", bed.arbiter_log());
    assert!(bed.arbiter_log().contains("outside its leases"));
}
