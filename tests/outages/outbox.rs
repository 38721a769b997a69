//! The outbox relay (ARCHITECTURE.md, "The outbox relay") across a broker
//! restart and a PostgreSQL restart while writers append: a private RabbitMQ
//! node and a private PostgreSQL, each stopped and started under the relay.
//! Every committed row reaches the downstream, each order's seqs in order.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::RngExt as _;
use shardline_testkit::wait::check;
use shardline_testkit::{
    BrokerNode, ChildWorker, Downstream, PROCESSING, PrivatePostgres, QueueType, STARTUP, TestEnv,
    order_ids, wait_until,
};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::assert_nothing_dead_lettered;

/// The outbox's schema in the private PostgreSQL.
const SCHEMA: &str = "shop";
const WRITERS: usize = 3;
const ORDERS: usize = 20;
/// Between a writer's transactions: about 40 rows a second per writer.
const PACE: Duration = Duration::from_millis(25);

/// Writers append for the whole test, one row per transaction, a tenth of the
/// transactions rolled back; the broker is stopped and started, then
/// PostgreSQL (`pg_ctl stop -m fast`, which ends the writers' and the relay's
/// sessions), each time until new rows reach the downstream again. Every
/// committed row is then called, each order's seqs from 1 without a gap,
/// nothing of a transaction that did not commit; the outbox ends empty. The
/// relay never exited: the database restart stopped it (logged, retried),
/// the broker restart either stopped it at its row or its publisher
/// reconnected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node and a private PostgreSQL: scripts/test runs it alone"]
async fn the_relay_loses_nothing_across_a_broker_restart_and_a_database_restart() {
    let started = Instant::now();
    let node = BrokerNode::start().await;
    let env = TestEnv::on_node("outbox-outages", QueueType::Classic, &node).await;
    env.apply_topology().await;
    let mut pg = PrivatePostgres::start().await;
    let url = pg.url();
    let out = env
        .shardline_command()
        .args([
            "outbox",
            "install",
            "--database-url",
            &url,
            "--schema",
            SCHEMA,
        ])
        .output()
        .await
        .unwrap();
    shardline_testkit::process::assert_exited_ok("`shardline outbox install`", &out);
    // Each transaction's token beside its outbox row: what committed, in
    // doubt included, is still readable after the relay deleted the rows.
    shardline_testkit::pg::try_client(&url)
        .await
        .unwrap()
        .batch_execute(
            "CREATE TABLE ledger (token text PRIMARY KEY, order_id text NOT NULL, seq bigint NOT NULL)",
        )
        .await
        .unwrap();

    let downstream = Downstream::start().await;
    let mut worker = ChildWorker::start(&env, "w", &downstream.url(), &[]);
    worker.wait_consuming(&env).await;
    let mut relay = {
        let mut cmd = env.shardline_command();
        cmd.args(["outbox", "relay", "--database-url", &url])
            .args(["--schema", SCHEMA, "--name", "relay"])
            .args(env.global_args());
        ChildWorker::spawn(&env, "relay", cmd)
    };
    let orders = order_ids(&format!("{}-o", env.id), ORDERS);
    let stop = CancellationToken::new();
    let writers = Writers::start(&url, &orders, stop.clone());

    downstream
        .wait_for("the relay under way", PROCESSING, |calls| {
            calls.iter().filter(|c| c.ok()).count() >= 100
        })
        .await;
    // Down until the outbox holds a backlog: the relay must drain it after.
    let outage = Instant::now();
    node.stop_app().await;
    let probe = shardline_testkit::pg::try_client(&url).await.unwrap();
    wait_until("a backlog in the outbox", PROCESSING, || async {
        let left = rows_left(&probe).await?;
        check(left >= 100, || format!("{left} rows in the outbox"))
    })
    .await;
    node.start_app().await;
    writers
        .wait_relayed_again(&downstream, "the broker restart")
        .await;
    let broker_outage = outage.elapsed();

    let outage = Instant::now();
    pg.stop().await;
    pg.start_again().await;
    writers
        .wait_relayed_again(&downstream, "the PostgreSQL restart")
        .await;
    let database_outage = outage.elapsed();
    stop.cancel();
    let written = writers.join().await;

    // The ledger row commits with its outbox row: what it holds committed,
    // in doubt or not.
    let db = shardline_testkit::pg::try_client(&url).await.unwrap();
    let committed: BTreeMap<String, (String, u64)> = db
        .query("SELECT token, order_id, seq FROM ledger", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| {
            let seq = u64::try_from(r.get::<_, i64>(2)).unwrap();
            (r.get(0), (r.get(1), seq))
        })
        .collect();
    for token in &written.committed {
        assert!(
            committed.contains_key(token),
            "{token} committed but not in the ledger"
        );
    }
    for token in committed.keys() {
        assert!(
            written.committed.contains(token) || written.in_doubt.contains(token),
            "{token} in the ledger but its writer saw it not commit"
        );
    }
    assert!(
        !written.not_committed.is_empty(),
        "no transaction rolled back: the test proves nothing about them"
    );
    let doubt_committed = written
        .in_doubt
        .iter()
        .filter(|t| committed.contains_key(*t))
        .count();

    let keys: BTreeSet<String> = committed
        .values()
        .map(|(order, seq)| format!("{order}:order.updated:{seq}"))
        .collect();
    downstream
        .wait_for("every committed row called", PROCESSING, |calls| {
            let called: BTreeSet<&str> = calls.iter().filter(|c| c.ok()).map(|c| c.key()).collect();
            keys.iter().all(|k| called.contains(k.as_str()))
        })
        .await;

    let mut expected: BTreeMap<String, Vec<(u64, String)>> = BTreeMap::new();
    for (token, (order, seq)) in &committed {
        expected
            .entry(order.clone())
            .or_default()
            .push((*seq, token.clone()));
    }
    for rows in expected.values_mut() {
        rows.sort();
    }
    let applied = applied_by_order(&downstream);
    for (order, rows) in &applied {
        let seqs: Vec<u64> = rows.iter().map(|(seq, _)| *seq).collect();
        let gapless: Vec<u64> = (1..=seqs.len() as u64).collect();
        assert_eq!(
            seqs, gapless,
            "order {order}: seqs ascending from 1, no gap"
        );
    }
    assert_eq!(
        applied, expected,
        "what was called, per order (seq, token), is exactly what committed"
    );
    for call in downstream.calls() {
        let (token, _) = token_of(&call);
        assert!(
            committed.contains_key(&token),
            "{} called with {token:?}, which never committed",
            call.key()
        );
    }

    wait_until("the outbox to be empty", STARTUP, || async {
        let left = rows_left(&db).await?;
        check(left == 0, || format!("{left} rows left"))
    })
    .await;
    assert_nothing_dead_lettered(&env).await;
    relay.assert_running("the end: it never exits on an outage");
    worker.assert_running("the end");

    // Each restart stops the relay, which says so: the broker's at the row it
    // was publishing (the relay's publisher does not reconnect by itself),
    // the database's with the statement it was running.
    let log = relay.log_text();
    let outages: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("outbox relay stopped"))
        .collect();
    eprintln!("the relay across the outages:\n{}", outages.join("\n"));
    let stops = outages.len();
    assert!(
        outages
            .iter()
            .any(|l| l.contains("the broker") && l.contains("stopped at row")),
        "the relay's log names no row it stopped at for the broker; {}",
        relay.log_tail(40)
    );
    assert!(
        outages.iter().any(|l| l.contains("the database")),
        "the relay's log shows no database stop; {}",
        relay.log_tail(40)
    );
    let calls = downstream.calls();
    eprintln!(
        "outbox across outages: {} transactions, {} committed, {} not, {} in doubt ({} of them \
         committed); {} calls for {} rows; broker restart {broker_outage:?}, PostgreSQL \
         restart {database_outage:?}; {} relay stops; {:?} in all",
        written.transactions,
        written.committed.len(),
        written.not_committed.len(),
        written.in_doubt.len(),
        doubt_committed,
        calls.len(),
        committed.len(),
        stops,
        started.elapsed()
    );
}

