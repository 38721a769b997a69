//! shardline's shard consumers, as a library.
//!
//! One serial consumer per shard; each delivery goes
//! decode → sequence gate → dedup claim → handler (retried in place) → dedup
//! commit → ack, or, when it cannot succeed, → dead letter (confirmed) → ack.
//!
//! Embedding it takes a [`Config`], a [`Handler`] and a stop token:
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! # async fn example() -> Result<(), shardline_worker::WorkerError> {
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! tokio::spawn(shardline_worker::cancel_on_signal(shutdown.clone()));
//! let config = shardline_worker::Config {
//!     worker_name: "billing-1".into(),
//!     ..shardline_worker::Config::default()
//! };
//! shardline_worker::run(config, Arc::new(shardline_worker::Log), shutdown).await
//! # }
//! ```
//!
//! [`Worker::new`] then [`Worker::progress`] gives a [`Progress`] to watch a
//! running worker. Modules, in the order a delivery meets them:
//!
//! - `config`: the settings, their defaults and their one validation.
//! - `supervisor`: the two broker connections (deliveries and acks; dead
//!   letters), their one reconnect loop, one task per shard.
//! - `membership`: `--assign auto` ([`Config::fleet`]): the member's lease
//!   and one rebalance step per heartbeat; which shards its consumers take.
//! - `shard`: one shard's consumer: exclusive consume or standby, drain and
//!   close (no `basic.cancel`) on stop.
//! - `lookahead`: the next delivery taken early, to claim it with the last commit.
//! - `schedule`: with `--concurrency` > 1, which event starts next: never two
//!   of one order, redelivered events alone, a bound on waiting events.
//! - `gate`: the sequence gate's held events, per order, with their deadlines.
//! - `control`: control messages (`x-shardline-control`), recognised before
//!   decoding and never processed as events.
//! - `process`: one delivery to an outcome: decode, admit, call the handler.
//! - `retry`: an event's budget of counted failures and the delay before its
//!   next attempt; the dead letter once it is spent.
//! - `dedup`: the Redis state: claims, `done` marks, each order's last seq.
//! - `quarantine`: per-order quarantine behind a dead letter ([`OnDeadLetter::Quarantine`]).
//! - `breaker`: the worker-wide downstream breaker ([`Config::breaker`]):
//!   an outage, or a downstream misconfigured for every event, pauses every
//!   shard instead of filling the DLQ.
//! - `rate`: the worker-wide call rate limit ([`Config::max_rate`]), a token bucket.
//! - `store`: one Redis connection per shard; outages pause the shard.
//! - [`handler`]: the [`Handler`] trait, its errors with their [`Fault`] (whose
//!   fault a failure is decides what follows), and the built-in handlers; the
//!   HTTP one attributes every answer and transport error.
//! - `settle`: the one place an outcome becomes ack, or dead letter then ack.
//! - `live`: each shard's live state (in flight, held, consuming or not).
//! - [`metrics`]: the one set of counters, and the metric names.
//! - `status`: the shard and worker status documents written to Redis.
//! - [`Progress`]: what a running worker did, for the code that embeds it.
//! - [`http`]: `/metrics`, `/healthz` and `/readyz` on [`Config::metrics_addr`].
//! - `signal`: SIGTERM and Ctrl-C to a stop token ([`cancel_on_signal`]).
//! - `error`: [`WorkerError`].

// No function over 100 lines (clippy.toml's threshold): `scripts/test` runs
// clippy with warnings as errors.
#![warn(clippy::too_many_lines)]

mod breaker;
mod config;
mod control;
mod dedup;
mod era;
mod error;
mod gate;
mod group;
pub mod handler;
pub mod http;
mod live;
mod lookahead;
mod membership;
pub mod metrics;
mod process;
mod progress;
mod quarantine;
mod rate;
mod retry;
mod schedule;
mod settle;
mod shard;
mod signal;
mod status;
mod store;
mod supervisor;

pub use config::{
    BreakerPolicy, Config, ConfigError, FleetPolicy, OnDeadLetter, OnGap, Problem, RetryPolicy,
};
pub use error::{BindError, WorkerError};
pub use handler::{
    Event, Fault, Handler, HandlerError, HandlerSpecError, Http, Log, Noop, from_spec,
};
pub use live::ShardState;
pub use metrics::Counts;
pub use progress::Progress;
pub use shardline_topology::status::Thresholds;
pub use signal::cancel_on_signal;
pub use supervisor::{Worker, run};
