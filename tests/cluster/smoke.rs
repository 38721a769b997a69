//! The cluster itself, before shardline runs on it: a quorum queue declared
//! with the topology's own arguments gets a member on each node; kill -9 of its
//! leader's node leaves the other two serving it over AMQP; the node restarted
//! with its data rejoins and catches up; dropping the handle leaves no VM.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::{BasicProperties, Connection};
use shardline_connect::TopologyOptions;
use shardline_connect::declare::queue_status;
use shardline_testkit::cluster::{CLUSTER_START, NODES};
use shardline_testkit::wait::check;
use shardline_testkit::{Cluster, QueueType, STARTUP, TestEnv, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a three-node RabbitMQ cluster: scripts/test runs it alone"]
async fn a_quorum_queue_survives_a_killed_node_that_rejoins() {
    let cluster = Cluster::start().await;
    let dir = cluster.dir().to_owned();
    let mut all = cluster.names.to_vec();
    all.sort();
    for i in 0..NODES {
        assert_eq!(
            cluster.running_nodes(i).await,
            all,
            "{} sees",
            cluster.names[i]
        );
    }

    let env = TestEnv::on_cluster("cluster-smoke", QueueType::Quorum, &cluster, 0).await;
    let queue = env.shard_queue(0);
    let conn = env.connect().await;
    let channel = conn.create_channel().await.unwrap();
    let quorum = TopologyOptions {
        queue_type: QueueType::Quorum,
        ..TopologyOptions::default()
    };
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            quorum.shard_queue_arguments(&env.names),
        )
        .await
        .unwrap();
    close(conn).await;
    let members = quorum_status(&cluster, 0, &env.vhost, &queue).await;
    assert_eq!(
        members.keys().cloned().collect::<Vec<_>>(),
        all,
        "{queue} should have a member on every node: {members:?}"
    );
    let leader = members
        .iter()
        .find(|(_, m)| m.state == "leader")
        .map(|(name, _)| name.clone())
        .unwrap_or_else(|| panic!("{queue} has no leader: {members:?}"));
    let killed = cluster.names.iter().position(|n| *n == leader).unwrap();
    let survivors: Vec<usize> = (0..NODES).filter(|i| *i != killed).collect();

    cluster.kill9(killed).await;
    let mut left: Vec<String> = survivors
        .iter()
        .map(|i| cluster.names[*i].clone())
        .collect();
    left.sort();
    for &i in &survivors {
        wait_until(
            &format!("{} to see the two survivors only", cluster.names[i]),
            STARTUP,
            || async {
                let running = cluster.running_nodes(i).await;
                check(running == left, || format!("running {running:?}"))
            },
        )
        .await;
    }
    // Both survivors still serve AMQP, and the queue (a new leader: two of
    // three members are a majority) confirms what they publish.
    for &i in &survivors {
        publish_confirmed(&cluster.amqp_url(i, &env.vhost), &queue).await;
    }
    assert_eq!(
        depth(&cluster.amqp_url(survivors[0], &env.vhost), &queue).await,
        2
    );

    cluster.restart(killed).await;
    for i in 0..NODES {
        assert_eq!(
            cluster.running_nodes(i).await,
            all,
            "{} sees",
            cluster.names[i]
        );
    }
    // The restarted member catches up with the leader's log.
    wait_until(
        &format!("{leader}'s member of {queue} to catch up"),
        CLUSTER_START,
        || async {
            let members = quorum_status(&cluster, survivors[0], &env.vhost, &queue).await;
            let leaders = members.values().filter(|m| m.state == "leader").count();
            let commits: Vec<u64> = members.values().map(|m| m.commit_index).collect();
            let caught_up = members.len() == NODES
                && leaders == 1
                && members[&leader].state == "follower"
                && commits.iter().all(|c| *c == commits[0]);
            check(caught_up, || format!("members {members:?}"))
        },
    )
    .await;
    // The restarted node serves AMQP again, the messages there.
    publish_confirmed(&cluster.amqp_url(killed, &env.vhost), &queue).await;
    assert_eq!(
        depth(&cluster.amqp_url(killed, &env.vhost), &queue).await,
        3
    );

    drop(env);
    drop(cluster);
    assert_eq!(
        Cluster::vms_under(&dir),
        Vec::<u32>::new(),
        "Erlang VMs of {} still run after the cluster was dropped",
        dir.display()
    );
    assert!(!dir.exists(), "{} still exists", dir.display());
}

/// One member's line of `rabbitmq-queues quorum_status`.
#[derive(Debug)]
struct Member {
    state: String,
    commit_index: u64,
}

/// The members of `queue` as node `i` sees them, by node name.
async fn quorum_status(
    cluster: &Cluster,
    i: usize,
    vhost: &str,
    queue: &str,
) -> BTreeMap<String, Member> {
    let text = cluster
        .cli(
            i,
            "rabbitmq-queues",
            &[
                "-q",
                "quorum_status",
                queue,
                "--vhost",
                vhost,
                "--formatter",
                "json",
            ],
        )
        .await;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("quorum_status of {queue} is not JSON ({e}): {text}"));
    rows.iter()
        .map(|row| {
            let name = row["Node Name"].as_str().unwrap_or_default().to_owned();
            let member = Member {
                state: row["Raft State"].as_str().unwrap_or_default().to_owned(),
                commit_index: row["Commit Index"].as_u64().unwrap_or_default(),
            };
            (name, member)
        })
        .collect()
}

/// Publishes one persistent message to `queue` through `url` and waits for
/// the broker's confirm.
async fn publish_confirmed(url: &str, queue: &str) {
    let conn = connect(url).await;
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            b"smoke",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    let confirm = tokio::time::timeout(STARTUP, confirm)
        .await
        .unwrap_or_else(|_| panic!("no confirm from {url} within {STARTUP:?}"))
        .unwrap_or_else(|e| panic!("publishing through {url}: {e}"));
    assert!(confirm.is_ack(), "publishing through {url}: nacked");
    assert!(
        confirm.take_message().is_none(),
        "publishing through {url}: returned unroutable"
    );
    close(conn).await;
}

/// Ready messages of `queue`, by passive declare through `url`.
async fn depth(url: &str, queue: &str) -> u32 {
    let conn = connect(url).await;
    let status = queue_status(&conn, queue).await.unwrap();
    close(conn).await;
    status.messages
}

async fn connect(url: &str) -> Connection {
    let target = url.parse().unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        shardline_connect::connect(&target, "cluster-smoke"),
    )
    .await
    .unwrap_or_else(|_| panic!("connecting to {url}: no answer within 10 s"))
    .unwrap_or_else(|e| panic!("connecting to {url}: {e}"))
}

async fn close(conn: Connection) {
    let _ = conn.close(200, "done".into()).await;
}
