//! Replays are records, not headers (docs/semantics.md §3, "Replays"): a
//! publisher that sets `x-shardline-replay` itself skips nothing — a random
//! id, the id of another order's replay record, the id of this event's record
//! with another body — while a replay `dlq replay` made passes the gate, also
//! redelivered after a kill -9 before its commit, and a copy after the commit
//! is a duplicate; replays of letters the broker dead-lettered itself each
//! get a record of their own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, SystemTime};

use lapin::types::{AMQPValue, FieldTable};
use shardline_contract::headers::{self, event_properties};
use shardline_contract::{Envelope, replay};

use shardline_testkit::dlq::{
    broker_dead_letter, depth, ids, indexed, list_json, run_ok, wait_depth,
};
use shardline_testkit::{
    ChildWorker, Downstream, Event, PROCESSING, Publisher, Reply, TestEnv, all_ok,
    assert_in_order_and_complete, describe,
};

/// `event` as a publisher who set the replay header itself sends it.
fn marked(event: &Event, marker: &str) -> lapin::BasicProperties {
    let props = event_properties(&event.key(), SystemTime::now(), &event.traceparent);
    let mut table = props
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    table.insert(headers::REPLAY.into(), AMQPValue::LongString(marker.into()));
    props.with_headers(FieldTable::from(table))
}

/// What the replay tool records for `body`.
fn record_of(body: &[u8]) -> String {
    replay::record(&Envelope::parse(body, usize::MAX).unwrap(), body)
}

async fn write_record(env: &TestEnv, id: &str, record: &str) {
    let mut redis = env.redis().await;
    redis::cmd("SET")
        .arg(env.keys().replay_record(id))
        .arg(record)
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
}

async fn read_record(env: &TestEnv, id: &str) -> Option<String> {
    let mut redis = env.redis().await;
    redis::cmd("GET")
        .arg(env.keys().replay_record(id))
        .query_async(&mut redis)
        .await
        .unwrap()
}

/// Three orders each get seq 3 first, marked as a replay by the publisher:
/// a random id; the id of a record made for another order's event; the id
/// of a record made for this seq with another body. Then seq 1 and 2. Every
/// order reaches the downstream as 1, 2, 3 and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_marker_a_publisher_set_skips_nothing() {
    let env = TestEnv::new("forged-replay").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let downstream = Downstream::start().await;
    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let orders = ["forged-random", "forged-other-order", "forged-other-body"];
    let events: Vec<Vec<Event>> = orders
        .iter()
        .map(|o| (1..=3).map(|seq| Event::new(o, seq, env.shards)).collect())
        .collect();
    let elsewhere = Event::new("forged-elsewhere", 7, env.shards);
    write_record(&env, "dl-elsewhere", &record_of(&elsewhere.body)).await;
    let mut other_body = events[2][2].clone();
    other_body.body = String::from_utf8(other_body.body)
        .unwrap()
        .replace("\"test\":true", "\"test\":false")
        .into_bytes();
    assert_ne!(other_body.body, events[2][2].body);
    write_record(&env, "dl-other-body", &record_of(&other_body.body)).await;

    let publisher = Publisher::connect(&env).await;
    for (order, marker) in events.iter().zip([
        format!("0190{:016x}", rand::random::<u64>()),
        "dl-elsewhere".to_owned(),
        "dl-other-body".to_owned(),
    ]) {
        let third = &order[2];
        publisher
            .publish_with(third.shard, &third.body, marked(third, &marker))
            .await;
    }
    let firsts: Vec<Event> = events.iter().flat_map(|o| o[..2].to_vec()).collect();
    publisher.publish(&firsts).await;

    let all: Vec<Event> = events.concat();
    let calls = downstream
        .wait_for("1, 2, 3 of every order", PROCESSING, |calls| {
            all_ok(calls, &all)
        })
        .await;
    assert_in_order_and_complete(&calls, &all);
    env.wait_shard_queues_drained(PROCESSING).await;
    assert_eq!(depth(&env, &conn).await, 0, "nothing dead-lettered");
    assert_eq!(
        read_record(&env, "dl-elsewhere").await,
        Some(record_of(&elsewhere.body)),
        "a record no event matched is not spent"
    );
    worker.stop().await;
}

