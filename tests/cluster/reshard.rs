//! A reshard on the three-node cluster with quorum queues: 8 → 12 under the
//! load of a publisher routing by the first count (md5 mod 8: every event of
//! a moved order is forwarded after its move), with a node killed -9 and
//! restarted during it. The command may lose its connection with the node;
//! run again, it resumes. Nothing lost, no order reordered, nothing
//! dead-lettered.

use std::time::Duration;

use shardline_contract::QueueType;
use shardline_testkit::{Downstream, Reply, TestEnv, orders_covering_shards};

use crate::load::{Load, ORDERS_PER_SHARD, assert_guarantees, wait_processing};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a three-node RabbitMQ cluster: scripts/test --long runs it alone"]
async fn a_reshard_from_8_to_12_quorum_shards_survives_a_node_restart() {
    let cluster = shardline_testkit::Cluster::start().await;
    let env = TestEnv::on_all_nodes("cluster-reshard", QueueType::Quorum, &cluster)
        .await
        .with_shards(8);
    env.apply_topology().await;
    let downstream = Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(2))).await;
    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let orders = orders_covering_shards("reshard", ORDERS_PER_SHARD, &env);
    let mut load = Load::start(&env, env.amqp_target(), orders).await;
    wait_processing(&downstream, "the load to be processed", 200).await;

    let node = 1;
    let mut tries = Vec::new();
    let reshard = async {
        for _ in 0..4 {
            let out = env
                .cli(&[
                    "topology",
                    "reshard",
                    "--to",
                    "12",
                    "--queue-type",
                    "quorum",
                ])
                .await;
            let printed = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let done = out.status.success();
            tries.push(printed);
            if done {
                return true;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        false
    };
    let fault = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        cluster.kill9(node).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        cluster.restart(node).await;
    };
    let (done, ()) = tokio::join!(reshard, fault);
    assert!(
        done,
        "the reshard did not finish in 4 runs:\n{}",
        tries.join("\n---\n")
    );
    let after = load.batches();
    load.wait_batches("publishing after the reshard", after + 20)
        .await;
    let published = load.stop().await;
    let record = shardline_connect::record::read(&mut env.redis().await, &env.keys())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((record.shards, record.reshard), (12, None));
    let calls = assert_guarantees(&env, &downstream, &published.events, &[&worker], 2).await;
    eprintln!(
        "cluster reshard 8 → 12 with {} killed and restarted: {} runs of the command, {} events, \
         {} calls; last run:\n{}",
        cluster.names[node],
        tries.len(),
        published.events.len(),
        calls.len(),
        tries.last().map_or("", String::as_str)
    );
}
