//! Broker flow control: a memory alarm on the (private) node blocks every
//! publishing connection. `shardline load` says so at once and waits inside
//! its window; once the alarm clears it completes, nothing lost.

use std::time::Instant;

use tokio::io::{AsyncBufReadExt as _, BufReader};

use shardline_testkit::broker::NODE_START;
use shardline_testkit::{BrokerNode, PROCESSING, QueueType, TestEnv, wait_until};

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
