//! Reconcile's runs at an interval, kept in Redis: `Reconciler::run_every`
//! writes a summary per run (the counts of its report, or its error), newest
//! first, at most `RUNS_CAP`; a single run writes none; a summary that cannot
//! be written stops no run; `shardline reconcile --interval` keeps them too.

use std::sync::Mutex;
use std::time::Duration;

use shardline_ops::reconcile::{self, RUNS_CAP, RunSummary};
use shardline_ops::{Event, Fleet, ReconcileConfig, ReconcileReport, Reconciler};
use shardline_testkit::wait::check;
use shardline_testkit::{ChildWorker, OrdersDb, PROCESSING, TestEnv, wait_until};
use tokio_util::sync::CancellationToken;

const SETTLED: Duration = Duration::from_secs(600);
const INTERVAL: Duration = Duration::from_millis(300);

/// Runs `reconciler` every [`INTERVAL`] until `enough(reports, failures)`
/// holds (checked as a `wait_until` probe), then stops it; its reports and
/// failures, in run order.
async fn run_until(
    reconciler: &Reconciler,
    what: &str,
    enough: impl Fn(&[ReconcileReport], &[String]) -> bool,
) -> (Vec<ReconcileReport>, Vec<String>) {
    let seen: Mutex<(Vec<ReconcileReport>, Vec<String>)> = Mutex::default();
    let cancel = CancellationToken::new();
    let progress = |event| {
        let mut seen = seen.lock().unwrap();
        match event {
            Event::Reconciled(report) => seen.0.push(*report),
            Event::ReconcileFailed { error } => seen.1.push(error),
            _ => {}
        }
    };
    let stop = async {
        wait_until(what, PROCESSING, || async {
            let seen = seen.lock().unwrap();
            if enough(&seen.0, &seen.1) {
                Ok(())
            } else {
                Err(format!("{} run(s), failures {:?}", seen.0.len(), seen.1))
            }
        })
        .await;
        cancel.cancel();
    };
    tokio::join!(reconciler.run_every(INTERVAL, &cancel, progress), stop);
    seen.into_inner().unwrap()
}

