//! The sequence gate's in-memory side: events that arrived ahead of their
//! order's sequence, held (still unacked in RabbitMQ, so nothing is lost if the
//! worker dies) until the gap fills or the grace ends.
//!
//! The gate's durable side, each order's last passed seq, is in Redis and moves
//! with the dedup commit (`dedup.rs`). This part only decides what runs next.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use shardline_topology::headers::FailReason;

use crate::config::{Config, OnGap};
use crate::lookahead::Ready;

/// How a delivery is to be processed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Directive {
    /// Through the gate, like any delivery.
    Normal,
    /// Past the gate: an accepted start, an applied gap, a replay.
    Bypass,
    /// Straight to the dead-letter exchange.
    DeadLetter(FailReason, String),
}

struct Held {
    ready: Box<Ready>,
    /// Held for the start grace (its order had no state) rather than a gap.
    start: bool,
}

/// One shard's held events, by order and seq.
pub struct Gate {
    orders: HashMap<String, BTreeMap<u64, Held>>,
    held: usize,
    /// Bumped whenever the set of held events changes.
    version: u64,
    runnable: VecDeque<(Ready, Directive)>,
    max_held: usize,
    gap_grace: Duration,
    start_grace: Duration,
    on_gap: OnGap,
}

/// What [`Gate::expire`] gave up on, for the caller to report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    pub order_key: String,
    /// The lowest held seq, the first after the gap.
    pub first_seq: u64,
    pub events: usize,
    /// The order had no state: its first event is accepted as the start.
    pub at_start: bool,
}

impl Gate {
    pub fn new(config: &Config) -> Self {
        Self {
            orders: HashMap::new(),
            held: 0,
            version: 0,
            runnable: VecDeque::new(),
            max_held: usize::from(config.max_held.max(1)),
            gap_grace: config.gap_grace,
            start_grace: config.start_grace,
            on_gap: config.on_gap,
        }
    }

    /// Events held now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Changes whenever the set of held events does.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The events the gate has not let go of yet: held, or released and
    /// waiting to run (for the backlog age).
    pub fn waiting(&self) -> impl Iterator<Item = &Ready> {
        self.held_events()
            .chain(self.runnable.iter().map(|(ready, _)| ready))
    }

    /// The events held now.
    pub fn held_events(&self) -> impl Iterator<Item = &Ready> {
        self.orders
            .values()
            .flat_map(BTreeMap::values)
            .map(|h| &*h.ready)
    }

    /// Holds `ready` (seq `seq` of `order_key`). A second copy of a held event
    /// comes back as `Err`, to be acked as a duplicate. At the bound the oldest
    /// gap times out first, early.
    pub fn hold(
        &mut self,
        mut ready: Box<Ready>,
        order_key: &str,
        seq: u64,
        start: bool,
        now: Instant,
    ) -> Result<Vec<Expired>, Box<Ready>> {
        if self
            .orders
            .get(order_key)
            .is_some_and(|held| held.contains_key(&seq))
        {
            return Err(ready);
        }
        let mut expired = Vec::new();
        if self.held >= self.max_held
            && let Some(oldest) = self.oldest_order()
        {
            expired.push(self.give_up(&oldest));
        }
        ready.held_since.get_or_insert(now);
        self.orders
            .entry(order_key.to_owned())
            .or_default()
            .insert(seq, Held { ready, start });
        self.held += 1;
        self.version += 1;
        Ok(expired)
    }

    /// An event of `order_key` passed: its lowest held successor runs next (it
    /// is held again if its gap is still open).
    pub fn passed(&mut self, order_key: &str) {
        let Some(held) = self.orders.get_mut(order_key) else {
            return;
        };
        if let Some((_, next)) = held.pop_first() {
            self.held -= 1;
            self.version += 1;
            self.runnable.push_back((*next.ready, Directive::Normal));
        }
        if held.is_empty() {
            self.orders.remove(order_key);
        }
    }

    /// The next delivery the gate released, before any new one is taken.
    pub fn pop_runnable(&mut self) -> Option<(Ready, Directive)> {
        self.runnable.pop_front()
    }

    /// When the earliest hold ends.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.orders
            .values()
            .filter_map(|held| self.deadline(held))
            .min()
    }

    /// Gives up every gap whose grace has ended by `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Expired> {
        let due: Vec<String> = self
            .orders
            .iter()
            .filter(|(_, held)| self.deadline(held).is_some_and(|d| d <= now))
            .map(|(order, _)| order.clone())
            .collect();
        due.iter().map(|order| self.give_up(order)).collect()
    }

    fn deadline(&self, held: &BTreeMap<u64, Held>) -> Option<Instant> {
        held.values()
            .filter_map(|h| {
                let grace = if h.start {
                    self.start_grace
                } else {
                    self.gap_grace
                };
                h.ready.held_since.map(|since| since + grace)
            })
            .min()
    }

    fn oldest_order(&self) -> Option<String> {
        self.orders
            .iter()
            .filter_map(|(order, held)| {
                let since = held.values().filter_map(|h| h.ready.held_since).min()?;
                Some((since, order))
            })
            .min()
            .map(|(_, order)| order.clone())
    }

    /// Ends the wait of one order. A start: its lowest event is accepted as the
    /// start and the rest go back through the gate after it. A gap: every held
    /// event is dead-lettered `seq-gap` (or applied), in seq order.
    fn give_up(&mut self, order_key: &str) -> Expired {
        let held = self.orders.remove(order_key).unwrap_or_default();
        self.held -= held.len();
        self.version += 1;
        let first_seq = held.keys().next().copied().unwrap_or_default();
        let at_start = held.values().any(|h| h.start);
        let events = held.len();
        let mut held = held.into_iter();
        if at_start {
            if let Some((_, first)) = held.next() {
                self.runnable.push_back((*first.ready, Directive::Bypass));
            }
            // The others wait for the start to pass, as successors do.
            let rest: BTreeMap<u64, Held> = held
                .map(|(seq, h)| (seq, Held { start: false, ..h }))
                .collect();
            if !rest.is_empty() {
                self.held += rest.len();
                self.orders.insert(order_key.to_owned(), rest);
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
                self.runnable.push_back((*h.ready, directive));
            }
        }
        Expired {
            order_key: order_key.to_owned(),
            first_seq,
            events,
            at_start,
        }
    }
}
