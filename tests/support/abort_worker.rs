//! `shardline-abort-worker`: a worker whose handler kills the process, for the
//! crash-loop fleet test (`tests/fleet/crashloop.rs`).
//!
//! Runs [`shardline_worker::run`] on every shard with a handler that calls
//! `std::process::abort()` on an event whose envelope has `data.poison == true`
//! and forwards every other event to `--handler-url` (the built-in HTTP
//! handler). SIGTERM or Ctrl-C drains and exits 0, as `shardline worker` does
//! (the same [`shardline_worker::cancel_on_signal`]).
//!
//! Built as a second binary of the root package (`[[bin]]`, `test = false`) so
//! that integration tests get its path from `CARGO_BIN_EXE_shardline-abort-worker`;
//! cargo gives tests no such path for examples.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use clap::Parser;
use shardline_connect::TopologyOptions;
use shardline_contract::QueueType;
use shardline_contract::{Names, ShardCount};
use shardline_worker::handler::Http;
use shardline_worker::{Config, Event, Handler, HandlerError, RetryPolicy};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(name = "shardline-abort-worker")]
struct Args {
    #[arg(
        long,
        env = "SHARDLINE_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: shardline_connect::AmqpTarget,
    #[arg(
        long,
        env = "SHARDLINE_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: shardline_connect::RedisTarget,
    #[arg(long, env = "SHARDLINE_REDIS_PREFIX", default_value = "shardline:")]
    redis_prefix: String,
    #[arg(long, env = "SHARDLINE_SHARDS", default_value_t = ShardCount::default())]
    shards: ShardCount,
    /// Where events that are not poison are POSTed.
    #[arg(long, env = "SHARDLINE_HANDLER_URL")]
    handler_url: String,
    #[arg(long, env = "SHARDLINE_MAX_DELIVERIES", default_value_t = 5)]
    max_deliveries: u32,
    #[arg(long, env = "SHARDLINE_WORKER_NAME", default_value = "abort-worker")]
    worker_name: String,
    /// Shard queue type, as `shardline worker --queue-type`: quorum queues are
    /// consumed non-exclusively (their single-active-consumer picks the active
    /// worker) and an event is dead-lettered `crash-loop` by its `x-delivery-count`.
    #[arg(long, env = "SHARDLINE_QUEUE_TYPE", default_value = "classic")]
    queue_type: QueueType,
    /// Quorum queues: the `x-delivery-limit` they were applied with.
    #[arg(long, env = "SHARDLINE_DELIVERY_LIMIT", default_value_t = shardline_connect::declare::DEFAULT_DELIVERY_LIMIT)]
    delivery_limit: u32,
}

/// Aborts the process on a poison event; forwards the others.
struct AbortOnPoison {
    http: Http,
}

fn is_poison(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/data/poison")
                .and_then(serde_json::Value::as_bool)
        })
        .unwrap_or(false)
}

#[async_trait]
impl Handler for AbortOnPoison {
    async fn handle(&self, event: &Event<'_>) -> Result<(), HandlerError> {
        if is_poison(event.body) {
            tracing::error!(
                dedup_key = event.dedup_key,
                attempt = event.attempt,
                "poison event: aborting the process"
            );
            std::process::abort();
        }
        self.http.handle(event).await
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,lapin=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let http = match Http::new(&args.handler_url) {
        Ok(http) => http,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let exclusive = TopologyOptions {
        shards: args.shards,
        queue_type: args.queue_type,
        ..TopologyOptions::default()
    }
    .exclusive_consumers();
    let config = Config {
        amqp: args.amqp_url,
        redis: args.redis_url,
        redis_prefix: args.redis_prefix,
        names: Names::default(),
        shards: args.shards,
        assign: args.shards.ids().collect(),
        worker_name: args.worker_name,
        max_deliveries: args.max_deliveries,
        exclusive,
        delivery_limit: (args.queue_type == QueueType::Quorum).then_some(args.delivery_limit),
        retry: RetryPolicy {
            base: Duration::from_millis(10),
            cap: Duration::from_millis(100),
            ..RetryPolicy::default()
        },
        ..Config::default()
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(shardline_worker::cancel_on_signal(shutdown.clone()));
    match shardline_worker::run(config, Arc::new(AbortOnPoison { http }), shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
