//! Retryable failures are retried in place (the order waits), permanent ones and
//! poison bodies are dead-lettered, and the shard moves on.

use std::collections::HashMap;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use shardline_connect::declare::queue_status;
use shardline_contract::headers::{self, FailReason, header_i64, header_str};

use shardline_testkit::{
    Call, Downstream, Event, PROCESSING, Publisher, Reply, TestEnv, all_ok, describe,
};

fn calls_for<'a>(calls: &'a [Call], key: &str) -> Vec<&'a Call> {
    calls.iter().filter(|c| c.key() == key).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_in_place_and_dead_letters_what_cannot_succeed() {
    let env = TestEnv::new("fail").await;
    env.apply_topology().await;
    let conn = env.connect().await;

    let x: Vec<Event> = (1..=3)
        .map(|s| Event::new("fail-x", s, env.shards))
        .collect();
    let y: Vec<Event> = (1..=3)
        .map(|s| Event::new("fail-y", s, env.shards))
        .collect();
    let z: Vec<Event> = (1..=3)
        .map(|s| Event::new("fail-z", s, env.shards))
        .collect();
    let (x2, y2) = (x[1].key(), y[1].key());
    let downstream = {
        let (x2, y2) = (x2.clone(), y2.clone());
        Downstream::scripted(move |call, before| {
            let key = call.key();
            if key == x2 && before.iter().filter(|c| c.key() == x2).count() < 2 {
                Reply::status(503)
            } else if key == y2 {
                Reply::status(422)
            } else {
                Reply::ok()
            }
        })
        .await
    };
    let worker = env
        .start_worker("w1", &downstream, |c| {
            c.retry.max_attempts = 5;
            c.retry.base = Duration::from_millis(10);
            c.retry.cap = Duration::from_millis(50);
        })
        .await;

    let publisher = Publisher::connect(&env).await;
    let z_shard = z[0].shard;
    publisher.publish(&x).await;
    publisher.publish(&y).await;
    publisher.publish(&z[..1]).await;
    publisher.publish_raw(z_shard, b"not json").await;
    publisher.publish(&z[1..]).await;

    let expect_ok: Vec<Event> = x.iter().chain(&z).chain([&y[0], &y[2]]).cloned().collect();
    let calls = downstream
        .wait_for(
            "every event but Y's seq 2 answered 2xx",
            PROCESSING,
            |calls| all_ok(calls, &expect_ok),
        )
        .await;
    let report = describe(&calls);

    // X seq 2: 503, 503, 200, attempts 1, 2, 3; X seq 3 only after it succeeded.
    let x2_calls = calls_for(&calls, &x2);
    let attempts: Vec<Option<u32>> = x2_calls.iter().map(|c| c.attempt()).collect();
    let statuses: Vec<u16> = x2_calls.iter().map(|c| c.status).collect();
    assert_eq!(attempts, [Some(1), Some(2), Some(3)], "{report}");
    assert_eq!(statuses, [503, 503, 200], "{report}");
    let x3_calls = calls_for(&calls, &x[2].key());
    assert_eq!(x3_calls.len(), 1, "{report}");
    assert!(
        x3_calls[0].index > x2_calls[2].index,
        "X seq 3 reached the downstream before seq 2 succeeded:\n{report}"
    );
    assert!(
        calls_for(&calls, &x[0].key())[0].index < x2_calls[0].index,
        "{report}"
    );

    // Y seq 2: one call (422 is permanent), then Y moves on.
    let y2_calls = calls_for(&calls, &y2);
    assert_eq!(y2_calls.len(), 1, "422 must not be retried:\n{report}");
    assert!(
        calls_for(&calls, &y[2].key())[0].index > y2_calls[0].index,
        "{report}"
    );

    // Z: the poison body in front of seq 2 did not block the shard or the order.
    let z_order: Vec<usize> = z
        .iter()
        .map(|e| calls_for(&calls, &e.key())[0].index)
        .collect();
    assert!(z_order.windows(2).all(|w| w[0] < w[1]), "{report}");

    // Both dead letters were confirmed before the events behind them were handled.
    let dlq = env.names.dead_letter_queue.clone();
    let channel = conn.create_channel().await.unwrap();
    let letters: Vec<Delivery> = shardline_testkit::dlq::peek_all(&env, &channel).await;
    let by_reason: HashMap<&str, &Delivery> = letters
        .iter()
        .map(|d| {
            (
                header_str(&d.properties, headers::FAIL_REASON).unwrap_or("-"),
                d,
            )
        })
        .collect();
    let summary: Vec<String> = letters
        .iter()
        .map(|d| {
            format!(
                "{:?} {:?}",
                String::from_utf8_lossy(&d.data),
                d.properties.headers()
            )
        })
        .collect();
    assert_eq!(letters.len(), 2, "DLQ holds {summary:#?}");

    let handler = by_reason
        .get("handler")
        .unwrap_or_else(|| panic!("no dead letter with reason `handler`: {summary:#?}"));
    assert_eq!(
        handler.data, y[1].body,
        "the original body is dead-lettered"
    );
    assert_eq!(
        header_i64(&handler.properties, headers::RETRY_COUNT),
        Some(1)
    );
    check_common(handler, y[1].shard);

    let decode = by_reason
        .get("decode")
        .unwrap_or_else(|| panic!("no dead letter with reason `decode`: {summary:#?}"));
    assert_eq!(decode.data, b"not json");
    assert_eq!(
        header_i64(&decode.properties, headers::RETRY_COUNT),
        Some(0)
    );
    check_common(decode, z_shard);

    let ids: Vec<_> = letters
        .iter()
        .map(|d| header_str(&d.properties, headers::DEAD_LETTER_ID))
        .collect();
    assert_ne!(ids[0], ids[1], "x-dead-letter-id must be unique");
    for letter in &letters {
        letter.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(queue_status(&conn, &dlq).await.unwrap().messages, 0);
    // What the worker counted agrees: X 2 retried twice, one dead letter each.
    let counts = worker.counts();
    assert_eq!(counts.retries, 2, "{}", worker.describe());
    assert_eq!(
        counts.dead_lettered(FailReason::Handler),
        1,
        "{}",
        worker.describe()
    );
    assert_eq!(
        counts.dead_lettered(FailReason::Decode),
        1,
        "{}",
        worker.describe()
    );
}

fn check_common(letter: &Delivery, shard: u16) {
    let props = &letter.properties;
    let present = |name: &str| header_str(props, name).is_some_and(|v| !v.is_empty());
    assert_eq!(
        header_i64(props, headers::SHARD),
        Some(i64::from(shard)),
        "{props:?}"
    );
    assert_eq!(
        header_str(props, headers::ORIGINAL_ROUTING_KEY),
        Some(format!("shard.{shard}").as_str()),
        "{props:?}"
    );
    assert_eq!(
        letter.routing_key.as_str(),
        header_str(props, headers::FAIL_REASON).unwrap_or("-"),
        "routing key on the DLX is the reason"
    );
    for name in [
        headers::ERROR,
        headers::FIRST_FAILED_AT,
        headers::DEAD_LETTER_ID,
    ] {
        assert!(present(name), "dead letter without {name}: {props:?}");
    }
}
