//! Shard status in Redis (SPEC §5): each worker writes the status of the shards
//! it consumes every [`WRITE_EVERY`] with a [`TTL`], so that `topology status`
//! can tell owner and backlog age without the broker's management plugin.
//! Also the backlog levels, shared by the metrics and `topology status`.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shardline_topology::ShardId;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Metrics, ShardState, unix_ms};

/// How often a worker writes the status of its shards.
pub const WRITE_EVERY: Duration = Duration::from_secs(2);
/// How long a status lives unless written again: a status older than this is
/// gone, so a missing key means no worker reports the shard.
pub const TTL: Duration = Duration::from_secs(10);

/// Backlog age thresholds (SPEC §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// WARN from this age. Default 30 s.
    pub warn: Duration,
    /// PAGE from this age. Default 2 min.
    pub page: Duration,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            warn: Duration::from_secs(30),
            page: Duration::from_secs(120),
        }
    }
}

/// How far behind a shard is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Level {
    Ok,
    Warn,
    Page,
}

impl Level {
    pub fn of(backlog_age: Duration, thresholds: &Thresholds) -> Self {
        if backlog_age >= thresholds.page {
            Self::Page
        } else if backlog_age >= thresholds.warn {
            Self::Warn
        } else {
            Self::Ok
        }
    }

    /// The gauge value: 0 OK, 1 WARN, 2 PAGE.
    pub fn value(self) -> u8 {
        self as u8
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "OK",
            Self::Warn => "WARN",
            Self::Page => "PAGE",
        }
    }
}

/// One shard's status as a worker writes it (JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardReport {
    pub shard: u16,
    /// The worker consuming the shard (`--worker-name`).
    pub owner: String,
    /// Age of the oldest unprocessed event, 0 when none.
    pub backlog_age_seconds: f64,
    /// How long the in-flight event has been worked on; absent when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inflight_age_seconds: Option<f64>,
    pub held_events: u64,
    /// The events held by the sequence gate (`shardline reconcile` treats
    /// them as on their way).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<HeldRef>,
    /// Unix milliseconds when written.
    pub updated_at_ms: u64,
}

impl ShardReport {
    /// The backlog age now: when the shard had a backlog, it has aged since
    /// the report was written (it may also have drained; the next report says).
    pub fn backlog_age_at(&self, now_ms: u64) -> Duration {
        let reported = Duration::from_secs_f64(self.backlog_age_seconds.max(0.0));
        if reported.is_zero() {
            reported
        } else {
            reported + Duration::from_millis(now_ms.saturating_sub(self.updated_at_ms))
        }
    }
}

/// An event held by the sequence gate: its order (as in Redis keys) and kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldRef {
    pub order_key: String,
    pub event: String,
}

/// The Redis key of a shard's status.
pub fn key(redis_prefix: &str, shard: u16) -> String {
    format!("{redis_prefix}status:shard:{shard}")
}

/// The reports of the consuming shards now.
pub fn reports(metrics: &Metrics, owner: &str) -> Vec<ShardReport> {
    let now = unix_ms();
    metrics
        .watches()
        .filter(|w| w.state() == ShardState::Consuming)
        .map(|w| {
            let snap = w.snapshot(now);
            ShardReport {
                shard: w.shard.get(),
                owner: owner.to_owned(),
                backlog_age_seconds: round_ms(snap.backlog_age),
                inflight_age_seconds: snap.inflight_age.map(round_ms),
                held_events: snap.held,
                held: if snap.held > 0 {
                    w.held_refs()
                } else {
                    Vec::new()
                },
                updated_at_ms: now,
            }
        })
        .collect()
}

fn round_ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

/// Whether the last status write reached Redis (part of `/readyz`).
#[derive(Debug, Default)]
pub struct WriterHealth {
    failing: std::sync::atomic::AtomicBool,
}

