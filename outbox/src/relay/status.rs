//! The relay's status document (`status:relay:{name}` in the fleet's Redis,
//! [`RelayReport`]): written every [`WRITE_EVERY`] with a [`TTL`], so that
//! `topology status` and the console show each relay, its role and its lag.
//! Without Redis in the publisher's configuration nothing is written.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use shardline_contract::status::{RelayReport, RelayRole, TTL, WRITE_EVERY, unix_ms};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::RelayConfig;

/// What the relay is doing, shared with its status writer.
#[derive(Debug)]
pub struct RelayState(Mutex<RelayReport>);

impl RelayState {
    pub(super) fn new(config: &RelayConfig) -> Self {
        Self(Mutex::new(RelayReport {
            relay: config.name.clone(),
            database: config.database.to_string(),
            schema: config.schema.to_string(),
            role: RelayRole::Standby,
            lag_ms: 0,
            relayed: 0,
            error: None,
            updated_at_ms: 0,
        }))
    }

    fn update(&self, change: impl FnOnce(&mut RelayReport)) {
        change(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// The report as it stands.
    pub fn report(&self) -> RelayReport {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(super) fn role(&self, role: RelayRole) {
        self.update(|r| {
            r.role = role;
            r.error = None;
        });
    }

    pub(super) fn retrying(&self, line: String) {
        self.update(|r| {
            r.role = RelayRole::Retrying;
            r.error = Some(line);
        });
    }

    pub(super) fn stopped(&self) {
        self.update(|r| r.role = RelayRole::Standby);
    }

    pub(super) fn lag(&self, lag: Duration) {
        self.update(|r| r.lag_ms = u64::try_from(lag.as_millis()).unwrap_or(u64::MAX));
    }

    pub(super) fn relayed(&self, rows: u64) {
        self.update(|r| r.relayed += rows);
    }
}

/// The status writer's task.
pub(super) struct Writer {
    task: Option<JoinHandle<()>>,
    stop: CancellationToken,
}

impl Writer {
    /// Stops writing; the document expires by its TTL.
    pub(super) async fn finish(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// Writes the relay's report every [`WRITE_EVERY`] until `stop`, when the
/// publisher's configuration names the fleet's Redis.
pub(super) fn spawn_writer(
    config: &RelayConfig,
    state: Arc<RelayState>,
    stop: CancellationToken,
) -> Writer {
    let Some(redis) = config.publisher.redis.clone() else {
        return Writer { task: None, stop };
    };
    let key = config.publisher.keys().relay_status(&config.name);
    let stopped = stop.clone();
    let task = tokio::spawn(async move {
        let mut conn = None;
        let mut tick = tokio::time::interval(WRITE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stopped.cancelled() => break,
                _ = tick.tick() => {}
            }
            if conn.is_none() {
                match redis.connect().await {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        tracing::debug!(error = %e, "the relay cannot write its status");
                        continue;
                    }
                }
            }
            let Some(c) = conn.as_mut() else { continue };
            let mut report = state.report();
            report.updated_at_ms = unix_ms();
            let Ok(json) = serde_json::to_string(&report) else {
                continue;
            };
            let written: Result<(), redis::RedisError> = redis::cmd("SET")
                .arg(&key)
                .arg(json)
                .arg("PX")
                .arg(u64::try_from(TTL.as_millis()).unwrap_or(u64::MAX))
                .query_async(c)
                .await;
            if let Err(e) = written {
                tracing::debug!(error = %e, "the relay cannot write its status");
                conn = None;
            }
        }
    });
    Writer {
        task: Some(task),
        stop,
    }
}
