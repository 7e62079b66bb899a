//! Stop signals as something to wait for: `tessera status --watch` blocks SIGINT and SIGTERM
//! and sleeps between frames in `sigtimedwait`, so Ctrl-C or a `kill` ends the sleep at once
//! and the loop can restore the terminal before it exits. No handler runs, so nothing has to
//! be async-signal-safe, and a signal that comes while a frame is being fetched waits, pending,
//! for the next sleep.

use std::time::Duration;

/// SIGINT and SIGTERM, blocked for the calling thread from [`StopSignals::block`] on.
#[derive(Debug)]
pub(crate) struct StopSignals {
    set: libc::sigset_t,
}

impl StopSignals {
    /// Blocks SIGINT and SIGTERM in this thread (the CLI's only one), so they stay pending
    /// until [`StopSignals::wait`] takes them.
    pub(crate) fn block() -> std::io::Result<Self> {
        // SAFETY: an all-zero sigset_t is a valid value to hand to sigemptyset, which then
        // initialises it; the pointers are to this local.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a live sigset_t; these calls only write into it.
        let ok = unsafe {
            libc::sigemptyset(&mut set) == 0
                && libc::sigaddset(&mut set, libc::SIGINT) == 0
                && libc::sigaddset(&mut set, libc::SIGTERM) == 0
        };
        if !ok {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `set` is initialised; a null old-set pointer is allowed.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        Ok(Self { set })
    }

    /// Sleeps up to `timeout`; returns the stop signal that ended the sleep, if one did.
    pub(crate) fn wait(&self, timeout: Duration) -> Option<libc::c_int> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let ts = libc::timespec {
                tv_sec: left.as_secs() as libc::time_t,
                tv_nsec: left.subsec_nanos() as libc::c_long,
            };
            // SAFETY: `self.set` is an initialised sigset_t and `ts` a valid timespec; a null
            // siginfo pointer is allowed.
            let sig = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &ts) };
            if sig > 0 {
                return Some(sig);
            }
            // EAGAIN: the time is up. EINTR (another signal, e.g. SIGWINCH): sleep on.
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINTR) || left.is_zero() {
                return None;
            }
        }
    }
}
