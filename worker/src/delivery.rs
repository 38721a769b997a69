//! A delivery as it flows through the stages (intake → attempt → settle):
//! what the broker sent ([`Message`]), what intake made of it ([`Decoded`],
//! [`Directive`], [`Ready`]) and what an attempt made of it ([`Outcome`]).
//! Types only: every stage reads them, none of them calls a stage.

use std::sync::OnceLock;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::message::Delivery;
use shardline_contract::headers::FailReason;
use shardline_contract::reshard::{MarkerId, MarkerKind, MoveId};
use shardline_contract::{Envelope, OrderKey};
use tokio::time::Instant;

use crate::dedup::{Admission, Claim, Verdict};
use crate::handler::HandlerError;
use crate::trace::ProcessTrace;

/// A delivery as processing sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Message<'a> {
    pub(crate) body: &'a [u8],
    pub(crate) properties: &'a BasicProperties,
    /// The exchange it was published to.
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    pub(crate) redelivered: bool,
}

impl<'a> Message<'a> {
    pub(crate) fn of(delivery: &'a lapin::message::Delivery) -> Self {
        Self {
            body: &delivery.data,
            properties: &delivery.properties,
            exchange: delivery.exchange.as_str(),
            routing_key: delivery.routing_key.as_str(),
            redelivered: delivery.redelivered,
        }
    }
}

/// What to do with a delivery.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Outcome {
    /// The handler succeeded: commit (dedup and gate), then ack.
    Processed,
    /// Processed before: ack without calling the handler.
    Duplicate,
    /// The attempt failed but may succeed (the claim is kept, and so the
    /// order's place): `settle` decides, with the event's retry budget, whether
    /// and when it is tried again.
    Failed { error: HandlerError },
    /// A live claim of another consumer: look again after this long.
    Wait(Duration),
    /// Ahead of its order's sequence: hold it unacked. `start` when the order
    /// has no state yet (the start grace applies, not the gap grace).
    Hold { start: bool },
    /// A newer consumer of the shard wrote the event's order: this consumer
    /// lost the shard. Leave the event unacked and stop consuming.
    Fenced,
    /// Cannot succeed: publish to the dead-letter exchange, then ack.
    DeadLetter {
        reason: FailReason,
        error: String,
        /// Handler attempts made.
        attempts: u32,
    },
}

/// How a delivery is to be processed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Directive {
    /// Through the gate, like any delivery.
    Normal,
    /// Past the gate: an accepted start, an applied gap, a replay.
    Bypass,
    /// Straight to the dead-letter exchange.
    DeadLetter(FailReason, String),
}

/// What survives between attempts at one delivery.
#[derive(Debug, Clone)]
pub(crate) struct Decoded {
    pub(crate) envelope: Envelope,
    pub(crate) dedup_key: String,
    pub(crate) order_key: OrderKey,
    /// Its kind's code in the order state (`Keys::kind_code`), computed once.
    pub(crate) kind_code: String,
    pub(crate) published_at_ms: Option<i64>,
    /// Its replay marker, if it carries one; honoured only once its replay
    /// record is found to match ([`Decoded::replay_of`]).
    pub(crate) replay: Option<ReplayMarker>,
    /// Quorum queues: deliveries so far (`x-delivery-count`).
    pub(crate) delivery_count: Option<i64>,
    pub(crate) token: u64,
}

