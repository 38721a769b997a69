//! `shardline demo`: the whole pipeline in one process, on throwaway names.
//!
//! Declares its own topology, runs workers for every shard with an in-process
//! handler that checks each order's transitions, publishes a generated stream
//! with injected faults, and reports what happened.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use clap::Args;
use shardline_bench::Scratch;
use shardline_bench::load::load_events;
use shardline_connect::{broker, declare};
use shardline_contract::headers::{self, FailReason};
use shardline_ops::Usage;
use shardline_publisher::Publisher;
use shardline_worker::{Config, Counts, Event, Handler, HandlerError, RetryPolicy, Worker};
use tokio_util::sync::CancellationToken;

use crate::{Flags as _, GlobalArgs};

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Orders in the generated stream.
    #[arg(long, default_value_t = 2000)]
    pub orders: u64,
    /// Events per order (seq 1..E).
    #[arg(long, default_value_t = 5)]
    pub events_per_order: u64,
    /// Give up waiting for the fleet after this long.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

/// Order ids are `DEMO-ORD-000001`….
const ORDER_PREFIX: &str = "DEMO-";
/// Every n-th event is published twice.
const DUPLICATE_EVERY: u64 = 50;
/// Every n-th event meets a downstream that fails twice before it succeeds.
const TRANSIENT_EVERY: u64 = 97;
/// The order whose third event the downstream always rejects.
const POISON_ORDER: u64 = 7;
const POISON_SEQ: u64 = 3;

pub(crate) async fn run(
    global: &GlobalArgs,
    args: DemoArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.orders >= POISON_ORDER,
        Usage(format!("--orders must be at least {POISON_ORDER}"))
    );
    anyhow::ensure!(
        args.events_per_order >= POISON_SEQ,
        Usage(format!("--events-per-order must be at least {POISON_SEQ}"))
    );
    let scratch = Scratch::create(&global.fleet(), "demo").await.flags()?;
    let result = run_on(global, &args, &scratch, shutdown).await;
    let cleanup = scratch.remove().await.flags();
    let code = result?;
    cleanup?;
    Ok(code)
}

async fn run_on(
    global: &GlobalArgs,
    args: &DemoArgs,
    scratch: &Scratch,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let handler = Arc::new(Downstream::new(args));
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
    let published = publish_stream(global, scratch, args).await?;
    let progress = crate::progress::bar(published.total(), "events settled");
    let deadline = started + args.timeout;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    while counts.counts().settled() < published.total()
        && Instant::now() < deadline
        && !shutdown.is_cancelled()
    {
        tick.tick().await;
        progress.set_position(counts.counts().settled());
        if worker.is_finished() {
            break;
        }
    }
    let elapsed = started.elapsed();
    progress.finish_and_clear();
    stop.cancel();
    worker.await??;

    let dlq_depth = {
        let conn = broker::connect(&global.amqp_url, "shardline demo report").await?;
        let status = declare::queue_status(&conn, &scratch.names.dead_letter_queue).await?;
        conn.close(200, "done".into()).await.ok();
        status.messages
    };
    let report = Report {
        published,
        counts: counts.counts(),
        downstream: &handler,
        elapsed,
        dlq_depth,
        shards: global.shards.get(),
    };
    report.print();
    let problems = report.problems();
    if problems.is_empty() {
        println!("\nresult: OK — every event accounted for, no order violated");
        Ok(ExitCode::SUCCESS)
    } else {
        anyhow::bail!("demo found problems: {}", problems.join("; "))
    }
}

/// What the stream contained.
#[derive(Debug, Default, Clone, Copy)]
struct Published {
    events: u64,
    duplicates: u64,
    malformed: u64,
}

impl Published {
    fn total(&self) -> u64 {
        self.events + self.duplicates + self.malformed
    }
}

/// Publishes every order's events interleaved (all first events, then all
/// second events…), with duplicates right after their originals and two bodies
/// that are not valid envelopes.
async fn publish_stream(
    global: &GlobalArgs,
    scratch: &Scratch,
    args: &DemoArgs,
) -> anyhow::Result<Published> {
    let mut publisher = Publisher::connect(shardline_publisher::Config {
        amqp: global.amqp_url.clone(),
        names: scratch.names.clone(),
        shards: global.shards,
        connection_name: "shardline demo publisher".into(),
        ..Default::default()
    })
    .await?;
    let mut published = Published::default();
    let stream = load_events(args.orders, args.events_per_order, ORDER_PREFIX);
    for (index, event) in (1..).zip(stream) {
        let event = event?;
        publisher.publish_event(&event).await?;
        published.events += 1;
        if index % DUPLICATE_EVERY == 0 {
            publisher.publish_event(&event).await?;
            published.duplicates += 1;
        }
        if index == args.orders {
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
                let shard = global.shards.shard_of("malformed");
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
    fn new(args: &DemoArgs) -> Self {
        Self {
            orders: args.orders,
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

struct Report<'a> {
    published: Published,
    counts: Counts,
    downstream: &'a Downstream,
    elapsed: Duration,
    dlq_depth: u32,
    shards: u16,
}

impl Report<'_> {
    fn print(&self) {
        let p = self.published;
        let s = &self.counts;
        let mut latencies = self
            .downstream
            .latencies_ms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        latencies.sort_unstable();
        let pct = |q: f64| {
            latencies
                .get(((latencies.len() as f64 - 1.0) * q).round() as usize)
                .copied()
                .unwrap_or(0)
        };
        let by_reason: Vec<String> = FailReason::ALL
            .into_iter()
            .filter(|r| s.dead_lettered(*r) > 0)
            .map(|r| format!("{r} {}", s.dead_lettered(r)))
            .collect();
        println!(
            "shardline demo: {} shards, {} events in {:.1} s",
            self.shards,
            p.total(),
            self.elapsed.as_secs_f64()
        );
        println!(
            "  published              {:>8}  ({} events, {} duplicates, {} malformed)",
            p.total(),
            p.events,
            p.duplicates,
            p.malformed
        );
        println!("  processed              {:>8}", s.processed);
        println!("  duplicates suppressed  {:>8}", s.duplicates);
        println!("  retries                {:>8}", s.retries);
        println!(
            "  dead-lettered          {:>8}  ({})",
            s.dead_lettered_total(),
            by_reason.join(", ")
        );
        println!("  dead-letter queue      {:>8}", self.dlq_depth);
        println!(
            "  order violations       {:>8}",
            self.downstream.violations.load(Ordering::Relaxed)
        );
        println!(
            "  throughput             {:>8.0}  events/s",
            p.total() as f64 / self.elapsed.as_secs_f64()
        );
        println!(
            "  publish→processed      p50 {} ms, p99 {} ms",
            pct(0.5),
            pct(0.99)
        );
    }

    /// Everything that does not add up.
    fn problems(&self) -> Vec<String> {
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
        expect(
            "dead-lettered decode",
            s.dead_lettered(FailReason::Decode),
            1,
        );
        expect(
            "dead-lettered invalid",
            s.dead_lettered(FailReason::Invalid),
            1,
        );
        expect(
            "dead-lettered handler",
            s.dead_lettered(FailReason::Handler),
            1,
        );
        expect("dead-letter queue depth", u64::from(self.dlq_depth), 3);
        expect(
            "order violations",
            self.downstream.violations.load(Ordering::Relaxed),
            0,
        );
        problems
    }
}
