//! The elastic fleet (`worker --assign auto`): members join and leave under a
//! steady publish; shards spread evenly, move without loss or repeats on a
//! graceful stop, and are consumed again within seconds of a kill -9.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use shardline_testkit::{
    ChildWorker, Downstream, Event, Publisher, TestEnv, assert_in_order_and_complete, interleaved,
    max_in_flight_per_shard, order_ids, repeats_per_shard, wait_all_answered,
};

/// The handler of members in tests that publish nothing.
const UNUSED: &str = "http://127.0.0.1:1/unused";

/// `shardline worker --assign auto --member-id NAME` calling `handler`.
fn member(env: &TestEnv, name: &str, handler: &str) -> ChildWorker {
    ChildWorker::start(
        env,
        name,
        handler,
        &["--assign", "auto", "--member-id", name],
    )
}

/// Publishes `events` in batches of `batch`, pausing `pause` between them
/// until `hurry` is set (then the rest goes out at once).
async fn publish_paced(
    env: &TestEnv,
    events: Vec<Event>,
    batch: usize,
    pause: Duration,
    hurry: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let publisher = Publisher::connect(env).await;
    tokio::spawn(async move {
        for chunk in events.chunks(batch) {
            publisher.publish(chunk).await;
            if !hurry.load(Ordering::SeqCst) {
                tokio::time::sleep(pause).await;
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_join_leave_and_die_under_a_steady_publish() {
    let env = TestEnv::new("elastic").await.with_shards(12);
    env.apply_topology().await;
    let downstream = Downstream::with_latency(Duration::from_millis(2)).await;
    let start = |name: &str| member(&env, name, &downstream.url());

    // A steady publish of ordered events throughout.
    let events = interleaved(&order_ids("elastic", 48), 30, env.shards);
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = publish_paced(
        &env,
        events.clone(),
        12,
        Duration::from_millis(60),
        stop.clone(),
    )
    .await;

    let mut a = start("a");
    env.wait_spread(&[("a", 12)], Duration::from_secs(30)).await;
    let mut b = start("b");
    let balanced_b = env
        .wait_spread(&[("a", 6), ("b", 6)], Duration::from_secs(30))
        .await;
    let mut c = start("c");
    let balanced_c = env
        .wait_spread(&[("a", 4), ("b", 4), ("c", 4)], Duration::from_secs(30))
        .await;

    b.sigterm();
    let status = b.wait_exit(Duration::from_secs(30)).await;
    assert!(status.success(), "b: {status}\n{}", b.log_tail(30));
    let moved_b = env
        .wait_spread(&[("a", 6), ("c", 6)], Duration::from_secs(30))
        .await;

    c.kill9();
    let killed = Instant::now();
    env.wait_spread(&[("a", 12)], Duration::from_secs(30)).await;
    let consumed_again = killed.elapsed();

    stop.store(true, Ordering::SeqCst);
    publisher.await.unwrap();
    let calls = wait_all_answered(&env, &downstream, &events).await;
    assert_in_order_and_complete(&calls, &events);
    let repeats = repeats_per_shard(&calls, &env);
    assert!(
        repeats.values().all(|n| *n <= 1),
        "more than one repeated call on a shard (one kill -9): {repeats:?}"
    );
    let in_flight = max_in_flight_per_shard(&calls, &env);
    assert!(
        in_flight.values().all(|n| *n <= 1),
        "two calls of one shard overlapped at --concurrency 1: {in_flight:?}"
    );
    assert!(
        consumed_again <= Duration::from_secs(12),
        "c's shards consumed again {consumed_again:?} after its kill -9"
    );
    eprintln!(
        "elastic: b joined → balanced {balanced_b:?}; c joined → balanced {balanced_c:?}; \
         b stopped → its shards consumed {moved_b:?}; c killed → consumed again {consumed_again:?}"
    );
    a.sigterm();
    a.wait_exit(Duration::from_secs(30)).await;
}

/// A member restarted with the same id within its lease gets its shards back;
/// nobody else takes them meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_restarted_within_its_lease_keeps_its_shards() {
    let env = TestEnv::new("elastic-restart").await.with_shards(6);
    env.apply_topology().await;
    let mut a = member(&env, "a", UNUSED);
    env.wait_spread(&[("a", 6)], Duration::from_secs(30)).await;
    let mut b = member(&env, "b", UNUSED);
    env.wait_spread(&[("a", 3), ("b", 3)], Duration::from_secs(30))
        .await;
    let before = env.consuming_workers().await;

    b.kill9();
    env.wait_spread(&[("a", 3)], Duration::from_secs(30)).await;
    let _b = member(&env, "b", UNUSED);
    env.wait_spread(&[("a", 3), ("b", 3)], Duration::from_secs(30))
        .await;
    assert_eq!(env.consuming_workers().await, before, "a shard moved");
    a.assert_running("the end");
}

/// A worker with a fixed `--assign` next to `auto` members: they leave the
/// shards it consumes alone and share the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_members_leave_a_fixed_workers_shards_alone() {
    let env = TestEnv::new("elastic-static").await.with_shards(6);
    env.apply_topology().await;
    let mut fixed = ChildWorker::start(&env, "s", "noop", &["--assign", "0-1"]);
    env.wait_spread(&[("s", 2)], Duration::from_secs(30)).await;
    let _a = member(&env, "a", UNUSED);
    let _b = member(&env, "b", UNUSED);
    env.wait_spread(&[("s", 2), ("a", 2), ("b", 2)], Duration::from_secs(30))
        .await;
    let owners = env.consuming_workers().await;
    assert_eq!((owners[&0].as_str(), owners[&1].as_str()), ("s", "s"));
    fixed.assert_running("the end");
}

/// A rolling restart of three members, one at a time, each waiting for the
/// fleet to be balanced again: nothing lost, order kept, no repeated call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_loses_and_repeats_nothing() {
    let env = TestEnv::new("elastic-rolling").await.with_shards(6);
    env.apply_topology().await;
    let downstream = Downstream::with_latency(Duration::from_millis(2)).await;
    let start = |name: &str| member(&env, name, &downstream.url());
    let events = interleaved(&order_ids("rolling", 24), 40, env.shards);
    let mut members = [start("a"), start("b"), start("c")];
    let balanced = [("a", 2), ("b", 2), ("c", 2)];
    env.wait_spread(&balanced, Duration::from_secs(30)).await;
    let never = Arc::new(AtomicBool::new(false));
    let publisher = publish_paced(&env, events.clone(), 8, Duration::from_millis(40), never).await;
    for member in &mut members {
        let name = member.name.clone();
        member.sigterm();
        let status = member.wait_exit(Duration::from_secs(30)).await;
        assert!(status.success(), "{name}: {status}");
        *member = start(&name);
        env.wait_spread(&balanced, Duration::from_secs(30)).await;
    }
    publisher.await.unwrap();
    let calls = wait_all_answered(&env, &downstream, &events).await;
    assert_in_order_and_complete(&calls, &events);
    let repeats = repeats_per_shard(&calls, &env);
    assert!(
        repeats.values().all(|n| *n == 0),
        "a graceful restart repeated calls: {repeats:?}"
    );
}

/// A member that handed shards over keeps an idle task per shard it does not
/// hold. When its consuming connection is lost, those idle tasks end too, so
/// that it reconnects and consumes its shards again. (Found by the chaos
/// soak: the idle tasks never saw the loss, and the member waited on them —
/// its shards unconsumed — until it was restarted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_handed_shards_over_reconnects_after_losing_its_connection() {
    let env = TestEnv::new("elastic-reconnect").await.with_shards(4);
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let mut a = member(&env, "a", &downstream.url());
    env.wait_spread(&[("a", 4)], Duration::from_secs(30)).await;
    let mut b = member(&env, "b", &downstream.url());
    env.wait_spread(&[("a", 2), ("b", 2)], Duration::from_secs(30))
        .await;

    let pid = env
        .broker()
        .one_connection(&env.vhost, "shardline worker a shards")
        .await;
    env.broker().close_connection(&pid).await;
    shardline_testkit::wait_until(
        "member a to reconnect",
        shardline_testkit::STARTUP,
        || async {
            let log = a.log_text();
            if log.contains("reconnected to the broker") {
                Ok(())
            } else {
                Err(a.log_tail(5))
            }
        },
    )
    .await;
    env.wait_spread(&[("a", 2), ("b", 2)], Duration::from_secs(30))
        .await;

    let events = interleaved(&order_ids("elastic-reconnect", 16), 3, env.shards);
    Publisher::connect(&env).await.publish(&events).await;
    let calls = wait_all_answered(&env, &downstream, &events).await;
    assert_in_order_and_complete(&calls, &events);
    a.assert_running("after the reconnect");
    b.assert_running("after a's reconnect");
}
