//! A rolling restart under load, as an operator upgrades a cluster: each node
//! in turn is stopped (`rabbitmqctl stop_app`: its clients' connections are
//! closed, its queue members stop) and started again, and the next one waits
//! until no node is quorum-critical (`rabbitmq-queues
//! check_if_node_is_quorum_critical` passes on every node: every quorum queue
//! has its restarted member back in sync). The worker and the publisher start
//! on node 1, in the address order 1, 2, 3, so they move twice (to node 2,
//! then back to node 1). The same guarantees as a killed node.

use std::time::{Duration, Instant};

use shardline_testkit::cluster::{CLUSTER_START, NODES};
use shardline_testkit::wait::check;
use shardline_testkit::{Downstream, Reply, orders_covering_shards, wait_until};

use crate::load::{
    LOAD_CONNECTION, Load, ORDERS_PER_SHARD, RESUME_BOUND, answered, assert_guarantees, pinned,
    quorum_cluster, wait_connected_to, wait_processing,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a three-node RabbitMQ cluster: scripts/test runs it alone"]
async fn a_rolling_restart_under_load_loses_nothing() {
    let (cluster, env) = quorum_cluster("cluster-rolling").await;
    let target = pinned(&cluster, &env, 0, "");
    let downstream = Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(5))).await;
    let worker = env
        .start_worker("w1", &downstream, |c| c.amqp = target.clone())
        .await;
    let orders = orders_covering_shards("rolling", ORDERS_PER_SHARD, &env);
    let mut load = Load::start(&env, target, orders).await;
    wait_connected_to(
        &cluster,
        &env,
        0,
        &["shardline worker w1 ", LOAD_CONNECTION],
    )
    .await;
    wait_processing(&downstream, "the load to be processed", 480).await;

    let mut steps = Vec::new();
    for i in 0..NODES {
        let stopping = Instant::now();
        cluster.ctl(i).run(&["stop_app"]).await;
        let stopped = stopping.elapsed();
        // While it is down, publishing and processing go on.
        let stalled = load.wait_resumed(stopping).await;
        let at = answered(&downstream.calls());
        wait_processing(&downstream, "processing with a node stopped", at).await;
        let starting = Instant::now();
        cluster.ctl(i).run(&["start_app"]).await;
        let started = starting.elapsed();
        let mut all = cluster.names.to_vec();
        all.sort();
        wait_until(
            &format!("{} to run in the cluster again", cluster.names[i]),
            CLUSTER_START,
            || async {
                let running = cluster.running_nodes((i + 1) % NODES).await;
                check(running == all, || format!("running {running:?}"))
            },
        )
        .await;
        let syncing = Instant::now();
        wait_until("no node quorum-critical", CLUSTER_START, || async {
            for node in 0..NODES {
                cluster.check_not_quorum_critical(node).await?;
            }
            Ok(())
        })
        .await;
        let synced = syncing.elapsed();
        assert!(
            stalled < RESUME_BOUND,
            "publishing stalled for {stalled:?} after stop_app of {}",
            cluster.names[i]
        );
        steps.push(format!(
            "{}: stop_app {stopped:?}, publishing stalled {stalled:?}, start_app {started:?}, \
             quorum-critical for {synced:?} more",
            cluster.names[i]
        ));
    }
    let after = load.batches();
    load.wait_batches("publishing after the rolling restart", after + 20)
        .await;
    let published = load.stop().await;
    let events = published.events;
    // The worker lost its connection at each stop of the node it was on.
    let moves = worker.counts().broker_reconnects;
    assert_eq!(
        moves,
        2,
        "the worker should have moved twice: {}",
        worker.describe()
    );
    let calls = assert_guarantees(&env, &downstream, &events, &[&worker], moves).await;
    let repeats: usize = shardline_testkit::repeats_per_shard(&calls, &env)
        .values()
        .sum();
    eprintln!(
        "rolling restart: {}; {} events, {} calls ({repeats} repeated), publisher {:?} ({} \
         batches nacked and sent again), worker {:?}",
        steps.join("; "),
        events.len(),
        calls.len(),
        published.counts,
        published.nacked_batches,
        worker.counts(),
    );
}
