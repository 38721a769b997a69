//! The process's stop signal, for programs that embed the worker: SIGTERM or
//! Ctrl-C cancels a token (the worker drains and returns); a second signal
//! exits at once.

use tokio_util::sync::CancellationToken;

/// Cancels `shutdown` on SIGTERM or Ctrl-C; a second signal exits the process
/// at once (status 130), without draining. Spawn it next to [`crate::run`]:
///
/// ```no_run
/// # async fn example(config: shardline_worker::Config) -> Result<(), shardline_worker::WorkerError> {
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// tokio::spawn(shardline_worker::cancel_on_signal(shutdown.clone()));
/// shardline_worker::run(config, std::sync::Arc::new(shardline_worker::Noop), shutdown).await
/// # }
/// ```
pub async fn cancel_on_signal(shutdown: CancellationToken) {
    wait_for_signal().await;
    tracing::info!("stop signal received: draining (send it again to exit at once)");
    shutdown.cancel();
    wait_for_signal().await;
    tracing::warn!("second stop signal: exiting without draining");
    std::process::exit(130);
}

#[cfg(unix)]
async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() {
    let _ = tokio::signal::ctrl_c().await;
}
