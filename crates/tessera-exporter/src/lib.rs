//! The `/metrics` endpoint both daemons serve (`tessera-arbiter` on 9464,
//! `tessera-device-plugin` on 9465): the `--metrics-addr` syntax and a small, bounded hyper
//! server. What is exposed is each daemon's own; this crate only carries the text.
//!
//! Modules: none; the whole API is [`parse_addr`] (and its [`BadAddr`]), [`serve`] (and its
//! [`Render`]) and [`MAX_SCRAPERS`]; the per-connection deadline is the crate's own.

#![forbid(unsafe_code)]

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use prometheus_client::encoding::prometheus_text;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Scrapes served at once; more connections are closed at once.
pub const MAX_SCRAPERS: usize = 8;
/// Longest life of one scrape connection, request and response together: a client that
/// trickles its request or never reads the answer loses it.
pub(crate) const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);

/// `--metrics-addr` is neither `none` nor an address.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not IP:PORT or `none`")]
pub struct BadAddr(pub String);

/// Parses `--metrics-addr`: `none` (any case) turns the endpoint off; otherwise `IP:PORT`
/// (port 0 picks one). A bare IPv6 address before the port is accepted too, since
/// `$(POD_IP):9464` expands that way on IPv6 clusters.
pub fn parse_addr(text: &str) -> Result<Option<SocketAddr>, BadAddr> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    if let Ok(a) = t.parse::<SocketAddr>() {
        return Ok(Some(a));
    }
    let bad = || BadAddr(text.to_owned());
    let (host, port) = t.rsplit_once(':').ok_or_else(bad)?;
    let ip: IpAddr = host.parse().map_err(|_| bad())?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    Ok(Some(SocketAddr::new(ip, port)))
}

/// Produces the exposition for one scrape. It runs on the blocking pool: renderers may take
/// plain locks.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

fn answer(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    render: Render,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    const PLAIN: &str = "text/plain; charset=utf-8";
    if req.uri().path() != "/metrics" {
        let text = "not found: metrics are at /metrics\n";
        return Ok(answer(StatusCode::NOT_FOUND, PLAIN, text.into()));
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let text = "GET /metrics\n";
        return Ok(answer(StatusCode::METHOD_NOT_ALLOWED, PLAIN, text.into()));
    }
    let body = tokio::task::spawn_blocking(move || render())
        .await
        .unwrap_or_default();
    Ok(answer(StatusCode::OK, prometheus_text::CONTENT_TYPE, body))
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes (or the task is dropped):
/// at most [`MAX_SCRAPERS`] connections at a time, each for at most [`CONNECTION_DEADLINE`].
/// 404 for other paths, 405 for other methods. A connection's failure ends only that
/// connection.
pub async fn serve(listener: TcpListener, render: Render, shutdown: impl Future<Output = ()>) {
    let slots = Arc::new(Semaphore::new(MAX_SCRAPERS));
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!("metrics: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => {
                // Drain: the scrapes already accepted finish (each within its deadline).
                let _ = slots.acquire_many(MAX_SCRAPERS as u32).await;
                return;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            // Too many scrapers at once: closing is the cheapest answer.
            continue;
        };
        let render = Arc::clone(&render);
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(stream);
            let svc = hyper::service::service_fn(move |req| handle(req, Arc::clone(&render)));
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(CONNECTION_DEADLINE)
                .serve_connection(io, svc);
            let _ = tokio::time::timeout(CONNECTION_DEADLINE, conn).await;
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(parse_addr("none").unwrap(), None);
        assert_eq!(parse_addr(" None ").unwrap(), None);
        assert_eq!(
            parse_addr("127.0.0.1:9465").unwrap(),
            Some("127.0.0.1:9465".parse().unwrap())
        );
        assert_eq!(
            parse_addr("fd00::5:9465").unwrap(),
            Some("[fd00::5]:9465".parse().unwrap())
        );
        assert_eq!(
            parse_addr("[::1]:0").unwrap(),
            Some("[::1]:0".parse().unwrap())
        );
        for bad in [
            "",
            "9465",
            "localhost",
            "localhost:9465",
            "1.2.3.4:99999",
            "1.2.3.4",
        ] {
            assert!(parse_addr(bad).is_err(), "{bad:?} accepted");
        }
    }
}
