//! `shardline bench`: the worker draining a pre-published load, next to raw
//! lapin consume-and-ack loops (with one Redis `SET NX EX` per event, and
//! without Redis), measured in alternating rounds of the same run on the same
//! broker, Redis and shard count. With `--downstream-latency` the worker calls
//! a local HTTP downstream that answers after that long (the `http` handler),
//! once per `--concurrency` value, and the rates are compared with the first
//! value's. With `--latency` it measures open-loop latency at a fixed rate
//! instead. Modules, in the order a run uses them:
//!
//! - `rounds`: the kinds of a round, per-round ratios, medians and spreads, the table.
//! - `drain`: one drain measurement (pre-publish, drain, clean up), the baselines.
//! - `latency`: `--latency`: the worker with a recording handler, the report.
//! - `schedule`: the intended send times and the event ids that carry them.
//! - `paced`: the publisher child process of `--latency` (`bench-publisher`).
//! - `cpu`: CPU time per process from `/proc`.

mod cpu;
mod drain;
mod latency;
pub(crate) mod paced;
mod rounds;
mod schedule;

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use shardline_worker::GroupCommit;
use tokio_util::sync::CancellationToken;

use crate::GlobalArgs;
use crate::publish::parse_rate;
use crate::worker::OnDeadLetterArg;
use rounds::{Baseline, Kind, Round, Summary};

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Events pre-published for each measurement.
    #[arg(long, default_value_t = 50_000)]
    pub events: u64,
    /// Events per order (seq 1..E).
    #[arg(long, default_value_t = 5)]
    pub events_per_order: u64,
    /// Approximate body size of each event, in bytes.
    #[arg(long, default_value_t = 200)]
    pub event_bytes: usize,
    /// Prefetch settings to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u16, 32])]
    pub prefetch: Vec<u16>,
    /// Calls in flight per shard (`worker --concurrency`) to measure,
    /// comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u16])]
    pub concurrency: Vec<u16>,
    /// The worker's `--group-commit` (`auto`: the worker's default; 1: strict).
    #[arg(long, value_name = "auto|N", default_value_t = GroupCommit::Auto)]
    pub group_commit: GroupCommit,
    /// Call a local HTTP downstream that answers 200 after this long (the
    /// worker's `http` handler) instead of the `noop` handler; the raw loops
    /// are not measured then.
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "latency")]
    pub downstream_latency: Option<Duration>,
    /// Raw loops the worker is compared with, comma-separated: `set` (one
    /// Redis `SET NX EX` per event), `nodedup` (no Redis).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Baseline::Set, Baseline::Nodedup])]
    pub baseline: Vec<Baseline>,
    /// Rounds per setting; each round measures every kind once, one after
    /// another. Medians are reported, with the spread of the ratios.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    /// Also drain the load with this program, a consumer written with another
    /// library (`bench/peer/`), as a check: it gets the queues, prefetch,
    /// Redis URL and key prefix in `PEER_*` variables and exits when it has
    /// acked `PEER_TOTAL` events.
    #[arg(long, value_name = "PATH", conflicts_with = "downstream_latency")]
    pub peer: Option<std::path::PathBuf>,
    /// Publish the events without `seq` (each is deduplicated by its own key;
    /// no order gate, no grouping).
    #[arg(long)]
    pub unsequenced: bool,
    /// The worker's `--on-dead-letter` mode (quarantine costs one Redis round
    /// trip per event).
    #[arg(long, value_enum, default_value_t = OnDeadLetterArg::Continue)]
    pub on_dead_letter: OnDeadLetterArg,
    /// The worker's `--kinds-ttl` (`0s`: record no kinds, to measure their cost).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub kinds_ttl: Option<Duration>,
    /// Open-loop latency instead of drain rates: a publisher process sends at
    /// `--rate` while the worker (noop handler) consumes.
    #[arg(long)]
    pub latency: bool,
    /// `--latency`: events per second, on a fixed schedule. Without it, the
    /// worker's drain rate of `--events` is measured first and half of it used.
    #[arg(long, requires = "latency", value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// `--latency`: how long the measured part lasts.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// `--latency`: published and consumed first, not counted.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub warmup: Duration,
}

/// One measured setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Setting {
    prefetch: u16,
    concurrency: u16,
}

impl BenchArgs {
    fn settings(&self) -> Vec<Setting> {
        self.prefetch
            .iter()
            .flat_map(|&prefetch| {
                self.concurrency.iter().map(move |&concurrency| Setting {
                    prefetch,
                    concurrency,
                })
            })
            .collect()
    }
}

