//! shardline's test kit: the one harness of the integration tests (dev-only).
//!
//! A test builds an isolated [`TestEnv`] (its own vhost, Redis prefix and
//! PostgreSQL schema, all removed on drop), a recording [`Downstream`], and
//! workers, then publishes with [`Publisher`] and checks what the downstream,
//! the broker and Redis saw. Modules in the order a test uses them:
//!
//! - [`wait`]: [`wait_until`], the one polling loop: a deadline, and a loud
//!   failure that says what was awaited and what was seen last.
//! - [`broker`]: `rabbitmqctl` against the machine's node or a private
//!   [`BrokerNode`] (own name, ports, files and Erlang cookie) that a test may
//!   stop and start.
//! - [`cluster`]: a private three-node [`Cluster`] (`scripts/cluster`) whose
//!   nodes a test may kill -9, pause and restart.
//! - [`env`](mod@env): [`TestEnv`], one per test.
//! - [`downstream`]: the HTTP service the worker calls, recording and scripted.
//! - [`worker`]: [`Worker`], an in-process `shardline_worker::Worker` run under a
//!   cancellation token: the default for every test.
//! - [`child`]: [`ChildWorker`], a worker *process*, only for what needs one:
//!   kill -9, SIGTERM, a handler that aborts the process, the CLI's own output.
//! - [`publish`]: raw, confirmed publishing of envelopes and malformed bodies.
//! - [`dlq`]: waiting for dead letters, taking them off, `dlq` CLI helpers.
//! - [`checks`]: assertions on what the downstream saw (order, exactly once, shape).
//! - [`metrics`]: `GET` on a worker's `/metrics`, `/readyz`, `/healthz`.
//! - [`pg`]: the test's PostgreSQL schema with an `orders` table, for `reconcile`,
//!   or a bare schema name a test creates itself ([`ScratchSchema`]).
//! - [`pg_private`]: a private PostgreSQL 15 server ([`PrivatePostgres`]) that a
//!   test may stop, restart or configure.
//! - [`redis`]: a private `redis-server` (plain or TLS) that a test may kill.
//! - [`sentinel`]: a private primary, replica and three Sentinels, for failovers.
//! - [`tls`]: a throwaway CA, a TLS terminator in front of a broker, a broker user.
//! - [`process`]: a helper child process with its log, killed on drop.
//! - [`paths`]: where binaries and scratch files are.
//!
//! Binaries: the kit finds `target/<profile>/<name>` next to the running test
//! executable ([`paths::cargo_bin`], as `assert_cmd` does); cargo builds the
//! root package's binaries before its integration tests, so `shardline` is
//! always there. A test that needs a binary behind a feature passes
//! `env!("CARGO_BIN_EXE_…")` to [`ChildWorker::spawn`] itself.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::missing_panics_doc)]

pub mod broker;
pub mod checks;
pub mod child;
pub mod cluster;
pub mod console;
pub mod dlq;
pub mod downstream;
pub mod env;
pub mod load;
pub mod metrics;
pub mod paths;
pub mod pg;
pub mod pg_private;
pub mod process;
pub mod publish;
pub mod redis;
pub mod sentinel;
pub mod tls;
pub mod wait;
pub mod worker;

use std::time::Duration;

pub use broker::BrokerNode;
pub use checks::{
    all_ok, assert_all_answered_once_in_order, assert_all_delivered_once_in_order,
    assert_exactly_once, assert_in_order_and_complete, assert_in_order_in_effect,
    assert_orders_never_overlap, assert_request_shape, max_in_flight_per_shard, ok_keys,
    orders_covering_shards, repeats_per_shard, wait_all_answered,
};
pub use child::ChildWorker;
pub use cluster::Cluster;
pub use downstream::{Call, Downstream, Reply, describe};
pub use env::{SHARDS, TestEnv};
pub use pg::{OrdersDb, ScratchSchema};
pub use pg_private::PrivatePostgres;
pub use publish::{Event, Publisher, interleaved, order_ids};
pub use shardline_contract::QueueType;
pub use wait::wait_until;
pub use worker::Worker;

/// Bound on start-up waits (a worker owning its shards, a standby standing by,
/// a helper server answering).
pub const STARTUP: Duration = Duration::from_secs(30);
/// Bound on a test's whole stream being processed (2 cores, several tests at once).
pub const PROCESSING: Duration = Duration::from_secs(120);
