//! A bench run: the drain rates of every setting in rounds, the HTTP
//! downstream's rates, or open-loop latency; what it reports as it goes
//! ([`BenchEvent`]) and at the end ([`BenchReport`]).

use std::fmt;
use std::time::Duration;

use shardline_contract::ShardCount;
use shardline_ops::Fleet;
use shardline_worker::GroupCommit;
use tokio_util::sync::CancellationToken;

use crate::drain;
use crate::error::Error;
use crate::latency::{self, LatencyRow};
use crate::rounds::{self, Baseline, Kind, Round, Summary};
use crate::settings::{BenchSettings, LatencySettings, Setting};

/// One step of a run, for a front end to show as it goes.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum BenchEvent {
    /// A drain run starts.
    Started {
        events: u64,
        unsequenced: bool,
        event_bytes: usize,
        shards: ShardCount,
        prefetch: Vec<u16>,
        concurrency: Vec<u16>,
        group_commit: GroupCommit,
        downstream_latency: Option<Duration>,
        rounds: u32,
    },
    /// One drain of round `round` by `kind` (labelled `label`) ran at `rate` events/s.
    Drained {
        round: u32,
        setting: Setting,
        label: &'static str,
        rate: f64,
    },
    /// Round `round`'s worker / `baseline` ratio.
    Ratio {
        round: u32,
        baseline: Baseline,
        ratio: f64,
    },
    /// The worker drained at `rate`; latency is measured at half of it.
    LatencyRate { setting: Setting, rate: f64 },
    /// A latency run starts.
    LatencyStarted {
        rate: f64,
        duration: Duration,
        warmup: Duration,
        shards: ShardCount,
        setting: Setting,
    },
}

/// One line for an operator.
impl fmt::Display for BenchEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Started {
                events,
                unsequenced,
                event_bytes,
                shards,
                prefetch,
                concurrency,
                group_commit,
                downstream_latency,
                rounds,
            } => write!(
                f,
                "bench: {events} {}events of ~{event_bytes} bytes over {shards} shards, prefetch {prefetch:?}, concurrency {concurrency:?}, group commit {group_commit}, {}, {rounds} round(s)",
                if *unsequenced { "unsequenced " } else { "" },
                downstream_latency.map_or_else(
                    || "noop handler".to_owned(),
                    |l| format!("downstream latency {}", humantime::format_duration(l))
                ),
            ),
            Self::Drained {
                round,
                setting,
                label,
                rate,
            } => write!(
                f,
                "  round {round}  prefetch {:>3}  concurrency {:>3}  {label:<28} {rate:>9.0} events/s",
                setting.prefetch, setting.concurrency
            ),
            Self::Ratio {
                round,
                baseline,
                ratio,
            } => write!(
                f,
                "  round {round}  worker / {}: {ratio:.2}",
                baseline.label()
            ),
            Self::LatencyRate { setting, rate } => write!(
                f,
                "  prefetch {:>3}  concurrency {:>3}  worker drain {rate:.0} events/s; latency at half of it",
                setting.prefetch, setting.concurrency
            ),
            Self::LatencyStarted {
                rate,
                duration,
                warmup,
                shards,
                setting,
            } => write!(
                f,
                "bench --latency: {rate:.0} events/s for {} after a {} warm-up, {shards} shards, prefetch {}, concurrency {}, noop handler",
                humantime::format_duration(*duration),
                humantime::format_duration(*warmup),
                setting.prefetch,
                setting.concurrency
            ),
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum BenchReport {
    /// Drain rates per setting, medians of the rounds, against the baselines.
    Drain { summaries: Vec<Summary> },
    /// Drain rates per setting with the HTTP downstream.
    Downstream { summaries: Vec<Summary> },
    /// Open-loop latency per setting.
    Latency { rows: Vec<LatencyRow> },
}

