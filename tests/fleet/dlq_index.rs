//! The dead-letter index that reconcile, `dlq list` and the console read
//! instead of browsing the DLQ: reconcile every second
//! while another task keeps reading the index (the console's refresh) and a
//! replay of another order holds the DLQ's letters never compensates the
//! event that is in the DLQ; after a Redis loss (`FLUSHDB` of a private
//! server) the DLQ says "reindex needed", and `dlq reindex` rebuilds the
//! same failure groups and entries.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use shardline_ops::dlq::{self, Filters, LetterQuery, ReplayConfig};
use shardline_ops::reconcile::{self, OnItsWay, RUNS_CAP};
use shardline_ops::topology::{self, StatusConfig};
use shardline_ops::{Event, Fleet, ReconcileConfig, ReconcileReport, Reconciler};
use shardline_testkit::dlq::{depth, wait_depth, wait_indexed};
use shardline_testkit::redis::RedisServer;
use shardline_testkit::wait::check;
use shardline_testkit::{Downstream, OrdersDb, PROCESSING, Publisher, Reply, TestEnv, wait_until};
use tokio_util::sync::CancellationToken;

use crate::reconcile::{answered, payment_with_id};

const SETTLED: Duration = Duration::from_secs(600);

/// A `payment.captured` without seq, its event id `pay-{order_id}-{n}`.
fn payment(order_id: &str, n: usize) -> Vec<u8> {
    payment_with_id(order_id, &format!("pay-{order_id}-{n}"))
}

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

