//! Copies of processed events are acked as duplicates and never reach the
//! downstream again.

use shardline_testkit::{
    Downstream, Event, PROCESSING, Publisher, TestEnv, all_ok, assert_exactly_once,
    assert_request_shape, describe, interleaved, orders_covering_shards,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_processed_events_cause_no_calls() {
    let env = TestEnv::new("dup").await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let worker = env.start_worker("w1", &downstream, |_| {}).await;

    let orders = orders_covering_shards("dup", 3, &env);
    let events = interleaved(&orders, 3, env.shards);
    let publisher = Publisher::connect(&env).await;
    publisher.publish(&events).await;
    downstream
        .wait_for("the originals answered", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;
    // All acked, so every dedup key is committed.
    env.wait_shard_queues_drained(PROCESSING).await;
    assert!(
        env.redis_key_count() > 0,
        "the worker wrote no Redis key under --redis-prefix {}",
        env.redis_prefix
    );

    // The same bytes again, then one new event per shard behind them: once a
    // shard's sentinel is answered, the copies queued before it were consumed.
    publisher.publish(&events).await;
    let mut sentinel_shards = std::collections::BTreeSet::new();
    let sentinels: Vec<Event> = orders
        .iter()
        .filter(|order| sentinel_shards.insert(env.shard_of(order)))
        .map(|order| Event::new(order, 4, env.shards))
        .collect();
    assert_eq!(
        sentinels
            .iter()
            .map(|e| e.shard)
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        usize::from(shardline_testkit::SHARDS),
        "one sentinel per shard"
    );
    publisher.publish(&sentinels).await;
    downstream
        .wait_for("the sentinels answered", PROCESSING, |calls| {
            all_ok(calls, &sentinels)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;

    let calls = downstream.calls();
    let all: Vec<Event> = events.iter().chain(&sentinels).cloned().collect();
    assert_eq!(
        calls.len(),
        all.len(),
        "duplicates reached the downstream:\n{}",
        describe(&calls)
    );
    assert_exactly_once(&calls, &all);
    // The worker counted each copy as a duplicate.
    let counts = worker.wait_settled((all.len() + events.len()) as u64).await;
    assert_eq!(
        counts.duplicates,
        events.len() as u64,
        "{}",
        worker.describe()
    );
    // Idempotency-Key is `{order_id}:{event}:{seq}`, among the other headers.
    assert_request_shape(&calls, &all, &env);
}
