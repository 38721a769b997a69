//! A replay's plan and its passes over the DLQ, without a broker: which
//! letters a replay republishes, which one of an order may go next, and when
//! a pass stops reading and gives back what it holds.
//!
//! The plan comes from the dead-letter index (order and seq per id), so that
//! a replay knows an order's earlier letters before it reads them. A pass
//! reads the DLQ from its head one letter at a time: a letter whose order's
//! earlier planned letters are done goes at once; any other letter is held
//! (unacked) until the pass ends and closes its channel, which returns the
//! held letters to the head of the queue, in their order.

use std::collections::{BTreeSet, HashMap};

use shardline_contract::letters::IndexEntry;

use crate::letter::LetterRef;

/// How a replay reads the DLQ: what a pass may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// A pass that has replayed a letter ends once it has read this many
    /// letters since its last replay (they are held: letters of other
    /// orders or letters that wait), giving them back. Default 100.
    pub size: usize,
    /// A pass never holds more letters than this: a pass that has replayed
    /// nothing when it reaches it stops the replay, naming the letter it
    /// waits for. Default 10,000.
    pub reach: usize,
}

impl Default for Window {
    fn default() -> Self {
        Self {
            size: 100,
            reach: 10_000,
        }
    }
}

/// Where a letter read from the DLQ stands in the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Planned, and every earlier planned letter of its order is done.
    Ready,
    /// Planned, behind an earlier planned letter of its order.
    Waiting,
    /// Not in the plan (another selection, or already replayed).
    Unplanned,
}

/// Sorts an order's letters: by seq (letters without one first, as they
/// were read), then by first failure, then by id.
type Place = (u64, u64, String);

/// The letters a replay still has to republish, per order.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// Per order, its pending letters in the order they go.
    orders: HashMap<String, BTreeSet<Place>>,
    /// Per id, its order, its place and what describes it.
    letters: HashMap<String, (String, Place, LetterRef)>,
    /// Orders in the order their oldest letter failed.
    first: Vec<String>,
}

impl Plan {
    /// The plan of `entries` (oldest first); entries without an order are
    /// not replayable and are returned apart.
    pub(crate) fn new(entries: &[IndexEntry]) -> (Self, Vec<LetterRef>) {
        let mut plan = Self::default();
        let mut skipped = Vec::new();
        for e in entries {
            let Some(order) = &e.order_id else {
                skipped.push(LetterRef::from(e));
                continue;
            };
            let place = (e.seq.unwrap_or(0), e.first_failed_ms, e.id.clone());
            let pending = plan.orders.entry(order.clone()).or_insert_with(|| {
                plan.first.push(order.clone());
                BTreeSet::new()
            });
            if pending.insert(place.clone()) {
                plan.letters
                    .insert(e.id.clone(), (order.clone(), place, LetterRef::from(e)));
            }
        }
        (plan, skipped)
    }

    pub(crate) fn len(&self) -> usize {
        self.letters.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.letters.is_empty()
    }

    pub(crate) fn verdict(&self, id: &str) -> Verdict {
        let Some((order, place, _)) = self.letters.get(id) else {
            return Verdict::Unplanned;
        };
        match self.orders.get(order).and_then(BTreeSet::first) {
            Some(next) if next == place => Verdict::Ready,
            _ => Verdict::Waiting,
        }
    }

    /// Takes `id` out of the plan (replayed, or given up), so that the next
    /// letter of its order may go.
    pub(crate) fn done(&mut self, id: &str) {
        if let Some((order, place, _)) = self.letters.remove(id)
            && let Some(pending) = self.orders.get_mut(&order)
        {
            pending.remove(&place);
            if pending.is_empty() {
                self.orders.remove(&order);
            }
        }
    }

    /// Takes every letter of `order` out of the plan (another replay holds
    /// it); returns how many there were.
    pub(crate) fn drop_order(&mut self, order: &str) -> usize {
        let Some(pending) = self.orders.remove(order) else {
            return 0;
        };
        for (_, _, id) in &pending {
            self.letters.remove(id);
        }
        pending.len()
    }

    /// The letter `id` waits for: the next planned letter of its order.
    pub(crate) fn blocker_of(&self, id: &str) -> Option<&LetterRef> {
        let (order, _, _) = self.letters.get(id)?;
        self.next_of(order)
    }

    fn next_of(&self, order: &str) -> Option<&LetterRef> {
        let (_, _, id) = self.orders.get(order)?.first()?;
        self.letters.get(id).map(|(_, _, l)| l)
    }

    /// The next letter of the order whose oldest letter failed first.
    pub(crate) fn first_pending(&self) -> Option<&LetterRef> {
        self.first.iter().find_map(|o| self.next_of(o))
    }

    /// Every pending letter in the order a replay sends them: orders as
    /// their oldest letter failed, each by seq.
    pub(crate) fn in_order(&self) -> Vec<LetterRef> {
        self.first
            .iter()
            .filter_map(|o| self.orders.get(o))
            .flatten()
            .filter_map(|(_, _, id)| self.letters.get(id).map(|(_, _, l)| l.clone()))
            .collect()
    }

