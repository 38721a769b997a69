//! Two workers on the same shards: one consumer per shard; the standby takes
//! over when the active worker is killed.

use std::time::Duration;

use crate::harness::{
    Downstream, PROCESSING, Publisher, Reply, SHARDS, STARTUP, TestEnv, Worker, all_ok,
    assert_exactly_once, assert_in_order_and_complete, describe, interleaved, ok_keys, order_ids,
    repeats_per_shard,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_takes_over_from_a_killed_worker() {
    let env = TestEnv::new("standby").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(15))).await;
    let flags = ["--standby-retry", "200ms"];

    let mut active = Worker::start(&env, "active", &downstream.url(), &flags);
    active.wait_consuming(&env, &conn).await;
    active.wait_log_all_shards("shard active", STARTUP).await;
    let mut standby = Worker::start(&env, "standby", &downstream.url(), &flags);
    standby.wait_log_all_shards("standing by", STARTUP).await;
    let statuses = env.shard_statuses(&conn).await;
    assert!(
        statuses.iter().all(|s| s.consumers == 1),
        "a shard without exactly one consumer while both workers run: {statuses:?}"
    );
    assert!(
        standby.logged_shards("shard active").is_empty(),
        "the standby claims shards the active worker holds:\n{}",
        standby.log_tail(40)
    );

    let events = interleaved(&order_ids("standby", 120), 5, env.shards);
    Publisher::connect(&env).await.publish(&events).await;
    let third = events.len() / 3;
    downstream
        .wait_for("a third of the events", PROCESSING, |calls| {
            ok_keys(calls).len() >= third
        })
        .await;
    active.kill9();
    active.wait_exit(STARTUP).await;
    let at_kill = downstream.calls();
    assert!(
        ok_keys(&at_kill).len() < events.len(),
        "the stream ended before the kill: the test proves nothing\n{}",
        describe(&at_kill)
    );

    downstream
        .wait_for(
            "every event, finished by the standby",
            PROCESSING,
            |calls| all_ok(calls, &events),
        )
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    assert_eq!(
        standby.logged_shards("shard active").len(),
        usize::from(SHARDS),
        "the standby did not take every shard:\n{}",
        standby.log_tail(40)
    );
    let statuses = env.shard_statuses(&conn).await;
    assert!(statuses.iter().all(|s| s.consumers == 1), "{statuses:?}");

    let calls = downstream.calls();
    assert_in_order_and_complete(&calls, &events);
    let repeats = repeats_per_shard(&calls, &env);
    assert!(
        repeats.values().all(|n| *n <= 1),
        "more than the in-flight event repeated on a shard: {repeats:?}\n{}",
        describe(&calls)
    );
}

/// A worker that owns some shards and stands by on others (what a standby
/// becomes after taking over part of the fleet): its retries on the held shards
/// must not disturb the shards it owns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standing_by_on_some_shards_leaves_the_owned_ones_alone() {
    let env = TestEnv::new("standby-mixed").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(50))).await;
    let low: Vec<u16> = (0..SHARDS / 2).collect();
    let high: Vec<u16> = (SHARDS / 2..SHARDS).collect();

    let mut owner = Worker::start(
        &env,
        "low",
        &downstream.url(),
        &["--assign", &format!("0-{}", SHARDS / 2 - 1)],
    );
    owner.wait_log_shards("shard active", &low, STARTUP).await;
    let mut mixed = Worker::start(
        &env,
        "mixed",
        &downstream.url(),
        &["--standby-retry", "200ms"],
    );
    mixed.wait_log_shards("shard active", &high, STARTUP).await;
    mixed.wait_log_shards("standing by", &low, STARTUP).await;
    let statuses = env.shard_statuses(&conn).await;
    assert!(
        statuses.iter().all(|s| s.consumers == 1),
        "a shard without exactly one consumer while `mixed` owns {high:?} and stands by \
         on {low:?}: {statuses:?}"
    );

    // About 25 events per shard at 50 ms each: several standby retries long.
    let events = interleaved(&order_ids("mixed", 40), 5, env.shards);
    Publisher::connect(&env).await.publish(&events).await;
    downstream
        .wait_for("every event", PROCESSING, |calls| all_ok(calls, &events))
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;

    let calls = downstream.calls();
    assert_in_order_and_complete(&calls, &events);
    // Nothing crashed, so nothing may be handled twice.
    assert_exactly_once(&calls, &events);
    let activations = mixed.logged_shard_counts("shard active");
    assert!(
        high.iter().all(|s| activations.get(s) == Some(&1)),
        "worker `mixed` lost and re-took its own shards {high:?} while standing by on \
         {low:?} (`shard active` lines per shard: {activations:?}); log tail:\n{}",
        mixed.log_tail(30)
    );
    assert!(
        low.iter().all(|s| !activations.contains_key(s)),
        "worker `mixed` took a shard `low` holds: {activations:?}"
    );
}
