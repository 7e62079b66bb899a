//! The pressure channel: a second connection, subscribed with a ticket of the memory one, on
//! which the arbiter sends `Pressure` before it refuses anyone and this process answers with
//! `Relinquish`, giving back every unused byte of credit.

use std::sync::atomic::Ordering;

use tessera_protocol::{TenantReply, TenantRequest};

use super::clock::poll_readable;
use super::{Session, UNASKED};
use crate::conn::{Conn, ConnError};
use crate::tlog;

impl Session {
    /// Gives all the credit back at once on the pressure channel (one `send`, no wait); false
    /// when the channel is busy or gone (the watcher then does it).
    pub(super) fn give_back_now(&self) -> bool {
        let Some(mut channel) = self.channel.try_lock() else {
            return false;
        };
        let Some(ch) = channel.as_mut() else {
            return false;
        };
        let bytes = self.drop_credit_above(0);
        if bytes == 0 {
            return true;
        }
        let sent = ch.send_nowait(&TenantRequest::Relinquish {
            seq: UNASKED,
            bytes,
        });
        if sent.is_ok() {
            self.given_back.fetch_add(1, Ordering::AcqRel);
            return true;
        }
        // Not announced: still ours; the watcher gives them back (it may wait for the socket).
        self.held.fetch_add(bytes, Ordering::SeqCst);
        self.credit.fetch_add(bytes, Ordering::SeqCst);
        if let Err(e) = sent
            && !matches!(e, ConnError::WouldBlock)
        {
            tlog!(Info, "pressure channel lost: {e}");
            *channel = None;
            self.channel_fd.store(-1, Ordering::Release);
        }
        false
    }

    pub(super) fn close_channel(&self) {
        self.channel_fd.store(-1, Ordering::Release);
        *self.channel.lock() = None;
    }

    /// Asks the watcher for a pressure channel for the new memory connection (made under the
    /// link lock): until it is open the process keeps no credit (see [`Session::keep`]).
    ///
    /// Why the watcher opens it, not the thread that connected: it costs a `Ticket` round trip,
    /// a second connection and its handshake, and a `Subscribe` round trip, all on the first
    /// CUDA call's critical path otherwise (issue 36: about a third of what the interposer
    /// added to a process's start). Meanwhile reservations ask for exactly what they need.
    pub(super) fn want_channel(&self) {
        self.close_channel();
        self.channel_wanted.store(true, Ordering::Release);
        let fd = self.wake_fd.load(Ordering::Acquire);
        if fd >= 0 {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a live u64 to the watcher's eventfd.
            let _ = unsafe { libc::write(fd, (&raw const one).cast(), 8) };
        }
    }

    /// Opens the pressure channel the last connection asked for ([`Session::want_channel`];
    /// the watcher thread): a ticket on the memory connection, a second connection that
    /// subscribes with it. Installed only if the memory connection is still the one the ticket
    /// came from (else it is closed: its ticket names a closed connection).
    ///
    /// Returns true when frames came in behind the channel's `Subscribed` (a `Pressure` sent
    /// at once): they were read with it into the connection's buffer, where no `poll` of the
    /// socket sees them, so the caller answers them now ([`Session::answer_pressure`]).
    pub(super) fn open_wanted_channel(&self) -> bool {
        if !self.channel_wanted.swap(false, Ordering::AcqRel) {
            return false;
        }
        let Some(path) = self.socket.as_deref() else {
            return false;
        };
        let (generation, ticket) = {
            let mut link = self.lock();
            let generation = link.generation;
            let Some(mem) = link.conn.as_mut() else {
                return false;
            };
            match mem.call(&TenantRequest::Ticket) {
                Ok(TenantReply::Ticket { ticket }) => (generation, ticket),
                other => {
                    tlog!(
                        Info,
                        "no pressure channel (Ticket answered {other:?}); this process keeps no memory credit"
                    );
                    return false;
                }
            }
        };
        let opened = (|| {
            let (mut ch, _) = Conn::connect(path, &self.token, Some(self.policy.rpc_timeout))?;
            ch.send_blocking(&TenantRequest::Subscribe { ticket })?;
            let mut answers = 0;
            loop {
                match ch.recv_reply()? {
                    TenantReply::Subscribed => return Ok((ch, answers)),
                    // Pressed before the answer: nothing is held as credit yet, and none is taken
                    // for a while (a sibling waits for room).
                    TenantReply::Pressure { seq } => {
                        self.pressed_ms.store(self.now_ms(), Ordering::SeqCst);
                        ch.send_blocking(&TenantRequest::Relinquish { seq, bytes: 0 })?;
                        answers += 1;
                    }
                    other => return Err(ConnError::Frame(format!("Subscribe answered {other:?}"))),
                }
            }
        })();
        match opened {
            Ok((ch, answers)) => {
                // Under the link lock: a memory connection dropped meanwhile closed the channel
                // it had (none) and wants a new one; this one belongs to no live connection.
                let link = self.lock();
                if link.generation != generation || link.conn.is_none() {
                    return false;
                }
                let buffered = ch.has_buffered_frame();
                self.given_back.store(answers, Ordering::Release);
                self.channel_fd.store(ch.fd(), Ordering::Release);
                *self.channel.lock() = Some(ch);
                buffered
            }
            Err(e) => {
                tlog!(
                    Info,
                    "no pressure channel ({e}); this process keeps no memory credit"
                );
                false
            }
        }
    }

    /// Answers every `Pressure` waiting on the channel: all unused credit goes back at once (in
    /// the process's turn, none: it goes back when the turn ends).
    pub(super) fn answer_pressure(&'static self) {
        let mut guard = self.channel.lock();
        let Some(ch) = guard.as_mut() else { return };
        loop {
            let seq = match ch.recv_reply() {
                Ok(TenantReply::Pressure { seq }) => seq,
                Ok(other) => {
                    tlog!(Warn, "unexpected frame on the pressure channel: {other:?}");
                    break;
                }
                Err(e) => {
                    tlog!(Info, "pressure channel lost: {e}");
                    break;
                }
            };
            // Marked before the credit is taken, SeqCst (see `pressed_recently`): credit added
            // after the take goes back at once from the thread that adds it. In its turn the
            // process keeps it: the watcher gives it back when the turn ends.
            self.pressed_ms.store(self.now_ms(), Ordering::SeqCst);
            let bytes = if self.in_turn() {
                0
            } else {
                self.drop_credit()
            };
            // Blocking (bounded by the connection's timeout): the answer must not be lost.
            let sent = ch.send_blocking(&TenantRequest::Relinquish { seq, bytes });
            if sent.is_ok() {
                self.given_back.fetch_add(1, Ordering::AcqRel);
            }
            if let Err(e) = sent {
                tlog!(Info, "pressure channel lost while relinquishing: {e}");
                // Whether the arbiter booked them is unknown: the memory connection is
                // re-established, and its `Redeclare` makes the ledger exact again.
                self.reset_memory_conn.store(true, Ordering::Release);
                break;
            }
            if !ch.has_buffered_frame() && !poll_readable(-1, ch.fd(), 0).1 {
                return;
            }
        }
        // A broken channel: the process keeps no credit until the next connection opens one.
        *guard = None;
        self.channel_fd.store(-1, Ordering::Release);
    }
}
