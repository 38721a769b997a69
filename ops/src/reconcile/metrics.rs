//! Reconcile's Prometheus metrics: totals over the runs of one process, in
//! their own registry (the caller serves it, e.g. on `/metrics`).

use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::ReconcileReport;

/// Metric names, as registered. Counters get `_total` appended on exposition,
/// so `SCANNED` is scraped as `shardline_reconcile_scanned_total`.
pub mod names {
    /// Counter: rows the orders query returned.
    pub const SCANNED: &str = "shardline_reconcile_scanned";
    /// Counter: orders skipped because they were updated within the grace.
    pub const SKIPPED_FRESH: &str = "shardline_reconcile_skipped_fresh";
    /// Counter: orders whose status implies no event.
    pub const NO_EXPECTATION: &str = "shardline_reconcile_no_expectation";
    /// Counter: expected events the fleet had processed.
    pub const PROCESSED: &str = "shardline_reconcile_processed";
    /// Counter: expected events missing and not on their way (compensated
    /// unless a dry run).
    pub const DRIFTED: &str = "shardline_reconcile_drifted";
    /// Counter: compensation events published and confirmed.
    pub const EMITTED: &str = "shardline_reconcile_emitted";
    /// Counter: expected events missing but possibly on their way (not
    /// compensated), unpublished outbox rows included.
    pub const PENDING: &str = "shardline_reconcile_pending";
    /// Counter `{outcome}`: runs, `ok` or `error`.
    pub const RUNS: &str = "shardline_reconcile_runs";
    /// Gauge: Unix time at which the last successful run ended.
    pub const LAST_RUN: &str = "shardline_reconcile_last_run_timestamp_seconds";
}

/// What `encode` returns, for a `Content-Type` header.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabel {
    outcome: &'static str,
}

/// The reconcile metrics.
pub struct Metrics {
    registry: Registry,
    scanned: Counter,
    skipped_fresh: Counter,
    no_expectation: Counter,
    processed: Counter,
    drifted: Counter,
    emitted: Counter,
    pending: Counter,
    runs: Family<RunLabel, Counter>,
    last_run: Gauge<f64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let mut counter = |name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        Self {
            scanned: counter(names::SCANNED, "Rows the orders query returned"),
            skipped_fresh: counter(
                names::SKIPPED_FRESH,
                "Orders skipped because they were updated within the grace",
            ),
            no_expectation: counter(
                names::NO_EXPECTATION,
                "Orders whose status implies no event",
            ),
            processed: counter(names::PROCESSED, "Expected events the fleet had processed"),
            drifted: counter(
                names::DRIFTED,
                "Expected events never processed and not on their way",
            ),
            emitted: counter(
                names::EMITTED,
                "Compensation events published and confirmed",
            ),
            pending: counter(
                names::PENDING,
                "Expected events missing but possibly on their way (held, dead-lettered, behind a backlog, compensated earlier, unpublished in the outbox)",
            ),
            runs: {
                let runs = Family::<RunLabel, Counter>::default();
                for outcome in ["ok", "error"] {
                    let _ = runs.get_or_create(&RunLabel { outcome });
                }
                registry.register(names::RUNS, "Reconcile runs, by outcome", runs.clone());
                runs
            },
            last_run: {
                let last_run = Gauge::<f64, AtomicU64>::default();
                registry.register(
                    names::LAST_RUN,
                    "Unix time at which the last successful run ended",
                    last_run.clone(),
                );
                last_run
            },
            registry,
        }
    }

    /// Adds a run's counts; `None` for a failed run.
    pub fn record(&self, report: Option<&ReconcileReport>) {
        let Some(r) = report else {
            self.runs
                .get_or_create(&RunLabel { outcome: "error" })
                .inc();
            return;
        };
        self.scanned.inc_by(r.scanned);
        self.skipped_fresh.inc_by(r.skipped_fresh);
        self.no_expectation.inc_by(r.no_expectation);
        self.processed.inc_by(r.processed);
        self.drifted.inc_by(r.drift.len() as u64);
        self.emitted.inc_by(r.emitted());
        self.pending.inc_by(r.pending.len() as u64);
        self.runs.get_or_create(&RunLabel { outcome: "ok" }).inc();
        self.last_run.set(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        );
    }

    /// The OpenMetrics text exposition ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::with_capacity(2048);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}