    /// The orders of the plan with the ids of their letters.
    pub(crate) fn ids_by_order(&self) -> impl Iterator<Item = (&str, Vec<String>)> {
        self.orders.iter().map(|(order, pending)| {
            (
                order.as_str(),
                pending.iter().map(|(_, _, id)| id.clone()).collect(),
            )
        })
    }
}

/// What a pass does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Read the next letter.
    Read,
    /// Close the channel (the held letters go back to the head) and start
    /// another pass.
    Release,
    /// Nothing can go: stop the replay, naming what it waits for.
    Stop,
}

/// One pass over the DLQ: what it read, held and replayed.
#[derive(Debug)]
pub(crate) struct Pass {
    window: Window,
    held: usize,
    replayed: usize,
    /// Letters read since the last replay of this pass.
    since: usize,
    /// The first letter held because it waits for an earlier one.
    first_waiting: Option<String>,
}

impl Pass {
    pub(crate) fn new(window: Window) -> Self {
        Self {
            window,
            held: 0,
            replayed: 0,
            since: 0,
            first_waiting: None,
        }
    }

    /// A letter of this pass was republished and left the DLQ.
    pub(crate) fn replayed(&mut self) {
        self.replayed += 1;
        self.since = 0;
    }

    /// A letter of this pass is held: it waits (`Verdict::Waiting`) or is
    /// not this replay's.
    pub(crate) fn held(&mut self, id: &str, verdict: Verdict) {
        self.held += 1;
        self.since += 1;
        if verdict == Verdict::Waiting && self.first_waiting.is_none() {
            self.first_waiting = Some(id.to_owned());
        }
    }

    pub(crate) fn held_count(&self) -> usize {
        self.held
    }

    /// After a letter: read on, give back, or stop.
    pub(crate) fn next(&self) -> Next {
        if self.replayed > 0 && self.since >= self.window.size {
            Next::Release
        } else if self.held >= self.window.reach {
            self.at_end()
        } else {
            Next::Read
        }
    }

    /// At the end of the queue (or the reach): another pass if this one
    /// replayed something, otherwise nothing more can go.
    pub(crate) fn at_end(&self) -> Next {
        if self.replayed > 0 {
            Next::Release
        } else {
            Next::Stop
        }
    }