impl WriterHealth {
    pub fn redis_ok(&self) -> bool {
        !self.failing.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set(&self, ok: bool) {
        self.failing
            .store(!ok, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Writes the status of the consuming shards every [`WRITE_EVERY`] until
/// `shutdown`. A failed write is logged once per outage and retried next time.
pub async fn run_writer(
    pool: deadpool_redis::Pool,
    metrics: Arc<Metrics>,
    redis_prefix: String,
    owner: String,
    health: Arc<WriterHealth>,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(WRITE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        let reports = reports(&metrics, &owner);
        let written =
            tokio::time::timeout(WRITE_EVERY, write(&pool, &redis_prefix, &reports)).await;
        let result = written.unwrap_or_else(|_| Err("timed out".into()));
        match result {
            Ok(()) => health.set(true),
            Err(e) => {
                if health.redis_ok() {
                    tracing::warn!(error = %e, "cannot write shard status to Redis");
                }
                health.set(false);
            }
        }
    }
}

async fn write(
    pool: &deadpool_redis::Pool,
    redis_prefix: &str,
    reports: &[ShardReport],
) -> Result<(), String> {
    let mut conn = pool.get().await.map_err(|e| e.to_string())?;
    let mut pipe = redis::pipe();
    // Also a ping, so that an idle worker notices that Redis went away.
    pipe.cmd("PING").ignore();
    for report in reports {
        let json = serde_json::to_string(report).map_err(|e| e.to_string())?;
        pipe.cmd("SET")
            .arg(key(redis_prefix, report.shard))
            .arg(json)
            .arg("PX")
            .arg(u64::try_from(TTL.as_millis()).unwrap_or(u64::MAX))
            .ignore();
    }
    pipe.query_async::<()>(&mut *conn)
        .await
        .map_err(|e| e.to_string())
}

/// Reads the status of `shards`; `None` where no fresh status exists.
pub async fn read(
    conn: &mut impl redis::aio::ConnectionLike,
    redis_prefix: &str,
    shards: &[ShardId],
) -> Result<Vec<Option<ShardReport>>, redis::RedisError> {
    if shards.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = shards.iter().map(|s| key(redis_prefix, s.get())).collect();
    let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(conn).await?;
    Ok(values
        .into_iter()
        .map(|v| v.and_then(|json| serde_json::from_str(&json).ok()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_start_at_their_thresholds() {
        let t = Thresholds::default();
        assert_eq!(Level::of(Duration::ZERO, &t), Level::Ok);
        assert_eq!(Level::of(Duration::from_millis(29_999), &t), Level::Ok);
        assert_eq!(Level::of(Duration::from_secs(30), &t), Level::Warn);
        assert_eq!(Level::of(Duration::from_millis(119_999), &t), Level::Warn);
        assert_eq!(Level::of(Duration::from_secs(120), &t), Level::Page);
        assert_eq!(Level::of(Duration::from_secs(3600), &t), Level::Page);
        assert_eq!(
            [Level::Ok, Level::Warn, Level::Page].map(Level::value),
            [0, 1, 2]
        );
        let tight = Thresholds {
            warn: Duration::from_secs(1),
            page: Duration::from_secs(2),
        };
        assert_eq!(Level::of(Duration::from_millis(1500), &tight), Level::Warn);
    }

    #[test]
    fn report_json_round_trips_and_names_its_fields() {
        let report = ShardReport {
            shard: 3,
            owner: "worker-a".into(),
            backlog_age_seconds: 12.5,
            inflight_age_seconds: Some(1.25),
            held_events: 2,
            held: Vec::new(),
            updated_at_ms: 1_700_000_000_000,
        };
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "shard": 3, "owner": "worker-a", "backlog_age_seconds": 12.5,
                "inflight_age_seconds": 1.25, "held_events": 2,
                "updated_at_ms": 1_700_000_000_000u64,
            })
        );
        let back: ShardReport = serde_json::from_value(json).unwrap();
        assert_eq!(back, report);
        let idle = ShardReport {
            inflight_age_seconds: None,
            ..report.clone()
        };
        assert!(!serde_json::to_string(&idle).unwrap().contains("inflight"));
        assert_eq!(key("shardline:", 3), "shardline:status:shard:3");
    }

    #[test]
    fn a_backlog_keeps_ageing_after_its_report() {
        let report = ShardReport {
            shard: 0,
            owner: "w".into(),
            backlog_age_seconds: 10.0,
            inflight_age_seconds: None,
            held_events: 0,
            held: Vec::new(),
            updated_at_ms: 1_000_000,
        };
        assert_eq!(report.backlog_age_at(1_002_000), Duration::from_secs(12));
        let drained = ShardReport {
            backlog_age_seconds: 0.0,
            ..report
        };
        assert_eq!(drained.backlog_age_at(1_002_000), Duration::ZERO);
    }
}