/// `dlq replay` of a dead letter while no worker runs: the replay exits and
/// the letter's index entry is gone before a worker starts; the replayed
/// event still passes the gate. Its first call is cut by a kill -9 (no
/// commit): the redelivery passes too, and is processed. After the commit a
/// copy with the same marker is a duplicate: no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_passes_after_a_stop_and_a_kill_then_is_spent() {
    const FAILING: u8 = 0;
    const HANG_NEXT: u8 = 1;
    const FIXED: u8 = 2;
    let env = TestEnv::new("replay-record").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let events: Vec<Event> = (1..=3)
        .map(|seq| Event::new("replayed-order", seq, env.shards))
        .collect();
    let failing = events[1].key();
    let phase = Arc::new(AtomicU8::new(FAILING));
    let downstream = {
        let phase = Arc::clone(&phase);
        Downstream::scripted(move |call, _| {
            if call.key() != failing {
                return Reply::ok();
            }
            match phase.load(Ordering::SeqCst) {
                FAILING => Reply::status(422),
                HANG_NEXT => {
                    phase.store(FIXED, Ordering::SeqCst);
                    Reply::ok().after(Duration::from_secs(600))
                }
                _ => Reply::ok(),
            }
        })
        .await
    };
    let mut first = ChildWorker::start(&env, "first", &downstream.url(), &[]);
    first.wait_consuming(&env).await;
    Publisher::connect(&env).await.publish(&events).await;
    wait_depth(&env, &conn, 1, PROCESSING).await;
    downstream
        .wait_for("seq 3 after seq 2's dead letter", PROCESSING, |calls| {
            calls.iter().any(|c| c.key() == events[2].key() && c.ok())
        })
        .await;
    first.sigterm();
    assert!(first.wait_exit(PROCESSING).await.success());

    let letter = ids(&list_json(&env, &[]).await).remove(0);
    phase.store(HANG_NEXT, Ordering::SeqCst);
    run_ok(&env, &["dlq", "replay"]).await;
    assert_eq!(
        indexed(&env).await,
        0,
        "the index entry left with the letter"
    );
    assert_eq!(
        read_record(&env, &letter).await,
        Some(record_of(&events[1].body))
    );

    let mut second = ChildWorker::start(&env, "second", &downstream.url(), &[]);
    downstream
        .wait_for("the replay's first call", PROCESSING, |calls| {
            calls.iter().filter(|c| c.key() == events[1].key()).count() == 2
        })
        .await;
    second.kill9();
    second.wait_exit(PROCESSING).await;

    let third = ChildWorker::start(&env, "third", &downstream.url(), &[]);
    let calls = downstream
        .wait_for("the redelivered replay processed", PROCESSING, |calls| {
            calls.iter().filter(|c| c.key() == events[1].key()).count() == 3
                && calls
                    .last()
                    .is_some_and(|c| c.key() == events[1].key() && c.ok())
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    assert_eq!(
        read_record(&env, &letter).await,
        None,
        "spent by the commit"
    );

    let copy = &events[1];
    Publisher::connect(&env)
        .await
        .publish_with(copy.shard, &copy.body, marked(copy, &letter))
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    let after = downstream.calls();
    assert_eq!(
        after.len(),
        calls.len(),
        "a duplicate: {}",
        describe(&after)
    );
    assert_eq!(depth(&env, &conn).await, 0);
    drop(third);
}

/// Two orders whose seq 1 was given up (their seq 2 accepted as a start
/// after the start grace); the letters of their seq 1 are ones the broker
/// dead-lettered itself (no dead-letter id). Both are replayed while no
/// worker runs, so both replays are in flight at once: each letter got a
/// record of its own and both pass the gate when a worker starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replays_of_broker_letters_each_pass_the_gate() {
    let env = TestEnv::new("broker-replays").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let downstream = Downstream::start().await;
    let start_grace = |c: &mut shardline_worker::Config| {
        c.start_grace = Duration::from_millis(200);
    };
    let worker = env.start_worker("w1", &downstream, start_grace).await;
    let orders = ["broker-letter-a", "broker-letter-b"];
    let seconds: Vec<Event> = orders
        .iter()
        .map(|o| Event::new(o, 2, env.shards))
        .collect();
    Publisher::connect(&env).await.publish(&seconds).await;
    downstream
        .wait_for("both seq 2 accepted as starts", PROCESSING, |calls| {
            all_ok(calls, &seconds)
        })
        .await;
    worker.stop().await;

    let firsts: Vec<Event> = orders
        .iter()
        .map(|o| Event::new(o, 1, env.shards))
        .collect();
    for first in &firsts {
        broker_dead_letter(&env, &conn, &first.body).await;
    }
    wait_depth(&env, &conn, 2, PROCESSING).await;
    for order in orders {
        run_ok(&env, &["dlq", "replay", "--order-id", order]).await;
    }
    let worker = env.start_worker("w2", &downstream, start_grace).await;
    downstream
        .wait_for("both replayed seq 1 processed", PROCESSING, |calls| {
            all_ok(calls, &firsts)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    assert_eq!(
        depth(&env, &conn).await,
        0,
        "neither was dead-lettered late"
    );
    worker.stop().await;
}
