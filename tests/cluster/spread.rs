//! shardline on the cluster through all three addresses: `topology apply
//! --queue-type quorum` declares the shard queues through each node in turn,
//! so their leaders spread over the nodes (no queue argument, no policy); the
//! DLQ is a quorum queue; a worker and a publisher given the three addresses
//! process every event once, in order, and their connections say which node
//! they reached.

use std::collections::BTreeMap;

use shardline_testkit::cluster::NODES;
use shardline_testkit::{
    Cluster, Downstream, Publisher, QueueType, TestEnv, assert_all_delivered_once_in_order,
    interleaved, order_ids,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a three-node RabbitMQ cluster: scripts/test runs it alone"]
async fn quorum_leaders_spread_over_the_nodes_and_every_tool_takes_the_three_addresses() {
    let cluster = Cluster::start().await;
    let env = TestEnv::on_all_nodes("cluster-spread", QueueType::Quorum, &cluster).await;
    let out = env.cli(&["topology", "apply"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("through 3 nodes"), "{stdout}");

    let listed = env
        .list_queues_via(cluster.ctl(0), &["type", "leader"])
        .await;
    let mut leaders: BTreeMap<String, usize> = BTreeMap::new();
    let mut dlq_type = None;
    for (name, fields) in &listed {
        let [kind, leader] = &fields[..] else {
            continue;
        };
        if *name == env.names.dead_letter_queue {
            dlq_type = Some(kind.clone());
        } else if name.starts_with(&env.names.queue_prefix) {
            *leaders.entry(leader.clone()).or_default() += 1;
        }
    }
    assert_eq!(dlq_type.as_deref(), Some("quorum"), "{listed:?}");
    let shards = env.shards.get() as usize;
    assert_eq!(
        leaders.len(),
        NODES,
        "leaders on every node: {leaders:?}\n{listed:?}"
    );
    assert!(
        leaders.values().all(|n| n.abs_diff(shards / NODES) <= 1),
        "leaders spread evenly: {leaders:?}"
    );

    let downstream = Downstream::start().await;
    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let events = interleaved(&order_ids("spread", 60), 4, env.shards);
    Publisher::connect(&env).await.publish(&events).await;
    assert_all_delivered_once_in_order(&env, &downstream, &events).await;
    worker.assert_all_processed(events.len() as u64).await;
    let names = cluster
        .ctl(0)
        .run(&[
            "-q",
            "list_connections",
            "--no-table-headers",
            "vhost",
            "client_properties",
        ])
        .await;
    let ours: Vec<&str> = names
        .lines()
        .filter(|l| l.starts_with(&env.vhost))
        .collect();
    assert!(
        !ours.is_empty() && ours.iter().all(|l| l.contains(" @ 127.0.0.1:")),
        "connection names say the node: {names}"
    );
}
