//! Per-order quarantine (`worker --on-dead-letter quarantine`): an order's
//! events after its dead letter follow it into the DLQ while other orders of
//! the shard flow; replaying the order after the fix applies them in seq
//! order, including events quarantined while the replay ran, and lifts the
//! quarantine; `dlq release` lifts it without a replay.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use shardline_worker::OnDeadLetter;

use shardline_testkit::dlq::{list_json, run_ok, text, wait_depth, wait_indexed};
use shardline_testkit::{
    Call, Downstream, Event, PROCESSING, Publisher, TestEnv, all_ok, assert_in_order_and_complete,
};

/// An order id other than `of` on the same shard.
fn same_shard(env: &TestEnv, of: &str, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|id| env.shard_of(id) == env.shard_of(of))
        .unwrap()
}

fn events(order: &str, seqs: std::ops::RangeInclusive<u64>, env: &TestEnv) -> Vec<Event> {
    seqs.map(|s| Event::new(order, s, env.shards)).collect()
}

/// The seqs of `order` answered 2xx, in the order the downstream saw them.
fn ok_seqs(calls: &[Call], order: &str) -> Vec<u64> {
    calls
        .iter()
        .filter(|c| c.ok() && c.order_id.as_deref() == Some(order))
        .filter_map(|c| c.seq)
        .collect()
}

/// X seq 2 fails for good: X 3..5 are quarantined (each naming X 2's dead
/// letter) while Y on the same shard proceeds. After the fix, a paced replay
/// of X delivers 2, 3, 4, 5 in order; X 6, published while the replay runs,
/// is quarantined behind the replay and replayed in a second round; then the
/// quarantine is lifted and X 7 flows as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quarantine_holds_an_order_until_its_replay_restores_the_sequence() {
    quarantine_holds_an_order(1).await;
}

/// The same with 4 calls in flight per shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quarantine_holds_an_order_at_concurrency_4() {
    quarantine_holds_an_order(4).await;
}

async fn quarantine_holds_an_order(concurrency: u16) {
    let env = TestEnv::new("quarantine").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let x = "qx";
    let y = same_shard(&env, x, "qy");
    let xs = events(x, 1..=7, &env);
    let ys = events(&y, 1..=5, &env);
    let fixed = Arc::new(AtomicBool::new(false));
    let downstream = Downstream::failing_until_fixed(xs[1].key(), Arc::clone(&fixed)).await;
    let mut worker = env
        .start_worker("w1", &downstream, |c| {
            c.on_dead_letter = OnDeadLetter::Quarantine;
            c.concurrency = concurrency;
        })
        .await;

    let publisher = Publisher::connect(&env).await;
    let interleaved: Vec<Event> = xs[..5]
        .iter()
        .zip(&ys)
        .flat_map(|(a, b)| [a.clone(), b.clone()])
        .collect();
    publisher.publish(&interleaved).await;
    downstream
        .wait_for("Y 1..5 and X 1 answered 2xx", PROCESSING, |calls| {
            all_ok(calls, &ys) && all_ok(calls, &xs[..1])
        })
        .await;
    wait_depth(&env, &conn, 4, PROCESSING).await;
    wait_indexed(&env, 4, PROCESSING).await;
    assert_eq!(
        ok_seqs(&downstream.calls(), x),
        [1],
        "X must stop at its hole"
    );

    let list = list_json(&env, &["--order-id", x]).await;
    let letters = list["dead_letters"].as_array().unwrap();
    let blocker = letters
        .iter()
        .find(|l| l["reason"] == "handler")
        .unwrap_or_else(|| panic!("no handler letter for X 2: {list:#}"));
    assert_eq!(blocker["seq"], 2, "{list:#}");
    let blocker_id = blocker["id"].as_str().unwrap();
    let quarantined: Vec<_> = letters
        .iter()
        .filter(|l| l["reason"] == "quarantined")
        .collect();
    assert_eq!(
        quarantined
            .iter()
            .map(|l| l["seq"].clone())
            .collect::<Vec<_>>(),
        [3, 4, 5],
        "{list:#}"
    );
    assert!(
        quarantined
            .iter()
            .all(|l| l["error"].as_str().unwrap().contains(blocker_id)),
        "each quarantined letter names the blocking dead letter: {list:#}"
    );

    // Fixed: replay X at one letter per 2 s; X 6 arrives once X 2 is through.
    fixed.store(true, Ordering::SeqCst);
    let replay = tokio::spawn({
        let env_args = env.global_args();
        let mut replay_cmd = env.shardline_command();
        async move {
            replay_cmd
                .args(["dlq", "replay", "--order-id", "qx", "--rate", "0.5"])
                .args(env_args)
                .output()
                .await
                .unwrap()
        }
    });
    downstream
        .wait_for("the replayed X 2 answered 2xx", PROCESSING, |calls| {
            ok_seqs(calls, x).contains(&2)
        })
        .await;
    publisher.publish(&xs[5..6]).await;
    let replay = replay.await.unwrap();
    assert!(replay.status.success(), "{}", text(&replay));
    let out = String::from_utf8_lossy(&replay.stdout);
    assert!(out.contains("quarantine lifted"), "{}", text(&replay));
    // X 6 went in 2 s before X 3 was republished: it was quarantined behind
    // the replay and needed the second round.
    assert!(
        out.contains("order qx: 1 event(s) quarantined during the replay"),
        "{}",
        text(&replay)
    );
    downstream
        .wait_for("X 1..6 answered 2xx", PROCESSING, |calls| {
            all_ok(calls, &xs[..6])
        })
        .await;
    assert_eq!(
        list_json(&env, &[]).await["matched"],
        0,
        "the DLQ must be empty"
    );

    // Lifted: X 7 flows through the gate as usual.
    publisher.publish(&xs[6..]).await;
    let calls = downstream
        .wait_for("X 7 answered 2xx", PROCESSING, |calls| all_ok(calls, &xs))
        .await;
    assert_eq!(
        ok_seqs(&calls, x),
        [1, 2, 3, 4, 5, 6, 7],
        "{}",
        text(&replay)
    );
    assert_in_order_and_complete(&calls, &ys);
    worker.assert_running().await;
}

