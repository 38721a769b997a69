//! Which of a shard's events may start next when it keeps several handler
//! calls in flight (`Config::concurrency` > 1): never two of one order, an
//! order's events in delivery order, redelivered events alone.
//!
//! A pure state machine over any item, so that its rules are unit-tested
//! without a broker. The shard's consumer (`shard::run_concurrent`) pushes what it
//! takes, starts what [`Schedule::next`] gives it and reports each end with
//! [`Schedule::finish`].
//!
//! - **Key-ordered.** An order is *active* while one of its events is ready or
//!   running; a later event of an active order waits in that order's queue and
//!   becomes ready when the one before it finishes.
//! - **Bounded.** Events taken and not yet finished (running, ready, waiting)
//!   are at most `max_taken`; at the bound [`Schedule::accepts`] is false and
//!   the shard takes no delivery until one finishes.
//! - **Redelivered events alone.** A redelivered event may be one whose earlier
//!   handler call killed the process; its admit counts an unfinished start. It
//!   starts only when nothing else runs, and nothing starts beside it until it
//!   finishes, so a crash it causes takes no innocent event down with it and
//!   only the killer's count reaches `--max-deliveries`.

use std::collections::{HashMap, VecDeque};

/// An item with what the schedule needs to know about it.
#[derive(Debug)]
pub(crate) struct Entry<T> {
    /// Its order; `None` for a body that has none (it conflicts with nothing).
    pub(crate) order: Option<String>,
    /// Runs alone in the shard (a redelivered event).
    pub(crate) alone: bool,
    pub(crate) item: T,
}

/// One shard's events between taken and finished.
#[derive(Debug)]
pub(crate) struct Schedule<T> {
    slots: usize,
    max_taken: usize,
    /// Orders with an event ready or running, and the events behind it.
    active: HashMap<String, VecDeque<Entry<T>>>,
    ready: VecDeque<Entry<T>>,
    waiting: usize,
    running: usize,
    /// A redelivered event is running: nothing else starts.
    alone_running: bool,
}

impl<T> Schedule<T> {
    /// At most `slots` running, at most `max_taken` taken in all.
    pub(crate) fn new(slots: usize, max_taken: usize) -> Self {
        Self {
            slots: slots.max(1),
            max_taken: max_taken.max(slots.max(1)),
            active: HashMap::new(),
            ready: VecDeque::new(),
            waiting: 0,
            running: 0,
            alone_running: false,
        }
    }

    /// A delivery taken from the broker: ready, or waiting behind its order.
    pub(crate) fn push(&mut self, entry: Entry<T>) {
        self.enqueue(entry, false);
    }

    /// An event the gate released: it goes before the events of its order
    /// that arrived while it was held.
    pub(crate) fn push_released(&mut self, entry: Entry<T>) {
        self.enqueue(entry, true);
    }

    fn enqueue(&mut self, entry: Entry<T>, first: bool) {
        let Some(order) = &entry.order else {
            self.ready.push_back(entry);
            return;
        };
        match self.active.get_mut(order) {
            Some(behind) => {
                self.waiting += 1;
                if first {
                    behind.push_front(entry);
                } else {
                    behind.push_back(entry);
                }
            }
            None => {
                self.active.insert(order.clone(), VecDeque::new());
                self.ready.push_back(entry);
            }
        }
    }

    /// The next event to start now, if a slot is free and the rules allow.
    pub(crate) fn next(&mut self) -> Option<Entry<T>> {
        if self.alone_running || self.running >= self.slots {
            return None;
        }
        let front = self.ready.front()?;
        if front.alone && self.running > 0 {
            return None;
        }
        let entry = self.ready.pop_front()?;
        self.running += 1;
        self.alone_running = entry.alone;
        Some(entry)
    }

    /// An event to start beyond the slots: the breaker's evidence attempt,
    /// while a slot's event waits for it. The first ready event that need
    /// not run alone; [`Schedule::finish`] ends it like any other.
    pub(crate) fn next_extra(&mut self) -> Option<Entry<T>> {
        if self.alone_running {
            return None;
        }
        let i = self.ready.iter().position(|e| !e.alone)?;
        let entry = self.ready.remove(i)?;
        self.running += 1;
        Some(entry)
    }

    /// A started event ended (acked, held or abandoned): its order's next
    /// event, if one waits, becomes ready.
    pub(crate) fn finish(&mut self, order: Option<&str>, alone: bool) {
        self.running = self.running.saturating_sub(1);
        if alone {
            self.alone_running = false;
        }
        let Some(order) = order else {
            return;
        };
        let next = self.active.get_mut(order).and_then(VecDeque::pop_front);
        match next {
            Some(next) => {
                self.waiting -= 1;
                self.ready.push_back(next);
            }
            None => {
                self.active.remove(order);
            }
        }
    }

    /// Whether the shard should take another delivery: a slot is free, nothing
    /// ready is kept from starting, and the taken events are under the bound.
    pub(crate) fn accepts(&self) -> bool {
        !self.alone_running
            && self.ready.is_empty()
            && self.running < self.slots
            && self.taken() < self.max_taken
    }

    /// Events running (handler calls in flight, backoff included).
    #[cfg(test)]
    pub(crate) fn running(&self) -> usize {
        self.running
    }

    /// Events waiting for their order or for a slot (ready, not started).
    pub(crate) fn waiting(&self) -> usize {
        self.waiting + self.ready.len()
    }

    /// The events not started, for the backlog age.
    pub(crate) fn pending(&self) -> impl Iterator<Item = &T> {
        self.ready
            .iter()
            .chain(self.active.values().flatten())
            .map(|e| &e.item)
    }