impl Decoded {
    /// The admit request for this delivery.
    pub(crate) fn admission(&self, redelivered: bool, bypass_gate: bool) -> Admission<'_> {
        Admission {
            claim: self.claim(),
            kind: &self.kind_code,
            redelivered,
            bypass_gate: bypass_gate || self.replay_of().is_some(),
            replay_of: self.replay_of(),
        }
    }

    /// The dead-letter id it replays, once its marker was checked against
    /// its replay record and honoured: it passes the gate and may lead its
    /// order out of quarantine. `None` for a fresh event and for a marker
    /// the record does not back (it is gated like a fresh event).
    pub(crate) fn replay_of(&self) -> Option<&str> {
        self.replay
            .as_ref()
            .filter(|marker| marker.honoured.get() == Some(&true))
            .map(|marker| marker.id.as_str())
    }

    /// It carries a replay marker not yet checked: it is admitted alone,
    /// after the check, never early with the previous commit.
    pub(crate) fn replay_unchecked(&self) -> bool {
        self.replay.as_ref().is_some_and(ReplayMarker::unchecked)
    }

    /// The claim this delivery makes (or may hold).
    pub(crate) fn claim(&self) -> Claim<'_> {
        Claim {
            dedup_key: &self.dedup_key,
            order_key: &self.order_key,
            seq: self.envelope.seq,
            token: self.token,
        }
    }
}

/// A delivery's `x-shardline-replay` marker: the id of the replay record
/// the replay tool wrote (`shardline_contract::replay`), and what that record
/// must hold for this event.
#[derive(Debug, Clone)]
pub(crate) struct ReplayMarker {
    pub(crate) id: String,
    /// `replay::record` of this delivery's envelope and body.
    pub(crate) record: String,
    /// The check's answer, set once per delivery, before its first admit.
    honoured: OnceLock<bool>,
}

impl ReplayMarker {
    /// A marker to check; one that cannot name a record (empty, not text,
    /// longer than an id) is ignored at once.
    pub(crate) fn new(id: Option<&str>, record: String) -> Self {
        let honoured = OnceLock::new();
        let id = id.unwrap_or_default();
        if id.is_empty() || id.len() > MAX_REPLAY_ID_BYTES {
            let _ = honoured.set(false);
        }
        Self {
            id: id.to_owned(),
            record,
            honoured,
        }
    }

    /// Not checked yet.
    pub(crate) fn unchecked(&self) -> bool {
        self.honoured.get().is_none()
    }

    /// Records the check's answer (the first answer stands).
    pub(crate) fn checked(&self, honoured: bool) {
        let _ = self.honoured.set(honoured);
    }
}

/// The longest replay id a marker may name (dead-letter ids are UUIDs or
/// `x-` and 32 hex digits).
const MAX_REPLAY_ID_BYTES: usize = 128;

/// A delivery with what is known about it before processing starts.
pub(crate) struct Ready {
    pub(crate) delivery: Delivery,
    /// The envelope, or the dead-letter outcome of a body that is not one.
    pub(crate) decoded: Result<Decoded, Outcome>,
    /// Its first admit verdict, when asked for together with the previous commit.
    pub(crate) admitted: Option<Verdict>,
    /// When the sequence gate first held it.
    pub(crate) held_since: Option<Instant>,
    /// A resharding marker (`intake::control::marker`): honoured by the
    /// shard's loop (`crate::reshard`), never attempted.
    pub(crate) marker: Option<Marker>,
    /// Its first call was made already, in a group that it failed in
    /// (`intake::group`) or as the breaker's evidence (`settle`): the serial
    /// path goes on from that outcome.
    pub(crate) tried: Option<Box<Tried>>,
}

/// A resharding marker (`x-shardline-control: drain` or `close`), as its
/// headers name it (`intake::control::marker`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Marker {
    pub(crate) id: MarkerId,
    pub(crate) move_id: MoveId,
    pub(crate) kind: MarkerKind,
}

/// A first call made already: its outcome and its span.
pub(crate) struct Tried {
    pub(crate) outcome: Outcome,
    pub(crate) trace: ProcessTrace,
}

impl Ready {
    /// The claim this delivery holds, if any.
    pub(crate) fn held_claim(&self) -> Option<Claim<'_>> {
        match (&self.decoded, &self.admitted) {
            (Ok(decoded), Some(Verdict::Claimed | Verdict::TakenOver)) => Some(decoded.claim()),
            _ => None,
        }
    }
}
