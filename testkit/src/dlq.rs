//! Reading the dead-letter queue: wait for letters, take them off, describe
//! them; the dead-letter index in Redis; and running the `shardline dlq`
//! commands.

use std::collections::BTreeMap;
use std::process::Output;
use std::time::Duration;

use lapin::Connection;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use shardline_connect::declare::queue_status;
use shardline_contract::headers::{self, header_i64, header_str};
use shardline_contract::letters::IndexEntry;

use crate::env::TestEnv;
use crate::wait::wait_until;

/// Messages in the environment's dead-letter queue (it has no consumer).
pub async fn depth(env: &TestEnv, conn: &Connection) -> u32 {
    queue_status(conn, &env.names.dead_letter_queue)
        .await
        .unwrap()
        .messages
}

/// Waits until the dead-letter queue holds at least `count` letters, then takes
/// every letter off it (acked), in queue order. Fails loudly after `timeout`.
pub async fn take(
    env: &TestEnv,
    conn: &Connection,
    count: u32,
    timeout: Duration,
) -> Vec<Delivery> {
    wait_until(
        &format!("at least {count} letter(s) in the dead-letter queue"),
        timeout,
        || async {
            let n = depth(env, conn).await;
            crate::wait::check(n >= count, || format!("it holds {n}"))
        },
    )
    .await;
    let channel = conn.create_channel().await.unwrap();
    let letters = peek_all(env, &channel).await;
    for letter in &letters {
        letter.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = channel.close(200, "done".into()).await;
    letters
}

/// Every letter in the dead-letter queue, taken off unacked (they return to the
/// queue when `channel` closes, or are acked by the caller).
pub async fn peek_all(env: &TestEnv, channel: &lapin::Channel) -> Vec<Delivery> {
    let mut letters = Vec::new();
    while let Some(message) = channel
        .basic_get(
            env.names.dead_letter_queue.as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .unwrap()
    {
        letters.push(message.delivery);
    }
    letters
}

/// Waits until the DLQ holds exactly `n` letters.
pub async fn wait_depth(env: &TestEnv, conn: &Connection, n: u32, timeout: Duration) {
    wait_until(
        &format!("exactly {n} letter(s) in the dead-letter queue"),
        timeout,
        || async {
            let d = depth(env, conn).await;
            crate::wait::check(d == n, || format!("it holds {d}"))
        },
    )
    .await;
}

/// The letter's `x-fail-reason`.
pub fn reason(letter: &Delivery) -> &str {
    header_str(&letter.properties, headers::FAIL_REASON).unwrap_or("-")
}

/// The letter's `x-retry-count`.
pub fn retry_count(letter: &Delivery) -> Option<i64> {
    header_i64(&letter.properties, headers::RETRY_COUNT)
}

/// One line per letter: reason, retry count, error, body.
pub fn describe(letters: &[Delivery]) -> String {
    letters
        .iter()
        .map(|l| {
            format!(
                "  reason={} retry-count={:?} error={:?} body={}\n",
                reason(l),
                retry_count(l),
                header_str(&l.properties, headers::ERROR).unwrap_or("-"),
                String::from_utf8_lossy(&l.data)
            )
        })
        .collect()
}

/// A finished command's exit status and output, for failure messages.
pub fn text(out: &Output) -> String {
    format!(
        "exit {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `shardline ARGS` with the environment's global flags; it must exit 0.
pub async fn run_ok(env: &TestEnv, args: &[&str]) -> Output {
    let out = env.cli(args).await;
    assert!(out.status.success(), "shardline {args:?}: {}", text(&out));
    out
}

/// `dlq list --json EXTRA`, parsed.
pub async fn list_json(env: &TestEnv, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["dlq", "list", "--json"];
    args.extend_from_slice(extra);
    let out = run_ok(env, &args).await;
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("`dlq list --json` printed no JSON ({e}): {}", text(&out)))
}

/// The ids of a `dlq list --json`, in DLQ order.
pub fn ids(list: &serde_json::Value) -> Vec<String> {
    list["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["id"].as_str().unwrap().to_owned())
        .collect()
}

/// A plain connection to the test Redis (every environment has its prefix there).
/// Letters in the environment's dead-letter index.
pub async fn indexed(env: &TestEnv) -> u64 {
    redis::cmd("ZCARD")
        .arg(env.keys().dlq_letters())
        .query_async(&mut env.redis().await)
        .await
        .unwrap()
}

/// Waits until the dead-letter index holds exactly `n` letters.
pub async fn wait_indexed(env: &TestEnv, n: u64, timeout: Duration) {
    wait_until(
        &format!("exactly {n} letter(s) in the dead-letter index"),
        timeout,
        || async {
            let i = indexed(env).await;
            crate::wait::check(i == n, || format!("it holds {i}"))
        },
    )
    .await;
}

/// The index entry of dead letter `id`, when there is one.
pub async fn index_entry(env: &TestEnv, id: &str) -> Option<IndexEntry> {
    let fields: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(env.keys().dlq_letter(id))
        .query_async(&mut env.redis().await)
        .await
        .unwrap();
    IndexEntry::from_fields(&fields)
}

/// The failure groups of the index: group id → (description, letters).
pub async fn index_groups(env: &TestEnv) -> BTreeMap<String, (String, u64)> {
    let mut redis = env.redis().await;
    let described: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(env.keys().dlq_groups())
        .query_async(&mut redis)
        .await
        .unwrap();
    let mut out = BTreeMap::new();
    for (id, description) in described {
        let count: u64 = redis::cmd("ZCARD")
            .arg(env.keys().dlq_group(&id))
            .query_async(&mut redis)
            .await
            .unwrap();
        out.insert(id, (description, count));
    }
    out
}

/// Deletes the environment's dead-letter index (its own prefix only: the
/// shared Redis keeps every other key), as a Redis loss would.
pub async fn delete_index(env: &TestEnv) {
    let mut redis = env.redis().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(env.keys().dlq_pattern())
        .query_async(&mut redis)
        .await
        .unwrap();
    if !keys.is_empty() {
        redis::cmd("DEL")
            .arg(keys)
            .query_async::<()>(&mut redis)
            .await
            .unwrap();
    }
}

/// Puts a letter in the DLQ as the broker dead-letters one itself (the quorum
/// backstop): through the dead-letter exchange, with an `x-death` entry
/// (reason `delivery_limit`) and none of the worker's dead-letter headers.
pub async fn broker_dead_letter(env: &TestEnv, conn: &Connection, body: &[u8]) {
    use lapin::types::{AMQPValue, FieldTable};
    let mut death = FieldTable::default();
    death.insert(
        "reason".into(),
        AMQPValue::LongString("delivery_limit".into()),
    );
    death.insert(
        "queue".into(),
        AMQPValue::LongString(env.shard_queue(0).as_str().into()),
    );
    death.insert("count".into(), AMQPValue::LongLongInt(1));
    death.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
    let mut headers = FieldTable::default();
    headers.insert(
        shardline_contract::letters::X_DEATH.into(),
        AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
    );
    let props = lapin::BasicProperties::default()
        .with_message_id("broker-dead-lettered".into())
        .with_headers(headers);
    let channel = dlx_channel(conn).await;
    to_dlx(env, &channel, body, props).await;
    let _ = channel.close(200, "done".into()).await;
}

/// Puts `events` into the dead-letter queue as a worker would have
/// dead-lettered them with `reason`, in this order (not indexed: `dlq
/// reindex`, or a replay, indexes them); returns their dead-letter ids.
pub async fn worker_dead_letters(
    env: &TestEnv,
    conn: &Connection,
    events: &[&crate::Event],
    reason: &str,
) -> Vec<String> {
    use lapin::types::{AMQPValue, FieldTable, LongString};
    let channel = dlx_channel(conn).await;
    let mut ids = Vec::with_capacity(events.len());
    for (n, event) in events.iter().enumerate() {
        let id = format!("test-letter-{n:05}-{}", event.key());
        let text = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()));
        let mut h = FieldTable::default();
        h.insert(headers::DEAD_LETTER_ID.into(), text(&id));
        h.insert(headers::FAIL_REASON.into(), text(reason));
        h.insert(headers::ERROR.into(), text("put there by a test"));
        h.insert(
            headers::SHARD.into(),
            AMQPValue::LongLongInt(event.shard.into()),
        );
        let props = lapin::BasicProperties::default().with_headers(h);
        to_dlx(env, &channel, &event.body, props).await;
        ids.push(id);
    }
    let _ = channel.close(200, "done".into()).await;
    ids
}

async fn dlx_channel(conn: &Connection) -> lapin::Channel {
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .unwrap();
    channel
}

/// Publishes a letter to the dead-letter exchange, confirmed and routed.
async fn to_dlx(
    env: &TestEnv,
    channel: &lapin::Channel,
    body: &[u8],
    props: lapin::BasicProperties,
) {
    let confirm = channel
        .basic_publish(
            env.names.dead_letter_exchange.as_str().into(),
            "delivery_limit".into(),
            lapin::options::BasicPublishOptions {
                mandatory: true,
                ..lapin::options::BasicPublishOptions::default()
            },
            body,
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack() && confirm.take_message().is_none());
}
