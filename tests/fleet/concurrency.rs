//! Key-level concurrency inside a shard (`worker --concurrency K`): up to K
//! calls in flight per shard, never two of one order, each order in seq order,
//! exactly once. kill -9 at K = 4 is in `crash.rs`, the gate and the
//! quarantine at K = 4 in `gate.rs` and `quarantine.rs`.

use std::time::Duration;

use shardline_testkit::{
    Downstream, Publisher, TestEnv, assert_all_delivered_once_in_order,
    assert_orders_never_overlap, interleaved, max_in_flight_per_shard, order_ids,
};

const LATENCY: Duration = Duration::from_millis(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_run_concurrently_in_a_shard_but_one_event_at_a_time_each() {
    const K: u16 = 16;
    let env = TestEnv::new("concurrency").await.with_shards(16);
    env.apply_topology().await;
    let downstream = Downstream::with_latency(LATENCY).await;
    let worker = env
        .start_worker("w1", &downstream, |c| c.concurrency = K)
        .await;

    // Seq 1 of all 800 orders, then seq 2, …: each shard queue interleaves ~50 orders.
    let events = interleaved(&order_ids("conc", 800), 5, env.shards);
    Publisher::connect(&env).await.publish(&events).await;

    let calls = assert_all_delivered_once_in_order(&env, &downstream, &events).await;
    assert_orders_never_overlap(&calls);
    let most = max_in_flight_per_shard(&calls, &env);
    assert!(
        most.values().all(|n| *n <= usize::from(K)),
        "more than {K} calls in flight on a shard: {most:?}"
    );
    assert!(
        most.values().any(|n| *n > 1),
        "no shard ever had two calls in flight: the test proves nothing: {most:?}"
    );
    worker.assert_all_processed(events.len() as u64).await;
}
