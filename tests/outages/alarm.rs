//! Broker flow control: a memory alarm on the (private) node blocks every
//! publishing connection. `shardline load` says so at once and waits inside
//! its window; once the alarm clears it completes, nothing lost. A worker
//! keeps consuming and acking meanwhile; its dead letter waits, unacked.

use std::time::Instant;

use tokio::io::{AsyncBufReadExt as _, BufReader};

use shardline_testkit::broker::NODE_START;
use shardline_testkit::{
    BrokerNode, Downstream, PROCESSING, Publisher, QueueType, Reply, TestEnv, all_ok,
    assert_in_order_and_complete, interleaved, order_ids, wait_until,
};

/// A watermark far below what any node uses: the alarm goes off at once.
const ALARM: &str = "0.0000001";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn a_memory_alarm_blocks_load_which_says_so_and_completes_when_it_clears() {
    let node = BrokerNode::start().await;
    let env = TestEnv::on_node("alarm", QueueType::Classic, &node).await;
    env.apply_topology().await;
    node.ctl()
        .run(&["set_vm_memory_high_watermark", ALARM])
        .await;

    let mut load = env.shardline_command();
    load.args(["load", "--orders", "50", "--events-per-order", "4"])
        .args(env.global_args())
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    let mut child = load.spawn().unwrap();
    let started = Instant::now();
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let blocked_line = tokio::time::timeout(NODE_START, async {
        while let Some(line) = stderr.next_line().await.unwrap() {
            let hit = line.contains("broker blocked: memory alarm");
            seen.push(line);
            if hit {
                return;
            }
        }
    })
    .await;
    assert!(
        blocked_line.is_ok(),
        "`load` never said the broker blocked it:\n{}",
        seen.join("\n")
    );
    let told_after = started.elapsed();
    // Blocked: nothing is confirmed while the alarm lasts.
    assert!(
        child.try_wait().unwrap().is_none(),
        "`load` ended while blocked"
    );
    node.ctl()
        .run(&["set_vm_memory_high_watermark", "0.4"])
        .await;
    let out = tokio::time::timeout(PROCESSING, child.wait_with_output())
        .await
        .expect("`load` did not finish after the alarm cleared")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", seen.join("\n"));
    assert!(
        stdout.contains("published 200 events (200 confirmed)"),
        "{stdout}"
    );
    wait_until("all 200 events in the shard queues", PROCESSING, || async {
        match env.shard_backlog().await {
            200 => Ok(()),
            n => Err(format!("{n} events")),
        }
    })
    .await;
    eprintln!("`load` reported the block {told_after:?} after it started");
}

/// Under the alarm a worker keeps consuming and acking what was published
/// before it (its deliveries and acks travel on a connection that publishes
/// nothing); a dead letter waits, blocked, with its event unacked, and goes
/// out when the alarm clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn a_worker_keeps_consuming_under_a_memory_alarm_and_its_dead_letter_waits() {
    let node = BrokerNode::start().await;
    let env = TestEnv::on_node("alarm-worker", QueueType::Classic, &node).await;
    env.apply_topology().await;
    let mut events = interleaved(&order_ids("alarm", 40), 3, env.shards);
    // The last event published: the last of its shard, so nothing waits
    // behind its dead letter.
    let bad = events.pop().unwrap();
    let bad_key = bad.key();
    let downstream = Downstream::scripted(move |call, _| match call.key() == bad_key {
        true => Reply::status(422),
        false => Reply::ok(),
    })
    .await;
    let publisher = Publisher::connect(&env).await;
    publisher.publish(&events).await;
    publisher.publish(std::slice::from_ref(&bad)).await;
    node.ctl()
        .run(&["set_vm_memory_high_watermark", ALARM])
        .await;

    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let calls = downstream
        .wait_for(
            "every other event processed under the alarm",
            PROCESSING,
            |calls| all_ok(calls, &events),
        )
        .await;
    let processed: Vec<_> = calls.into_iter().filter(|c| c.ok()).collect();
    assert_in_order_and_complete(&processed, &events);
    // The dead-letter connection is blocked by the broker, its event unacked.
    let dead_letters = "shardline worker w1 dead letters";
    wait_until("the dead-letter connection blocked", PROCESSING, || async {
        let listed = node
            .ctl()
            .run(&[
                "-q",
                "list_connections",
                "--no-table-headers",
                "client_properties",
                "state",
            ])
            .await;
        match listed
            .lines()
            .any(|l| l.contains(dead_letters) && l.ends_with("blocked"))
        {
            true => Ok(()),
            false => Err(listed),
        }
    })
    .await;
    assert_eq!(worker.counts().dead_lettered_total(), 0);
    let bad_queue = env.shard_queue(bad.shard);
    assert_eq!(
        env.queue_depths().await.get(&bad_queue).map(|d| d.1),
        Some(1)
    );

    node.ctl()
        .run(&["set_vm_memory_high_watermark", "0.4"])
        .await;
    let counts = worker
        .wait_counts("the dead letter published after the alarm", |c| {
            c.dead_lettered_total() == 1
        })
        .await;
    assert_eq!(counts.processed, events.len() as u64, "{counts:?}");
}