/// A replay whose blocker fails again applies nothing behind it (exit 3, the
/// order stays quarantined); `dlq release` lifts the quarantine: later events
/// flow again and the dead letters stay in the DLQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quarantine_survives_a_failed_replay_and_release_lifts_it() {
    let env = TestEnv::new("quarantine-release").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let z = "qz";
    let zs = events(z, 1..=4, &env);
    let fixed = Arc::new(AtomicBool::new(false));
    let downstream = Downstream::failing_until_fixed(zs[1].key(), fixed).await;
    let mut worker = env
        .start_worker("w1", &downstream, |c| {
            c.on_dead_letter = OnDeadLetter::Quarantine
        })
        .await;
    let publisher = Publisher::connect(&env).await;
    publisher.publish(&zs[..3]).await;
    wait_depth(&env, &conn, 2, PROCESSING).await;

    // Still broken: the replayed Z 2 fails again, Z 3 is quarantined again.
    let replay = env.cli(&["dlq", "replay", "--order-id", z]).await;
    assert_eq!(replay.status.code(), Some(3), "{}", text(&replay));
    assert!(
        String::from_utf8_lossy(&replay.stdout).contains("still quarantined"),
        "{}",
        text(&replay)
    );
    let list = list_json(&env, &["--order-id", z]).await;
    let reasons: Vec<_> = list["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["seq"].clone(), l["reason"].clone()))
        .collect();
    assert_eq!(
        reasons,
        [
            (2.into(), "handler".into()),
            (3.into(), "quarantined".into())
        ],
        "{list:#}"
    );
    assert_eq!(
        ok_seqs(&downstream.calls(), z),
        [1],
        "nothing applied past Z 2"
    );

    let released = run_ok(&env, &["dlq", "release", "--order-id", z]).await;
    let out = String::from_utf8_lossy(&released.stdout);
    assert!(out.contains("released order qz"), "{}", text(&released));
    assert!(
        out.contains("2 dead letter(s) of order qz stay"),
        "{}",
        text(&released)
    );
    publisher.publish(&zs[3..]).await;
    let calls = downstream
        .wait_for("Z 4 answered 2xx", PROCESSING, |calls| {
            all_ok(calls, &zs[3..])
        })
        .await;
    assert_eq!(ok_seqs(&calls, z), [1, 4]);
    assert_eq!(list_json(&env, &[]).await["matched"], 2, "the letters stay");
    worker.assert_running().await;
}
