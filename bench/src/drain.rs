//! One drain measurement: pre-publish the load into fresh names, drain it with
//! the worker or a raw lapin loop, clean up; the rate is events over the
//! drain's wall time.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Response, StatusCode};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use shardline_connect::broker;
use shardline_ops::Fleet;
use shardline_publisher::Publisher;
use shardline_worker::handler::{Http, Noop};
use shardline_worker::{Config, Handler, Worker};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::load::{load_events, padding};
use crate::rounds::{Baseline, Kind};
use crate::scratch::Scratch;
use crate::settings::{BenchSettings, Setting};

/// The worker's configuration for `setting` on `scratch`'s names.
pub(crate) fn worker_config(scratch: &Scratch, args: &BenchSettings, setting: Setting) -> Config {
    Config {
        prefetch: setting.prefetch,
        concurrency: setting.concurrency,
        group_commit: args.group_commit,
        on_dead_letter: args.on_dead_letter,
        kinds_ttl: args.kinds_ttl,
        ..scratch.worker_config("bench")
    }
}

/// Pre-publishes the load into fresh names, drains it with `kind`, cleans up;
/// returns events/s.
pub(crate) async fn measure(
    global: &Fleet,
    args: &BenchSettings,
    kind: Kind,
    setting: Setting,
    downstream: Option<SocketAddr>,
) -> Result<f64, Error> {
    let handler: Arc<dyn Handler> = match downstream {
        Some(addr) => Arc::new(Http::new(&format!("http://{addr}/events"))?),
        None => Arc::new(Noop),
    };
    let scratch = Scratch::create(global, "bench").await?;
    let result = async {
        // Bounded, so that a broker that stopped confirming (a memory or disk
        // alarm blocks publishers) ends the bench with a reason, not a hang.
        tokio::time::timeout(drain_deadline(args.events), prepublish(global, &scratch, args))
            .await
            .map_err(|_| {
                Error::Failed(format!(
                    "publishing the load did not finish within {}: is the broker blocking publishers (memory or disk alarm: `rabbitmqctl status`)?",
                    humantime::format_duration(drain_deadline(args.events))
                ))
            })??;
        let started = Instant::now();
        match kind {
            Kind::Raw(Baseline::Peer) => {
                let path = args
                    .peer
                    .as_deref()
                    .ok_or_else(|| Error::setting(&["peer"], "no peer"))?;
                peer_drain(path, global, &scratch, setting.prefetch, args.events).await?;
            }
            Kind::Raw(baseline) => {
                raw_drain(global, &scratch, setting.prefetch, args.events, baseline).await?;
            }
            Kind::Worker => {
                let config = worker_config(&scratch, args, setting);
                worker_drain(config, handler, args.events).await?;
            }
        }
        Ok::<_, Error>(args.events as f64 / started.elapsed().as_secs_f64())
    }
    .await;
    scratch.remove().await?;
    result
}

