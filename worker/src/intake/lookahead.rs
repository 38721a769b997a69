//! A shard's next delivery, taken from the consumer early when the broker has
//! already sent it, so that its dedup claim can ride along with the current
//! event's commit: one Redis round trip per event instead of two.
//!
//! It also finds the breaker's evidence attempts for a serial shard
//! ([`Lookahead::take_other`]): events of other orders, taken from further
//! down the broker window; the deliveries passed over on the way wait here, in
//! delivery order, and the evidence event comes back to the front, unsettled,
//! with the outcome of its attempt (`Ready::tried`).

use std::collections::{HashSet, VecDeque};

use futures_util::{FutureExt as _, StreamExt as _};
use lapin::Consumer;
use lapin::message::Delivery;
use tokio::time::Instant;

use crate::attempt::Processor;
use crate::delivery::{Message, Ready};
use crate::intake::decode;
use crate::intake::gate::Holdable;
use crate::settle::Upcoming;
use crate::store::RedisSlot;

impl Holdable for Ready {
    fn held_since(&self) -> Option<Instant> {
        self.held_since
    }

    fn set_held_since(&mut self, at: Instant) {
        self.held_since = Some(at);
    }
}

/// A new delivery, decoded (`decode`).
fn ready(delivery: Delivery, processor: &Processor) -> Ready {
    let decoded = decode(&Message::of(&delivery), processor.max_body_bytes());
    Ready {
        delivery,
        decoded,
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

/// The shard's consumer with the deliveries taken ahead: one, or while the
/// breaker looks for evidence, those passed over.
pub(crate) struct Lookahead {
    consumer: Consumer,
    parked: VecDeque<Peeked>,
}

impl Lookahead {
    pub(crate) fn new(consumer: Consumer) -> Self {
        Self {
            consumer,
            parked: VecDeque::new(),
        }
    }

    /// The next delivery: the one taken ahead, else the broker's next.
    /// `Ok(None)` when the broker cancelled the consumer.
    pub(crate) async fn next(
        &mut self,
        processor: &Processor,
    ) -> Result<Option<Ready>, lapin::Error> {
        let peeked = match self.parked.pop_front() {
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
    pub(crate) fn peek(&mut self, processor: &Processor) -> Option<&mut Ready> {
        if self.parked.is_empty()
            && let Some(next) = self.consumer.next().now_or_never()
        {
            self.parked.push_back(Self::wrap(next, processor));
        }
        match self.parked.front_mut() {
            Some(Peeked::Ready(ready)) => Some(ready),
            _ => None,
        }
    }

    /// Up to `max` deliveries from the front that the broker has already
    /// sent, while each `fits`; never waits. The first that does not fit
    /// stays here.
    pub(crate) fn take_while(
        &mut self,
        max: usize,
        processor: &Processor,
        fits: impl Fn(&Ready) -> bool,
    ) -> Vec<Ready> {
        let mut taken = Vec::new();
        while taken.len() < max && self.peek(processor).is_some_and(|ready| fits(ready)) {
            if let Some(Peeked::Ready(ready)) = self.parked.pop_front() {
                taken.push(ready);
            }
        }
        taken
    }

    /// Puts deliveries taken from the front back, in their order.
    pub(crate) fn unpark(&mut self, deliveries: Vec<Ready>) {
        for ready in deliveries.into_iter().rev() {
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
            self.parked.push_back(Self::wrap(next, processor));
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
        match self.parked.remove(found?) {
            Some(Peeked::Ready(ready)) => Some(ready),
            _ => None,
        }
    }

    /// Waits for the broker's next delivery and keeps it here (cancel-safe).
    /// Never returns once the consumer ended.
    pub(crate) async fn arrival(&mut self, processor: &Processor) {
        if matches!(self.parked.back(), Some(Peeked::End(_))) {
            return std::future::pending().await;
        }
        let next = self.consumer.next().await;
        self.parked.push_back(Self::wrap(next, processor));
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
    pub(crate) async fn release(&mut self, processor: &Processor, redis: &mut RedisSlot) {
        for peeked in std::mem::take(&mut self.parked) {
            if let Peeked::Ready(ready) = peeked
                && let Some(claim) = ready.held_claim()
            {
                processor.dedup().release(redis, &claim).await;
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

impl Upcoming for Lookahead {
    fn peek(&mut self, processor: &Processor) -> Option<&mut Ready> {
        Lookahead::peek(self, processor)
    }

    fn forget_admission(&mut self) {
        Lookahead::forget_admission(self);
    }

    fn take_other(&mut self, order_key: &str, processor: &Processor) -> Option<Ready> {
        Lookahead::take_other(self, order_key, processor)
    }

    async fn arrival(&mut self, processor: &Processor) {
        Lookahead::arrival(self, processor).await;
    }

    fn unpark(&mut self, deliveries: Vec<Ready>) {
        Lookahead::unpark(self, deliveries);
    }
}
