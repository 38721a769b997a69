//! Prometheus metrics: every name defined here once, the registry, and the
//! worker's one set of counters. Per-shard handles are resolved up front so
//! that the hot path is a few relaxed atomics; [`crate::Progress`] reads the
//! same counters.
//!
//! Counters and the processing-time histogram are bumped where things happen
//! (`settle`, `attempt`, `store`, the supervisor). Everything that
//! depends on the clock (backlog age, in-flight age, the levels, stuck) is
//! computed when scraped, from each shard's live state (`live.rs`).

use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use shardline_contract::ShardId;
use shardline_contract::headers::FailReason;
use shardline_contract::status::{Level, StampSource, Thresholds};

use crate::breaker::BreakerMetrics;
use crate::handler::Fault;
use crate::live::{ShardState, ShardWatch, Snapshot, unix_ms};
use crate::membership::FleetMetrics;

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
    /// Counter `{cause}`: failed handler attempts by whose fault they were
    /// (`event`, `availability`, `configuration`, `unconfirmed`), and
    /// `infrastructure`: Redis became unreachable or a broker connection was
    /// lost (shards paused, no attempt counted).
    pub const ATTEMPT_FAILURES: &str = "shardline_attempt_failures";
    /// Gauge: 1 while calls are paused for the downstream's configuration (a
    /// redirect, or the same 401/403/404/405/410 for several orders).
    pub const DOWNSTREAM_MISCONFIGURED: &str = "shardline_downstream_misconfigured";
    /// Counter: times Redis became unreachable (shards paused).
    pub const REDIS_OUTAGES: &str = "shardline_redis_outages";
    /// Counter: broker connections opened after the first.
    pub const BROKER_RECONNECTS: &str = "shardline_broker_reconnects";
    /// Counter: sequence gaps given up on (timed out, or accepted as a start).
    pub const SEQ_GAPS: &str = "shardline_seq_gaps";
    /// Counter: replay markers ignored (no replay record matched the event).
    pub const REPLAY_MARKERS_IGNORED: &str = "shardline_replay_markers_ignored";
    /// Counter: order-state writes refused because a newer consumer of the
    /// shard had written the order (this consumer lost the shard).
    pub const FENCED_WRITES: &str = "shardline_fenced_writes";
    /// Counter: handler calls abandoned in flight (the broker connection
    /// was lost, or a drain timed out): the event stays unacked for
    /// redelivery while the downstream may still finish the call.
    pub const ABANDONED_CALLS: &str = "shardline_abandoned_calls";
    /// Counter: events committed and acked in groups (`--group-commit`).
    pub const GROUPED_EVENTS: &str = "shardline_grouped_events";
    /// Counter: events forwarded to their order's route, confirmed, then
    /// acked: their queue does not process their bucket (a legacy
    /// publisher's routing, a retired queue, a move's old shard after its
    /// drain marker).
    pub const FORWARDED: &str = "shardline_forwarded";
    /// Counter: resharding markers honoured (a move drained or a holding
    /// queue closed).
    pub const MARKERS_HONOURED: &str = "shardline_markers_honoured";
    /// Gauge `{shard}`: age of the shard's oldest unprocessed event, 0 when none.
    pub const BACKLOG_AGE_SECONDS: &str = "shardline_backlog_age_seconds";
    /// Gauge `{shard}`: 0 OK, 1 WARN, 2 PAGE (thresholds: `Config::backlog`).
    pub const BACKLOG_LEVEL: &str = "shardline_backlog_level";
    /// Gauge `{shard}`: 1 when the backlog age counts from a publisher's
    /// claim (`publisher-claimed`), 0 otherwise.
    pub const BACKLOG_PUBLISHER_CLAIMED: &str = "shardline_backlog_publisher_claimed";
    /// Gauge `{shard}`: messages ready in the shard queue (passive declare, polled).
    pub const QUEUE_DEPTH: &str = "shardline_queue_depth";
    /// Gauge: messages in the dead-letter queue (passive declare, polled).
    pub const DLQ_DEPTH: &str = "shardline_dlq_depth";
    /// Gauge `{shard}`: events the sequence gate holds.
    pub const HELD_EVENTS: &str = "shardline_held_events";
    /// Gauge `{shard}`: bytes of event bodies the shard holds decoded (held,
    /// read ahead, waiting to run), bounded by `--max-held-bytes`.
    pub const HELD_BYTES: &str = "shardline_held_bytes";
    /// Gauge `{shard}`: handler calls in flight (claimed, not yet acked; retry
    /// backoff included), at most `--concurrency`.
    pub const INFLIGHT_EVENTS: &str = "shardline_inflight_events";
    /// Gauge `{shard}`: events taken from the queue that wait for an earlier
    /// event of their order to finish (or for a free slot).
    pub const WAITING_EVENTS: &str = "shardline_waiting_events";
    /// Gauge `{shard}`: 1 while this worker consumes the shard (on
    /// single-active-consumer queues: from its first delivery, as the broker
    /// does not tell a consumer that it became the active one).
    pub const SHARD_ACTIVE: &str = "shardline_shard_active";
    /// Gauge `{shard}`: seconds the in-flight event has been worked on, 0 when none.
    pub const INFLIGHT_SECONDS: &str = "shardline_inflight_seconds";
    /// Gauge `{shard}`: 1 when the in-flight event is older than `Config::stuck_after`.
    pub const STUCK: &str = "shardline_stuck";
    /// Gauge: the downstream breaker, 0 closed, 1 open, 2 half-open.
    pub const BREAKER_STATE: &str = "shardline_breaker_state";
    /// Counter: times the downstream breaker opened (calls paused).
    pub const BREAKER_TRIPS: &str = "shardline_breaker_trips";
    /// Counter: seconds handler calls were paused by the breaker (pauses that ended).
    pub const BREAKER_PAUSED_SECONDS: &str = "shardline_breaker_paused_seconds";
    /// Gauge: shards the elastic fleet's assignment gives this member (`--assign auto`).
    pub const FLEET_OWNED_SHARDS: &str = "shardline_fleet_owned_shards";
    /// Gauge: live members of the elastic fleet, as this member sees them.
    pub const FLEET_MEMBERS: &str = "shardline_fleet_members";
    /// Counter `{kind}`: shard handovers: `graceful` (this member handed a shard
    /// over while alive), `crash` (it took one from a member that was gone).
    pub const FLEET_HANDOVERS: &str = "shardline_fleet_handovers";
}

