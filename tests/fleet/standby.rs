//! Two workers on the same shards: one active consumer per shard; the standby
//! takes over when the active worker is killed (classic queues: exclusive
//! consumers; quorum queues: the queue's single-active-consumer).

use std::collections::BTreeMap;
use std::time::Duration;

use shardline_testkit::env::ConsumerRow;
use shardline_worker::ShardState;

use shardline_testkit::{
    ChildWorker, Downstream, PROCESSING, Publisher, QueueType, Reply, SHARDS, STARTUP, TestEnv,
    Worker, all_ok, assert_exactly_once, assert_in_order_and_complete, describe, interleaved,
    ok_keys, order_ids, repeats_per_shard,
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
    // Classic: the standby waits outside the queue (its exclusive consume is
    // refused); quorum: it is a second, inactive consumer of every queue.
    let consumers_with_standby: u32 = if env.is_quorum() { 2 } else { 1 };

    // A process: the point is kill -9 of the active worker.
    let mut active = ChildWorker::start(
        &env,
        "active",
        &downstream.url(),
        &["--standby-retry", "200ms"],
    );
    active.wait_consuming(&env).await;
    let mut standby = {
        let mut config = env.worker_config("standby");
        config.standby_retry = Duration::from_millis(200);
        Worker::spawn(config, downstream.handler())
    };
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
        // It never held a shard: every shard standing by, nothing handled.
        assert!(
            standby.progress().all_standing_by() && standby.counts().handler_attempts == 0,
            "the standby claims shards the active worker holds: {}",
            standby.describe()
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
    assert!(
        standby.progress().all_consuming(),
        "the standby did not take every shard: {}",
        standby.describe()
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

    let low_ids = env
        .shards
        .ids()
        .filter(|id| low.contains(&id.get()))
        .collect();
    let owner = env
        .start_worker("low", &downstream, |c| c.assign = low_ids)
        .await;
    let mut mixed = {
        let mut config = env.worker_config("mixed");
        config.standby_retry = Duration::from_millis(200);
        Worker::spawn(config, downstream.handler())
    };
    mixed.wait_consuming_shards(&env, &high).await;
    mixed.wait_standing_by_shards(&env, &low).await;
    let statuses = env.shard_statuses(&conn).await;
    assert!(
        statuses.iter().all(|s| s.consumers == 1),
        "a shard without exactly one consumer while `mixed` owns {high:?} and stands by \
         on {low:?}: {statuses:?}"
    );
    // The channel of each of `mixed`'s consumers: a shard lost and taken again
    // would be on a new one.
    let channels_of_mixed =
        |all: &BTreeMap<String, Vec<ConsumerRow>>| -> BTreeMap<u16, Vec<String>> {
            high.iter()
                .map(|&s| {
                    let tag = format!("mixed/shard-{s}");
                    let rows = all
                        .get(&env.shard_queue(s))
                        .map(Vec::as_slice)
                        .unwrap_or_default();
                    (
                        s,
                        rows.iter()
                            .filter(|r| r.tag == tag)
                            .map(|r| r.channel.clone())
                            .collect(),
                    )
                })
                .collect()
        };
    let channels_before = channels_of_mixed(&env.shard_consumers().await);
    assert!(
        channels_before.values().all(|c| c.len() == 1),
        "one consumer of `mixed` per owned shard: {channels_before:?}"
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
    let consumers = env.shard_consumers().await;
    let channels_after = channels_of_mixed(&consumers);
    assert_eq!(
        channels_after,
        channels_before,
        "worker `mixed` lost and re-took its own shards {high:?} while standing by on \
         {low:?} (its consumers' channels changed); {}",
        mixed.describe()
    );
    assert_eq!(
        mixed.states(&high),
        vec![ShardState::Consuming; high.len()],
        "{}",
        mixed.describe()
    );
    assert_eq!(
        mixed.states(&low),
        vec![ShardState::StandingBy; low.len()],
        "{}",
        mixed.describe()
    );
    assert_eq!(mixed.counts().broker_reconnects, 0, "{}", mixed.describe());
    // Each worker handled exactly the events of its own shards: `mixed` never
    // took a shard `low` holds.
    let on = |shards: &[u16]| events.iter().filter(|e| shards.contains(&e.shard)).count() as u64;
    assert_eq!(mixed.counts().processed, on(&high), "{}", mixed.describe());
    assert_eq!(owner.counts().processed, on(&low), "{}", owner.describe());
    for &shard in &low {
        let tags: Vec<&str> = consumers
            .get(&env.shard_queue(shard))
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|r| r.tag.as_str())
            .collect();
        assert_eq!(
            tags,
            [format!("low/shard-{shard}")],
            "worker `mixed` took a shard `low` holds: {consumers:?}"
        );
    }
}
