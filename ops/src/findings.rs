//! What a reconcile run found: the events order statuses imply, those on
//! their way (pending) and those not (drift, with what became of each
//! compensation), and the report of the run. Its own module, below
//! `progress`, because a run's report travels in an [`Event`](crate::Event);
//! `reconcile` finds and compensates, and re-exports these types.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use shardline_contract::ShardId;

/// An event an order's status implies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub order_id: String,
    /// The order id as it is written in Redis keys.
    pub order_key: String,
    pub status: String,
    /// The event kind.
    pub kind: String,
    pub shard: ShardId,
}

impl Expected {
    /// The compensation's `event_id`, which the worker dedups it by.
    pub fn event_id(&self) -> String {
        format!("reconcile:{}:{}", self.order_id, self.kind)
    }

    /// `order=… event=… status=… shard=…`.
    pub fn describe(&self) -> String {
        format!(
            "order={} event={} status={} shard={}",
            self.order_id,
            self.kind,
            self.status,
            self.shard.get()
        )
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "order_id": self.order_id,
            "status": self.status,
            "event": self.kind,
            "shard": self.shard.get(),
        })
    }
}

/// Why a missing event may still arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnItsWay {
    /// Reconcile emitted its compensation before; not processed yet.
    Compensated,
    /// The sequence gate holds it (or released it and it has not run yet).
    Held,
    /// In the DLQ, waiting for a replay.
    DeadLettered { id: String },
    /// The order's shard is behind by more than the grace.
    Backlog { age: Duration },
    /// The order's shard has messages and no worker reports it.
    Unconsumed { messages: u32 },
    /// A `dlq replay` of the order runs (or ended within its lock's tail):
    /// the event may be between the DLQ and the worker.
    Replaying,
    /// The DLQ holds more letters than its index: it could be one of those.
    IndexBehind { depth: u64, indexed: u64 },
    /// The order has rows in the transactional outbox that the relay has
    /// not published yet, read in the orders' snapshot: `rows` in all,
    /// `of_kind` of the event's kind, the oldest written `oldest` ago. The
    /// relay publishes an order's rows in seq order; until it is done with
    /// the order, the event is among them, or just ahead of them.
    Outbox {
        rows: u64,
        of_kind: u64,
        oldest: Duration,
    },
    /// The transactional outbox's oldest unpublished row was written `lag`
    /// ago, more than the grace: what the relay publishes now waits in
    /// backlogs younger than its orders, so it could be any missing event.
    RelayBehind { lag: Duration },
}

impl OnItsWay {
    /// A short name (JSON `reason`).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Compensated => "compensation_emitted",
            Self::Held => "held",
            Self::DeadLettered { .. } => "dead_lettered",
            Self::Backlog { .. } => "backlog",
            Self::Unconsumed { .. } => "unconsumed",
            Self::Replaying => "replaying",
            Self::IndexBehind { .. } => "index_behind",
            Self::Outbox { .. } => "outbox",
            Self::RelayBehind { .. } => "relay_behind",
        }
    }

    /// For people.
    pub fn detail(&self) -> String {
        match self {
            Self::Compensated => "compensation already emitted, not processed yet".into(),
            Self::Held => "held by the sequence gate".into(),
            Self::DeadLettered { id } => format!("in the DLQ (dead letter {id})"),
            Self::Backlog { age } => format!("the shard's backlog is {} old", seconds(*age)),
            Self::Unconsumed { messages } => {
                format!("the shard has {messages} message(s) and no worker reporting it")
            }
            Self::Replaying => "a replay of the order runs or just ended".into(),
            Self::IndexBehind { depth, indexed } => format!(
                "the DLQ holds {depth} letters and its index {indexed}: reindex needed (`shardline dlq reindex`)"
            ),
            Self::Outbox {
                rows,
                of_kind,
                oldest,
            } => format!(
                "unpublished in the outbox ({rows} row{} of the order, {of_kind} of this kind, oldest written {} ago)",
                if *rows == 1 { "" } else { "s" },
                seconds(*oldest)
            ),
            Self::RelayBehind { lag } => format!(
                "the outbox relay is behind: its oldest unpublished row was written {} ago, more than the grace",
                seconds(*lag)
            ),
        }
    }
}

/// `d` in whole seconds, for people (`2m 5s`).
fn seconds(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_secs(d.as_secs()))
}

/// A missing event that may still arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub expected: Expected,
    pub why: OnItsWay,
}

/// What became of a drifted event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compensation {
    Emitted,
    /// A dry run.
    WouldEmit,
    NotEmitted(NotEmitted),
}

/// Why a compensation was not emitted.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NotEmitted {
    /// No valid compensation envelope can be built (e.g. an oversize id).
    Invalid(String),
    /// The run found more drift than `max_emit`.
    OverLimit { drifted: usize, max_emit: usize },
    /// The run was cancelled first.
    Cancelled,
}

