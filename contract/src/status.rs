//! The status documents workers write to Redis every [`WRITE_EVERY`] with a
//! [`TTL`] (docs/semantics.md §5), so that `topology status` (and anything else on
//! `shardline-ops`) can tell owner, backlog age and in-flight events without
//! the broker's management plugin and without depending on the worker; and
//! the backlog levels both sides compute. Keys are in [`crate::keys`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// How often a worker writes the status of its shards.
pub const WRITE_EVERY: Duration = Duration::from_secs(2);
/// How long a status lives unless written again: a status older than this is
/// gone, so a missing key means no worker reports the shard.
pub const TTL: Duration = Duration::from_secs(10);

/// How long the report of a worker that stopped gracefully lives, so that a
/// shard nobody took over keeps saying since when its events wait.
pub const STOPPED_TTL: Duration = Duration::from_secs(3600);

/// Wall-clock Unix milliseconds now.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Backlog age thresholds (docs/semantics.md §5).
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

/// Where the time an event's backlog age counts from came from
/// (docs/semantics.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StampSource {
    /// The worker's own clock when it received the event: the event carried
    /// no publish time, or one later than that.
    Received,
    /// The broker's stamp ([`crate::headers::BROKER_TIMESTAMP_MS`]), trusted
    /// because the worker saw the broker overwrite a planted one.
    Broker,
    /// The publisher's claim (`x-published-at-ms`, else the AMQP `timestamp`),
    /// earlier than the worker received the event and not verified.
    Publisher,
}

impl StampSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Received => "received",
            Self::Broker => "broker",
            Self::Publisher => "publisher",
        }
    }
}

/// The label of a WARN or PAGE whose backlog age rests on a publisher's
/// claim ([`StampSource::Publisher`]): `PAGE (publisher-claimed)`.
pub const PUBLISHER_CLAIMED: &str = "publisher-claimed";

/// One shard's status as a worker writes it (JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardReport {
    pub shard: u16,
    /// The worker consuming the shard (`--worker-name`).
    pub owner: String,
    /// Age of the oldest unprocessed event, 0 when none.
    pub backlog_age_seconds: f64,
    /// What that age counts from; absent when there is no backlog, and in
    /// documents of workers that predate it (their ages could rest on a
    /// publisher's claim unlabelled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog_age_source: Option<StampSource>,
    /// How long the in-flight event has been worked on; absent when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inflight_age_seconds: Option<f64>,
    /// Events in flight (claimed, not yet acked); the age above is the
    /// oldest's. Absent in documents of workers that predate it.
    #[serde(default)]
    pub inflight_events: u64,
    /// Events taken from the queue that wait for an earlier event of their
    /// order to finish (or for a free slot), with `--concurrency` > 1; they
    /// count in the backlog age. Absent in documents of workers that predate it.
    #[serde(default)]
    pub waiting_events: u64,
    pub held_events: u64,
    /// The events held by the sequence gate (`shardline reconcile` treats
    /// them as on their way).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<HeldRef>,
    /// Unix milliseconds when written.
    pub updated_at_ms: u64,
    /// Events a second its owner forwarded from the shard's queue to
    /// other shards over the last status interval: events still routed by
    /// a shard count of before (a publisher outside the project, or one
    /// without the recorded topology), or a reshard's moves. Absent in
    /// documents of workers that predate it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub forwarded_per_second: f64,
    /// Unix milliseconds when the owner stopped consuming the shard on a
    /// graceful stop; absent while it consumes. A stopped report names no
    /// owner ([`Self::owner`]) and lives [`STOPPED_TTL`], unless a new owner
    /// writes over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_at_ms: Option<u64>,
}

impl ShardReport {
    /// The worker consuming the shard; none once it stopped.
    pub fn owner(&self) -> Option<&str> {
        self.stopped_at_ms.is_none().then_some(self.owner.as_str())
    }

