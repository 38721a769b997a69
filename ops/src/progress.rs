//! What long operations report as they go (a replay per letter and per
//! quarantine round, reconcile per run), through a callback the caller
//! passes: the CLI prints each event, the console forwards them to a page.
//! New variants will come (the broker blocking a publisher under an alarm,
//! and unblocking it), so matches need a catch-all arm.

use std::fmt;
use std::time::Duration;

use crate::findings::ReconcileReport;
use serde::Serialize;

use crate::letter::LetterRef;

/// One step of a long operation.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Event {
    /// A replay leaves a letter in the DLQ: its body is not an envelope.
    ReplaySkipped { letter: LetterRef },
    /// A replay could not read which orders are quarantined (`cause`;
    /// `connected`: Redis answered but the read failed), and goes on without
    /// following them.
    QuarantinesUnknown { cause: String, connected: bool },
    /// A replay starts republishing `letters` letters (the first pass, or a
    /// quarantine round).
    Replaying { letters: usize },
    /// A letter was republished to `shard`, confirmed, and left the DLQ.
    Replayed { letter: LetterRef, shard: u16 },
    /// The first pass of a replay ended (also when it failed part-way).
    ReplayPass {
        replayed: usize,
        matching: usize,
        skipped: usize,
        read: usize,
    },
    /// The DLQ held letters the dead-letter index did not; a replay rebuilt
    /// the index first (`dlq reindex`).
    Reindexed { indexed: u64, derived: u64 },
    /// The DLQ holds `missing` letters the index does not, and a replay
    /// could not rebuild it (`cause`): those letters stay in the DLQ.
    IndexShort { missing: u64, cause: String },
    /// A replay stopped before its plan was done.
    ReplayBlocked(Box<Blocked>),
    /// A replayed order's quarantine is lifted.
    QuarantineLifted { order_id: String },
    /// No worker applied an order's replayed events within `wait`.
    NotApplied { order_id: String, wait: Duration },
    /// Events of the order were quarantined while the replay ran; they are
    /// replayed next.
    Requarantined { order_id: String, letters: usize },
    /// The order stays quarantined behind dead letter `head` (its letter,
    /// when found in the DLQ): the cause needs fixing first.
    StillQuarantined {
        order_id: String,
        head: String,
        blocker: Option<LetterRef>,
    },
    /// The replay stopped following quarantines after `rounds` rounds.
    RoundsExhausted { rounds: usize, orders: Vec<String> },
    /// A reconcile run ended.
    Reconciled(Box<ReconcileReport>),
    /// A reconcile run failed; the next one is tried after the interval.
    ReconcileFailed { error: String },
}

/// One line for an operator: what the CLI prints and the console's job shows.
impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Replaying { letters } => write!(f, "replaying {letters} dead letter(s)"),
            Self::Replayed { letter, shard } => write!(f, "replayed {letter} to shard {shard}"),
            Self::ReplaySkipped { letter } => write!(
                f,
                "skipped {letter}: body is not an order event envelope, nothing to route (left in the DLQ; `dlq show` it, then `dlq purge` or republish a fixed copy)"
            ),
            Self::QuarantinesUnknown { cause, connected } => write!(
                f,
                "cannot read quarantines ({cause}); replaying without following them{}",
                if *connected {
                    ""
                } else {
                    " (check a quarantined order with `dlq list --order-id` afterwards)"
                }
            ),
            Self::ReplayPass {
                replayed,
                matching,
                skipped,
                read,
            } => write!(
                f,
                "replayed {replayed} of {matching} matching, {skipped} skipped (not envelopes), {read} read; {} left in the DLQ unreplayed",
                read.saturating_sub(*replayed)
            ),
            Self::Reindexed { indexed, derived } => write!(
                f,
                "the DLQ held letters the dead-letter index did not: index rebuilt first ({indexed} letters, {derived} dead-lettered by the broker)"
            ),
            Self::IndexShort { missing, cause } => write!(
                f,
                "{missing} letter(s) in the DLQ are not in the dead-letter index and are not replayed this time ({cause}); run `dlq reindex`, then replay again"
            ),
            Self::ReplayBlocked(blocked) => blocked.fmt(f),
            Self::QuarantineLifted { order_id } => {
                write!(f, "order {order_id}: quarantine lifted")
            }
            Self::NotApplied { order_id, wait } => write!(
                f,
                "order {order_id}: the replayed events were not applied within {} (is a worker with --on-dead-letter quarantine running?); run `dlq replay --order-id {order_id}` again later",
                humantime::format_duration(*wait)
            ),
            Self::Requarantined { order_id, letters } => write!(
                f,
                "order {order_id}: {letters} event(s) quarantined during the replay; replaying them"
            ),
            Self::StillQuarantined {
                order_id,
                head,
                blocker,
            } => write!(
                f,
                "order {order_id}: still quarantined behind dead letter {head}{}; fix the cause and replay the order again",
                blocker
                    .as_ref()
                    .map_or_else(String::new, |l| format!(" ({l})"))
            ),
            Self::RoundsExhausted { rounds, orders } => write!(
                f,
                "stopped after {rounds} rounds; the orders still quarantined: {}",
                orders.join(", ")
            ),
            Self::Reconciled(report) => write!(f, "reconcile run: {}", report.summary()),
            Self::ReconcileFailed { error } => write!(f, "reconcile run failed: {error}"),
        }
    }
}

/// Why a replay stopped before its plan was done: `letter` (when one was
/// read) waits for `waits_for`, which no pass reached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Blocked {
    pub letter: Option<LetterRef>,
    pub waits_for: LetterRef,
    /// `waits_for` is not within this many letters of the DLQ's head;
    /// `None`: the whole DLQ was read and it is not there.
    pub reach: Option<usize>,
    /// Planned letters left in the DLQ.
    pub left: usize,
}

/// One line: what waits, for which letter, and what to do.
impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            letter,
            waits_for,
            reach,
            left,
        } = self;
        match letter {
            Some(l) => write!(f, "stopped: {l} waits for {waits_for}, ")?,
            None => write!(f, "stopped: the next letter to replay is {waits_for}, ")?,
        }
        match reach {
            Some(reach) => write!(
                f,
                "which is not within the first {reach} letters of the DLQ (--reach; the letters ahead of it are held unacked while a replay reads past them)"
            )?,
            None => write!(
                f,
                "which is not in the DLQ (removed since the index was read: run `dlq reindex`)"
            )?,
        }
        write!(f, "; {left} planned letter(s) left in the DLQ")
    }
}
