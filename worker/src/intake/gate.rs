//! The sequence gate's in-memory side: events that arrived ahead of their
//! order's sequence, held (still unacked in RabbitMQ, so nothing is lost if the
//! worker dies) until the gap fills or the grace ends.
//!
//! The gate's durable side, each order's last passed seq, is in Redis and moves
//! with the commit (`dedup/`). This part only decides what runs next:
//! a state machine over any held item, on tokio's clock, so that its timers are
//! tested without a broker (`tokio::time::pause`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use shardline_contract::OrderKey;
use shardline_contract::headers::FailReason;
use tokio::time::Instant;

use crate::config::{Config, OnGap};
use crate::delivery::Directive;
use crate::intake::bytes::HeldBytes;

/// What the gate holds: an item that remembers when it was first held, so
/// that an event released and held again keeps the grace of its arrival.
pub(crate) trait Holdable {
    fn held_since(&self) -> Option<Instant>;
    fn set_held_since(&mut self, at: Instant);
    /// Its body's bytes, counted against `--max-held-bytes`.
    fn size(&self) -> usize;
}

struct Held<T> {
    item: Box<T>,
    /// Held for the start grace (its order had no state) rather than a gap.
    start: bool,
}

/// One shard's held events, by order and seq.
pub(crate) struct Gate<T> {
    orders: HashMap<OrderKey, BTreeMap<u64, Held<T>>>,
    held: usize,
    /// Bumped whenever the set of held events changes.
    version: u64,
    runnable: VecDeque<(T, Directive)>,
    max_held: usize,
    /// The shard's decoded bytes: the gate counts its held and runnable
    /// events' bodies there.
    bytes: HeldBytes,
    gap_grace: Duration,
    start_grace: Duration,
    on_gap: OnGap,
}

/// What [`Gate::expire`] gave up on, for the caller to report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Expired {
    pub(crate) order_key: OrderKey,
    /// The lowest held seq, the first after the gap.
    pub(crate) first_seq: u64,
    pub(crate) events: usize,
    /// The order had no state: its first event is accepted as the start.
    pub(crate) at_start: bool,
}

impl<T: Holdable> Gate<T> {
    pub(crate) fn new(config: &Config) -> Self {
        Self {
            orders: HashMap::new(),
            held: 0,
            version: 0,
            runnable: VecDeque::new(),
            max_held: usize::from(config.max_held.max(1)),
            bytes: HeldBytes::new(config.max_held_bytes),
            gap_grace: config.gap_grace,
            start_grace: config.start_grace,
            on_gap: config.on_gap,
        }
    }

    /// Events held now.
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// Holds nothing and has released nothing that waits to run: no
    /// delivery it took is unacked.
    pub(crate) fn is_idle(&self) -> bool {
        self.held == 0 && self.runnable.is_empty()
    }

    /// An event it released waits to run (before any new delivery).
    pub(crate) fn has_runnable(&self) -> bool {
        !self.runnable.is_empty()
    }

    /// At `--max-held`: while calls are paused the shard takes no delivery
    /// rather than give up a gap early.
    pub(crate) fn is_full(&self) -> bool {
        self.held >= self.max_held
    }

    /// The shard's decoded bytes (`--max-held-bytes`), which the gate's
    /// held and runnable events are counted in; shared with the lookahead.
    pub(crate) fn bytes(&self) -> &HeldBytes {
        &self.bytes
    }

    /// At `--max-held-bytes` (the gate's events with those read ahead and
    /// waiting): the shard takes no new delivery. Nothing is given up for
    /// bytes; held events wait for their gap or its grace, as below
    /// `--max-held`.
    pub(crate) fn is_full_of_bytes(&self) -> bool {
        !self.bytes.has_room()
    }

    /// Calls were paused for `by` (the downstream breaker): every hold's
    /// grace is extended by as much, so no gap or start times out because
    /// the shard could not run its events.
    pub(crate) fn extend(&mut self, by: Duration) {
        if by.is_zero() {
            return;
        }
        for item in self.orders.values_mut().flat_map(BTreeMap::values_mut) {
            if let Some(since) = item.item.held_since() {
                item.item.set_held_since(since + by);
            }
        }
    }

