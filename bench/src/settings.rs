//! What a bench run measures: plain data, filled in by a front end (the CLI
//! from its flags) and checked by [`BenchSettings::check`].

use std::path::PathBuf;
use std::time::Duration;

use shardline_worker::{GroupCommit, OnDeadLetter};

use crate::error::Error;
use crate::rounds::Baseline;

/// A bench run: the load, the settings measured and how.
#[derive(Debug, Clone)]
pub struct BenchSettings {
    /// Events pre-published for each measurement.
    pub events: u64,
    /// Events per order (seq 1..E).
    pub events_per_order: u64,
    /// Approximate body size of each event, in bytes.
    pub event_bytes: usize,
    /// Prefetch settings to measure.
    pub prefetch: Vec<u16>,
    /// Calls in flight per shard to measure (each with every prefetch).
    pub concurrency: Vec<u16>,
    /// The worker's group commit.
    pub group_commit: GroupCommit,
    /// Call a local HTTP downstream that answers 200 after this long (the
    /// `http` handler) instead of the `noop` handler; no baselines then.
    pub downstream_latency: Option<Duration>,
    /// Raw loops the worker is compared with.
    pub baselines: Vec<Baseline>,
    /// Rounds per setting; each round measures every kind once.
    pub rounds: u32,
    /// A consumer written with another library (`bench/peer/`), also
    /// measured as a check: it gets the queues, prefetch, Redis URL and key
    /// prefix in `PEER_*` variables and exits when it has acked `PEER_TOTAL`.
    pub peer: Option<PathBuf>,
    /// Publish the events without `seq`.
    pub unsequenced: bool,
    /// The worker's mode after a dead letter.
    pub on_dead_letter: OnDeadLetter,
    /// The worker's kinds TTL (`None`: its default).
    pub kinds_ttl: Option<Duration>,
    /// Open-loop latency instead of drain rates.
    pub latency: Option<LatencySettings>,
}

/// `bench --latency`: a publisher process sends on a fixed schedule while the
/// worker (noop handler) consumes.
#[derive(Debug, Clone)]
pub struct LatencySettings {
    /// Events per second; without it, the worker's drain rate of
    /// [`BenchSettings::events`] is measured first and half of it used.
    pub rate: Option<f64>,
    /// How long the measured part lasts.
    pub duration: Duration,
    /// Published and consumed first, not counted.
    pub warmup: Duration,
    /// The program run as the publisher: it gets the subcommand
    /// `bench-publisher` with `--rate=`, `--events=`, `--start-unix-us=`,
    /// `--events-per-order=` and `--event-bytes=`, and the broker and names
    /// in `SHARDLINE_*` variables, and prints a [`PacedReport`](crate::PacedReport)
    /// as its last line (the `shardline` binary's hidden `bench-publisher`).
    pub publisher: PathBuf,
}

/// One measured setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    pub prefetch: u16,
    pub concurrency: u16,
}

impl BenchSettings {
    /// Refuses settings that measure nothing.
    pub fn check(&self) -> Result<(), Error> {
        if self.events == 0 {
            return Err(Error::setting(&["events"], "events must be at least 1"));
        }
        if self.events_per_order == 0 {
            return Err(Error::setting(
                &["events_per_order"],
                "events_per_order must be at least 1",
            ));
        }
        if self.prefetch.contains(&0) {
            return Err(Error::setting(
                &["prefetch"],
                "prefetch values must be at least 1",
            ));
        }
        if self.concurrency.contains(&0) {
            return Err(Error::setting(
                &["concurrency"],
                "concurrency values must be at least 1",
            ));
        }
        if self.rounds == 0 {
            return Err(Error::setting(&["rounds"], "rounds must be at least 1"));
        }
        Ok(())
    }

    /// Every prefetch with every concurrency, prefetch first.
    pub fn settings(&self) -> Vec<Setting> {
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
