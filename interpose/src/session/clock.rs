//! The session's clock: everything it does that reads the time or blocks for a while goes
//! through [`Clock`], so its tests run on a [`FakeClock`] that moves only when the test moves
//! it (no test depends on how fast the machine is). The hot paths (a reservation taken from
//! the credit, a free) read no clock at all.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// Time and timed waits, as the session sees them.
pub trait Clock: Send + Sync {
    /// The current instant.
    fn now(&self) -> Instant;
    /// Blocks the calling thread for `d`.
    fn sleep(&self, d: Duration);
    /// Waits up to `timeout` for `wake` or `chan` to become readable (negative fds are
    /// ignored; with neither it just sleeps). Returns which were readable.
    fn wait_either(&self, wake: RawFd, chan: RawFd, timeout: Duration) -> (bool, bool);
}

/// The machine's monotonic clock, and real waits.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep(&self, d: Duration) {
        std::thread::sleep(d);
    }

    fn wait_either(&self, wake: RawFd, chan: RawFd, timeout: Duration) -> (bool, bool) {
        if wake < 0 && chan < 0 {
            std::thread::sleep(timeout);
            return (false, false);
        }
        // Sub-millisecond waits round up so the release delay is not a busy loop.
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        let ms = if ms == 0 && !timeout.is_zero() { 1 } else { ms };
        poll_readable(wake, chan, ms)
    }
}