/// What the HTTP endpoint serves `/metrics` as.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabel {
    shard: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabel {
    cause: &'static str,
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

/// Counters of the whole worker, not of one shard.
#[derive(Debug, Clone, Default)]
struct WorkerCounters {
    redis_outages: Counter,
    broker_reconnects: Counter,
    gaps: Counter,
    fenced: Counter,
    abandoned: Counter,
    grouped: Counter,
    forwarded: Counter,
    markers: Counter,
    replay_markers_ignored: Counter,
    /// Failures by [`Fault`], indexed by [`Fault::index`].
    failures: [Counter; 5],
    /// Read by [`crate::Progress`] only (not exported: no metric of its own yet).
    takeovers: Counter,
}

/// The worker's registry and the handles of its shards.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    /// Grows when the worker follows a reshard to more shard queues.
    shards: RwLock<Vec<Arc<ShardMetrics>>>,
    families: ShardFamilies,
    /// The shards' live states, shared with the scrape-time collector.
    live: Arc<RwLock<Vec<Arc<ShardWatch>>>>,
    worker: WorkerCounters,
    queue_depth: Family<ShardLabel, Gauge>,
    dlq_depth: Gauge,
    breaker: BreakerMetrics,
    fleet: FleetMetrics,
}

/// The per-shard metric families (registered once; kept to add shards).
#[derive(Debug, Clone)]
struct ShardFamilies {
    events: Family<OutcomeLabels, Counter>,
    dead_letters: Family<ReasonLabels, Counter>,
    processing: Family<ShardLabel, Histogram>,
    attempts: Family<ShardLabel, Counter>,
    queue_depth: Family<ShardLabel, Gauge>,
}

impl ShardFamilies {
    fn new() -> Self {
        Self {
            events: Family::default(),
            dead_letters: Family::default(),
            processing: Family::new_with_constructor(
                (|| Histogram::new(exponential_buckets(0.001, 2.0, 16))) as fn() -> Histogram,
            ),
            attempts: Family::default(),
            queue_depth: Family::default(),
        }
    }

