//! Releasing a closed connection's memory on the card's word.
//!
//! A process's socket closes before the driver has torn the process down: the kernel closes
//! its files one by one at exit, and a real driver frees the memory when it tears the context
//! down, which may come later still (asynchronously). Were the ledger to release the bytes when
//! the socket closes, a sibling granted them at once would allocate while the card still holds
//! the dead process's memory: the allocation would hold more than its limit on the card, and a
//! neighbour near a full card could get a real out-of-memory.
//!
//! So a memory connection that closes holding bytes *drains* (see
//! `tessera_ledger::Ledger::begin_drain`): its bytes stay counted until the card no longer
//! holds memory of its pid (NVML lists it no more, or with 0 bytes). The card is asked at the
//! close, then again with growing waits, and at once when the process has exited (a pidfd of
//! it becomes readable: its files, the driver's included, are closed): an event, not a poll,
//! decides how soon a dead process's memory is counted free. The wait is bounded by
//! [`DRAIN_BOUND`] from the close, after which the bytes are released with a log line (a
//! driver that never lets go, a process that lives on holding memory after its socket
//! closed). A sibling's reservation that would fit without the draining bytes waits for them
//! (see `tenant`); it is not refused.
//!
//! The timing is a pure state machine ([`Drain`]) driven with the time passed in; the I/O is
//! behind small traits ([`Clock`], [`ExitWatch`], [`CardView`]) so tests use fakes.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::ledger::ConnId;
use crate::peer::{Exit, ProcId};
use crate::state::{Arbiter, TenantBinding};

/// Longest a closed connection's bytes stay counted waiting for the card.
pub(crate) const DRAIN_BOUND: Duration = Duration::from_secs(2);

/// First wait between two questions to the card once the process exited; doubled after each
/// answer that it still holds memory, up to [`LAST_LOOK`]. The simulator (and a driver that
/// frees at once) answers at the first question; a driver tearing down a large context takes
/// milliseconds to seconds, asked a few dozen times at most.
const FIRST_LOOK: Duration = Duration::from_micros(250);
/// Longest wait between two questions to the card.
const LAST_LOOK: Duration = Duration::from_millis(25);

/// Errors of a drain's I/O (the drain goes on until its bound: the bytes are released then).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DrainError {
    /// NVML could not be loaded or asked.
    #[error("NVML: {0}")]
    Nvml(String),
}

impl From<nvml_wrapper::error::NvmlError> for DrainError {
    fn from(e: nvml_wrapper::error::NvmlError) -> Self {
        DrainError::Nvml(e.to_string())
    }
}

/// Why a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// The process exited and the card no longer holds memory of its pid.
    Card,
    /// The process exited, and there is no card to ask (no NVML): its exit is the best word.
    Exited,
    /// [`DRAIN_BOUND`] passed; `exited`: whether the process had exited by then.
    TimedOut {
        /// Whether the process's exit was seen.
        exited: bool,
    },
}

/// What a drain does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Wait for the process to exit, at most this long (then step again).
    WaitExit(Duration),
    /// Ask the card whether it still holds memory of the pid.
    AskCard,
    /// Sleep this long, then step again.
    Sleep(Duration),
    /// Release the bytes.
    Done(Why),
}

/// The timing of one drain, pure: times are offsets from any fixed instant, passed in.
#[derive(Debug, Clone)]
pub(crate) struct Drain {
    deadline: Duration,
    has_card: bool,
    exited: bool,
    next_look: Duration,
    backoff: Duration,
}

impl Drain {
    /// A drain that began at `now`, ending at the latest `bound` later; `has_card`: whether
    /// there is a card to ask (else the process's exit ends it).
    pub(crate) fn new(now: Duration, bound: Duration, has_card: bool) -> Self {
        Self {
            deadline: now.saturating_add(bound),
            has_card,
            exited: false,
            next_look: now,
            backoff: FIRST_LOOK,
        }
    }

    /// What to do at `now`.
    pub(crate) fn step(&self, now: Duration) -> Step {
        if now >= self.deadline {
            return Step::Done(Why::TimedOut {
                exited: self.exited,
            });
        }
        if !self.has_card {
            return match self.exited {
                true => Step::Done(Why::Exited),
                false => Step::WaitExit(self.deadline - now),
            };
        }
        if now >= self.next_look {
            return Step::AskCard;
        }
        let until = self.next_look.min(self.deadline) - now;
        // Before the exit, the wait for the next question is a wait for the exit too.
        match self.exited {
            true => Step::Sleep(until),
            false => Step::WaitExit(until),
        }
    }

