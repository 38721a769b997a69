//! The chaos soak (`scripts/soak`): the fleet under a steady load for minutes
//! while a schedule drawn from a seed overlaps faults, then a check of the
//! whole history against the bounds of `docs/failures.md` and a report.
//!
//! The stage: a private three-node RabbitMQ cluster with the quorum topology
//! (`scripts/cluster`), a private Redis primary, replica and three Sentinels,
//! three `shardline worker --assign auto` processes (one at `--concurrency
//! 4`, one at `--prefetch 32` with the default grouping, one with the
//! defaults), the project's publisher at a steady rate over 200 orders, and a
//! downstream that records every call. The schedule (`shardline_soak`) kills
//! and stops workers, kills and cuts off broker nodes, fails the Redis primary
//! over, takes the downstream out or slows it, raises a memory alarm and sends
//! poison and hostile-header events; faults overlap.
//!
//! The check (`shardline_soak::check`) reads the downstream's calls, the
//! publisher's confirms and the DLQ. The test prints the seed and the schedule
//! first, writes `report.md` and `throughput.png` into
//! `SHARDLINE_SOAK_OUT` (default `target/soak`), and fails on any violation.
//!
//! Settings, from the environment (`scripts/soak` sets them from its flags):
//! `SHARDLINE_SOAK_MINUTES` (3), `SHARDLINE_SOAK_SEED` (1), `SHARDLINE_SOAK_RATE`
//! (events per second, 100), `SHARDLINE_SOAK_OUT`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod record;
mod rig;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline_contract::OrderId;
use shardline_soak::{Fleet, History, Schedule, Summary, check, write_report};

use crate::record::Recorder;
use crate::rig::Rig;

/// What one soak runs: its length, its seed, its rate and where its report goes.
struct Settings {
    run: Duration,
    seed: u64,
    rate: u32,
    out: PathBuf,
}

impl Settings {
    fn from_env() -> Self {
        let number = |name: &str, default: u64| -> u64 {
            std::env::var(name).map_or(default, |v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{name} must be a whole number, got {v:?}"))
            })
        };
        Self {
            run: Duration::from_secs(number("SHARDLINE_SOAK_MINUTES", 3) * 60),
            seed: number("SHARDLINE_SOAK_SEED", 1),
            rate: u32::try_from(number("SHARDLINE_SOAK_RATE", 100)).unwrap(),
            out: std::env::var_os("SHARDLINE_SOAK_OUT").map_or_else(
                || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/soak"),
                PathBuf::from,
            ),
        }
    }
}

/// How long the fleet gets after the run to process what was published.
const SETTLE: Duration = Duration::from_secs(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the chaos soak: scripts/soak runs it (a cluster, Sentinels, three workers, minutes)"]
async fn soak() {
    let settings = Settings::from_env();
    let schedule = Schedule::from_seed(settings.seed, settings.run);
    println!("{}", schedule.render());
    let fleet = Fleet::soak();
    let rig = Arc::new(Rig::start(&settings, &fleet).await);
    let start = Instant::now();
    let recorder = Recorder::start(rig.clone(), start);
    let faults = rig.run_schedule(&schedule, start).await;
    rig.stop_load().await;
    rig.settle(SETTLE).await;
    let samples = recorder.stop().await;
    let topology = rig.topology().await;
    let routing = topology.routing().unwrap();
    let resharded = rig.resharded();
    // A call before the reshard finished counts on the order's first shard
    // (md5 mod 8), one after it on the order's shard by the final map.
    let shard_of = |order: &str, at: Instant| match (resharded, OrderId::new(order)) {
        (Some(done), Ok(id)) if at >= done => routing.shard_of(&id).get(),
        _ => rig.env.shard_of(order),
    };
    let history = History {
        shards: topology.shards,
        retired: topology.retired.clone(),
        published: rig.published(start),
        calls: record::calls(&rig.downstream.calls(), start, shard_of),
        letters: record::letters(&rig.env).await,
        faults,
        samples,
        final_consumers: rig.final_consumers(&topology).await,
        fleet,
    };
    let verdict = check(&history);
    for violation in &verdict.violations {
        println!("violation: {violation}");
    }
    let passed = verdict.passed();
    let summary = Summary::new(&history, verdict, settings.seed, settings.run);
    let report = write_report(&settings.out, &summary, &history).unwrap();
    println!("soak report: {}", report.display());
    rig.stop().await;
    assert!(
        passed,
        "the soak's check found violations (seed {}): see {}",
        settings.seed,
        report.display()
    );
}