    /// Shard `id`'s handles, every series resolved now so that it exists from
    /// the start (rates work from the first scrape) and bumps never allocate.
    fn shard(&self, id: ShardId, worker: &WorkerCounters) -> Arc<ShardMetrics> {
        let shard = id.get();
        let outcome = |outcome| {
            self.events
                .get_or_create(&OutcomeLabels { shard, outcome })
                .clone()
        };
        let label = ShardLabel { shard };
        let _ = self.queue_depth.get_or_create(&label);
        Arc::new(ShardMetrics {
            processed: outcome("processed"),
            duplicate: outcome("duplicate"),
            retried: outcome("retried"),
            dead_lettered: outcome("dead_lettered"),
            dead_letters: FailReason::ALL.map(|reason| {
                self.dead_letters
                    .get_or_create(&ReasonLabels {
                        shard,
                        reason: reason.as_str(),
                    })
                    .clone()
            }),
            attempts: self.attempts.get_or_create(&label).clone(),
            processing: self.processing.get_or_create(&label).clone(),
            worker: worker.clone(),
            watch: ShardWatch::new(id),
        })
    }

    fn register(self, registry: &mut Registry) {
        registry.register(
            names::EVENTS,
            "Events settled or retried, by shard and outcome",
            self.events,
        );
        registry.register(
            names::DEAD_LETTERS,
            "Dead letters published (confirmed), by shard and reason",
            self.dead_letters,
        );
        registry.register(
            names::PROCESSING_SECONDS,
            "Seconds from taking a processed event to its ack, retries included",
            self.processing,
        );
        registry.register(
            names::HANDLER_ATTEMPTS,
            "Handler calls, retries included",
            self.attempts,
        );
        registry.register(
            names::QUEUE_DEPTH,
            "Messages ready in the shard queue (polled by passive declare)",
            self.queue_depth,
        );
    }
}

impl WorkerCounters {
    /// The worker's counters, the failure series resolved by cause.
    fn resolved(failures: &Family<CauseLabel, Counter>) -> Self {
        Self {
            // One statement each: a handle's read guard lives to the end of its
            // statement, and creating the next series needs the write lock.
            failures: Fault::ALL.map(|fault| {
                failures
                    .get_or_create(&CauseLabel {
                        cause: fault.as_str(),
                    })
                    .clone()
            }),
            ..Self::default()
        }
    }

    fn register(&self, registry: &mut Registry, failures: Family<CauseLabel, Counter>) {
        registry.register(
            names::ATTEMPT_FAILURES,
            "Failed handler attempts by whose fault they were (event, availability, configuration, unconfirmed), and infrastructure failures (Redis unreachable, broker connection lost)",
            failures,
        );
        registry.register(
            names::REDIS_OUTAGES,
            "Times Redis became unreachable (shards paused until it returned)",
            self.redis_outages.clone(),
        );
        registry.register(
            names::BROKER_RECONNECTS,
            "Broker connections opened after the first",
            self.broker_reconnects.clone(),
        );
        registry.register(
            names::SEQ_GAPS,
            "Sequence gaps given up on (timed out, or accepted as an order's start)",
            self.gaps.clone(),
        );
        registry.register(
            names::FENCED_WRITES,
            "Order-state writes refused: a newer consumer of the shard had written the order",
            self.fenced.clone(),
        );
        registry.register(
            names::ABANDONED_CALLS,
            "Handler calls abandoned in flight (the broker connection was lost, or a drain timed out): the event stays unacked for redelivery while the downstream may still finish the call",
            self.abandoned.clone(),
        );
        registry.register(
            names::GROUPED_EVENTS,
            "Events committed and acked in groups (--group-commit)",
            self.grouped.clone(),
        );
        registry.register(
            names::FORWARDED,
            "Events forwarded to their order's route (confirmed, then acked) because their queue does not process their bucket: a publisher routing by a shard count of before (legacy), a retired queue, or a move's old shard after its drain marker",
            self.forwarded.clone(),
        );
        registry.register(
            names::MARKERS_HONOURED,
            "Resharding markers honoured: a move's old shard drained, or its holding queue closed",
            self.markers.clone(),
        );
        registry.register(
            names::REPLAY_MARKERS_IGNORED,
            "Events whose x-shardline-replay marker was ignored: no replay record of the replay tools matched the event (forged, spent, expired or lost in a Redis failover); each was gated like a fresh event",
            self.replay_markers_ignored.clone(),
        );
    }
}

