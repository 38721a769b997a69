//! What a running worker has done and where its shards are, for the code that
//! embeds it (the CLI's demo and bench, tests): a cheap handle read while the
//! worker runs.

use std::sync::Arc;

use shardline_contract::ShardId;

use crate::live::ShardState;
use crate::metrics::{Counts, Metrics};

/// A running worker's progress; clone it freely.
#[derive(Debug, Clone)]
pub struct Progress {
    metrics: Arc<Metrics>,
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
            .into_iter()
            .map(|w| (w.shard, w.state()))
            .collect()
    }

    /// Whether every assigned shard is consumed by this worker (on
    /// single-active-consumer queues: registered, as the broker does not say
    /// which consumer is active).
    pub fn all_consuming(&self) -> bool {
        self.metrics
            .watches()
            .into_iter()
            .filter(|w| w.is_assigned())
            .all(|w| w.state().is_consuming())
    }

    /// Whether every assigned shard waits for another consumer to let go.
    pub fn all_standing_by(&self) -> bool {
        self.metrics
            .watches()
            .into_iter()
            .all(|w| w.state() == ShardState::StandingBy)
    }
}
