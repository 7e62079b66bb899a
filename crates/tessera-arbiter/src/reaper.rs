//! The reaper: deletes allocations owned by a process (`tessera run`) once the owner is gone and
//! none of their processes is left (the rule is [`crate::owner::gone`]; this is its service,
//! run by the server every [`REAP_EVERY`], and at once when an owner exits (a pidfd of it,
//! [`watch_owner`]) or a process closes its last connection ([`Arbiter::reap_soon`]): an
//! allocation of `tessera run --exec`, whose owner is the command itself, is gone
//! milliseconds after the command, not up to a tick later, so the next command's shares fit.
//! A create about to be refused for room looks too (`admin.rs`): a script's next command can
//! ask before the reaper's task has run. An exited owner whose parent has not waited for it
//! yet (a zombie) is gone ([`tessera_protocol::process::alive`]).

#![forbid(unsafe_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tessera_protocol::ProcessOwner;

use crate::owner::{alive, gone};
use crate::peer::{Exit, ProcId};
use crate::state::Arbiter;

/// How often the reaper looks at owned allocations.
pub(crate) const REAP_EVERY: Duration = Duration::from_millis(250);

/// An allocation restored from the state file is not reaped this soon after the arbiter
/// started: its processes need a moment to reconnect (an interposer retries for up to 5 s), and
/// until they have, it would look empty.
pub(crate) const RECONNECT_GRACE: Duration = Duration::from_secs(10);

/// One look at every owned allocation: deletes those whose owner is gone and whose processes
/// all ended; returns how many it deleted.
pub(crate) async fn reap(arb: &Arbiter, proc: &Path) -> usize {
    let mut deleted = 0;
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
                deleted += 1;
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
    deleted
}

/// Runs [`reap`] every [`REAP_EVERY`], and whenever [`Arbiter::reap_soon`] asks, until
/// aborted.
pub(crate) async fn reap_loop(arb: Arc<Arbiter>) {
    let mut tick = tokio::time::interval(REAP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let asked = arb.reap_signal();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = asked.notified() => {}
        }
        reap(&arb, Path::new("/proc")).await;
    }
}

/// Asks the reaper to look once `owner` (of an allocation just created) has exited: a task
/// waits on a pidfd of it, the kernel's word, not a poll. Nothing to watch on a kernel without
/// `pidfd_open`: the reaper's tick finds the owner gone then.
pub(crate) fn watch_owner(arb: &Arbiter, owner: ProcessOwner) {
    let id = ProcId {
        pid: owner.pid,
        start: owner.start_time,
    };
    match Exit::of(id) {
        exit @ Exit::Pidfd(_) => {
            let asked = arb.reap_signal();
            tokio::spawn(async move {
                exit.exited().await;
                asked.notify_one();
            });
        }
        Exit::Gone => arb.reap_soon(),
        Exit::Unknown => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The owner's exit itself asks the reaper to look (the pidfd's word), and an owner that is
    /// already gone asks at once; while the owner runs, nothing asks.
    #[tokio::test]
    async fn an_owners_exit_asks_the_reaper_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let arb = crate::state::test_arbiter(dir.path(), 1);
        let asked = arb.reap_signal();
        let (mut child, owner) = crate::owner::test_owner();
        watch_owner(&arb, owner);
        let early = tokio::time::timeout(Duration::from_millis(300), asked.notified()).await;
        assert!(early.is_err(), "asked while the owner runs");
        child.kill().unwrap();
        // Not reaped by us yet: a zombie's pidfd is readable all the same.
        tokio::time::timeout(Duration::from_secs(10), asked.notified())
            .await
            .expect("the owner's exit did not ask the reaper");
        child.wait().unwrap();
        // The same owner again, now gone: asked at once, no task.
        watch_owner(&arb, owner);
        tokio::time::timeout(Duration::from_secs(10), asked.notified())
            .await
            .expect("a gone owner did not ask the reaper");
    }
}