/// A downstream on a free local port that answers every request 200 after
/// `latency`, until `stop`.
pub(crate) async fn start_downstream(
    latency: Duration,
    stop: CancellationToken,
) -> Result<SocketAddr, Error> {
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

async fn prepublish(global: &Fleet, scratch: &Scratch, args: &BenchSettings) -> Result<(), Error> {
    let mut publisher = Publisher::connect(shardline_publisher::Config {
        amqp: global.amqp.clone(),
        names: scratch.names.clone(),
        shards: global.shards,
        window: 1024,
        connection_name: "shardline bench publisher".into(),
        ..Default::default()
    })
    .await?;
    let orders = args.events.div_ceil(args.events_per_order);
    let padding = padding(args.event_bytes);
    let stream = load_events(orders, args.events_per_order, "BENCH-")
        .filter(|event| {
            event.as_ref().map_or(true, |event| {
                event
                    .seq
                    .is_some_and(|seq| (seq - 1) * orders < args.events)
            })
        })
        .take(usize::try_from(args.events).unwrap_or(usize::MAX));
    for event in stream {
        let mut event = event.map_err(Error::OrderPrefix)?;
        if args.unsequenced {
            event.seq = None;
        }
        if let serde_json::Value::Object(data) = &mut event.data {
            data.insert("pad".into(), padding.clone().into());
        }
        publisher.publish_event(&event).await?;
    }
    publisher.close().await?;
    Ok(())
}

/// A baseline: per shard, one channel on a shared connection, and for
/// [`Baseline::Set`] one Redis connection, `SET key 1 NX EX` then ack for
/// every delivery; for [`Baseline::Nodedup`] the ack alone.
async fn raw_drain(
    global: &Fleet,
    scratch: &Scratch,
    prefetch: u16,
    total: u64,
    baseline: Baseline,
) -> Result<(), Error> {
    let conn = Arc::new(broker::connect(&global.amqp, "shardline bench raw loop").await?);
    let with_redis = baseline == Baseline::Set;
    let done = Arc::new(AtomicU64::new(0));
    let finished = CancellationToken::new();
    let mut tasks = JoinSet::new();
    for shard in global.shards.ids() {
        let queue = scratch.names.shard_queue(shard);
        let (conn, done, finished) = (conn.clone(), done.clone(), finished.clone());
        let key_prefix = format!("{}raw:", scratch.redis_prefix);
        // One connection per shard, as the loop was first measured (the
        // worker's shards share up to 16); through the Sentinels for a
        // `redis+sentinel://` URL.
        let mut redis = match with_redis {
            true => Some(global.redis.connect().await?),
            false => None,
        };
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
                    _ = finished.cancelled() => return Ok::<_, Error>(()),
                    next = consumer.next() => next,
                };
                let Some(delivery) = next else { return Ok(()) };
                let delivery = delivery?;
                if let Some(redis) = redis.as_mut() {
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
                        .query_async::<Option<String>>(redis)
                        .await?;
                }
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
        Error::Failed(format!(
            "raw loop drained {} of {total} events before the deadline",
            done.load(Ordering::Relaxed)
        ))
    })
}

/// The `--peer` program on the same queues: started, given everything in
/// `PEER_*` variables, and timed to its exit (its connection set-up counted,
/// as the raw loops' is).
async fn peer_drain(
    path: &std::path::Path,
    global: &Fleet,
    scratch: &Scratch,
    prefetch: u16,
    total: u64,
) -> Result<(), Error> {
    let queues: Vec<String> = global
        .shards
        .ids()
        .map(|shard| scratch.names.shard_queue(shard))
        .collect();
    let mut child = tokio::process::Command::new(path)
        .env("PEER_AMQP_URL", global.amqp.primary())
        .env("PEER_QUEUES", queues.join(","))
        .env("PEER_PREFETCH", prefetch.to_string())
        .env("PEER_REDIS_URL", global.redis.url())
        .env("PEER_KEY_PREFIX", format!("{}peer:", scratch.redis_prefix))
        .env("PEER_TOTAL", total.to_string())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            Error::target(
                &["peer"],
                format!("peer {}: cannot start it: {e}", path.display()),
            )
        })?;
    let status = tokio::time::timeout(drain_deadline(total), child.wait())
        .await
        .map_err(|_| {
            Error::target(
                &["peer"],
                format!(
                    "peer {}: did not drain {total} events in time",
                    path.display()
                ),
            )
        })??;
    if !status.success() {
        return Err(Error::target(
            &["peer"],
            format!("peer {}: {status}", path.display()),
        ));
    }
    Ok(())
}

async fn worker_drain(config: Config, handler: Arc<dyn Handler>, total: u64) -> Result<(), Error> {
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
    tokio::time::timeout(WORKER_STOP, worker)
        .await
        .map_err(|_| {
            Error::Failed(format!(
                "the worker did not stop within {} of being told to (settled {} of {total})",
                humantime::format_duration(WORKER_STOP),
                progress.counts().settled()
            ))
        })???;
    let settled = progress.counts().settled();
    if settled < total {
        return Err(Error::Failed(format!(
            "worker drained {settled} of {total} events before the deadline"
        )));
    }
    Ok(())
}

/// How long a worker told to stop may take: its drain timeout (10 s) and more.
const WORKER_STOP: Duration = Duration::from_secs(30);

/// Generous: a drain slower than 200 events/s means something is broken.
fn drain_deadline(total: u64) -> Duration {
    Duration::from_secs(30 + total / 200)
}