    fn taken(&self) -> usize {
        self.running + self.waiting()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(order: &str, n: u32) -> Entry<(String, u32)> {
        Entry {
            order: Some(order.to_owned()),
            alone: false,
            item: (order.to_owned(), n),
        }
    }

    fn started(s: &mut Schedule<(String, u32)>) -> Vec<(String, u32)> {
        std::iter::from_fn(|| s.next().map(|e| e.item)).collect()
    }

    fn pair(order: &str, n: u32) -> (String, u32) {
        (order.to_owned(), n)
    }

    #[test]
    fn a_busy_order_waits_while_other_orders_go_ahead() {
        let mut s = Schedule::new(4, 100);
        for e in [ev("a", 1), ev("a", 2), ev("b", 1), ev("a", 3), ev("c", 1)] {
            s.push(e);
        }
        assert_eq!(started(&mut s), [pair("a", 1), pair("b", 1), pair("c", 1)]);
        assert_eq!((s.running(), s.waiting()), (3, 2));
        s.finish(Some("b"), false);
        assert_eq!(started(&mut s), [], "a's next waits for a 1");
        s.finish(Some("a"), false);
        assert_eq!(started(&mut s), [pair("a", 2)]);
        s.finish(Some("a"), false);
        assert_eq!(started(&mut s), [pair("a", 3)]);
        s.finish(Some("a"), false);
        s.finish(Some("c"), false);
        assert_eq!((s.running(), s.waiting()), (0, 0));
        assert!(s.active.is_empty());
    }

    #[test]
    fn the_evidence_event_runs_beyond_the_slots_but_never_beside_its_order() {
        let mut s = Schedule::new(1, 100);
        for e in [ev("a", 1), ev("a", 2), ev("b", 1)] {
            s.push(e);
        }
        assert_eq!(started(&mut s), [pair("a", 1)]);
        let extra = s.next_extra().map(|e| e.item);
        assert_eq!(extra, Some(pair("b", 1)), "a 2 waits behind a 1");
        assert_eq!((s.running(), s.next_extra().map(|e| e.item)), (2, None));
        s.finish(Some("b"), false);
        s.finish(Some("a"), false);
        assert_eq!(started(&mut s), [pair("a", 2)]);
    }

    #[test]
    fn no_more_than_the_slots_run() {
        let mut s = Schedule::new(2, 100);
        for order in ["a", "b", "c"] {
            s.push(ev(order, 1));
        }
        assert_eq!(started(&mut s), [pair("a", 1), pair("b", 1)]);
        assert!(!s.accepts(), "slots full and c is ready");
        s.finish(Some("b"), false);
        assert_eq!(started(&mut s), [pair("c", 1)]);
    }

    #[test]
    fn events_without_an_order_conflict_with_nothing() {
        let mut s = Schedule::new(3, 100);
        for n in 0..3 {
            s.push(Entry {
                order: None,
                alone: false,
                item: (String::new(), n),
            });
        }
        assert_eq!(started(&mut s).len(), 3);
        s.finish(None, false);
        assert_eq!(s.running(), 2);
    }

    #[test]
    fn at_the_bound_the_shard_takes_nothing_until_an_event_finishes() {
        // A hot order: its events wait one behind the other.
        let mut s = Schedule::new(4, 5);
        s.push(ev("hot", 1));
        assert_eq!(started(&mut s), [pair("hot", 1)]);
        for n in 2..=5 {
            assert!(s.accepts());
            s.push(ev("hot", n));
            assert_eq!(started(&mut s), []);
        }
        assert_eq!((s.running(), s.waiting()), (1, 4));
        assert!(!s.accepts(), "5 taken: at the bound");
        s.finish(Some("hot"), false);
        assert_eq!(started(&mut s), [pair("hot", 2)]);
        assert!(s.accepts(), "4 taken: under the bound again");
    }

    #[test]
    fn a_released_event_goes_before_its_orders_later_arrivals() {
        let mut s = Schedule::new(4, 100);
        s.push(ev("a", 1));
        assert_eq!(started(&mut s), [pair("a", 1)]);
        s.push(ev("a", 5));
        // a 1 passed; the gate released a 2, held meanwhile.
        s.push_released(ev("a", 2));
        s.finish(Some("a"), false);
        assert_eq!(started(&mut s), [pair("a", 2)]);
        s.finish(Some("a"), false);
        assert_eq!(started(&mut s), [pair("a", 5)]);
    }

    #[test]
    fn a_redelivered_event_runs_alone() {
        let mut s = Schedule::new(4, 100);
        s.push(ev("a", 1));
        assert_eq!(started(&mut s), [pair("a", 1)]);
        s.push(Entry {
            alone: true,
            ..ev("x", 1)
        });
        s.push(ev("b", 1));
        assert_eq!(started(&mut s), [], "x waits for a 1 to finish; b behind x");
        assert!(!s.accepts());
        s.finish(Some("a"), false);
        assert_eq!(started(&mut s), [pair("x", 1)]);
        assert!(!s.accepts(), "nothing is taken beside it");
        s.finish(Some("x"), true);
        assert_eq!(started(&mut s), [pair("b", 1)]);
        assert!(s.accepts());
    }

    #[test]
    fn redelivered_events_run_one_at_a_time() {
        let mut s = Schedule::new(8, 100);
        for order in ["x", "y", "z"] {
            s.push(Entry {
                alone: true,
                ..ev(order, 1)
            });
        }
        for order in ["x", "y", "z"] {
            assert_eq!(started(&mut s), [pair(order, 1)]);
            s.finish(Some(order), true);
        }
        assert_eq!((s.running(), s.waiting()), (0, 0));
    }
}
