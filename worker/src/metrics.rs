//! Prometheus metrics: every name defined here once, the registry, and per-shard
//! handles resolved up front so that the hot path is a few relaxed atomics.
//!
//! Counters and the processing-time histogram are bumped where things happen
//! (`settle.rs`). Everything that depends on the clock (backlog age, in-flight
//! age, the levels, stuck) is computed when scraped, from the per-shard
//! [`ShardWatch`] that the shard task keeps up to date (`shard.rs`).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lapin::BasicProperties;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use shardline_topology::ShardId;
use shardline_topology::headers::{self, FailReason};

use crate::stats::Stats;
use crate::status::{HeldRef, Level, Thresholds};

/// Metric names, as registered. Counters get `_total` appended on exposition
/// (OpenMetrics), so `EVENTS` is scraped as `shardline_events_total`.
pub mod names {
    /// Counter `{shard, outcome}`: outcome `processed`, `duplicate`, `retried`
    /// (a failed attempt retried in place), `dead_lettered`.
    pub const EVENTS: &str = "shardline_events";
    /// Counter `{shard, reason}`: dead letters published (and confirmed) by reason.
    pub const DEAD_LETTERS: &str = "shardline_dead_letters";
    /// Histogram `{shard}`: seconds from taking an event to its ack, processed events.
    pub const PROCESSING_SECONDS: &str = "shardline_processing_seconds";
    /// Counter `{shard}`: handler calls, first attempts and retries.
    pub const HANDLER_ATTEMPTS: &str = "shardline_handler_attempts";
    /// Counter: times Redis became unreachable (shards paused).
    pub const REDIS_OUTAGES: &str = "shardline_redis_outages";
    /// Counter: broker connections opened after the first.
    pub const BROKER_RECONNECTS: &str = "shardline_broker_reconnects";
    /// Counter: sequence gaps given up on (timed out, or accepted as a start).
    pub const SEQ_GAPS: &str = "shardline_seq_gaps";
    /// Gauge `{shard}`: age of the shard's oldest unprocessed event, 0 when none.
    pub const BACKLOG_AGE_SECONDS: &str = "shardline_backlog_age_seconds";
    /// Gauge `{shard}`: 0 OK, 1 WARN, 2 PAGE (`--backlog-warn`, `--backlog-page`).
    pub const BACKLOG_LEVEL: &str = "shardline_backlog_level";
    /// Gauge `{shard}`: messages ready in the shard queue (passive declare, polled).
    pub const QUEUE_DEPTH: &str = "shardline_queue_depth";
    /// Gauge: messages in the dead-letter queue (passive declare, polled).
    pub const DLQ_DEPTH: &str = "shardline_dlq_depth";
    /// Gauge `{shard}`: events the sequence gate holds.
    pub const HELD_EVENTS: &str = "shardline_held_events";
    /// Gauge `{shard}`: 1 while this worker consumes the shard (on
    /// single-active-consumer queues: from its first delivery, as the broker
    /// does not tell a consumer that it became the active one).
    pub const SHARD_ACTIVE: &str = "shardline_shard_active";
    /// Gauge `{shard}`: seconds the in-flight event has been worked on, 0 when none.
    pub const INFLIGHT_SECONDS: &str = "shardline_inflight_seconds";
    /// Gauge `{shard}`: 1 when the in-flight event is older than `--stuck-after`.
    pub const STUCK: &str = "shardline_stuck";
}

/// What the HTTP endpoint serves `/metrics` as.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabel {
    shard: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    shard: u16,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    shard: u16,
    reason: &'static str,
}

/// The worker's registry and the handles of its shards.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    shards: Vec<Arc<ShardMetrics>>,
    queue_depth: Family<ShardLabel, Gauge>,
    dlq_depth: Gauge,
}

