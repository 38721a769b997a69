//! Embedding the worker with a custom Rust [`Handler`]: every event is written
//! into a PostgreSQL table, idempotently by its dedup key, so that a repeated
//! delivery (a crash mid-handler, a replay) changes nothing.
//!
//! The worker guarantees the order of each order's events and claims each
//! event in Redis; the `ON CONFLICT (dedup_key) DO NOTHING` makes the
//! downstream side idempotent too, which is what makes "exactly once in
//! effect" hold across a crash between the insert and the ack.
//!
//! Run it against local services (RabbitMQ, Redis, PostgreSQL):
//!
//! ```text
//! shardline topology apply
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run --example postgres_handler
//! shardline publish --order-id A1024 --event payment.captured --seq 1
//! psql postgres://postgres@127.0.0.1:5432/test -c 'select * from shardline_events'
//! ```
//!
//! `SHARDLINE_AMQP_URL`, `SHARDLINE_REDIS_URL` and `SHARDLINE_SHARDS` are read
//! as `shardline worker` reads them; everything else is the library's default
//! [`Config`]. Ctrl-C or SIGTERM drains and stops (a second one exits at once).

use std::sync::Arc;

use async_trait::async_trait;
use shardline_contract::ShardCount;
use shardline_worker::{Config, Event, Handler, HandlerError};
use tokio_postgres::error::SqlState;
use tokio_util::sync::CancellationToken;

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS shardline_events (
    dedup_key   text PRIMARY KEY,
    order_id    text NOT NULL,
    event       text NOT NULL,
    seq         bigint,
    shard       integer NOT NULL,
    body        jsonb NOT NULL,
    inserted_at timestamptz NOT NULL DEFAULT now()
)";

const INSERT: &str = "INSERT INTO shardline_events (dedup_key, order_id, event, seq, shard, body)
    VALUES ($1, $2, $3, $4, $5, ($6::text)::jsonb)
    ON CONFLICT (dedup_key) DO NOTHING";

/// Writes each event as one row keyed by its dedup key.
struct PostgresHandler {
    /// One connection for every shard: tokio-postgres pipelines concurrent
    /// queries on it. (A production handler would use a pool that reconnects;
    /// here a lost connection fails every attempt as retryable.)
    client: tokio_postgres::Client,
}

#[async_trait]
impl Handler for PostgresHandler {
    async fn handle(&self, event: &Event<'_>) -> Result<(), HandlerError> {
        let body = std::str::from_utf8(event.body)
            .map_err(|e| HandlerError::permanent(format!("body is not UTF-8: {e}")))?;
        let seq = event.envelope.seq.and_then(|seq| i64::try_from(seq).ok());
        let shard = i32::from(event.shard.get());
        self.client
            .execute(
                INSERT,
                &[
                    &event.dedup_key,
                    &event.envelope.order_id.as_str(),
                    &event.envelope.event,
                    &seq,
                    &shard,
                    &body,
                ],
            )
            .await
            .map_err(classify)?;
        Ok(())
    }
}

/// Data and constraint errors will fail again however often they are tried:
/// dead-letter the event. Anything else (connection lost, server restarting,
/// serialization failure) may pass next time.
fn classify(e: tokio_postgres::Error) -> HandlerError {
    let permanent = e.code().is_some_and(|code| {
        let class = &code.code()[..2];
        // 22: data exception, 23: integrity constraint violation.
        (class == "22" || class == "23") && *code != SqlState::T_R_SERIALIZATION_FAILURE
    });
    if permanent {
        HandlerError::permanent(format!("PostgreSQL refused the event: {e}"))
    } else {
        HandlerError::retryable(format!("PostgreSQL: {e}"))
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,lapin=off".into()),
        )
        .init();

    let database = env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let (client, connection) = tokio_postgres::connect(&database, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::error!(error = %e, "PostgreSQL connection ended");
        }
    });
    client.batch_execute(SCHEMA).await?;

    let shards: ShardCount = env_or("SHARDLINE_SHARDS", "16")
        .parse()
        .map_err(|e| anyhow::anyhow!("SHARDLINE_SHARDS: {e}"))?;
    let config = Config {
        amqp: env_or(
            "SHARDLINE_AMQP_URL",
            "amqp://guest:guest@127.0.0.1:5672/%2f",
        )
        .parse()?,
        redis: env_or("SHARDLINE_REDIS_URL", "redis://127.0.0.1:6379").parse()?,
        shards,
        assign: shards.ids().collect(),
        worker_name: format!("postgres-example-{}", std::process::id()),
        ..Config::default()
    };

    let shutdown = CancellationToken::new();
    tokio::spawn(shardline_worker::cancel_on_signal(shutdown.clone()));
    shardline_worker::run(config, Arc::new(PostgresHandler { client }), shutdown).await?;
    Ok(())
}
