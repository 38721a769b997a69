//! kill -9 mid-stream: nothing lost, order kept, at most the events in flight
//! of each shard repeated (one, K with `--concurrency K`, a group with
//! `--group-commit N`).

use std::time::Duration;

use shardline_testkit::{
    ChildWorker, Downstream, PROCESSING, Publisher, QueueType, Reply, STARTUP, TestEnv, all_ok,
    assert_in_order_and_complete, assert_orders_never_overlap, describe, interleaved, ok_keys,
    order_ids, repeats_per_shard,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_stream_loses_nothing() {
    kill_9_mid_stream(QueueType::Classic, 1, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_concurrency_4_repeats_at_most_4_calls_per_shard() {
    kill_9_mid_stream(QueueType::Classic, 4, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_group_commit_repeats_at_most_a_group_per_shard() {
    kill_9_mid_stream(QueueType::Classic, 1, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_stream_loses_nothing_on_quorum_queues() {
    kill_9_mid_stream(QueueType::Quorum, 1, 1).await;
}

/// Both workers run with `--concurrency k` and `--group-commit group`.
async fn kill_9_mid_stream(queue_type: QueueType, k: u16, group: u16) {
    let env = TestEnv::with_queue_type("crash", queue_type).await;
    env.apply_topology().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(15))).await;
    let events = interleaved(&order_ids("crash", 120), 5, env.shards);
    Publisher::connect(&env).await.publish(&events).await;

    // A process: the point is kill -9.
    let (concurrency, group_commit) = (k.to_string(), group.to_string());
    let mut flags = vec!["--concurrency", &concurrency];
    if group > 1 {
        // Groups form from what the broker has already sent.
        flags.extend(["--group-commit", &group_commit, "--prefetch", "16"]);
    }
    let mut first = ChildWorker::start(&env, "first", &downstream.url(), &flags);
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
        .start_worker("second", &downstream, |c| {
            c.concurrency = k;
            c.group_commit = group;
        })
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
    let bound = usize::from(k.max(group));
    assert!(
        repeats.values().all(|n| *n <= bound),
        "more than the {bound} event(s) in flight repeated on a shard: {repeats:?}\n{}",
        describe(&calls)
    );
}