impl Metrics {
    /// Registers every metric, with label values resolved for `shards`.
    pub fn new(
        shards: &[ShardId],
        stats: Arc<Stats>,
        backlog: Thresholds,
        stuck_after: Duration,
    ) -> Self {
        let mut registry = Registry::default();
        let events = Family::<OutcomeLabels, Counter>::default();
        let dead_letters = Family::<ReasonLabels, Counter>::default();
        let processing = Family::<ShardLabel, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(0.001, 2.0, 16))) as fn() -> Histogram,
        );
        let attempts = Family::<ShardLabel, Counter>::default();
        let queue_depth = Family::<ShardLabel, Gauge>::default();
        let dlq_depth = Gauge::default();

        let shard_metrics: Vec<Arc<ShardMetrics>> = shards
            .iter()
            .map(|&id| {
                let shard = id.get();
                let outcome = |outcome| {
                    events
                        .get_or_create(&OutcomeLabels { shard, outcome })
                        .clone()
                };
                let label = ShardLabel { shard };
                // Resolved now so that every series exists from the start
                // (rates work from the first scrape) and bumps never allocate.
                let _ = queue_depth.get_or_create(&label);
                Arc::new(ShardMetrics {
                    processed: outcome("processed"),
                    duplicate: outcome("duplicate"),
                    retried: outcome("retried"),
                    dead_lettered: outcome("dead_lettered"),
                    dead_letters: FailReason::ALL.map(|reason| {
                        dead_letters
                            .get_or_create(&ReasonLabels {
                                shard,
                                reason: reason.as_str(),
                            })
                            .clone()
                    }),
                    attempts: attempts.get_or_create(&label).clone(),
                    processing: processing.get_or_create(&label).clone(),
                    watch: ShardWatch::new(id),
                })
            })
            .collect();

        registry.register(
            names::EVENTS,
            "Events settled or retried, by shard and outcome",
            events,
        );
        registry.register(
            names::DEAD_LETTERS,
            "Dead letters published (confirmed), by shard and reason",
            dead_letters,
        );
        registry.register(
            names::PROCESSING_SECONDS,
            "Seconds from taking a processed event to its ack, retries included",
            processing,
        );
        registry.register(
            names::HANDLER_ATTEMPTS,
            "Handler calls, retries included",
            attempts,
        );
        registry.register(
            names::QUEUE_DEPTH,
            "Messages ready in the shard queue (polled by passive declare)",
            queue_depth.clone(),
        );
        registry.register(
            names::DLQ_DEPTH,
            "Messages in the dead-letter queue (polled by passive declare)",
            dlq_depth.clone(),
        );
        registry.register_collector(Box::new(LiveCollector {
            shards: shard_metrics.iter().map(|m| m.watch.clone()).collect(),
            stats,
            backlog,
            stuck_after,
        }));
        Self {
            registry,
            shards: shard_metrics,
            queue_depth,
            dlq_depth,
        }
    }

    /// The handles of every shard, in the order given to [`Metrics::new`].
    pub fn shards(&self) -> &[Arc<ShardMetrics>] {
        &self.shards
    }

    /// Every shard's live state.
    pub fn watches(&self) -> impl Iterator<Item = &Arc<ShardWatch>> {
        self.shards.iter().map(|m| &m.watch)
    }

    pub fn set_queue_depth(&self, shard: ShardId, messages: u32) {
        self.queue_depth
            .get_or_create(&ShardLabel { shard: shard.get() })
            .set(i64::from(messages));
    }

    pub fn set_dlq_depth(&self, messages: u32) {
        self.dlq_depth.set(i64::from(messages));
    }

    /// The registry in the OpenMetrics text format.
    pub fn encode(&self) -> Result<String, fmt::Error> {
        let mut out = String::with_capacity(16 * 1024);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// One shard's metric handles; bumping one is a relaxed atomic add.
#[derive(Debug)]
pub struct ShardMetrics {
    processed: Counter,
    duplicate: Counter,
    retried: Counter,
    dead_lettered: Counter,
    dead_letters: [Counter; FailReason::ALL.len()],
    attempts: Counter,
    processing: Histogram,
    pub watch: Arc<ShardWatch>,
}

impl ShardMetrics {
    /// A processed event was acked; its processing time is taken from the
    /// in-flight mark.
    pub fn processed(&self) {
        self.processed.inc();
        self.attempts.inc();
        if let Some(started) = self.watch.inflight_elapsed() {
            self.processing.observe(started.as_secs_f64());
        }
    }

    pub fn duplicate(&self) {
        self.duplicate.inc();
    }

    /// A failed handler attempt is retried in place.
    pub fn retried(&self) {
        self.retried.inc();
        self.attempts.inc();
    }

    /// An event was dead-lettered; `handler_called` when its last step was a
    /// handler attempt (handler error or timeout).
    pub fn dead_lettered(&self, reason: FailReason) {
        self.dead_lettered.inc();
        if let Some(i) = FailReason::ALL.iter().position(|r| *r == reason) {
            self.dead_letters[i].inc();
        }
        if matches!(reason, FailReason::Handler | FailReason::Timeout) {
            self.attempts.inc();
        }
    }
}

/// Where a shard's consumer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardState {
    /// Not started, or stopped (connection lost, worker stopping).
    Idle = 0,
    /// Another consumer holds the shard; retrying.
    StandingBy = 1,
    /// This worker consumes the shard.
    Consuming = 2,
    /// Registered on a single-active-consumer queue, where the broker picks the
    /// active consumer without telling it: consuming from the first delivery.
    Registered = 3,
}

