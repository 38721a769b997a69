//! Fleet tests: the worker, the publisher and the `shardline` commands against a
//! real RabbitMQ, Redis and PostgreSQL, on the test kit (`shardline-testkit`).
//!
//! Each test gets its own vhost, Redis prefix and PostgreSQL schema
//! ([`shardline_testkit::TestEnv`]), a recording downstream
//! ([`shardline_testkit::Downstream`]) and workers. Workers run in-process
//! ([`shardline_testkit::Worker`]: `shardline_worker::Worker` under a
//! cancellation token, observed through its progress) unless the test needs a
//! process ([`shardline_testkit::ChildWorker`]): kill -9 ([`crash`],
//! [`standby`]), SIGTERM ([`shutdown`], [`reconcile`]'s first stop is a plain
//! cancel), or the binary's own output ([`tls`]: its log never shows a
//! password; [`trace_otlp`]: `main`'s OTLP exporter; [`observability`]: the
//! error naming `--metrics-addr`). A `TestEnv` has classic shard queues unless
//! made with [`shardline_testkit::TestEnv::with_queue_type`]. Tests, in the order
//! of the pipeline:
//!
//! - [`cli`]: the command line as a newcomer meets it: plain-text logs in files, exit codes.
//! - [`topology`]: `topology apply` is idempotent, pika-compatible and loud on conflicts.
//! - [`reshard`]: resharding's parts on the real broker: a publisher acknowledges a new generation only after its confirms.
//! - [`broker_facts`]: what the guarantees rest on in the broker, per version: returns and nacks on quorum queues, the delivery limit, the arguments `apply` declares, prefetch, the largest message.
//! - [`ordering`]: per-order sequence and exactly-once delivery across shards.
//! - [`duplicates`]: redelivered copies never reach the downstream twice.
//! - [`failures`]: in-place retries, permanent failures and poison bodies dead-lettered.
//! - [`gate`]: the sequence gate: held events, gaps, late events, start grace, max held.
//! - [`hostile`]: a corpus of malformed bodies and odd headers: defined outcomes, no panic, no blocked shard.
//! - [`concurrency`]: `--concurrency K`: K calls in flight per shard, never two of one order.
//! - [`group_commit`]: `--group-commit N`: events claimed, committed and acked in groups, once and in order.
//! - [`breaker`]: a downstream outage pauses the fleet and dead-letters nothing; a poison event still does.
//! - [`attribution`]: each failure's fault decides what follows: hostile trace headers are dropped, a redirect or the same 401 for every order pauses the worker, a refusal only one order gets is dead-lettered.
//! - [`rate`]: `--max-rate R`: the worker's calls never outrun R per second plus the burst.
//! - [`crash`]: kill -9 mid-stream loses nothing and repeats at most the events in flight (K with `--concurrency K`).
//! - [`elastic`]: `--assign auto`: members join, stop and die; shards spread and move without loss.
//! - [`scale`]: one worker on 1,024 shards connects, consumes every one and processes events over all of them; a standby of all of them stays connected; a handshake the broker hangs up on is explained.
//! - [`standby`]: one consumer per shard; a standby takes over from a killed worker.
//! - [`shutdown`]: SIGTERM drains the in-flight event, acks it and exits 0.
//! - [`trace`]: the publisher's trace continues into the downstream call.
//! - [`trace_otlp`]: the binaries export their spans over OTLP/HTTP, flushed on exit.
//! - [`observability`]: `/metrics` backlog age behind a slow downstream, `/readyz`, `topology status`.
//! - [`stamps`]: a publisher's `x-published-at-ms` moves no backlog age forward and pages only as `publisher-claimed`.
//! - [`nack`]: a nacked event is sent again on a new connection, within `nack_retries`.
//! - [`dlq`]: `dlq list|show|replay|purge` on dead letters a worker made.
//! - [`replay_records`]: only a replay the operator tools recorded passes the gate; a publisher's own marker skips nothing.
//! - [`reconcile`]: order snapshots in PostgreSQL against the events the fleet processed: one compensation per missing event, pending ones left alone.
//! - [`reconcile_runs`]: `Reconciler::run_every` keeps each run's summary (ok or failed) in Redis, capped; a single run keeps none.
//! - [`dlq_index`]: the dead-letter index under load (reconcile every second while the index is read and another order replayed never compensates a dead letter) and after a Redis loss (`dlq reindex` after `FLUSHDB` rebuilds the same groups).
//! - [`quarantine`]: `--on-dead-letter quarantine` holds an order behind its dead letter until replayed or released.
//! - [`tls`]: `amqps://` and `rediss://` with a certificate from a private CA.
//! - [`ports`]: 300 idle or half-sent connections to the metrics port and to the console: probes still answer, events still flow, the server closes them; a file limit of 64 is refused at start, named.
//! - [`secrets`]: a canary password in every URL and connection string reaches no output (logs at trace, errors, help, DLQ, status, metrics, dead-letter headers).
//! - [`console`]: `shardline console` in-process: tokens, the session cookie, Host/Origin/CSRF checks, the JSON API, hostile text escaped.
//! - [`audit`]: the audit log in Redis: newest first, capped, one per key prefix, an unreadable entry read as such.
//!
//! Elsewhere: `tests/trace_inmemory.rs` (a global tracer provider, so its own
//! binary), `tests/crashloop.rs` (the test-only abort worker, `--features
//! test-support`), `tests/outages/` (a private RabbitMQ node and a private Redis).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod attribution;
mod audit;
mod breaker;
mod broker_facts;
mod cli;
mod concurrency;
mod console;
mod crash;
mod dlq;
mod dlq_index;
mod duplicates;
mod elastic;
mod failures;
mod gate;
mod group_commit;
mod hostile;
mod nack;
mod observability;
mod ordering;
mod outbox;
mod ports;
mod quarantine;
mod rate;
mod reconcile;
mod reconcile_outbox;
mod reconcile_runs;
mod replay_records;
mod replay_window;
mod reshard;
mod scale;
mod secrets;
mod shutdown;
mod stamps;
mod standby;
mod tls;
mod topology;
mod trace;
mod trace_otlp;
