//! The outbox relay (ARCHITECTURE.md, "The outbox relay") against the real
//! PostgreSQL, RabbitMQ and Redis: applications append in their own
//! transactions, `shardline outbox relay` publishes exactly what committed,
//! each order's events in seq order.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::RngExt as _;
use shardline_testkit::pg::{PG_URL, ScratchSchema, client};
use shardline_testkit::wait::{check, wait_until};
use shardline_testkit::{ChildWorker, Downstream, TestEnv, order_ids};
use tokio_postgres::Client;

/// The outbox installed in a schema of the test's own (`outbox install`).
async fn installed(env: &TestEnv, prefix: &str) -> ScratchSchema {
    let schema = ScratchSchema::new(prefix);
    let out = env
        .shardline_command()
        .args(["outbox", "install", "--database-url", PG_URL])
        .args(["--schema", &schema.name])
        .output()
        .await
        .unwrap();
    shardline_testkit::process::assert_exited_ok("`shardline outbox install`", &out);
    schema
}

/// `shardline outbox relay` on `schema`, named `name`.
fn relay(env: &TestEnv, schema: &ScratchSchema, name: &str) -> ChildWorker {
    relay_with(env, schema, name, &[])
}

fn relay_with(env: &TestEnv, schema: &ScratchSchema, name: &str, extra: &[&str]) -> ChildWorker {
    let mut cmd = env.shardline_command();
    cmd.args(["outbox", "relay", "--database-url", PG_URL])
        .args(["--schema", &schema.name, "--name", name])
        .args(env.global_args())
        .args(extra);
    ChildWorker::spawn(env, name, cmd)
}

/// Appends one event in its own transaction: its seq.
async fn append(
    client: &Client,
    schema: &ScratchSchema,
    order: &str,
    data: serde_json::Value,
) -> u64 {
    let row = client
        .query_one(
            &format!(
                "SELECT {}.shardline_outbox_append($1, 'order.updated', $2)",
                schema.name
            ),
            &[&order, &data],
        )
        .await
        .unwrap();
    u64::try_from(row.get::<_, i64>(0)).unwrap()
}

