//! The ruststream-lapin peer: the consumer a user of the RustStream framework would write on its
//! RabbitMQ transport, run by shardline's bench as the thing shardline is compared against.
//!
//! Per delivery: one Redis `SET <prefix><message_id> 1 NX EX 604800` (the dedup mark), then the
//! handler (which does nothing), then the framework acks. One subscriber per queue, sequential
//! (the framework's default dispatch: one message at a time), with the given prefetch per queue.
//!
//! Configured by the environment (no arguments); see README.md for the interface.

use std::env;
use std::io;
use std::num::NonZeroU16;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use ruststream::runtime::SubscriptionEnd;
use ruststream_lapin::context::AmqpContext;
use ruststream_lapin::prelude::*;
use tokio::sync::Notify;

/// How long the whole run may take, from the first connection attempt.
const DEADLINE: Duration = Duration::from_secs(600);

/// The dedup mark's lifetime: seven days.
const MARK_TTL_SECONDS: u64 = 604_800;

/// The settings the bench hands over in the environment.
struct Config {
    amqp_url: String,
    queues: Vec<String>,
    prefetch: u16,
    redis_url: String,
    key_prefix: String,
    total: u64,
}

impl Config {
    fn from_env() -> Result<Self, String> {
        fn var(name: &str) -> Result<String, String> {
            env::var(name).map_err(|_| format!("{name} is not set"))
        }
        let queues: Vec<String> = var("PEER_QUEUES")?
            .split(',')
            .map(str::trim)
            .filter(|q| !q.is_empty())
            .map(str::to_owned)
            .collect();
        if queues.is_empty() {
            return Err("PEER_QUEUES names no queue".to_owned());
        }
        let prefetch = var("PEER_PREFETCH")?
            .trim()
            .parse::<u16>()
            .map_err(|e| format!("PEER_PREFETCH: {e}"))?;
        let total = var("PEER_TOTAL")?
            .trim()
            .parse::<u64>()
            .map_err(|e| format!("PEER_TOTAL: {e}"))?;
        Ok(Self {
            amqp_url: var("PEER_AMQP_URL")?,
            queues,
            prefetch,
            redis_url: var("PEER_REDIS_URL")?,
            key_prefix: env::var("PEER_KEY_PREFIX").unwrap_or_default(),
            total,
        })
    }
}

/// What the handlers and `main` share: the ack count, the first failure, the finish line.
struct Progress {
    started: Instant,
    total: u64,
    acked: AtomicU64,
    /// Elapsed time when the last of `total` was acked.
    finished: OnceLock<Duration>,
    failure: Mutex<Option<String>>,
    stop: Notify,
}

impl Progress {
    fn acked(&self) {
        let n = self.acked.fetch_add(1, Ordering::AcqRel) + 1;
        if n == self.total {
            let _ = self.finished.set(self.started.elapsed());
            self.stop.notify_one();
        }
    }

    fn fail(&self, reason: String) {
        let mut failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if failure.is_none() {
            *failure = Some(reason);
        }
        drop(failure);
        self.stop.notify_one();
    }

    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// The application state `on_startup` produces: the Redis connection every delivery uses.
struct Peer {
    redis: MultiplexedConnection,
    key_prefix: String,
    progress: Arc<Progress>,
}

/// The delivery's bytes, untouched: the payload is never decoded (the handler does nothing with
/// it), so no codec sits on the path.
#[derive(Deserialized)]
struct Event<'a>(#[allow(dead_code)] &'a [u8]);

/// One delivery: mark it in Redis, handle it, and let the framework ack it.
#[subscriber]
async fn consume(_event: &Event<'_>, ctx: &mut Context<'_, AmqpContext, Peer>) -> HandlerOutcome {
    let peer = ctx.state();
    let key = match ctx.headers().message_id() {
        Some(id) => format!("{}{id}", peer.key_prefix),
        // No message id: the delivery tag stands in, qualified by the queue because tags are
        // per channel and every queue has a channel of its own.
        None => format!(
            "{}{}#{}",
            peer.key_prefix,
            ctx.name(),
            ctx.context(DeliveryTag)
        ),
    };
    let mut redis = peer.redis.clone();
    let progress = Arc::clone(&peer.progress);
    let marked: Result<Option<String>, redis::RedisError> = redis::cmd("SET")
        .arg(&key)
        .arg(1)
        .arg("NX")
        .arg("EX")
        .arg(MARK_TTL_SECONDS)
        .query_async(&mut redis)
        .await;
    match marked {
        // First sighting: the handler runs - and does nothing.
        Ok(Some(_)) => {}
        // Already marked: a duplicate, acked without handling.
        Ok(None) => {}
        Err(err) => {
            progress.fail(format!("redis SET {key}: {err}"));
            return HandlerOutcome::retry();
        }
    }
    // Counted once the framework's ack has gone out.
    ctx.after_ack(async move { progress.acked() });
    HandlerOutcome::ack()
}

