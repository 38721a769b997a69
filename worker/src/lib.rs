//! shardline's shard consumers.
//!
//! One serial consumer per shard; each delivery goes
//! decode → dedup claim → handler (retried in place) → dedup commit → ack,
//! or, when it cannot succeed, → dead-letter (confirmed) → ack. Modules in flow order:
//!
//! - [`config`]: the worker's settings and the retry policy.
//! - [`supervisor`]: the broker connection, its reconnection, one task per shard.
//! - [`shard`]: one shard's consumer: exclusive consume or standby, drain on stop.
//! - [`lookahead`]: the next delivery taken early, to claim it with the last commit.
//! - [`gate`]: the sequence gate's held events, per order, with their deadlines.
//! - [`process`]: one delivery to an [`Outcome`], callable without a broker.
//! - [`dedup`]: the Redis state: claims, `done` marks, each order's last seq.
//! - [`quarantine`]: per-order quarantine behind a dead letter (`--on-dead-letter quarantine`).
//! - [`store`]: one Redis connection per shard; outages pause the shard.
//! - [`handler`]: the [`Handler`] trait, its errors and the built-in handlers.
//! - [`settle`]: the one place an outcome becomes ack or dead-letter-then-ack.
//! - [`stats`]: counters of what happened, for reports and metrics.
//! - [`metrics`]: Prometheus metric names, per-shard handles and live shard state.
//! - [`status`]: backlog levels and the shard status each worker writes to Redis.
//! - [`progress`]: what a running worker did, for the code that embeds it.
//! - [`http`]: `/metrics`, `/healthz` and `/readyz` on `--metrics-addr`.

pub mod config;
pub mod dedup;
pub mod gate;
pub mod handler;
pub mod http;
pub mod lookahead;
pub mod metrics;
pub mod process;
pub mod progress;
pub mod quarantine;
pub mod settle;
pub mod shard;
pub mod stats;
pub mod status;
pub mod store;
pub mod supervisor;

pub use config::{Config, OnDeadLetter, OnGap, RetryPolicy};
pub use handler::{Event, Handler, HandlerError};
pub use metrics::ShardState;
pub use process::Outcome;
pub use progress::{Counts, Progress};
pub use stats::Stats;
pub use supervisor::{Worker, WorkerError, run};
