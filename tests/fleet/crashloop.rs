//! Crash-loop protection (SPEC §3): an event whose handler kills the worker
//! process is counted across restarts and, after `--max-deliveries` handler
//! starts that never finished, dead-lettered `crash-loop`, so the shard moves on.
//!
//! The worker here is `shardline-abort-worker` (tests/support/abort_worker.rs):
//! `shardline_worker::run` with a handler that calls `std::process::abort()` on
//! an event with `data.poison == true` and forwards the others over HTTP.

use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use shardline_topology::NewEvent;
use tokio::process::{Child, Command};

use crate::harness::{
    Downstream, Event, PROCESSING, Publisher, QueueType, STARTUP, TestEnv, all_ok,
    assert_exactly_once, describe, dlq,
};

const BIN: &str = env!("CARGO_BIN_EXE_shardline-abort-worker");
const MAX_DELIVERIES: u32 = 3;
/// Restarts allowed before the test gives up on the worker ever moving on.
const MAX_RESTARTS: u32 = 10;
const SIGABRT: i32 = 6;

/// One run of the abort worker, its output in its own log file.
struct Run {
    child: Child,
    log: PathBuf,
}

impl Run {
    fn start(env: &TestEnv, handler_url: &str, n: u32) -> Self {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fleet");
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join(format!("{}-abort-worker-{n}.log", env.id));
        let file = File::create(&log).unwrap();
        // No core dump per abort: `ulimit -c 0`, then exec the worker itself (so
        // its exit status is the worker's).
        let child = Command::new("sh")
            .args(["-c", "ulimit -c 0; exec \"$0\" \"$@\"", BIN])
            .args(["--amqp-url", &env.amqp_url])
            .args(["--redis-url", crate::harness::env::REDIS_URL])
            .args(["--redis-prefix", &env.redis_prefix])
            .args(["--shards", &env.shards.get().to_string()])
            .args(["--handler-url", handler_url])
            .args(["--max-deliveries", &MAX_DELIVERIES.to_string()])
            .args(["--worker-name", &format!("abort-{n}")])
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info,lapin=off")
            .env(env.queue_type_env().0, env.queue_type_env().1)
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self { child, log }
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        format!(
            "---- {} ----\n{}",
            self.log.display(),
            all[all.len().saturating_sub(lines)..].join("\n")
        )
    }
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
        order_id: order.into(),
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
    let deadline = Instant::now() + PROCESSING;
    let mut runs: Vec<Run> = vec![Run::start(&env, &downstream.url(), 0)];
    let mut aborts = 0;
    loop {
        let current = runs.last_mut().unwrap();
        if let Some(status) = current.exited() {
            let logs: Vec<String> = runs.iter().map(|r| r.log_tail(15)).collect();
            assert_eq!(
                status.signal(),
                Some(SIGABRT),
                "the worker exited ({status}) other than by abort\n{}",
                logs.join("\n")
            );
            aborts += 1;
            assert!(
                aborts <= MAX_RESTARTS,
                "the worker aborted {aborts} times: the poison event was never dead-lettered\n{}\n{}",
                logs.join("\n"),
                describe(&downstream.calls())
            );
            runs.push(Run::start(&env, &downstream.url(), aborts));
            continue;
        }
        if all_ok(&downstream.calls(), std::slice::from_ref(&e3))
            && dlq::depth(&env, &conn).await >= 1
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after {aborts} abort(s) and {PROCESSING:?}, seq 3 not processed or nothing \
             dead-lettered (DLQ depth {})\n{}\n{}",
            dlq::depth(&env, &conn).await,
            runs.iter()
                .map(|r| r.log_tail(15))
                .collect::<Vec<_>>()
                .join("\n"),
            describe(&downstream.calls())
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
    let pid = last.child.id().unwrap();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -TERM {pid} failed");
    let exit = tokio::time::timeout(STARTUP, last.child.wait()).await;
    let log = last.log_tail(20);
    match exit {
        Ok(status) => assert!(
            status.as_ref().is_ok_and(ExitStatus::success),
            "after SIGTERM the worker exited with {status:?}\n{log}"
        ),
        Err(_) => panic!("the worker still runs {STARTUP:?} after SIGTERM\n{log}"),
    }
}