fn at_ms(report: &ReconcileReport) -> u64 {
    u64::try_from(report.at.duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// Order `ix-dlq`'s payment is in the DLQ (its downstream answers 422
/// whatever happens) and the order database says it was paid; order
/// `ix-replay` has six payments in the DLQ, replayed at 2/s once the
/// downstream is fixed. Reconcile runs every second all along (through
/// `run_every`, as `reconcile --interval 1s` does), while a reader keeps
/// asking for the groups, the letters, `dlq list` and the fleet status, the
/// console's refresh. Every run counts ix-dlq's payment as pending in the DLQ
/// (the replay's reader holds its letter meanwhile: the index still has it),
/// none emits anything, and ix-replay's six payments reach the downstream once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_every_second_during_reads_and_a_replay_never_compensates_a_dead_letter() {
    const REPLAYED: usize = 6;
    let env = TestEnv::new("dlq-index-load").await;
    env.apply_topology().await;
    let db = OrdersDb::new(&env).await;
    let conn = env.connect().await;
    let fleet = env.ops_fleet();
    let fixed = Arc::new(AtomicBool::new(false));
    let downstream = Downstream::scripted({
        let fixed = Arc::clone(&fixed);
        move |call, _| match call.order_id.as_deref() {
            Some("ix-replay") if fixed.load(Ordering::SeqCst) => {
                Reply::ok().after(Duration::from_millis(100))
            }
            _ => Reply::status(422),
        }
    })
    .await;
    let _worker = env.start_worker("w1", &downstream, |_| {}).await;
    let publisher = Publisher::connect(&env).await;
    publisher
        .publish_raw(env.shard_of("ix-dlq"), &payment("ix-dlq", 0))
        .await;
    for n in 0..REPLAYED {
        publisher
            .publish_raw(env.shard_of("ix-replay"), &payment("ix-replay", n))
            .await;
    }
    let letters = u32::try_from(REPLAYED + 1).unwrap();
    wait_depth(&env, &conn, letters, PROCESSING).await;
    wait_indexed(&env, u64::from(letters), PROCESSING).await;
    db.set("ix-dlq", "PAID", SETTLED).await;
    db.set("ix-replay", "PAID", SETTLED).await;
    let in_dlq = dlq::letters(
        &fleet,
        &LetterQuery {
            filters: Filters {
                order_id: Some(shardline_contract::OrderId::new("ix-dlq").unwrap()),
                ..Filters::default()
            },
            ..LetterQuery::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(in_dlq.len(), 1, "{in_dlq:?}");
    let (letter_id, group) = (in_dlq[0].id.clone(), in_dlq[0].group.clone());

    let reconciler = Reconciler::new(
        fleet.clone(),
        ReconcileConfig {
            orders_url: db.url(),
            ..ReconcileConfig::default()
        },
    )
    .unwrap();
    let cancel = CancellationToken::new();
    let reports: Mutex<Vec<ReconcileReport>> = Mutex::default();
    let failed: Mutex<Vec<String>> = Mutex::default();
    let reads = AtomicUsize::new(0);
    let misreads: Mutex<Vec<String>> = Mutex::default();

    let reconciling = reconciler.run_every(Duration::from_secs(1), &cancel, |event| match event {
        Event::Reconciled(report) => reports.lock().unwrap().push(*report),
        Event::ReconcileFailed { error } => failed.lock().unwrap().push(error),
        _ => {}
    });
    // The console's refresh: the index's groups and letters, `dlq list`, the
    // fleet status in its cheap form, over and over.
    let reading = async {
        let mut refresh = tokio::time::interval(Duration::from_millis(50));
        loop {
            tokio::select! {
                _ = refresh.tick() => {}
                () = cancel.cancelled() => break,
            }
            let groups = dlq::groups(&fleet).await.unwrap();
            let letters = dlq::letters(&fleet, &LetterQuery::default()).await.unwrap();
            let list = dlq::list(&fleet, &Filters::default()).await.unwrap();
            let status = topology::status(&fleet, &StatusConfig::default())
                .await
                .unwrap();
            if !groups.iter().any(|g| g.group.id == group)
                || !letters.iter().any(|l| l.id == letter_id)
                || !list.letters.iter().any(|l| l.id == letter_id)
                || status.dlq.reindex_needed()
                || list.reindex_needed()
            {
                misreads.lock().unwrap().push(format!(
                    "groups {groups:?}, letters {letters:?}, list depth {} indexed {}, status {:?}",
                    list.depth, list.indexed, status.dlq
                ));
            }
            reads.fetch_add(1, Ordering::SeqCst);
        }
    };
    let scenario = async {
        let runs = || reports.lock().unwrap().len();
        wait_until("a reconcile run before the replay", PROCESSING, || async {
            check(runs() >= 1, || {
                format!("failures {:?}", failed.lock().unwrap())
            })
        })
        .await;
        fixed.store(true, Ordering::SeqCst);
        let started = now_ms();
        let replay = dlq::replay(
            &fleet,
            &ReplayConfig {
                filters: Filters {
                    order_id: Some(shardline_contract::OrderId::new("ix-replay").unwrap()),
                    ..Filters::default()
                },
                rate: Some(2.0),
                ..ReplayConfig::default()
            },
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap();
        let ended = now_ms();
        downstream
            .wait_for("ix-replay's payments answered", PROCESSING, |calls| {
                answered(calls, "ix-replay") == REPLAYED
            })
            .await;
        env.wait_shard_queues_drained(PROCESSING).await;
        // Runs go on until one finds ix-replay's payment processed.
        wait_until("a reconcile run after the replay", PROCESSING, || async {
            let reports = reports.lock().unwrap();
            check(
                reports
                    .iter()
                    .any(|r| r.pending.len() == 1 && r.processed == 1),
                || format!("{} run(s), the last {:?}", reports.len(), reports.last()),
            )
        })
        .await;
        cancel.cancel();
        (replay, started, ended)
    };
    let ((), (), (replay, started, ended)) = tokio::join!(reconciling, reading, scenario);

    let reports = reports.into_inner().unwrap();
    assert!(failed.into_inner().unwrap().is_empty());
    let misreads = misreads.into_inner().unwrap();
    assert!(
        misreads.is_empty(),
        "{} misread(s): {misreads:#?}",
        misreads.len()
    );
    let reads = reads.into_inner();
    assert!(reads >= 10, "only {reads} reads of the index");
    assert_eq!(
        (replay.matching, replay.replayed),
        (REPLAYED, REPLAYED),
        "{replay:?}"
    );
    assert!(
        replay.locked_elsewhere.is_empty() && !replay.cancelled,
        "{replay:?}"
    );
    let during = reports
        .iter()
        .filter(|r| (started..=ended).contains(&at_ms(r)))
        .count();
    assert!(
        during >= 1,
        "no run ended during the replay ({started}..{ended} ms)"
    );
    for (i, r) in reports.iter().enumerate() {
        assert!(r.drift.is_empty() && r.emitted() == 0, "run {i}: {r:?}");
        let dead = r
            .pending
            .iter()
            .find(|p| p.expected.order_id == "ix-dlq")
            .unwrap_or_else(|| panic!("run {i}: ix-dlq not pending: {r:?}"));
        assert_eq!(
            dead.why,
            OnItsWay::DeadLettered {
                id: letter_id.clone()
            },
            "run {i}: {r:?}"
        );
        // ix-replay: in the DLQ, being replayed, or processed; never drifted.
        assert_eq!(r.scanned, 2, "run {i}: {r:?}");
        assert_eq!(r.pending.len() as u64 + r.processed, 2, "run {i}: {r:?}");
    }
    eprintln!(
        "index under load: {} reconcile runs ({during} during the replay), {reads} reads",
        reports.len()
    );

    // Each run's summary was kept, none with a compensation.
    let kept = reconcile::runs(&fleet, RUNS_CAP).await.unwrap();
    assert_eq!(kept.len(), reports.len().min(RUNS_CAP), "{kept:#?}");
    assert!(
        kept.iter()
            .all(|s| s.emitted == 0 && s.drifted == 0 && s.pending >= 1),
        "{kept:#?}"
    );

    // ix-dlq's letter stays, alone, in the DLQ and in the index.
    assert_eq!(depth(&env, &conn).await, 1);
    let list = dlq::list(&fleet, &Filters::default()).await.unwrap();
    assert_eq!(list.indexed, 1, "{list:?}");
    assert_eq!(list.letters[0].id, letter_id, "{list:?}");
    let calls = downstream.calls();
    assert_eq!(answered(&calls, "ix-replay"), REPLAYED);
    assert!(
        !calls
            .iter()
            .any(|c| String::from_utf8_lossy(&c.body).contains("\"compensation\"")),
        "a compensation went out"
    );
}

/// Waits until `fleet`'s index holds `n` letters.
async fn wait_fleet_indexed(fleet: &Fleet, n: u64) {
    wait_until(
        &format!("{n} letter(s) in the index"),
        PROCESSING,
        || async {
            let list = dlq::list(fleet, &Filters::default()).await.unwrap();
            check(list.indexed == n, || {
                format!("indexed {}, depth {}", list.indexed, list.depth)
            })
        },
    )
    .await;
}

/// A worker on a private Redis dead-letters payments of three orders
/// (answered 422), of two more (answered 400) and a body that is not JSON:
/// three failure groups. `FLUSHDB` loses the index: the DLQ shows six
/// letters and an empty index ("reindex needed"); `dlq reindex` rebuilds the
/// same groups (ids, reasons, errors, counts, times, orders) and the same
/// entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_reindex_after_flushdb_rebuilds_the_same_groups() {
    let env = TestEnv::new("dlq-reindex-flush").await;
    env.apply_topology().await;
    let redis = RedisServer::start(&env.id).await;
    let fleet = env.ops_fleet_on(&redis.url());
    let conn = env.connect().await;
    let downstream = Downstream::scripted(|call, _| match call.order_id.as_deref() {
        Some(o) if o.starts_with("rx-a") => Reply::status(422),
        _ => Reply::status(400),
    })
    .await;
    let worker = env
        .start_worker("w1", &downstream, |c| {
            c.redis = redis.url().parse().unwrap()
        })
        .await;
    let publisher = Publisher::connect(&env).await;
    let orders = ["rx-a-1", "rx-a-2", "rx-a-3", "rx-b-1", "rx-b-2"];
    for order in orders {
        publisher
            .publish_raw(env.shard_of(order), &payment(order, 0))
            .await;
    }
    publisher.publish_raw(0, b"not json").await;
    wait_depth(&env, &conn, 6, PROCESSING).await;
    wait_fleet_indexed(&fleet, 6).await;
    worker.stop().await;

    let before = dlq::groups(&fleet).await.unwrap();
    let entries = dlq::letters(&fleet, &LetterQuery::default()).await.unwrap();
    let shape: Vec<(&str, u64, u64)> = before
        .iter()
        .map(|g| (g.group.reason.as_str(), g.count, g.orders))
        .collect();
    assert_eq!(
        shape,
        [("handler", 3, 3), ("handler", 2, 2), ("decode", 1, 0)],
        "{before:#?}"
    );
    assert_ne!(before[0].group.error, before[1].group.error, "{before:#?}");
    assert!(before.iter().all(|g| g.first_failed_ms > 0), "{before:#?}");

    // Redis loses everything: the DLQ is deeper than its index.
    redis::cmd("FLUSHDB")
        .query::<()>(&mut redis.connection())
        .unwrap();
    let lost = dlq::list(&fleet, &Filters::default()).await.unwrap();
    assert_eq!((lost.depth, lost.indexed), (6, 0), "{lost:?}");
    assert!(lost.reindex_needed(), "{lost:?}");
    assert!(lost.table().contains("reindex needed"), "{}", lost.table());
    let status = topology::status(&fleet, &StatusConfig::default())
        .await
        .unwrap();
    assert!(status.dlq.reindex_needed(), "{:?}", status.dlq);
    assert!(dlq::groups(&fleet).await.unwrap().is_empty());

    let report = dlq::reindex(&fleet, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(
        (
            report.read,
            report.indexed,
            report.derived,
            report.removed,
            report.groups
        ),
        (6, 6, 0, 0, 3),
        "{report:?}"
    );
    assert!(!report.cancelled);
    assert_eq!(dlq::groups(&fleet).await.unwrap(), before);
    assert_eq!(
        dlq::letters(&fleet, &LetterQuery::default()).await.unwrap(),
        entries
    );
    let rebuilt = dlq::list(&fleet, &Filters::default()).await.unwrap();
    assert!(!rebuilt.reindex_needed(), "{rebuilt:?}");
    assert_eq!(
        depth(&env, &conn).await,
        6,
        "reindex must leave the DLQ as it was"
    );
}
