//! The end of both plugins' serving: SIGTERM (the kubelet, a rollout) or SIGINT.

/// Completes on SIGTERM or SIGINT (the kubelet's pod shutdown, or Ctrl-C); SIGINT alone if
/// SIGTERM cannot be watched.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("shutting down");
}
