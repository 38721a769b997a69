//! A shard's next delivery, taken from the consumer early when the broker has
//! already sent it, so that its dedup claim can ride along with the current
//! event's commit: one Redis round trip per event instead of two.
//!
//! It also finds the breaker's evidence attempts for a serial shard
//! ([`Lookahead::take_other`]): events of other orders, taken from further
//! down the broker window; the deliveries passed over on the way wait here, in
//! delivery order, and the evidence event comes back to the front, unsettled,
//! with the outcome of its attempt (`Ready::tried`).
//!
//! The deliveries kept here count in the shard's decoded bytes
//! (`intake::bytes`): at `--max-held-bytes` a peek takes nothing new. The
//! evidence search alone reads on past the bound (up to the broker window):
//! a breaker left without evidence would dead-letter an event as poison.

use std::collections::{HashSet, VecDeque};

use futures_util::{FutureExt as _, Stream, StreamExt as _};
use lapin::Consumer;
use lapin::message::Delivery;
use tokio::time::Instant;

use crate::attempt::Processor;
use crate::dedup::OrderState;
use crate::delivery::{Message, Ready};
use crate::intake::bytes::HeldBytes;
use crate::intake::gate::Holdable;
use crate::intake::{control, decode};
use crate::settle::Upcoming;

impl Holdable for Ready {
    fn held_since(&self) -> Option<Instant> {
        self.held_since
    }

    fn set_held_since(&mut self, at: Instant) {
        self.held_since = Some(at);
    }

    fn size(&self) -> usize {
        self.delivery.data.len()
    }
}

/// A new delivery, decoded (`decode`), as intake hands it on. A forwarded
/// copy of a redelivery counts as one (`headers::REDELIVERED`).
pub(crate) fn ready(mut delivery: Delivery, processor: &Processor) -> Ready {
    if shardline_contract::headers::header(
        &delivery.properties,
        shardline_contract::headers::REDELIVERED,
    )
    .is_some()
    {
        delivery.redelivered = true;
    }
    let decoded = decode(&Message::of(&delivery), processor.max_body_bytes());
    let marker = control::recognise(&delivery.properties)
        .and_then(|message| control::marker(&message, &delivery.properties));
    Ready {
        delivery,
        decoded,
        marker,
        admitted: None,
        held_since: None,
        tried: None,
    }
}

/// What the consumer yielded when polled.
#[expect(
    clippy::large_enum_variant,
    reason = "one per shard; boxing would allocate per event"
)]
enum Peeked {
    Ready(Ready),
    /// The consumer ended (`None`) or failed.
    End(Option<lapin::Error>),
}

impl Peeked {
    /// The bytes it counts in the shard's decoded bytes.
    fn size(&self) -> usize {
        match self {
            Peeked::Ready(ready) => ready.delivery.data.len(),
            Peeked::End(_) => 0,
        }
    }
}

/// Where a shard's deliveries come from: its broker consumer, or in unit
/// tests a stream of mock deliveries.
pub(crate) trait Deliveries: Stream<Item = Result<Delivery, lapin::Error>> + Unpin {}

impl<T: Stream<Item = Result<Delivery, lapin::Error>> + Unpin> Deliveries for T {}

/// The shard's consumer with the deliveries taken ahead: one, or while the
/// breaker looks for evidence, those passed over.
pub(crate) struct Lookahead<S = Consumer> {
    consumer: S,
    parked: VecDeque<Peeked>,
    /// The shard's decoded bytes, which `parked` counts in.
    bytes: HeldBytes,
}

impl<S: Deliveries> Lookahead<S> {
    /// Reads ahead whatever the bytes held (unit tests).
    #[cfg(test)]
    pub(crate) fn new(consumer: S) -> Self {
        Self::counting(consumer, HeldBytes::unbounded())
    }

    /// Counts what it keeps in the shard's `bytes`, and reads ahead only
    /// below their bound.
    pub(crate) fn counting(consumer: S, bytes: HeldBytes) -> Self {
        Self {
            consumer,
            parked: VecDeque::new(),
            bytes,
        }
    }

    /// Whether a delivery taken ahead is kept here: the next one needs no
    /// new delivery from the broker.
    pub(crate) fn has_parked(&self) -> bool {
        !self.parked.is_empty()
    }

