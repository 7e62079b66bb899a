//! Metrics end to end: the real arbiter on a simulated GPU, scraped by a real Prometheus server
//! (Debian's `prometheus` package, which `.ci/run` installs) and checked by `promtool`. Ground
//! truth for GPU time is the simulated engine's per-process busy counters; for memory, what
//! the test's own tenants hold; for refusals, the out-of-memory errors the tenants saw.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`): the simulated driver,
//! the interposer, `compute_tenant` and `mem_tenant`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_protocol::client::TenantClient;
use tessera_protocol::{TenantReply, TenantRequest};
use tessera_testkit::http::get as http_get;
use tessera_testkit::{
    ArbiterSpec, GIB, KillOnDrop, MIB, RunningArbiter, SimGpu, allocation, artifact, wait_until,
};

/// Where Debian's package puts the tools; `PATH` is looked at first.
/// A simulated 80 GiB GPU in `dir` and the arbiter's spec on it (log in `dir/arbiter.log`).
fn one_gpu(dir: &std::path::Path) -> (SimGpu, ArbiterSpec) {
    let sim = SimGpu::prepare(&dir.join("sim"), "1x80GiB");
    let spec = ArbiterSpec::in_dir(env!("CARGO_BIN_EXE_tessera-arbiter"), dir, sim.clone())
        .log_to(dir.join("arbiter.log"));
    (sim, spec)
}

/// An arbiter on one simulated 80 GiB GPU serving metrics on a free loopback port.
struct Node {
    _dir: tempfile::TempDir,
    sim: SimGpu,
    arbiter: RunningArbiter,
    metrics: SocketAddr,
}

impl Node {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (sim, spec) = one_gpu(dir.path());
        let mut cmd = spec.command();
        cmd.args([
            "--metrics-addr",
            "127.0.0.1:0",
            "--host-mount-ns",
            "/proc/self/ns/mnt",
        ]);
        let arbiter = spec.start_command(cmd);
        let metrics = arbiter.metrics_addr(Duration::from_secs(10));
        Self {
            _dir: dir,
            sim,
            arbiter,
            metrics,
        }
    }

    /// A program on the simulated GPU under the interposer with `token`.
    fn tenant_command(&self, program: &Path, token: &str) -> Command {
        let mut cmd = Command::new(program);
        self.sim
            .apply(&mut cmd)
            .env("LD_PRELOAD", artifact("libtessera_interpose.so"))
            .env("TESSERA_SOCKET", &self.arbiter.socket)
            .env("TESSERA_TOKEN", token)
            .env_remove("TESSERA_REAL_LIBCUDA")
            .stdin(Stdio::null());
        cmd
    }
}

/// `s` for a URL query.
fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server of its own (port, config and TSDB in a temp folder), scraping `target`
/// every second.
struct Prometheus {
    _dir: tempfile::TempDir,
    addr: SocketAddr,
    _child: KillOnDrop,
    log: PathBuf,
}