fn kind_label(kind: Kind, downstream: bool) -> &'static str {
    match (kind, downstream) {
        (Kind::Raw(b), _) => b.label(),
        (Kind::Worker, false) => "shardline worker (noop)",
        (Kind::Worker, true) => "shardline worker (http)",
    }
}

pub(crate) async fn run(
    global: &GlobalArgs,
    args: BenchArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.events > 0, "--events must be at least 1");
    anyhow::ensure!(
        args.events_per_order > 0,
        "--events-per-order must be at least 1"
    );
    anyhow::ensure!(
        !args.prefetch.contains(&0),
        "--prefetch values must be at least 1"
    );
    anyhow::ensure!(
        !args.concurrency.contains(&0),
        "--concurrency values must be at least 1"
    );
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    if args.latency {
        return run_latency(global, &args, &shutdown).await;
    }
    let stop_downstream = CancellationToken::new();
    let _stop_downstream = stop_downstream.clone().drop_guard();
    let downstream = match args.downstream_latency {
        Some(latency) => Some(drain::start_downstream(latency, stop_downstream).await?),
        None => None,
    };
    eprintln!(
        "bench: {} {}events of ~{} bytes over {} shards, prefetch {:?}, concurrency {:?}, group commit {}, {}, {} round(s)",
        args.events,
        if args.unsequenced { "unsequenced " } else { "" },
        args.event_bytes,
        global.shards,
        args.prefetch,
        args.concurrency,
        args.group_commit,
        args.downstream_latency.map_or_else(
            || "noop handler".to_owned(),
            |l| format!("downstream latency {}", humantime::format_duration(l))
        ),
        args.rounds
    );
    let mut baselines = args.baseline.clone();
    if args.peer.is_some() {
        baselines.push(Baseline::Peer);
    }
    if downstream.is_some() {
        baselines.clear();
    }
    let baselines = &baselines[..];
    let order = rounds::round_order(baselines);
    let mut summaries = Vec::new();
    for setting in args.settings() {
        let mut measured = Vec::new();
        for round in 1..=args.rounds {
            let mut this = Round::default();
            for &kind in &order {
                if shutdown.is_cancelled() {
                    anyhow::bail!("interrupted");
                }
                let rate = drain::measure(global, &args, kind, setting, downstream).await?;
                eprintln!(
                    "  round {round}  prefetch {:>3}  concurrency {:>3}  {:<28} {rate:>9.0} events/s",
                    setting.prefetch,
                    setting.concurrency,
                    kind_label(kind, downstream.is_some())
                );
                this.record(kind, rate);
            }
            for &b in baselines {
                if let Some(ratio) = this.ratio(b) {
                    eprintln!("  round {round}  worker / {}: {ratio:.2}", b.label());
                }
            }
            measured.push(this);
        }
        summaries.push(Summary::new(
            setting.prefetch,
            setting.concurrency,
            baselines,
            &measured,
        ));
    }
    println!();
    if downstream.is_some() {
        println!(
            "{:>8}  {:>11}  {:>15}  {:>12}",
            "prefetch", "concurrency", "worker events/s", "vs first"
        );
        let first = summaries.first().map_or(0.0, |s| s.worker);
        for s in summaries {
            println!(
                "{:>8}  {:>11}  {:>15.0}  {:>11.2}x",
                s.prefetch,
                s.concurrency,
                s.worker,
                s.worker / first
            );
        }
    } else {
        print!("{}", rounds::table(&summaries));
    }
    Ok(ExitCode::SUCCESS)
}

async fn run_latency(
    global: &GlobalArgs,
    args: &BenchArgs,
    shutdown: &CancellationToken,
) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    for setting in args.settings() {
        let rate = match args.rate {
            Some(rate) => rate,
            None => {
                let drained = drain::measure(global, args, Kind::Worker, setting, None).await?;
                eprintln!(
                    "  prefetch {:>3}  concurrency {:>3}  worker drain {drained:.0} events/s; latency at half of it",
                    setting.prefetch, setting.concurrency
                );
                drained / 2.0
            }
        };
        if shutdown.is_cancelled() {
            anyhow::bail!("interrupted");
        }
        eprintln!(
            "bench --latency: {rate:.0} events/s for {} after a {} warm-up, {} shards, prefetch {}, concurrency {}, noop handler",
            humantime::format_duration(args.duration),
            humantime::format_duration(args.warmup),
            global.shards,
            setting.prefetch,
            setting.concurrency
        );
        let row = latency::measure(global, args, setting, rate, shutdown).await?;
        rows.push(row);
    }
    println!();
    print!("{}", latency::table(&rows));
    Ok(ExitCode::SUCCESS)
}
