//! A shard's next delivery, taken from the consumer early when the broker has
//! already sent it, so that its dedup claim can ride along with the current
//! event's commit: one Redis round trip per event instead of two.

use futures_util::{FutureExt as _, StreamExt as _};
use lapin::Consumer;
use lapin::message::Delivery;
use tokio::time::Instant;

use crate::dedup::Verdict;
use crate::gate::Holdable;
use crate::process::{Decoded, Message, Outcome, Processor};
use crate::store::RedisSlot;

/// A delivery with what is known about it before processing starts.
pub(crate) struct Ready {
    pub(crate) delivery: Delivery,
    /// The envelope, or the dead-letter outcome of a body that is not one.
    pub(crate) decoded: Result<Decoded, Outcome>,
    /// Its first admit verdict, when asked for together with the previous commit.
    pub(crate) admitted: Option<Verdict>,
    /// When the sequence gate first held it.
    held_since: Option<Instant>,
}

impl Holdable for Ready {
    fn held_since(&self) -> Option<Instant> {
        self.held_since
    }

    fn set_held_since(&mut self, at: Instant) {
        self.held_since = Some(at);
    }
}

impl Ready {
    fn new(delivery: Delivery, processor: &Processor) -> Self {
        let decoded = processor.decode(&Message::of(&delivery));
        Self {
            delivery,
            decoded,
            admitted: None,
            held_since: None,
        }
    }

    /// The dedup key when this delivery holds a claim.
    fn held_key(&self) -> Option<&str> {
        match (&self.decoded, &self.admitted) {
            (Ok(decoded), Some(Verdict::Claimed | Verdict::TakenOver)) => Some(&decoded.dedup_key),
            _ => None,
        }
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

/// The shard's consumer with at most one delivery taken ahead.
pub(crate) struct Lookahead {
    consumer: Consumer,
    peeked: Option<Peeked>,
}

impl Lookahead {
    pub(crate) fn new(consumer: Consumer) -> Self {
        Self {
            consumer,
            peeked: None,
        }
    }

    /// The next delivery: the one taken ahead, else the broker's next.
    /// `Ok(None)` when the broker cancelled the consumer.
    pub(crate) async fn next(
        &mut self,
        processor: &Processor,
    ) -> Result<Option<Ready>, lapin::Error> {
        let peeked = match self.peeked.take() {
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
        if self.peeked.is_none()
            && let Some(next) = self.consumer.next().now_or_never()
        {
            self.peeked = Some(Self::wrap(next, processor));
        }
        match &mut self.peeked {
            Some(Peeked::Ready(ready)) => Some(ready),
            _ => None,
        }
    }

    /// Forgets the verdict asked for early (its claim stays; asking again
    /// recognises it): a dead letter made since may have quarantined its order.
    pub(crate) fn forget_admission(&mut self) {
        if let Some(Peeked::Ready(ready)) = &mut self.peeked {
            ready.admitted = None;
        }
    }

    /// Gives up a claim made early for a delivery that will not be processed
    /// here (the worker is stopping; the broker redelivers it).
    pub(crate) async fn release(&mut self, processor: &Processor, redis: &mut RedisSlot) {
        if let Some(Peeked::Ready(ready)) = &self.peeked
            && let Some(key) = ready.held_key()
        {
            processor.dedup().release(redis, key).await;
        }
        self.peeked = None;
    }

    fn wrap(next: Option<Result<Delivery, lapin::Error>>, processor: &Processor) -> Peeked {
        match next {
            Some(Ok(delivery)) => Peeked::Ready(Ready::new(delivery, processor)),
            Some(Err(e)) => Peeked::End(Some(e)),
            None => Peeked::End(None),
        }
    }
}
