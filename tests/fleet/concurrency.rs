//! Key-level concurrency inside a shard (`worker --concurrency K`): up to K
//! calls in flight per shard, never two of one order, each order in seq order,
//! exactly once; after kill -9 at most K repeated calls per shard. The gate and
//! the quarantine at K = 4 are in `gate.rs` and `quarantine.rs`.

use std::time::Duration;

use shardline_testkit::{
    ChildWorker, Downstream, PROCESSING, Publisher, STARTUP, TestEnv, all_ok, assert_exactly_once,
    assert_in_order_and_complete, assert_orders_never_overlap, describe, interleaved,
    max_in_flight_per_shard, ok_keys, order_ids, repeats_per_shard,
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

    downstream
        .wait_for("all 4000 events answered", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    let calls = downstream.calls();
    assert_exactly_once(&calls, &events);
    assert_in_order_and_complete(&calls, &events);
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
    let counts = worker.wait_settled(events.len() as u64).await;
    assert_eq!(
        counts.processed,
        events.len() as u64,
        "{}",
        worker.describe()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_concurrency_4_repeats_at_most_4_calls_per_shard() {
    const K: u16 = 4;
    let env = TestEnv::new("concurrency-crash").await;
    env.apply_topology().await;
    let downstream = Downstream::with_latency(Duration::from_millis(15)).await;
    let events = interleaved(&order_ids("cc", 240), 5, env.shards);
    Publisher::connect(&env).await.publish(&events).await;

    let mut first = ChildWorker::start(&env, "first", &downstream.url(), &["--concurrency", "4"]);
    first.wait_consuming(&env).await;
    let third = events.len() / 3;
    downstream
        .wait_for("a third of the events", PROCESSING, |calls| {
            ok_keys(calls).len() >= third
        })
        .await;
    first.kill9();
    first.wait_exit(STARTUP).await;
    let at_kill = downstream.calls();
    assert!(
        ok_keys(&at_kill).len() < events.len(),
        "the stream ended before the kill: the test proves nothing\n{}",
        describe(&at_kill)
    );

    let _second = env
        .start_worker("second", &downstream, |c| c.concurrency = K)
        .await;
    downstream
        .wait_for("every event after the restart", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;

    let calls = downstream.calls();
    assert_in_order_and_complete(&calls, &events);
    assert_orders_never_overlap(&calls);
    let repeats = repeats_per_shard(&calls, &env);
    assert!(
        repeats.values().all(|n| *n <= usize::from(K)),
        "more than the {K} calls in flight repeated on a shard: {repeats:?}\n{}",
        describe(&calls)
    );
}