/// Registers the breaker's metrics and returns their handles.
fn register_breaker(registry: &mut Registry) -> BreakerMetrics {
    let breaker = BreakerMetrics::default();
    registry.register(
        names::BREAKER_STATE,
        "The downstream breaker: 0 closed, 1 open (calls paused), 2 half-open (one probe call)",
        breaker.state.clone(),
    );
    registry.register(
        names::DOWNSTREAM_MISCONFIGURED,
        "1 while handler calls are paused for the downstream's configuration (a redirect, or the same 401/403/404/405/410 for several orders)",
        breaker.misconfigured.clone(),
    );
    registry.register(
        names::BREAKER_TRIPS,
        "Times the downstream breaker opened",
        breaker.trips.clone(),
    );
    registry.register(
        names::BREAKER_PAUSED_SECONDS,
        "Seconds handler calls were paused by the downstream breaker",
        breaker.paused_seconds.clone(),
    );
    breaker
}

/// Registers the elastic fleet's metrics and returns their handles.
fn register_fleet(registry: &mut Registry) -> FleetMetrics {
    let fleet = FleetMetrics::default();
    registry.register(
        names::FLEET_OWNED_SHARDS,
        "Shards the elastic fleet's assignment gives this member (--assign auto)",
        fleet.owned.clone(),
    );
    registry.register(
        names::FLEET_MEMBERS,
        "Live members of the elastic fleet, as this member sees them",
        fleet.members.clone(),
    );
    let handovers = Family::<KindLabel, Counter>::default();
    // One statement each: a handle's read guard lives to the end of its
    // statement, and creating the next series needs the write lock.
    let graceful = handovers
        .get_or_create(&KindLabel { kind: "graceful" })
        .clone();
    let crash = handovers
        .get_or_create(&KindLabel { kind: "crash" })
        .clone();
    registry.register(
        names::FLEET_HANDOVERS,
        "Shard handovers: graceful (handed over while alive) or crash (taken from a gone member)",
        handovers,
    );
    FleetMetrics {
        graceful,
        crash,
        ..fleet
    }
}

impl Metrics {
    /// Registers every metric, with label values resolved for `shards`.
    pub(crate) fn new(shards: &[ShardId], backlog: Thresholds, stuck_after: Duration) -> Self {
        let mut registry = Registry::default();
        let families = ShardFamilies::new();
        let failures = Family::<CauseLabel, Counter>::default();
        let worker = WorkerCounters::resolved(&failures);
        let shard_metrics: Vec<Arc<ShardMetrics>> = shards
            .iter()
            .map(|&id| families.shard(id, &worker))
            .collect();
        let queue_depth = families.queue_depth.clone();
        families.clone().register(&mut registry);
        let dlq_depth = Gauge::default();
        registry.register(
            names::DLQ_DEPTH,
            "Messages in the dead-letter queue (polled by passive declare)",
            dlq_depth.clone(),
        );
        worker.register(&mut registry, failures);
        let breaker = register_breaker(&mut registry);
        let fleet = register_fleet(&mut registry);
        let live = Arc::new(RwLock::new(
            shard_metrics.iter().map(|m| m.watch.clone()).collect(),
        ));
        registry.register_collector(Box::new(LiveCollector {
            shards: live.clone(),
            backlog,
            stuck_after,
        }));
        Self {
            registry,
            shards: RwLock::new(shard_metrics),
            families,
            live,
            worker,
            queue_depth,
            dlq_depth,
            breaker,
            fleet,
        }
    }

    /// The elastic fleet's handles.
    pub(crate) fn fleet(&self) -> FleetMetrics {
        self.fleet.clone()
    }

    /// The downstream breaker's handles.
    pub(crate) fn breaker(&self) -> BreakerMetrics {
        self.breaker.clone()
    }

    /// The handles of every shard, in the order given to [`Metrics::new`]
    /// and then [`Metrics::grow`].
    pub(crate) fn shards(&self) -> Vec<Arc<ShardMetrics>> {
        self.shards.read().map(|s| s.clone()).unwrap_or_default()
    }