impl Prometheus {
    fn start(target: SocketAddr) -> Self {
        let bin = tessera_testkit::prometheus::tool("prometheus");
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: tessera-arbiter\n    scrape_interval: 1s\n    \
                 scrape_timeout: 1s\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        // A free port: bound, read, released (Prometheus binds it right after).
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let log = dir.path().join("prometheus.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(&bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let mut child = KillOnDrop::new(child);
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "prometheus exited with {status}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            let ready = TcpStream::connect(addr).is_ok() && http_get(addr, "/-/ready").0 == 200;
            if ready {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "prometheus not ready in 30 s: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self {
            _dir: dir,
            addr,
            _child: child,
            log,
        }
    }

    /// `/api/v1/query` of `promql` at unix time `at`: the `data.result` array.
    fn query(&self, promql: &str, at: f64) -> Vec<serde_json::Value> {
        let target = format!("/api/v1/query?query={}&time={at:.3}", url_encode(promql));
        let (status, body) = http_get(self.addr, &target);
        assert_eq!(status, 200, "{promql}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{promql}: {body}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The value of the one series of `promql` whose `allocation` label is `id`.
    fn value_of(&self, promql: &str, at: f64, id: &str) -> f64 {
        let r = self.query(promql, at);
        let s: Vec<_> = r
            .iter()
            .filter(|s| s["metric"]["allocation"] == id)
            .collect();
        assert_eq!(s.len(), 1, "{promql} for {id}: {r:?}");
        s[0]["value"][1].as_str().unwrap().parse().unwrap()
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Unix time and busy ns per pid.
type BusySample = (f64, HashMap<u32, u64>);

/// Busy time per pid, sampled every 20 ms with its unix time (the simulator forgets a process
/// when it exits, so the counters are read while the tenants run).
struct Sampler {
    samples: Arc<Mutex<Vec<BusySample>>>,
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(sim_dir: PathBuf) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (Arc::clone(&samples), Arc::clone(&stop));
        let handle = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let busy = tessera_sim_state::read_processes(&sim_dir)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|p| (p.pid, p.busy_ns.first().copied().unwrap_or(0)))
                    .collect();
                s.lock().unwrap().push((unix_now(), busy));
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Self {
            samples,
            stop,
            handle: Some(handle),
        }
    }

    /// Busy ns of `pid` at unix time `t`, interpolated between the samples around it.
    fn busy_at(&self, pid: u32, t: f64) -> f64 {
        let s = self.samples.lock().unwrap();
        let i = s.partition_point(|(at, _)| *at < t);
        assert!(i > 0 && i < s.len(), "no samples around {t}");
        let (t0, b0) = (s[i - 1].0, s[i - 1].1[&pid] as f64);
        let (t1, b1) = (s[i].0, s[i].1[&pid] as f64);
        b0 + (b1 - b0) * (t - t0) / (t1 - t0)
    }

    fn finish(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A `compute_tenant` under the interposer; returns the child and its pid line.
fn compute_tenant(node: &Node, token: &str, seconds: f64) -> (Child, u32) {
    let mut child = node
        .tenant_command(&artifact("compute_tenant"), token)
        .args(["--kernel-us", "5000", "--seconds", &seconds.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut first)
        .unwrap();
    let pid = first
        .trim()
        .strip_prefix("pid ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("compute_tenant did not start: {first:?}"));
    (child, pid)
}

#[test]
fn prometheus_sees_gpu_time_memory_and_refusals_as_the_tenants_had_them() {
    let node = Node::start();
    let prom = Prometheus::start(node.metrics);
    let mut admin = node.arbiter.admin();
    let (ta, a) = admin.create(allocation(0, GIB, 30, None)).unwrap();
    let (tb, b) = admin.create(allocation(0, GIB, 70, None)).unwrap();
    // Prometheus applies its targets a few seconds after start-up: wait for the first scrape.
    let first = wait_until(Duration::from_secs(30), || {
        prom.query("up{job=\"tessera-arbiter\"} == 1", unix_now())
            .len()
            == 1
    });
    assert!(first.is_some(), "prometheus never scraped the arbiter");

    // GPU time: two tenants share the GPU at 30/70, launching 5 ms kernels back to back.
    let mut sampler = Sampler::start(node.sim.dir.clone());
    let run = 14.0;
    let (ca, pa) = compute_tenant(&node, &ta, run);
    let (cb, pb) = compute_tenant(&node, &tb, run);
    let started = unix_now();
    // Settle 3 s, then look at the 8 s that follow (ending well before the tenants stop), once
    // Prometheus has stored a scrape after the window's end.
    let at = started + 11.0;
    let window = 8.0;
    let stored = wait_until(Duration::from_secs(60), || {
        unix_now() > at
            && prom
                .query(
                    &format!(
                        "timestamp(tessera_allocation_gpu_seconds_total{{allocation=\"{}\"}})",
                        b.id
                    ),
                    unix_now(),
                )
                .first()
                .and_then(|r| r["value"][1].as_str()?.parse::<f64>().ok())
                .is_some_and(|t| t > at)
    });
    assert!(stored.is_some(), "no scrape stored after the window");
    let mut rates = Vec::new();
    for (id, pid) in [(&a.id, pa), (&b.id, pb)] {
        // The samples in the window, as Prometheus stored them: their slope is the rate over
        // their span (PromQL's rate() extrapolates it to the window's edges, which is off by
        // up to a tenth when a scrape comes late: it is used below for the split only, where
        // both allocations share the same scrapes). Returns (rate, engine busy rate).
        let slope = |metric: &str| {
            let raw = prom.query(&format!("{metric}{{allocation=\"{id}\"}}[{window}s]"), at);
            let values = raw[0]["values"].as_array().unwrap().clone();
            assert!(
                values.len() >= 5,
                "too few scrapes of {metric} in {window} s: {values:?}"
            );
            let ts = |v: &serde_json::Value| v[0].as_f64().unwrap();
            let val = |v: &serde_json::Value| v[1].as_str().unwrap().parse::<f64>().unwrap();
            let (first, last) = (&values[0], values.last().unwrap());
            let (t0, t1) = (ts(first), ts(last));
            let rate = (val(last) - val(first)) / (t1 - t0);
            let engine = (sampler.busy_at(pid, t1) - sampler.busy_at(pid, t0)) / 1e9 / (t1 - t0);
            eprintln!(
                "allocation {id}: {metric} rate {rate:.4} s/s, engine busy {engine:.4} s/s \
                 over {:.2} s ({} scrapes)",
                t1 - t0,
                values.len()
            );
            (rate, engine)
        };
        // The GPU time NVML saw its processes use (the backstop's reading, no tenant report):
        // the engine's busy time within 5%.
        let (busy, engine) = slope("tessera_allocation_gpu_busy_seconds_total");
        assert!(
            (busy - engine).abs() <= 0.05 * engine,
            "allocation {id}: NVML busy rate {busy:.4} vs engine {engine:.4}"
        );
        let (rate, engine) = slope("tessera_allocation_gpu_seconds_total");
        // The counter misses none of the work the engine did. It also counts the hand-overs (a
        // lease is charged from its grant to its release, and the engine idles between the
        // grant and the first kernel and after the last one): about 5-11% at 50 hand-overs a
        // second, more on a loaded machine. That cost is a figure, not a bound to test; the
        // upper bound here only catches a counter gone wrong.
        assert!(
            rate >= 0.97 * engine && rate <= 1.5 * engine,
            "allocation {id}: rate {rate:.4} vs engine {engine:.4}"
        );
        rates.push((rate, engine));
    }
    // Each allocation's part of the GPU time as the counters tell it is the engine's, and PromQL's
    // rate() agrees (how close the part is to the share is `compute_share`'s figure).
    let part = |v: &[(f64, f64)], engine: bool| {
        let f = |x: &(f64, f64)| if engine { x.1 } else { x.0 };
        f(&v[0]) / (f(&v[0]) + f(&v[1]))
    };
    let (counted, engine) = (part(&rates, false), part(&rates, true));
    let promql = |id: &str| {
        prom.value_of(
            &format!("rate(tessera_allocation_gpu_seconds_total[{window}s])"),
            at,
            id,
        )
    };
    let (ra, rb) = (promql(&a.id), promql(&b.id));
    let by_promql = ra / (ra + rb);
    eprintln!(
        "A's part: {counted:.4} by the counters ({by_promql:.4} by rate()), {engine:.4} by the \
         engine (share 30)"
    );
    assert!(
        (by_promql - counted).abs() <= 0.005,
        "rate(): {by_promql:.3}"
    );
    // Within 5 points, not 1: the hand-overs charged to each holder (see above) grow with the
    // machine's load and need not fall evenly on the two.
    assert!(
        (counted - engine).abs() <= 0.05,
        "A's part {counted:.3} by the counters, {engine:.3} by the engine"
    );
    let (ca, cb) = (
        ca.wait_with_output().unwrap(),
        cb.wait_with_output().unwrap(),
    );
    assert!(ca.status.success() && cb.status.success());
    sampler.finish();

    // Memory: what the tenants hold, exactly. Refusals: each one a tenant saw.
    let mut hold_a = TenantClient::connect(&node.arbiter.socket, &ta).unwrap();
    let mut hold_b = TenantClient::connect(&node.arbiter.socket, &tb).unwrap();
    let reserve = |c: &mut TenantClient, bytes| c.call(&TenantRequest::Reserve { bytes }).unwrap();
    assert!(matches!(
        reserve(&mut hold_a, 300 * MIB),
        TenantReply::Reserved { .. }
    ));
    assert!(matches!(
        reserve(&mut hold_b, 123 * MIB),
        TenantReply::Reserved { .. }
    ));
    assert!(matches!(
        reserve(&mut hold_b, 77 * MIB + 5),
        TenantReply::Reserved { .. }
    ));
    let mut refusals = 0;
    for _ in 0..2 {
        assert!(matches!(
            reserve(&mut hold_a, GIB),
            TenantReply::Denied { .. }
        ));
        refusals += 1;
    }
    // Real processes under the interposer that ask for more than the limit: each sees
    // CUDA_ERROR_OUT_OF_MEMORY once.
    for _ in 0..3 {
        let out = node
            .tenant_command(&artifact("mem_tenant"), &ta)
            .args(["hold", "--bytes", &(2 * GIB).to_string(), "--seconds", "0"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "mem_tenant: {text}");
        let line = text.lines().rev().find(|l| l.starts_with('{')).unwrap();
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["refusals"], 1, "{line}");
        refusals += 1;
    }
    // Prometheus has it all once a scrape shows the last change (the refusals just made).
    let refused_seen = || {
        prom.query("tessera_allocation_oom_refusals_total", unix_now())
            .iter()
            .any(|s| {
                s["metric"]["allocation"] == a.id.as_str()
                    && s["value"][1].as_str() == Some(refusals.to_string().as_str())
            })
    };
    wait_until(Duration::from_secs(60), refused_seen)
        .expect("Prometheus never scraped the refusals");
    let now = unix_now();
    let used = |id: &str| prom.value_of("tessera_allocation_memory_used_bytes", now, id);
    assert_eq!(used(&a.id), (300 * MIB) as f64);
    assert_eq!(used(&b.id), (200 * MIB + 5) as f64);
    assert_eq!(
        prom.value_of("tessera_allocation_oom_refusals_total", now, &a.id),
        refusals as f64
    );
    assert_eq!(
        prom.value_of("tessera_allocation_oom_refusals_total", now, &b.id),
        0.0
    );
    assert_eq!(
        prom.value_of("tessera_allocation_memory_limit_bytes", now, &a.id),
        GIB as f64
    );
    // The admin List reports the same counters.
    let listed = admin.list().unwrap();
    let la = listed.iter().find(|s| s.id == a.id).unwrap();
    assert_eq!(la.oom_refusals, refusals);
    assert!(la.leases > 0 && la.gpu_time_total_ns > 0 && la.throttled_total_ns > 0);

    // A deleted allocation's series are gone at the next scrape.
    drop(hold_b);
    admin.delete(&b.id).unwrap();
    wait_until(Duration::from_secs(60), || {
        prom.query("tessera_allocation_memory_limit_bytes", unix_now())
            .len()
            == 1
    })
    .expect("the deleted allocation's series stayed");
    let left = prom.query("tessera_allocation_memory_limit_bytes", unix_now());
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0]["metric"]["allocation"], a.id.as_str());
    let log = std::fs::read_to_string(&prom.log).unwrap_or_default();
    assert!(!log.contains("level=error"), "prometheus: {log}");
}

#[test]
fn promtool_finds_no_problem_in_a_scrape() {
    let node = Node::start();
    let mut admin = node.arbiter.admin();
    let mut labels = std::collections::BTreeMap::new();
    labels.insert(
        tessera_protocol::LABEL_NAMESPACE.to_owned(),
        "ml".to_owned(),
    );
    labels.insert(
        tessera_protocol::LABEL_POD.to_owned(),
        "trainer \"0\"".to_owned(),
    );
    let mut create = allocation(0, GIB, 40, Some(60));
    create.labels = labels;
    let (token, best_effort) = admin.create(create).unwrap();
    // The other one latency-tier, as the DRA driver's latency class and the device plugin's
    // latency resource create them: its tier is a series of its own.
    let (_, latency) = admin
        .create_tiered(
            allocation(0, GIB, 20, None),
            None,
            tessera_protocol::Tier::Latency,
        )
        .unwrap();
    let mut t = node.arbiter.tenant(&token);
    t.call(&TenantRequest::Reserve { bytes: MIB }).unwrap();
    t.call(&TenantRequest::Ping).unwrap();
    let (status, body) = http_get(node.metrics, "/metrics");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("pod=\"trainer \\\"0\\\"\""), "{body}");
    for (a, tier) in [(&best_effort, 0.0), (&latency, 1.0)] {
        let prefix = format!("tessera_allocation_latency_tier{{allocation=\"{}\",", a.id);
        let line = body
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no tier series of {}:\n{body}", a.id));
        let value: f64 = line.rsplit_once(' ').unwrap().1.parse().unwrap();
        assert_eq!(value, tier, "{line}");
    }
    tessera_testkit::prometheus::check_metrics(&body);
    // Every arbiter metric docs/metrics.md documents is served (the dashboard test checks the
    // dashboard's queries against the same document).
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/metrics.md"),
    )
    .unwrap();
    let names = tessera_testkit::prometheus::documented_names(
        &doc,
        &["tessera_allocation_", "tessera_gpu_", "tessera_arbiter_"],
    );
    assert!(names.len() >= 20, "{names:?}");
    for n in &names {
        assert!(
            tessera_testkit::prometheus::exposes(&body, n),
            "{n} is documented but not served:\n{body}"
        );
    }
    let (status, _) = http_get(node.metrics, "/");
    assert_eq!(status, 404);
}

#[test]
fn none_serves_no_metrics_and_a_taken_address_stops_the_start_with_exit_4() {
    let dir = tempfile::tempdir().unwrap();
    let (_sim, spec) = one_gpu(dir.path());
    let mut cmd = spec.command();
    cmd.args(["--metrics-addr", "none"]);
    let mut arbiter = spec.start_command(cmd);
    assert!(
        !arbiter.log_text().contains("metrics on"),
        "{}",
        arbiter.log_text()
    );
    arbiter.stop(Duration::from_secs(10));

    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = spec
        .command()
        .args(["--metrics-addr", &addr])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(
        err.contains(&format!("cannot listen for metrics on {addr}")),
        "{err}"
    );
    assert!(!spec.socket.exists(), "the tenant socket was left behind");
}
