//! What a running worker has done and where its shards are, for the code that
//! embeds it (the CLI's demo and bench, tests): a cheap handle read while the
//! worker runs.

use std::sync::Arc;

use shardline_topology::ShardId;
use shardline_topology::headers::FailReason;

use crate::live::ShardState;
use crate::metrics::Metrics;

/// A running worker's progress; clone it freely.
#[derive(Debug, Clone)]
pub struct Progress {
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
    /// By reason, in the order of [`FailReason::ALL`].
    pub(crate) dead_letters: [u64; FailReason::ALL.len()],
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
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        Self { metrics }
    }

    /// The totals now (the same counters `/metrics` serves).
    pub fn counts(&self) -> Counts {
        self.metrics.counts()
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
        self.metrics.watches().all(|w| w.state().is_consuming())
    }

    /// Whether every assigned shard waits for another consumer to let go.
    pub fn all_standing_by(&self) -> bool {
        self.metrics
            .watches()
            .all(|w| w.state() == ShardState::StandingBy)
    }
}