    /// Every shard's live state.
    pub(crate) fn watches(&self) -> Vec<Arc<ShardWatch>> {
        self.shards().iter().map(|m| m.watch.clone()).collect()
    }

    /// Adds the shards of `ids` it does not have yet (a reshard's new shard
    /// queues, followed without a restart); returns their handles.
    pub(crate) fn grow(&self, ids: impl IntoIterator<Item = ShardId>) -> Vec<Arc<ShardMetrics>> {
        let Ok(mut shards) = self.shards.write() else {
            return Vec::new();
        };
        let mut added = Vec::new();
        for id in ids {
            if shards.iter().any(|m| m.watch.shard == id) {
                continue;
            }
            let metrics = self.families.shard(id, &self.worker);
            shards.push(metrics.clone());
            added.push(metrics);
        }
        if let Ok(mut live) = self.live.write() {
            live.extend(added.iter().map(|m| m.watch.clone()));
        }
        added
    }

    /// The counter of Redis outages, for the Redis health that notices them.
    pub(crate) fn redis_outages(&self) -> Counter {
        self.worker.redis_outages.clone()
    }

    /// The broker connections were opened again (after a loss: an
    /// infrastructure failure).
    pub(crate) fn broker_reconnected(&self) {
        self.worker.broker_reconnects.inc();
        self.worker.failures[Fault::Infrastructure.index()].inc();
    }

    /// The counter of infrastructure failures, for the Redis health that
    /// notices an outage.
    pub(crate) fn infrastructure_failures(&self) -> Counter {
        self.worker.failures[Fault::Infrastructure.index()].clone()
    }

    pub(crate) fn set_queue_depth(&self, shard: ShardId, messages: u32) {
        self.queue_depth
            .get_or_create(&ShardLabel { shard: shard.get() })
            .set(i64::from(messages));
    }

    pub(crate) fn set_dlq_depth(&self, messages: u32) {
        self.dlq_depth.set(i64::from(messages));
    }

    /// The totals now, summed over the shards.
    pub(crate) fn counts(&self) -> Counts {
        let shards = self.shards();
        let sum = |f: fn(&ShardMetrics) -> u64| shards.iter().map(|m| f(m)).sum::<u64>();
        Counts {
            processed: sum(|m| m.processed.get()),
            duplicates: sum(|m| m.duplicate.get()),
            handler_attempts: sum(|m| m.attempts.get()),
            retries: sum(|m| m.retried.get()),
            takeovers: self.worker.takeovers.get(),
            redis_outages: self.worker.redis_outages.get(),
            broker_reconnects: self.worker.broker_reconnects.get(),
            held: sum(|m| m.watch.held()),
            held_bytes: sum(|m| m.watch.held_bytes()),
            gaps: self.worker.gaps.get(),
            fenced_writes: self.worker.fenced.get(),
            abandoned_calls: self.worker.abandoned.get(),
            grouped: self.worker.grouped.get(),
            forwarded: self.worker.forwarded.get(),
            breaker_trips: self.breaker.trips.get(),
            breaker_paused_ms: (self.breaker.paused_seconds.get() * 1000.0) as u64,
            downstream_misconfigured: self.breaker.misconfigured.get() == 1,
            failures: self.worker.failures.each_ref().map(Counter::get),
            dead_letters: std::array::from_fn(|i| {
                shards.iter().map(|m| m.dead_letters[i].get()).sum()
            }),
        }
    }