fn app(config: &Config, progress: Arc<Progress>) -> impl App {
    let mut broker =
        LapinBroker::new(config.amqp_url.clone()).connection_name("ruststream-lapin-peer");
    // A prefetch of 0 is AMQP's "unlimited", which the framework spells as no prefetch at all.
    if let Some(prefetch) = NonZeroU16::new(config.prefetch) {
        broker = broker.prefetch(prefetch);
    }
    let redis_url = config.redis_url.clone();
    let key_prefix = config.key_prefix.clone();
    let queues = config.queues.clone();
    RustStream::new(AppInfo::new(
        "ruststream-lapin-peer",
        env!("CARGO_PKG_VERSION"),
    ))
    .on_startup(async move |()| {
        let redis_error = |e: redis::RedisError| io::Error::other(format!("redis: {e}"));
        let client = redis::Client::open(redis_url.as_str()).map_err(redis_error)?;
        let redis = client
            .get_multiplexed_async_connection()
            .await
            .map_err(redis_error)?;
        Ok::<_, io::Error>(Peer {
            redis,
            key_prefix,
            progress,
        })
    })
    .on_subscription_end(SubscriptionEnd::FailFast)
    .shutdown_timeout(Duration::from_secs(10))
    .with_broker(broker, move |b| {
        for queue in queues {
            // By name: the queue exists already, and the broker declares nothing.
            b.include(consume.name(queue));
        }
    })
}

/// One line, whatever the error's own formatting does with newlines.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

async fn run(config: Config, progress: Arc<Progress>) -> Result<(), String> {
    if config.total == 0 {
        let _ = progress.finished.set(progress.started.elapsed());
        return Ok(());
    }
    let app = app(&config, Arc::clone(&progress));
    let stop = Arc::clone(&progress);
    let result = app
        .run_until(async move { stop.stop.notified().await })
        .await;
    if let Some(failure) = progress.failure() {
        return Err(failure);
    }
    result.map_err(|e| e.to_string())?;
    if progress.finished.get().is_none() {
        return Err(format!(
            "the service stopped after {} of {} acks",
            progress.acked.load(Ordering::Acquire),
            config.total
        ));
    }
    Ok(())
}

fn main() -> ExitCode {
    let started = Instant::now();
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(err) => {
            eprintln!("peer: {}", one_line(&err));
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("peer: tokio runtime: {}", one_line(&err.to_string()));
            return ExitCode::FAILURE;
        }
    };
    let progress = Arc::new(Progress {
        started,
        total: config.total,
        acked: AtomicU64::new(0),
        finished: OnceLock::new(),
        failure: Mutex::new(None),
        stop: Notify::new(),
    });
    let outcome = runtime.block_on(async {
        match tokio::time::timeout_at(
            (started + DEADLINE).into(),
            run(config, Arc::clone(&progress)),
        )
        .await
        {
            Ok(result) => result,
            Err(_) => Err(format!(
                "timed out after {} s with {} of {} acked",
                DEADLINE.as_secs(),
                progress.acked.load(Ordering::Acquire),
                progress.total
            )),
        }
    });
    // Whatever is still running (a detached dispatch task after a timeout) ends with the process.
    runtime.shutdown_background();
    match outcome {
        Ok(()) => {
            let elapsed = progress
                .finished
                .get()
                .copied()
                .unwrap_or_else(|| started.elapsed());
            println!(
                "peer: acked {} messages in {:.3} seconds",
                progress.total,
                elapsed.as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("peer: {}", one_line(&err));
            ExitCode::FAILURE
        }
    }
}