    /// The label a level above OK carries when the backlog age rests on a
    /// publisher's claim ([`PUBLISHER_CLAIMED`]); none for a stopped report,
    /// whose age counts from the stop.
    pub fn level_label(&self, level: Level) -> Option<&'static str> {
        let claimed =
            self.stopped_at_ms.is_none() && self.backlog_age_source == Some(StampSource::Publisher);
        (claimed && level > Level::Ok).then_some(PUBLISHER_CLAIMED)
    }

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

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// An event held by the sequence gate: its order (as in Redis keys) and kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldRef {
    pub order_key: String,
    pub event: String,
}

/// One worker process as it reports itself (JSON, `status:worker:{name}`):
/// which shards it was given and which it consumes. Later fields (fleet
/// membership, the downstream breaker) are added with `#[serde(default)]`, so
/// older readers and writers keep understanding each other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// The worker's name (`--worker-name`), also the owner in its shard reports.
    pub worker: String,
    /// The shards it was assigned (consumed or stood by for).
    pub assigned: Vec<u16>,
    /// Of those, the shards it consumes now.
    pub consuming: Vec<u16>,
    /// Unix milliseconds when written.
    pub updated_at_ms: u64,
    /// Its downstream breaker.
    #[serde(default)]
    pub breaker: BreakerReport,
    /// It honours resharding's markers (a worker of before dead-letters
    /// them `control`: a reshard refuses to start while one runs).
    #[serde(default)]
    pub knows_markers: bool,
    /// It consumes the shard queues a reshard adds (`--assign auto` or
    /// `all`); a fixed part keeps its `assigned`.
    #[serde(default)]
    pub takes_new_shards: bool,
}

/// Whether a worker's handler calls flow (closed) or are paused because the
/// downstream looks out (open: waiting for the cooldown; half-open: one probe
/// call runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BreakerState {
    #[default]
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    /// The gauge value: 0 closed, 1 open, 2 half-open.
    pub fn value(self) -> u8 {
        self as u8
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half-open",
        }
    }
}

/// A worker's downstream breaker as its status document carries it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BreakerReport {
    pub state: BreakerState,
    /// Unix milliseconds since calls are paused (open or half-open); none when closed.
    #[serde(default)]
    pub since_ms: Option<u64>,
    /// Why it last changed state.
    #[serde(default)]
    pub reason: String,
    /// Times it opened since the worker started.
    #[serde(default)]
    pub trips: u64,
    /// Why calls are paused (or were, when closed): absent in documents of
    /// workers older than this field, read as an outage.
    #[serde(default)]
    pub cause: PauseCause,
}

/// Why a worker's calls are paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseCause {
    /// The downstream is out: connections refused, timeouts, 5xx.
    #[default]
    Outage,
    /// The downstream's configuration is wrong (a redirect, or the same
    /// 401/403/404/405/410 for several orders): an operator must act.
    Configuration,
}

impl PauseCause {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Outage => "outage",
            Self::Configuration => "configuration",
        }
    }
}

impl BreakerReport {
    /// How long calls have been paused at `now_ms`; zero when closed.
    pub fn paused_for(&self, now_ms: u64) -> Duration {
        self.since_ms.map_or(Duration::ZERO, |since| {
            Duration::from_millis(now_ms.saturating_sub(since))
        })
    }
}

