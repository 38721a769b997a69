//! SIGTERM: stop consuming, finish and ack the in-flight event, exit 0; a
//! restarted worker delivers the rest.

use std::time::{Duration, Instant};

use shardline_testkit::{
    ChildWorker, Downstream, PROCESSING, Publisher, Reply, TestEnv, all_ok, assert_exactly_once,
    assert_in_order_and_complete, describe, interleaved, ok_keys, order_ids,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_in_flight_event_and_exits_0() {
    let env = TestEnv::new("stop").await;
    env.apply_topology().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(200))).await;
    let events = interleaved(&order_ids("stop", 64), 2, env.shards);
    Publisher::connect(&env).await.publish(&events).await;

    // A process: the point is SIGTERM and the exit code.
    let mut first = ChildWorker::start(&env, "first", &downstream.url(), &[]);
    first.wait_consuming(&env).await;
    downstream
        .wait_for("16 calls", PROCESSING, |calls| calls.len() >= 16)
        .await;
    let signalled = Instant::now();
    first.sigterm();
    let arrived_before_signal = downstream.calls().len();
    let status = first.wait_exit(Duration::from_secs(10)).await;
    let took = signalled.elapsed();
    assert_eq!(
        status.code(),
        Some(0),
        "SIGTERM must exit 0 (took {took:?}); log tail:\n{}",
        first.log_tail(40)
    );

    let calls = downstream.calls();
    let done = ok_keys(&calls).len();
    assert!(
        done < events.len(),
        "the stream ended before SIGTERM: the test proves nothing"
    );
    let abandoned: Vec<_> = calls[..arrived_before_signal]
        .iter()
        .filter(|c| !c.completed)
        .collect();
    assert!(
        abandoned.is_empty(),
        "calls in flight at SIGTERM were abandoned: {abandoned:?}"
    );
    // Each event the downstream completed was acked; nothing else was.
    let backlog = env.shard_backlog().await;
    assert_eq!(
        backlog,
        (events.len() - done) as u64,
        "after exit the shard queues hold {backlog} of {} events, {done} of which were \
         processed:\n{}",
        events.len(),
        describe(&calls)
    );

    let _second = env.start_worker("second", &downstream, |_| {}).await;
    downstream
        .wait_for("every event after the restart", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    let calls = downstream.calls();
    assert_in_order_and_complete(&calls, &events);
    assert_exactly_once(&calls, &events);
}
