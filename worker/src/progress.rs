//! What a running worker has done and where its shards are, for the code that
//! embeds it (the CLI's demo and bench, tests): a cheap handle read while the
//! worker runs.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use shardline_topology::ShardId;
use shardline_topology::headers::FailReason;

use crate::metrics::{Metrics, ShardState};
use crate::stats::Stats;

/// A running worker's progress; clone it freely.
#[derive(Debug, Clone)]
pub struct Progress {
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
}

/// Totals since the worker started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counts {
    /// Events the handler processed and that were acked.
    pub processed: u64,
    /// Events acked as duplicates without calling the handler.
    pub duplicates: u64,
    /// Handler calls, first attempts and retries.
    pub handler_attempts: u64,
    /// Failed attempts retried in place.
    pub retries: u64,
    /// Claims taken over from a consumer that died mid-handler.
    pub takeovers: u64,
    /// Times Redis became unreachable (shards paused).
    pub redis_outages: u64,
    /// Broker connections opened after the first.
    pub broker_reconnects: u64,
    /// Events the sequence gate holds now.
    pub held: u64,
    /// Sequence gaps given up on (timed out or accepted as a start).
    pub gaps: u64,
    dead_letters: [u64; FailReason::ALL.len()],
}

impl Counts {
    /// Dead letters published (and confirmed) for `reason`.
    pub fn dead_lettered(&self, reason: FailReason) -> u64 {
        FailReason::ALL
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.dead_letters[i])
    }

    /// Dead letters published, all reasons.
    pub fn dead_lettered_total(&self) -> u64 {
        self.dead_letters.iter().sum()
    }

    /// Events settled one way or another: processed, duplicate or dead-lettered.
    pub fn settled(&self) -> u64 {
        self.processed + self.duplicates + self.dead_lettered_total()
    }
}

impl Progress {
    pub(crate) fn new(stats: Arc<Stats>, metrics: Arc<Metrics>) -> Self {
        Self { stats, metrics }
    }

    /// The totals now.
    pub fn counts(&self) -> Counts {
        let s = &self.stats;
        let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        Counts {
            processed: load(&s.processed),
            duplicates: load(&s.duplicates),
            handler_attempts: load(&s.handler_attempts),
            retries: load(&s.retries),
            takeovers: load(&s.takeovers),
            redis_outages: load(&s.redis_outages),
            broker_reconnects: load(&s.broker_reconnects),
            held: load(&s.held),
            gaps: load(&s.gaps),
            dead_letters: FailReason::ALL.map(|r| s.dead_lettered_count(r)),
        }
    }

    /// Each assigned shard with where its consumer is.
    pub fn shards(&self) -> Vec<(ShardId, ShardState)> {
        self.metrics
            .watches()
            .map(|w| (w.shard, w.state()))
            .collect()
    }

    /// Whether every assigned shard is consumed by this worker (on
    /// single-active-consumer queues: registered, as the broker does not say
    /// which consumer is active).
    pub fn all_consuming(&self) -> bool {
        self.metrics
            .watches()
            .all(|w| matches!(w.state(), ShardState::Consuming | ShardState::Registered))
    }

    /// Whether every assigned shard waits for another consumer to let go.
    pub fn all_standing_by(&self) -> bool {
        self.metrics
            .watches()
            .all(|w| w.state() == ShardState::StandingBy)
    }
}
