//! The link state machine: the memory connection made on first use, backoff while the
//! arbiter is unreachable, a pause after a refusal, reconnection with `Redeclare`, and the
//! request loop that waits for an arbiter that is down up to the outage bound.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::MutexGuard;
use tessera_protocol::{TenantReply, TenantRequest};

use super::{Session, SessionError};
use crate::conn::{Conn, ConnError};
use crate::tlog;

pub(super) struct Link {
    pub(super) conn: Option<Conn>,
    pub(super) next_attempt: Instant,
    pub(super) backoff: Duration,
    pub(super) refused: bool,
    pub(super) ever_connected: bool,
    /// Incremented on every new connection, so the watcher can tell them apart.
    pub(super) generation: u64,
    pub(super) warned_down: bool,
    pub(super) watcher_started: bool,
}

/// What one locked step of a request decided.
enum Step<R> {
    Done(R),
    Fail(SessionError),
    Wait(Instant),
}

impl Session {
    /// Runs `op` on the open connection, connecting or reconnecting as needed. `op` returns
    /// `None` when the connection broke (it is dropped and the request retried). With `wait`,
    /// an unreachable arbiter is waited for up to the outage bound; without, one attempt is
    /// made.
    pub(super) fn request<R>(
        &'static self,
        wait: bool,
        mut op: impl FnMut(&'static Self, &mut Conn) -> Option<R>,
    ) -> Result<R, SessionError> {
        let deadline = self.clock.now() + self.policy.outage_wait;
        loop {
            let step = self.with_link(|link| {
                let now = self.clock.now();
                let Some(conn) = self.ensure_connected(link, now) else {
                    if link.refused {
                        return Step::Fail(SessionError::Unavailable);
                    }
                    return Step::Wait(link.next_attempt);
                };
                match op(self, conn) {
                    Some(r) => Step::Done(r),
                    None => {
                        self.drop_conn(link);
                        Step::Wait(link.next_attempt)
                    }
                }
            });
            match step {
                Step::Done(r) => return Ok(r),
                Step::Fail(e) => return Err(e),
                Step::Wait(at) => {
                    let now = self.clock.now();
                    if !wait || now >= deadline {
                        return Err(SessionError::Unavailable);
                    }
                    let until = at.min(deadline);
                    self.clock.sleep(
                        until
                            .saturating_duration_since(now)
                            .max(Duration::from_millis(1)),
                    );
                }
            }
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Link> {
        // No poisoning: a panic inside the lock leaves consistent data (every update is a
        // single store).
        self.link.lock()
    }

    /// Runs `f` under the link lock. Without a watcher, pending releases are flushed after.
    fn with_link<R>(&'static self, f: impl FnOnce(&mut Link) -> R) -> R {
        let mut link = self.lock();
        let r = f(&mut link);
        drop(link);
        if self.wake_fd.load(Ordering::Acquire) < 0 {
            self.try_flush();
        }
        r
    }

    pub(super) fn drop_conn(&self, link: &mut Link) {
        // Closing is all the arbiter needs to release this connection's ledger (credit too).
        link.conn = None;
        self.conn_fd.store(-1, Ordering::Release);
        self.close_channel();
        let now = self.clock.now();
        link.next_attempt = now + link.backoff.min(self.policy.backoff_min);
    }

    /// Connects if needed (respecting the backoff); on a new connection re-declares what is
    /// allocated and opens the pressure channel. Returns the open connection, `None` while
    /// there is none (unreachable, refused, or waiting out the backoff).
    pub(super) fn ensure_connected<'l>(
        &'static self,
        link: &'l mut Link,
        now: Instant,
    ) -> Option<&'l mut Conn> {
        if link.conn.is_some() {
            return link.conn.as_mut();
        }
        if now < link.next_attempt {
            return None;
        }
        let Some(path) = self.socket.as_deref() else {
            if !link.refused {
                match crate::config::get().closed_reason() {
                    Some(e) => tlog!(
                        Error,
                        "cannot prove this process's allocation ({e}): every allocation is refused and every launch fails"
                    ),
                    None => tlog!(
                        Error,
                        "no tenant socket to prove this process's allocation to: every allocation is refused and every launch fails"
                    ),
                }
            }
            link.refused = true;
            link.next_attempt = now + self.policy.refused_pause;
            return None;
        };
        // Credit died with the old connection: only what is allocated is re-declared.
        self.drop_credit();
        let held = self.held.load(Ordering::SeqCst);
        let attempt = Conn::connect(path, &self.token, Some(self.policy.rpc_timeout)).and_then(
            |(mut conn, view)| {
                if held > 0 {
                    match conn.call(&TenantRequest::Redeclare { bytes: held })? {
                        TenantReply::Reserved { in_use } => {
                            self.last_in_use.store(in_use, Ordering::Release)
                        }
                        other => {
                            return Err(ConnError::Frame(format!("Redeclare answered {other:?}")));
                        }
                    }
                }
                Ok((conn, view))
            },
        );
        match attempt {
            Ok((conn, view)) => {
                self.limit.store(view.memory_limit, Ordering::Release);
                self.limit_known.store(true, Ordering::Release);
                let _ = self.gpu_uuid.set(view.gpu_uuid.to_ascii_lowercase());
                if self.policy.watch {
                    self.want_channel();
                }
                self.conn_fd.store(conn.fd(), Ordering::Release);
                if link.ever_connected {
                    tlog!(Info, "reconnected to the arbiter; re-declared {held} bytes");
                } else {
                    tlog!(
                        Debug,
                        "connected to the arbiter: allocation {} limit {}",
                        view.id,
                        view.memory_limit
                    );
                }
                link.generation += 1;
                self.generation.store(link.generation, Ordering::Release);
                link.backoff = self.policy.backoff_min;
                link.refused = false;
                link.warned_down = false;
                link.ever_connected = true;
                if self.policy.watch && !link.watcher_started {
                    link.watcher_started = self.start_watcher();
                }
                Some(link.conn.insert(conn))
            }
            Err(ConnError::Refused(reason)) => {
                tlog!(Error, "arbiter refused this process: {reason}");
                link.refused = true;
                link.next_attempt = now + self.policy.refused_pause;
                None
            }
            Err(e) => {
                if !link.warned_down {
                    tlog!(Warn, "arbiter unreachable ({e}); retrying");
                    link.warned_down = true;
                }
                link.refused = false;
                link.next_attempt = now + link.backoff;
                link.backoff = (link.backoff * 2).min(self.policy.backoff_max);
                None
            }
        }
    }
}
