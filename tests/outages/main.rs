//! Outage tests: the worker and the publisher against a broker whose
//! connections are closed or that is stopped and started, and a worker whose
//! Redis dies or fails over.
//!
//! None of them touches the machine's RabbitMQ or Redis: the broker outages
//! hit a private RabbitMQ node that each test starts
//! ([`shardline_testkit::BrokerNode`]: own node name, ports, files and Erlang
//! cookie; stopped and removed when the test ends, also on failure), the Redis
//! outages a private `redis-server` (or a primary, a replica and three
//! Sentinels). They are still `#[ignore]`d so that the parallel suite skips
//! them: a node start costs seconds of CPU and their timing matters.
//! `scripts/test` runs them afterwards, one at a time:
//!
//! ```sh
//! cargo test --test outages -- --ignored --test-threads=1
//! ```
//!
//! The workers run in-process ([`shardline_testkit::Worker`]); what they did is
//! read from their progress, the broker and `/readyz` (the outbox test runs the
//! worker and the relay as child processes).
//!
//! - [`broker`]: the worker survives `close_connection` and a broker restart, on
//!   classic and on quorum shard queues.
//! - [`outbox`]: the outbox relay across a broker restart and a restart of a
//!   private PostgreSQL: nothing lost, each order's seqs in order.
//! - [`probe_policies`]: with `--management-url`, policies on the shard queues
//!   that would undercut the worker (a lower delivery limit, a TTL) refuse it.
//! - [`publisher`]: the publisher re-sends, in order, across the same outages.
//! - [`redis_outage`]: a Redis outage pauses the shards, counted once; they resume by themselves;
//!   at `--concurrency` too; and an elastic fleet moves no shard across it.
//! - [`redis_sentinel`]: Redis behind Sentinel: a killed primary and a manual
//!   failover pause the shards until the new primary answers; a connection a
//!   replica refused is never pooled again; `topology status` through Sentinels.
//! - [`sac_failover`]: classic-queue single-active-consumer failover on this
//!   3.10.8 (rabbitmq-server#5460): the bug report's cancel-then-close crashes the
//!   queue; the worker's graceful stop and a lost connection hand over.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod alarm;
mod broker;
mod outbox;
mod probe_policies;
mod publisher;
mod redis_outage;
mod redis_sentinel;
mod sac_failover;

use shardline_testkit::TestEnv;

/// Fails the test if the dead-letter queue holds anything: an outage is no
/// reason to give up on an event.
async fn assert_nothing_dead_lettered(env: &TestEnv) {
    let depths = env.queue_depths().await;
    let dlq = depths.get(&env.names.dead_letter_queue).map_or(0, |d| d.0);
    assert_eq!(dlq, 0, "events dead-lettered during the outage: {depths:?}");
}
