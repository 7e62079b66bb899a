//! A small arbiter stand-in for unit tests of the session logic: real Unix socket, real
//! frames, and the arbiter's own ledger rules (`tessera-ledger`: reserve, credit, release,
//! redeclare, a connection's bytes given back when it closes), so the sessions are checked
//! against the real credit rule, not a copy. It can be killed
//! (every connection shut down, socket removed) to test outages. The real arbiter is tested
//! against the interposer by the integration tests.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_protocol::frame::{read_frame, write_frame};
use tessera_protocol::{
    AllocationView, Hello, RefusalKind, Role, ServerHello, TenantReply, TenantRequest,
};

/// The mock's one allocation in the ledger.
const KEY: tessera_ledger::AccountKey = 1;

/// Shared ledger of the mock.
#[derive(Debug, Default)]
pub(crate) struct Books {
    /// The arbiter's ledger, with one account ([`KEY`]); a connection is attached from its
    /// welcome until it closes.
    pub ledger: tessera_ledger::Ledger,
    /// Requests seen, in order.
    pub log: Vec<TenantRequest>,
    /// Pressure channels: memory connection -> the channel's stream.
    pub channels: HashMap<u64, UnixStream>,
    /// Answers to pressure: (seq, bytes).
    pub relinquished: Vec<(u64, u64)>,
    /// When set, the next `Granted` is written only after the granted connection's channel
    /// was sent `Pressure { seq }` and answered it: a press that crosses the grant's reply.
    pub press_before_grant: Option<u64>,
    /// When set, the next `Subscribed` is followed by `Pressure { seq }` in the same write, so
    /// that the channel's first read takes both (a press sent as the channel opens).
    pub press_on_subscribe: Option<u64>,
    /// Requests the real arbiter treats as protocol violations (it closes the connection):
    /// a release of more than the connection holds, a `Redeclare` that is not the first
    /// request. The mock closes too, and counts them so tests can assert there were none.
    pub violations: Vec<TenantRequest>,
}

/// A running mock arbiter.
#[derive(Debug)]
pub(crate) struct MockArbiter {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    books: Arc<Mutex<Books>>,
    streams: Arc<Mutex<Vec<UnixStream>>>,
    thread: Option<JoinHandle<()>>,
}

/// The token the mock accepts.
pub(crate) const TOKEN: &str = "good-token";

