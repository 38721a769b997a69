//! Fleet tests: the `shardline` binary against a real RabbitMQ and Redis.
//!
//! Each test gets its own vhost and Redis prefix ([`harness::TestEnv`]), a
//! recording downstream ([`harness::Downstream`]) and worker processes
//! ([`harness::Worker`]). Tests, in the order of the pipeline:
//!
//! - [`topology`]: `topology apply` is idempotent, pika-compatible and loud on conflicts.
//! - [`ordering`]: per-order sequence and exactly-once delivery across shards.
//! - [`duplicates`]: redelivered copies never reach the downstream twice.
//! - [`failures`]: in-place retries, permanent failures and poison bodies dead-lettered.
//! - [`crash`]: kill -9 mid-stream loses nothing and repeats at most the in-flight event.
//! - [`standby`]: one consumer per shard; a standby takes over from a killed worker.
//! - [`shutdown`]: SIGTERM drains the in-flight event, acks it and exits 0.
//! - [`trace`]: the publisher's trace continues into the downstream call.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod harness;

mod crash;
mod duplicates;
mod failures;
mod ordering;
mod shutdown;
mod standby;
mod topology;
mod trace;
