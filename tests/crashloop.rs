//! Crash-loop protection (docs/semantics.md §3): an event whose handler kills the worker
//! process is counted across restarts and, after `--max-deliveries` handler
//! starts that never finished, dead-lettered `crash-loop`, so the shard moves on.
//!
//! The worker here is `shardline-abort-worker` (tests/support/abort_worker.rs):
//! `shardline_worker::run` with a handler that calls `std::process::abort()` on
//! an event with `data.poison == true` and forwards the others over HTTP.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::ExitStatusExt;

use shardline_contract::NewEvent;
use tokio::process::Command;

use shardline_testkit::{
    ChildWorker, Downstream, Event, PROCESSING, Publisher, QueueType, STARTUP, TestEnv, all_ok,
    assert_exactly_once, describe, dlq, wait_until,
};

const BIN: &str = env!("CARGO_BIN_EXE_shardline-abort-worker");
const MAX_DELIVERIES: u32 = 3;
/// Restarts allowed before the test gives up on the worker ever moving on.
const MAX_RESTARTS: u32 = 10;
const SIGABRT: i32 = 6;

/// One run of the abort worker (a process: the point is that it aborts).
fn start_run(env: &TestEnv, handler_url: &str, n: u32) -> ChildWorker {
    // No core dump per abort: `ulimit -c 0`, then exec the worker itself (so
    // its exit status is the worker's).
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "ulimit -c 0; exec \"$0\" \"$@\"", BIN])
        .args(["--amqp-url", &env.amqp_url])
        .args(["--redis-url", shardline_testkit::env::REDIS_URL])
        .args(["--redis-prefix", &env.redis_prefix])
        .args(["--shards", &env.shards.get().to_string()])
        .args(["--handler-url", handler_url])
        .args(["--max-deliveries", &MAX_DELIVERIES.to_string()])
        .args(["--worker-name", &format!("abort-{n}")])
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "info,lapin=off")
        .env(env.queue_type_env().0, env.queue_type_env().1);
    ChildWorker::spawn(env, &format!("abort-worker-{n}"), cmd)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_that_kills_the_worker_is_dead_lettered_crash_loop() {
    dead_lettered_crash_loop(QueueType::Classic).await;
}

/// On quorum queues each abort also returns the event to the queue with its
/// `x-delivery-count` raised; with `--max-deliveries` (3) far below the
/// queue's delivery limit (20), the worker's own count still decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_that_kills_the_worker_is_dead_lettered_crash_loop_on_quorum_queues() {
    dead_lettered_crash_loop(QueueType::Quorum).await;
}

async fn dead_lettered_crash_loop(queue_type: QueueType) {
    let env = TestEnv::with_queue_type("crashloop", queue_type).await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let downstream = Downstream::start().await;

    let order = "crashloop-o";
    let e1 = Event::new(order, 1, env.shards);
    let mut poison = Event::new(order, 2, env.shards);
    poison.body = NewEvent {
        order_id: shardline_contract::OrderId::new(order).unwrap(),
        event: poison.event.clone(),
        seq: Some(2),
        event_id: None,
        data: serde_json::json!({ "poison": true }),
    }
    .to_body()
    .unwrap();
    let e3 = Event::new(order, 3, env.shards);
    Publisher::connect(&env)
        .await
        .publish(&[e1.clone(), poison.clone(), e3.clone()])
        .await;

    // Restart the worker each time it aborts, until seq 3 got through and the
    // poison event is in the DLQ.
    let mut runs: Vec<ChildWorker> = vec![start_run(&env, &downstream.url(), 0)];
    let mut aborts = 0;
    let downstream_url = downstream.url();
    let (runs_ref, aborts_ref) = (&mut runs, &mut aborts);
    wait_until("seq 3 processed and the poison event dead-lettered", PROCESSING, || {
        let current = runs_ref.last_mut().unwrap();
        if let Some(status) = current.exited() {
            let logs: Vec<String> = runs_ref.iter().map(|r| r.log_tail(15)).collect();
            assert_eq!(
                status.signal(),
                Some(SIGABRT),
                "the worker exited ({status}) other than by abort\n{}",
                logs.join("\n")
            );
            *aborts_ref += 1;
            let aborts = *aborts_ref;
            assert!(
                aborts <= MAX_RESTARTS,
                "the worker aborted {aborts} times: the poison event was never dead-lettered\n{}\n{}",
                logs.join("\n"),
                describe(&downstream.calls())
            );
            runs_ref.push(start_run(&env, &downstream_url, aborts));
        }
        let context = format!(
            "after {} abort(s): {}\n{}",
            *aborts_ref,
            runs_ref.iter().map(|r| r.log_tail(15)).collect::<Vec<_>>().join("\n"),
            describe(&downstream.calls())
        );
        let (env, conn, downstream, e3) = (&env, &conn, &downstream, &e3);
        async move {
            let dlq = dlq::depth(env, conn).await;
            if all_ok(&downstream.calls(), std::slice::from_ref(e3)) && dlq >= 1 {
                Ok(())
            } else {
                Err(format!("DLQ depth {dlq}; {context}"))
            }
        }
    })
    .await;
    let all_logs = || {
        runs.iter()
            .map(|r| r.log_tail(20))
            .collect::<Vec<_>>()
            .join("\n")
    };

    // One handler start per run that aborted; the next run's claim found
    // MAX_DELIVERIES unfinished starts and dead-lettered the event.
    assert_eq!(
        aborts,
        MAX_DELIVERIES,
        "expected exactly {MAX_DELIVERIES} aborts before `crash-loop`\n{}",
        all_logs()
    );
    let letters = dlq::take(&env, &conn, 1, PROCESSING).await;
    let report = dlq::describe(&letters);
    assert_eq!(letters.len(), 1, "dead letters:\n{report}");
    assert_eq!(dlq::reason(&letters[0]), "crash-loop", "{report}");
    assert_eq!(
        dlq::retry_count(&letters[0]),
        Some(i64::from(MAX_DELIVERIES)),
        "x-retry-count: handler starts that never finished\n{report}"
    );
    assert_eq!(letters[0].data, poison.body, "the original body\n{report}");

    env.wait_shard_queues_drained(PROCESSING).await;
    let calls = downstream.calls();
    assert_exactly_once(&calls, &[e1, e3]);

    // The last run is healthy: SIGTERM drains and exits 0.
    let last = runs.last_mut().unwrap();
    last.sigterm();
    let status = last.wait_exit(STARTUP).await;
    assert!(
        status.success(),
        "after SIGTERM the worker exited with {status:?}\n{}",
        last.log_tail(20)
    );
}
