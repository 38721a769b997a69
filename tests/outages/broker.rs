//! The worker across broker outages: its connection force-closed, and the
//! broker application stopped and started, each mid-stream. SPEC §3 "Outages":
//! abort the in-flight handler call, reconnect with backoff, resubscribe,
//! nothing lost.

use std::time::Duration;

use crate::harness::{
    Downstream, PROCESSING, Publisher, QueueType, Reply, SHARDS, TestEnv, Worker, all_ok,
    assert_in_order_and_complete, describe, interleaved, ok_keys, orders_covering_shards,
    repeats_per_shard,
};
use crate::support::{
    BROKER_RESTART, StoppedBroker, assert_nothing_dead_lettered, close_connection, one_connection,
    wait_until,
};

#[derive(Debug, Clone, Copy)]
enum Outage {
    /// `rabbitmqctl close_connection` on the worker's connection.
    CloseConnection,
    /// `rabbitmqctl stop_app`, then `start_app`.
    BrokerRestart,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "disturbs the shared broker: scripts/test runs it alone"]
async fn worker_survives_its_connection_being_closed() {
    worker_survives("close-worker", Outage::CloseConnection, QueueType::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "disturbs the shared broker: scripts/test runs it alone"]
async fn worker_survives_its_connection_being_closed_on_quorum_queues() {
    worker_survives("close-worker", Outage::CloseConnection, QueueType::Quorum).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "disturbs the shared broker: scripts/test runs it alone"]
async fn worker_survives_a_broker_restart() {
    worker_survives("restart-worker", Outage::BrokerRestart, QueueType::Classic).await;
}

/// Quorum queues come back through their Raft log after `start_app`; the
/// worker resubscribes and the single-active-consumer makes it active again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "disturbs the shared broker: scripts/test runs it alone"]
async fn worker_survives_a_broker_restart_on_quorum_queues() {
    worker_survives("restart-worker", Outage::BrokerRestart, QueueType::Quorum).await;
}

/// 1000 events (200 orders × 5, 125 per shard) at 25 ms per handler call, so
/// each shard is busy for seconds; the outage hits after a quarter of them.
/// Afterwards: every event reached the downstream, per order in seq order, and
/// each shard repeated at most its one in-flight event.
async fn worker_survives(name: &str, outage: Outage, queue_type: QueueType) {
    let env = TestEnv::with_queue_type(name, queue_type).await;
    env.apply_topology().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(25))).await;
    let events = interleaved(&orders_covering_shards(name, 25, &env), 5, env.shards);

    let mut worker = Worker::start(&env, "outage", &downstream.url(), &[]);
    {
        let conn = env.connect().await;
        worker.wait_consuming(&env, &conn).await;
    }
    let conn_name = "shardline worker outage shards ";
    let before = one_connection(&env.vhost, conn_name).await;
    Publisher::connect(&env).await.publish(&events).await;

    let quarter = events.len() / 4;
    downstream
        .wait_for("a quarter of the events", PROCESSING, |calls| {
            ok_keys(calls).len() >= quarter
        })
        .await;
    let stopped = match outage {
        Outage::CloseConnection => {
            close_connection(&before).await;
            None
        }
        Outage::BrokerRestart => Some(StoppedBroker::stop().await),
    };
    let at_outage = downstream.calls();
    assert!(
        ok_keys(&at_outage).len() < events.len(),
        "the stream ended before the outage: the test proves nothing\n{}",
        describe(&at_outage)
    );
    if let Some(stopped) = stopped {
        stopped.start().await;
    }

    // The worker reconnects and resubscribes by itself.
    wait_until(
        "the worker to reconnect",
        BROKER_RESTART,
        || worker.log_text().contains("reconnected to the broker"),
        || worker.log_tail(40),
    )
    .await;
    downstream
        .wait_for("every event after the outage", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    assert_nothing_dead_lettered(&env).await;
    {
        let conn = env.connect().await;
        worker.wait_consuming(&env, &conn).await;
    }
    let after = one_connection(&env.vhost, conn_name).await;
    assert_ne!(after, before, "the worker should be on a new connection");
    let active = worker.logged_shard_counts(env.taken_log_line());
    assert!(
        (0..SHARDS).all(|s| active.get(&s).is_some_and(|n| *n >= 2)),
        "every shard should have been taken again after the outage: {active:?}\n{}",
        worker.log_tail(40)
    );

    let calls = downstream.calls();
    assert_in_order_and_complete(&calls, &events);
    let repeats = repeats_per_shard(&calls, &env);
    assert!(
        repeats.values().all(|n| *n <= 1),
        "more than the in-flight event repeated on a shard ({outage:?}, {queue_type:?}): \
         {repeats:?}\n{}",
        describe(&calls)
    );
    eprintln!(
        "{outage:?} ({queue_type:?}): {} events, {} calls, {} at the outage, repeats per \
         shard {repeats:?}",
        events.len(),
        calls.len(),
        at_outage.len()
    );
}
