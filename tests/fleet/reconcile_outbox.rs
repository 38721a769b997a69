//! `shardline reconcile --outbox-schema` against orders and a transactional
//! outbox in one PostgreSQL schema (installed by `shardline outbox install`)
//! and a real fleet: an order whose event is still a row of the outbox is
//! pending, never compensated; once the row is gone without the event ever
//! processed it is drift, compensated once; a relay behind by more than the
//! grace leaves every missing event pending; and a row committed, or one
//! relayed, while a run reads takes effect once: the run reads the orders
//! and the outbox in one snapshot.
//!
//! The relay is played by the test (publish the row as the relay would,
//! then delete it), so that a row goes out at a chosen moment.

use std::process::Output;
use std::time::Duration;

use serde_json::json;
use shardline_contract::{NewEvent, OrderId};
use tokio_postgres::Client;

use shardline_testkit::dlq::text;
use shardline_testkit::pg::{PG_URL, client};
use shardline_testkit::{
    Downstream, OrdersDb, PROCESSING, Publisher, Reply, STARTUP, TestEnv, wait_until,
};

use crate::reconcile::{answered, pending_reasons};

const PAID: &str = "payment.captured";
const SETTLED: Duration = Duration::from_secs(600);
/// What the application appends as each event's `data`.
const DATA: &str = r#"{"amount": 1200}"#;

/// The test's orders schema, with the outbox installed in it.
struct Shop {
    db: OrdersDb,
    client: Client,
}

impl Shop {
    async fn new(env: &TestEnv) -> Self {
        let db = OrdersDb::new(env).await;
        let out = env
            .cli(&[
                "outbox",
                "install",
                "--database-url",
                PG_URL,
                "--schema",
                &db.schema,
            ])
            .await;
        assert!(out.status.success(), "outbox install: {}", text(&out));
        Self {
            client: client().await,
            db,
        }
    }

    fn table(&self, name: &str) -> String {
        format!("{}.{name}", self.db.schema)
    }

