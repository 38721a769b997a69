//! `shardline reconcile` against orders in PostgreSQL and a real fleet: an
//! order whose event was never processed gets one compensation (a dry run
//! emits none, a second run none either), the worker processes it, and the
//! drift is gone; events held by the gate, in the DLQ or behind a shard
//! backlog older than the grace are pending, never compensated; an event processed
//! before the upgrade to the order state (an old `kind:` key) counts as processed; a
//! broken `--orders-url` is one line without the password; runs while letters
//! sit in the DLQ and a replay moves them never compensate one of them, and a
//! DLQ deeper than its index leaves every missing event pending.

use std::process::Output;
use std::time::Duration;

use serde_json::json;
use shardline_contract::NewEvent;

use shardline_testkit::dlq::{delete_index, depth, run_ok, text, wait_depth, wait_indexed};
use shardline_testkit::{
    Call, ChildWorker, Downstream, Event, OrdersDb, PROCESSING, Publisher, Reply, STARTUP, TestEnv,
    wait_until,
};

const PAID: &str = "payment.captured";
const SETTLED: Duration = Duration::from_secs(600);

pub(crate) async fn reconcile(env: &TestEnv, db: &OrdersDb, extra: &[&str]) -> Output {
    let url = db.url();
    let mut args = vec!["reconcile", "--orders-url", url.as_str()];
    args.extend_from_slice(extra);
    env.cli(&args).await
}

