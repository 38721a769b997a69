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
//! running worker.
//!
//! A delivery passes three stages, each a module that calls forward only
//! (`scripts/test` fails on a module import cycle):
//!
//! 1. `intake`: deliveries to events ready for an attempt — decode (control
//!    messages first, `intake::control`, never processed as events), the
//!    sequence gate (`intake::gate`), the read-ahead whose claim rides with
//!    the last commit (`intake::lookahead`), group commit (`intake::group`),
//!    and with `--concurrency` which event starts next (`intake::schedule`).
//! 2. `attempt`: one attempt at an event — admit (dedup, gate, claim), the
//!    breaker's admission, the rate token, the handler call under its
//!    timeout, and whose fault a failure is ([`Fault`]).
//! 3. `settle`: the outcome to the broker — commit, ack (`settle::acks`, the
//!    one door for acks), retry in place (`settle::retry`), dead letter
//!    (`settle::dead_letter`). It reaches the deliveries behind the current
//!    one only through `settle::Upcoming`, which intake's read-ahead
//!    implements.
//!
//! What the stages share:
//!
//! - `delivery`: a delivery's types as they flow (message, decoded event,
//!   directive, outcome); `trace`: its consumer span.
//! - `context`: one shard's context (processor, its order state's layout, names, metrics).
//! - `dedup`: the order state in Redis (claims, `done` marks, each order's
//!   last seq, fencing), one Lua script per step.
//! - `quarantine`: per-order quarantine behind a dead letter ([`OnDeadLetter::Quarantine`]).
//! - `breaker`: the worker-wide downstream breaker ([`Config::breaker`]): an
//!   outage, or a downstream misconfigured for every event, pauses every
//!   shard instead of filling the DLQ.
//! - `rate`: the worker-wide call rate limit ([`Config::max_rate`]), a token bucket.
//! - `store`: the worker's shards on a few shared Redis connections (at most
//!   16); outages pause the shards.
//! - [`handler`]: the [`Handler`] trait, its errors with their [`Fault`], and
//!   the built-in handlers; the HTTP one attributes every answer and
//!   transport error.
//!
//! Around them:
//!
//! - `config`: the settings, their defaults and their one validation.
//! - `supervisor`: the two broker connections (deliveries and acks; dead
//!   letters), their one reconnect loop, one task per shard; `depth`: the
//!   pace of its queue-depth poll.
//! - `limits`: what the broker and the process allow so many shards, checked
//!   at start: the channel ceiling (2,047 shards per worker) and file
//!   descriptors (`RLIMIT_NOFILE`, its soft limit raised to the hard one).
//! - `membership`: `--assign auto` ([`Config::fleet`]): the member's lease
//!   and one rebalance step per heartbeat; which shards its consumers take.
//! - `shard`: one shard's consumer, the loop that drives the stages:
//!   exclusive consume or standby, drain and close (no `basic.cancel`) on stop.
//! - `live`: each shard's live state (in flight, held, consuming or not).
//! - [`metrics`]: the one set of counters, and the metric names.
//! - `status`: the shard and worker status documents written to Redis.
//! - [`Progress`]: what a running worker did, for the code that embeds it.
//! - [`http`]: `/metrics`, `/healthz` and `/readyz` on [`Config::metrics_addr`].
//! - `signal`: SIGTERM and Ctrl-C to a stop token ([`cancel_on_signal`]).
//! - `error`: [`WorkerError`].

// The shard task spawned by the supervisor nests deep futures (consume, group,
// settle, Redis and HTTP I/O); proving it `Send` takes more than the default 128
// steps of trait recursion.
#![recursion_limit = "256"]
// No function over 100 lines (clippy.toml's threshold): `scripts/test` runs
// clippy with warnings as errors.
#![warn(clippy::too_many_lines)]

// The stages a delivery passes, in flow order; each calls forward only.
mod attempt;
mod intake;
mod settle;

// What the stages share: the delivery's types and span, the shard's context,
// the order state and the worker-wide breaker and rate limit.
mod breaker;
mod config;
mod context;
mod dedup;
mod delivery;
mod depth;
mod era;
mod error;
pub mod handler;
pub mod http;
mod limits;
mod live;
mod membership;
pub mod metrics;
mod progress;
mod quarantine;
mod rate;
mod reshard;
mod shard;
mod signal;
mod status;
mod store;
mod supervisor;
mod trace;

#[cfg(test)]
mod testing;

pub use config::{
    BreakerPolicy, Config, ConfigError, FleetPolicy, GroupCommit, Grouping, OnDeadLetter, OnGap,
    Problem, RetryPolicy,
};
pub use error::{BindError, WorkerError};
pub use handler::{
    Event, Fault, Handler, HandlerError, HandlerSpecError, Http, Log, Noop, from_spec,
};
pub use limits::{FileNeed, LimitError};
pub use live::ShardState;
pub use metrics::Counts;
pub use progress::Progress;
pub use shardline_connect::inbound::Inbound;
pub use shardline_contract::status::Thresholds;
pub use signal::cancel_on_signal;
pub use supervisor::{Worker, run};
