//! Two workers on the same shards: one active consumer per shard; the standby
//! takes over when the active worker is killed (classic queues: exclusive
//! consumers; quorum queues: the queue's single-active-consumer).

use std::time::Duration;

use crate::harness::{
    Downstream, PROCESSING, Publisher, QueueType, Reply, SHARDS, STARTUP, TestEnv, Worker, all_ok,
    assert_exactly_once, assert_in_order_and_complete, describe, interleaved, ok_keys, order_ids,
    repeats_per_shard,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_takes_over_from_a_killed_worker() {
    standby_takes_over(QueueType::Classic).await;
}

/// On quorum queues both workers consume every shard queue; the queue's
/// single-active-consumer keeps exactly one of them active per shard, and makes
/// the standby's consumer active when the active worker dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_takes_over_from_a_killed_worker_on_quorum_queues() {
    standby_takes_over(QueueType::Quorum).await;
}

async fn standby_takes_over(queue_type: QueueType) {
    let env = TestEnv::with_queue_type("standby", queue_type).await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(15))).await;
    let flags = ["--standby-retry", "200ms"];
    let taken = env.taken_log_line();
    // Classic: the standby waits outside the queue (its exclusive consume is
    // refused); quorum: it is a second, inactive consumer of every queue.
    let consumers_with_standby: u32 = if env.is_quorum() { 2 } else { 1 };

    let mut active = Worker::start(&env, "active", &downstream.url(), &flags);
    active.wait_consuming(&env, &conn).await;
    active.wait_log_all_shards(taken, STARTUP).await;
    let mut standby = Worker::start(&env, "standby", &downstream.url(), &flags);
    standby.wait_standing_by(&env).await;
    // A passive declare counts the active consumer only (quorum queues leave
    // waiting single-active consumers out of it).
    let statuses = env.shard_statuses(&conn).await;
    assert!(
        statuses.iter().all(|s| s.consumers == 1),
        "a shard without exactly one active consumer while both workers run: {statuses:?}"
    );
    if let Some(wrong) = env
        .active_owner_mismatch("active", consumers_with_standby)
        .await
    {
        panic!("while both workers run: {wrong}");
    }
    if !env.is_quorum() {
        assert!(
            standby.logged_shards(taken).is_empty(),
            "the standby claims shards the active worker holds:\n{}",
            standby.log_tail(40)
        );
    }

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
        standby.logged_shards(taken).len(),
        usize::from(SHARDS),
        "the standby did not take every shard:\n{}",
        standby.log_tail(40)
    );
    let statuses = env.shard_statuses(&conn).await;
    assert!(statuses.iter().all(|s| s.consumers == 1), "{statuses:?}");
    if let Some(wrong) = env.active_owner_mismatch("standby", 1).await {
        panic!("after the active worker was killed: {wrong}");
    }

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