    fn park_back(&mut self, peeked: Peeked) {
        self.bytes.add(peeked.size());
        self.parked.push_back(peeked);
    }

    fn unpark_front(&mut self) -> Option<Peeked> {
        let peeked = self.parked.pop_front()?;
        self.bytes.sub(peeked.size());
        Some(peeked)
    }

    /// The next delivery: the one taken ahead, else the broker's next.
    /// `Ok(None)` when the broker cancelled the consumer.
    pub(crate) async fn next(
        &mut self,
        processor: &Processor,
    ) -> Result<Option<Ready>, lapin::Error> {
        let peeked = match self.unpark_front() {
            Some(peeked) => peeked,
            None => Self::wrap(self.consumer.next().await, processor),
        };
        match peeked {
            Peeked::Ready(ready) => Ok(Some(ready)),
            Peeked::End(None) => Ok(None),
            Peeked::End(Some(e)) => Err(e),
        }
    }

    /// The next delivery if the broker has already sent it; never waits.
    /// At `--max-held-bytes` it takes none from the broker.
    pub(crate) fn peek(&mut self, processor: &Processor) -> Option<&mut Ready> {
        if self.parked.is_empty()
            && self.bytes.has_room()
            && let Some(next) = self.consumer.next().now_or_never()
        {
            self.park_back(Self::wrap(next, processor));
        }
        match self.parked.front_mut() {
            Some(Peeked::Ready(ready)) => Some(ready),
            _ => None,
        }
    }

    /// Up to `max` deliveries from the front that the broker has already
    /// sent, while each `fits`; never waits. The first that does not fit
    /// stays here. What it takes counts against `--max-held-bytes` until it
    /// returns: it takes nothing new from the broker past the bound.
    pub(crate) fn take_while(
        &mut self,
        max: usize,
        processor: &Processor,
        fits: impl Fn(&Ready) -> bool,
    ) -> Vec<Ready> {
        let mut taken = Vec::new();
        let mut taken_bytes = 0;
        while taken.len() < max
            && (self.has_parked() || self.bytes.has_room_with(taken_bytes))
            && self.peek(processor).is_some_and(|ready| fits(ready))
        {
            if let Some(Peeked::Ready(ready)) = self.unpark_front() {
                taken_bytes += ready.delivery.data.len();
                taken.push(ready);
            }
        }
        taken
    }

    /// Puts deliveries taken from the front back, in their order.
    pub(crate) fn unpark(&mut self, deliveries: Vec<Ready>) {
        for ready in deliveries.into_iter().rev() {
            self.bytes.add(ready.delivery.data.len());
            self.parked.push_front(Peeked::Ready(ready));
        }
    }

    /// Whether a delivery kept here came before `tag` (it is unacked).
    pub(crate) fn keeps_below(&self, tag: u64) -> bool {
        self.parked
            .iter()
            .any(|p| matches!(p, Peeked::Ready(r) if r.delivery.delivery_tag < tag))
    }

    /// The evidence attempt's event: the first delivery here of an order
    /// other than `order_key` (and than those of the deliveries passed over
    /// that it may not overtake), never a redelivered one (it may be a
    /// killer) nor one an evidence attempt already tried (`Ready::tried`). Reads what the broker has sent without waiting; `None` when
    /// nothing fits yet ([`Lookahead::arrival`] waits for more).
    pub(crate) fn take_other(&mut self, order_key: &str, processor: &Processor) -> Option<Ready> {
        while !matches!(self.parked.back(), Some(Peeked::End(_)))
            && let Some(next) = self.consumer.next().now_or_never()
        {
            self.park_back(Self::wrap(next, processor));
        }
        let mut passed: HashSet<&str> = HashSet::from([order_key]);
        let mut found = None;
        for (i, peeked) in self.parked.iter().enumerate() {
            let Peeked::Ready(ready) = peeked else { break };
            let Ok(decoded) = &ready.decoded else {
                continue;
            };
            let order = decoded.order_key.as_str();
            if !ready.delivery.redelivered && ready.tried.is_none() && !passed.contains(order) {
                found = Some(i);
                break;
            }
            passed.insert(order);
        }
        let found = self.parked.remove(found?)?;
        self.bytes.sub(found.size());
        match found {
            Peeked::Ready(ready) => Some(ready),
            Peeked::End(_) => None,
        }
    }

