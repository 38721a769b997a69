//! shardline's operator tools as a library: what `shardline topology status`,
//! `dlq …`, `reconcile` and the demo's cleanup do, for the command line, the
//! web console and Rust users alike.
//!
//! Each operation takes a plain config ([`Fleet`] says where the fleet is, a
//! per-operation config what to do), returns a typed report or an [`Error`],
//! and never prints: long operations report [`Event`]s through a callback and
//! stop at a [`CancellationToken`](tokio_util::sync::CancellationToken).
//! Modules, in the order an operator meets them:
//!
//! - [`fleet`]: where the broker, Redis, the names and the shard count are.
//! - [`topology`]: `apply`'s description and the fleet status (depth,
//!   owner, backlog age and level per shard; the DLQ; the workers), with a
//!   cheap form that does not browse the DLQ.
//! - [`dlq`]: the dead-letter queue: reading without removing, list and show,
//!   replay (key-ordered, confirmed, with quarantine rounds), purge, release;
//!   the dead-letter index's failure groups and entries.
//! - [`reshard`]: what a reshard of the recorded topology to M shards would
//!   move (`topology reshard --plan`).
//! - [`reconcile`]: compensation events for what the order database says
//!   happened and the fleet never processed; its Prometheus metrics; the
//!   summaries of its runs at an interval, kept in Redis.
//! - [`audit`]: the operator actions the console performed, who and what,
//!   kept in Redis.
//! - [`scratch`]: throwaway names for demos and benchmarks, and removing
//!   their topology and Redis keys.
//! - [`progress`]: the events long operations report as they go.
//! - [`error`]: what went wrong, naming config fields, never flags.
//!
//! What progress events carry sits below [`progress`] in private modules,
//! so that `dlq` and `reconcile`, which emit the events, stay above it:
//! `letter` ([`LetterRef`], re-exported from [`dlq`]) and `findings`
//! ([`ReconcileReport`] and its parts, re-exported from [`reconcile`]).

pub mod audit;
mod capped;
pub mod dlq;
pub mod error;
mod findings;
pub mod fleet;
mod letter;
pub mod progress;
pub mod reconcile;
pub mod reshard;
pub mod scratch;
pub mod topology;

pub use audit::AuditEntry;
pub use dlq::{
    Filters, GroupCount, GroupSummary, Letter, LetterQuery, LetterRef, ListReport, PurgeReport,
    ReindexReport, ReleaseReport, ReplayConfig, ReplayReport,
};
pub use error::{Error, Usage};
pub use fleet::Fleet;
pub use progress::Event;
pub use reconcile::{ReconcileConfig, ReconcileReport, Reconciler, RunSummary};
pub use topology::{StatusConfig, StatusReport};