/// What the writers' transactions came to, by token.
#[derive(Default)]
struct Written {
    /// COMMIT answered.
    committed: BTreeSet<String>,
    /// Rolled back, or failed before COMMIT was sent: never committed.
    not_committed: BTreeSet<String>,
    /// COMMIT sent, no answer (the connection ended): either.
    in_doubt: BTreeSet<String>,
    transactions: usize,
}

/// The writing tasks: each on its own connection, reconnecting when it
/// ends, appending one row per transaction to a random order. Each row's
/// data carries a unique token and `n`, the number of its transaction
/// across all writers.
struct Writers {
    written: Arc<Mutex<Written>>,
    next: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    fn start(url: &str, orders: &[String], stop: CancellationToken) -> Self {
        let written = Arc::new(Mutex::new(Written::default()));
        let next = Arc::new(AtomicU64::new(0));
        let tasks = (0..WRITERS)
            .map(|w| {
                let (url, orders) = (url.to_owned(), orders.to_vec());
                let (written, next, stop) = (Arc::clone(&written), Arc::clone(&next), stop.clone());
                tokio::spawn(async move {
                    while !stop.is_cancelled() {
                        let Ok(mut client) = shardline_testkit::pg::try_client(&url).await else {
                            tokio::time::sleep(PACE * 4).await;
                            continue;
                        };
                        while !stop.is_cancelled() && !client.is_closed() {
                            let n = next.fetch_add(1, Ordering::SeqCst);
                            let token = format!("w{w}-n{n}");
                            let (order, roll_back) = {
                                let mut rng = rand::rng();
                                let order = orders[rng.random_range(0..orders.len())].clone();
                                (order, rng.random_range(0..10) == 0)
                            };
                            let outcome = transact(&mut client, &order, &token, n, roll_back).await;
                            {
                                let mut w = written.lock().unwrap();
                                w.transactions += 1;
                                match outcome {
                                    Outcome::Committed => w.committed.insert(token),
                                    Outcome::NotCommitted => w.not_committed.insert(token),
                                    Outcome::InDoubt => w.in_doubt.insert(token),
                                };
                            }
                            tokio::time::sleep(PACE).await;
                        }
                    }
                })
            })
            .collect();
        Self {
            written,
            next,
            tasks,
        }
    }

