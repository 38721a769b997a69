//! Outage tests: the worker and the publisher against a broker whose connections
//! are closed or that is stopped and started, and a worker whose Redis dies.
//!
//! These tests close connections, stop the broker (`rabbitmqctl stop_app`) or kill
//! a Redis server, which disturbs every vhost on the shared broker. They are all
//! `#[ignore]`d so that `cargo test --workspace` (parallel, 4 threads) skips them;
//! `scripts/test` runs them afterwards, alone and one at a time:
//!
//! ```sh
//! cargo test --test outages -- --ignored --test-threads=1
//! ```
//!
//! Each test still gets its own vhost and Redis prefix (the fleet harness's
//! [`harness::TestEnv`]), and leaves the broker running: a guard restarts it
//! (`start_app`, `await_startup`) even when the test fails.
//!
//! - [`broker`]: the worker survives `close_connection` and a broker restart, on
//!   classic and on quorum shard queues.
//! - [`publisher`]: the publisher re-sends, in order, across the same outages.
//! - [`redis_outage`]: a Redis outage pauses the shards, logged once; they resume by themselves.
//! - [`support`]: finding connections, the broker-restart guard, a private Redis.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// The fleet tests' harness, shared (not copied); this target uses part of it.
#[allow(dead_code, unused_imports)]
#[path = "../fleet/harness/mod.rs"]
mod harness;

mod broker;
mod publisher;
mod redis_outage;
mod support;