impl NotEmitted {
    /// For people; `term` names the config field (or `cancelled`) as the
    /// reader knows it.
    pub fn text(&self, term: &dyn Fn(&str) -> String) -> String {
        match self {
            Self::Invalid(why) => why.clone(),
            Self::OverLimit { drifted, max_emit } => {
                format!("{drifted} drifted, over {} {max_emit}", term("max_emit"))
            }
            Self::Cancelled => term("cancelled"),
        }
    }
}

/// A missing event not on its way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drift {
    pub expected: Expected,
    pub compensation: Compensation,
}

/// What one run found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconcileReport {
    /// When the run ended.
    pub at: SystemTime,
    pub dry_run: bool,
    pub window: Duration,
    pub grace: Duration,
    /// Rows the query returned.
    pub scanned: u64,
    /// Rows updated before the window (a query that ignores `$1`): ignored.
    pub outside_window: u64,
    /// Rows without `order_id` or `updated_at`: ignored.
    pub invalid: u64,
    pub skipped_fresh: u64,
    pub no_expectation: u64,
    /// Expected events the fleet had processed.
    pub processed: u64,
    pub pending: Vec<Pending>,
    pub drift: Vec<Drift>,
}

impl Default for ReconcileReport {
    fn default() -> Self {
        Self {
            at: UNIX_EPOCH,
            dry_run: false,
            window: Duration::ZERO,
            grace: Duration::ZERO,
            scanned: 0,
            outside_window: 0,
            invalid: 0,
            skipped_fresh: 0,
            no_expectation: 0,
            processed: 0,
            pending: Vec::new(),
            drift: Vec::new(),
        }
    }
}

impl ReconcileReport {
    /// Compensations published and confirmed.
    pub fn emitted(&self) -> u64 {
        self.drift
            .iter()
            .filter(|d| d.compensation == Compensation::Emitted)
            .count() as u64
    }

    /// Drift that was not compensated (a dry run, or emission refused).
    pub fn needs_attention(&self) -> bool {
        self.drift
            .iter()
            .any(|d| d.compensation != Compensation::Emitted)
    }

    /// The counts on one line.
    pub fn summary(&self) -> String {
        let mut out = format!(
            "scanned {}, skipped fresh {}, no expectation {}, processed {}, pending {}, drifted {}, emitted {}",
            self.scanned,
            self.skipped_fresh,
            self.no_expectation,
            self.processed,
            self.pending.len(),
            self.drift.len(),
            self.emitted(),
        );
        if self.outside_window > 0 {
            let _ = write!(out, ", outside window {}", self.outside_window);
        }
        if self.invalid > 0 {
            let _ = write!(out, ", invalid rows {}", self.invalid);
        }
        out
    }

    /// A line per drifted and pending event, then the summary; `term`
    /// names config fields (and `cancelled`) as the reader knows them.
    pub fn text(&self, term: &dyn Fn(&str) -> String) -> String {
        let mut out = String::new();
        for d in &self.drift {
            let e = &d.expected;
            let _ = match &d.compensation {
                Compensation::Emitted => {
                    writeln!(
                        out,
                        "emitted      {} event_id={}",
                        e.describe(),
                        e.event_id()
                    )
                }
                Compensation::WouldEmit => {
                    writeln!(
                        out,
                        "would emit   {} event_id={}",
                        e.describe(),
                        e.event_id()
                    )
                }
                Compensation::NotEmitted(why) => {
                    writeln!(out, "not emitted  {}: {}", e.describe(), why.text(term))
                }
            };
        }
        for p in &self.pending {
            let _ = writeln!(
                out,
                "pending      {}: {}",
                p.expected.describe(),
                p.why.detail()
            );
        }
        let (name, nothing) = if self.dry_run {
            ("reconcile (dry run)", "; nothing emitted")
        } else {
            ("reconcile", "")
        };
        let _ = writeln!(out, "{name}: {}{nothing}", self.summary());
        out
    }