    /// Waits until a row of a transaction begun after now is called: the
    /// writers and the relay both go on after `outage`.
    async fn wait_relayed_again(&self, downstream: &Downstream, outage: &str) {
        let mark = self.next.load(Ordering::SeqCst);
        let from = downstream.calls().len();
        wait_until(
            &format!("new rows relayed after {outage}"),
            PROCESSING,
            || async {
                let calls = downstream.calls_since(from);
                let newest = calls.iter().filter(|c| c.ok()).map(|c| token_of(c).1).max();
                check(newest.is_some_and(|n| n >= mark), || {
                    format!(
                        "transaction {mark} on; the newest called since is {newest:?}, {} calls; \
                         {} transactions written",
                        calls.len(),
                        self.written.lock().unwrap().transactions
                    )
                })
            },
        )
        .await;
    }

    async fn join(self) -> Written {
        for task in self.tasks {
            task.await.unwrap();
        }
        Arc::try_unwrap(self.written)
            .ok()
            .unwrap()
            .into_inner()
            .unwrap()
    }
}

enum Outcome {
    Committed,
    NotCommitted,
    InDoubt,
}

/// One transaction: the append, and the token in the ledger beside it.
async fn transact(
    client: &mut Client,
    order: &str,
    token: &str,
    n: u64,
    roll_back: bool,
) -> Outcome {
    let Ok(tx) = client.transaction().await else {
        return Outcome::NotCommitted;
    };
    let data = serde_json::json!({ "token": token, "n": n });
    let appended = tx
        .query_one(
            &format!("SELECT {SCHEMA}.shardline_outbox_append($1, 'order.updated', $2)"),
            &[&order, &data],
        )
        .await;
    let Ok(row) = appended else {
        return Outcome::NotCommitted;
    };
    let seq: i64 = row.get(0);
    let ledger = tx
        .execute(
            "INSERT INTO ledger (token, order_id, seq) VALUES ($1, $2, $3)",
            &[&token, &order, &seq],
        )
        .await;
    if ledger.is_err() {
        return Outcome::NotCommitted;
    }
    if roll_back {
        let _ = tx.rollback().await;
        return Outcome::NotCommitted;
    }
    match tx.commit().await {
        Ok(()) => Outcome::Committed,
        Err(_) => Outcome::InDoubt,
    }
}

/// Rows in the outbox.
async fn rows_left(client: &Client) -> Result<i64, String> {
    let row = client
        .query_one(
            &format!("SELECT count(*) FROM {SCHEMA}.shardline_outbox"),
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(row.get(0))
}

/// A call's token and transaction number, from its event's data.
fn token_of(call: &shardline_testkit::Call) -> (String, u64) {
    let body: serde_json::Value = serde_json::from_slice(&call.body).unwrap_or_default();
    let data = &body["data"];
    (
        data["token"].as_str().unwrap_or_default().to_owned(),
        data["n"].as_u64().unwrap_or(0),
    )
}

/// The first 2xx call of each key, per order, in call order: (seq, token).
fn applied_by_order(downstream: &Downstream) -> BTreeMap<String, Vec<(u64, String)>> {
    let mut seen = BTreeSet::new();
    let mut by_order: BTreeMap<String, Vec<(u64, String)>> = BTreeMap::new();
    for call in downstream.calls().into_iter().filter(|c| c.ok()) {
        if !seen.insert(call.key().to_owned()) {
            continue;
        }
        by_order
            .entry(call.order_id.clone().unwrap_or_default())
            .or_default()
            .push((call.seq.unwrap_or(0), token_of(&call).0));
    }
    by_order
}
