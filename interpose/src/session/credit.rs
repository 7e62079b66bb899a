//! Credit arithmetic: bytes the arbiter counts for this process that it has not allocated.
//! Reserve and release, the granule asked for ahead of need, what is kept after frees, and
//! giving back what is above a bound (on the pressure channel when there is one).

use std::sync::atomic::Ordering;

use tessera_protocol::{TenantReply, TenantRequest};

use super::link::Link;
use super::{PRESSED_FOR, Session, SessionError, UNASKED};
use crate::tlog;

/// Smallest and largest credit granule (what a round trip asks for on top of the request).
const GRANULE_MIN: u64 = 2 << 20;
const GRANULE_MAX: u64 = 512 << 20;

/// The credit granule of an allocation with `limit` bytes: 1/32 of it, within bounds.
pub fn granule(limit: u64) -> u64 {
    (limit / 32).clamp(GRANULE_MIN, GRANULE_MAX)
}

impl Session {
    fn now_us(&self) -> u64 {
        self.clock
            .now()
            .saturating_duration_since(self.origin)
            .as_micros() as u64
            + 1
    }

    /// True when a free made credit while pressed less than [`super::CHURN_GAP`] ago.
    fn churning(&self) -> bool {
        let last = self.last_free_us.load(Ordering::Relaxed);
        last != 0 && self.now_us().saturating_sub(last) <= super::CHURN_GAP.as_micros() as u64
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.clock
            .now()
            .saturating_duration_since(self.origin)
            .as_millis() as u64
            + 1
    }

    /// True within [`PRESSED_FOR`] of a `Pressure` (the watcher clears the mark afterwards,
    /// so the free path reads no clock).
    ///
    /// SeqCst, as the watcher's mark (see `answer_pressure`): a thread that adds credit and
    /// then reads the mark, and a watcher that sets it and then takes the credit, cannot both
    /// miss the other; so credit added while a `Pressure` is answered goes back either in the
    /// answer or at once from here. (A plain load on x86, as Relaxed.)
    fn pressed_recently(&self) -> bool {
        self.pressed_ms.load(Ordering::SeqCst) != 0
    }

    /// True within this process's turn ([`super::TURN`] from its last grant). Reads the clock:
    /// asked only while pressed.
    pub(super) fn in_turn(&self) -> bool {
        let end = self.turn_end_ms.load(Ordering::Relaxed);
        end != 0 && self.now_ms() < end
    }

    /// How long the watcher may wait before it looks again: the tick, or less when a pressed
    /// process's turn ends sooner (what the turn kept then goes back without a free to send it).
    pub(super) fn watch_timeout(&self) -> std::time::Duration {
        let tick = self.policy.tick;
        if !self.pressed_recently() {
            return tick;
        }
        let (end, now) = (self.turn_end_ms.load(Ordering::Relaxed), self.now_ms());
        if end > now {
            tick.min(std::time::Duration::from_millis(end - now))
        } else {
            tick
        }
    }

    pub(super) fn pressure_expired(&self) -> bool {
        let at = self.pressed_ms.load(Ordering::Relaxed);
        at != 0 && self.now_ms().saturating_sub(at) >= PRESSED_FOR.as_millis() as u64
    }

    /// Credit this process keeps after frees (more is given back after the release delay):
    /// two granules while it has a pressure channel and was not pressed lately; all of it while
    /// pressed in its turn; else none.
    pub fn keep(&self) -> u64 {
        if !self.has_channel() {
            return 0;
        }
        if self.pressed_recently() {
            return if self.in_turn() { u64::MAX } else { 0 };
        }
        2 * granule(self.limit.load(Ordering::Relaxed))
    }

    /// Credit asked for on top of a request that makes a round trip.
    fn extra(&self) -> u64 {
        if !self.has_channel() || self.pressed_recently() {
            return 0;
        }
        granule(self.limit.load(Ordering::Relaxed))
    }