    /// Why a pass that replayed nothing stops: the letter that waits (if
    /// one was read) and the planned letter it waits for.
    pub(crate) fn blocked(&self, plan: &Plan) -> Option<(Option<LetterRef>, LetterRef)> {
        let waiting = self.first_waiting.as_deref();
        let blocker = waiting
            .and_then(|id| plan.blocker_of(id))
            .or_else(|| plan.first_pending())?;
        let letter = waiting.and_then(|id| plan.letters.get(id).map(|(_, _, l)| l.clone()));
        Some((letter, blocker.clone()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(id: &str, order: Option<&str>, seq: Option<u64>, failed: u64) -> IndexEntry {
        IndexEntry {
            id: id.into(),
            reason: "handler".into(),
            group: "g".into(),
            error: String::new(),
            order_id: order.map(Into::into),
            seq,
            kind: None,
            shard: Some(1),
            first_failed_ms: failed,
            trace_id: None,
            attempts: None,
        }
    }

    fn ids(letters: &[LetterRef]) -> Vec<&str> {
        letters.iter().map(LetterRef::id).collect()
    }

    #[test]
    fn an_order_goes_by_seq_and_orders_as_their_oldest_letter_failed() {
        let (plan, skipped) = Plan::new(&[
            entry("b3", Some("B"), Some(3), 1),
            entry("a2", Some("A"), Some(2), 2),
            entry("b1", Some("B"), Some(1), 3),
            entry("junk", None, None, 4),
            entry("a1", Some("A"), Some(1), 5),
            entry("x", Some("B"), None, 6),
        ]);
        assert_eq!(ids(&skipped), ["junk"]);
        assert_eq!(ids(&plan.in_order()), ["x", "b1", "b3", "a1", "a2"]);
        assert_eq!(plan.len(), 5);
    }

    #[test]
    fn only_the_next_letter_of_an_order_is_ready() {
        let (mut plan, _) = Plan::new(&[
            entry("a3", Some("A"), Some(3), 1),
            entry("a1", Some("A"), Some(1), 2),
            entry("b1", Some("B"), Some(1), 3),
        ]);
        assert_eq!(plan.verdict("a3"), Verdict::Waiting);
        assert_eq!(plan.verdict("a1"), Verdict::Ready);
        assert_eq!(plan.verdict("b1"), Verdict::Ready);
        assert_eq!(plan.verdict("other"), Verdict::Unplanned);
        assert_eq!(plan.blocker_of("a3").unwrap().id(), "a1");
        plan.done("a1");
        assert_eq!(plan.verdict("a3"), Verdict::Ready);
        assert_eq!(plan.verdict("a1"), Verdict::Unplanned, "done is done");
        plan.done("a3");
        plan.done("b1");
        assert!(plan.is_empty());
    }

    #[test]
    fn a_dropped_order_leaves_the_others() {
        let (mut plan, _) = Plan::new(&[
            entry("a1", Some("A"), Some(1), 1),
            entry("a2", Some("A"), Some(2), 2),
            entry("b1", Some("B"), Some(1), 3),
        ]);
        assert_eq!(plan.drop_order("A"), 2);
        assert_eq!(plan.drop_order("A"), 0);
        assert_eq!(ids(&plan.in_order()), ["b1"]);
        assert_eq!(plan.verdict("a2"), Verdict::Unplanned);
    }

    #[test]
    fn a_flowing_pass_gives_back_what_it_holds_after_a_window() {
        let mut pass = Pass::new(Window { size: 3, reach: 10 });
        pass.replayed();
        for i in 0..2 {
            pass.held(&i.to_string(), Verdict::Unplanned);
            assert_eq!(pass.next(), Next::Read);
        }
        pass.held("w", Verdict::Waiting);
        assert_eq!(pass.next(), Next::Release);
        assert_eq!(pass.held_count(), 3);
    }

    #[test]
    fn a_pass_that_replayed_nothing_reads_past_its_window_up_to_the_reach() {
        let (plan, _) = Plan::new(&[
            entry("a1", Some("A"), Some(1), 1),
            entry("a2", Some("A"), Some(2), 2),
        ]);
        let mut pass = Pass::new(Window { size: 2, reach: 4 });
        pass.held("x", Verdict::Unplanned);
        pass.held("a2", Verdict::Waiting);
        pass.held("y", Verdict::Unplanned);
        assert_eq!(pass.next(), Next::Read, "past the window of 2");
        pass.held("z", Verdict::Unplanned);
        assert_eq!(pass.next(), Next::Stop, "the reach of 4");
        let (letter, blocker) = pass.blocked(&plan).unwrap();
        assert_eq!(letter.unwrap().id(), "a2");
        assert_eq!(blocker.id(), "a1");
    }

    #[test]
    fn the_queue_end_stops_only_a_pass_that_replayed_nothing() {
        let mut pass = Pass::new(Window::default());
        assert_eq!(pass.at_end(), Next::Stop);
        pass.replayed();
        assert_eq!(pass.at_end(), Next::Release);
    }

    #[test]
    fn without_a_waiting_letter_the_blocker_is_the_oldest_orders_next() {
        let (plan, _) = Plan::new(&[
            entry("b1", Some("B"), Some(1), 1),
            entry("a1", Some("A"), Some(1), 2),
        ]);
        let mut pass = Pass::new(Window { size: 1, reach: 1 });
        pass.held("x", Verdict::Unplanned);
        let (letter, blocker) = pass.blocked(&plan).unwrap();
        assert!(letter.is_none());
        assert_eq!(blocker.id(), "b1");
        assert!(pass.blocked(&Plan::default()).is_none());
    }

    /// A model of the DLQ: passes over a queue whose held letters return to
    /// its head, each ending as `Pass` says; every planned letter goes in
    /// its order's seq order, or the replay stops naming a blocker, and it
    /// never loops.
    #[test]
    fn passes_over_a_model_queue_replay_each_order_in_seq_order_or_stop() {
        let queue = ["a3", "x", "a2", "b1", "y", "a1", "b2"];
        let entries = [
            entry("a1", Some("A"), Some(1), 1),
            entry("a2", Some("A"), Some(2), 2),
            entry("a3", Some("A"), Some(3), 3),
            entry("b1", Some("B"), Some(1), 4),
            entry("b2", Some("B"), Some(2), 5),
        ];
        for (size, reach) in [(1, 7), (2, 7), (1, 100), (100, 100), (1, 3)] {
            let (mut plan, _) = Plan::new(&entries);
            let mut dlq: Vec<&str> = queue.to_vec();
            let mut sent = Vec::new();
            let mut passes = 0;
            let stopped = loop {
                passes += 1;
                assert!(passes < 50, "a replay never loops");
                let mut pass = Pass::new(Window { size, reach });
                let mut kept = Vec::new();
                let mut rest = dlq.clone().into_iter();
                let next = loop {
                    let Some(id) = rest.next() else {
                        break pass.at_end();
                    };
                    match plan.verdict(id) {
                        Verdict::Ready => {
                            plan.done(id);
                            sent.push(id);
                            pass.replayed();
                        }
                        v => {
                            pass.held(id, v);
                            kept.push(id);
                        }
                    }
                    match pass.next() {
                        Next::Read => {}
                        other => break other,
                    }
                };
                kept.extend(rest);
                dlq = kept;
                if plan.is_empty() {
                    break None;
                }
                if next == Next::Stop {
                    break pass.blocked(&plan);
                }
            };
            let a: Vec<_> = sent.iter().filter(|i| i.starts_with('a')).collect();
            assert!(
                a.windows(2).all(|w| w[0] < w[1]),
                "{size}/{reach}: {sent:?}"
            );
            if reach >= queue.len() {
                assert!(stopped.is_none(), "{size}/{reach}: finished");
                assert_eq!(sent.len(), 5);
            } else {
                let (_, blocker) = stopped.unwrap();
                assert_eq!(blocker.id(), "a1", "{size}/{reach}: names a1");
            }
        }
    }
}