/// The fleet's breaker document (`Keys::fleet_breaker`): which worker has it
/// open, and its report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetBreaker {
    pub worker: String,
    pub breaker: BreakerReport,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
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
            forwarded_per_second: 0.0,
            shard: 3,
            owner: "worker-a".into(),
            backlog_age_seconds: 12.5,
            backlog_age_source: None,
            inflight_age_seconds: Some(1.25),
            inflight_events: 1,
            waiting_events: 0,
            held_events: 2,
            held: Vec::new(),
            updated_at_ms: 1_700_000_000_000,
            stopped_at_ms: None,
        };
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "shard": 3, "owner": "worker-a", "backlog_age_seconds": 12.5,
                "inflight_age_seconds": 1.25, "inflight_events": 1, "waiting_events": 0,
                "held_events": 2,
                "updated_at_ms": 1_700_000_000_000u64,
            })
        );
        let back: ShardReport = serde_json::from_value(json).unwrap();
        assert_eq!(back, report);
        let idle = ShardReport {
            inflight_age_seconds: None,
            inflight_events: 0,
            ..report.clone()
        };
        assert!(
            !serde_json::to_string(&idle)
                .unwrap()
                .contains("inflight_age")
        );
        let old: ShardReport = serde_json::from_str(
            r#"{"shard":1,"owner":"w","backlog_age_seconds":0.0,"held_events":0,"updated_at_ms":1}"#,
        )
        .unwrap();
        assert_eq!(
            (old.inflight_events, old.stopped_at_ms, old.owner()),
            (0, None, Some("w")),
            "documents of older workers still read"
        );
        let stopped = ShardReport {
            stopped_at_ms: Some(1_700_000_001_000),
            ..report
        };
        let json = serde_json::to_value(&stopped).unwrap();
        assert_eq!(json["stopped_at_ms"], 1_700_000_001_000u64);
        assert_eq!(stopped.owner(), None, "a stopped worker owns nothing");
    }

    #[test]
    fn a_level_resting_on_a_publishers_claim_is_labelled() {
        let report: ShardReport = serde_json::from_str(
            r#"{"shard":1,"owner":"w","backlog_age_seconds":300.0,"backlog_age_source":"publisher","held_events":1,"updated_at_ms":1}"#,
        )
        .unwrap();
        assert_eq!(report.backlog_age_source, Some(StampSource::Publisher));
        assert_eq!(report.level_label(Level::Page), Some("publisher-claimed"));
        assert_eq!(report.level_label(Level::Warn), Some("publisher-claimed"));
        assert_eq!(report.level_label(Level::Ok), None, "OK needs no label");
        for seen in [StampSource::Received, StampSource::Broker] {
            let seen = ShardReport {
                backlog_age_source: Some(seen),
                ..report.clone()
            };
            assert_eq!(seen.level_label(Level::Page), None);
        }
        let stopped = ShardReport {
            stopped_at_ms: Some(1),
            ..report.clone()
        };
        assert_eq!(
            stopped.level_label(Level::Page),
            None,
            "a stopped shard's age counts from the stop"
        );
        let older = ShardReport {
            backlog_age_source: None,
            ..report
        };
        assert_eq!(older.level_label(Level::Page), None);
        assert_eq!(
            serde_json::to_value(Some(StampSource::Broker)).unwrap(),
            "broker"
        );
    }

    #[test]
    fn a_backlog_keeps_ageing_after_its_report() {
        let report = ShardReport {
            forwarded_per_second: 0.0,
            shard: 0,
            owner: "w".into(),
            backlog_age_seconds: 10.0,
            backlog_age_source: Some(StampSource::Received),
            inflight_age_seconds: None,
            inflight_events: 0,
            waiting_events: 0,
            held_events: 0,
            held: Vec::new(),
            updated_at_ms: 1_000_000,
            stopped_at_ms: None,
        };
        assert_eq!(report.backlog_age_at(1_002_000), Duration::from_secs(12));
        let drained = ShardReport {
            backlog_age_seconds: 0.0,
            ..report
        };
        assert_eq!(drained.backlog_age_at(1_002_000), Duration::ZERO);
    }
}

/// What an outbox relay is doing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RelayRole {
    /// It holds the outbox's lock and publishes.
    Active,
    /// Another relay holds the lock; it takes over when that one goes.
    Standby,
    /// It lost the database or the broker and retries (`error` says why).
    Retrying,
}

impl RelayRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Standby => "standby",
            Self::Retrying => "retrying",
        }
    }
}

/// One outbox relay as it reports itself (JSON, `status:relay:{name}`),
/// written every [`WRITE_EVERY`] with a [`TTL`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RelayReport {
    /// The relay's name (`--name`).
    pub relay: String,
    /// The database it relays from, password hidden, and the outbox's schema.
    pub database: String,
    pub schema: String,
    pub role: RelayRole,
    /// Age of the oldest unpublished row it saw, from its `written_at`, in
    /// milliseconds; 0 when the outbox was empty.
    pub lag_ms: u64,
    /// Rows published, confirmed and deleted since it started.
    pub relayed: u64,
    /// Why it retries, one line; `None` while it works.
    #[serde(default)]
    pub error: Option<String>,
    /// Unix milliseconds when written.
    pub updated_at_ms: u64,
}