    /// What the application does: the order's status and, in the same
    /// transaction, the event appended to the outbox.
    async fn write(&mut self, order_id: &str, status: &str, event: Option<&str>) {
        let (orders, append) = (self.table("orders"), self.table("shardline_outbox_append"));
        let tx = self.client.transaction().await.unwrap();
        tx.execute(&upsert(&orders), &[&order_id, &status, &settled()])
            .await
            .unwrap();
        if let Some(event) = event {
            tx.execute(
                &format!("SELECT {append}($1, $2, $3::text::jsonb)"),
                &[&order_id, &event, &DATA],
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }

    /// The outbox's rows of `order_id`.
    async fn rows(&self, order_id: &str) -> i64 {
        let row = self
            .client
            .query_one(
                &format!(
                    "SELECT count(*) FROM {} WHERE order_id = $1",
                    self.table("shardline_outbox")
                ),
                &[&order_id],
            )
            .await
            .unwrap();
        row.get(0)
    }

    /// Removes the order's rows without publishing them: lost on their way.
    async fn lose(&self, order_id: &str) {
        self.client
            .execute(
                &format!(
                    "DELETE FROM {} WHERE order_id = $1",
                    self.table("shardline_outbox")
                ),
                &[&order_id],
            )
            .await
            .unwrap();
    }

    /// What the relay does with the order's rows: publishes each (confirmed),
    /// then deletes it.
    async fn relay(&self, env: &TestEnv, publisher: &Publisher, order_id: &str) {
        let rows = self
            .client
            .query(
                &format!(
                    "SELECT id, event_id::text, event, seq FROM {} WHERE order_id = $1 ORDER BY id",
                    self.table("shardline_outbox")
                ),
                &[&order_id],
            )
            .await
            .unwrap();
        assert!(!rows.is_empty(), "no row of {order_id} to relay");
        for row in rows {
            let body = NewEvent {
                order_id: OrderId::new(order_id).unwrap(),
                event: row.get(2),
                seq: Some(u64::try_from(row.get::<_, i64>(3)).unwrap()),
                event_id: Some(row.get(1)),
                data: json!({ "amount": 1200 }),
            }
            .to_body()
            .unwrap();
            publisher.publish_raw(env.shard_of(order_id), &body).await;
            self.client
                .execute(
                    &format!(
                        "DELETE FROM {} WHERE id = $1",
                        self.table("shardline_outbox")
                    ),
                    &[&row.get::<_, i64>(0)],
                )
                .await
                .unwrap();
        }
    }

    /// Backdates every row of the outbox by `age`.
    async fn age_rows(&self, age: Duration) {
        self.client
            .execute(
                &format!(
                    "UPDATE {} SET written_at = clock_timestamp() - make_interval(secs => $1)",
                    self.table("shardline_outbox")
                ),
                &[&age.as_secs_f64()],
            )
            .await
            .unwrap();
    }
}

fn upsert(orders: &str) -> String {
    format!(
        "INSERT INTO {orders} (order_id, status, updated_at) VALUES ($1, $2, $3)
         ON CONFLICT (order_id) DO UPDATE SET status = $2, updated_at = $3"
    )
}

fn settled() -> std::time::SystemTime {
    std::time::SystemTime::now() - SETTLED
}

async fn reconcile(env: &TestEnv, shop: &Shop, extra: &[&str]) -> Output {
    super::reconcile::reconcile(env, &shop.db, extra).await
}

/// `reconcile --json --outbox-schema …` (plus `extra`), which must exit
/// with `code`; its report.
async fn reconcile_json(
    env: &TestEnv,
    shop: &Shop,
    extra: &[&str],
    code: i32,
) -> serde_json::Value {
    let mut args = vec!["--outbox-schema", shop.db.schema.as_str()];
    args.extend_from_slice(extra);
    super::reconcile::reconcile_json(env, &shop.db, &args, code).await
}

fn pair(order: &str, reason: &str) -> (String, String) {
    (order.to_owned(), reason.to_owned())
}

fn no_compensation_reached(downstream: &Downstream) {
    assert!(
        !downstream
            .calls()
            .iter()
            .any(|c| String::from_utf8_lossy(&c.body).contains("\"compensation\"")),
        "a compensation went out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpublished_outbox_row_is_pending_and_drift_once_gone_unprocessed() {
    let env = TestEnv::new("reconcile-outbox").await;
    env.apply_topology().await;
    let mut shop = Shop::new(&env).await;

    // ob-paid: PAID with its payment in the outbox; ob-other: PAID with only
    // a row of another kind in the outbox. No relay runs, no worker either.
    shop.write("ob-paid", "PAID", Some(PAID)).await;
    shop.write("ob-other", "PAID", Some("inventory.reserved"))
        .await;

    // A schema the outbox would not accept is a usage error; one without
    // an outbox fails the run; both name the flag.
    let out = reconcile(&env, &shop, &["--outbox-schema", "Shop"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--outbox-schema \"Shop\": "),
        "{}",
        text(&out)
    );
    let out = reconcile(&env, &shop, &["--outbox-schema", "reconcile_no_outbox"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--outbox-schema: reading \"reconcile_no_outbox\".shardline_outbox: "),
        "{}",
        text(&out)
    );

    // Without the outbox, both look drifted.
    let out = reconcile(&env, &shop, &["--json", "--dry-run"]).await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let blind: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(blind["counts"]["drifted"], 2, "{blind:#}");

    let report = reconcile_json(&env, &shop, &[], 0).await;
    assert_eq!(report["counts"]["scanned"], 2, "{report:#}");
    assert_eq!(report["counts"]["pending"], 2, "{report:#}");
    assert_eq!(report["counts"]["drifted"], 0, "{report:#}");
    assert_eq!(report["counts"]["emitted"], 0, "{report:#}");
    assert_eq!(
        pending_reasons(&report),
        [pair("ob-other", "outbox"), pair("ob-paid", "outbox")],
        "{report:#}"
    );
    let detail = |order: &str| {
        report["pending"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["order_id"] == order)
            .map(|p| p["detail"].as_str().unwrap().to_owned())
            .unwrap()
    };
    assert!(
        detail("ob-paid").starts_with(
            "unpublished in the outbox (1 row of the order, 1 of this kind, oldest written "
        ),
        "{report:#}"
    );
    assert!(
        detail("ob-other").contains("1 row of the order, 0 of this kind"),
        "{report:#}"
    );
    assert_eq!(env.shard_backlog().await, 0, "a compensation was published");

    // The text report says the same.
    let schema = shop.db.schema.clone();
    let out = reconcile(&env, &shop, &["--outbox-schema", &schema]).await;
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.lines().any(|l| l
            .starts_with("pending      order=ob-paid event=payment.captured status=PAID")
            && l.contains(": unpublished in the outbox (1 row")),
        "{}",
        text(&out)
    );

    // ob-paid's row is gone, its event never reached the fleet. While the
    // relay is behind by more than the grace (ob-other's row, backdated),
    // no missing event is compensated.
    shop.lose("ob-paid").await;
    shop.age_rows(Duration::from_secs(900)).await;
    let behind = reconcile_json(&env, &shop, &[], 0).await;
    assert_eq!(
        pending_reasons(&behind),
        [pair("ob-other", "outbox"), pair("ob-paid", "relay_behind")],
        "{behind:#}"
    );
    assert_eq!(behind["counts"]["emitted"], 0, "{behind:#}");
    assert_eq!(env.shard_backlog().await, 0, "a compensation was published");

    // The relay caught up (but for ob-other's row): ob-paid is drift, and
    // compensated once.
    shop.age_rows(Duration::ZERO).await;
    let drift = reconcile_json(&env, &shop, &[], 0).await;
    assert_eq!(drift["counts"]["drifted"], 1, "{drift:#}");
    assert_eq!(drift["counts"]["emitted"], 1, "{drift:#}");
    assert_eq!(drift["drift"][0]["order_id"], "ob-paid", "{drift:#}");
    assert_eq!(drift["drift"][0]["compensation"], "emitted", "{drift:#}");
    assert_eq!(
        pending_reasons(&drift),
        [pair("ob-other", "outbox")],
        "{drift:#}"
    );
    let again = reconcile_json(&env, &shop, &[], 0).await;
    assert_eq!(
        pending_reasons(&again),
        [
            pair("ob-other", "outbox"),
            pair("ob-paid", "compensation_emitted")
        ],
        "{again:#}"
    );
    assert_eq!(env.shard_backlog().await, 1, "exactly one compensation");
    assert_eq!(shop.rows("ob-other").await, 1, "reconcile wrote the outbox");
}

/// A run whose orders query pauses 3 s after its snapshot was taken. While
/// it pauses, another connection commits ob-late's PAID together with its
/// outbox row, and the relay publishes and deletes ob-relayed's row (its
/// event then in flight at a worker, held 10 s by the downstream). The run
/// sees the snapshot: ob-late still CREATED (no expectation), ob-relayed's
/// row still there (pending, where two snapshots would have seen a PAID
/// order with no row and no processed event: drift). The next run sees
/// ob-late PAID with its row: pending. Nothing is ever compensated; each
/// payment reaches the downstream once, by the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_committed_or_relayed_during_a_run_takes_effect_once() {
    const LATE: &str = "ob-late";
    const RELAYED: &str = "ob-relayed";
    let env = TestEnv::new("reconcile-outbox-snapshot").await;
    env.apply_topology().await;
    let mut shop = Shop::new(&env).await;
    let downstream = Downstream::scripted(|call, before| {
        let first = !before
            .iter()
            .any(|c| c.order_id.as_deref() == Some(RELAYED));
        if call.order_id.as_deref() == Some(RELAYED) && first {
            Reply::ok().after(Duration::from_secs(10))
        } else {
            Reply::ok()
        }
    })
    .await;
    let _worker = env.start_worker("w1", &downstream, |_| {}).await;
    // The worker reports ob-relayed's shard: a missing event there is not
    // "on a shard nobody consumes".
    let status = env.keys().shard_status_of(env.shard_of(RELAYED));
    let redis = env.redis().await;
    wait_until("the worker's shard status", STARTUP, || {
        let (mut redis, status) = (redis.clone(), status.clone());
        async move {
            let exists: bool = redis::cmd("EXISTS")
                .arg(&status)
                .query_async(&mut redis)
                .await
                .unwrap();
            exists.then_some(()).ok_or_else(|| "no status".to_owned())
        }
    })
    .await;
    let publisher = Publisher::connect(&env).await;

    shop.write(LATE, "CREATED", None).await;
    shop.write(RELAYED, "PAID", Some(PAID)).await;
    // The application's transaction for ob-late, open across the run's snapshot.
    let writer = client().await;
    writer
        .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
        .unwrap();
    writer
        .execute(
            &upsert(&shop.table("orders")),
            &[&LATE, &"PAID", &settled()],
        )
        .await
        .unwrap();
    writer
        .execute(
            &format!(
                "SELECT {}($1, $2, $3::text::jsonb)",
                shop.table("shardline_outbox_append")
            ),
            &[&LATE, &PAID, &DATA],
        )
        .await
        .unwrap();

    let schema = shop.db.schema.clone();
    let paused = format!(
        "SELECT o.order_id, o.status, o.updated_at FROM (SELECT pg_sleep(3)) AS pause, \
         {schema}.orders AS o WHERE o.updated_at >= $1"
    );
    let args = ["--orders-query", paused.as_str()];
    let run = reconcile_json(&env, &shop, &args, 0);
    let meanwhile = async {
        // The run's query runs, so its snapshot is taken.
        let watcher = client().await;
        wait_until("the run's paused orders query", STARTUP, || {
            let (watcher, schema) = (&watcher, &schema);
            async move {
                let row = watcher
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' \
                         AND backend_xmin IS NOT NULL AND query LIKE '%pg_sleep(3)%' \
                         AND query LIKE '%' || $1 || '.orders%' AND pid <> pg_backend_pid()",
                        &[schema],
                    )
                    .await
                    .unwrap();
                (row.get::<_, i64>(0) == 1)
                    .then_some(())
                    .ok_or_else(|| "not yet".to_owned())
            }
        })
        .await;
        shop.relay(&env, &publisher, RELAYED).await;
        writer.batch_execute("COMMIT").await.unwrap();
    };
    let (first, ()) = tokio::join!(run, meanwhile);
    assert_eq!(first["counts"]["scanned"], 2, "{first:#}");
    assert_eq!(first["counts"]["no_expectation"], 1, "{first:#}");
    assert_eq!(first["counts"]["emitted"], 0, "{first:#}");
    assert_eq!(first["counts"]["drifted"], 0, "{first:#}");
    assert_eq!(
        pending_reasons(&first),
        [pair(RELAYED, "outbox")],
        "{first:#}"
    );
    assert_eq!(shop.rows(RELAYED).await, 0);

    downstream
        .wait_for("ob-relayed's payment", PROCESSING, |calls| {
            answered(calls, RELAYED) == 1
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    let second = reconcile_json(&env, &shop, &[], 0).await;
    assert_eq!(second["counts"]["processed"], 1, "{second:#}");
    assert_eq!(second["counts"]["emitted"], 0, "{second:#}");
    assert_eq!(
        pending_reasons(&second),
        [pair(LATE, "outbox")],
        "{second:#}"
    );
    assert_eq!(shop.rows(LATE).await, 1, "the row waits for the relay");

    shop.relay(&env, &publisher, LATE).await;
    downstream
        .wait_for("ob-late's payment", PROCESSING, |calls| {
            answered(calls, LATE) == 1
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    let done = reconcile_json(&env, &shop, &[], 0).await;
    assert_eq!(done["counts"]["processed"], 2, "{done:#}");
    assert_eq!(done["counts"]["pending"], 0, "{done:#}");
    assert_eq!(done["counts"]["drifted"], 0, "{done:#}");
    let calls = downstream.calls();
    assert_eq!(answered(&calls, RELAYED), 1);
    assert_eq!(answered(&calls, LATE), 1);
    no_compensation_reached(&downstream);
}
