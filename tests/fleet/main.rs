//! Fleet tests: the `shardline` binary against a real RabbitMQ and Redis.
//!
//! Each test gets its own vhost and Redis prefix ([`harness::TestEnv`]), a
//! recording downstream ([`harness::Downstream`]) and worker processes
//! ([`harness::Worker`]). A `TestEnv` has classic shard queues unless made with
//! [`harness::TestEnv::with_queue_type`]: then every `shardline` process it starts gets
//! `SHARDLINE_QUEUE_TYPE=quorum`. The ordering, crash, crash-loop and standby
//! tests run on both (`…_on_quorum_queues`). Tests, in the order of the pipeline:
//!
//! - [`topology`]: `topology apply` is idempotent, pika-compatible and loud on conflicts.
//! - [`ordering`]: per-order sequence and exactly-once delivery across shards.
//! - [`duplicates`]: redelivered copies never reach the downstream twice.
//! - [`failures`]: in-place retries, permanent failures and poison bodies dead-lettered.
//! - [`gate`]: the sequence gate: held events, gaps, late events, start grace, max held.
//! - [`hostile`]: a corpus of malformed bodies and odd headers: defined outcomes, no panic, no blocked shard.
//! - [`crash`]: kill -9 mid-stream loses nothing and repeats at most the in-flight event.
//! - [`crashloop`]: an event that aborts the worker is dead-lettered `crash-loop` after `--max-deliveries`.
//! - [`standby`]: one consumer per shard; a standby takes over from a killed worker.
//! - [`shutdown`]: SIGTERM drains the in-flight event, acks it and exits 0.
//! - [`trace`]: the publisher's trace continues into the downstream call.
//! - [`trace_inmemory`]: publish → process → downstream call in one trace, seen by an in-memory exporter.
//! - [`trace_otlp`]: the binaries export their spans over OTLP/HTTP, flushed on exit.
//! - [`observability`]: `/metrics` backlog age behind a slow downstream, `/readyz`, `topology status`.
//! - [`dlq`]: `dlq list|show|replay|purge` on dead letters a worker made.
//! - [`reconcile`]: order snapshots in PostgreSQL against the events the fleet processed: one compensation per missing event, pending ones left alone.
//! - [`quarantine`]: `--on-dead-letter quarantine` holds an order behind its dead letter until replayed or released.
//! - [`tls`]: `amqps://` and `rediss://` with a certificate from a private CA.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod harness;

mod crash;
mod crashloop;
mod dlq;
mod duplicates;
mod failures;
mod gate;
mod hostile;
mod observability;
mod ordering;
mod quarantine;
mod reconcile;
mod shutdown;
mod standby;
mod tls;
mod topology;
mod trace;
mod trace_inmemory;
mod trace_otlp;
