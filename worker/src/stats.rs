//! Counters of what the worker did, shared by every shard task.

use std::sync::atomic::{AtomicU64, Ordering};

use shardline_topology::headers::FailReason;

/// Monotonic counters; cheap to bump from any shard.
#[derive(Debug, Default)]
pub struct Stats {
    /// Events the handler processed and that were acked.
    pub processed: AtomicU64,
    /// Events acked as duplicates without calling the handler.
    pub duplicates: AtomicU64,
    /// Handler attempts, the first ones included.
    pub handler_attempts: AtomicU64,
    /// Failed attempts that were retried in place.
    pub retries: AtomicU64,
    /// Claims taken over from a consumer that died mid-handler.
    pub takeovers: AtomicU64,
    /// Times a shard paused because Redis was unreachable.
    pub redis_outages: AtomicU64,
    /// Broker connections opened after the first.
    pub broker_reconnects: AtomicU64,
    /// Events the sequence gate holds now (a gauge).
    pub held: AtomicU64,
    /// Sequence gaps given up on (timed out or accepted as a start).
    pub gaps: AtomicU64,
    dead_lettered: [AtomicU64; FailReason::ALL.len()],
}

impl Stats {
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn dead_lettered(&self, reason: FailReason) {
        Self::bump(&self.dead_lettered[Self::index(reason)]);
    }

    /// Dead letters published for `reason`.
    pub fn dead_lettered_count(&self, reason: FailReason) -> u64 {
        self.dead_lettered[Self::index(reason)].load(Ordering::Relaxed)
    }

    /// Dead letters published, all reasons.
    pub fn dead_lettered_total(&self) -> u64 {
        FailReason::ALL
            .into_iter()
            .map(|r| self.dead_lettered_count(r))
            .sum()
    }

    /// Events settled one way or another: processed, duplicate or dead-lettered.
    pub fn settled(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
            + self.duplicates.load(Ordering::Relaxed)
            + self.dead_lettered_total()
    }

    fn index(reason: FailReason) -> usize {
        FailReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_reason_and_in_total() {
        let stats = Stats::default();
        stats.dead_lettered(FailReason::Decode);
        stats.dead_lettered(FailReason::Handler);
        stats.dead_lettered(FailReason::Handler);
        Stats::bump(&stats.processed);
        assert_eq!(stats.dead_lettered_count(FailReason::Handler), 2);
        assert_eq!(stats.dead_lettered_total(), 3);
        assert_eq!(stats.settled(), 4);
    }
}
