//! `shardline bench`: the worker draining a pre-published load, next to a raw
//! lapin consume-and-ack loop doing one Redis `SET NX EX` per event, measured in
//! the same run on the same broker, Redis and shard count.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use shardline_publisher::Publisher;
use shardline_topology::broker;
use shardline_worker::{Config, Worker, handler::Noop};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::GlobalArgs;
use crate::publish::load_events;
use crate::scratch::Scratch;
use crate::worker::OnDeadLetterArg;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Events pre-published for each measurement.
    #[arg(long, default_value_t = 50_000)]
    pub events: u64,
    /// Events per order (seq 1..E).
    #[arg(long, default_value_t = 5)]
    pub events_per_order: u64,
    /// Approximate body size of each event, in bytes.
    #[arg(long, default_value_t = 200)]
    pub event_bytes: usize,
    /// Prefetch settings to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u16, 32])]
    pub prefetch: Vec<u16>,
    /// Measurements of each kind per prefetch; the median is reported.
    #[arg(long, default_value_t = 1)]
    pub rounds: u32,
    /// The worker's `--on-dead-letter` mode (quarantine costs one Redis round
    /// trip per event).
    #[arg(long, value_enum, default_value_t = OnDeadLetterArg::Continue)]
    pub on_dead_letter: OnDeadLetterArg,
    /// The worker's `--kinds-ttl` (`0s`: record no kinds, to measure their cost).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub kinds_ttl: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Raw,
    Worker,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Self::Raw => "raw lapin loop + SET NX EX",
            Self::Worker => "shardline worker (noop)",
        }
    }
}

