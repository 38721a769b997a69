//! SIGTERM: stop consuming, finish and ack the in-flight event, exit 0; a
//! restarted worker delivers the rest.

use std::time::{Duration, Instant};

use shardline_testkit::{
    ChildWorker, Downstream, Event, PROCESSING, Publisher, Reply, STARTUP, TestEnv, all_ok,
    assert_exactly_once, assert_in_order_and_complete, describe, interleaved, ok_keys, order_ids,
    wait_until,
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

/// After a graceful stop the status says so at once: the shards have no
/// owner, and an event published since waits with a backlog age; the
/// command exits 3 (attention: events and no consumer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_graceful_stop_the_status_shows_no_owner_at_once() {
    let env = TestEnv::new("stopped").await;
    env.apply_topology().await;
    let mut worker = ChildWorker::start(&env, "leaving", "noop", &[]);
    worker.wait_consuming(&env).await;
    let owners = |json: &serde_json::Value| -> Vec<Option<String>> {
        json["shards"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| s["owner"].as_str().map(str::to_owned))
            .collect()
    };
    let status = || async {
        let out = env.cli(&["topology", "status", "--json"]).await;
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        (out.status.code(), json)
    };
    wait_until(
        "the status to name the worker as every shard's owner",
        STARTUP,
        || async {
            let (_, json) = status().await;
            let owners = owners(&json);
            shardline_testkit::wait::check(
                owners.len() == usize::from(env.shards.get())
                    && owners.iter().all(|o| o.as_deref() == Some("leaving")),
                || format!("owners {owners:?}"),
            )
        },
    )
    .await;

    worker.sigterm();
    let exit = worker.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(exit.code(), Some(0), "{}", worker.log_tail(20));
    let event = Event::new("stopped-1", 1, env.shards);
    Publisher::connect(&env)
        .await
        .publish(std::slice::from_ref(&event))
        .await;

    let (code, json) = status().await;
    assert_eq!(
        owners(&json),
        vec![None; usize::from(env.shards.get())],
        "a stopped worker still owns shards: {json:#}"
    );
    let shard = &json["shards"][usize::from(event.shard)];
    assert_eq!(shard["stopped"]["owner"], "leaving", "{json:#}");
    assert_eq!(shard["messages"], 1, "{json:#}");
    assert!(shard["backlog_age_seconds"].is_number(), "{json:#}");
    assert_eq!(
        code,
        Some(3),
        "events wait and nobody consumes them: {json:#}"
    );
}