    /// Waits for the broker's next delivery and keeps it here (cancel-safe).
    /// Never returns once the consumer ended.
    pub(crate) async fn arrival(&mut self, processor: &Processor) {
        if matches!(self.parked.back(), Some(Peeked::End(_))) {
            return std::future::pending().await;
        }
        let next = self.consumer.next().await;
        self.park_back(Self::wrap(next, processor));
    }

    /// Forgets the verdict asked for early (its claim stays; asking again
    /// recognises it): a dead letter made since may have quarantined its order.
    pub(crate) fn forget_admission(&mut self) {
        if let Some(Peeked::Ready(ready)) = self.parked.front_mut() {
            ready.admitted = None;
        }
    }

    /// Gives up a claim made early for a delivery that will not be processed
    /// here (the worker is stopping; the broker redelivers it).
    pub(crate) async fn release<O: OrderState>(&mut self, store: &mut O) {
        for peeked in std::mem::take(&mut self.parked) {
            self.bytes.sub(peeked.size());
            if let Peeked::Ready(ready) = peeked
                && let Some(claim) = ready.held_claim()
            {
                store.release(&claim).await;
            }
        }
    }

    fn wrap(next: Option<Result<Delivery, lapin::Error>>, processor: &Processor) -> Peeked {
        match next {
            Some(Ok(delivery)) => Peeked::Ready(ready(delivery, processor)),
            Some(Err(e)) => Peeked::End(Some(e)),
            None => Peeked::End(None),
        }
    }
}

impl<S: Deliveries> Upcoming for Lookahead<S> {
    fn peek(&mut self, processor: &Processor) -> Option<&mut Ready> {
        Lookahead::<S>::peek(self, processor)
    }

    fn forget_admission(&mut self) {
        Lookahead::<S>::forget_admission(self);
    }

    fn take_other(&mut self, order_key: &str, processor: &Processor) -> Option<Ready> {
        Lookahead::<S>::take_other(self, order_key, processor)
    }

    async fn arrival(&mut self, processor: &Processor) {
        Lookahead::<S>::arrival(self, processor).await;
    }

    fn unpark(&mut self, deliveries: Vec<Ready>) {
        Lookahead::<S>::unpark(self, deliveries);
    }
}

#[cfg(test)]
mod tests {
    use futures_util::stream;

    use super::*;
    use crate::attempt::test_processor;
    use crate::delivery::{Outcome, Tried};

