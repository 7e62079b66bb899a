//! The timer: a tokio task that ticks a GPU's scheduler at its next wake-up (an overdue lease
//! revoked, a capped waiter's bucket refilled, a hold over), or sooner when an event may have
//! moved it. The scheduler itself stays pure: this is the only code that reads a clock.

use std::time::{Duration, Instant};

use super::SchedulerHandle;

impl SchedulerHandle {
    /// Revokes overdue leases and wakes capped waiters on time; runs until the task is
    /// dropped. `epoch` is the origin of the `now` values given to the other methods.
    pub(crate) async fn run_timer(self, epoch: Instant) {
        loop {
            let now = epoch.elapsed().as_nanos() as u64;
            match self.tick(now) {
                Some(at) => {
                    // One extra microsecond so float rounding cannot make a busy loop.
                    let deadline = epoch + Duration::from_nanos(at + 1_000);
                    tokio::select! {
                        _ = tokio::time::sleep_until(deadline.into()) => {}
                        _ = self.changed().notified() => {}
                    }
                }
                None => self.changed().notified().await,
            }
        }
    }
}
