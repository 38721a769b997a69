//! `shardline demo`: the whole pipeline in one process, on throwaway names.
//!
//! [`run`] runs a worker on every shard of a [`Scratch`] with an in-process
//! handler that injects faults and checks each order's transitions, publishes
//! a generated stream (duplicates, two malformed bodies, a poison event, some
//! transient failures), waits until every event settled, and returns a
//! [`DemoReport`]: what happened, and what does not add up.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use shardline_connect::{broker, declare};
use shardline_contract::headers::{self, FailReason};
use shardline_publisher::Publisher;
use shardline_worker::{Config, Counts, Event, Handler, HandlerError, RetryPolicy, Worker};
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::load::load_events;
use crate::scratch::Scratch;

/// Order ids are `DEMO-ORD-000001`….
const ORDER_PREFIX: &str = "DEMO-";
/// Every n-th event is published twice.
const DUPLICATE_EVERY: u64 = 50;
/// Every n-th event meets a downstream that fails twice before it succeeds.
const TRANSIENT_EVERY: u64 = 97;
/// The order whose third event the downstream always rejects.
pub const POISON_ORDER: u64 = 7;
pub const POISON_SEQ: u64 = 3;

/// What a demo run generates and how long it waits.
#[derive(Debug, Clone)]
pub struct DemoSettings {
    /// Orders in the stream (at least [`POISON_ORDER`]).
    pub orders: u64,
    /// Events per order, seq 1..E (at least [`POISON_SEQ`]).
    pub events_per_order: u64,
    /// Give up waiting for the fleet after this long.
    pub timeout: Duration,
}

/// What the stream contained.
#[derive(Debug, Default, Clone, Copy)]
pub struct Published {
    pub events: u64,
    pub duplicates: u64,
    pub malformed: u64,
}

impl Published {
    pub fn total(&self) -> u64 {
        self.events + self.duplicates + self.malformed
    }
}

/// What a demo run saw.
#[derive(Debug, Clone)]
pub struct DemoReport {
    pub published: Published,
    pub counts: Counts,
    pub elapsed: Duration,
    pub dlq_depth: u32,
    pub shards: u16,
    /// Events of an order that reached the handler after a later one.
    pub order_violations: u64,
    /// Publish → processed, milliseconds, sorted.
    pub latencies_ms: Vec<u64>,
}

/// Runs the demo on `scratch`'s names; `progress(settled, total)` as events settle.
pub async fn run(
    scratch: &Scratch,
    settings: &DemoSettings,
    shutdown: CancellationToken,
    progress: impl Fn(u64, u64),
) -> Result<DemoReport, Error> {
    let handler = Arc::new(Downstream::new(settings.orders));
    let stop = shutdown.child_token();
    let config = Config {
        // Short backoff keeps the demo brisk; the policy is the production one.
        retry: RetryPolicy {
            base: Duration::from_millis(10),
            ..RetryPolicy::default()
        },
        ..scratch.worker_config("demo")
    };
    let worker = Worker::new(config, handler.clone())?;
    let counts = worker.progress();
    let worker = tokio::spawn(worker.run(stop.clone()));

    let started = Instant::now();
    let published = publish_stream(scratch, settings).await?;
    let deadline = started + settings.timeout;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    while counts.counts().settled() < published.total()
        && Instant::now() < deadline
        && !shutdown.is_cancelled()
    {
        tick.tick().await;
        progress(counts.counts().settled(), published.total());
        if worker.is_finished() {
            break;
        }
    }
    let elapsed = started.elapsed();
    stop.cancel();
    worker.await??;

    let conn = broker::connect(&scratch.fleet().amqp, "shardline demo report").await?;
    let dlq = declare::queue_status(&conn, &scratch.names.dead_letter_queue).await;
    conn.close(200, "done".into()).await.ok();
    let dlq = dlq.map_err(|e| Error::Failed(e.to_string()))?;
    let mut latencies_ms = handler
        .latencies_ms
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    latencies_ms.sort_unstable();
    Ok(DemoReport {
        published,
        counts: counts.counts(),
        elapsed,
        dlq_depth: dlq.messages,
        shards: scratch.fleet().shards.get(),
        order_violations: handler.violations.load(Ordering::Relaxed),
        latencies_ms,
    })
}