/// One `poll` of `wake` and `chan` for reading, up to `ms` milliseconds (0: just a look).
/// Returns which were readable (a hang-up or an error counts: the reader finds out).
pub(super) fn poll_readable(wake: RawFd, chan: RawFd, ms: i32) -> (bool, bool) {
    let mut pfd = [
        libc::pollfd {
            fd: wake,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: chan,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: `pfd` is a valid pollfd array of length 2; negative fds are ignored by poll.
    let n = unsafe { libc::poll(pfd.as_mut_ptr(), 2, ms) };
    if n <= 0 {
        return (false, false);
    }
    let ready = |p: &libc::pollfd| {
        p.fd >= 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
    };
    (ready(&pfd[0]), ready(&pfd[1]))
}

#[cfg(test)]
pub(super) use fake::FakeClock;

#[cfg(test)]
mod fake {
    use std::os::fd::RawFd;
    use std::time::{Duration, Instant};

    use parking_lot::{Condvar, Mutex, MutexGuard};

    use super::{Clock, poll_readable};

    /// A clock that stands still until [`FakeClock::advance`]: a sleep or a timed wait returns
    /// once the fake time has reached its end (a wait on fds also returns when one becomes
    /// readable, as the real one does).
    #[derive(Debug)]
    pub(crate) struct FakeClock {
        origin: Instant,
        state: Mutex<State>,
        moved: Condvar,
    }

    #[derive(Debug, Default)]
    struct State {
        /// Fake time since `origin`.
        now: Duration,
        /// Where each blocked sleeper or waiter wakes (a multiset; one entry per thread).
        wakes: Vec<Duration>,
        /// Sleeps and timed waits begun, ever.
        waits: u64,
    }

    impl FakeClock {
        /// A clock at a fixed origin, leaked as sessions are (they live as long as a process).
        pub(crate) fn leaked() -> &'static Self {
            Box::leak(Box::new(Self {
                origin: Instant::now(),
                state: Mutex::new(State::default()),
                moved: Condvar::new(),
            }))
        }

        /// Fake time since the clock was made.
        pub(crate) fn elapsed(&self) -> Duration {
            self.state.lock().now
        }

        /// Sleeps and timed waits begun so far: unchanged across a call means it never waited.
        pub(crate) fn waits(&self) -> u64 {
            self.state.lock().waits
        }

        /// True while a thread is blocked in a sleep or a timed wait that ends `d` from now
        /// (which tells a test what the session waits for before it moves the time).
        pub(crate) fn waiting_for(&self, d: Duration) -> bool {
            let s = self.state.lock();
            s.wakes.contains(&(s.now + d))
        }

        /// Moves the time on by `d`, waking whoever's wait ends by then.
        pub(crate) fn advance(&self, d: Duration) {
            self.state.lock().now += d;
            self.moved.notify_all();
        }

        /// When a thread is blocked in a sleep or a timed wait that has not ended yet, moves
        /// the time to the earliest end and returns true; else false. Driving a thread with this
        /// makes every wait it does last exactly as long as it asked, however slow the machine.
        pub(crate) fn advance_to_next_wake(&self) -> bool {
            let mut s = self.state.lock();
            let now = s.now;
            let Some(next) = s.wakes.iter().copied().filter(|&w| w > now).min() else {
                return false;
            };
            s.now = next;
            drop(s);
            self.moved.notify_all();
            true
        }

        /// Blocks until the fake time reaches `now + d`, or `early` says to stop (asked
        /// about every millisecond of real time). Returns what `early` last said.
        fn block(&self, d: Duration, mut early: impl FnMut() -> bool) -> bool {
            let mut s = self.state.lock();
            let end = s.now + d;
            s.waits += 1;
            s.wakes.push(end);
            let stopped = loop {
                if s.now >= end {
                    break false;
                }
                let look = MutexGuard::unlocked(&mut s, &mut early);
                if look {
                    break true;
                }
                self.moved.wait_for(&mut s, Duration::from_millis(1));
            };
            let at = s.wakes.iter().position(|&w| w == end);
            if let Some(at) = at {
                s.wakes.swap_remove(at);
            }
            stopped
        }
    }

    impl Clock for FakeClock {
        fn now(&self) -> Instant {
            self.origin + self.state.lock().now
        }

        fn sleep(&self, d: Duration) {
            self.block(d, || false);
        }

        fn wait_either(&self, wake: RawFd, chan: RawFd, timeout: Duration) -> (bool, bool) {
            let mut seen = (false, false);
            self.block(timeout, || {
                seen = poll_readable(wake, chan, 0);
                seen.0 || seen.1
            });
            seen
        }
    }

    mod tests {
        use super::*;

        #[test]
        fn a_sleep_ends_when_the_time_is_moved_past_it_and_not_before() {
            let clock = FakeClock::leaked();
            let sleeper = std::thread::spawn(move || clock.sleep(Duration::from_millis(30)));
            // The sleeper registers its wake-up; moving the time short of it leaves it asleep.
            while clock.waits() == 0 {
                std::thread::yield_now();
            }
            clock.advance(Duration::from_millis(29));
            assert!(clock.advance_to_next_wake(), "the sleeper's end was lost");
            sleeper.join().unwrap();
            assert_eq!(clock.elapsed(), Duration::from_millis(30));
            assert!(!clock.advance_to_next_wake(), "nobody waits any more");
        }

        #[test]
        fn a_wait_on_fds_returns_when_one_becomes_readable_without_the_time_moving() {
            let clock = FakeClock::leaked();
            let mut fds = [0; 2];
            // SAFETY: `fds` has room for the two descriptors pipe(2) writes.
            assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
            let (r, w) = (fds[0], fds[1]);
            let waiter =
                std::thread::spawn(move || clock.wait_either(-1, r, Duration::from_secs(9)));
            while clock.waits() == 0 {
                std::thread::yield_now();
            }
            // SAFETY: writing one byte from a live buffer to our own pipe.
            assert_eq!(unsafe { libc::write(w, [1u8].as_ptr().cast(), 1) }, 1);
            assert_eq!(waiter.join().unwrap(), (false, true));
            assert_eq!(clock.elapsed(), Duration::ZERO);
            for fd in fds {
                // SAFETY: our own pipe's descriptors, closed once.
                unsafe { libc::close(fd) };
            }
        }
    }
}
