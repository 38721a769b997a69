//! Intake, the first stage: deliveries to events ready for an attempt.
//! It decodes (control messages first, never as events), holds events ahead
//! of their order's sequence (`gate`), reads ahead so that a claim rides
//! with the last commit (`lookahead`), forms groups (`group`) and, with
//! `--concurrency`, schedules which event starts next (`schedule`).
//!
//! Stages call forward only: intake → attempt → settle.

pub(crate) mod bytes;
pub(crate) mod control;
pub(crate) mod gate;
pub(crate) mod group;
pub(crate) mod lookahead;
pub(crate) mod schedule;

use shardline_contract::headers::{self, FailReason};
use shardline_contract::{Envelope, EnvelopeError, Keys, replay};

use crate::delivery::{Decoded, Message, Outcome, ReplayMarker};

/// Parses the envelope; a body that is not one is dead-lettered at once.
/// A control message is recognised first, by its header, and never
/// decoded as an event (`intake::control`).
pub(crate) fn decode(msg: &Message<'_>, max_body_bytes: usize) -> Result<Decoded, Outcome> {
    if let Some(message) = control::recognise(msg.properties) {
        let control::Verdict::DeadLetter { reason, error } =
            match control::marker(&message, msg.properties) {
                // Honoured by the shard's loop before it reaches an attempt
                // (`crate::reshard`); one that gets here was not.
                Some(marker) => control::Verdict::DeadLetter {
                    reason: FailReason::Control,
                    error: format!(
                        "marker {} of move {} is not in the reshard's record: it releases nothing",
                        marker.id.0, marker.move_id.0
                    ),
                },
                None => control::handle(&message),
            };
        return Err(Outcome::DeadLetter {
            reason,
            error,
            attempts: 0,
        });
    }
    let envelope = Envelope::parse(msg.body, max_body_bytes).map_err(|e| {
        let reason = match e {
            EnvelopeError::Decode(_) => FailReason::Decode,
            EnvelopeError::Invalid(_) => FailReason::Invalid,
        };
        Outcome::DeadLetter {
            reason,
            error: e.to_string(),
            attempts: 0,
        }
    })?;
    let replay = headers::header(msg.properties, headers::REPLAY).map(|_| {
        ReplayMarker::new(
            headers::header_str(msg.properties, headers::REPLAY),
            replay::record(&envelope, msg.body),
        )
    });
    Ok(Decoded {
        dedup_key: envelope.dedup_key(msg.body),
        order_key: envelope.order_key(),
        kind_code: Keys::kind_code(&envelope.event),
        envelope,
        published_at_ms: headers::header_i64(msg.properties, headers::PUBLISHED_AT_MS),
        replay,
        delivery_count: headers::header_i64(msg.properties, headers::DELIVERY_COUNT),
        token: rand::random(),
    })
}