pub async fn run(
    global: &GlobalArgs,
    args: BenchArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.events > 0, "--events must be at least 1");
    anyhow::ensure!(
        args.events_per_order > 0,
        "--events-per-order must be at least 1"
    );
    anyhow::ensure!(
        !args.prefetch.contains(&0),
        "--prefetch values must be at least 1"
    );
    eprintln!(
        "bench: {} events of ~{} bytes over {} shards, prefetch {:?}, {} round(s)",
        args.events, args.event_bytes, global.shards, args.prefetch, args.rounds
    );
    let mut rows = Vec::new();
    for &prefetch in &args.prefetch {
        let mut rates = [Vec::new(), Vec::new()];
        for round in 0..args.rounds {
            // Alternate the order so drift on a noisy machine hits both kinds alike.
            let kinds = if round % 2 == 0 {
                [Kind::Raw, Kind::Worker]
            } else {
                [Kind::Worker, Kind::Raw]
            };
            for kind in kinds {
                if shutdown.is_cancelled() {
                    anyhow::bail!("interrupted");
                }
                let rate = measure(global, &args, kind, prefetch).await?;
                eprintln!(
                    "  prefetch {prefetch:>3}  {:<28} {rate:>9.0} events/s",
                    kind.label()
                );
                rates[usize::from(kind == Kind::Worker)].push(rate);
            }
        }
        rows.push((prefetch, median(&mut rates[0]), median(&mut rates[1])));
    }
    println!();
    println!(
        "{:>8}  {:>14}  {:>14}  {:>12}",
        "prefetch", "raw events/s", "worker events/s", "worker/raw"
    );
    for (prefetch, raw, worker) in rows {
        println!(
            "{prefetch:>8}  {raw:>14.0}  {worker:>15.0}  {:>12.2}",
            worker / raw
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Pre-publishes the load into fresh names, drains it with `kind`, cleans up.
async fn measure(
    global: &GlobalArgs,
    args: &BenchArgs,
    kind: Kind,
    prefetch: u16,
) -> anyhow::Result<f64> {
    let scratch = Scratch::create(global, "bench").await?;
    let result = async {
        prepublish(global, &scratch, args).await?;
        let started = Instant::now();
        match kind {
            Kind::Raw => raw_drain(global, &scratch, prefetch, args.events).await?,
            Kind::Worker => {
                let config = Config {
                    prefetch,
                    on_dead_letter: args.on_dead_letter.into(),
                    kinds_ttl: args.kinds_ttl,
                    ..scratch.worker_config("bench")
                };
                worker_drain(config, args.events).await?;
            }
        }
        Ok::<_, anyhow::Error>(args.events as f64 / started.elapsed().as_secs_f64())
    }
    .await;
    scratch.remove().await?;
    result
}

async fn prepublish(
    global: &GlobalArgs,
    scratch: &Scratch,
    args: &BenchArgs,
) -> anyhow::Result<()> {
    let mut publisher = Publisher::connect(shardline_publisher::Config {
        amqp: global.amqp_url.clone(),
        names: scratch.names.clone(),
        shards: global.shards,
        window: 1024,
        connection_name: "shardline bench publisher".into(),
        ..Default::default()
    })
    .await?;
    let orders = args.events.div_ceil(args.events_per_order);
    let padding = "x".repeat(args.event_bytes.saturating_sub(130));
    let stream = load_events(orders, args.events_per_order, "BENCH-")
        .filter(|event| {
            event
                .seq
                .is_some_and(|seq| (seq - 1) * orders < args.events)
        })
        .take(usize::try_from(args.events).unwrap_or(usize::MAX));
    for mut event in stream {
        if let serde_json::Value::Object(data) = &mut event.data {
            data.insert("pad".into(), padding.clone().into());
        }
        publisher.publish_event(&event).await?;
    }
    publisher.close().await?;
    Ok(())
}

/// The baseline: per shard, one channel on a shared connection and one Redis
/// connection, `SET key 1 NX EX` then ack for every delivery.
async fn raw_drain(
    global: &GlobalArgs,
    scratch: &Scratch,
    prefetch: u16,
    total: u64,
) -> anyhow::Result<()> {
    let conn = Arc::new(broker::connect(&global.amqp_url, "shardline bench raw loop").await?);
    let redis = redis::Client::open(global.redis_url.url()).context("--redis-url")?;
    let done = Arc::new(AtomicU64::new(0));
    let finished = CancellationToken::new();
    let mut tasks = JoinSet::new();
    for shard in global.shards.ids() {
        let queue = scratch.names.shard_queue(shard);
        let (conn, done, finished) = (conn.clone(), done.clone(), finished.clone());
        let key_prefix = format!("{}raw:", scratch.redis_prefix);
        let mut redis = redis.get_multiplexed_async_connection().await?;
        tasks.spawn(async move {
            let channel = conn.create_channel().await?;
            channel
                .basic_qos(prefetch, BasicQosOptions::default())
                .await?;
            let mut consumer = channel
                .basic_consume(
                    queue.as_str().into(),
                    format!("raw-{shard}").as_str().into(),
                    BasicConsumeOptions {
                        exclusive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            loop {
                let next = tokio::select! {
                    _ = finished.cancelled() => return Ok::<_, anyhow::Error>(()),
                    next = consumer.next() => next,
                };
                let Some(delivery) = next else { return Ok(()) };
                let delivery = delivery?;
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.to_string())
                    .unwrap_or_else(|| delivery.delivery_tag.to_string());
                redis::cmd("SET")
                    .arg(format!("{key_prefix}{id}"))
                    .arg(1)
                    .arg("NX")
                    .arg("EX")
                    .arg(604_800)
                    .query_async::<Option<String>>(&mut redis)
                    .await?;
                delivery.ack(BasicAckOptions::default()).await?;
                if done.fetch_add(1, Ordering::Relaxed) + 1 == total {
                    finished.cancel();
                }
            }
        });
    }
    let outcome = tokio::time::timeout(drain_deadline(total), finished.cancelled()).await;
    finished.cancel();
    while let Some(joined) = tasks.join_next().await {
        joined??;
    }
    conn.close(200, "done".into()).await.ok();
    outcome.map_err(|_| {
        anyhow::anyhow!(
            "raw loop drained {} of {total} events before the deadline",
            done.load(Ordering::Relaxed)
        )
    })
}

async fn worker_drain(config: Config, total: u64) -> anyhow::Result<()> {
    let stop = CancellationToken::new();
    let worker = Worker::new(config, Arc::new(Noop))?;
    let progress = worker.progress();
    let worker = tokio::spawn(worker.run(stop.clone()));
    let deadline = Instant::now() + drain_deadline(total);
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    while progress.counts().settled() < total && Instant::now() < deadline && !worker.is_finished()
    {
        tick.tick().await;
    }
    stop.cancel();
    worker.await??;
    let settled = progress.counts().settled();
    anyhow::ensure!(
        settled >= total,
        "worker drained {settled} of {total} events before the deadline"
    );
    Ok(())
}

/// Generous: a drain slower than 200 events/s means something is broken.
fn drain_deadline(total: u64) -> Duration {
    Duration::from_secs(30 + total / 200)
}
