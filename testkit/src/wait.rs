//! The one polling loop of the test kit and the tests.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How often a condition is checked again.
pub const POLL: Duration = Duration::from_millis(50);

/// Polls `probe` every [`POLL`] until it returns `Ok(value)`, and returns the
/// value. `Err(context)` means "not yet"; the last context goes into the
/// failure message when `timeout` passes (a probe that hangs past the deadline
/// fails the same way). A probe may also panic itself, e.g. when a worker it
/// waits on has exited: then the test fails at once.
///
/// ```no_run
/// # async fn f(env: &shardline_testkit::TestEnv) {
/// use shardline_testkit::{STARTUP, wait_until};
/// let depth = wait_until("the DLQ to hold a letter", STARTUP, || async {
///     let depths = env.queue_depths().await;
///     let dlq = depths.get(&env.names.dead_letter_queue).map_or(0, |d| d.0);
///     if dlq > 0 { Ok(dlq) } else { Err(format!("depths {depths:?}")) }
/// })
/// .await;
/// # }
/// ```
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    try_wait_until(what, timeout, probe)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// [`wait_until`] that returns the timeout as `Err` (saying what it waited
/// for and what it last saw) instead of failing the test: for a harness that
/// records the outcome and lets its own check judge it.
pub async fn try_wait_until<T, F, Fut>(
    what: &str,
    timeout: Duration,
    mut probe: F,
) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let started = Instant::now();
    let deadline = started + timeout;
    let mut last = String::from("(not checked yet)");
    loop {
        match tokio::time::timeout_at(deadline, probe()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(context)) => last = context,
            Err(_) => {
                last =
                    format!("the last check was still running at the deadline; before it: {last}")
            }
        }
        if Instant::now() + POLL >= deadline {
            return Err(format!(
                "timed out after {:?} waiting for {what}\nlast seen: {last}",
                started.elapsed()
            ));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `Ok(())` when `done`, else `Err(context())`: a probe's answer in one line.
pub fn check(done: bool, context: impl FnOnce() -> String) -> Result<(), String> {
    if done { Ok(()) } else { Err(context()) }
}