    /// Reserves `bytes`: locally from the credit when it covers them, else at the arbiter
    /// (one round trip, the credit counted towards the request). Waits for an unreachable
    /// arbiter up to the outage bound. Returns the allocation's bytes in use as last reported
    /// by the arbiter.
    pub fn reserve(&'static self, bytes: u64) -> Result<u64, SessionError> {
        if self.take_credit(bytes) {
            return Ok(self.last_in_use.load(Ordering::Acquire));
        }
        self.request(true, |s, conn| {
            // Asked before the round trip, whose wait is not the process's gap.
            let churning = s.churning();
            // All the credit goes towards this request: the arbiter is asked for the rest.
            let credit = s.credit.swap(0, Ordering::SeqCst);
            if credit >= bytes {
                // Frees of other threads arrived meanwhile.
                s.credit.fetch_add(credit - bytes, Ordering::SeqCst);
                return Some(Ok(s.last_in_use.load(Ordering::Acquire)));
            }
            let need = bytes - credit;
            let extra = s.extra();
            let req = if s.has_channel() {
                let given_back = s.given_back.load(Ordering::Acquire);
                TenantRequest::ReserveCredit {
                    bytes: need,
                    extra,
                    given_back,
                }
            } else {
                TenantRequest::Reserve { bytes: need }
            };
            let answer = conn.call(&req);
            let granted = match &answer {
                Ok(TenantReply::Reserved { in_use }) => Some((need, *in_use)),
                Ok(TenantReply::Granted { bytes: g, in_use }) if *g >= need => Some((*g, *in_use)),
                _ => None,
            };
            if let Some((g, in_use)) = granted {
                let turn = s.policy.turn.as_millis() as u64;
                if turn > 0 && churning {
                    s.turn_end_ms.store(s.now_ms() + turn, Ordering::Relaxed);
                    // A watcher asleep for a whole tick must wake at the turn's end, when what
                    // the turn kept goes back: it looks again now and sees the turn.
                    s.wake_watcher();
                }
                s.held.fetch_add(g, Ordering::SeqCst);
                let credit = s.credit.fetch_add(g - need, Ordering::SeqCst) + g - need;
                // What is allocated, as far as this process knows (its own credit is not).
                let in_use = in_use.saturating_sub(credit);
                s.last_in_use.store(in_use, Ordering::Release);
                if g > need {
                    // Credit granted before a `Pressure` that the watcher answered while this
                    // reply was on its way (the answer could not give it back): it goes back
                    // now, not after the next free or the idle tick, while a sibling waits.
                    s.credit_added(credit);
                }
                return Some(Ok(in_use));
            }
            // Not granted: the credit is still ours.
            s.credit.fetch_add(credit, Ordering::SeqCst);
            match answer {
                Ok(TenantReply::Denied { limit, in_use }) => {
                    s.last_in_use.store(in_use, Ordering::Release);
                    Some(Err(SessionError::Denied { limit, in_use }))
                }
                Ok(TenantReply::Error { message }) => {
                    tlog!(Warn, "arbiter could not reserve {need} bytes: {message}");
                    Some(Err(SessionError::Unavailable))
                }
                Ok(other) => {
                    tlog!(Warn, "unexpected reply to {req:?}: {other:?}");
                    None
                }
                Err(e) => {
                    tlog!(Info, "arbiter connection lost during Reserve: {e}");
                    None
                }
            }
        })?
    }

    /// Takes `bytes` out of the credit when it covers them (one compare-and-swap): the arbiter
    /// already counts them for this process, so the allocation needs no round trip and the
    /// limit still holds exactly. A free followed by an allocation of no more than it freed
    /// (what frameworks' caching allocators do) thus costs no round trip at all.
    fn take_credit(&self, bytes: u64) -> bool {
        let mut credit = self.credit.load(Ordering::SeqCst);
        while bytes > 0 && credit >= bytes {
            match self.credit.compare_exchange_weak(
                credit,
                credit - bytes,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return true,
                Err(now) => credit = now,
            }
        }
        false
    }

    /// Returns `bytes` (a free, or a failed driver call): one atomic add, never waits, never
    /// fails. The bytes become credit; what exceeds [`Session::keep`] is announced by the
    /// watcher within the release delay. While disconnected it is applied locally and the
    /// reconnection's `Redeclare` reflects it.
    pub fn release(&'static self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let credit = self.credit.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.credit_added(credit);
    }