/// A shard's live state, written by its task and read by scrapes, the status
/// writer and `/readyz`. Times are unix milliseconds, 0 for none.
#[derive(Debug)]
pub struct ShardWatch {
    pub shard: ShardId,
    state: AtomicU8,
    /// Monotonic nanoseconds (see [`Clock`]) when the in-flight event was taken.
    inflight_since_ns: AtomicU64,
    /// When the in-flight event was published.
    inflight_published_ms: AtomicU64,
    held: AtomicU64,
    /// When the oldest held event was published.
    held_oldest_ms: AtomicU64,
    /// Which events the gate holds (for the status in Redis).
    held_refs: std::sync::Mutex<Vec<HeldRef>>,
}

impl ShardWatch {
    fn new(shard: ShardId) -> Arc<Self> {
        Arc::new(Self {
            shard,
            state: AtomicU8::new(ShardState::Idle as u8),
            inflight_since_ns: AtomicU64::new(0),
            inflight_published_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
            held_oldest_ms: AtomicU64::new(0),
            held_refs: std::sync::Mutex::default(),
        })
    }

    pub fn set_state(&self, state: ShardState) {
        self.state.store(state as u8, Ordering::Relaxed);
        if !matches!(state, ShardState::Consuming | ShardState::Registered) {
            self.clear_inflight();
            self.set_held(0, None);
            self.set_held_refs(Vec::new());
        }
    }

    pub fn state(&self) -> ShardState {
        match self.state.load(Ordering::Relaxed) {
            1 => ShardState::StandingBy,
            2 => ShardState::Consuming,
            3 => ShardState::Registered,
            _ => ShardState::Idle,
        }
    }

    /// The shard's task starts working on an event published at `published_ms`.
    pub fn start_inflight(&self, published_ms: u64) {
        if self.state.load(Ordering::Relaxed) == ShardState::Registered as u8 {
            // Deliveries come only to the active consumer.
            let _ = self.state.compare_exchange(
                ShardState::Registered as u8,
                ShardState::Consuming as u8,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        self.inflight_since_ns
            .store(CLOCK.now_ns().max(1), Ordering::Relaxed);
        self.inflight_published_ms
            .store(published_ms, Ordering::Relaxed);
    }

    pub fn clear_inflight(&self) {
        self.inflight_since_ns.store(0, Ordering::Relaxed);
        self.inflight_published_ms.store(0, Ordering::Relaxed);
    }

    fn inflight_elapsed(&self) -> Option<Duration> {
        match self.inflight_since_ns.load(Ordering::Relaxed) {
            0 => None,
            since => Some(Duration::from_nanos(CLOCK.now_ns().saturating_sub(since))),
        }
    }

    /// The gate holds `held` events, the oldest published at `oldest_ms`.
    pub fn set_held(&self, held: usize, oldest_ms: Option<u64>) {
        self.held.store(held as u64, Ordering::Relaxed);
        self.held_oldest_ms
            .store(oldest_ms.unwrap_or(0), Ordering::Relaxed);
    }

    /// The events the gate holds now, by order and kind.
    pub fn set_held_refs(&self, refs: Vec<HeldRef>) {
        if let Ok(mut held) = self.held_refs.lock() {
            *held = refs;
        }
    }

    /// The events the gate holds, as last set.
    pub fn held_refs(&self) -> Vec<HeldRef> {
        self.held_refs
            .lock()
            .map(|held| held.clone())
            .unwrap_or_default()
    }

    /// What the shard looks like at `now_ms`.
    pub fn snapshot(&self, now_ms: u64) -> Snapshot {
        let inflight_published = self.inflight_published_ms.load(Ordering::Relaxed);
        let held_oldest = self.held_oldest_ms.load(Ordering::Relaxed);
        let head = [inflight_published, held_oldest]
            .into_iter()
            .filter(|ms| *ms > 0)
            .min();
        Snapshot {
            state: self.state(),
            backlog_age: head.map_or(Duration::ZERO, |ms| {
                Duration::from_millis(now_ms.saturating_sub(ms))
            }),
            inflight_age: self.inflight_elapsed(),
            held: self.held.load(Ordering::Relaxed),
        }
    }
}

/// One shard at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    pub state: ShardState,
    /// Age of the oldest unprocessed event (in flight or held); zero when none.
    pub backlog_age: Duration,
    /// How long the in-flight event has been worked on, if there is one.
    pub inflight_age: Option<Duration>,
    pub held: u64,
}

/// When a delivery was published: `x-published-at-ms`, else the AMQP
/// `timestamp` (seconds), else `received_ms`.
pub fn published_ms(properties: &BasicProperties, received_ms: u64) -> u64 {
    headers::header_i64(properties, headers::PUBLISHED_AT_MS)
        .and_then(|ms| u64::try_from(ms).ok())
        .or_else(|| properties.timestamp().map(|s| s.saturating_mul(1000)))
        .filter(|ms| *ms > 0)
        .unwrap_or(received_ms)
}

/// Wall-clock unix milliseconds now.
pub fn unix_ms() -> u64 {
    CLOCK.unix_ms()
}

/// A monotonic clock anchored to the wall clock once, so that durations never
/// jump and ages need no syscall beyond `Instant::now`.
struct Clock {
    anchor: std::sync::OnceLock<(Instant, u64)>,
}

static CLOCK: Clock = Clock {
    anchor: std::sync::OnceLock::new(),
};

impl Clock {
    fn anchor(&self) -> (Instant, u64) {
        *self.anchor.get_or_init(|| {
            let unix = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            (Instant::now(), unix)
        })
    }

