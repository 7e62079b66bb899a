//! A stand-in Kubernetes API server for the DRA plugin's tests: real HTTP/1.1 and JSON as the
//! API server speaks them, for the few `resource.k8s.io/v1` calls the plugin makes (list,
//! create, update, delete ResourceSlices; get ResourceClaims).
//!
//! It keeps objects as JSON, assigns `uid`/`resourceVersion`, refuses stale updates (409) and
//! duplicate creates (409), and applies the slice rules upstream validation enforces beyond
//! the OpenAPI schema (422): device names are DNS labels, at most 128 devices, a
//! `requestPolicy` only on a device with `allowMultipleAllocations`, and a default inside
//! `validRange` on a step from its minimum.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use serde_json::{Value, json};

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

/// What the server holds.
#[derive(Debug, Default)]
pub struct ApiState {
    /// ResourceSlices by name.
    pub slices: BTreeMap<String, Value>,
    /// ResourceClaims by `(namespace, name)`.
    pub claims: BTreeMap<(String, String), Value>,
    /// Every request as `METHOD path`.
    pub requests: Vec<String>,
    /// Every write refused by validation, with the reason.
    pub rejected: Vec<String>,
    /// Answer every ResourceClaim read with a 500 (an API server in trouble).
    pub fail_claim_reads: bool,
    /// Every request's `Authorization` header (empty when it had none).
    pub authorizations: Vec<String>,
    /// When set, a request without exactly `Authorization: Bearer <this>` gets a 401, as the
    /// API server answers an unknown token.
    pub require_token: Option<String>,
    version: u64,
}

impl ApiState {
    fn next_version(&mut self) -> String {
        self.version += 1;
        self.version.to_string()
    }
}

/// The running stand-in; stops when dropped.
pub struct FakeApiServer {
    addr: SocketAddr,
    state: Arc<Mutex<ApiState>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeApiServer {
    /// Starts on a free loopback port.
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the stand-in API server");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(ApiState::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if sp.load(Ordering::SeqCst) {
                    return;
                }
                if let Ok(c) = conn {
                    let _ = serve(c, &st);
                }
            }
        });
        Self {
            addr,
            state,
            stop,
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The state, locked.
    pub fn state(&self) -> std::sync::MutexGuard<'_, ApiState> {
        self.state.lock().unwrap()
    }

    /// Stores a ResourceClaim (as the scheduler left it); returns its uid.
    pub fn put_claim(&self, claim: Value) -> String {
        let ns = claim["metadata"]["namespace"].as_str().unwrap().to_owned();
        let name = claim["metadata"]["name"].as_str().unwrap().to_owned();
        let uid = claim["metadata"]["uid"].as_str().unwrap().to_owned();
        self.state().claims.insert((ns, name), claim);
        uid
    }

    /// The slices, cloned.
    pub fn slices(&self) -> Vec<Value> {
        self.state().slices.values().cloned().collect()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(conn: TcpStream, state: &Mutex<ApiState>) -> std::io::Result<()> {
    conn.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("").to_owned(),
    );
    let mut length = 0usize;
    let mut authorization = String::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().unwrap_or(0);
            } else if k.eq_ignore_ascii_case("authorization") {
                authorization = v.trim().to_owned();
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let (status, out) = {
        let mut st = state.lock().unwrap();
        st.requests.push(format!("{method} {target}"));
        st.authorizations.push(authorization.clone());
        match &st.require_token {
            Some(t) if authorization != format!("Bearer {t}") => {
                status(401, "Unauthorized", "Unauthorized")
            }
            _ => route(&mut st, &method, &target, &body),
        }
    };
    let text = out.to_string();
    let mut w = conn;
    write!(
        w,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    )?;
    w.flush()
}

fn status(code: u16, reason: &str, message: &str) -> (u16, Value) {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
               "reason": reason, "message": message, "code": code}),
    )
}

