//! metrics_scrape: what one Prometheus scrape of the arbiter costs with many allocations.
//!
//! Starts the real `tessera-arbiter` on four simulated 80 GiB GPUs with `/metrics` on a free
//! loopback port, creates N allocations (default 100, `--allocations N`) spread over the GPUs,
//! connects one tenant per allocation (it reserves memory and takes one compute lease, so every
//! series has a value), then times 300 scrapes (`GET /metrics`, a new connection each, as
//! Prometheus does after an idle keep-alive) and prints the median, p99 and max with the size of
//! the exposition. Target: a scrape with 100 allocations under 10 ms.
//!
//! Build and run: `cargo build --release --workspace && target/release/metrics_scrape`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tessera_protocol::client::TenantClient;
use tessera_protocol::{CreateAllocation, GpuSelector, TenantReply, TenantRequest};

const GPUS: u32 = 4;
const SCRAPES: usize = 300;

/// One scrape: the whole response, read to the end.
fn scrape(addr: SocketAddr) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).expect("connect to /metrics");
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut out = Vec::with_capacity(256 * 1024);
    s.read_to_end(&mut out).expect("read the response");
    assert!(out.starts_with(b"HTTP/1.1 200"), "scrape failed");
    out
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    let n = tessera_benches::number_flag("metrics_scrape", "--allocations", 100.0) as u32;
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let addr_flag = port.to_string();
    let node = tessera_benches::SimNode::start_with(
        "metrics_scrape",
        &format!("{GPUS}x80GiB"),
        &["--metrics-addr", &addr_flag, "--backstop-interval-ms", "0"],
    );
    let mut admin = node.admin();
    let per_gpu = n.div_ceil(GPUS).max(1);
    let mut tenants = Vec::new();
    for i in 0..n {
        let gpu = i % GPUS;
        let create = CreateAllocation {
            gpu: GpuSelector::Index(gpu),
            memory_limit: (80 << 30) / u64::from(per_gpu),
            share: (100 / per_gpu).max(1),
            cap: (i % 3 == 0).then_some(50),
            labels: [
                ("tessera.dev/namespace".to_owned(), "bench".to_owned()),
                ("tessera.dev/pod".to_owned(), format!("pod-{i}")),
                ("tessera.dev/container".to_owned(), "main".to_owned()),
            ]
            .into_iter()
            .collect(),
        };
        let (token, _) = admin.create(create).expect("create an allocation");
        let mut t = TenantClient::connect(&node.socket, &token).expect("tenant connection");
        let reserved = t.call(&TenantRequest::Reserve {
            bytes: (64 << 20) + u64::from(i),
        });
        assert!(matches!(reserved, Ok(TenantReply::Reserved { .. })));
        if let Ok(TenantReply::LeaseGranted { lease_id, .. }) = t.call(&TenantRequest::LeaseAcquire)
        {
            let _ = t.send(&TenantRequest::LeaseRelease {
                lease_id,
                busy_ns: 1_000_000,
                early: true,
            });
        }
        tenants.push(t);
    }
    // Warm-up (first connection, allocator).
    let body = scrape(port);
    for _ in 0..10 {
        scrape(port);
    }
    let mut times: Vec<Duration> = (0..SCRAPES)
        .map(|_| {
            let start = Instant::now();
            scrape(port);
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    let q = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
    let text = String::from_utf8_lossy(&body);
    let series = text
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or("")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .count();
    println!(
        "Tessera arbiter /metrics: {n} allocations on {GPUS} simulated GPUs, {} tenant \
         connections, {SCRAPES} scrapes (new connection each)",
        tenants.len()
    );
    println!("{:<28} {:>12} {:>12} {:>12}", "", "median", "p99", "max");
    println!(
        "{:<28} {:>12} {:>12} {:>12}",
        "scrape (GET /metrics)",
        ms(q(0.5)),
        ms(q(0.99)),
        ms(q(1.0))
    );
    println!(
        "exposition: {} bytes, {series} samples; target: p99 under 10 ms: {}",
        body.len(),
        if q(0.99) < Duration::from_millis(10) {
            "met"
        } else {
            "NOT met"
        }
    );
    drop(tenants);
}