    /// A first (or, `redelivered`, a repeated) delivery of `order`'s `seq`.
    fn event(tag: u64, order: &str, seq: u64, redelivered: bool) -> Result<Delivery, lapin::Error> {
        let body = format!(r#"{{"order_id":"{order}","event":"order.paid","seq":{seq}}}"#);
        Ok(Delivery::mock(
            tag,
            "order.sharding".into(),
            "shard.3".into(),
            redelivered,
            body.into_bytes(),
        ))
    }

    /// A broker that has sent `sent` and nothing more yet (it never ends).
    fn sent(sent: Vec<Result<Delivery, lapin::Error>>) -> Lookahead<impl Deliveries> {
        Lookahead::new(stream::iter(sent).chain(stream::pending()))
    }

    fn order_of(ready: &Ready) -> &str {
        ready.decoded.as_ref().map_or("", |d| &d.envelope.order_id)
    }

    async fn tags(lookahead: &mut Lookahead<impl Deliveries>, n: usize) -> Vec<u64> {
        let processor = test_processor();
        let mut tags = Vec::new();
        for _ in 0..n {
            let ready = lookahead.next(&processor).await.unwrap().unwrap();
            tags.push(ready.delivery.delivery_tag);
        }
        tags
    }

    #[tokio::test]
    async fn the_evidence_is_the_first_first_delivery_of_an_order_not_passed_over() {
        let processor = test_processor();
        let mut lookahead = sent(vec![
            event(2, "A", 2, false),
            event(3, "B", 1, true),
            event(4, "B", 2, false),
            event(5, "C", 1, false),
        ]);
        let other = lookahead.take_other("A", &processor).unwrap();
        assert_eq!(
            other.delivery.delivery_tag, 5,
            "B's second may not overtake its redelivered first"
        );
        assert_eq!(order_of(&other), "C");
        assert!(lookahead.keeps_below(5));
        assert!(!lookahead.keeps_below(2));
        assert_eq!(
            tags(&mut lookahead, 3).await,
            [2, 3, 4],
            "the passed over stay in delivery order"
        );
    }

    #[tokio::test]
    async fn nothing_fits_when_only_the_waiting_order_and_undecodable_bodies_are_here() {
        let processor = test_processor();
        let not_an_envelope = Ok(Delivery::mock(
            3,
            "".into(),
            "".into(),
            false,
            b"[1]".to_vec(),
        ));
        let mut lookahead = sent(vec![event(2, "A", 2, false), not_an_envelope]);
        assert!(lookahead.take_other("A", &processor).is_none());
        assert_eq!(tags(&mut lookahead, 2).await, [2, 3]);
        assert!(
            lookahead.peek(&processor).is_none(),
            "peek never waits for the broker"
        );
    }

    #[tokio::test]
    async fn an_event_tried_as_evidence_comes_back_first_and_is_not_tried_again() {
        let processor = test_processor();
        let mut lookahead = sent(vec![event(2, "B", 1, false), event(3, "C", 1, false)]);
        let mut other = lookahead.take_other("A", &processor).unwrap();
        assert_eq!(other.delivery.delivery_tag, 2);
        let msg = Message::of(&other.delivery);
        let trace = processor.start_trace(&msg, other.decoded.as_ref().ok());
        other.tried = Some(Box::new(Tried {
            outcome: Outcome::Processed,
            trace,
        }));
        lookahead.unpark(vec![other]);
        let next = lookahead.take_other("A", &processor).unwrap();
        assert_eq!(
            next.delivery.delivery_tag, 3,
            "a tried event is not evidence twice"
        );
        let front = lookahead.peek(&processor).unwrap();
        assert_eq!(front.delivery.delivery_tag, 2);
        assert!(front.tried.is_some(), "it keeps the outcome of its attempt");
    }

    #[tokio::test]
    async fn take_while_stops_at_the_first_that_does_not_fit_and_keeps_it() {
        let processor = test_processor();
        let mut lookahead = sent(vec![
            event(1, "A", 1, false),
            event(2, "B", 1, false),
            event(3, "C", 1, true),
            event(4, "D", 1, false),
        ]);
        let taken = lookahead.take_while(10, &processor, |r| !r.delivery.redelivered);
        let taken: Vec<u64> = taken.iter().map(|r| r.delivery.delivery_tag).collect();
        assert_eq!(taken, [1, 2]);
        assert_eq!(tags(&mut lookahead, 2).await, [3, 4]);
    }

    #[tokio::test]
    async fn the_consumers_end_is_kept_after_what_was_read_ahead() {
        let processor = test_processor();
        let mut lookahead = Lookahead::new(stream::iter(vec![event(1, "A", 1, false)]));
        assert!(
            lookahead
                .take_other("B", &processor)
                .is_some_and(|r| order_of(&r) == "A")
        );
        assert!(lookahead.take_other("B", &processor).is_none());
        assert!(
            lookahead.next(&processor).await.unwrap().is_none(),
            "cancelled by the broker"
        );
    }

    #[tokio::test]
    async fn at_the_byte_bound_a_peek_takes_nothing_new_and_what_it_keeps_counts() {
        let processor = test_processor();
        let bytes = HeldBytes::new(1);
        let broker = stream::iter(vec![event(1, "A", 1, false), event(2, "A", 2, false)]);
        let mut lookahead = Lookahead::counting(broker.chain(stream::pending()), bytes.clone());
        let size = lookahead.peek(&processor).map(|r| r.delivery.data.len());
        assert!(size.is_some(), "holding nothing: room for one of any size");
        assert_eq!(Some(bytes.get()), size, "kept ahead, counted");
        assert_eq!(tags(&mut lookahead, 1).await, [1]);
        assert_eq!(bytes.get(), 0, "taken to run: no longer counted");
        bytes.add(1);
        assert!(lookahead.peek(&processor).is_none(), "at the bound");
        bytes.sub(1);
        let next = lookahead.peek(&processor).map(|r| r.delivery.delivery_tag);
        assert_eq!(next, Some(2));
    }
}
