//! Classic-queue single-active-consumer failover on this broker (3.10.8),
//! which has rabbitmq-server#5460: switching the active consumer can crash
//! the queue so that the standby never takes over. Its reproduction used
//! prefetch 200, a `multiple` ack per message and an active consumer that
//! cancels and closes while deliveries are unacked. The worker refuses
//! `--single-active-consumer` on classic queues below 3.10.13 (the probe);
//! these tests record, on a private node, whether that pattern and ours
//! (a worker stopped, a connection lost) meet the bug here.

use std::time::Duration;

use futures_util::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use shardline_testkit::{BrokerNode, QueueType, TestEnv};

const MESSAGES: u64 = 5_000;

/// How the active consumer goes away.
#[derive(Debug, Clone, Copy)]
enum Leaving {
    /// `basic.cancel`, then channel and connection close, with deliveries
    /// unacked (the reproduction of rabbitmq-server#5460; a worker's graceful stop).
    CancelThenClose,
    /// Channel and connection close without `basic.cancel`, deliveries
    /// unacked: the worker's graceful stop (`shard.rs`, `close`).
    CloseWithoutCancel,
    /// The broker closes its connection (`rabbitmqctl close_connection`):
    /// what a killed worker or a lost network looks like to the queue.
    ConnectionLost,
}

async fn connect(env: &TestEnv, name: &str) -> Connection {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(&env.amqp_url, props).await.unwrap()
}

/// How a round ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failover {
    /// The standby received every message left.
    TookOver,
    /// The queue process crashed (the node logged `{badmatch,false}`) and
    /// the standby had received `taken` of the messages left.
    Crashed { taken: u64 },
    /// Neither within 30 s.
    Stalled { taken: u64 },
}

/// Runs one round: an active consumer acking with `multiple`, a standby,
/// [`MESSAGES`] published; the active one leaves after a fifth.
async fn round(env: &TestEnv, node: &BrokerNode, queue: &str, leaving: Leaving) -> Failover {
    let crashes_before = queue_crashes(node);
    let mut args = FieldTable::default();
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    let setup = connect(env, "sac-setup").await;
    let ch = setup.create_channel().await.unwrap();
    ch.queue_declare(queue.into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap();

    let consumer = |name: &'static str| async move {
        let conn = connect(env, name).await;
        let ch = conn.create_channel().await.unwrap();
        ch.basic_qos(200, BasicQosOptions::default()).await.unwrap();
        let deliveries = ch
            .basic_consume(
                queue.into(),
                name.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        (conn, ch, deliveries)
    };
    let (active_conn, active_ch, mut active) = consumer("sac-active").await;
    let (_standby_conn, _standby_ch, mut standby) = consumer("sac-standby").await;

    for i in 0..MESSAGES {
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            i.to_string().as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    }

    let mut acked = 0u64;
    while acked < MESSAGES / 5 {
        let delivery = active.next().await.unwrap().unwrap();
        delivery
            .ack(BasicAckOptions { multiple: true })
            .await
            .unwrap();
        acked += 1;
    }
    match leaving {
        Leaving::CancelThenClose => {
            active_ch
                .basic_cancel("sac-active".into(), BasicCancelOptions::default())
                .await
                .unwrap();
            let _ = active_ch.close(200, "bye".into()).await;
            let _ = active_conn.close(200, "bye".into()).await;
        }
        Leaving::CloseWithoutCancel => {
            let _ = active_ch.close(200, "bye".into()).await;
            let _ = active_conn.close(200, "bye".into()).await;
        }
        Leaving::ConnectionLost => {
            let pid = env.broker().one_connection(&env.vhost, "sac-active").await;
            env.broker().close_connection(&pid).await;
        }
    }

    let (count, taken) = tokio::sync::watch::channel(0u64);
    let reader = tokio::spawn(async move {
        while let Some(Ok(delivery)) = standby.next().await {
            delivery.ack(BasicAckOptions::default()).await.unwrap();
            count.send_modify(|n| *n += 1);
        }
    });
    let left = MESSAGES - acked;
    // The standby takes over, or the node logs a crash (a log has no event
    // to await: it is read every 100 ms).
    let crashed = async {
        while queue_crashes(node) == crashes_before {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let mut all = taken.clone();
    let outcome = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::select! {
            _ = all.wait_for(|n| *n >= left) => Failover::TookOver,
            () = crashed => Failover::Crashed { taken: *taken.borrow() },
        }
    })
    .await
    .unwrap_or_else(|_| Failover::Stalled {
        taken: *taken.borrow(),
    });
    reader.abort();
    let _ = setup.close(200, "done".into()).await;
    outcome
}

/// How many times the node's log tells of a queue process that crashed
/// with rabbitmq-server#5460's `{badmatch,false}`.
fn queue_crashes(node: &BrokerNode) -> usize {
    let log = node.dir().join("log").join(format!("{}.log", node.name));
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .matches("** {{badmatch,false}")
        .count()
}

/// The bug report's pattern (cancel, then close, with deliveries unacked) can
/// crash the queue here (3 of 9 rounds in our runs; being a race, it may
/// miss all 15, which is reported, not failed); the worker's own
/// ways of leaving — a graceful stop closes the channel without
/// `basic.cancel`, a killed worker's connection is lost — let the standby
/// take over in every round beside it (0 crashes in 24 rounds in our runs).
/// Neither proves the worker safe: `--single-active-consumer` on classic
/// queues stays refused below 3.10.13 unless the risk is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn the_workers_ways_of_leaving_hand_over_where_the_sac_bug_can_crash_a_cancelling_consumers_queue()
 {
    let node = BrokerNode::start().await;
    let env = TestEnv::on_node("sac-failover", QueueType::Classic, &node).await;
    let mut rounds = 0;
    let mut crashed = None;
    while crashed.is_none() && rounds < 15 {
        for leaving in [Leaving::CloseWithoutCancel, Leaving::ConnectionLost] {
            let outcome = round(&env, &node, &format!("ours-{rounds}-{leaving:?}"), leaving).await;
            assert_eq!(
                outcome,
                Failover::TookOver,
                "round {rounds}, {leaving:?}: the standby did not take over"
            );
        }
        let queue = format!("cancel-{rounds}");
        let outcome = round(&env, &node, &queue, Leaving::CancelThenClose).await;
        eprintln!("round {rounds}: cancel then close: {outcome:?}");
        if matches!(outcome, Failover::Crashed { .. } | Failover::Stalled { .. }) {
            crashed = Some((rounds, outcome));
        }
        rounds += 1;
    }
    // rabbitmq-server#5460 is a race: a round that misses it says nothing about the broker
    // (3 of 9 rounds met it in our runs, none of 15 in one CI run). What
    // this test asserts is ours: the worker's ways of leaving handed over in
    // every round; whether the bug showed beside them is reported.
    match crashed {
        Some((at, outcome)) => eprintln!(
            "rabbitmq-server#5460 reproduced in round {at} ({outcome:?}); the worker's ways of leaving took over in all {} rounds",
            2 * rounds
        ),
        None => eprintln!(
            "cancel-then-close did not crash the queue in {rounds} rounds (a race); the worker's ways of leaving took over in all {} rounds",
            2 * rounds
        ),
    }
}
