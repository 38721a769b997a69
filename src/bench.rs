//! `shardline bench` and the hidden `bench-publisher`: flags to
//! [`shardline_bench`], its progress and report printed.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use shardline_bench::{Baseline, BenchSettings, LatencySettings, PacedSettings};
use shardline_worker::GroupCommit;
use tokio_util::sync::CancellationToken;

use crate::publish::{parse_rate, publisher_config};
use crate::worker::OnDeadLetterArg;
use crate::{Flags as _, GlobalArgs};

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
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub prefetch: Vec<u16>,
    /// Calls in flight per shard (`worker --concurrency`) to measure,
    /// comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
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
    #[arg(long, value_enum, value_delimiter = ',', default_value = "set,nodedup")]
    pub baseline: Vec<BaselineArg>,
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

/// A raw lapin consume-and-ack loop the worker is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BaselineArg {
    /// One Redis `SET key 1 NX EX` per event, then the ack.
    Set,
    /// The ack only, no Redis at all.
    Nodedup,
}

impl From<BaselineArg> for Baseline {
    fn from(arg: BaselineArg) -> Self {
        match arg {
            BaselineArg::Set => Self::Set,
            BaselineArg::Nodedup => Self::Nodedup,
        }
    }
}

#[derive(Debug, Args)]
pub(crate) struct PacedArgs {
    /// Events per second.
    #[arg(long, value_parser = parse_rate)]
    pub rate: f64,
    /// Events to send in all.
    #[arg(long)]
    pub events: u64,
    /// When event 0 is due, µs since the Unix epoch.
    #[arg(long)]
    pub start_unix_us: u64,
    /// Events per order (seq 1..E, orders interleaved).
    #[arg(long, default_value_t = 5)]
    pub events_per_order: u64,
    /// Approximate body size of each event, in bytes.
    #[arg(long, default_value_t = 200)]
    pub event_bytes: usize,
}

impl BenchArgs {
    /// The library's settings; the publisher of `--latency` is this binary.
    fn settings(self) -> anyhow::Result<BenchSettings> {
        let latency = if self.latency {
            Some(LatencySettings {
                rate: self.rate,
                duration: self.duration,
                warmup: self.warmup,
                publisher: std::env::current_exe()
                    .context("finding this binary to run the publisher")?,
            })
        } else {
            None
        };
        Ok(BenchSettings {
            events: self.events,
            events_per_order: self.events_per_order,
            event_bytes: self.event_bytes,
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            group_commit: self.group_commit,
            downstream_latency: self.downstream_latency,
            baselines: self.baseline.into_iter().map(Baseline::from).collect(),
            rounds: self.rounds,
            peer: self.peer,
            unsequenced: self.unsequenced,
            on_dead_letter: self.on_dead_letter.into(),
            kinds_ttl: self.kinds_ttl,
            latency,
        })
    }
}

pub(crate) async fn run(
    global: &GlobalArgs,
    args: BenchArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let settings = args.settings()?;
    let report = shardline_bench::run(&global.fleet(), &settings, &shutdown, |event| {
        eprintln!("{event}");
    })
    .await
    .flags()?;
    println!();
    print!("{}", report.table());
    Ok(ExitCode::SUCCESS)
}

/// `bench-publisher`: publishes on the schedule, prints its report as one JSON line.
pub(crate) async fn run_publisher(
    global: &GlobalArgs,
    args: PacedArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let settings = PacedSettings {
        rate: args.rate,
        events: args.events,
        start_unix_us: args.start_unix_us,
        events_per_order: args.events_per_order,
        event_bytes: args.event_bytes,
    };
    let config = publisher_config(global, 1024, "shardline bench latency publisher");
    let report = shardline_bench::paced::publish(config, &settings, &shutdown)
        .await
        .flags()?;
    println!("{}", report.to_json());
    Ok(ExitCode::SUCCESS)
}
