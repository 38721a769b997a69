//! Redis dies mid-stream (SIGKILL of a private, non-persistent server) and comes
//! back empty on the same port. docs/semantics.md §3 "Outages": no processing without
//! dedup, so the shards pause, the outage is counted (and logged) once,
//! `/readyz` says Redis is unreachable, and processing resumes by itself when
//! Redis returns.

use std::time::Duration;

use shardline_testkit::metrics::{free_addr, get, wait_ok};
use shardline_testkit::redis::RedisServer;
use shardline_testkit::wait::check;
use shardline_testkit::{
    Downstream, PROCESSING, Publisher, Reply, STARTUP, TestEnv, assert_in_order_and_complete,
    describe, interleaved, ok_keys, orders_covering_shards, wait_all_answered, wait_until,
};

use crate::assert_nothing_dead_lettered;

/// How long the downstream must stay silent while Redis is down. A pause is the
/// absence of calls, which no event can signal, so this is a fixed observation
/// window: without the pause the 8 shards would make ~300 calls in it.
const PAUSE_WINDOW: Duration = Duration::from_millis(1500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kills a Redis server and watches timing: scripts/test runs it alone"]
async fn redis_outage_pauses_the_shards_and_they_resume() {
    let env = TestEnv::new("redis-outage").await;
    env.apply_topology().await;
    let mut redis = RedisServer::start(&env.id).await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(25))).await;
    let events = interleaved(&orders_covering_shards("redis", 20, &env), 5, env.shards);

    let addr = free_addr();
    let redis_url = redis.url();
    let mut worker = env
        .start_worker("redis", &downstream, |c| {
            c.redis = redis_url.parse().unwrap();
            c.metrics_addr = Some(addr);
        })
        .await;
    wait_ok(addr, "/readyz", STARTUP).await;
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
        "the worker to count the Redis outage",
        PROCESSING,
        || async { check(worker.counts().redis_outages >= 1, || worker.describe()) },
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
    worker.assert_running().await;
    let (status, ready) = get(addr, "/readyz").await.expect("/readyz answers");
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    assert!(
        status != 200 && ready["redis"] == "unreachable",
        "/readyz while Redis is down: {status} {ready}"
    );
    // Nothing was acked without its dedup commit: what was not committed is
    // still in the queues.
    let backlog = env.shard_backlog().await;
    let done = ok_keys(&paused).len() as u64;
    assert!(
        backlog >= events.len() as u64 - done,
        "{backlog} events left in the queues, but only {done} of {} processed",
        events.len()
    );

    redis.restart().await;
    let calls = wait_all_answered(&env, &downstream, &events).await;
    assert_nothing_dead_lettered(&env).await;

    // The dedup state went with the server: repeats are allowed, gaps and
    // reordering are not.
    assert_in_order_and_complete(&calls, &events);
    assert_eq!(
        worker.counts().redis_outages,
        1,
        "the outage should be counted (and logged) once per worker: {}",
        worker.describe()
    );
    // Recovered: ready again, Redis reachable.
    let ready: serde_json::Value =
        serde_json::from_str(&wait_ok(addr, "/readyz", STARTUP).await).unwrap();
    assert_eq!(
        ready["redis"], "reachable",
        "the recovery should show: {ready}"
    );
    worker.assert_running().await;
    eprintln!(
        "redis outage: {} events, {} calls, {} before the kill",
        events.len(),
        calls.len(),
        paused.len()
    );
}

/// With `--concurrency` every shard's calls share one Redis connection
/// through forks of its slot; after each outage — a server paused long enough
/// for requests to time out on a live connection, then a kill — they must
/// all move to the new connection and give the old one back, or a few outages
/// exhaust the pool and a shard waits for a connection forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kills a Redis server: scripts/test runs it alone"]
async fn at_concurrency_every_shard_resumes_after_repeated_outages() {
    let env = TestEnv::new("redis-outage-k").await;
    env.apply_topology().await;
    let mut redis = RedisServer::start(&env.id).await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(10))).await;
    let events = interleaved(&orders_covering_shards("redisk", 40, &env), 5, env.shards);
    let redis_url = redis.url();
    let worker = env
        .start_worker("redis-k", &downstream, |c| {
            c.redis = redis_url.parse().unwrap();
            c.concurrency = 4;
        })
        .await;
    Publisher::connect(&env).await.publish(&events).await;

    let client = redis::Client::open(redis.url()).unwrap();
    for outage in 1..=4_u64 {
        let before = ok_keys(&downstream.calls()).len();
        downstream
            .wait_for("more events processed", PROCESSING, |calls| {
                ok_keys(calls).len() >= before + 20
            })
            .await;
        let killed = outage == 4;
        if killed {
            redis.kill9();
        } else {
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            let () = redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(3000)
                .arg("ALL")
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        wait_until("the worker to count the outage", PROCESSING, || async {
            check(worker.counts().redis_outages >= outage, || {
                worker.describe()
            })
        })
        .await;
        if killed {
            redis.restart().await;
        }
    }
    let calls = wait_all_answered(&env, &downstream, &events).await;
    assert_nothing_dead_lettered(&env).await;
    assert_in_order_and_complete(&calls, &events);
    worker.stop().await;
}

/// Redis unreachable for longer than a lease under three `--assign auto`
/// members, then back empty: the leases count as renewed, the assignment is
/// rebuilt from what the members own, and no shard moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kills a Redis server: scripts/test runs it alone"]
async fn a_redis_outage_moves_no_shard_of_an_elastic_fleet() {
    let env = TestEnv::new("redis-fleet").await.with_shards(6);
    env.apply_topology().await;
    let mut redis = RedisServer::start(&env.id).await;
    let member = |name: &str| {
        let mut cmd = env.shardline_command();
        cmd.arg("worker")
            .args(env.global_args_with(&env.amqp_url, &redis.url()))
            .args(["--handler", "noop", "--worker-name", name])
            .args(["--assign", "auto", "--member-id", name]);
        shardline_testkit::ChildWorker::spawn(&env, name, cmd)
    };
    let mut members = [member("a"), member("b"), member("c")];
    env.wait_spread(&[("a", 2), ("b", 2), ("c", 2)], STARTUP)
        .await;
    let before = env.consuming_workers().await;

    redis.kill9();
    // Longer than the 5 s lease: every lease lapses while Redis is away.
    tokio::time::sleep(Duration::from_secs(7)).await;
    redis.restart().await;
    // For two leases after Redis returns, nothing moves.
    let watched = std::time::Instant::now();
    while watched.elapsed() < Duration::from_secs(10) {
        assert_eq!(env.consuming_workers().await, before, "a shard moved");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for m in &mut members {
        m.assert_running("the end");
    }
}
