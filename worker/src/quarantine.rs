//! Per-order quarantine ([`crate::OnDeadLetter::Quarantine`], docs/semantics.md §3): once an event
//! of an order is dead-lettered, the order's later events follow it into the
//! DLQ (reason `quarantined`) instead of being applied past the hole, until
//! the order's dead letters are replayed or the order is released.
//!
//! The state is one sorted set per order ([`Keys::quarantine`]): the
//! dead-letter ids that hold the order, scored by seq (0 without one). Ids are
//! UUIDv7, so letters of equal seq sort in the order they were made. The
//! lowest member is the blocker. A replayed letter runs only when it is the
//! blocker (or older than it); applied, it leaves the set (in the dedup commit,
//! see `crate::dedup`; a dead letter enters it in the same script that
//! records the letter), and the order is free when the set is empty — Redis
//! deletes an empty set, so "no key" means "not quarantined". A replay that
//! fails again re-enters the set under its new id with the same seq, so it
//! stays the blocker and the successors replayed behind it are quarantined
//! again rather than applied out of order.

use shardline_contract::{Keys, OrderKey};

/// The dead letter an order waits behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Blocker {
    /// Its `x-dead-letter-id`.
    pub(crate) id: String,
    /// Its seq (0 when it had none).
    pub(crate) seq: u64,
}

/// The score of a letter: its seq. Seqs beyond 2^53 lose precision as a
/// score; they only ever compare against the same order's other seqs.
#[expect(clippy::cast_precision_loss, reason = "a sort score; documented above")]
pub(crate) fn score(seq: Option<u64>) -> f64 {
    seq.unwrap_or(0) as f64
}

/// What [`add_head_query`] answers: the order's lowest member with its score
/// (none when the order is not quarantined), and the replayed letter's score.
pub(crate) type Head = (Vec<(String, f64)>, Option<f64>);

/// Adds the reads [`blocker`] decides on to `pipe` (in the admit's round trip).
pub(crate) fn add_head_query(
    pipe: &mut redis::Pipeline,
    keys: &Keys,
    order_key: &OrderKey,
    replay_of: Option<&str>,
) {
    let key = keys.quarantine(order_key);
    pipe.cmd("ZRANGE").arg(&key).arg(0).arg(0).arg("WITHSCORES");
    // A fresh event asks for the empty member, never in the set: one shape
    // of answer either way.
    pipe.cmd("ZSCORE").arg(&key).arg(replay_of.unwrap_or(""));
}

/// Whether an event (`seq`, and the dead-letter id it replays) must wait
/// behind a dead letter: `None` when its order is not quarantined, or when the
/// event is the replay of the blocker (or of a letter older than it).
pub(crate) fn blocker(
    (head, own): Head,
    seq: Option<u64>,
    replay_of: Option<&str>,
) -> Option<Blocker> {
    let (id, head_score) = head.into_iter().next()?;
    let runs = may_run(&id, head_score, replay_of, own.is_some(), seq);
    (!runs).then(|| Blocker {
        id,
        seq: head_score_seq(head_score),
    })
}

/// Whether an event of a quarantined order (blocker `head_id` at
/// `head_score`) may run: only a replay of the blocker, or of a letter that is
/// not in the set and older than the blocker (from before the quarantine).
fn may_run(
    head_id: &str,
    head_score: f64,
    replay_of: Option<&str>,
    replay_in_set: bool,
    seq: Option<u64>,
) -> bool {
    match replay_of {
        Some(replayed) if replayed == head_id => true,
        Some(_) => !replay_in_set && score(seq) < head_score,
        None => false,
    }
}

#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "scores are seqs written by `enter`"
)]
fn head_score_seq(score: f64) -> u64 {
    score.max(0.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_round_trip_the_seqs_of_real_orders() {
        for seq in [0, 1, 2, 1_000_000, 1 << 53] {
            assert_eq!(head_score_seq(score(Some(seq))), seq);
        }
        assert_eq!(score(None), 0.0);
    }

    #[test]
    fn only_the_blocker_or_an_older_letter_runs() {
        let head = "0190-a";
        // A fresh event waits behind any blocker.
        assert!(!may_run(head, 2.0, None, false, Some(1)));
        assert!(!may_run(head, 2.0, None, false, Some(9)));
        // The blocker's replay runs.
        assert!(may_run(head, 2.0, Some(head), true, Some(2)));
        // A successor's replay waits while the blocker is unresolved.
        assert!(!may_run(head, 2.0, Some("0190-b"), true, Some(3)));
        // A letter from before the quarantine, older than the blocker, runs.
        assert!(may_run(head, 2.0, Some("0190-0"), false, Some(1)));
        // One not in the set but not older waits.
        assert!(!may_run(head, 2.0, Some("0190-0"), false, Some(2)));
    }
}