/// Rows still in the outbox.
async fn rows_left(client: &Client, schema: &ScratchSchema) -> i64 {
    client
        .query_one(
            &format!("SELECT count(*) FROM {}.shardline_outbox", schema.name),
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// What the writers committed and rolled back.
#[derive(Default)]
struct Written {
    /// (order, seq) of every committed append.
    committed: BTreeSet<(String, u64)>,
    /// The tokens of the transactions that rolled back.
    rolled_back: BTreeSet<String>,
    /// Transactions done, committed or not.
    transactions: usize,
}

/// `writers` connections appending to `orders` until `stop`: each
/// transaction appends to one to three orders (in order-id order, as the
/// docs tell writers), a third of them stay open up to 1.5 s before
/// committing, a tenth roll back. Every row carries its transaction's token.
fn start_writers(
    writers: usize,
    schema: &ScratchSchema,
    orders: &[String],
    stop: tokio_util::sync::CancellationToken,
) -> (Arc<Mutex<Written>>, Vec<tokio::task::JoinHandle<()>>) {
    let written = Arc::new(Mutex::new(Written::default()));
    let tasks = (0..writers)
        .map(|w| {
            let (schema, orders) = (schema.name.clone(), orders.to_vec());
            let (written, stop) = (Arc::clone(&written), stop.clone());
            tokio::spawn(async move {
                let mut client = client().await;
                for t in 0.. {
                    if stop.is_cancelled() {
                        break;
                    }
                    let token = format!("w{w}-t{t}");
                    let (mut picked, hold, roll_back) = {
                        let mut rng = rand::rng();
                        let n = rng.random_range(1..=3);
                        let picked: BTreeSet<String> = (0..n)
                            .map(|_| orders[rng.random_range(0..orders.len())].clone())
                            .collect();
                        let hold = rng.random_range(0..3) == 0;
                        let hold = hold.then(|| Duration::from_millis(rng.random_range(0..1500)));
                        (picked.into_iter().collect::<Vec<_>>(), hold, rng.random_range(0..10) == 0)
                    };
                    picked.sort();
                    let tx = client.transaction().await.unwrap();
                    let mut seqs: Vec<(String, u64)> = Vec::new();
                    let data = serde_json::json!({ "txn": token });
                    for order in &picked {
                        let row = tx
                            .query_one(
                                &format!("SELECT {schema}.shardline_outbox_append($1, 'order.updated', $2)"),
                                &[order, &data],
                            )
                            .await
                            .unwrap();
                        let seq = u64::try_from(row.get::<_, i64>(0)).unwrap();
                        seqs.push((order.clone(), seq));
                    }
                    if let Some(hold) = hold {
                        tokio::time::sleep(hold).await;
                    }
                    if roll_back {
                        tx.rollback().await.unwrap();
                        let mut w = written.lock().unwrap();
                        w.rolled_back.insert(token);
                        w.transactions += 1;
                    } else {
                        tx.commit().await.unwrap();
                        let mut w = written.lock().unwrap();
                        w.committed.extend(seqs);
                        w.transactions += 1;
                    }
                }
            })
        })
        .collect();
    (written, tasks)
}

/// The first 2xx call of each key, per order, in call order: (seq, txn token).
fn applied_by_order(downstream: &Downstream) -> BTreeMap<String, Vec<(u64, String)>> {
    let mut seen = BTreeSet::new();
    let mut by_order: BTreeMap<String, Vec<(u64, String)>> = BTreeMap::new();
    for call in downstream.calls().into_iter().filter(|c| c.ok()) {
        if !seen.insert(call.key().to_owned()) {
            continue;
        }
        let body: serde_json::Value = serde_json::from_slice(&call.body).unwrap_or_default();
        let token = body["data"]["txn"].as_str().unwrap_or_default().to_owned();
        by_order
            .entry(call.order_id.clone().unwrap_or_default())
            .or_default()
            .push((call.seq.unwrap_or(0), token));
    }
    by_order
}

/// Waits until every committed (order, seq) is called, then checks each
/// order's first calls ascend from seq 1 without a gap: those calls.
async fn all_called_in_seq_order(
    downstream: &Downstream,
    committed: &BTreeSet<(String, u64)>,
) -> BTreeMap<String, Vec<(u64, String)>> {
    let keys: BTreeSet<String> = committed
        .iter()
        .map(|(order, seq)| format!("{order}:order.updated:{seq}"))
        .collect();
    downstream
        .wait_for(
            "every committed row called",
            Duration::from_secs(90),
            |calls| {
                let called: BTreeSet<&str> =
                    calls.iter().filter(|c| c.ok()).map(|c| c.key()).collect();
                keys.iter().all(|k| called.contains(k.as_str()))
            },
        )
        .await;
    let applied = applied_by_order(downstream);
    for (order, calls) in &applied {
        let seqs: Vec<u64> = calls.iter().map(|(seq, _)| *seq).collect();
        let gapless: Vec<u64> = (1..=seqs.len() as u64).collect();
        assert_eq!(
            seqs, gapless,
            "order {order}: seqs ascending from 1, no gap"
        );
    }
    applied
}

/// Eight writers append concurrently to a shared pool of orders (two
/// writers on one order at once is common: 24 orders, one to three per
/// transaction); a third of the transactions stay open up to 1.5 s, a tenth
/// roll back; the relay is killed -9 in the middle and started again. Every
/// committed row reaches the downstream, each order's seqs ascending from 1
/// without a gap, no rolled-back row is ever published, repeats only after
/// the kill (at most one batch), and the outbox is empty once all is called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_rows_reach_the_downstream_in_seq_order_across_a_relay_kill() {
    let env = TestEnv::new("outbox-writers").await;
    env.apply_topology().await;
    let schema = installed(&env, "outbox_writers").await;
    let downstream = Downstream::start().await;
    let mut worker = ChildWorker::start(&env, "w", &downstream.url(), &[]);
    worker.wait_consuming(&env).await;
    let mut first = relay(&env, &schema, "relay-1");
    let orders = order_ids(&format!("{}-o", env.id), 24);
    let stop = tokio_util::sync::CancellationToken::new();
    let (written, writers) = start_writers(8, &schema, &orders, stop.clone());

    wait_until(
        "a third of the writing",
        Duration::from_secs(60),
        || async {
            let done = written.lock().unwrap().transactions;
            check(done >= 60, || format!("{done} transactions"))
        },
    )
    .await;
    first.kill9();
    let killed_at = Instant::now();
    first.wait_exit(Duration::from_secs(10)).await;
    let _second = relay(&env, &schema, "relay-2");
    wait_until(
        "the rest of the writing",
        Duration::from_secs(60),
        || async {
            let done = written.lock().unwrap().transactions;
            check(done >= 180, || format!("{done} transactions"))
        },
    )
    .await;
    stop.cancel();
    for writer in writers {
        writer.await.unwrap();
    }

    let (committed, rolled_back) = {
        let w = written.lock().unwrap();
        (w.committed.clone(), w.rolled_back.clone())
    };
    assert!(!rolled_back.is_empty(), "some transactions roll back");
    let applied = all_called_in_seq_order(&downstream, &committed).await;
    for (order, calls) in &applied {
        for (seq, token) in calls {
            assert!(
                !rolled_back.contains(token),
                "order {order} seq {seq}: a rolled-back row ({token}) was published"
            );
        }
    }
    let called: usize = applied.values().map(Vec::len).sum();
    assert_eq!(
        called,
        committed.len(),
        "every committed row once, nothing else"
    );

    // Repeats (2xx calls of a key already applied) only after the kill, at
    // most one batch of them.
    let mut seen = BTreeSet::new();
    let repeats: Vec<Instant> = downstream
        .calls()
        .into_iter()
        .filter(|c| c.ok() && !seen.insert(c.key().to_owned()))
        .map(|c| c.started)
        .collect();
    assert!(
        repeats.iter().all(|at| *at >= killed_at),
        "a repeat before the kill"
    );
    assert!(
        repeats.len() <= 500,
        "{} repeats: more than one batch",
        repeats.len()
    );

    let db = client().await;
    wait_until(
        "the outbox to hold no published row",
        Duration::from_secs(30),
        || async {
            let left = rows_left(&db, &schema).await;
            check(left == 0, || format!("{left} rows left"))
        },
    )
    .await;
    worker.assert_running("the end");
}

/// Two relays on one outbox: one publishes, the other stands by; killed -9,
/// the first is replaced by the second within seconds, and the events each
/// published (tagged `x-shardline-relay`, read off the shard queues: no
/// worker runs) overlap by at most one batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_relay_takes_over_within_seconds_of_a_kill() {
    let env = TestEnv::new("outbox-standby").await;
    env.apply_topology().await;
    let schema = installed(&env, "outbox_standby").await;
    let mut a = relay(&env, &schema, "relay-a");
    let db = client().await;
    let order = format!("{}-o", env.id);
    append(&db, &schema, &order, serde_json::json!({})).await;
    let status = || async {
        let out = env.cli(&["topology", "status"]).await;
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    wait_until(
        "relay-a active, its first row relayed",
        Duration::from_secs(30),
        || async {
            let text = status().await;
            check(
                text.contains("outbox relay relay-a: active") && text.contains("1 rows relayed"),
                || text.clone(),
            )
        },
    )
    .await;
    let _b = relay(&env, &schema, "relay-b");
    wait_until("relay-b on standby", Duration::from_secs(30), || async {
        let text = status().await;
        check(text.contains("outbox relay relay-b: standby"), || {
            text.clone()
        })
    })
    .await;

    // Appends go on while A is killed.
    let writing = {
        let (schema, order) = (schema.name.clone(), order.clone());
        tokio::spawn(async move {
            let db = client().await;
            for _ in 0..200 {
                db.query_one(
                    &format!(
                        "SELECT {schema}.shardline_outbox_append($1, 'order.updated', '{{}}')"
                    ),
                    &[&order],
                )
                .await
                .unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let queue = env.shard_queue(env.shard_of(&order));
    let holds = |what: &'static str, n: u64| {
        let (env, queue) = (&env, &queue);
        wait_until(what, Duration::from_secs(30), move || async move {
            let depth = env.queue_depths().await.get(queue).map_or(0, |d| d.0);
            check(depth >= n, || format!("{depth} in {queue}"))
        })
    };
    holds("relay-a publishing the appends", 20).await;
    a.kill9();
    let killed_ms = shardline_contract::status::unix_ms();
    a.wait_exit(Duration::from_secs(10)).await;
    writing.await.unwrap();
    holds("all 201 events in the queue", 201).await;

    // (relay, seq, published at) of every message, in queue order.
    let conn = env.connect().await;
    let channel = conn.create_channel().await.unwrap();
    let mut published = Vec::new();
    while let Some(message) = channel
        .basic_get(
            queue.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
    {
        let headers = message
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        let relay = match headers.inner().get("x-shardline-relay") {
            Some(lapin::types::AMQPValue::LongString(s)) => s.to_string(),
            other => panic!("no relay header: {other:?}"),
        };
        let at = match headers.inner().get("x-published-at-ms") {
            Some(lapin::types::AMQPValue::LongLongInt(ms)) => u64::try_from(*ms).unwrap(),
            other => panic!("no publish stamp: {other:?}"),
        };
        let body: serde_json::Value = serde_json::from_slice(&message.delivery.data).unwrap();
        published.push((relay, body["seq"].as_u64().unwrap(), at));
    }
    let took_over = published
        .iter()
        .find(|(relay, _, _)| relay == "relay-b")
        .map(|(_, _, at)| at.saturating_sub(killed_ms))
        .expect("relay-b published");
    assert!(
        took_over < 5_000,
        "relay-b published {took_over} ms after the kill"
    );
    let seqs_of = |name: &str| -> BTreeSet<u64> {
        published
            .iter()
            .filter(|(r, _, _)| r == name)
            .map(|(_, s, _)| *s)
            .collect()
    };
    let (by_a, by_b) = (seqs_of("relay-a"), seqs_of("relay-b"));
    let overlap = by_a.intersection(&by_b).count();
    assert!(overlap <= 500, "{overlap} events published by both relays");
    let all: BTreeSet<u64> = by_a.union(&by_b).copied().collect();
    assert_eq!(
        all,
        (1..=201).collect::<BTreeSet<_>>(),
        "every seq published"
    );
    // In the queue each relay's events are in seq order, and B's first
    // event comes after every one of A's, save A's batch in flight.
    let first_of_b = by_b.iter().next().copied().unwrap();
    assert!(by_a.iter().all(|s| *s < first_of_b + 500));
    println!("outbox standby took over in {took_over} ms; {overlap} events published by both");
}

/// The relay started before the topology exists stops at the first row,
/// says which and why, and retries; once `topology apply` made the exchange
/// and queues, it goes on from that row: nothing skipped, order kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_waits_at_its_row_until_the_topology_exists() {
    let env = TestEnv::new("outbox-topology").await;
    let schema = installed(&env, "outbox_topology").await;
    let db = client().await;
    let order = format!("{}-o", env.id);
    for _ in 0..5 {
        append(&db, &schema, &order, serde_json::json!({})).await;
    }
    let mut relay = relay(&env, &schema, "relay-t");
    wait_until(
        "the relay to say where it stopped",
        Duration::from_secs(30),
        || async {
            let log = relay.log_text();
            check(
                log.contains("stopped at row") && log.contains(&format!("order {order} seq 1")),
                || relay.log_tail(5),
            )
        },
    )
    .await;
    assert_eq!(
        rows_left(&db, &schema).await,
        5,
        "nothing deleted while nothing is published"
    );
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let mut worker = ChildWorker::start(&env, "w", &downstream.url(), &[]);
    worker.wait_consuming(&env).await;
    downstream
        .wait_for("the five events", Duration::from_secs(60), |calls| {
            calls.iter().filter(|c| c.ok()).count() >= 5
        })
        .await;
    let seqs: Vec<u64> = applied_by_order(&downstream)[&order]
        .iter()
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);
    relay.assert_running("the end");
}

/// An order whose seqs 1–5 were published before the outbox: its counter
/// seeded to 6, its appended events get 6, 7 and are processed, not
/// dead-lettered `late` nor taken for duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_order_goes_on_from_its_published_seqs() {
    let env = TestEnv::new("outbox-seed").await;
    env.apply_topology().await;
    let schema = installed(&env, "outbox_seed").await;
    let downstream = Downstream::start().await;
    let mut worker = ChildWorker::start(&env, "w", &downstream.url(), &[]);
    worker.wait_consuming(&env).await;
    let order = format!("{}-o", env.id);
    for seq in 1..=5 {
        let out = env
            .cli(&[
                "publish",
                "--order-id",
                &order,
                "--event",
                "order.updated",
                "--seq",
                &seq.to_string(),
            ])
            .await;
        shardline_testkit::process::assert_exited_ok("`shardline publish`", &out);
    }
    downstream
        .wait_for("seqs 1–5", Duration::from_secs(30), |calls| {
            calls.iter().filter(|c| c.ok()).count() >= 5
        })
        .await;
    let db = client().await;
    let next: i64 = db
        .query_one(
            &format!("SELECT {}.shardline_outbox_seed($1, 6)", schema.name),
            &[&order],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(next, 6);
    assert_eq!(append(&db, &schema, &order, serde_json::json!({})).await, 6);
    assert_eq!(append(&db, &schema, &order, serde_json::json!({})).await, 7);
    let _relay = relay(&env, &schema, "relay-s");
    downstream
        .wait_for("seqs 6 and 7", Duration::from_secs(30), |calls| {
            calls.iter().filter(|c| c.ok()).count() >= 7
        })
        .await;
    let seqs: Vec<u64> = applied_by_order(&downstream)[&order]
        .iter()
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(env.dlq_backlog().await, 0, "nothing dead-lettered");
}

/// A reshard 4 → 6 while writers append and the relay publishes: the relay
/// is a registered publisher of the reshard's barriers, so every committed
/// row is processed and each order's seqs still ascend from 1 without a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reshard_while_relaying_keeps_every_row_and_each_orders_order() {
    let env = TestEnv::new("outbox-reshard").await.with_shards(4);
    env.apply_topology().await;
    let schema = installed(&env, "outbox_reshard").await;
    let downstream = Downstream::start().await;
    let mut members = ["a", "b"].map(|name| {
        ChildWorker::start(
            &env,
            name,
            &downstream.url(),
            &["--assign", "auto", "--member-id", name],
        )
    });
    for member in &mut members {
        member.wait_consuming(&env).await;
    }
    let _relay = relay(&env, &schema, "relay-r");
    let orders = order_ids(&format!("{}-o", env.id), 40);
    let stop = tokio_util::sync::CancellationToken::new();
    let (written, writers) = start_writers(4, &schema, &orders, stop.clone());
    wait_until("some rows relayed", Duration::from_secs(60), || async {
        let called = downstream.calls().len();
        check(called >= 50, || format!("{called} calls"))
    })
    .await;
    let out = env
        .shardline_command()
        .args(["topology", "reshard", "--to", "6"])
        .args(env.global_args())
        .output()
        .await
        .unwrap();
    shardline_testkit::process::assert_exited_ok("`shardline topology reshard --to 6`", &out);
    wait_until(
        "writing after the reshard",
        Duration::from_secs(60),
        || async {
            let done = written.lock().unwrap().transactions;
            check(done >= 150, || format!("{done} transactions"))
        },
    )
    .await;
    stop.cancel();
    for writer in writers {
        writer.await.unwrap();
    }
    let committed = written.lock().unwrap().committed.clone();
    let applied = all_called_in_seq_order(&downstream, &committed).await;
    assert_eq!(
        applied.values().map(Vec::len).sum::<usize>(),
        committed.len()
    );
    assert_eq!(env.dlq_backlog().await, 0, "nothing dead-lettered");
    let moved = downstream
        .calls()
        .iter()
        .filter_map(|c| c.shard())
        .any(|shard| shard >= 4);
    assert!(moved, "some events processed on the new shards 4 and 5");
}
