//! The end of both plugins' serving: SIGTERM (the kubelet, a rollout) or SIGINT.

use std::future::Future;

use tokio::signal::unix::{SignalKind, signal};

/// Watches SIGTERM and SIGINT from this call on and returns a future that completes on the
/// first of them. Call it before anything is bound: a handler installed only when the future is
/// first polled (after the sockets are served) left a SIGTERM sent during start-up to the
/// default action, and the plugin died of the signal instead of exiting 0 with its sockets
/// removed (a restart right after a start, or a rollout, would see that). Must be called inside
/// a Tokio runtime (`Runtime::enter`).
pub fn watch() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("shutting down");
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_sigterm_before_the_first_poll_is_seen_not_fatal() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let stop = {
            let _in = rt.enter();
            watch().unwrap()
        };
        // Were the handler installed at the first poll, this would end the test process. Sent
        // by kill(1), as the kubelet's runtime would, so the crate stays free of unsafe code.
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill: {sent}");
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), stop)
                .await
                .expect("the SIGTERM raised before the first poll completes the future");
        });
    }
}
