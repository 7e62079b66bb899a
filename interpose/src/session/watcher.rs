//! The watcher thread: flushes deferred releases, gives back credit an idle process holds,
//! answers pressure, notices the arbiter closing the socket and reconnects; when it panics,
//! the process keeps no credit from then on.

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;

use super::Session;
use crate::tlog;

impl Session {
    /// One round of the watcher thread: waits up to the tick for a free above the kept credit
    /// or a `Pressure`; answers pressure at once; announces credit above what is kept after
    /// the release delay; gives back credit left untouched for a whole tick; checks (without
    /// waiting on it) whether the arbiter closed the socket, and reconnects (and re-declares)
    /// if so.
    ///
    /// The memory socket itself is only polled with a zero timeout: a thread blocked in `poll`
    /// on it would be woken by every frame that passes (two context switches per request).
    pub fn watch_once(&'static self) {
        #[cfg(test)]
        if super::tests::PANIC_IN_WATCHER
            .compare_exchange(
                self as *const Self as usize,
                0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            panic!("injected: a panic in the watcher");
        }
        // A new memory connection's pressure channel first (its set-up is kept off the
        // critical path of the thread that connected); a `Pressure` that came in with its
        // `Subscribed` is answered at once (the socket's poll will not show it again).
        if self.open_wanted_channel() {
            self.answer_pressure();
        }
        let generation = self.generation.load(Ordering::Acquire);
        let before = self.credit.load(Ordering::SeqCst);
        // Arm before looking at the credit: a free after this point wakes us again.
        self.armed.store(true, Ordering::Release);
        if self.pressure_expired() {
            self.pressed_ms.store(0, Ordering::Relaxed);
        }
        let (woken, mut pressed) = if before > self.keep() {
            (true, false)
        } else {
            self.clock.wait_either(
                self.wake_fd.load(Ordering::Acquire),
                self.channel_fd.load(Ordering::Acquire),
                self.watch_timeout(),
            )
        };
        if pressed {
            self.answer_pressure();
        }
        if self.reset_memory_conn.swap(false, Ordering::AcqRel) {
            let mut link = self.lock();
            self.drop_conn(&mut link);
        }
        if woken {
            self.drain_wake_fd();
            // Give the process the chance to allocate the freed bytes again; a pressure that
            // comes meanwhile is answered at once.
            let end = self.clock.now() + self.policy.release_delay;
            loop {
                let left = end.saturating_duration_since(self.clock.now());
                if left.is_zero() {
                    break;
                }
                (_, pressed) =
                    self.clock
                        .wait_either(-1, self.channel_fd.load(Ordering::Acquire), left);
                if pressed {
                    self.answer_pressure();
                }
            }
            if self.credit.load(Ordering::SeqCst) > self.keep() {
                let mut link = self.lock();
                self.flush_locked(&mut link, self.keep());
            }
        } else if !pressed && before > 0 && self.credit.load(Ordering::SeqCst) == before {
            // Quiet for a whole tick (or until a pressed process's turn ended): an idle process
            // holds no credit.
            let mut link = self.lock();
            self.flush_locked(&mut link, 0);
        }
        let fd = self.conn_fd.load(Ordering::Acquire);
        if hung_up(fd) {
            let mut link = self.lock();
            if link.generation == generation && link.conn.is_some() {
                tlog!(Info, "arbiter closed the connection");
                self.drop_conn(&mut link);
            }
        }
        // Connected (the common case): nothing to do, and no lock taken.
        let reconnected = self.conn_fd.load(Ordering::Acquire) >= 0 || {
            let mut link = self.lock();
            !link.ever_connected
                || link.conn.is_some()
                || self.ensure_connected(&mut link, self.clock.now()).is_some()
        };
        if !reconnected {
            self.clock
                .sleep(self.policy.tick.min(self.policy.backoff_max));
        }
    }

    fn drain_wake_fd(&self) {
        let fd = self.wake_fd.load(Ordering::Acquire);
        if fd >= 0 {
            let mut v = 0u64;
            // SAFETY: reading 8 bytes into a live u64 from our non-blocking eventfd.
            let _ = unsafe { libc::read(fd, (&raw mut v).cast(), 8) };
        }
    }

    /// Starts the thread that flushes deferred releases, answers pressure and notices the
    /// arbiter closing the socket (so an idle process's memory is re-declared after an arbiter
    /// restart).
    pub(super) fn start_watcher(&'static self) -> bool {
        // SAFETY: eventfd has no memory preconditions.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            tlog!(
                Warn,
                "cannot create the watcher's eventfd; frees send their release at once"
            );
        }
        // Published before the thread starts, so its first look already waits on it (a look
        // without it would sleep through that round's frees); a free before the thread runs
        // leaves its wake-up in the eventfd's count.
        self.wake_fd.store(efd, Ordering::Release);
        let spawned = std::thread::Builder::new()
            .name("tessera-watch".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                // A panic mid-look leaves nothing half-done that matters: the link's lock is
                // released on unwind, and `watcher_died` then gives every byte of credit back.
                let look =
                    || std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.watch_once()));
                while look().is_ok() {}
                self.watcher_died();
            });
        match spawned {
            Ok(_) => true,
            Err(_) => {
                tlog!(
                    Warn,
                    "cannot start the watcher thread; reconnection waits for the next call"
                );
                // Frees send their release at once again.
                self.wake_fd.store(-1, Ordering::Release);
                if efd >= 0 {
                    // SAFETY: our own eventfd; no thread reads it, and frees from now on see
                    // -1 (the same hand-over as in `watcher_died`).
                    unsafe { libc::close(efd) };
                }
                // Nobody would answer pressure: keep no credit.
                self.close_channel();
                false
            }
        }
    }

    /// The watcher thread panicked: nobody answers pressure or flushes deferred releases any
    /// more, so the process keeps no credit. The channel is closed (which makes [`Self::keep`]
    /// 0), frees send their releases at once from now on, and the credit held is given back.
    fn watcher_died(&'static self) {
        tlog!(
            Error,
            "the watcher thread failed: this process now keeps no memory credit (every free is announced at once)"
        );
        let fd = self.wake_fd.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: our own eventfd; no one reads it any more (frees see -1 from now on).
            unsafe { libc::close(fd) };
        }
        self.close_channel();
        self.try_flush();
    }
}

/// True when the peer of socket `fd` has closed it (checked without waiting).
fn hung_up(fd: RawFd) -> bool {
    if fd < 0 {
        return false;
    }
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `pfd` is a valid pollfd array of length 1; a zero timeout never blocks. A stale
    // fd number at worst reports another file's state; the caller re-checks the generation.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}