    /// The process exited at `now`: its teardown is under way, ask the card at once and
    /// soon again.
    pub(crate) fn exited(&mut self, now: Duration) {
        self.exited = true;
        self.next_look = now;
        self.backoff = FIRST_LOOK;
    }

    /// The card answered at `now` (`holds`: it still has memory of the pid, or could not say).
    pub(crate) fn card(&mut self, holds: bool, now: Duration) -> Option<Why> {
        if !holds {
            return Some(Why::Card);
        }
        self.next_look = now.saturating_add(self.backoff);
        self.backoff = (self.backoff * 2).min(LAST_LOOK);
        None
    }
}

/// Time for a drain: a monotonic offset, and a way to let it pass.
pub(crate) trait Clock {
    /// Now, as an offset from a fixed instant.
    fn now(&self) -> Duration;
    /// Lets `d` pass.
    fn sleep(&self, d: Duration);
}

/// The real clock, from the instant it was made.
#[derive(Debug)]
pub(crate) struct RealClock(Instant);

impl RealClock {
    /// A clock starting now.
    pub(crate) fn start() -> Self {
        Self(Instant::now())
    }
}

impl Clock for RealClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }

    fn sleep(&self, d: Duration) {
        std::thread::sleep(d);
    }
}

/// The end of a process, to wait for.
pub(crate) trait ExitWatch {
    /// Waits up to `timeout`; true once the process has exited.
    fn wait(&self, timeout: Duration) -> bool;
}

impl ExitWatch for Exit {
    fn wait(&self, timeout: Duration) -> bool {
        Exit::wait(self, timeout)
    }
}

/// The card's word on a process.
pub(crate) trait CardView: Send + Sync {
    /// Whether any GPU still holds device memory of `pid` (listed with more than 0 bytes, or
    /// with an amount it cannot tell).
    fn holds(&self, pid: i32) -> Result<bool, DrainError>;
}

/// [`CardView`] over NVML: the processes each GPU lists, compute and graphics.
pub(crate) struct NvmlCard(Mutex<nvml_wrapper::Nvml>);

impl std::fmt::Debug for NvmlCard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NvmlCard")
    }
}

impl NvmlCard {
    /// Loads NVML from `lib`.
    pub(crate) fn load(lib: &std::ffi::OsStr) -> Result<Self, DrainError> {
        let nvml = nvml_wrapper::Nvml::builder().lib_path(lib).init()?;
        Ok(Self(Mutex::new(nvml)))
    }
}