    /// The registry in the OpenMetrics text format.
    pub(crate) fn encode(&self) -> Result<String, fmt::Error> {
        let mut out = String::with_capacity(16 * 1024);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// One shard's metric handles; bumping one is a relaxed atomic add.
#[derive(Debug)]
pub(crate) struct ShardMetrics {
    processed: Counter,
    duplicate: Counter,
    retried: Counter,
    dead_lettered: Counter,
    dead_letters: [Counter; FailReason::ALL.len()],
    attempts: Counter,
    processing: Histogram,
    worker: WorkerCounters,
    pub(crate) watch: Arc<ShardWatch>,
}

impl ShardMetrics {
    /// A processed event was acked, `took` after it was taken.
    pub(crate) fn processed(&self, took: Duration) {
        self.processed.inc();
        self.processing.observe(took.as_secs_f64());
    }

    /// An event was acked as a duplicate (of a processed or a held one).
    pub(crate) fn duplicate(&self) {
        self.duplicate.inc();
    }

    /// The handler is called (a first attempt or a retry).
    pub(crate) fn attempt(&self) {
        self.attempts.inc();
    }

    /// A handler attempt failed, by `fault`.
    pub(crate) fn attempt_failed(&self, fault: Fault) {
        self.worker.failures[fault.index()].inc();
    }

    /// A failed handler attempt is retried in place.
    pub(crate) fn retried(&self) {
        self.retried.inc();
    }

    /// An event was dead-lettered (its copy confirmed) and acked.
    pub(crate) fn dead_lettered(&self, reason: FailReason) {
        self.dead_lettered.inc();
        if let Some(i) = FailReason::ALL.iter().position(|r| *r == reason) {
            self.dead_letters[i].inc();
        }
    }

    /// A claim was taken over from a consumer that died mid-handler.
    pub(crate) fn took_over(&self) {
        self.worker.takeovers.inc();
    }

    /// An event's replay marker was ignored: no replay record backed it.
    pub(crate) fn replay_marker_ignored(&self) {
        self.worker.replay_markers_ignored.inc();
    }

    /// The gate gave up on a sequence gap.
    pub(crate) fn gap(&self) {
        self.worker.gaps.inc();
    }

    /// An order-state write was fenced.
    pub(crate) fn fenced(&self) {
        self.worker.fenced.inc();
    }

    /// Handler calls were abandoned in flight.
    pub(crate) fn abandoned(&self, calls: usize) {
        self.worker.abandoned.inc_by(calls as u64);
    }

    /// Events were committed and acked as a group.
    pub(crate) fn grouped(&self, events: usize) {
        self.worker.grouped.inc_by(events as u64);
    }

    /// An event was forwarded to its order's route.
    pub(crate) fn forwarded(&self) {
        self.worker.forwarded.inc();
        self.watch.count_forward();
    }

    /// A resharding marker was honoured.
    pub(crate) fn marker_honoured(&self) {
        self.worker.markers.inc();
    }
}

/// The clock-dependent metrics, computed at scrape time.
#[derive(Debug)]
struct LiveCollector {
    shards: Arc<RwLock<Vec<Arc<ShardWatch>>>>,
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
}

impl Collector for LiveCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let now = unix_ms();
        let watches = self.shards.read().map(|s| s.clone()).unwrap_or_default();
        let snaps: Vec<(u16, Snapshot)> = watches
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
            "Age of the shard's oldest unprocessed event (in flight, waiting or held), 0 when none; \
             counted from the broker's stamp when it overwrites timestamp_in_ms, else from the \
             publisher's claim (x-published-at-ms or timestamp, unverified: see \
             shardline_backlog_publisher_claimed), never from later than the worker received it",
            &each(&|s| s.backlog_age.as_secs_f64()),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::BACKLOG_LEVEL,
            "Backlog level: 0 OK, 1 WARN (--backlog-warn), 2 PAGE (--backlog-page); the age may \
             rest on a publisher's claim (shardline_backlog_publisher_claimed 1)",
            &each_int(&|s| i64::from(Level::of(s.backlog_age, &self.backlog).value())),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::BACKLOG_PUBLISHER_CLAIMED,
            "1 when the backlog age counts from a publisher's claim (x-published-at-ms or \
             timestamp) the worker cannot verify: its WARN or PAGE is publisher-claimed",
            &each_int(&|s| i64::from(s.backlog_source == Some(StampSource::Publisher))),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::HELD_EVENTS,
            "Events the sequence gate holds",
            &each_int(&|s| i64::try_from(s.held).unwrap_or(i64::MAX)),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::HELD_BYTES,
            "Bytes of event bodies the shard holds decoded (held, read ahead, waiting to run), \
             at most about --max-held-bytes",
            &each_int(&|s| i64::try_from(s.held_bytes).unwrap_or(i64::MAX)),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::INFLIGHT_EVENTS,
            "Handler calls in flight (claimed, not yet acked), at most --concurrency",
            &each_int(&|s| i64::try_from(s.inflight).unwrap_or(i64::MAX)),
        )?;
        Self::gauge_family(
            &mut encoder,
            names::WAITING_EVENTS,
            "Events taken that wait for an earlier event of their order (or a free slot)",
            &each_int(&|s| i64::try_from(s.waiting).unwrap_or(i64::MAX)),
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
        Ok(())
    }
}

