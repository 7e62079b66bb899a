//! The reaper: deletes allocations owned by a process (`tessera run`) once the owner is gone and
//! none of their processes is left (the rule is [`crate::owner::gone`]; this is its service,
//! run by the server every [`REAP_EVERY`]).

#![forbid(unsafe_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::owner::{alive, gone};
use crate::state::Arbiter;

/// How often the reaper looks at owned allocations.
pub(crate) const REAP_EVERY: Duration = Duration::from_millis(250);

/// An allocation restored from the state file is not reaped this soon after the arbiter
/// started: its processes need a moment to reconnect (an interposer retries for up to 5 s), and
/// until they have, it would look empty.
pub(crate) const RECONNECT_GRACE: Duration = Duration::from_secs(10);

/// One look at every owned allocation: deletes those whose owner is gone and whose processes
/// all ended.
pub(crate) async fn reap(arb: &Arc<Arbiter>, proc: &Path) {
    let owned = arb.owned();
    arb.members()
        .retain(|id| owned.iter().any(|(o, ..)| o == id));
    let in_grace = arb.now_ns() < RECONNECT_GRACE.as_nanos() as u64;
    for (id, owner, connected, restored) in owned {
        if restored && in_grace {
            continue;
        }
        let owner_alive = alive(proc, owner);
        let members = arb.members().prune(&id, |p| alive(proc, p));
        if !gone(owner_alive, connected, members) {
            continue;
        }
        match arb.delete(&id).await {
            Ok(()) => {
                arb.members().forget(&id);
                tracing::info!(
                    "deleted allocation {id}: its owner (pid {}) is gone and none of its \
                     processes is left",
                    owner.pid
                );
            }
            Err(e) => tracing::warn!("allocation {id}: owner gone, but not deleted: {e}"),
        }
    }
}

/// Runs [`reap`] every [`REAP_EVERY`] until aborted.
pub(crate) async fn reap_loop(arb: Arc<Arbiter>) {
    let mut tick = tokio::time::interval(REAP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        reap(&arb, Path::new("/proc")).await;
    }
}
