//! The worker across broker outages: its connection force-closed, and the
//! broker application stopped and started, each mid-stream. docs/semantics.md §3 "Outages":
//! abort the in-flight handler call, reconnect with backoff, resubscribe,
//! nothing lost.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use shardline_testkit::broker::NODE_START;
use shardline_testkit::wait::check;
use shardline_testkit::{
    BrokerNode, Downstream, PROCESSING, Publisher, QueueType, Reply, SHARDS, TestEnv, all_ok,
    assert_in_order_and_complete, describe, interleaved, ok_keys, orders_covering_shards,
    repeats_per_shard, wait_until,
};

use crate::assert_nothing_dead_lettered;

#[derive(Debug, Clone, Copy)]
enum Outage {
    /// `rabbitmqctl close_connection` on the worker's connection.
    CloseConnection,
    /// `rabbitmqctl stop_app`, then `start_app`, of the test's private node.
    BrokerRestart,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn worker_survives_its_connection_being_closed() {
    worker_survives("close-worker", Outage::CloseConnection, QueueType::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn worker_survives_its_connection_being_closed_on_quorum_queues() {
    worker_survives("close-worker", Outage::CloseConnection, QueueType::Quorum).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn worker_survives_a_broker_restart() {
    worker_survives("restart-worker", Outage::BrokerRestart, QueueType::Classic).await;
}

/// Quorum queues come back through their Raft log after `start_app`; the
/// worker resubscribes and the single-active-consumer makes it active again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn worker_survives_a_broker_restart_on_quorum_queues() {
    worker_survives("restart-worker", Outage::BrokerRestart, QueueType::Quorum).await;
}

/// 1000 events (200 orders × 5, 125 per shard) at 25 ms per handler call, so
/// each shard is busy for seconds; the outage hits after a quarter of them.
/// Afterwards: every event reached the downstream, per order in seq order, and
/// each shard repeated at most its one in-flight event.
async fn worker_survives(name: &str, outage: Outage, queue_type: QueueType) {
    let node = BrokerNode::start().await;
    let env = TestEnv::on_node(name, queue_type, &node).await;
    env.apply_topology().await;
    // While the outage command runs (rabbitmqctl takes seconds on a busy
    // machine), calls slow down, so that the stream is still flowing when
    // the outage lands instead of having ended.
    let slow = Arc::new(AtomicBool::new(false));
    let downstream = {
        let slow = Arc::clone(&slow);
        Downstream::scripted(move |_, _| {
            let delay = if slow.load(Ordering::SeqCst) { 400 } else { 25 };
            Reply::ok().after(Duration::from_millis(delay))
        })
        .await
    };
    let events = interleaved(&orders_covering_shards(name, 25, &env), 5, env.shards);

    let mut worker = env.start_worker("outage", &downstream, |_| {}).await;
    let conn_name = "shardline worker outage shards ";
    let before = env.broker().one_connection(&env.vhost, conn_name).await;
    Publisher::connect(&env).await.publish(&events).await;

    let quarter = events.len() / 4;
    downstream
        .wait_for("a quarter of the events", PROCESSING, |calls| {
            ok_keys(calls).len() >= quarter
        })
        .await;
    slow.store(true, Ordering::SeqCst);
    match outage {
        Outage::CloseConnection => env.broker().close_connection(&before).await,
        Outage::BrokerRestart => node.stop_app().await,
    }
    let at_outage = downstream.calls();
    slow.store(false, Ordering::SeqCst);
    assert!(
        ok_keys(&at_outage).len() < events.len(),
        "the stream ended before the outage: the test proves nothing\n{}",
        describe(&at_outage)
    );
    if let Outage::BrokerRestart = outage {
        node.start_app().await;
    }

    // The worker reconnects and resubscribes by itself.
    wait_until("the worker to reconnect", NODE_START, || async {
        check(worker.counts().broker_reconnects >= 1, || worker.describe())
    })
    .await;
    downstream
        .wait_for("every event after the outage", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    assert_nothing_dead_lettered(&env).await;
    worker.wait_consuming(&env).await;
    let after = env.broker().one_connection(&env.vhost, conn_name).await;
    assert_ne!(after, before, "the worker should be on a new connection");
    // Every shard was taken again after the outage: its consumer is on a
    // channel of the new connection.
    let channels = channel_connections(&env).await;
    let consumers = env.shard_consumers().await;
    for shard in 0..SHARDS {
        let tag = format!("outage/shard-{shard}");
        let rows = consumers
            .get(&env.shard_queue(shard))
            .map(Vec::as_slice)
            .unwrap_or_default();
        let on: Vec<Option<&String>> = rows
            .iter()
            .filter(|r| r.tag == tag)
            .map(|r| channels.get(&r.channel))
            .collect();
        assert_eq!(
            on,
            [Some(&after)],
            "shard {shard} should have been taken again on the new connection {after}: \
             {consumers:?}; channels {channels:?}; {}",
            worker.describe()
        );
    }
    worker.assert_running().await;

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

/// Each channel of the broker (Erlang pid) with its connection's pid.
async fn channel_connections(env: &TestEnv) -> BTreeMap<String, String> {
    let text = env
        .broker()
        .run(&[
            "-q",
            "list_channels",
            "--no-table-headers",
            "pid",
            "connection",
        ])
        .await;
    text.lines()
        .filter_map(|line| {
            let (channel, connection) = line.split_once('\t')?;
            Some((channel.trim().to_owned(), connection.trim().to_owned()))
        })
        .collect()
}