/// `reconcile --json`, which must exit with `code`; its report.
pub(crate) async fn reconcile_json(
    env: &TestEnv,
    db: &OrdersDb,
    extra: &[&str],
    code: i32,
) -> serde_json::Value {
    let mut args = vec!["--json"];
    args.extend_from_slice(extra);
    let out = reconcile(env, db, &args).await;
    assert_eq!(out.status.code(), Some(code), "{}", text(&out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("`reconcile --json` printed no JSON ({e}): {}", text(&out)))
}

fn counts(
    scanned: u64,
    skipped_fresh: u64,
    no_expectation: u64,
    processed: u64,
    pending: u64,
    drifted: u64,
    emitted: u64,
) -> serde_json::Value {
    json!({
        "scanned": scanned, "outside_window": 0, "invalid": 0,
        "skipped_fresh": skipped_fresh, "no_expectation": no_expectation,
        "processed": processed, "pending": pending, "drifted": drifted, "emitted": emitted,
    })
}

/// A `payment.captured` without seq, as a shop's publisher sends it.
fn payment(order_id: &str) -> Vec<u8> {
    payment_with_id(order_id, &format!("pay-{order_id}"))
}

/// A `payment.captured` without seq, with its event id.
pub(crate) fn payment_with_id(order_id: &str, event_id: &str) -> Vec<u8> {
    NewEvent {
        order_id: shardline_contract::OrderId::new(order_id).unwrap(),
        event: PAID.into(),
        seq: None,
        event_id: Some(event_id.into()),
        data: json!({ "amount": 1200 }),
    }
    .to_body()
    .unwrap()
}

/// The downstream's completed 2xx answers for `order_id`.
pub(crate) fn answered(calls: &[Call], order_id: &str) -> usize {
    calls
        .iter()
        .filter(|c| c.order_id.as_deref() == Some(order_id) && c.ok() && c.completed)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_compensates_a_missing_event_once() {
    let env = TestEnv::new("reconcile").await;
    env.apply_topology().await;
    let db = OrdersDb::new(&env).await;
    let downstream = Downstream::start().await;

    // The fleet processes rc-present's payment, then stops: what reconcile
    // emits stays in the queue until a worker runs again.
    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let publisher = Publisher::connect(&env).await;
    publisher
        .publish_raw(env.shard_of("rc-present"), &payment("rc-present"))
        .await;
    downstream
        .wait_for("rc-present's payment", PROCESSING, |calls| {
            answered(calls, "rc-present") == 1
        })
        .await;
    // Acked, so committed: its kind is recorded.
    env.wait_shard_queues_drained(PROCESSING).await;
    worker.stop().await;

    // Processed by a worker of the layout before the order state, which
    // recorded kinds as keys of their own: reconcile still finds it.
    let mut redis = redis::Client::open(shardline_testkit::env::REDIS_URL)
        .unwrap()
        .get_connection()
        .unwrap();
    redis::cmd("SET")
        .arg(env.keys().kind("rc-upgraded", PAID))
        .arg(1)
        .query::<()>(&mut redis)
        .unwrap();
    db.set("rc-upgraded", "PAID", SETTLED).await;
    db.set("rc-missing", "PAID", SETTLED).await;
    db.set("rc-present", "PAID", SETTLED).await;
    db.set("rc-created", "CREATED", SETTLED).await;
    db.set("rc-fresh", "PAID", Duration::from_secs(30)).await;
    db.set("rc-old", "PAID", Duration::from_secs(30 * 3600))
        .await;

    // A dry run reports the drift, emits nothing and asks for attention.
    let dry = reconcile_json(&env, &db, &["--dry-run"], 3).await;
    assert_eq!(dry["counts"], counts(5, 1, 1, 2, 0, 1, 0), "{dry:#}");
    assert_eq!(dry["drift"][0]["compensation"], "would_emit", "{dry:#}");
    assert_eq!(env.shard_backlog().await, 0, "a dry run published");

    let first = reconcile_json(&env, &db, &[], 0).await;
    assert_eq!(first["counts"], counts(5, 1, 1, 2, 0, 1, 1), "{first:#}");
    let drift = &first["drift"][0];
    assert_eq!(drift["order_id"], "rc-missing", "{first:#}");
    assert_eq!(drift["status"], "PAID", "{first:#}");
    assert_eq!(drift["event"], PAID, "{first:#}");
    assert_eq!(
        drift["event_id"],
        format!("reconcile:rc-missing:{PAID}"),
        "{first:#}"
    );
    assert_eq!(drift["compensation"], "emitted", "{first:#}");

    // Not processed yet: nothing new, the compensation is pending.
    let second = reconcile_json(&env, &db, &[], 0).await;
    assert_eq!(second["counts"], counts(5, 1, 1, 2, 1, 0, 0), "{second:#}");
    assert_eq!(second["pending"][0]["order_id"], "rc-missing", "{second:#}");
    assert_eq!(
        second["pending"][0]["reason"], "compensation_emitted",
        "{second:#}"
    );
    assert_eq!(env.shard_backlog().await, 1, "exactly one compensation");

    let _worker = env.start_worker("w2", &downstream, |_| {}).await;
    let calls = downstream
        .wait_for("the compensation", PROCESSING, |calls| {
            answered(calls, "rc-missing") == 1
        })
        .await;
    let call = calls
        .iter()
        .find(|c| c.order_id.as_deref() == Some("rc-missing"))
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(body["compensation"], true, "{body}");
    assert_eq!(body["event"], PAID, "{body}");
    assert_eq!(body["event_id"], format!("reconcile:rc-missing:{PAID}"));
    assert_eq!(body["reason"], format!("status=PAID missing={PAID}"));
    assert!(body.get("seq").is_none(), "{body}");
    assert!(call.header("traceparent").is_some(), "{call:?}");
    env.wait_shard_queues_drained(PROCESSING).await;

    // Processed: no drift left.
    let third = reconcile(&env, &db, &[]).await;
    assert!(third.status.success(), "{}", text(&third));
    let stdout = String::from_utf8_lossy(&third.stdout);
    assert_eq!(
        stdout.lines().last(),
        Some(
            "reconcile: scanned 5, skipped fresh 1, no expectation 1, processed 3, pending 0, drifted 0, emitted 0"
        ),
        "{}",
        text(&third)
    );
    assert_eq!(answered(&downstream.calls(), "rc-missing"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_leaves_events_on_their_way_alone() {
    let env = TestEnv::new("reconcile-pending").await;
    env.apply_topology().await;
    let db = OrdersDb::new(&env).await;
    let conn = env.connect().await;

    // A broken --orders-url: one line naming the flag, no password.
    let out = env
        .cli(&[
            "reconcile",
            "--orders-url",
            "postgres://postgres:s3cret@127.0.0.1:1/test",
        ])
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: --orders-url postgres://postgres:***@127.0.0.1:1/test: ")
            && stderr.lines().count() == 1
            && !stderr.contains("s3cret"),
        "{}",
        text(&out)
    );

    // rc-dlq's payment is rejected (dead-lettered); rc-held's arrives as seq 3
    // of an order the gate has not seen, held for the start grace; rc-behind's
    // waits in its shard queue behind a downstream call for rc-slow that takes
    // 30 s (on a shard of its own among the three).
    let taken = [env.shard_of("rc-dlq"), env.shard_of("rc-held")];
    let (slow, behind) = (0..)
        .map(|i| (format!("rc-slow-{i}"), format!("rc-behind-{i}")))
        .find(|(a, b)| env.shard_of(a) == env.shard_of(b) && !taken.contains(&env.shard_of(a)))
        .unwrap();
    let downstream = Downstream::scripted({
        let slow = slow.clone();
        move |call, _| match call.order_id.as_deref() {
            Some("rc-dlq") => Reply::status(422),
            Some(order) if order == slow => Reply::ok().after(Duration::from_secs(30)),
            _ => Reply::ok(),
        }
    })
    .await;
    let _worker = env
        .start_worker("w1", &downstream, |c| {
            c.start_grace = Duration::from_secs(600);
        })
        .await;
    let publisher = Publisher::connect(&env).await;
    publisher
        .publish_raw(env.shard_of("rc-dlq"), &payment("rc-dlq"))
        .await;
    let held = Event::new("rc-held", 3, env.shards);
    assert_eq!(held.event, PAID);
    publisher.publish(std::slice::from_ref(&held)).await;
    wait_depth(&env, &conn, 1, PROCESSING).await;
    wait_indexed(&env, 1, PROCESSING).await;
    wait_status(&env, held.shard, "rc-held held", |r| {
        r["held"]
            .as_array()
            .is_some_and(|h| h.iter().any(|e| e["order_key"] == "rc-held"))
    })
    .await;
    let slow_shard = env.shard_of(&slow);
    publisher.publish_raw(slow_shard, &payment(&slow)).await;
    publisher.publish_raw(slow_shard, &payment(&behind)).await;
    downstream
        .wait_for("the slow call started", PROCESSING, |calls| {
            calls
                .iter()
                .any(|c| c.order_id.as_deref() == Some(slow.as_str()))
        })
        .await;
    wait_status(&env, slow_shard, "a backlog over 1 s", |r| {
        r["backlog_age_seconds"]
            .as_f64()
            .is_some_and(|age| age > 1.0)
    })
    .await;

    db.set("rc-dlq", "PAID", SETTLED).await;
    db.set("rc-held", "PAID", SETTLED).await;
    db.set(&behind, "PAID", SETTLED).await;
    let report = reconcile_json(&env, &db, &["--grace", "1s"], 0).await;
    assert_eq!(report["counts"], counts(3, 0, 0, 0, 3, 0, 0), "{report:#}");
    let mut reasons: Vec<(String, String)> = report["pending"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["order_id"].as_str().unwrap().to_owned(),
                p["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            (behind.clone(), "backlog".to_owned()),
            ("rc-dlq".to_owned(), "dead_lettered".to_owned()),
            ("rc-held".to_owned(), "held".to_owned())
        ],
        "{report:#}"
    );
    assert_eq!(
        depth(&env, &conn).await,
        1,
        "reconcile must leave the DLQ as it was"
    );
    assert!(
        !downstream
            .calls()
            .iter()
            .any(|c| String::from_utf8_lossy(&c.body).contains("\"compensation\"")),
        "a compensation went out"
    );
}

/// The orders a `reconcile --json` report left pending, with their reasons.
pub(crate) fn pending_reasons(report: &serde_json::Value) -> Vec<(String, String)> {
    let mut reasons: Vec<(String, String)> = report["pending"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["order_id"].as_str().unwrap().to_owned(),
                p["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    reasons.sort();
    reasons
}

/// 12 orders PAID whose payments were dead-lettered (422 until the fix).
/// With the index lost, every run leaves them pending (`index_behind`);
/// reindexed, they are pending as dead letters. Then runs of reconcile
/// follow each other while `dlq replay --rate 6` moves the letters to a
/// downstream that answers after 300 ms: no run emits anything (an order is
/// always in the index or under its replay lock until its payment was
/// processed), every payment reaches the downstream once, and at the end
/// every order is processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_during_a_replay_never_compensates_a_dead_letter() {
    const ORDERS: usize = 12;
    let env = TestEnv::new("reconcile-replay").await;
    env.apply_topology().await;
    let db = OrdersDb::new(&env).await;
    let conn = env.connect().await;
    let fixed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let downstream = Downstream::scripted({
        let fixed = std::sync::Arc::clone(&fixed);
        move |_, _| {
            if fixed.load(std::sync::atomic::Ordering::SeqCst) {
                Reply::ok().after(Duration::from_millis(300))
            } else {
                Reply::status(422)
            }
        }
    })
    .await;
    let _worker = env.start_worker("w1", &downstream, |_| {}).await;
    let publisher = Publisher::connect(&env).await;
    let orders: Vec<String> = (0..ORDERS).map(|i| format!("rr-{i}")).collect();
    for order in &orders {
        publisher
            .publish_raw(env.shard_of(order), &payment(order))
            .await;
        db.set(order, "PAID", SETTLED).await;
    }
    let n = u32::try_from(ORDERS).unwrap();
    wait_depth(&env, &conn, n, PROCESSING).await;
    wait_indexed(&env, ORDERS as u64, PROCESSING).await;

    delete_index(&env).await;
    let lost = reconcile_json(&env, &db, &[], 0).await;
    assert_eq!(lost["counts"]["pending"], ORDERS, "{lost:#}");
    assert!(
        pending_reasons(&lost)
            .iter()
            .all(|(_, r)| r == "index_behind"),
        "{lost:#}"
    );
    run_ok(&env, &["dlq", "reindex"]).await;
    let indexed = reconcile_json(&env, &db, &[], 0).await;
    assert!(
        pending_reasons(&indexed).len() == ORDERS
            && pending_reasons(&indexed)
                .iter()
                .all(|(_, r)| r == "dead_lettered"),
        "{indexed:#}"
    );

    fixed.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut cmd = env.shardline_command();
    cmd.args(["dlq", "replay", "--rate", "6"])
        .args(env.global_args());
    let mut replay = ChildWorker::spawn(&env, "replay", cmd);
    let mut runs = 0;
    let mut during = 0;
    loop {
        let running = replay.exited().is_none();
        let report = reconcile_json(&env, &db, &[], 0).await;
        assert_eq!(report["counts"]["emitted"], 0, "run {runs}: {report:#}");
        assert_eq!(report["counts"]["drifted"], 0, "run {runs}: {report:#}");
        runs += 1;
        during += usize::from(running);
        if !running {
            break;
        }
    }
    assert!(replay.wait_exit(PROCESSING).await.success());
    assert!(during >= 2, "only {during} run(s) while the replay ran");
    downstream
        .wait_for("every replayed payment", PROCESSING, |calls| {
            orders.iter().all(|o| answered(calls, o) == 1)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    let done = reconcile_json(&env, &db, &[], 0).await;
    assert_eq!(done["counts"]["processed"], ORDERS, "{done:#}");
    assert_eq!(depth(&env, &conn).await, 0);
    let calls = downstream.calls();
    assert!(
        !calls
            .iter()
            .any(|c| String::from_utf8_lossy(&c.body).contains("\"compensation\"")),
        "a compensation went out"
    );
    assert!(orders.iter().all(|o| answered(&calls, o) == 1));
}

/// Waits until the status the worker writes for `shard` satisfies `ok`.
async fn wait_status(
    env: &TestEnv,
    shard: u16,
    what: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) {
    let redis = env.redis().await;
    let key = env.keys().shard_status_of(shard);
    wait_until(
        &format!("shard {shard}'s status to show {what}"),
        STARTUP,
        || {
            let (mut redis, key, ok) = (redis.clone(), &key, &ok);
            async move {
                let json: Option<String> = redis::cmd("GET")
                    .arg(key)
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                let report: Option<serde_json::Value> =
                    json.as_deref().and_then(|j| serde_json::from_str(j).ok());
                match report {
                    Some(r) if ok(&r) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        },
    )
    .await;
}