    /// The credit grew to `credit` (a free, or a grant with credit): while pressed lately and
    /// past its turn, it all goes back at once; what exceeds [`Session::keep`] is announced by
    /// the watcher within the release delay. One atomic load when neither applies.
    fn credit_added(&'static self, credit: u64) {
        let pressed = self.pressed_recently();
        if pressed {
            self.last_free_us.store(self.now_us(), Ordering::Relaxed);
        }
        if pressed && !self.in_turn() && self.give_back_now() {
            // Another process of the allocation waits for room: it gets these bytes now, not
            // after the release delay (and not this process's next allocation first).
            return;
        }
        if self.wake_fd.load(Ordering::Acquire) < 0 {
            // No watcher: send now.
            self.try_flush();
        } else if credit > self.keep() {
            self.wake_watcher();
        }
    }

    /// Wakes the watcher if it waits and no wake-up is on its way (one `write` at most per
    /// round of it).
    fn wake_watcher(&self) {
        let fd = self.wake_fd.load(Ordering::Acquire);
        if fd >= 0 && self.armed.swap(false, Ordering::AcqRel) {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a live u64 to the watcher's eventfd.
            let _ = unsafe { libc::write(fd, (&raw const one).cast(), 8) };
        }
    }

    /// Takes all the credit out of `held`; returns it (the bytes to announce, if connected).
    pub(super) fn drop_credit(&self) -> u64 {
        let bytes = self.credit.swap(0, Ordering::SeqCst);
        if bytes > 0 {
            self.held.fetch_sub(bytes, Ordering::SeqCst);
        }
        bytes
    }

    /// Takes the credit above `keep` out of `held`; returns it.
    pub(super) fn drop_credit_above(&self, keep: u64) -> u64 {
        let mut credit = self.credit.load(Ordering::SeqCst);
        loop {
            if credit <= keep {
                return 0;
            }
            match self.credit.compare_exchange_weak(
                credit,
                keep,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => {
                    let bytes = credit - keep;
                    self.held.fetch_sub(bytes, Ordering::SeqCst);
                    return bytes;
                }
                Err(now) => credit = now,
            }
        }
    }

    /// Announces credit above what is kept if the lock is free; otherwise its holder will.
    pub(super) fn try_flush(&'static self) {
        while self.credit.load(Ordering::SeqCst) > self.keep() {
            let Some(mut link) = self.link.try_lock() else {
                return;
            };
            self.flush_locked(&mut link, self.keep());
        }
    }

    /// Sends the credit above `keep` back, now: on the pressure channel when there is one (an
    /// unasked `Relinquish`), so that it reaches the arbiter before any answer to a later
    /// `Pressure` does; a refusal elsewhere must not race with bytes still in flight on
    /// another socket. Otherwise as a `Release` on the memory connection.
    pub(super) fn flush_locked(&'static self, link: &mut Link, keep: u64) {
        let bytes = self.drop_credit_above(keep);
        if bytes == 0 {
            return;
        }
        {
            let mut channel = self.channel.lock();
            if let Some(ch) = channel.as_mut() {
                // Blocking (bounded by the connection's timeout): a full socket means the
                // arbiter is busy, not that the bytes may be dropped.
                match ch.send_blocking(&TenantRequest::Relinquish {
                    seq: UNASKED,
                    bytes,
                }) {
                    Ok(()) => {
                        self.given_back.fetch_add(1, Ordering::AcqRel);
                        return;
                    }
                    Err(e) => {
                        // Whether the arbiter booked them is unknown (half a frame may have
                        // gone): the memory connection starts over, its `Redeclare` exact.
                        tlog!(Info, "pressure channel lost: {e}");
                        *channel = None;
                        self.channel_fd.store(-1, Ordering::Release);
                        drop(channel);
                        self.drop_conn(link);
                        return;
                    }
                }
            }
        }
        if let Some(conn) = link.conn.as_mut()
            && let Err(e) = conn.send_nowait(&TenantRequest::Release { bytes })
        {
            tlog!(Info, "arbiter connection lost during Release: {e}");
            self.drop_conn(link);
        }
    }
}
