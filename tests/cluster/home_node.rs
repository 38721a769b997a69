//! The default classic topology on a cluster: each shard queue lives on one
//! node. With that node down its queue answers 404 "home node … is down": the
//! worker tells that apart from a missing topology, starts, consumes the other
//! shards, and keeps trying the unavailable ones until their node is back.

use shardline_testkit::cluster::NODES;
use shardline_testkit::{
    Cluster, Downstream, PROCESSING, Publisher, QueueType, TestEnv, Worker, all_ok,
    assert_all_delivered_once_in_order, assert_in_order_and_complete, interleaved,
    orders_covering_shards,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a three-node RabbitMQ cluster: scripts/test runs it alone"]
async fn a_shard_whose_node_is_down_waits_while_the_others_run() {
    let cluster = Cluster::start().await;
    let env = TestEnv::on_all_nodes("cluster-home", QueueType::Classic, &cluster).await;
    env.apply_topology().await;
    // Shard i was declared through node i mod 3: node 2 (index 1) holds 1, 4, 7.
    let down = 1;
    let (lost, live): (Vec<u16>, Vec<u16>) =
        (0..env.shards.get()).partition(|s| usize::from(*s) % NODES == down);
    cluster.kill9(down).await;

    let downstream = Downstream::start().await;
    let mut worker = Worker::spawn(env.worker_config("w1"), downstream.handler());
    worker.wait_consuming_shards(&env, &live).await;
    let orders = orders_covering_shards("home", 2, &env);
    let (on_lost, on_live): (Vec<String>, Vec<String>) = orders
        .into_iter()
        .partition(|o| lost.contains(&env.shard_of(o)));
    let live_events = interleaved(&on_live, 3, env.shards);
    Publisher::connect(&env).await.publish(&live_events).await;
    // The queues on the node that is down cannot be read, so not "drained":
    // what the downstream got is the check here.
    downstream
        .wait_for("the live shards' events", PROCESSING, |calls| {
            all_ok(calls, &live_events)
        })
        .await;
    assert_in_order_and_complete(&downstream.calls(), &live_events);

    cluster.restart(down).await;
    worker.wait_consuming(&env).await;
    let lost_events = interleaved(&on_lost, 3, env.shards);
    Publisher::connect(&env).await.publish(&lost_events).await;
    let all: Vec<_> = live_events.iter().chain(&lost_events).cloned().collect();
    assert_all_delivered_once_in_order(&env, &downstream, &all).await;
}
