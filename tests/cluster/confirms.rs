//! A publisher whose node stops answering fails over when its confirms stop
//! arriving: the node is frozen (SIGSTOP), so its TCP connections stay open
//! and no error comes; after `confirm_timeout` of unconfirmed time the
//! publisher gives the connection up, connects to the next address and sends
//! its window again. Nothing is lost (every confirmed event is processed, in
//! order), the stall is about the timeout, and the thawed node rejoins. The
//! worker is on another node and the frozen one leads the fewest shard
//! queues, so what is measured is the publisher's failover.

use std::time::{Duration, Instant};

use shardline_testkit::cluster::NODES;
use shardline_testkit::{orders_covering_shards, wait_until};

use crate::load::{
    LOAD_CONNECTION, Load, ORDERS_PER_SHARD, assert_guarantees, connections, heal_after_pause,
    leaders, pinned, quorum_cluster, wait_connected_to,
};

/// The publisher's confirm timeout here (30 s by default).
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a three-node RabbitMQ cluster: scripts/test runs it alone"]
async fn a_publisher_whose_node_stops_answering_fails_over_when_confirms_stop() {
    let (cluster, env) = quorum_cluster("cluster-confirms").await;
    let led = leaders(&cluster, &env, 0).await;
    let frozen = (0..NODES).min_by_key(|&i| (led[i].len(), i)).unwrap_or(0);
    let worker_node = (frozen + 1) % NODES;
    let downstream = shardline_testkit::Downstream::start().await;
    let worker_target = pinned(&cluster, &env, worker_node, "");
    let worker = env
        .start_worker("w1", &downstream, |c| c.amqp = worker_target)
        .await;
    let orders = orders_covering_shards("confirms", ORDERS_PER_SHARD, &env);
    let mut load = Load::start_with(&env, pinned(&cluster, &env, frozen, ""), orders, |c| {
        c.confirm_timeout = CONFIRM_TIMEOUT;
    })
    .await;
    wait_connected_to(&cluster, &env, frozen, &[LOAD_CONNECTION]).await;
    load.wait_batches("the load to run", 10).await;

    // The fault starts when the node is frozen: confirms that arrive while
    // the pause command runs are from before it.
    cluster.pause(frozen).await;
    let fault = Instant::now();
    let stalled = load.wait_resumed(fault).await;
    let resumed = fault.elapsed();
    // While the frozen node still counts as up (under `net_ticktime`),
    // `list_connections` may get no answer from the cluster: read until the
    // listing shows the publisher on another node.
    wait_until(
        "the publisher on another node",
        shardline_testkit::STARTUP,
        || async {
            let moved = connections(&cluster, &env, worker_node).await;
            let on_another = moved
                .iter()
                .any(|(node, name)| name.starts_with(LOAD_CONNECTION) && *node != frozen);
            on_another.then_some(()).ok_or_else(|| format!("{moved:?}"))
        },
    )
    .await;
    let after = load.batches();
    load.wait_batches("publishing on the new node", after + 10)
        .await;
    cluster.resume(frozen).await;
    let healed = heal_after_pause(&cluster, frozen, worker_node).await;
    let published = load.stop().await;
    assert!(
        published.counts.reconnects >= 1 && published.counts.resent >= 1,
        "the publisher reconnected and sent its window again: {:?}",
        published.counts
    );
    assert!(
        stalled >= CONFIRM_TIMEOUT && stalled < crate::load::RESUME_BOUND,
        "publishing stalled for {stalled:?}: at least the confirm timeout ({CONFIRM_TIMEOUT:?}), \
         well below {:?}",
        crate::load::RESUME_BOUND
    );
    let calls = assert_guarantees(&env, &downstream, &published.events, &[&worker], 1).await;
    eprintln!(
        "confirms: froze {} (leader of {} shard queues); publishing stalled {stalled:?} \
         (first confirm after the freeze {resumed:?} in), healed {healed:?}; {} events, {} calls; \
         publisher {:?}",
        cluster.names[frozen],
        led[frozen].len(),
        published.events.len(),
        calls.len(),
        published.counts
    );
}
