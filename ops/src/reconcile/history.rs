//! The runs of reconcile at an interval, kept in Redis for the console: a
//! summary per run, ok or failed, newest first in one capped list
//! ([`shardline_contract::Keys::reconcile_runs`]). A single run (no
//! interval) leaves none: its caller has its report.

use std::time::{Duration, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use shardline_contract::status::unix_ms;

use super::ReconcileReport;
use crate::{Error, Fleet, capped};

/// Summaries the list keeps: a run beyond them drops the oldest.
pub const RUNS_CAP: usize = 100;

/// Characters of an unreadable summary's text kept in its `error`.
const EXCERPT_CHARS: usize = 200;

/// One run's counts, or why it failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// When the run ended, Unix ms.
    pub at_ms: u64,
    /// How long it took, ms.
    pub took_ms: u64,
    pub dry_run: bool,
    /// Rows the orders query returned.
    pub scanned: u64,
    /// Rows updated within the grace, skipped.
    pub fresh: u64,
    /// Missing events not on their way.
    pub drifted: u64,
    /// Compensations published and confirmed.
    pub emitted: u64,
    /// Missing events that may still arrive.
    pub pending: u64,
    /// The run failed: why (the counts are 0).
    pub error: Option<String>,
}

impl RunSummary {
    /// The summary of a run that reported `report` after `took`.
    pub fn of(report: &ReconcileReport, took: Duration) -> Self {
        let at_ms = report.at.duration_since(UNIX_EPOCH).map_or(0, millis);
        Self {
            at_ms,
            took_ms: millis(took),
            dry_run: report.dry_run,
            scanned: report.scanned,
            fresh: report.skipped_fresh,
            drifted: report.drift.len() as u64,
            emitted: report.emitted(),
            pending: report.pending.len() as u64,
            error: None,
        }
    }

    /// The summary of a run that failed with `error` after `took`, now.
    pub fn failed(error: String, took: Duration) -> Self {
        Self {
            at_ms: unix_ms(),
            took_ms: millis(took),
            dry_run: false,
            scanned: 0,
            fresh: 0,
            drifted: 0,
            emitted: 0,
            pending: 0,
            error: Some(error),
        }
    }

    /// The summary stored as `text`; a failed one at time 0 saying so when
    /// it does not parse, so that one bad summary never hides the others.
    fn parse(text: &str) -> Self {
        serde_json::from_str(text).unwrap_or_else(|e| Self {
            at_ms: 0,
            ..Self::failed(
                format!(
                    "unreadable run summary ({e}): {}",
                    capped::excerpt(text, EXCERPT_CHARS)
                ),
                Duration::ZERO,
            )
        })
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Appends `run` to the fleet's run summaries (the oldest beyond
/// [`RUNS_CAP`] go).
pub async fn record_run(fleet: &Fleet, run: &RunSummary) -> Result<(), Error> {
    let text = serde_json::to_string(run).map_err(|e| Error::Encode {
        what: "a reconcile run summary",
        cause: e.to_string(),
    })?;
    capped::push(
        fleet,
        &fleet.keys.reconcile_runs(),
        &text,
        RUNS_CAP,
        "writing reconcile's run summaries",
    )
    .await
}

/// The `limit` newest run summaries (at most [`RUNS_CAP`]), newest first.
pub async fn runs(fleet: &Fleet, limit: usize) -> Result<Vec<RunSummary>, Error> {
    let texts = capped::newest(
        fleet,
        &fleet.keys.reconcile_runs(),
        limit,
        RUNS_CAP,
        "reading reconcile's run summaries",
    )
    .await?;
    Ok(texts.iter().map(|t| RunSummary::parse(t)).collect())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use shardline_contract::ShardCount;
    use shardline_contract::envelope::order_key_of;

    use super::*;
    use crate::reconcile::{Compensation, Drift, Expected, OnItsWay, Pending};

    fn expected(order_id: &str) -> Expected {
        Expected {
            order_id: order_id.into(),
            order_key: order_key_of(order_id),
            status: "PAID".into(),
            kind: "payment.captured".into(),
            shard: ShardCount::default().shard_of(order_id),
        }
    }

    #[test]
    fn a_summary_counts_the_report_and_reads_back_as_written() {
        let drift = |order: &str, compensation| Drift {
            expected: expected(order),
            compensation,
        };
        let report = ReconcileReport {
            at: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            scanned: 7,
            skipped_fresh: 2,
            pending: vec![Pending {
                expected: expected("p"),
                why: OnItsWay::Held,
            }],
            drift: vec![
                drift("a", Compensation::Emitted),
                drift("b", Compensation::WouldEmit),
            ],
            ..ReconcileReport::default()
        };
        let summary = RunSummary::of(&report, Duration::from_millis(1500));
        assert_eq!(
            summary,
            RunSummary {
                at_ms: 1_700_000_000_123,
                took_ms: 1500,
                dry_run: false,
                scanned: 7,
                fresh: 2,
                drifted: 2,
                emitted: 1,
                pending: 1,
                error: None,
            }
        );
        let text = serde_json::to_string(&summary).unwrap();
        assert_eq!(RunSummary::parse(&text), summary);

        let failed = RunSummary::failed("orders database down".into(), Duration::from_secs(2));
        let now = unix_ms();
        assert!(
            failed.at_ms <= now && failed.at_ms + 60_000 > now,
            "{failed:?}"
        );
        assert_eq!(failed.error.as_deref(), Some("orders database down"));
        assert_eq!((failed.took_ms, failed.scanned), (2000, 0));
    }

    #[test]
    fn an_unreadable_summary_is_a_failed_run_at_time_zero() {
        let read = RunSummary::parse("{\"at_ms\": \"soon\"}");
        assert_eq!(read.at_ms, 0);
        let error = read.error.unwrap();
        assert!(
            error.starts_with("unreadable run summary (")
                && error.ends_with("{\"at_ms\": \"soon\"}"),
            "{error}"
        );
    }
}