async fn runs(fleet: &Fleet) -> Vec<RunSummary> {
    reconcile::runs(fleet, RUNS_CAP).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_at_an_interval_keeps_each_runs_summary() {
    let env = TestEnv::new("reconcile-runs").await;
    env.apply_topology().await;
    let db = OrdersDb::new(&env).await;
    db.set("rs-missing", "PAID", SETTLED).await;
    db.set("rs-fresh", "PAID", Duration::from_secs(30)).await;
    db.set("rs-created", "CREATED", SETTLED).await;
    let fleet = env.ops_fleet();
    let config = ReconcileConfig {
        orders_url: db.url(),
        ..ReconcileConfig::default()
    };

    // A single run (a dry run here) keeps no summary.
    let dry = Reconciler::new(
        fleet.clone(),
        ReconcileConfig {
            dry_run: true,
            ..config.clone()
        },
    )
    .unwrap();
    let once = dry.run_once(&CancellationToken::new()).await.unwrap();
    assert_eq!(once.drift.len(), 1, "{once:?}");
    assert!(runs(&fleet).await.is_empty());

    // No worker runs: the first run emits rs-missing's compensation, the
    // later ones find it pending.
    let reconciler = Reconciler::new(fleet.clone(), config.clone()).unwrap();
    let (reports, failures) =
        run_until(&reconciler, "three reconcile runs", |r, _| r.len() >= 3).await;
    assert!(failures.is_empty(), "{failures:?}");
    let kept = runs(&fleet).await;
    assert_eq!(kept.len(), reports.len(), "{kept:#?}");
    for (summary, report) in kept.iter().rev().zip(&reports) {
        assert_eq!(
            *summary,
            RunSummary {
                took_ms: summary.took_ms,
                ..RunSummary::of(report, Duration::ZERO)
            }
        );
    }
    assert!(
        kept.windows(2).all(|w| w[0].at_ms >= w[1].at_ms),
        "{kept:#?}"
    );
    let first = kept.last().unwrap();
    assert_eq!(
        (
            first.scanned,
            first.fresh,
            first.drifted,
            first.emitted,
            first.pending
        ),
        (3, 1, 1, 1, 0),
        "{first:?}"
    );
    assert!(!first.dry_run && first.error.is_none(), "{first:?}");
    for later in &kept[..kept.len() - 1] {
        assert_eq!(
            (
                later.drifted,
                later.emitted,
                later.pending,
                later.error.as_deref()
            ),
            (0, 0, 1, None),
            "{later:?}"
        );
    }

    // Failed runs are kept too, with their error (no password in it).
    let broken = Reconciler::new(
        fleet.clone(),
        ReconcileConfig {
            orders_url: "postgres://postgres:s3cret@127.0.0.1:1/test".into(),
            ..config.clone()
        },
    )
    .unwrap();
    let (_, failures) = run_until(&broken, "two failed runs", |_, f| f.len() >= 2).await;
    let kept = runs(&fleet).await;
    assert_eq!(kept.len(), reports.len() + failures.len(), "{kept:#?}");
    for (summary, error) in kept.iter().zip(failures.iter().rev()) {
        assert_eq!(summary.error.as_ref(), Some(error), "{summary:?}");
        assert!(
            error
                .starts_with("orders_url postgres://postgres:***@127.0.0.1:1/test: cannot connect")
                && !error.contains("s3cret"),
            "{error}"
        );
        assert_eq!((summary.scanned, summary.emitted), (0, 0), "{summary:?}");
    }

    // A summary that cannot be written (the key holds a string) is logged;
    // the runs go on.
    let mut redis = env.redis().await;
    redis::cmd("SET")
        .arg(fleet.keys.reconcile_runs())
        .arg("not a list")
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
    let (reports, _) = run_until(&reconciler, "two runs over a broken key", |r, _| {
        r.len() >= 2
    })
    .await;
    assert!(reports.iter().all(|r| r.drift.is_empty()), "{reports:?}");
    assert!(reconcile::runs(&fleet, 10).await.is_err());
    let refused = reconcile::record_run(&fleet, &RunSummary::of(&reports[0], Duration::ZERO)).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("writing reconcile's run summaries")),
        "{refused:?}"
    );

    // The cap: the RUNS_CAP newest summaries are kept.
    redis::cmd("DEL")
        .arg(fleet.keys.reconcile_runs())
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
    for i in 0..RUNS_CAP + 5 {
        reconcile::record_run(
            &fleet,
            &RunSummary::failed(format!("run {i}"), Duration::ZERO),
        )
        .await
        .unwrap();
    }
    let kept = reconcile::runs(&fleet, RUNS_CAP + 10).await.unwrap();
    assert_eq!(kept.len(), RUNS_CAP);
    assert_eq!(kept[0].error, Some(format!("run {}", RUNS_CAP + 4)));
    assert_eq!(kept[RUNS_CAP - 1].error.as_deref(), Some("run 5"));

    // `shardline reconcile --interval` keeps them, as the library does.
    redis::cmd("DEL")
        .arg(fleet.keys.reconcile_runs())
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
    let url = db.url();
    let mut cmd = env.shardline_command();
    cmd.args(["reconcile", "--orders-url", &url, "--interval", "300ms"])
        .args(env.global_args());
    let mut cli = ChildWorker::spawn(&env, "reconcile-interval", cmd);
    wait_until("two runs of the CLI kept", PROCESSING, || {
        cli.assert_running("keeping two runs");
        let fleet = &fleet;
        async move {
            let kept = runs(fleet).await;
            check(kept.len() >= 2, || format!("{kept:#?}"))
        }
    })
    .await;
    cli.sigterm();
    assert!(cli.wait_exit(PROCESSING).await.success());
    let kept = runs(&fleet).await;
    assert!(
        kept.iter()
            .all(|s| s.error.is_none() && s.scanned == 3 && s.pending == 1),
        "{kept:#?}"
    );
}