impl DemoReport {
    /// Publish → processed latency at quantile `q` (0..=1), milliseconds.
    pub fn latency_ms(&self, q: f64) -> u64 {
        let last = self.latencies_ms.len().saturating_sub(1) as f64;
        self.latencies_ms
            .get((last * q).round() as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Dead letters by reason, `reason n`, for the reasons that have any.
    pub fn dead_letters_by_reason(&self) -> Vec<String> {
        FailReason::ALL
            .into_iter()
            .filter(|r| self.counts.dead_lettered(*r) > 0)
            .map(|r| format!("{r} {}", self.counts.dead_lettered(r)))
            .collect()
    }

    /// Everything that does not add up; empty when the run is right.
    pub fn problems(&self) -> Vec<String> {
        let s = &self.counts;
        let p = self.published;
        let mut problems = Vec::new();
        let mut expect = |what: &str, got: u64, want: u64| {
            if got != want {
                problems.push(format!("{what}: {got}, expected {want}"));
            }
        };
        expect("processed", s.processed, p.events - 1);
        expect("duplicates suppressed", s.duplicates, p.duplicates);
        for (reason, name) in [
            (FailReason::Decode, "dead-lettered decode"),
            (FailReason::Invalid, "dead-lettered invalid"),
            (FailReason::Handler, "dead-lettered handler"),
        ] {
            expect(name, s.dead_lettered(reason), 1);
        }
        expect("dead-letter queue depth", u64::from(self.dlq_depth), 3);
        expect("order violations", self.order_violations, 0);
        problems
    }
}

/// Publishes every order's events interleaved (all first events, then all
/// second events…), with duplicates right after their originals and two bodies
/// that are not valid envelopes.
async fn publish_stream(scratch: &Scratch, settings: &DemoSettings) -> Result<Published, Error> {
    let shards = scratch.fleet().shards;
    let mut publisher = Publisher::connect(shardline_publisher::Config {
        amqp: scratch.fleet().amqp.clone(),
        names: scratch.names.clone(),
        shards,
        connection_name: "shardline demo publisher".into(),
        ..Default::default()
    })
    .await?;
    let mut published = Published::default();
    let stream = load_events(settings.orders, settings.events_per_order, ORDER_PREFIX);
    for (index, event) in (1..).zip(stream) {
        let event = event.map_err(Error::OrderPrefix)?;
        publisher.publish_event(&event).await?;
        published.events += 1;
        if index % DUPLICATE_EVERY == 0 {
            publisher.publish_event(&event).await?;
            published.duplicates += 1;
        }
        if index == settings.orders {
            // Two bodies that are not valid envelopes, once the first events are out.
            for body in [
                &b"not json at all"[..],
                br#"{"order_id": 42, "event": "order.created"}"#,
            ] {
                let props = headers::event_properties(
                    "demo-malformed",
                    SystemTime::now(),
                    &headers::new_traceparent(),
                );
                let shard = shards.shard_of("malformed");
                publisher
                    .publish_to_shard(shard, body.to_vec(), props)
                    .await?;
                published.malformed += 1;
            }
        }
    }
    publisher.close().await?;
    Ok(published)
}

/// The in-process downstream: injects the faults and checks each order's
/// transitions arrive in sequence.
struct Downstream {
    orders: u64,
    last_seq: Mutex<HashMap<String, u64>>,
    violations: AtomicU64,
    latencies_ms: Mutex<Vec<u64>>,
}

impl Downstream {
    fn new(orders: u64) -> Self {
        Self {
            orders,
            last_seq: Mutex::new(HashMap::new()),
            violations: AtomicU64::new(0),
            latencies_ms: Mutex::new(Vec::new()),
        }
    }

    fn index(&self, event: &Event<'_>) -> Option<(u64, u64)> {
        let n: u64 = event
            .envelope
            .order_id
            .strip_prefix(ORDER_PREFIX)?
            .strip_prefix("ORD-")?
            .parse()
            .ok()?;
        let seq = event.envelope.seq?;
        Some((n, (seq - 1) * self.orders + n))
    }
}

#[async_trait]
impl Handler for Downstream {
    async fn handle(&self, event: &Event<'_>) -> Result<(), HandlerError> {
        if let Some((n, index)) = self.index(event) {
            if n == POISON_ORDER && event.envelope.seq == Some(POISON_SEQ) {
                return Err(HandlerError::permanent(
                    "downstream rejected the event (422)",
                ));
            }
            if index % TRANSIENT_EVERY == 0 && event.attempt <= 2 {
                return Err(HandlerError::retryable("downstream unavailable (503)"));
            }
        }
        let seq = event.envelope.seq.unwrap_or_default();
        {
            let mut last = self.last_seq.lock().unwrap_or_else(PoisonError::into_inner);
            let previous = last
                .insert(event.envelope.order_id.to_string(), seq)
                .unwrap_or(0);
            if seq <= previous {
                self.violations.fetch_add(1, Ordering::Relaxed);
                tracing::error!(order_id = %event.envelope.order_id, seq, previous, "order violation");
            }
        }
        if let Some(published) = event.published_at_ms {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis();
            let latency = u64::try_from(now)
                .unwrap_or(u64::MAX)
                .saturating_sub(u64::try_from(published).unwrap_or(0));
            self.latencies_ms
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(latency);
        }
        Ok(())
    }
}
