//! `nvml-wrapper`'s `process_utilization_stats` against the simulated NVML: two real clients
//! run known amounts of kernel time, and a poller that passes the timestamp of each previous
//! answer (as the arbiter does) sums smUtil × window back to each one's busy time. The test
//! runs alone in a process of its own (`crate::nvml_alone`): the library reads its state
//! folder from the environment.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nvml_wrapper::error::NvmlError;
use tessera_testkit::{KillOnDrop, python};

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

#[test]
fn per_process_sm_util_times_window_adds_up_to_each_process_kernel_time() {
    let Some(state) = crate::nvml_alone(
        module_path!(),
        "per_process_sm_util_times_window_adds_up_to_each_process_kernel_time",
        "1x16GiB",
    ) else {
        return;
    };
    let nvml = crate::sim_nvml();
    let dev = nvml.device_by_index(0).unwrap();
    let mut last_seen = now_us();
    assert!(
        matches!(
            dev.process_utilization_stats(last_seen),
            Err(NvmlError::NotFound)
        ),
        "nothing ran yet"
    );

    // A: 8 kernels of 125 ms (1 s); B: 20 of 25 ms (0.5 s), sharing the one engine.
    let start = |ns: &str, kernels: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["sim", "--gpus", "1x16GiB", "--state-dir"])
            .arg(state.as_path())
            .arg("--")
            .arg(python())
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sim_worker.py"))
            .args(["0", ns, kernels])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let pid: u32 = line
            .trim()
            .strip_prefix("ready ")
            .expect("ready PID")
            .parse()
            .unwrap();
        // The `done` line arrives while the poller polls: a thread waits for it.
        let (tx, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if line.starts_with("done") {
                    let _ = tx.send(());
                }
            }
        });
        (KillOnDrop::new(child), done, pid)
    };
    let (a, a_done, a_pid) = start("125000000", "8");
    let (b, b_done, b_pid) = start("25000000", "20");

    // Poll every 100 ms, each time from the previous answer, until both are done and then once
    // more (the last kernel's tail). At 250 ms a loaded machine's stretched sleeps left as few
    // as 3 answers with samples in the 1.5 s of work.
    let mut busy_us: HashMap<u32, f64> = HashMap::new();
    let mut windows = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut done = [false, false];
    let mut tail = 2;
    while tail > 0 {
        assert!(Instant::now() < deadline, "workers never finished");
        std::thread::sleep(Duration::from_millis(100));
        match dev.process_utilization_stats(last_seen) {
            Ok(samples) => {
                let ts = samples[0].timestamp;
                assert!(ts > last_seen);
                for s in &samples {
                    assert_eq!(s.timestamp, ts);
                    assert!(s.sm_util <= 100);
                    *busy_us.entry(s.pid).or_default() +=
                        f64::from(s.sm_util) / 100.0 * (ts - last_seen) as f64;
                }
                last_seen = ts;
                windows += 1;
            }
            Err(NvmlError::NotFound) => {}
            Err(e) => panic!("process_utilization_stats: {e}"),
        }
        for (i, rx) in [&a_done, &b_done].into_iter().enumerate() {
            done[i] |= rx.try_recv().is_ok();
        }
        if done == [true, true] {
            tail -= 1;
        }
    }
    assert!(windows >= 4, "only {windows} answers with samples");
    let got = |pid: u32| busy_us.get(&pid).copied().unwrap_or(0.0) / 1e6;
    let (a_s, b_s) = (got(a_pid), got(b_pid));
    eprintln!("A {a_s:.4} s, B {b_s:.4} s over {windows} answers");
    assert!(
        (a_s - 1.0).abs() < 0.05,
        "A ran 1 s of kernels; smUtil × windows says {a_s:.3} s"
    );
    assert!(
        (b_s - 0.5).abs() < 0.03,
        "B ran 0.5 s of kernels; smUtil × windows says {b_s:.3} s"
    );
    assert_eq!(busy_us.len(), 2, "only A and B ran: {busy_us:?}");

    // Idle since the last answer: nothing to report.
    assert!(matches!(
        dev.process_utilization_stats(last_seen),
        Err(NvmlError::NotFound)
    ));
    drop((a, b));
}
