//! Memory pressure: taking unused credit back from an allocation's other processes before a
//! reservation is refused.
//!
//! Each interposed process holds some *credit*: bytes the ledger counts for it that it has not
//! allocated (frees it kept, room it was given ahead of need). Allocations and frees inside
//! the credit make no round trip. So that credit never causes a false out-of-memory, a
//! reservation that would be refused first *presses* the allocation's other processes: each
//! one's pressure channel (a second connection of that process, tied to its memory connection
//! by a one-use ticket) receives `Pressure { seq }`, and the process answers at once with
//! `Relinquish { seq, bytes }`, giving back every unused byte. The requester waits until all
//! pressed channels answered (or a deadline passed), then tries again; it is refused only if
//! the bytes are really held.
//!
//! This module is the registry and the rendezvous; the ledger is touched by the caller.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::ledger::{AccountKey, ConnId};

/// Where a pressure frame goes: the write side of a process's pressure channel.
pub(crate) trait PressureSink: Send + Sync {
    /// Sends `Pressure { seq }` without blocking; false if it could not be sent.
    fn press(&self, seq: u64) -> bool;
}

/// Errors of the pressure registry (each closes the offending connection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PressureError {
    /// `Subscribe` with a ticket that was never issued, already used, or whose connection
    /// closed.
    #[error("unknown or used pressure ticket")]
    UnknownTicket,
    /// The ticket belongs to another allocation's connection.
    #[error("pressure ticket of another allocation")]
    WrongAllocation,
    /// `Relinquish` on a connection that is not a pressure channel.
    #[error("relinquish on a connection that is not a pressure channel")]
    NotAChannel,
}

struct Channel {
    key: AccountKey,
    /// The pressure channel's own connection.
    ctl: ConnId,
    sink: Arc<dyn PressureSink>,
    /// Pressures sent and not answered yet.
    owed: Vec<u64>,
    /// When the oldest of them was sent (None while nothing is owed).
    owed_since: Option<Instant>,
    /// `Relinquish` frames handled so far.
    frames: u64,
    /// When a `Pressure` was last written to it (see [`STILL_PRESSED`]).
    pressed_at: Option<Instant>,
}

/// Outstanding tickets a memory connection may hold: a process asks for two at once, its
/// pressure channel's (opened by the interposer's watcher thread after the first reservation)
/// and its lease connection's (at its first launch), and neither may cancel the other, which
/// left the lease connection refused ("unknown or used pressure ticket") and its launches
/// waiting to retry. Bounded, so a tenant asking in a loop holds no more than this.
pub(crate) const TICKETS_PER_CONN: usize = 2;

#[derive(Default)]
struct Inner {
    /// Ticket -> (account, memory connection, when issued: [`Inner::issued`] at the time).
    tickets: HashMap<u64, (AccountKey, ConnId, u64)>,
    /// Tickets issued so far (orders a connection's tickets, see [`TICKETS_PER_CONN`]).
    issued: u64,
    /// Memory connection -> its pressure channel.
    channels: HashMap<ConnId, Channel>,
    /// Pressure seq -> channels that have not answered it.
    outstanding: HashMap<u64, usize>,
    next_seq: u64,
}

impl Inner {
    fn settle(&mut self, seq: u64) {
        if let Some(n) = self.outstanding.get_mut(&seq) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Registry of pressure channels and the rendezvous between pressing and answering.
#[derive(Default)]
pub(crate) struct PressureHub {
    inner: Mutex<Inner>,
    answered: Condvar,
    /// Counts ledger frees (any allocation), so a reservation that does not fit can wait for
    /// the next one without missing it.
    freed: Mutex<u64>,
    freed_cv: Condvar,
    /// Reservations waiting for room, any allocation (see [`PressureHub::waiters`]).
    waiters: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for PressureHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = self.lock();
        f.debug_struct("PressureHub")
            .field("channels", &i.channels.len())
            .field("tickets", &i.tickets.len())
            .finish()
    }
}

/// A pressure round in progress: wait for it with [`PressureHub::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Round {
    seq: u64,
    /// Channels the pressure reached.
    pub sent: usize,
    /// Targets with a channel of this allocation, pressed now or not (pressed lately, or owing
    /// an answer already).
    pub channels: usize,
    /// Of those, channels that still owed an answer to a round sent at least [`SILENT_AFTER`]
    /// before (silent since: a stopped process, or one the host has not run for a while).
    pub late: usize,
}