    /// Changes whenever the set of held events does.
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// The events the gate has not let go of yet: held, or released and
    /// waiting to run (for the backlog age).
    pub(crate) fn waiting(&self) -> impl Iterator<Item = &T> {
        self.held_events()
            .chain(self.runnable.iter().map(|(item, _)| item))
    }

    /// The events held now.
    pub(crate) fn held_events(&self) -> impl Iterator<Item = &T> {
        self.orders
            .values()
            .flat_map(BTreeMap::values)
            .map(|h| &*h.item)
    }

    /// Holds `item` (seq `seq` of `order_key`). A second copy of a held event
    /// comes back as `Err`, to be acked as a duplicate. At the bound the oldest
    /// gap times out first, early.
    pub(crate) fn hold(
        &mut self,
        mut item: Box<T>,
        order_key: &OrderKey,
        seq: u64,
        start: bool,
        now: Instant,
    ) -> Result<Vec<Expired>, Box<T>> {
        if self
            .orders
            .get(order_key)
            .is_some_and(|held| held.contains_key(&seq))
        {
            return Err(item);
        }
        let mut expired = Vec::new();
        if self.held >= self.max_held
            && let Some(oldest) = self.oldest_order()
        {
            expired.push(self.give_up(&oldest));
        }
        if item.held_since().is_none() {
            item.set_held_since(now);
        }
        self.bytes.add(item.size());
        self.orders
            .entry(order_key.clone())
            .or_default()
            .insert(seq, Held { item, start });
        self.held += 1;
        self.version += 1;
        Ok(expired)
    }

    /// An event of `order_key` passed: its lowest held successor runs next (it
    /// is held again if its gap is still open).
    pub(crate) fn passed(&mut self, order_key: &OrderKey) {
        let Some(held) = self.orders.get_mut(order_key) else {
            return;
        };
        if let Some((_, next)) = held.pop_first() {
            self.held -= 1;
            self.version += 1;
            self.runnable.push_back((*next.item, Directive::Normal));
        }
        if held.is_empty() {
            self.orders.remove(order_key);
        }
    }

    /// Takes out every held event of the orders whose first held event
    /// `leaves` (a marker moved their bucket away): in each order's seq
    /// order, for the caller to forward.
    pub(crate) fn take_orders(&mut self, leaves: impl Fn(&T) -> bool) -> Vec<T> {
        let leaving: Vec<OrderKey> = self
            .orders
            .iter()
            .filter(|(_, held)| held.values().next().is_some_and(|h| leaves(&h.item)))
            .map(|(order, _)| order.clone())
            .collect();
        let mut taken = Vec::new();
        for order in leaving {
            for (_, held) in self.orders.remove(&order).unwrap_or_default() {
                self.held -= 1;
                self.bytes.sub(held.item.size());
                taken.push(*held.item);
            }
            self.version += 1;
        }
        taken
    }

    /// The next delivery the gate released, before any new one is taken.
    pub(crate) fn pop_runnable(&mut self) -> Option<(T, Directive)> {
        let next = self.runnable.pop_front();
        if let Some((item, _)) = &next {
            self.bytes.sub(item.size());
        }
        next
    }