/// Totals since the worker started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counts {
    /// Events the handler processed and that were acked.
    pub processed: u64,
    /// Events acked as duplicates without calling the handler.
    pub duplicates: u64,
    /// Handler calls, first attempts and retries.
    pub handler_attempts: u64,
    /// Failed attempts retried in place.
    pub retries: u64,
    /// Claims taken over from a consumer that died mid-handler.
    pub takeovers: u64,
    /// Times Redis became unreachable (shards paused).
    pub redis_outages: u64,
    /// Broker connections opened after the first.
    pub broker_reconnects: u64,
    /// Events the sequence gate holds now.
    pub held: u64,
    /// Bytes of event bodies held decoded now (held, read ahead, waiting
    /// to run: `--max-held-bytes`).
    pub held_bytes: u64,
    /// Sequence gaps given up on (timed out or accepted as a start).
    pub gaps: u64,
    /// Order-state writes refused because a newer consumer wrote the order.
    pub fenced_writes: u64,
    /// Handler calls abandoned in flight (connection lost, drain timeout).
    pub abandoned_calls: u64,
    /// Events committed and acked in groups (`--group-commit`).
    pub grouped: u64,
    /// Events forwarded to their order's route (resharding, legacy routing).
    pub forwarded: u64,
    /// Times the downstream breaker opened.
    pub breaker_trips: u64,
    /// Milliseconds calls were paused by the breaker, over the pauses that ended.
    pub breaker_paused_ms: u64,
    /// Calls are paused now for the downstream's configuration.
    pub downstream_misconfigured: bool,
    /// Failures by [`Fault`], in the order of [`Fault::ALL`].
    pub(crate) failures: [u64; 5],
    /// By reason, in the order of [`FailReason::ALL`].
    pub(crate) dead_letters: [u64; FailReason::ALL.len()],
}

