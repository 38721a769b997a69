//! The relay's Prometheus metrics, in their own registry (the caller serves
//! it, e.g. on `/metrics`).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Metric names, as registered. Counters get `_total` appended on exposition.
pub mod names {
    /// Counter: rows published, confirmed by the broker and deleted.
    pub const RELAYED: &str = "shardline_outbox_relayed";
    /// Counter: batches published (each confirmed, then deleted).
    pub const BATCHES: &str = "shardline_outbox_batches";
    /// Counter `{cause}`: stops, each followed by a retry with backoff:
    /// `database`, `broker`, `lock`, `row` (a row that cannot be published).
    pub const ERRORS: &str = "shardline_outbox_errors";
    /// Gauge: seconds since the oldest unpublished row was written.
    pub const LAG: &str = "shardline_outbox_lag_seconds";
    /// Gauge: 1 while this relay holds the outbox's lock and publishes.
    pub const ACTIVE: &str = "shardline_outbox_active";
}

/// What a stop is counted as in `shardline_outbox_errors_total{cause}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// The database: unreachable, a statement failed, the outbox missing.
    Database,
    /// The broker: unreachable, a nack, a return, a missing exchange.
    Broker,
    /// The lock was lost.
    Lock,
    /// A row that cannot be published (its event over the publisher's limit).
    Row,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Database => "database",
            Self::Broker => "broker",
            Self::Lock => "lock",
            Self::Row => "row",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabel {
    cause: &'static str,
}

/// The relay's metrics.
pub struct Metrics {
    registry: Registry,
    relayed: Counter,
    batches: Counter,
    errors: Family<CauseLabel, Counter>,
    lag: Gauge<f64, AtomicU64>,
    active: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let relayed = Counter::default();
        let batches = Counter::default();
        let errors = Family::<CauseLabel, Counter>::default();
        let lag = Gauge::<f64, AtomicU64>::default();
        let active = Gauge::default();
        registry.register(
            names::RELAYED,
            "Outbox rows published, confirmed by the broker and deleted",
            relayed.clone(),
        );
        registry.register(
            names::BATCHES,
            "Outbox batches published, confirmed and deleted",
            batches.clone(),
        );
        registry.register(
            names::ERRORS,
            "Relay stops by cause (database, broker, lock, row), each followed by a retry",
            errors.clone(),
        );
        registry.register(
            names::LAG,
            "Seconds since the oldest unpublished outbox row was written (its written_at: \
             the time of the append, not of the commit; 0 when the outbox is empty)",
            lag.clone(),
        );
        registry.register(
            names::ACTIVE,
            "1 while this relay holds the outbox lock and publishes, 0 on standby",
            active.clone(),
        );
        Self {
            registry,
            relayed,
            batches,
            errors,
            lag,
            active,
        }
    }

    pub(crate) fn relayed(&self, rows: u64) {
        self.relayed.inc_by(rows);
        self.batches.inc();
    }

    pub(crate) fn error(&self, cause: Cause) {
        self.errors
            .get_or_create(&CauseLabel {
                cause: cause.as_str(),
            })
            .inc();
    }

    pub(crate) fn lag(&self, seconds: f64) {
        self.lag.set(seconds);
    }

    pub(crate) fn active(&self, active: bool) {
        self.active.set(i64::from(active));
    }

    /// Rows relayed so far.
    pub fn relayed_total(&self) -> u64 {
        self.relayed.get()
    }

    /// The registry in the OpenMetrics text format.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_are_exposed_under_their_names() {
        let metrics = Metrics::new();
        metrics.relayed(3);
        metrics.error(Cause::Broker);
        metrics.lag(1.5);
        metrics.active(true);
        let text = metrics.encode().expect("encodes");
        for line in [
            "shardline_outbox_relayed_total 3",
            "shardline_outbox_batches_total 1",
            "shardline_outbox_errors_total{cause=\"broker\"} 1",
            "shardline_outbox_lag_seconds 1.5",
            "shardline_outbox_active 1",
        ] {
            assert!(text.contains(line), "{line} missing from {text}");
        }
        assert_eq!(metrics.relayed_total(), 3);
    }
}
