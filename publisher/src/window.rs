//! The unconfirmed events, in publish order: the in-flight window
//! (backpressure) and what is re-sent, in order, after a connection loss.
//!
//! Invariant: the events sent on the current channel form a prefix; everything
//! after the first unsent event is unsent too. So re-sending "from the first
//! unsent" always keeps each order's events in their publish order.

use std::collections::VecDeque;
use std::time::Instant;

use lapin::BasicProperties;
use lapin::types::ShortString;
use opentelemetry::Context;
use opentelemetry::trace::TraceContextExt as _;
use shardline_contract::{OrderId, telemetry};

/// An event as it goes on the wire, kept until the broker confirms it.
#[derive(Debug, Clone)]
pub(crate) struct Outgoing {
    pub routing_key: ShortString,
    /// The order it routes by (an event; `None`: sent to a given shard).
    pub order: Option<OrderId>,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
    /// The event's publish span while it records (a tracer provider is
    /// installed); it ends when the broker settles the event.
    pub trace: Option<Context>,
}

#[derive(Debug)]
pub(crate) struct Entry<C> {
    pub event: Outgoing,
    /// First send, for the confirm latency (a re-send keeps it: the caller
    /// waited all along).
    pub first_sent: Option<Instant>,
    /// The confirm on the current channel; `None` while not sent on it.
    pub confirm: Option<C>,
}

/// Unconfirmed events, generic over the confirm handle so the accounting is
/// testable without a broker.
#[derive(Debug)]
pub(crate) struct Unconfirmed<C> {
    entries: VecDeque<Entry<C>>,
    window: usize,
}

impl<C> Unconfirmed<C> {
    pub(crate) fn new(window: usize) -> Self {
        let window = window.max(1);
        Self {
            entries: VecDeque::with_capacity(window.min(4096)),
            window,
        }
    }