impl CardView for NvmlCard {
    fn holds(&self, pid: i32) -> Result<bool, DrainError> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let nvml = self.0.lock();
        for i in 0..nvml.device_count()? {
            let dev = nvml.device_by_index(i)?;
            let mut list = dev.running_compute_processes()?;
            // A compute-only GPU (or the simulator) has no graphics list.
            list.extend(dev.running_graphics_processes().unwrap_or_default());
            if list
                .iter()
                .any(|p| p.pid as i32 == pid && p.used_gpu_memory != UsedGpuMemory::Used(0))
            {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// The card drains ask, once the server installed it (none: a process's exit ends its drain).
/// One per arbiter process, like the NVML library it wraps.
static CARD: OnceLock<Arc<dyn CardView>> = OnceLock::new();

/// Installs the card drains ask (at start-up; a second call changes nothing).
pub(crate) fn install_card(card: Arc<dyn CardView>) {
    let _ = CARD.set(card);
}

/// Runs `drain` to its end for process `pid`; returns why it ended and the last error of the
/// card, if it had any.
pub(crate) fn run(
    drain: &mut Drain,
    clock: &dyn Clock,
    exit: &dyn ExitWatch,
    card: Option<&dyn CardView>,
    pid: i32,
) -> (Why, Option<DrainError>) {
    let mut last_error = None;
    loop {
        let now = clock.now();
        match drain.step(now) {
            Step::Done(why) => return (why, last_error),
            Step::WaitExit(max) => {
                if exit.wait(max) {
                    drain.exited(clock.now());
                }
            }
            Step::AskCard => {
                // `step` asks only with a card; without one it would have ended the drain.
                let holds = card.map_or(Ok(false), |c| c.holds(pid));
                let holds = holds.unwrap_or_else(|e| {
                    last_error = Some(e);
                    true
                });
                if let Some(why) = drain.card(holds, clock.now()) {
                    return (why, last_error);
                }
            }
            Step::Sleep(d) => clock.sleep(d),
        }
    }
}

/// After memory connection `conn` of process `proc` closed: keeps what it holds counted until
/// the card let it go (see the module notes), then returns; the caller detaches it. A
/// connection holding nothing, or of no known process, returns at once. Its compute lease and
/// lease wait go at once (GPU time is not held by a dead process).
pub(crate) fn after_close(arb: &Arbiter, b: &TenantBinding, conn: ConnId, proc: Option<ProcId>) {
    let Some(id) = proc else {
        return;
    };
    let Ok(bytes) = arb.with_ledger(|l| l.begin_drain(b.key, conn)) else {
        return;
    };
    if bytes == 0 {
        return;
    }
    b.scheduler.connection_closed(conn, arb.now_ns());
    let clock = RealClock::start();
    let exit = Exit::of(id);
    let card = CARD.get().map(|c| c.as_ref());
    let mut drain = Drain::new(clock.now(), DRAIN_BOUND, card.is_some());
    let (why, error) = run(&mut drain, &clock, &exit, card, id.pid);
    let who = format!("tenant conn {conn} of {} (pid {})", b.view.id, id.pid);
    let held = tessera_protocol::size::human(bytes);
    let took = clock.now();
    match why {
        Why::TimedOut { exited } => {
            let what = if exited {
                "the card still holds its memory"
            } else {
                "its process has not exited"
            };
            let error = error
                .map(|e| format!(" (last card error: {e})"))
                .unwrap_or_default();
            tracing::warn!(
                "{who}: {what} {DRAIN_BOUND:?} after its connection closed; its {held} are \
                 released anyway{error}"
            );
        }
        Why::Card | Why::Exited => {
            tracing::debug!("{who}: {held} released {took:?} after close ({why:?})");
        }
    }
}

/// Longest the thread of a closed pressure channel waits for its process's exit (see
/// [`after_channel_close`]): a process that closes its sockets at its exit has exited within
/// microseconds of it; one that lives on is left to its memory connection's drain.
const CHANNEL_EXIT_GRACE: Duration = Duration::from_millis(5);

/// After the pressure channel of memory connection `mem` closed (on the channel's thread):
/// when the memory connection's process has exited and the card holds nothing of it, its
/// bytes are released now, on the card's word as in [`after_close`].
///
/// Why from here: a process's sockets close together at its exit, and the channel's thread
/// runs under normal scheduling, where the memory connection's is batch-scheduled (see
/// `tenant`): under load that one waits for a CPU until the running task's slice ends, and a
/// SIGKILLed tenant's memory stayed counted that much longer (issue 36). The memory
/// connection's thread still detaches it (then freeing nothing), and its own drain handles a
/// process that lives on or a card that has not let go yet. The process is the memory
/// connection's (the kernel's name for it, not the channel's), so a channel that another
/// process subscribed with a ticket it was handed frees nothing by closing.
pub(crate) fn after_channel_close(arb: &Arbiter, b: &TenantBinding, mem: ConnId) {
    let Some(id) = arb.conn_process(b.key, mem) else {
        return;
    };
    if !Exit::of(id).wait(CHANNEL_EXIT_GRACE) {
        return;
    }
    let Ok(bytes) = arb.with_ledger(|l| l.begin_drain(b.key, mem)) else {
        return;
    };
    if bytes == 0 {
        return;
    }
    // The same rule as a drain's: without a card the exit is the best word.
    let free = CARD.get().is_none_or(|c| c.holds(id.pid) == Ok(false));
    if !free {
        return;
    }
    if let Ok(freed) = arb.with_ledger(|l| l.release_drained(b.key, mem))
        && freed > 0
    {
        arb.pressure().note_freed();
        tracing::debug!(
            "tenant conn {mem} of {} (pid {}): {} released at its exit, its channel's close",
            b.view.id,
            id.pid,
            tessera_protocol::size::human(freed)
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A clock that moves only when slept on (or when a fake waits on it), ns.
    struct FakeClock(AtomicU64);

    impl FakeClock {
        fn set(&self, t: Duration) {
            self.0.store(t.as_nanos() as u64, Ordering::SeqCst);
        }
    }

    impl Clock for FakeClock {
        fn now(&self) -> Duration {
            Duration::from_nanos(self.0.load(Ordering::SeqCst))
        }
        fn sleep(&self, d: Duration) {
            self.set(self.now() + d);
        }
    }

    /// A process that exits at `at` (never: `None`), on the fake clock.
    struct FakeExit<'c> {
        clock: &'c FakeClock,
        at: Option<Duration>,
    }

    impl ExitWatch for FakeExit<'_> {
        fn wait(&self, timeout: Duration) -> bool {
            let now = self.clock.now();
            match self.at {
                Some(at) if at <= now + timeout => {
                    self.clock.set(now.max(at));
                    true
                }
                _ => {
                    self.clock.sleep(timeout);
                    false
                }
            }
        }
    }

    /// A card that holds the pid's memory until `frees_at` (never: `None`), counting questions.
    struct FakeCard<'c> {
        clock: &'c FakeClock,
        frees_at: Option<Duration>,
        asked: AtomicU32,
        fails: bool,
    }

    impl CardView for FakeCard<'_> {
        fn holds(&self, _pid: i32) -> Result<bool, DrainError> {
            self.asked.fetch_add(1, Ordering::SeqCst);
            if self.fails {
                return Err(DrainError::Nvml("unknown error".into()));
            }
            Ok(self.frees_at.is_none_or(|t| self.clock.now() < t))
        }
    }

    fn drain(
        exit_at: Option<Duration>,
        frees_at: Option<Duration>,
        fails: bool,
        has_card: bool,
    ) -> (Why, Duration, u32, Option<DrainError>) {
        let clock = FakeClock(AtomicU64::new(0));
        let exit = FakeExit {
            clock: &clock,
            at: exit_at,
        };
        let card = FakeCard {
            clock: &clock,
            frees_at,
            asked: AtomicU32::new(0),
            fails,
        };
        let mut d = Drain::new(clock.now(), DRAIN_BOUND, has_card);
        let view = has_card.then_some(&card as &dyn CardView);
        let (why, error) = run(&mut d, &clock, &exit, view, 42);
        (why, clock.now(), card.asked.load(Ordering::SeqCst), error)
    }

    #[test]
    fn a_card_that_frees_at_the_exit_is_asked_at_the_exit() {
        let (why, at, asked, _) = drain(Some(3 * MS), Some(3 * MS), false, true);
        assert_eq!((why, at), (Why::Card, 3 * MS));
        // At the close, 0.25, 0.75 and 1.75 ms (the waits double), then at the exit.
        assert_eq!(asked, 5);
    }

    #[test]
    fn a_card_that_frees_later_is_asked_again_with_growing_waits_until_it_does() {
        let (why, at, asked, _) = drain(Some(MS), Some(200 * MS), false, true);
        assert_eq!(why, Why::Card);
        assert!(
            at >= 200 * MS && at <= 200 * MS + LAST_LOOK,
            "released {at:?} after close: at most one wait after the card freed"
        );
        // 3 before the exit; after it the waits start again at 0.25 ms and double up to
        // 25 ms: 8 questions in the first 33 ms, then one every 25 ms.
        assert!(asked <= 20, "asked {asked} times");
    }

    #[test]
    fn a_live_process_the_card_holds_nothing_of_is_released_at_the_first_question() {
        // A process that closed its socket and holds nothing on the card (or whose driver
        // handle closed before its socket, at exit).
        let (why, at, asked, _) = drain(None, Some(Duration::ZERO), false, true);
        assert_eq!((why, at, asked), (Why::Card, Duration::ZERO, 1));
    }

    #[test]
    fn a_live_process_holding_memory_is_released_at_the_bound() {
        let (why, at, asked, _) = drain(None, None, false, true);
        assert_eq!((why, at), (Why::TimedOut { exited: false }, DRAIN_BOUND));
        assert!(asked < 100, "asked {asked} times in 2 s");
    }

    #[test]
    fn an_exit_during_the_wait_for_the_next_question_is_asked_about_at_once() {
        // Asked at the close (holds), then the waits grow to 25 ms; the exit at 100.1 ms
        // and the card's release with it end the drain then, not at the next question.
        let exit = 100 * MS + Duration::from_micros(100);
        let (why, at, _, _) = drain(Some(exit), Some(exit), false, true);
        assert_eq!((why, at), (Why::Card, exit));
    }

    #[test]
    fn a_card_that_never_frees_is_given_up_on_at_the_bound() {
        let (why, at, asked, error) = drain(Some(10 * MS), None, false, true);
        assert_eq!((why, at), (Why::TimedOut { exited: true }, DRAIN_BOUND));
        assert!(asked < 100, "asked {asked} times in 2 s");
        assert_eq!(error, None);
    }

    #[test]
    fn a_card_that_cannot_answer_is_asked_until_the_bound_and_its_error_reported() {
        let (why, at, _, error) = drain(Some(MS), Some(Duration::ZERO), true, true);
        assert_eq!((why, at), (Why::TimedOut { exited: true }, DRAIN_BOUND));
        assert_eq!(error, Some(DrainError::Nvml("unknown error".into())));
    }

    #[test]
    fn without_a_card_the_exit_ends_the_drain() {
        let (why, at, asked, _) = drain(Some(7 * MS), None, false, false);
        assert_eq!((why, at, asked), (Why::Exited, 7 * MS, 0));
    }

    #[test]
    fn the_state_machine_steps_ask_wait_ask_sleep_and_end() {
        let mut d = Drain::new(10 * MS, DRAIN_BOUND, true);
        assert_eq!(d.step(10 * MS), Step::AskCard);
        assert_eq!(d.card(true, 10 * MS), None);
        assert_eq!(d.step(10 * MS), Step::WaitExit(FIRST_LOOK));
        assert_eq!(d.card(true, 10 * MS + FIRST_LOOK), None);
        assert_eq!(d.step(10 * MS + FIRST_LOOK), Step::WaitExit(2 * FIRST_LOOK));
        d.exited(12 * MS);
        assert_eq!(d.step(12 * MS), Step::AskCard);
        assert_eq!(d.card(true, 12 * MS), None);
        assert_eq!(d.step(12 * MS), Step::Sleep(FIRST_LOOK));
        assert_eq!(d.step(12 * MS + FIRST_LOOK), Step::AskCard);
        assert_eq!(
            d.step(10 * MS + DRAIN_BOUND),
            Step::Done(Why::TimedOut { exited: true })
        );
        assert_eq!(d.card(false, 13 * MS), Some(Why::Card));
    }

    #[test]
    fn a_closed_pressure_channel_releases_its_memory_connection_only_once_its_process_exited() {
        // The channel's thread releases the memory connection's bytes when that process has
        // exited (here: no card installed, so the exit is the word); a live process keeps them,
        // whoever closed the channel (a tenant handing its ticket to another process included).
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let (arb, token) = crate::state::test_arbiter_with_allocation(dir.path(), 2, 1 << 30);
        let me = crate::peer::ProcId {
            pid: std::process::id() as i32,
            start: crate::peer::proc_start(std::process::id() as i32).unwrap(),
        };
        let live = arb
            .attach_tenant(&token, 7, Some(crate::peer::Peer::without_pidfd(me)))
            .unwrap();
        arb.with_ledger(|l| l.reserve(live.key, 7, 600 * MIB))
            .unwrap();
        after_channel_close(&arb, &live, 7);
        assert_eq!(
            arb.with_ledger(|l| l.usage(live.key)).unwrap().in_use,
            600 * MIB
        );
        assert_eq!(
            arb.with_ledger(|l| l.draining(live.key)),
            0,
            "not even draining"
        );

        let mut child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let gone = crate::peer::ProcId {
            pid,
            start: crate::peer::proc_start(pid).unwrap(),
        };
        let dead = arb
            .attach_tenant(&token, 8, Some(crate::peer::Peer::without_pidfd(gone)))
            .unwrap();
        arb.with_ledger(|l| l.reserve(dead.key, 8, 300 * MIB))
            .unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        after_channel_close(&arb, &dead, 8);
        assert_eq!(
            arb.with_ledger(|l| l.usage(dead.key)).unwrap().in_use,
            600 * MIB
        );
        // Its own thread's detach then frees nothing more.
        assert_eq!(arb.detach_tenant(&dead, 8, Some(gone)).unwrap(), 0);
        assert_eq!(
            arb.with_ledger(|l| l.usage(live.key)).unwrap().in_use,
            600 * MIB
        );
    }
}