    fn now_ns(&self) -> u64 {
        let (at, _) = self.anchor();
        u64::try_from(at.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn unix_ms(&self) -> u64 {
        let (at, unix) = self.anchor();
        unix + u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// The clock-dependent metrics, computed at scrape time.
#[derive(Debug)]
struct LiveCollector {
    shards: Vec<Arc<ShardWatch>>,
    stats: Arc<Stats>,
    backlog: Thresholds,
    stuck_after: Duration,
}

impl LiveCollector {
    fn gauge_family<V: prometheus_client::encoding::EncodeGaugeValue + Copy>(
        encoder: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        values: &[(u16, V)],
    ) -> Result<(), fmt::Error> {
        let mut metric = encoder.encode_descriptor(
            name,
            help,
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (shard, value) in values {
            let labels = ShardLabel { shard: *shard };
            ConstGauge::new(*value).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn counter(
        encoder: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        value: u64,
    ) -> Result<(), fmt::Error> {
        let counter = ConstCounter::new(value);
        counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)
    }
}

impl Collector for LiveCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let now = unix_ms();
        let snaps: Vec<(u16, Snapshot)> = self
            .shards
            .iter()
            .map(|w| (w.shard.get(), w.snapshot(now)))
            .collect();
        let each = |f: &dyn Fn(&Snapshot) -> f64| -> Vec<(u16, f64)> {
            snaps.iter().map(|(s, snap)| (*s, f(snap))).collect()
        };
        let each_int = |f: &dyn Fn(&Snapshot) -> i64| -> Vec<(u16, i64)> {
            snaps.iter().map(|(s, snap)| (*s, f(snap))).collect()
        };
        Self::gauge_family(
            &mut encoder,
            names::BACKLOG_AGE_SECONDS,
            "Age of the shard's oldest unprocessed event (in flight or held), 0 when none",
            &each(&|s| s.backlog_age.as_secs_f64()),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::BACKLOG_LEVEL,
            "Backlog level: 0 OK, 1 WARN (--backlog-warn), 2 PAGE (--backlog-page)",
            &each_int(&|s| i64::from(Level::of(s.backlog_age, &self.backlog).value())),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::HELD_EVENTS,
            "Events the sequence gate holds",
            &each_int(&|s| i64::try_from(s.held).unwrap_or(i64::MAX)),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::SHARD_ACTIVE,
            "1 while this worker consumes the shard",
            &each_int(&|s| i64::from(s.state == ShardState::Consuming)),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::INFLIGHT_SECONDS,
            "Seconds the in-flight event has been worked on (attempts and backoff), 0 when none",
            &each(&|s| s.inflight_age.map_or(0.0, |d| d.as_secs_f64())),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::STUCK,
            "1 when the in-flight event is older than --stuck-after",
            &each_int(&|s| i64::from(s.inflight_age.is_some_and(|d| d >= self.stuck_after))),
        )?;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Self::counter(
            &mut encoder,
            names::REDIS_OUTAGES,
            "Times Redis became unreachable (shards paused until it returned)",
            load(&self.stats.redis_outages),
        )?;
        Self::counter(
            &mut encoder,
            names::BROKER_RECONNECTS,
            "Broker connections opened after the first",
            load(&self.stats.broker_reconnects),
        )?;
        Self::counter(
            &mut encoder,
            names::SEQ_GAPS,
            "Sequence gaps given up on (timed out, or accepted as an order's start)",
            load(&self.stats.gaps),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_topology::ShardCount;

    fn shards(n: u32) -> Vec<ShardId> {
        ShardCount::new(n).unwrap().ids().collect()
    }

    #[test]
    fn exposition_names_every_metric_with_shard_labels() {
        let stats = Arc::new(Stats::default());
        let m = Metrics::new(
            &shards(2),
            stats.clone(),
            Thresholds::default(),
            Duration::from_secs(60),
        );
        let s1 = m.shards()[1].clone();
        s1.watch.set_state(ShardState::Consuming);
        s1.watch.start_inflight(unix_ms() - 45_000);
        s1.processed();
        s1.retried();
        s1.dead_lettered(FailReason::Handler);
        Stats::bump(&stats.broker_reconnects);
        m.set_dlq_depth(7);
        let text = m.encode().unwrap();
        for needle in [
            "shardline_events_total{shard=\"1\",outcome=\"processed\"} 1",
            "shardline_events_total{shard=\"1\",outcome=\"retried\"} 1",
            "shardline_events_total{shard=\"0\",outcome=\"processed\"} 0",
            "shardline_dead_letters_total{shard=\"1\",reason=\"handler\"} 1",
            "shardline_handler_attempts_total{shard=\"1\"} 3",
            "shardline_processing_seconds_count{shard=\"1\"} 1",
            "shardline_broker_reconnects_total 1",
            "shardline_dlq_depth 7",
            "shardline_queue_depth{shard=\"0\"} 0",
            "shardline_backlog_level{shard=\"1\"} 1",
            "shardline_backlog_level{shard=\"0\"} 0",
            "shardline_backlog_age_seconds{shard=\"0\"} 0",
            "shardline_shard_active{shard=\"1\"} 1",
            "shardline_shard_active{shard=\"0\"} 0",
            "shardline_stuck{shard=\"1\"} 0",
        ] {
            assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
        }
    }

    #[test]
    fn backlog_is_the_oldest_of_in_flight_and_held() {
        let watch = ShardWatch::new(shards(1)[0]);
        let now = 1_000_000;
        assert_eq!(watch.snapshot(now).backlog_age, Duration::ZERO);
        watch.start_inflight(now - 5_000);
        watch.set_held(2, Some(now - 9_000));
        let snap = watch.snapshot(now);
        assert_eq!(snap.backlog_age, Duration::from_secs(9));
        assert_eq!(snap.held, 2);
        assert!(snap.inflight_age.is_some());
        watch.set_held(0, None);
        assert_eq!(watch.snapshot(now).backlog_age, Duration::from_secs(5));
        watch.clear_inflight();
        let snap = watch.snapshot(now);
        assert_eq!(snap.backlog_age, Duration::ZERO);
        assert_eq!(snap.inflight_age, None);
        // A publisher clock ahead of ours reads as no age, not a negative one.
        watch.start_inflight(now + 3_000);
        assert_eq!(watch.snapshot(now).backlog_age, Duration::ZERO);
    }

    #[test]
    fn publish_time_falls_back_to_timestamp_then_receipt() {
        let bare = BasicProperties::default();
        assert_eq!(published_ms(&bare, 42), 42);
        let stamped = BasicProperties::default().with_timestamp(1_700_000_000);
        assert_eq!(published_ms(&stamped, 42), 1_700_000_000_000);
        let props = headers::event_properties(
            "id",
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            &headers::new_traceparent(),
        );
        assert_eq!(published_ms(&props, 42), 1_700_000_000_123);
    }
}