    /// When the earliest hold ends.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.orders
            .values()
            .filter_map(|held| self.deadline(held))
            .min()
    }

    /// Gives up every gap whose grace has ended by `now`.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<Expired> {
        let due: Vec<OrderKey> = self
            .orders
            .iter()
            .filter(|(_, held)| self.deadline(held).is_some_and(|d| d <= now))
            .map(|(order, _)| order.clone())
            .collect();
        due.iter().map(|order| self.give_up(order)).collect()
    }

    fn deadline(&self, held: &BTreeMap<u64, Held<T>>) -> Option<Instant> {
        held.values()
            .filter_map(|h| {
                let grace = if h.start {
                    self.start_grace
                } else {
                    self.gap_grace
                };
                h.item.held_since().map(|since| since + grace)
            })
            .min()
    }

    fn oldest_order(&self) -> Option<OrderKey> {
        self.orders
            .iter()
            .filter_map(|(order, held)| {
                let since = held.values().filter_map(|h| h.item.held_since()).min()?;
                Some((since, order))
            })
            .min()
            .map(|(_, order)| order.clone())
    }

    /// Ends the wait of one order. A start: its lowest event is accepted as the
    /// start and the rest go back through the gate after it. A gap: every held
    /// event is dead-lettered `seq-gap` (or applied), in seq order.
    fn give_up(&mut self, order_key: &OrderKey) -> Expired {
        let held = self.orders.remove(order_key).unwrap_or_default();
        self.held -= held.len();
        self.version += 1;
        let first_seq = held.keys().next().copied().unwrap_or_default();
        let at_start = held.values().any(|h| h.start);
        let events = held.len();
        let mut held = held.into_iter();
        if at_start {
            if let Some((_, first)) = held.next() {
                self.runnable.push_back((*first.item, Directive::Bypass));
            }
            // The others wait for the start to pass, as successors do.
            let rest: BTreeMap<u64, Held<T>> = held
                .map(|(seq, h)| (seq, Held { start: false, ..h }))
                .collect();
            if !rest.is_empty() {
                self.held += rest.len();
                self.orders.insert(order_key.clone(), rest);
            }
        } else {
            for (seq, h) in held {
                let directive = match self.on_gap {
                    OnGap::Apply => Directive::Bypass,
                    OnGap::DeadLetter => Directive::DeadLetter(
                        FailReason::SeqGap,
                        format!(
                            "seq {seq} waited {} for the gap before seq {first_seq} to fill",
                            humantime::format_duration(self.gap_grace)
                        ),
                    ),
                };
                self.runnable.push_back((*h.item, directive));
            }
        }
        Expired {
            order_key: order_key.clone(),
            first_seq,
            events,
            at_start,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A held event as the tests see it: its seq.
    #[derive(Debug, PartialEq)]
    struct Item {
        seq: u64,
        since: Option<Instant>,
        size: usize,
    }

    impl Holdable for Item {
        fn held_since(&self) -> Option<Instant> {
            self.since
        }

        fn set_held_since(&mut self, at: Instant) {
            self.since = Some(at);
        }

        fn size(&self) -> usize {
            self.size
        }
    }

    fn key(order: &str) -> OrderKey {
        shardline_contract::OrderId::new(order).unwrap().key()
    }

    fn item(seq: u64) -> Box<Item> {
        sized(seq, 0)
    }

    /// An item whose body is `size` bytes.
    fn sized(seq: u64, size: usize) -> Box<Item> {
        Box::new(Item {
            seq,
            since: None,
            size,
        })
    }

    fn gate(config: Config) -> Gate<Item> {
        Gate::new(&config)
    }

    /// Every runnable item: its seq and directive.
    fn drain(gate: &mut Gate<Item>) -> Vec<(u64, Directive)> {
        std::iter::from_fn(|| gate.pop_runnable())
            .map(|(item, directive)| (item.seq, directive))
            .collect()
    }

    fn is_seq_gap(directive: &Directive) -> bool {
        matches!(directive, Directive::DeadLetter(FailReason::SeqGap, _))
    }

    /// Advances the paused clock by `d` and gives up what is due.
    async fn after(gate: &mut Gate<Item>, d: Duration) -> Vec<Expired> {
        tokio::time::advance(d).await;
        gate.expire(Instant::now())
    }

    const MS: Duration = Duration::from_millis(1);

    #[tokio::test(start_paused = true)]
    async fn a_start_waits_the_start_grace_then_runs_past_the_gate() {
        let mut g = gate(Config::default());
        let t0 = Instant::now();
        g.hold(item(3), &key("A"), 3, true, t0).unwrap();
        g.hold(item(5), &key("A"), 5, true, t0).unwrap();
        assert_eq!(g.next_deadline(), Some(t0 + Duration::from_secs(5)));
        assert!(after(&mut g, Duration::from_secs(5) - MS).await.is_empty());
        let expired = after(&mut g, MS).await;
        assert_eq!(
            expired,
            [Expired {
                order_key: key("A"),
                first_seq: 3,
                events: 2,
                at_start: true
            }]
        );
        // The lowest is the start; the rest wait for it like any successor.
        assert_eq!(drain(&mut g), [(3, Directive::Bypass)]);
        assert_eq!(g.held(), 1);
        assert_eq!(
            g.next_deadline(),
            Some(t0 + Duration::from_secs(120)),
            "the gap grace counts from the arrival"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_extends_every_grace_by_its_length() {
        let mut g = gate(Config::default());
        let t0 = Instant::now();
        g.hold(item(3), &key("A"), 3, true, t0).unwrap();
        g.hold(item(9), &key("B"), 9, false, t0).unwrap();
        let pause = Duration::from_secs(40);
        g.extend(pause);
        assert_eq!(g.next_deadline(), Some(t0 + Duration::from_secs(5) + pause));
        assert!(after(&mut g, Duration::from_secs(45) - MS).await.is_empty());
        assert_eq!(
            after(&mut g, MS).await.len(),
            1,
            "the start, 5 s + 40 s later"
        );
        assert!(
            after(&mut g, Duration::from_secs(115) - MS)
                .await
                .is_empty()
        );
        assert_eq!(
            after(&mut g, MS).await.len(),
            1,
            "the gap, 120 s + 40 s later"
        );
        assert!(!g.is_full());
    }

    #[tokio::test(start_paused = true)]
    async fn a_gap_that_never_fills_is_dead_lettered_after_the_gap_grace() {
        let mut g = gate(Config::default());
        g.hold(item(4), &key("A"), 4, false, Instant::now())
            .unwrap();
        tokio::time::advance(Duration::from_secs(30)).await;
        g.hold(item(3), &key("A"), 3, false, Instant::now())
            .unwrap();
        g.hold(item(9), &key("B"), 9, false, Instant::now())
            .unwrap();
        assert!(after(&mut g, Duration::from_secs(90) - MS).await.is_empty());
        let expired = after(&mut g, MS).await;
        assert_eq!(expired.len(), 1, "only A's oldest event is due");
        assert_eq!((expired[0].first_seq, expired[0].events), (3, 2));
        let run = drain(&mut g);
        assert_eq!(run.iter().map(|(seq, _)| *seq).collect::<Vec<_>>(), [3, 4]);
        assert!(run.iter().all(|(_, d)| is_seq_gap(d)), "{run:?}");
        assert_eq!(g.held(), 1);
        let expired = after(&mut g, Duration::from_secs(30)).await;
        assert_eq!(expired[0].order_key, "B");
    }

    #[tokio::test(start_paused = true)]
    async fn a_gap_that_fills_releases_the_order_in_seq_order() {
        let mut g = gate(Config::default());
        let t0 = Instant::now();
        g.hold(item(4), &key("A"), 4, false, t0).unwrap();
        g.hold(item(3), &key("A"), 3, false, t0).unwrap();
        let version = g.version();
        // Seq 2 arrives and passes: 3 runs, then 4 after 3 passed.
        g.passed(&key("A"));
        assert_ne!(g.version(), version);
        assert_eq!(drain(&mut g), [(3, Directive::Normal)]);
        g.passed(&key("A"));
        assert_eq!(drain(&mut g), [(4, Directive::Normal)]);
        g.passed(&key("A"));
        assert!(drain(&mut g).is_empty());
        assert_eq!((g.held(), g.next_deadline()), (0, None));
        assert!(after(&mut g, Duration::from_secs(600)).await.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_held_again_keeps_the_grace_of_its_arrival() {
        let mut g = gate(Config::default());
        let t0 = Instant::now();
        g.hold(item(5), &key("A"), 5, false, t0).unwrap();
        tokio::time::advance(Duration::from_secs(60)).await;
        // Seq 3 passed but 4 is still missing: 5 runs, is held again.
        g.passed(&key("A"));
        let (again, _) = g.pop_runnable().unwrap();
        g.hold(Box::new(again), &key("A"), 5, false, Instant::now())
            .unwrap();
        assert_eq!(g.next_deadline(), Some(t0 + Duration::from_secs(120)));
    }

    #[tokio::test(start_paused = true)]
    async fn at_max_held_the_oldest_gap_times_out_early() {
        let mut g = gate(Config {
            max_held: 2,
            ..Config::default()
        });
        g.hold(item(5), &key("old"), 5, false, Instant::now())
            .unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        g.hold(item(7), &key("new"), 7, false, Instant::now())
            .unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        let expired = g
            .hold(item(8), &key("new"), 8, false, Instant::now())
            .unwrap();
        assert_eq!(expired.len(), 1, "long before the grace");
        assert_eq!(expired[0].order_key, "old");
        let run = drain(&mut g);
        assert!(
            matches!(run.as_slice(), [(5, d)] if is_seq_gap(d)),
            "{run:?}"
        );
        assert_eq!(g.held(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn on_gap_apply_runs_the_held_events_past_the_gap() {
        let mut g = gate(Config {
            on_gap: OnGap::Apply,
            gap_grace: Duration::from_secs(10),
            ..Config::default()
        });
        g.hold(item(6), &key("A"), 6, false, Instant::now())
            .unwrap();
        g.hold(item(4), &key("A"), 4, false, Instant::now())
            .unwrap();
        let expired = after(&mut g, Duration::from_secs(10)).await;
        assert_eq!(expired.len(), 1);
        assert!(!expired[0].at_start);
        assert_eq!(
            drain(&mut g),
            [(4, Directive::Bypass), (6, Directive::Bypass)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_copy_of_a_held_event_comes_back() {
        let mut g = gate(Config::default());
        let t0 = Instant::now();
        g.hold(item(3), &key("A"), 3, false, t0).unwrap();
        let copy = g.hold(item(3), &key("A"), 3, false, t0).unwrap_err();
        assert_eq!(copy.seq, 3);
        assert_eq!(g.held(), 1);
        // The same seq of another order is no copy.
        assert!(g.hold(item(3), &key("B"), 3, false, t0).is_ok());
        assert_eq!(g.held(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_are_counted_while_held_and_until_released_events_are_taken() {
        let mut g = gate(Config::default());
        let t0 = Instant::now();
        g.hold(sized(3, 100), &key("A"), 3, false, t0).unwrap();
        g.hold(sized(4, 50), &key("A"), 4, false, t0).unwrap();
        assert_eq!(g.bytes().get(), 150);
        assert!(g.hold(sized(3, 100), &key("A"), 3, false, t0).is_err());
        assert_eq!(g.bytes().get(), 150, "a second copy is not held");
        // Released: counted until it is taken to run.
        g.passed(&key("A"));
        assert_eq!(g.bytes().get(), 150);
        assert_eq!(g.pop_runnable().map(|(i, _)| i.seq), Some(3));
        assert_eq!(g.bytes().get(), 50);
        // Given up: the same.
        assert_eq!(after(&mut g, Duration::from_secs(120)).await.len(), 1);
        assert_eq!(g.bytes().get(), 50);
        assert_eq!(drain(&mut g).len(), 1);
        assert_eq!(g.bytes().get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn at_max_held_bytes_the_gate_is_full_and_gives_nothing_up() {
        let mut g = gate(Config {
            max_held_bytes: 100,
            ..Config::default()
        });
        let t0 = Instant::now();
        assert!(!g.is_full_of_bytes());
        assert!(
            g.hold(sized(3, 60), &key("A"), 3, false, t0)
                .unwrap()
                .is_empty()
        );
        assert!(!g.is_full_of_bytes(), "below the bound");
        assert!(
            g.hold(sized(5, 60), &key("B"), 5, false, t0)
                .unwrap()
                .is_empty(),
            "no gap is given up for bytes"
        );
        assert!(g.is_full_of_bytes());
        assert!(!g.is_full(), "two events are far below --max-held");
        assert_eq!(g.held(), 2);
        assert!(drain(&mut g).is_empty(), "held events stay held");
        // A's gap fills: its event runs, and there is room again.
        g.passed(&key("A"));
        assert!(g.is_full_of_bytes(), "released, not yet taken");
        assert_eq!(drain(&mut g).len(), 1);
        assert!(!g.is_full_of_bytes());
    }

    #[tokio::test(start_paused = true)]
    async fn a_single_event_larger_than_the_bound_is_taken_when_nothing_is_held() {
        let mut g = gate(Config {
            max_held_bytes: 100,
            ..Config::default()
        });
        let t0 = Instant::now();
        assert!(!g.is_full_of_bytes(), "holding nothing: room for any size");
        g.hold(sized(3, 1_000), &key("A"), 3, false, t0).unwrap();
        assert!(g.is_full_of_bytes());
        g.passed(&key("A"));
        assert_eq!(drain(&mut g).len(), 1);
        assert!(!g.is_full_of_bytes());
        assert_eq!(g.bytes().get(), 0);
    }
}