    /// The run as one JSON object; `term` as for [`Self::text`].
    pub fn json(&self, term: &dyn Fn(&str) -> String) -> serde_json::Value {
        serde_json::json!({
            "at": humantime::format_rfc3339_seconds(self.at).to_string(),
            "dry_run": self.dry_run,
            "window_seconds": self.window.as_secs(),
            "grace_seconds": self.grace.as_secs(),
            "counts": {
                "scanned": self.scanned,
                "outside_window": self.outside_window,
                "invalid": self.invalid,
                "skipped_fresh": self.skipped_fresh,
                "no_expectation": self.no_expectation,
                "processed": self.processed,
                "pending": self.pending.len(),
                "drifted": self.drift.len(),
                "emitted": self.emitted(),
            },
            "drift": self.drift.iter().map(|d| {
                let mut v = d.expected.json();
                v["event_id"] = d.expected.event_id().into();
                let (outcome, error) = match &d.compensation {
                    Compensation::Emitted => ("emitted", None),
                    Compensation::WouldEmit => ("would_emit", None),
                    Compensation::NotEmitted(e) => ("not_emitted", Some(e.text(term))),
                };
                v["compensation"] = outcome.into();
                v["error"] = error.into();
                v
            }).collect::<Vec<_>>(),
            "pending": self.pending.iter().map(|p| {
                let mut v = p.expected.json();
                v["reason"] = p.why.reason().into();
                v["detail"] = p.why.detail().into();
                v
            }).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use shardline_contract::ShardCount;
    use shardline_contract::envelope::order_key_of;

    pub(crate) fn expected(order_id: &str, kind: &str) -> Expected {
        Expected {
            order_id: order_id.into(),
            order_key: order_key_of(order_id),
            status: "PAID".into(),
            kind: kind.into(),
            shard: ShardCount::default().shard_of(order_id),
        }
    }

    /// Config fields as the command line names them.
    pub(crate) fn flag(field: &str) -> String {
        match field {
            "cancelled" => "stopped by a signal".into(),
            f => format!("--{}", f.replace('_', "-")),
        }
    }

    #[test]
    fn report_counts_and_attention() {
        let mut report = ReconcileReport {
            scanned: 4,
            skipped_fresh: 1,
            no_expectation: 1,
            processed: 1,
            drift: vec![Drift {
                expected: expected("A1", "payment.captured"),
                compensation: Compensation::Emitted,
            }],
            ..ReconcileReport::default()
        };
        assert_eq!(report.emitted(), 1);
        assert!(!report.needs_attention());
        let text = report.text(&flag);
        assert!(
            text.ends_with(
                "reconcile: scanned 4, skipped fresh 1, no expectation 1, processed 1, pending 0, drifted 1, emitted 1\n"
            ),
            "{text}"
        );
        report.dry_run = true;
        report.drift[0].compensation = Compensation::WouldEmit;
        assert_eq!(report.emitted(), 0);
        assert!(report.needs_attention(), "drift left alone needs attention");
        assert!(
            report
                .text(&flag)
                .contains("would emit   order=A1 event=payment.captured")
        );
        report.pending.push(Pending {
            expected: expected("A2", "payment.captured"),
            why: OnItsWay::DeadLettered { id: "dl-1".into() },
        });
        let text = report.text(&flag);
        assert!(text.contains("pending      order=A2 event=payment.captured status=PAID"));
        assert!(text.contains("in the DLQ (dead letter dl-1)"));
        assert!(text.ends_with("; nothing emitted\n"), "{text}");

        report.drift[0].compensation = Compensation::NotEmitted(NotEmitted::OverLimit {
            drifted: 3,
            max_emit: 2,
        });
        assert!(
            report
                .text(&flag)
                .contains(": 3 drifted, over --max-emit 2\n")
        );
        let json = report.json(&flag);
        assert_eq!(json["drift"][0]["compensation"], "not_emitted");
        assert_eq!(json["drift"][0]["error"], "3 drifted, over --max-emit 2");
        assert_eq!(json["pending"][0]["reason"], "dead_lettered");
        assert_eq!(json["counts"]["pending"], 1);
        report.pending.push(Pending {
            expected: expected("A3", "payment.captured"),
            why: OnItsWay::Outbox {
                rows: 1,
                of_kind: 1,
                oldest: Duration::from_millis(12_700),
            },
        });
        let text = report.text(&flag);
        assert!(
            text.contains(
                "pending      order=A3 event=payment.captured status=PAID shard="
            ) && text.contains(
                ": unpublished in the outbox (1 row of the order, 1 of this kind, oldest written 12s ago)\n"
            ),
            "{text}"
        );
        let json = report.json(&flag);
        assert_eq!(json["pending"][1]["reason"], "outbox");
        assert_eq!(json["counts"]["pending"], 2);
        assert_eq!(
            NotEmitted::Cancelled.text(&flag),
            "stopped by a signal",
            "the caller words cancellation"
        );
    }

    #[test]
    fn outbox_reasons_say_how_much_waits() {
        let other_kinds = OnItsWay::Outbox {
            rows: 3,
            of_kind: 0,
            oldest: Duration::from_secs(125),
        };
        assert_eq!(other_kinds.reason(), "outbox");
        assert_eq!(
            other_kinds.detail(),
            "unpublished in the outbox (3 rows of the order, 0 of this kind, oldest written 2m 5s ago)"
        );
        let behind = OnItsWay::RelayBehind {
            lag: Duration::from_secs(600),
        };
        assert_eq!(behind.reason(), "relay_behind");
        assert_eq!(
            behind.detail(),
            "the outbox relay is behind: its oldest unpublished row was written 10m ago, more than the grace"
        );
    }
}