impl MockArbiter {
    /// Listens on `path` with an allocation limit of `limit` bytes.
    pub(crate) fn start(path: &Path, limit: u64) -> Self {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path).expect("bind mock socket");
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let mut initial = Books::default();
        initial.ledger.open(KEY, limit);
        let books = Arc::new(Mutex::new(initial));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let (s, b, st) = (stop.clone(), books.clone(), streams.clone());
        let thread = std::thread::spawn(move || {
            let mut next_id = 0u64;
            while !s.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false).unwrap();
                        st.lock().push(stream.try_clone().unwrap());
                        next_id += 1;
                        let (b, id) = (b.clone(), next_id);
                        std::thread::spawn(move || serve(stream, id, limit, b));
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    Err(_) => return,
                }
            }
        });
        Self {
            path: path.to_owned(),
            stop,
            books,
            streams,
            thread: Some(thread),
        }
    }

    /// Bytes in use across all connections.
    pub(crate) fn in_use(&self) -> u64 {
        self.books.lock().ledger.usage(KEY).map_or(0, |u| u.in_use)
    }

    /// Open connections (pressure channels are not counted: they hold nothing).
    pub(crate) fn connections(&self) -> usize {
        self.books
            .lock()
            .ledger
            .usage(KEY)
            .map_or(0, |u| u.connections as usize)
    }

    /// Protocol violations seen so far (see [`Books::violations`]).
    pub(crate) fn violations(&self) -> Vec<TenantRequest> {
        self.books.lock().violations.clone()
    }

    /// Requests seen so far.
    pub(crate) fn log(&self) -> Vec<TenantRequest> {
        self.books.lock().log.clone()
    }

    /// Presses every pressure channel with `seq` and waits for all answers; returns the bytes
    /// given back.
    pub(crate) fn press_all(&self, seq: u64) -> u64 {
        let n = {
            let b = self.books.lock();
            for mut ch in b.channels.values() {
                write_frame(&mut ch, &TenantReply::Pressure { seq }).unwrap();
            }
            b.channels.len()
        };
        self.wait_for("relinquish", |a| {
            a.books
                .lock()
                .relinquished
                .iter()
                .filter(|(s, _)| *s == seq)
                .count()
                == n
        });
        let b = self.books.lock();
        b.relinquished
            .iter()
            .filter(|(s, _)| *s == seq)
            .map(|(_, bytes)| bytes)
            .sum()
    }

    /// Answers to pressure so far: (seq, bytes).
    pub(crate) fn relinquished(&self) -> Vec<(u64, u64)> {
        self.books.lock().relinquished.clone()
    }

    /// Makes the next channel's `Subscribed` come with a press (see
    /// [`Books::press_on_subscribe`]).
    pub(crate) fn press_on_subscribe(&self, seq: u64) {
        self.books.lock().press_on_subscribe = Some(seq);
    }

    /// Makes the next grant cross a press (see [`Books::press_before_grant`]).
    pub(crate) fn press_before_next_grant(&self, seq: u64) {
        self.books.lock().press_before_grant = Some(seq);
    }

    /// Open pressure channels.
    pub(crate) fn channels(&self) -> usize {
        self.books.lock().channels.len()
    }

    /// Waits until `f` holds (or panics after 30 s: a deadline for a broken test only, generous
    /// so that a loaded machine never reaches it).
    pub(crate) fn wait_for(&self, what: &str, f: impl Fn(&Self) -> bool) {
        let end = Instant::now() + Duration::from_secs(30);
        while !f(self) {
            assert!(Instant::now() < end, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Simulates a crash: stops accepting, shuts every connection, removes the socket.
    pub(crate) fn kill(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for s in self.streams.lock().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for MockArbiter {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn serve(mut stream: UnixStream, id: u64, limit: u64, books: Arc<Mutex<Books>>) {
    let Ok(hello) = read_frame::<_, Hello>(&mut stream) else {
        return;
    };
    let ok = matches!(&hello.role,
        Role::Tenant { token } | Role::Companion { token, .. } if token == TOKEN);
    if !ok {
        let _ = write_frame(
            &mut stream,
            &ServerHello::Rejected {
                kind: RefusalKind::UnknownToken,
                reason: "unknown token".into(),
            },
        );
        return;
    }
    let view = AllocationView {
        id: "alloc-1".into(),
        gpu_index: 0,
        gpu_uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
        memory_limit: limit,
        share: 50,
        cap: None,
    };
    books
        .lock()
        .ledger
        .attach(KEY, id)
        .expect("the account is open");
    if write_frame(
        &mut stream,
        &ServerHello::Welcome {
            version: 1,
            allocation: Some(view),
        },
    )
    .is_err()
    {
        let _ = books.lock().ledger.detach(KEY, id);
        return;
    }
    // Set when this connection is the pressure channel of connection `channel_of`.
    let mut channel_of = None;
    let mut handled = 0u64;
    while let Ok(req) = read_frame::<_, TenantRequest>(&mut stream) {
        handled += 1;
        let mut press_too = None;
        let reply = {
            let mut b = books.lock();
            b.log.push(req.clone());
            // As the real arbiter: a lie closes the connection.
            let held = |c: Option<u64>| c.and_then(|c| b.ledger.held(KEY, c)).unwrap_or(0);
            let lie = match req {
                TenantRequest::Release { bytes } => bytes > held(Some(id)),
                TenantRequest::Relinquish { bytes, .. } => bytes > held(channel_of),
                TenantRequest::Redeclare { .. } => handled > 1,
                _ => false,
            };
            if lie {
                b.violations.push(req);
                break;
            }
            match req {
                TenantRequest::Subscribe { ticket } => {
                    b.channels.insert(ticket, stream.try_clone().unwrap());
                    // A channel is not a process: it holds nothing and is not counted.
                    let _ = b.ledger.detach(KEY, id);
                    channel_of = Some(ticket);
                    press_too = b.press_on_subscribe.take();
                    Some(TenantReply::Subscribed)
                }
                TenantRequest::Relinquish { seq, bytes } => {
                    let mem = channel_of.expect("relinquish on a channel");
                    let _ = b.ledger.release(KEY, mem, bytes);
                    b.relinquished.push((seq, bytes));
                    None
                }
                req => serve_one(req, &mut b, id),
            }
        };
        if matches!(reply, Some(TenantReply::Granted { .. })) {
            press_before_reply(&books, id);
        }
        if let Some(seq) = press_too {
            // One write: the session's first read of the channel takes both frames.
            let mut both = Vec::new();
            write_frame(&mut both, &TenantReply::Subscribed).unwrap();
            write_frame(&mut both, &TenantReply::Pressure { seq }).unwrap();
            if std::io::Write::write_all(&mut stream, &both).is_err() {
                break;
            }
            continue;
        }
        if let Some(r) = reply
            && write_frame(&mut stream, &r).is_err()
        {
            break;
        }
    }
    let mut b = books.lock();
    let _ = b.ledger.detach(KEY, id);
    b.channels.remove(&id);
}

/// Presses connection `id`'s channel and waits for its answer if a test asked for it (see
/// [`Books::press_before_grant`]); the grant, already booked, is replied to afterwards.
fn press_before_reply(books: &Mutex<Books>, id: u64) {
    let seq = {
        let mut b = books.lock();
        let Some(seq) = b.press_before_grant.take() else {
            return;
        };
        let mut ch = b.channels.get(&id).expect("a channel to press");
        write_frame(&mut ch, &TenantReply::Pressure { seq }).unwrap();
        seq
    };
    let end = Instant::now() + Duration::from_secs(30);
    while !books.lock().relinquished.iter().any(|(s, _)| *s == seq) {
        assert!(Instant::now() < end, "pressure {seq} not answered");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn serve_one(req: TenantRequest, b: &mut Books, id: u64) -> Option<TenantReply> {
    use tessera_ledger::{Credit, Reservation};
    let usage = b.ledger.usage(KEY).expect("the account is open");
    let (limit, total) = (usage.limit, usage.in_use);
    let denied = |in_use| Some(TenantReply::Denied { limit, in_use });
    match req {
        TenantRequest::Reserve { bytes } => match b.ledger.reserve(KEY, id, bytes) {
            Ok(Reservation::Granted { in_use }) => Some(TenantReply::Reserved { in_use }),
            Ok(Reservation::Denied { in_use, .. }) => denied(in_use),
            Err(e) => panic!("mock ledger: {e}"),
        },
        TenantRequest::Release { bytes } => {
            b.ledger.release(KEY, id, bytes).expect("checked above");
            None
        }
        TenantRequest::Redeclare { bytes } => match b.ledger.redeclare(KEY, id, bytes) {
            Ok(in_use) => Some(TenantReply::Reserved { in_use }),
            Err(e) => Some(TenantReply::Error {
                message: e.to_string(),
            }),
        },
        TenantRequest::ReserveCredit { bytes, extra, .. } => {
            match b.ledger.reserve_credit(KEY, id, bytes, extra) {
                Ok(Credit::Granted { bytes, in_use }) => {
                    Some(TenantReply::Granted { bytes, in_use })
                }
                Ok(Credit::Denied { in_use, .. }) => denied(in_use),
                Err(e) => panic!("mock ledger: {e}"),
            }
        }
        // The ticket is the connection's own number.
        TenantRequest::Ticket => Some(TenantReply::Ticket { ticket: id }),
        TenantRequest::MemInfo | TenantRequest::MemInfoAfter { .. } => Some(TenantReply::MemInfo {
            limit,
            in_use: total,
        }),
        TenantRequest::Ping => Some(TenantReply::Pong),
        other => Some(TenantReply::Error {
            message: format!("mock does not serve {other:?}"),
        }),
    }
}