impl Counts {
    /// Dead letters published (and confirmed) for `reason`.
    pub fn dead_lettered(&self, reason: FailReason) -> u64 {
        FailReason::ALL
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.dead_letters[i])
    }

    /// Failed handler attempts of `fault` (for [`Fault::Infrastructure`]:
    /// Redis outages and broker connections lost).
    pub fn failures(&self, fault: Fault) -> u64 {
        self.failures[fault.index()]
    }

    /// Dead letters published, all reasons.
    pub fn dead_lettered_total(&self) -> u64 {
        self.dead_letters.iter().sum()
    }

    /// Events settled one way or another: processed, duplicate or dead-lettered.
    pub fn settled(&self) -> u64 {
        self.processed + self.duplicates + self.dead_lettered_total()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_contract::ShardCount;

    fn shards(n: u32) -> Vec<ShardId> {
        ShardCount::new(n).unwrap().ids().collect()
    }

    /// docs/reference/metrics.md: every metric the registry exposes, with its
    /// type, labels and help, read from a fresh exposition.
    fn reference_page() -> String {
        let m = Metrics::new(&shards(1), Thresholds::default(), Duration::from_secs(60));
        let text = m.encode().unwrap();
        // name → (type, help, labels), in exposition order.
        let mut metrics: Vec<(String, String, String, Vec<String>)> = Vec::new();
        for line in text.lines() {
            let described = line
                .strip_prefix("# TYPE ")
                .map(|rest| (rest, true))
                .or_else(|| line.strip_prefix("# HELP ").map(|rest| (rest, false)));
            if let Some((rest, is_type)) = described {
                let (name, value) = rest.split_once(' ').unwrap_or((rest, ""));
                if !metrics.iter().any(|m| m.0 == name) {
                    metrics.push((name.to_owned(), String::new(), String::new(), Vec::new()));
                }
                let entry = metrics.iter_mut().find(|m| m.0 == name).unwrap();
                if is_type {
                    entry.1 = value.to_owned();
                } else {
                    entry.2 = value.to_owned();
                }
            } else if let Some((series, labels)) = line.split_once('{') {
                let Some(entry) = metrics.iter_mut().find(|m| series.starts_with(&m.0)) else {
                    continue;
                };
                for pair in labels.split('}').next().unwrap_or_default().split(',') {
                    let label = pair.split('=').next().unwrap_or_default().to_owned();
                    if label != "le" && !label.is_empty() && !entry.3.contains(&label) {
                        entry.3.push(label);
                    }
                }
            }
        }
        let mut page = String::from(
            "# Metrics\n\n\
             Generated from the worker's metric registry (`worker/src/metrics.rs`, names in\n\
             `metrics::names`); do not edit by hand. Served at `/metrics` (OpenMetrics text) with\n\
             `--metrics-addr`; counters are scraped with `_total` appended. What to alert on, and\n\
             what each series means in more words: [observability](../operating/observability.md#metrics).\n\n\
             | metric | type | labels | meaning |\n|---|---|---|---|\n",
        );
        for (name, kind, help, labels) in metrics {
            let scraped = if kind == "counter" {
                format!("{name}_total")
            } else {
                name
            };
            let labels: Vec<String> = labels.iter().map(|l| format!("`{l}`")).collect();
            page.push_str(&format!(
                "| `{scraped}` | {kind} | {} | {} |\n",
                labels.join(", "),
                help.replace('|', "\\|")
            ));
        }
        page
    }

    #[test]
    fn the_metrics_reference_is_current() {
        let page =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference/metrics.md");
        shardline_docs::generated::check(
            &page,
            &reference_page(),
            "cargo test -p shardline-worker --lib the_metrics_reference_is_current",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn exposition_names_every_metric_with_shard_labels() {
        let m = Metrics::new(&shards(2), Thresholds::default(), Duration::from_secs(60));
        let s1 = m.shards()[1].clone();
        s1.watch.set_state(ShardState::Consuming);
        s1.watch.start_inflight(crate::live::Stamp {
            ms: unix_ms() - 45_000,
            source: StampSource::Publisher,
        });
        for _ in 0..3 {
            s1.attempt();
        }
        s1.processed(Duration::from_millis(5));
        s1.retried();
        s1.dead_lettered(FailReason::Handler);
        m.broker_reconnected();
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
            "shardline_redis_outages_total 0",
            "shardline_seq_gaps_total 0",
            "shardline_fenced_writes_total 0",
            "shardline_abandoned_calls_total 0",
            "shardline_grouped_events_total 0",
            "shardline_inflight_events{shard=\"1\"} 1",
            "shardline_waiting_events{shard=\"1\"} 0",
            "shardline_dlq_depth 7",
            "shardline_queue_depth{shard=\"0\"} 0",
            "shardline_backlog_level{shard=\"1\"} 1",
            "shardline_backlog_level{shard=\"0\"} 0",
            "shardline_backlog_age_seconds{shard=\"0\"} 0",
            "shardline_backlog_publisher_claimed{shard=\"1\"} 1",
            "shardline_backlog_publisher_claimed{shard=\"0\"} 0",
            "shardline_shard_active{shard=\"1\"} 1",
            "shardline_shard_active{shard=\"0\"} 0",
            "shardline_stuck{shard=\"1\"} 0",
        ] {
            assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
        }
    }

    #[test]
    fn counts_read_the_same_counters_as_the_exposition() {
        let m = Metrics::new(&shards(2), Thresholds::default(), Duration::from_secs(60));
        let [s0, s1] = [m.shards()[0].clone(), m.shards()[1].clone()];
        s0.processed(Duration::from_millis(5));
        s1.processed(Duration::from_millis(5));
        s1.duplicate();
        s0.dead_lettered(FailReason::Decode);
        s1.dead_lettered(FailReason::Handler);
        s1.dead_lettered(FailReason::Handler);
        s0.gap();
        s1.took_over();
        s1.watch.set_state(ShardState::Consuming);
        s1.watch.set_held(2, None);
        let counts = m.counts();
        assert_eq!(counts.processed, 2);
        assert_eq!(counts.duplicates, 1);
        assert_eq!(counts.dead_lettered(FailReason::Handler), 2);
        assert_eq!(counts.dead_lettered_total(), 3);
        assert_eq!(counts.settled(), 6);
        assert_eq!((counts.gaps, counts.takeovers, counts.held), (1, 1, 2));
    }
}