    /// Whether a new event must wait for the oldest confirm first.
    pub(crate) fn is_full(&self) -> bool {
        self.entries.len() >= self.window
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Appends an event, not yet sent.
    pub(crate) fn push(&mut self, event: Outgoing) {
        self.entries.push_back(Entry {
            event,
            first_sent: None,
            confirm: None,
        });
    }

    /// Index of the first event not sent on the current channel.
    pub(crate) fn first_unsent(&self) -> usize {
        self.entries.partition_point(|e| e.confirm.is_some())
    }

    /// The first unsent event, if any, to send next.
    pub(crate) fn next_unsent(&self) -> Option<&Outgoing> {
        self.entries.get(self.first_unsent()).map(|e| &e.event)
    }

    /// Records that the first unsent event went out with `confirm`.
    pub(crate) fn mark_sent(&mut self, confirm: C, now: Instant) {
        let i = self.first_unsent();
        if let Some(entry) = self.entries.get_mut(i) {
            entry.first_sent.get_or_insert(now);
            entry.confirm = Some(confirm);
        }
    }

    /// The oldest event and its confirm, when it was sent on the current channel.
    pub(crate) fn oldest_confirm(&mut self) -> Option<&mut C> {
        self.entries.front_mut()?.confirm.as_mut()
    }

    /// Removes the oldest event once its confirm has resolved.
    pub(crate) fn pop_oldest(&mut self) -> Option<Entry<C>> {
        self.entries.pop_front()
    }

    /// Copies of every event (unconfirmed or confirmed but not yet
    /// settled), to send again should a lease lapse while they settle.
    pub(crate) fn copies(&self) -> Vec<Outgoing> {
        self.entries.iter().map(|e| e.event.clone()).collect()
    }

    /// Routes the events of orders again (a new map acknowledged): those not
    /// sent on the current channel, or with `all` (the channel is being
    /// given up, so everything will be sent again) every one.
    pub(crate) fn reroute(&mut self, all: bool, key: impl Fn(&OrderId) -> Option<ShortString>) {
        for entry in self
            .entries
            .iter_mut()
            .filter(|e| all || e.confirm.is_none())
        {
            if let Some(order) = &entry.event.order
                && let Some(routing_key) = key(order)
            {
                entry.event.routing_key = routing_key;
            }
        }
    }

    /// The channel is gone: every event is unsent again, in its original order.
    /// Returns how many of them had been sent before (and will be re-sent).
    pub(crate) fn forget_confirms(&mut self) -> usize {
        let mut resend = 0;
        for entry in &mut self.entries {
            if entry.first_sent.is_some() {
                resend += 1;
                if let Some(cx) = &entry.event.trace {
                    cx.span().add_event(telemetry::event::RESENT, Vec::new());
                }
            }
            entry.confirm = None;
        }
        resend
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(key: &str) -> Outgoing {
        Outgoing {
            routing_key: key.into(),
            order: None,
            body: key.as_bytes().to_vec(),
            properties: BasicProperties::default(),
            trace: None,
        }
    }

    fn keys(q: &Unconfirmed<u32>) -> Vec<String> {
        q.entries
            .iter()
            .map(|e| e.event.routing_key.to_string())
            .collect()
    }

    #[test]
    fn window_fills_at_its_bound_and_zero_means_one() {
        let mut q = Unconfirmed::<u32>::new(2);
        assert!(!q.is_full());
        q.push(event("a"));
        assert!(!q.is_full());
        q.push(event("b"));
        assert!(q.is_full());
        q.pop_oldest();
        assert!(!q.is_full());

        let mut one = Unconfirmed::<u32>::new(0);
        one.push(event("a"));
        assert!(one.is_full());
    }

    #[test]
    fn sends_in_order_and_settles_oldest_first() {
        let now = Instant::now();
        let mut q = Unconfirmed::new(8);
        for k in ["a", "b", "c"] {
            q.push(event(k));
        }
        assert_eq!(q.first_unsent(), 0);
        assert!(q.oldest_confirm().is_none(), "nothing sent yet");
        q.mark_sent(1, now);
        q.mark_sent(2, now);
        assert_eq!(q.first_unsent(), 2);
        assert_eq!(q.next_unsent().map(|e| e.routing_key.as_str()), Some("c"));
        assert_eq!(q.oldest_confirm().copied(), Some(1));
        let oldest = q.pop_oldest().unwrap();
        assert_eq!(oldest.event.routing_key.as_str(), "a");
        assert_eq!(oldest.first_sent, Some(now));
        assert_eq!(q.first_unsent(), 1);
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn a_new_route_applies_to_unsent_events_of_orders_only() {
        let mut q = Unconfirmed::new(8);
        let of = |key: &str, order: &str| Outgoing {
            order: Some(OrderId::new(order).unwrap()),
            ..event(key)
        };
        q.push(of("shard.1", "A"));
        q.push(of("shard.1", "B"));
        q.push(event("shard.2"));
        q.mark_sent(1, Instant::now());
        let rerouted = |o: &OrderId| Some(format!("move.1.1-4.{o}").into());
        q.reroute(false, rerouted);
        assert_eq!(keys(&q), ["shard.1", "move.1.1-4.B", "shard.2"]);
        // With the channel given up (a lapsed lease), every event of an
        // order goes by the new route.
        q.reroute(true, rerouted);
        assert_eq!(keys(&q), ["move.1.1-4.A", "move.1.1-4.B", "shard.2"]);
        assert_eq!(q.copies().len(), 3);
    }

    #[test]
    fn a_lost_channel_resends_everything_in_original_order() {
        let t0 = Instant::now();
        let mut q = Unconfirmed::new(8);
        for k in ["a", "b", "c", "d"] {
            q.push(event(k));
        }
        q.mark_sent(1, t0);
        q.mark_sent(2, t0);
        q.mark_sent(3, t0);
        q.pop_oldest();
        // b and c were sent on the lost channel, d never was.
        assert_eq!(q.forget_confirms(), 2);
        assert_eq!(q.first_unsent(), 0);
        assert_eq!(keys(&q), ["b", "c", "d"]);
        let later = t0 + std::time::Duration::from_millis(5);
        q.mark_sent(10, later);
        let b = q.pop_oldest().unwrap();
        assert_eq!(b.first_sent, Some(t0), "latency counts from the first send");
        assert_eq!(b.confirm, Some(10));
        assert!(!q.is_empty());
    }
}