fn route(st: &mut ApiState, method: &str, target: &str, body: &[u8]) -> (u16, Value) {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    if let Some(rest) = path.strip_prefix("/apis/resource.k8s.io/v1/namespaces/") {
        let mut seg = rest.split('/');
        if let (Some(ns), Some("resourceclaims"), Some(name), None) =
            (seg.next(), seg.next(), seg.next(), seg.next())
            && method == "GET"
        {
            if st.fail_claim_reads {
                return status(500, "InternalError", "etcd is unavailable");
            }
            return match st.claims.get(&(ns.to_owned(), name.to_owned())) {
                Some(c) => (200, c.clone()),
                None => status(
                    404,
                    "NotFound",
                    &format!("resourceclaims \"{name}\" not found"),
                ),
            };
        }
        return status(404, "NotFound", "no such route");
    }
    let parsed: Result<Value, _> = serde_json::from_slice(body);
    match (method, path) {
        ("GET", SLICES) => {
            let want = field_selector(query);
            let items: Vec<Value> = st
                .slices
                .values()
                .filter(|s| {
                    want.iter().all(|(k, v)| {
                        let got = match k.as_str() {
                            "spec.driver" => &s["spec"]["driver"],
                            "spec.nodeName" => &s["spec"]["nodeName"],
                            _ => &Value::Null,
                        };
                        got.as_str() == Some(v.as_str())
                    })
                })
                .cloned()
                .collect();
            let rv = st.version.to_string();
            (
                200,
                json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                       "metadata": {"resourceVersion": rv}, "items": items}),
            )
        }
        ("POST", SLICES) => {
            let Ok(mut obj) = parsed else {
                return status(400, "BadRequest", "body is not JSON");
            };
            if let Err(e) = validate_slice(&obj) {
                st.rejected.push(e.clone());
                return status(422, "Invalid", &e);
            }
            let name = obj["metadata"]["name"].as_str().unwrap_or("").to_owned();
            if st.slices.contains_key(&name) {
                return status(
                    409,
                    "AlreadyExists",
                    &format!("resourceslices \"{name}\" already exists"),
                );
            }
            let rv = st.next_version();
            obj["metadata"]["resourceVersion"] = json!(rv);
            obj["metadata"]["uid"] = json!(format!("uid-{rv}"));
            st.slices.insert(name, obj.clone());
            (201, obj)
        }
        ("PUT", p) | ("DELETE", p) if p.starts_with(SLICES) => {
            let name = p[SLICES.len()..].trim_start_matches('/').to_owned();
            let Some(cur) = st.slices.get(&name).cloned() else {
                return status(
                    404,
                    "NotFound",
                    &format!("resourceslices \"{name}\" not found"),
                );
            };
            if method == "DELETE" {
                st.slices.remove(&name);
                return (
                    200,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
                );
            }
            let Ok(mut obj) = parsed else {
                return status(400, "BadRequest", "body is not JSON");
            };
            if obj["metadata"]["resourceVersion"] != cur["metadata"]["resourceVersion"] {
                return status(409, "Conflict", "the object has been modified");
            }
            if let Err(e) = validate_slice(&obj) {
                st.rejected.push(e.clone());
                return status(422, "Invalid", &e);
            }
            let rv = st.next_version();
            obj["metadata"]["resourceVersion"] = json!(rv);
            obj["metadata"]["uid"] = cur["metadata"]["uid"].clone();
            st.slices.insert(name, obj.clone());
            (200, obj)
        }
        _ => status(404, "NotFound", "no such route"),
    }
}

/// `fieldSelector=a%3Db%2Cc%3Dd` as pairs.
fn field_selector(query: &str) -> Vec<(String, String)> {
    let Some(sel) = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("fieldSelector="))
    else {
        return Vec::new();
    };
    let sel = sel.replace("%3D", "=").replace("%2C", ",");
    sel.split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A quantity's integer value (`100`, `80Gi`, `256Mi`); `None` for forms these tests never
/// write.
pub fn quantity(v: &Value) -> Option<u128> {
    let s = v.as_str()?;
    let (num, mult) = [
        ("Ki", 1u128 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
    ]
    .iter()
    .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n, *m)))
    .unwrap_or((s, 1));
    num.parse::<u128>().ok().map(|n| n * mult)
}

/// The upstream rules for a ResourceSlice that its OpenAPI schema does not express.
pub fn validate_slice(s: &Value) -> Result<(), String> {
    if s["apiVersion"] != "resource.k8s.io/v1" || s["kind"] != "ResourceSlice" {
        return Err(format!(
            "apiVersion/kind: {} {}",
            s["apiVersion"], s["kind"]
        ));
    }
    let spec = &s["spec"];
    for f in ["driver", "nodeName"] {
        if !spec[f].is_string() {
            return Err(format!("spec.{f} is required here"));
        }
    }
    if !spec["pool"]["name"].is_string() || !spec["pool"]["generation"].is_i64() {
        return Err("spec.pool needs name and generation".into());
    }
    let devices = spec["devices"].as_array().cloned().unwrap_or_default();
    if devices.len() > 128 {
        return Err(format!("{} devices, at most 128", devices.len()));
    }
    for d in &devices {
        let name = d["name"].as_str().unwrap_or("");
        if !is_dns_label(name) {
            return Err(format!("device name {name:?} is not a DNS label"));
        }
        let multi = d["allowMultipleAllocations"] == Value::Bool(true);
        for (cname, c) in d["capacity"].as_object().cloned().unwrap_or_default() {
            let Some(p) = c.get("requestPolicy") else {
                continue;
            };
            if !multi {
                return Err(format!(
                    "{name}.{cname}: requestPolicy needs allowMultipleAllocations"
                ));
            }
            let value = quantity(&c["value"]).ok_or(format!("{name}.{cname}: bad value"))?;
            let r = &p["validRange"];
            let min = quantity(&r["min"]).ok_or(format!("{name}.{cname}: bad min"))?;
            let max = quantity(&r["max"]).unwrap_or(value);
            let step = quantity(&r["step"]).unwrap_or(1);
            let def = quantity(&p["default"]).ok_or(format!("{name}.{cname}: bad default"))?;
            if step == 0 || min > max || max > value {
                return Err(format!(
                    "{name}.{cname}: validRange {min}..{max} step {step} over {value}"
                ));
            }
            if def < min || def > max || !(def - min).is_multiple_of(step) {
                return Err(format!(
                    "{name}.{cname}: default {def} not on a step of {min}..{max}"
                ));
            }
        }
    }
    Ok(())
}
