//! Redis dies mid-stream (SIGKILL of a private, non-persistent server) and comes
//! back empty on the same port. SPEC §3 "Outages": no processing without
//! dedup, so the shards pause, the outage is logged once, and processing
//! resumes by itself when Redis returns.

use std::time::Duration;

use crate::harness::{
    Downstream, PROCESSING, Publisher, Reply, TestEnv, Worker, all_ok,
    assert_in_order_and_complete, describe, interleaved, ok_keys, orders_covering_shards,
};
use crate::support::{PrivateRedis, assert_nothing_dead_lettered, wait_until};

/// How long the downstream must stay silent while Redis is down. A pause is the
/// absence of calls, which no event can signal, so this is a fixed observation
/// window: without the pause the 8 shards would make ~300 calls in it.
const PAUSE_WINDOW: Duration = Duration::from_millis(1500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "disturbs the shared broker: scripts/test runs it alone"]
async fn redis_outage_pauses_the_shards_and_they_resume() {
    let env = TestEnv::new("redis-outage").await;
    env.apply_topology().await;
    let mut redis = PrivateRedis::start(&env);
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(25))).await;
    let events = interleaved(&orders_covering_shards("redis", 20, &env), 5, env.shards);

    let mut worker = Worker::start_on_redis(&env, "redis", &redis.url(), &downstream.url(), &[]);
    let conn = env.connect().await;
    worker.wait_consuming(&env, &conn).await;
    Publisher::connect(&env).await.publish(&events).await;

    let third = events.len() / 3;
    downstream
        .wait_for("a third of the events", PROCESSING, |calls| {
            ok_keys(calls).len() >= third
        })
        .await;
    redis.kill9();

    // The worker notices (its next claim or commit fails) and says so.
    wait_until(
        "the worker to log the Redis outage",
        PROCESSING,
        || worker.count_lines("Redis unreachable") >= 1,
        || worker.log_tail(40),
    )
    .await;
    // Handler calls already under way when Redis died finish; then nothing.
    downstream
        .wait_for("the in-flight calls to finish", PROCESSING, |calls| {
            calls.iter().all(|c| c.completed)
        })
        .await;
    let paused = downstream.calls();
    assert!(
        ok_keys(&paused).len() < events.len(),
        "the stream ended before Redis died: the test proves nothing\n{}",
        describe(&paused)
    );
    tokio::time::sleep(PAUSE_WINDOW).await;
    let during = downstream.calls();
    assert_eq!(
        during.len(),
        paused.len(),
        "the downstream was called while Redis was down (no processing without dedup)\n{}",
        describe(&during)
    );
    worker.assert_running();
    // Nothing was acked without its dedup commit: what was not committed is
    // still in the queues.
    let backlog = env.shard_backlog().await;
    let done = ok_keys(&paused).len() as u64;
    assert!(
        backlog >= events.len() as u64 - done,
        "{backlog} events left in the queues, but only {done} of {} processed",
        events.len()
    );

    redis.restart();
    downstream
        .wait_for("every event after Redis returned", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    assert_nothing_dead_lettered(&env).await;

    let calls = downstream.calls();
    // The dedup state went with the server: repeats are allowed, gaps and
    // reordering are not.
    assert_in_order_and_complete(&calls, &events);
    assert_eq!(
        worker.count_lines("Redis unreachable"),
        1,
        "the outage should be logged once per worker\n{}",
        worker.log_tail(40)
    );
    assert!(
        worker.count_lines("Redis reachable again") >= 1,
        "the recovery should be logged\n{}",
        worker.log_tail(40)
    );
    worker.assert_running();
    eprintln!(
        "redis outage: {} events, {} calls, {} before the kill",
        events.len(),
        calls.len(),
        paused.len()
    );
}
