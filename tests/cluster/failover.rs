//! A node lost under load: the worker and the publisher are connected to the
//! node that leads the most shard queues when its Erlang VM is killed (kill
//! -9: its sockets close at once, nothing is shut down cleanly). Both move to
//! the next address, the survivors elect new leaders, publishing resumes
//! within seconds; the node then restarts and rejoins. Nothing is lost, no
//! order is reordered, a shard repeats at most its call in flight, and the
//! DLQ (a quorum queue) is still there.

use std::time::Instant;

use lapin::Connection;
use shardline_connect::declare::queue_status;
use shardline_testkit::cluster::NODES;
use shardline_testkit::wait::check;
use shardline_testkit::{Downstream, Reply, STARTUP, orders_covering_shards, wait_until};

use crate::load::{
    LOAD_CONNECTION, Load, ORDERS_PER_SHARD, RESUME_BOUND, answered, assert_guarantees, busiest,
    leaders, pinned, quorum_cluster, wait_connected_to, wait_processing,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a three-node RabbitMQ cluster: scripts/test runs it alone"]
async fn a_killed_node_under_load_loses_nothing_and_publishing_resumes_within_seconds() {
    let (cluster, env) = quorum_cluster("cluster-failover").await;
    let led = leaders(&cluster, &env, 0).await;
    let node = busiest(&led);
    let survivor = (node + 1) % NODES;
    let target = pinned(&cluster, &env, node, "");
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(std::time::Duration::from_millis(5))).await;
    let worker = env
        .start_worker("w1", &downstream, |c| c.amqp = target.clone())
        .await;
    let orders = orders_covering_shards("failover", ORDERS_PER_SHARD, &env);
    let mut load = Load::start(&env, target, orders).await;
    let clients = ["shardline worker w1 ", LOAD_CONNECTION];
    wait_connected_to(&cluster, &env, node, &clients).await;
    wait_processing(&downstream, "the load to be processed", 480).await;

    let killed = Instant::now();
    cluster.kill9(node).await;
    let stalled = load.wait_resumed(killed).await;
    let resumed = killed.elapsed();
    // Every shard queue and the DLQ are led from a survivor.
    let left = wait_until(
        "every queue to have a leader on a survivor",
        STARTUP,
        || async {
            let listed = env
                .list_queues_via(cluster.ctl(survivor), &["type", "leader"])
                .await;
            let on_lost = listed
                .values()
                .any(|fields| fields.get(1).is_none_or(|l| *l == cluster.names[node]));
            let dlq = listed.get(&env.names.dead_letter_queue);
            let quorum_dlq = dlq.is_some_and(|f| f.first().is_some_and(|t| t == "quorum"));
            check(!on_lost && quorum_dlq, || format!("{listed:?}")).map(|()| listed)
        },
    )
    .await;
    let dlq = {
        let target = cluster.amqp_url(survivor, &env.vhost).parse().unwrap();
        let conn = shardline_connect::connect(&target, "failover-check")
            .await
            .unwrap();
        let status = queue_status(&conn, &env.names.dead_letter_queue).await;
        close(conn).await;
        status
    };
    assert!(dlq.is_ok(), "the DLQ after the kill: {dlq:?}");
    let at_kill = answered(&downstream.calls());
    wait_processing(&downstream, "processing after the kill", at_kill).await;
    let processing = killed.elapsed();
    for (i, name) in [(node + 1) % NODES, (node + 2) % NODES]
        .iter()
        .map(|i| (*i, &cluster.names[*i]))
    {
        let on = crate::load::connections(&cluster, &env, i).await;
        assert!(
            on.iter().all(|(n, _)| *n != node),
            "a connection still on the killed node, as {name} sees it: {on:?}"
        );
    }

    let restarting = Instant::now();
    cluster.restart(node).await;
    let rejoined = restarting.elapsed();
    let after = load.batches();
    load.wait_batches("publishing with the node back", after + 20)
        .await;
    let published = load.stop().await;
    let events = published.events;
    let calls = assert_guarantees(&env, &downstream, &events, &[&worker], 1).await;
    assert!(
        stalled < RESUME_BOUND,
        "publishing stalled for {stalled:?} after the kill"
    );
    let repeats: usize = shardline_testkit::repeats_per_shard(&calls, &env)
        .values()
        .sum();
    eprintln!(
        "failover: killed {} (leader of {} of {} shard queues); publishing stalled {stalled:?} \
         (resumed {resumed:?} after the kill, processing {processing:?}), every queue led from \
         a survivor ({} queues), node rejoined in {rejoined:?}; {} events, {} calls ({repeats} \
         repeated), publisher {:?} ({} batches nacked and sent again), worker {:?}",
        cluster.names[node],
        led[node].len(),
        env.shards.get(),
        left.len(),
        events.len(),
        calls.len(),
        published.counts,
        published.nacked_batches,
        worker.counts(),
    );
}

async fn close(conn: Connection) {
    let _ = conn.close(200, "done".into()).await;
}