/// How long a channel owes an answer before a new round counts it as silent ([`Round::late`]).
/// A round sent just before by another waiter does not make a live process late: its answer,
/// on its way, serves both rounds, and is waited for like a fresh one (seen: a round 0.2 ms old
/// made a sibling late, its channel thread was not run for 70 ms, and a waiter that would have
/// fitted with its answer was refused at the memory wait).
pub(crate) const SILENT_AFTER: Duration = Duration::from_millis(50);

/// How long after a `Pressure` was written to a channel that has answered it the channel is
/// not pressed again: the process read the frame after it was written, and from its reading
/// keeps no credit for [`tessera_protocol::PRESSED_FOR`] (its frees go back at once), so
/// another frame would only cost it and the waiter a round trip each for nothing. 10 ms short
/// of that: the process's clock counts whole milliseconds. Without it a waiter at a full
/// allocation pressed every process again at every free it was woken by: eight processes
/// hammering one limit spent half their time in those rounds (issue 36).
pub const STILL_PRESSED: Duration =
    Duration::from_millis(tessera_protocol::PRESSED_FOR.as_millis() as u64 - 10);

impl PressureHub {
    /// An empty registry.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update leaves the maps consistent; a panic elsewhere cannot tear them.
        self.inner.lock()
    }

    /// A one-use ticket for memory connection `conn` of account `key`. `ticket` is the
    /// caller's random number (so tests can choose it). At most [`TICKETS_PER_CONN`] of a
    /// connection's tickets are outstanding: past that its oldest is dropped.
    pub(crate) fn issue_ticket(&self, key: AccountKey, conn: ConnId, ticket: u64) {
        let mut i = self.lock();
        let mine: Vec<(u64, u64)> = i
            .tickets
            .iter()
            .filter(|(_, (_, c, _))| *c == conn)
            .map(|(t, (_, _, at))| (*at, *t))
            .collect();
        if mine.len() >= TICKETS_PER_CONN
            && let Some(&(_, oldest)) = mine.iter().min()
        {
            i.tickets.remove(&oldest);
        }
        i.issued += 1;
        let at = i.issued;
        i.tickets.insert(ticket, (key, conn, at));
    }

    /// Uses up `ticket` for a companion connection (a lease connection, see
    /// [`tessera_protocol::Role::Companion`]) of account `key`; returns the memory connection it
    /// was issued on, which the companion is tied to.
    pub(crate) fn redeem(&self, ticket: u64, key: AccountKey) -> Result<ConnId, PressureError> {
        let mut i = self.lock();
        let (tkey, mem, _) = *i.tickets.get(&ticket).ok_or(PressureError::UnknownTicket)?;
        if tkey != key {
            return Err(PressureError::WrongAllocation);
        }
        i.tickets.remove(&ticket);
        Ok(mem)
    }

    /// Makes connection `ctl` of account `key` the pressure channel of the memory connection
    /// that was given `ticket`; returns that connection. The ticket is used up.
    pub(crate) fn subscribe(
        &self,
        ticket: u64,
        key: AccountKey,
        ctl: ConnId,
        sink: Arc<dyn PressureSink>,
    ) -> Result<ConnId, PressureError> {
        let mut i = self.lock();
        let (tkey, mem, _) = *i.tickets.get(&ticket).ok_or(PressureError::UnknownTicket)?;
        if tkey != key {
            return Err(PressureError::WrongAllocation);
        }
        i.tickets.remove(&ticket);
        let old = i.channels.insert(
            mem,
            Channel {
                key,
                ctl,
                sink,
                owed: Vec::new(),
                owed_since: None,
                frames: 0,
                pressed_at: None,
            },
        );
        if let Some(old) = old {
            for seq in old.owed {
                i.settle(seq);
            }
            self.answered.notify_all();
        }
        Ok(mem)
    }

    /// The pressure channel `ctl` of memory connection `mem` closed.
    pub(crate) fn channel_closed(&self, mem: ConnId, ctl: ConnId) {
        let mut i = self.lock();
        if i.channels.get(&mem).is_some_and(|c| c.ctl == ctl) {
            let ch = i.channels.remove(&mem).expect("present");
            for seq in ch.owed {
                i.settle(seq);
            }
            self.answered.notify_all();
        }
    }

    /// Memory connection `mem` closed: its channel and tickets go (its ledger entry, credit
    /// included, was freed by the caller).
    pub(crate) fn conn_closed(&self, mem: ConnId) {
        let mut i = self.lock();
        i.tickets.retain(|_, (_, c, _)| *c != mem);
        if let Some(ch) = i.channels.remove(&mem) {
            for seq in ch.owed {
                i.settle(seq);
            }
            self.answered.notify_all();
        }
    }

    /// Presses the channels of `targets` (memory connections of account `key`). Targets with
    /// no channel, whose channel cannot take the frame, or that answered a press written less
    /// than [`STILL_PRESSED`] ago, are skipped.
    pub(crate) fn press(&self, key: AccountKey, targets: &[ConnId]) -> Round {
        self.press_at(key, targets, Instant::now())
    }

    /// [`PressureHub::press`] at `now` (a test's instant).
    pub(crate) fn press_at(&self, key: AccountKey, targets: &[ConnId], now: Instant) -> Round {
        let mut i = self.lock();
        // Seq 0 is never used: a `Relinquish` with seq 0 answers nothing (credit given back
        // unasked).
        i.next_seq += 1;
        let seq = i.next_seq;
        let (mut sent, mut late, mut channels) = (0, 0, 0);
        for t in targets {
            let Some(ch) = i.channels.get_mut(t).filter(|c| c.key == key) else {
                continue;
            };
            channels += 1;
            // A channel that owes an answer already gets no second frame: its next answer
            // gives back everything it has then, which serves this round too. So a process
            // that is slow to run never has more than one `Pressure` queued.
            let owing = !ch.owed.is_empty();
            let still_pressed = ch
                .pressed_at
                .is_some_and(|at| now.saturating_duration_since(at) < STILL_PRESSED);
            if !owing && still_pressed {
                continue;
            }
            if owing || ch.sink.press(seq) {
                if !owing {
                    ch.pressed_at = Some(now);
                }
                ch.owed.push(seq);
                sent += 1;
                let since = *ch.owed_since.get_or_insert(now);
                late += usize::from(owing && now.saturating_duration_since(since) >= SILENT_AFTER);
            }
        }
        if sent > 0 {
            i.outstanding.insert(seq, sent);
        }
        Round {
            seq,
            sent,
            late,
            channels,
        }
    }

    /// Waits until every channel pressed in `round` that owed nothing before it answered (the
    /// [`Round::late`] ones aside), or `deadline`. True when they all answered.
    pub(crate) fn wait_fresh(&self, round: Round, deadline: Instant) -> bool {
        let mut i = self.lock();
        loop {
            let left = i.outstanding.get(&round.seq).copied().unwrap_or(0);
            if left <= round.late {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            self.answered.wait_until(&mut i, deadline);
        }
    }

    /// The channel `ctl` of memory connection `mem` answered pressure `seq` (the caller booked
    /// the bytes). Any answer settles every round the channel owes: it gave back all it had
    /// (a round joined after the process read its frame just tries again). Seq 0 (credit given
    /// back unasked) answers nothing. A channel that is not `ctl`'s is an error.
    pub(crate) fn answered(&self, mem: ConnId, ctl: ConnId, seq: u64) -> Result<(), PressureError> {
        let mut i = self.lock();
        let ch = i
            .channels
            .get_mut(&mem)
            .filter(|c| c.ctl == ctl)
            .ok_or(PressureError::NotAChannel)?;
        ch.frames += 1;
        if seq == 0 || ch.owed.is_empty() {
            return Ok(());
        }
        let owed = std::mem::take(&mut ch.owed);
        ch.owed_since = None;
        for s in owed {
            i.settle(s);
        }
        self.answered.notify_all();
        Ok(())
    }

    /// `Relinquish` frames handled on the pressure channel of memory connection `mem` (None
    /// without a channel).
    pub(crate) fn channel_frames(&self, mem: ConnId) -> Option<u64> {
        self.lock().channels.get(&mem).map(|c| c.frames)
    }

    /// A reservation begins waiting for room ([`PressureHub::wait_ended`] when it ends).
    pub(crate) fn wait_began(&self) {
        self.waiters
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// A reservation waits for room no more.
    pub(crate) fn wait_ended(&self) {
        self.waiters
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Reservations waiting for room now, in any allocation: one atomic load, so a request can
    /// tell whether it must be careful of a waiter before it takes the ledger's lock.
    pub(crate) fn waiters(&self) -> usize {
        self.waiters.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The count of frees so far (see [`PressureHub::wait_freed`]).
    pub(crate) fn freed_count(&self) -> u64 {
        *self.freed.lock()
    }

    /// Something was freed in the ledger: wakes reservations waiting for room.
    pub(crate) fn note_freed(&self) {
        *self.freed.lock() += 1;
        self.freed_cv.notify_all();
    }

    /// Waits until a free after `seen` (a [`PressureHub::freed_count`]) or `deadline`.
    pub(crate) fn wait_freed(&self, seen: u64, deadline: Instant) {
        let mut n = self.freed.lock();
        while *n == seen {
            if Instant::now() >= deadline {
                return;
            }
            self.freed_cv.wait_until(&mut n, deadline);
        }
    }

    /// Waits until every channel pressed in `round` answered, or `deadline`. True when all
    /// answered.
    pub(crate) fn wait(&self, round: Round, deadline: Instant) -> bool {
        let mut i = self.lock();
        loop {
            let left = i.outstanding.get(&round.seq).copied().unwrap_or(0);
            if left == 0 {
                i.outstanding.remove(&round.seq);
                return true;
            }
            if Instant::now() >= deadline {
                i.outstanding.remove(&round.seq);
                return false;
            }
            self.answered.wait_until(&mut i, deadline);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;

    #[derive(Default)]
    struct Sink {
        got: Mutex<Vec<u64>>,
        broken: AtomicBool,
    }

    impl PressureSink for Sink {
        fn press(&self, seq: u64) -> bool {
            if self.broken.load(Ordering::SeqCst) {
                return false;
            }
            self.got.lock().push(seq);
            true
        }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn a_ticket_is_redeemed_once_and_only_by_its_allocation() {
        let hub = PressureHub::new();
        hub.issue_ticket(1, 10, 5);
        assert_eq!(hub.redeem(5, 2), Err(PressureError::WrongAllocation));
        assert_eq!(hub.redeem(5, 1), Ok(10));
        assert_eq!(hub.redeem(5, 1), Err(PressureError::UnknownTicket));
        assert_eq!(hub.redeem(6, 1), Err(PressureError::UnknownTicket));
    }

    #[test]
    fn a_connections_channel_and_lease_tickets_do_not_cancel_each_other_and_stay_bounded() {
        let hub = PressureHub::new();
        // The watcher's ticket for the pressure channel, then the lease connection's, asked
        // before the first was used: both good, each once.
        hub.issue_ticket(1, 10, 100);
        hub.issue_ticket(1, 10, 200);
        assert_eq!(hub.redeem(200, 1), Ok(10));
        let sink = Arc::new(Sink::default());
        assert_eq!(hub.subscribe(100, 1, 11, sink), Ok(10));
        // A tenant asking in a loop keeps only the last TICKETS_PER_CONN.
        for t in 1..=10 {
            hub.issue_ticket(1, 10, t);
        }
        for t in 1..=(10 - TICKETS_PER_CONN as u64) {
            assert_eq!(
                hub.redeem(t, 1),
                Err(PressureError::UnknownTicket),
                "ticket {t}"
            );
        }
        for t in (10 - TICKETS_PER_CONN as u64 + 1)..=10 {
            assert_eq!(hub.redeem(t, 1), Ok(10), "ticket {t}");
        }
        // Another connection's tickets are not touched by this one's.
        hub.issue_ticket(1, 20, 500);
        for t in 600..610 {
            hub.issue_ticket(1, 10, t);
        }
        assert_eq!(hub.redeem(500, 1), Ok(20));
    }

    #[test]
    fn a_ticket_ties_a_channel_to_its_memory_connection_once() {
        let hub = PressureHub::new();
        hub.issue_ticket(1, 10, 777);
        let sink = Arc::new(Sink::default());
        assert_eq!(
            hub.subscribe(777, 2, 11, sink.clone()),
            Err(PressureError::WrongAllocation)
        );
        assert_eq!(hub.subscribe(777, 1, 11, sink.clone()), Ok(10));
        assert_eq!(
            hub.subscribe(777, 1, 12, sink.clone()),
            Err(PressureError::UnknownTicket),
            "a ticket is used once"
        );
        assert_eq!(
            hub.subscribe(5, 1, 12, sink),
            Err(PressureError::UnknownTicket)
        );
    }

    #[test]
    fn press_reaches_only_channels_of_the_account_and_wait_returns_when_all_answered() {
        let hub = Arc::new(PressureHub::new());
        let (a, b, other) = (
            Arc::new(Sink::default()),
            Arc::new(Sink::default()),
            Arc::new(Sink::default()),
        );
        hub.issue_ticket(1, 10, 1);
        hub.issue_ticket(1, 20, 2);
        hub.issue_ticket(9, 30, 3);
        hub.subscribe(1, 1, 11, a.clone()).unwrap();
        hub.subscribe(2, 1, 21, b.clone()).unwrap();
        hub.subscribe(3, 9, 31, other.clone()).unwrap();
        // Connection 30 is of another account: never pressed for account 1.
        let round = hub.press(1, &[10, 20, 30, 40]);
        assert_eq!(round.sent, 2);
        assert_eq!(a.got.lock().len(), 1);
        assert!(other.got.lock().is_empty());
        let seq = a.got.lock()[0];
        let h = Arc::clone(&hub);
        let answer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            h.answered(10, 11, seq).unwrap();
            h.answered(20, 21, seq).unwrap();
        });
        let t = Instant::now();
        assert!(hub.wait(round, soon()));
        assert!(t.elapsed() >= Duration::from_millis(15));
        answer.join().unwrap();
        // Only the channel itself may answer for its connection.
        assert_eq!(hub.answered(10, 99, seq), Err(PressureError::NotAChannel));
    }

    #[test]
    fn a_channel_that_owes_an_answer_gets_no_second_frame_and_one_answer_settles_both() {
        let hub = Arc::new(PressureHub::new());
        let sink = Arc::new(Sink::default());
        hub.issue_ticket(1, 10, 1);
        hub.subscribe(1, 1, 11, sink.clone()).unwrap();
        let first = hub.press(1, &[10]);
        let second = hub.press(1, &[10]);
        assert_eq!((first.sent, second.sent), (1, 1));
        assert_eq!(sink.got.lock().len(), 1, "one frame queued at most");
        let seq = sink.got.lock()[0];
        // Unasked give-backs settle nothing (but are counted).
        hub.answered(10, 11, 0).unwrap();
        assert_eq!(hub.channel_frames(10), Some(1));
        assert_eq!(hub.channel_frames(11), None);
        assert!(!hub.wait(first, Instant::now() + Duration::from_millis(10)));
        let second = hub.press(1, &[10]);
        hub.answered(10, 11, seq).unwrap();
        assert!(hub.wait(second, soon()));
        // Owing nothing again: the next round once it may keep credit again sends a frame
        // (one before that has nothing to ask it, see `STILL_PRESSED`).
        hub.press_at(1, &[10], Instant::now() + STILL_PRESSED);
        assert_eq!(sink.got.lock().len(), 2);
    }

    #[test]
    fn wait_is_bounded_when_a_channel_does_not_answer() {
        let hub = PressureHub::new();
        hub.issue_ticket(1, 10, 1);
        hub.subscribe(1, 1, 11, Arc::new(Sink::default())).unwrap();
        let round = hub.press(1, &[10]);
        let t = Instant::now();
        assert!(!hub.wait(round, Instant::now() + Duration::from_millis(50)));
        assert!(t.elapsed() >= Duration::from_millis(45));
    }

    #[test]
    fn a_round_tells_the_channels_silent_since_an_earlier_one_apart() {
        let hub = Arc::new(PressureHub::new());
        let (a, b) = (Arc::new(Sink::default()), Arc::new(Sink::default()));
        hub.issue_ticket(1, 10, 1);
        hub.issue_ticket(1, 20, 2);
        hub.subscribe(1, 1, 11, a.clone()).unwrap();
        hub.subscribe(2, 1, 21, b.clone()).unwrap();
        // A never answers its first pressure (a stopped process).
        let t0 = Instant::now();
        let first = hub.press_at(1, &[10], t0);
        assert_eq!((first.sent, first.late), (1, 0));
        assert!(!hub.wait_fresh(first, Instant::now() + Duration::from_millis(10)));
        // A round just after (another waiter's): A's answer may be on its way, it is not late.
        let just_after = hub.press_at(1, &[10], t0 + SILENT_AFTER / 2);
        assert_eq!((just_after.sent, just_after.late), (1, 0));
        // The next round, once A was silent a while: A is late, B fresh. Waiting for the fresh
        // ones is waiting for B.
        let second = hub.press_at(1, &[10, 20], t0 + SILENT_AFTER);
        assert_eq!((second.sent, second.late), (2, 1));
        let seq = b.got.lock()[0];
        let h = Arc::clone(&hub);
        let answer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            h.answered(20, 21, seq).unwrap();
        });
        assert!(hub.wait_fresh(second, soon()));
        answer.join().unwrap();
        assert!(!hub.wait(second, Instant::now() + Duration::from_millis(10)));
        // A answers at last: every round it owed settles, and it is fresh again.
        let seq = a.got.lock()[0];
        hub.answered(10, 11, seq).unwrap();
        assert!(hub.wait(second, soon()));
        let again = hub.press_at(1, &[10], t0 + SILENT_AFTER + STILL_PRESSED);
        assert_eq!((again.sent, again.late), (1, 0));
    }

    #[test]
    fn a_channel_that_answered_a_press_is_not_pressed_again_while_it_keeps_no_credit() {
        const MS: Duration = Duration::from_millis(1);
        let hub = PressureHub::new();
        let a = Arc::new(Sink::default());
        hub.issue_ticket(1, 10, 1);
        hub.subscribe(1, 1, 11, a.clone()).unwrap();
        let t0 = Instant::now();
        assert_eq!(hub.press_at(1, &[10], t0).sent, 1);
        // Owing: it joins the next round without a second frame.
        assert_eq!(hub.press_at(1, &[10], t0 + MS).sent, 1);
        assert_eq!(a.got.lock().len(), 1);
        let seq = a.got.lock()[0];
        hub.answered(10, 11, seq).unwrap();
        // Answered: from its reading of the frame (after t0) it keeps no credit for
        // PRESSED_FOR, so a round before STILL_PRESSED passes has nothing to ask it.
        let skipped = hub.press_at(1, &[10], t0 + STILL_PRESSED - MS);
        assert_eq!(skipped.sent, 0);
        assert!(hub.wait(skipped, soon()), "nothing to wait for");
        assert_eq!(a.got.lock().len(), 1);
        // Then it may keep credit again: pressed.
        assert_eq!(hub.press_at(1, &[10], t0 + STILL_PRESSED).sent, 1);
        assert_eq!(a.got.lock().len(), 2);
        assert!(STILL_PRESSED < tessera_protocol::PRESSED_FOR);
    }

    #[test]
    fn a_closing_channel_settles_what_it_owed() {
        let hub = Arc::new(PressureHub::new());
        hub.issue_ticket(1, 10, 1);
        hub.subscribe(1, 1, 11, Arc::new(Sink::default())).unwrap();
        let round = hub.press(1, &[10]);
        let h = Arc::clone(&hub);
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            h.conn_closed(10);
        });
        assert!(hub.wait(round, soon()));
        closer.join().unwrap();
        // Nothing left to press.
        assert_eq!(hub.press(1, &[10]).sent, 0);
    }

    #[test]
    fn a_free_wakes_a_waiting_reservation_and_the_wait_is_bounded() {
        let hub = Arc::new(PressureHub::new());
        let seen = hub.freed_count();
        let h = Arc::clone(&hub);
        let freer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            h.note_freed();
        });
        // Woken by the free (it happened, and the wait ended well before its deadline: a
        // minute, so a loaded machine cannot reach it), not by the deadline.
        let deadline = Instant::now() + Duration::from_secs(60);
        hub.wait_freed(seen, deadline);
        assert!(Instant::now() < deadline, "not woken by the free");
        assert_eq!(hub.freed_count(), seen + 1, "returned before the free");
        freer.join().unwrap();
        // Nothing more is freed: the wait ends at its deadline.
        let t = Instant::now();
        hub.wait_freed(
            hub.freed_count(),
            Instant::now() + Duration::from_millis(30),
        );
        assert!(t.elapsed() >= Duration::from_millis(25));
    }

    #[test]
    fn an_unwritable_channel_is_skipped() {
        let hub = PressureHub::new();
        let sink = Arc::new(Sink::default());
        sink.broken.store(true, Ordering::SeqCst);
        hub.issue_ticket(1, 10, 1);
        hub.subscribe(1, 1, 11, sink).unwrap();
        let round = hub.press(1, &[10]);
        assert_eq!(round.sent, 0);
        assert!(hub.wait(round, soon()));
    }
}