impl BenchReport {
    /// The report's table.
    pub fn table(&self) -> String {
        match self {
            Self::Drain { summaries } => rounds::table(summaries),
            Self::Downstream { summaries } => {
                let mut out = format!(
                    "{:>8}  {:>11}  {:>15}  {:>12}\n",
                    "prefetch", "concurrency", "worker events/s", "vs first"
                );
                let first = summaries.first().map_or(0.0, |s| s.worker);
                for s in summaries {
                    out.push_str(&format!(
                        "{:>8}  {:>11}  {:>15.0}  {:>11.2}x\n",
                        s.prefetch,
                        s.concurrency,
                        s.worker,
                        s.worker / first
                    ));
                }
                out
            }
            Self::Latency { rows } => latency::table(rows),
        }
    }
}

fn kind_label(kind: Kind, downstream: bool) -> &'static str {
    match (kind, downstream) {
        (Kind::Raw(b), _) => b.label(),
        (Kind::Worker, false) => "shardline worker (noop)",
        (Kind::Worker, true) => "shardline worker (http)",
    }
}

/// Runs the bench `args` describes on throwaway names beside `fleet`'s
/// (its broker, Redis and shard count), reporting each step to `progress`,
/// until done or `shutdown`.
pub async fn run(
    fleet: &Fleet,
    args: &BenchSettings,
    shutdown: &CancellationToken,
    mut progress: impl FnMut(BenchEvent),
) -> Result<BenchReport, Error> {
    args.check()?;
    if let Some(latency) = &args.latency {
        return run_latency(fleet, args, latency, shutdown, progress).await;
    }
    let stop_downstream = CancellationToken::new();
    let _stop_downstream = stop_downstream.clone().drop_guard();
    let downstream = match args.downstream_latency {
        Some(latency) => Some(drain::start_downstream(latency, stop_downstream).await?),
        None => None,
    };
    progress(BenchEvent::Started {
        events: args.events,
        unsequenced: args.unsequenced,
        event_bytes: args.event_bytes,
        shards: fleet.shards,
        prefetch: args.prefetch.clone(),
        concurrency: args.concurrency.clone(),
        group_commit: args.group_commit,
        downstream_latency: args.downstream_latency,
        rounds: args.rounds,
    });
    let mut baselines = args.baselines.clone();
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
                    return Err(Error::Failed("interrupted".into()));
                }
                let rate = drain::measure(fleet, args, kind, setting, downstream).await?;
                progress(BenchEvent::Drained {
                    round,
                    setting,
                    label: kind_label(kind, downstream.is_some()),
                    rate,
                });
                this.record(kind, rate);
            }
            for &baseline in baselines {
                if let Some(ratio) = this.ratio(baseline) {
                    progress(BenchEvent::Ratio {
                        round,
                        baseline,
                        ratio,
                    });
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
    Ok(if downstream.is_some() {
        BenchReport::Downstream { summaries }
    } else {
        BenchReport::Drain { summaries }
    })
}

async fn run_latency(
    fleet: &Fleet,
    args: &BenchSettings,
    latency: &LatencySettings,
    shutdown: &CancellationToken,
    mut progress: impl FnMut(BenchEvent),
) -> Result<BenchReport, Error> {
    let mut rows = Vec::new();
    for setting in args.settings() {
        let rate = match latency.rate {
            Some(rate) => rate,
            None => {
                let drained = drain::measure(fleet, args, Kind::Worker, setting, None).await?;
                progress(BenchEvent::LatencyRate {
                    setting,
                    rate: drained,
                });
                drained / 2.0
            }
        };
        if shutdown.is_cancelled() {
            return Err(Error::Failed("interrupted".into()));
        }
        progress(BenchEvent::LatencyStarted {
            rate,
            duration: latency.duration,
            warmup: latency.warmup,
            shards: fleet.shards,
            setting,
        });
        rows.push(latency::measure(fleet, args, latency, setting, rate, shutdown).await?);
    }
    Ok(BenchReport::Latency { rows })
}
