//! The chaos soak's logic, without I/O beyond writing its report.
//!
//! The soak runs three workers (`--assign auto`) against a three-node RabbitMQ
//! cluster of quorum queues, Redis behind three Sentinels and a downstream that
//! records every call, under a steady publisher, while an orchestrator
//! (`scripts/soak`) injects faults from a seeded schedule: worker and node kills, a
//! partition, a Redis failover, downstream outages, a memory alarm, poison events.
//! This crate, in flow order, draws the schedule, holds what the orchestrator
//! recorded, checks it against the invariants and the bounds of
//! `docs/failures.md`, and writes the report.
//!
//! - `schedule`: [`Schedule::from_seed`], the faults and when they hold.
//! - `history`: [`History`], the recorded events, calls, letters, faults and samples.
//! - `backlog`: [`Backlog`], the confirmed events the recorder sees waiting.
//! - `check`: [`check`], the [`Verdict`] of a history.
//! - `report`: [`recovery`], [`Summary`] and [`write_report`], `report.md` and its chart.

mod backlog;
mod check;
mod history;
mod report;
mod schedule;

pub use backlog::Backlog;
pub use check::{AllowedLetter, Repeats, Verdict, Violation, check};
pub use history::{
    Call, FaultRecord, FinalConsumers, Fleet, History, Letter, PoisonKind, Published, Sample,
    WorkerFlags,
};
pub use report::{Recovery, ReportError, Summary, recovery, write as write_report};
pub use schedule::{DRAIN, Fault, FaultKind, MANDATORY_FROM, SHARDS, Schedule, WARM_UP, clock};
