//! `shardline bench`: the worker draining a pre-published load, next to a raw
//! lapin consume-and-ack loop doing one Redis `SET NX EX` per event, measured in
//! the same run on the same broker, Redis and shard count. With
//! `--downstream-latency` the worker calls a local HTTP downstream that answers
//! after that long (the `http` handler), once per `--concurrency` value, and
//! the rates are compared with the first value's.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use futures_util::StreamExt;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Response, StatusCode};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use shardline_publisher::Publisher;
use shardline_topology::broker;
use shardline_worker::handler::{Http, Noop};
use shardline_worker::{Config, Handler, Worker};
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
    /// Calls in flight per shard (`worker --concurrency`) to measure,
    /// comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u16])]
    pub concurrency: Vec<u16>,
    /// Call a local HTTP downstream that answers 200 after this long (the
    /// worker's `http` handler) instead of the `noop` handler; the raw loop is
    /// not measured then.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub downstream_latency: Option<Duration>,
    /// Measurements of each kind per setting; the median is reported.
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
    fn label(self, downstream: bool) -> &'static str {
        match (self, downstream) {
            (Self::Raw, _) => "raw lapin loop + SET NX EX",
            (Self::Worker, false) => "shardline worker (noop)",
            (Self::Worker, true) => "shardline worker (http)",
        }
    }
}

/// One measured setting.
#[derive(Debug, Clone, Copy)]
struct Setting {
    prefetch: u16,
    concurrency: u16,
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
    anyhow::ensure!(
        !args.concurrency.contains(&0),
        "--concurrency values must be at least 1"
    );
    let stop_downstream = CancellationToken::new();
    let _stop_downstream = stop_downstream.clone().drop_guard();
    let downstream = match args.downstream_latency {
        Some(latency) => Some(start_downstream(latency, stop_downstream).await?),
        None => None,
    };
    eprintln!(
        "bench: {} events of ~{} bytes over {} shards, prefetch {:?}, concurrency {:?}, {}, {} round(s)",
        args.events,
        args.event_bytes,
        global.shards,
        args.prefetch,
        args.concurrency,
        args.downstream_latency.map_or_else(
            || "noop handler".to_owned(),
            |l| format!("downstream latency {}", humantime::format_duration(l))
        ),
        args.rounds
    );
    let kinds: &[Kind] = if downstream.is_some() {
        &[Kind::Worker]
    } else {
        &[Kind::Raw, Kind::Worker]
    };
    let mut rows = Vec::new();
    for &prefetch in &args.prefetch {
        for &concurrency in &args.concurrency {
            let setting = Setting {
                prefetch,
                concurrency,
            };
            let mut rates = [Vec::new(), Vec::new()];
            for round in 0..args.rounds {
                // Alternate the order so drift on a noisy machine hits both kinds alike.
                let mut order = kinds.to_vec();
                if round % 2 == 1 {
                    order.reverse();
                }
                for kind in order {
                    if shutdown.is_cancelled() {
                        anyhow::bail!("interrupted");
                    }
                    let rate = measure(global, &args, kind, setting, downstream).await?;
                    eprintln!(
                        "  prefetch {prefetch:>3}  concurrency {concurrency:>3}  {:<28} {rate:>9.0} events/s",
                        kind.label(downstream.is_some())
                    );
                    rates[usize::from(kind == Kind::Worker)].push(rate);
                }
            }
            rows.push((setting, median(&mut rates[0]), median(&mut rates[1])));
        }
    }
    println!();
    if downstream.is_some() {
        println!(
            "{:>8}  {:>11}  {:>15}  {:>12}",
            "prefetch", "concurrency", "worker events/s", "vs first"
        );
        let first = rows.first().map_or(0.0, |(_, _, worker)| *worker);
        for (setting, _, worker) in rows {
            println!(
                "{:>8}  {:>11}  {worker:>15.0}  {:>11.2}x",
                setting.prefetch,
                setting.concurrency,
                worker / first
            );
        }
    } else {
        println!(
            "{:>8}  {:>11}  {:>14}  {:>15}  {:>12}",
            "prefetch", "concurrency", "raw events/s", "worker events/s", "worker/raw"
        );
        for (setting, raw, worker) in rows {
            println!(
                "{:>8}  {:>11}  {raw:>14.0}  {worker:>15.0}  {:>12.2}",
                setting.prefetch,
                setting.concurrency,
                worker / raw
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A downstream on a free local port that answers every request 200 after
/// `latency`, until `stop`.
async fn start_downstream(
    latency: Duration,
    stop: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = shardline_worker::http::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(shardline_worker::http::serve_with(
        listener,
        stop,
        move |_req| async move {
            tokio::time::sleep(latency).await;
            let mut ok = Response::new(Full::new(Bytes::from_static(b"{}")));
            *ok.status_mut() = StatusCode::OK;
            Ok::<_, Infallible>(ok)
        },
    ));
    Ok(addr)
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
    setting: Setting,
    downstream: Option<SocketAddr>,
) -> anyhow::Result<f64> {
    let handler: Arc<dyn Handler> = match downstream {
        Some(addr) => Arc::new(Http::new(&format!("http://{addr}/events"))?),
        None => Arc::new(Noop),
    };
    let scratch = Scratch::create(global, "bench").await?;
    let result = async {
        prepublish(global, &scratch, args).await?;
        let started = Instant::now();
        match kind {
            Kind::Raw => raw_drain(global, &scratch, setting.prefetch, args.events).await?,
            Kind::Worker => {
                let config = Config {
                    prefetch: setting.prefetch,
                    concurrency: setting.concurrency,
                    on_dead_letter: args.on_dead_letter.into(),
                    kinds_ttl: args.kinds_ttl,
                    ..scratch.worker_config("bench")
                };
                worker_drain(config, handler, args.events).await?;
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

async fn worker_drain(config: Config, handler: Arc<dyn Handler>, total: u64) -> anyhow::Result<()> {
    let stop = CancellationToken::new();
    let worker = Worker::new(config, handler)?;
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
