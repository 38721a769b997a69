//! Events of one order reach the downstream in seq order, exactly once, while
//! orders on different shards run in parallel.

use shardline_testkit::{
    Downstream, Publisher, QueueType, TestEnv, assert_all_delivered_once_in_order,
    assert_request_shape, interleaved, order_ids,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_order_arrives_in_sequence_exactly_once() {
    in_sequence_exactly_once(QueueType::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_order_arrives_in_sequence_exactly_once_on_quorum_queues() {
    in_sequence_exactly_once(QueueType::Quorum).await;
}

async fn in_sequence_exactly_once(queue_type: QueueType) {
    let env = TestEnv::with_queue_type("order", queue_type).await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let worker = env.start_worker("w1", &downstream, |_| {}).await;

    // Seq 1 of all 200 orders, then seq 2, …: every shard queue interleaves orders.
    let events = interleaved(&order_ids("ord", 200), 5, env.shards);
    Publisher::connect(&env).await.publish(&events).await;

    let calls = assert_all_delivered_once_in_order(&env, &downstream, &events).await;
    assert_request_shape(&calls, &events, &env);
    worker.assert_all_processed(events.len() as u64).await;
}
