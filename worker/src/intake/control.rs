//! Control messages: messages on a shard queue that are instructions to the
//! worker rather than events, recognised by their `x-shardline-control`
//! header before any decoding, so that no control message is ever processed
//! as an event.
//!
//! The one kind this worker knows is resharding's marker (`drain` in a
//! move's old shard queue, `close` in its holding queue), with its id and
//! move ([`marker`]); the shard's loop honours it (`crate::reshard`) only
//! when the reshard's record holds its id as pending, so a forged one moves
//! nothing. Every other control message, and a marker without its id or
//! move, is dead-lettered with the reason `control` (and counted in
//! `shardline_dead_letters_total{reason="control"}`), its kind in `x-error`.

use lapin::BasicProperties;
use shardline_contract::headers::{self, FailReason};
use shardline_contract::reshard::{MarkerId, MarkerKind, MoveId};

use crate::delivery::Marker;

/// A control message, as its header names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ControlMessage {
    /// The header's value; `None` when it is not text.
    kind: Option<String>,
}

/// What becomes of a control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Unknown or unverifiable: dead-lettered with this reason and text.
    DeadLetter { reason: FailReason, error: String },
}

/// The control message a delivery is, if it is one (its header is present,
/// whatever its value).
pub(crate) fn recognise(properties: &BasicProperties) -> Option<ControlMessage> {
    headers::header(properties, headers::CONTROL)?;
    let kind = headers::header_str(properties, headers::CONTROL).map(str::to_owned);
    Some(ControlMessage { kind })
}

/// The marker `message` is: its kind is `drain` or `close` and it names its
/// id and move. `None` for any other control message.
pub(crate) fn marker(message: &ControlMessage, properties: &BasicProperties) -> Option<Marker> {
    let kind = match message.kind.as_deref()? {
        headers::CONTROL_DRAIN => MarkerKind::Drain,
        headers::CONTROL_CLOSE => MarkerKind::Close,
        _ => return None,
    };
    let id = headers::header_i64(properties, headers::MARKER_ID)?;
    let move_id = headers::header_i64(properties, headers::MARKER_MOVE)?;
    Some(Marker {
        id: MarkerId(u64::try_from(id).ok()?),
        move_id: MoveId(u16::try_from(move_id).ok()?),
        kind,
    })
}

/// What to do with `message` when it is no marker the loop honours.
pub(crate) fn handle(message: &ControlMessage) -> Verdict {
    let error = match &message.kind {
        Some(kind) => format!(
            "control message `{}` is not known to this worker: never processed as an event",
            kind.escape_debug()
        ),
        None => "control message whose kind is not text: never processed as an event".into(),
    };
    Verdict::DeadLetter {
        reason: FailReason::Control,
        error,
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable, LongString};

    use super::*;

    fn with_control(value: Option<AMQPValue>) -> BasicProperties {
        let mut table = FieldTable::default();
        if let Some(v) = value {
            table.insert(headers::CONTROL.into(), v);
        }
        BasicProperties::default().with_headers(table)
    }

    #[test]
    fn an_event_is_no_control_message() {
        assert_eq!(recognise(&with_control(None)), None);
        assert_eq!(recognise(&BasicProperties::default()), None);
    }

    #[test]
    fn every_control_message_is_dead_lettered_control_naming_its_kind() {
        let marker = AMQPValue::LongString(LongString::from("drain-marker"));
        let message =
            recognise(&with_control(Some(marker))).unwrap_or_else(|| panic!("recognised"));
        let Verdict::DeadLetter { reason, error } = handle(&message);
        assert_eq!(reason, FailReason::Control);
        assert!(error.contains("`drain-marker` is not known"), "{error}");

        let odd = recognise(&with_control(Some(AMQPValue::LongInt(7))))
            .unwrap_or_else(|| panic!("a header of any type marks a control message"));
        let Verdict::DeadLetter { error, .. } = handle(&odd);
        assert!(error.contains("not text"), "{error}");

        let hostile = AMQPValue::LongString(LongString::from("x\n\u{1b}[2J"));
        let Verdict::DeadLetter { error, .. } =
            handle(&recognise(&with_control(Some(hostile))).unwrap_or_else(|| panic!()));
        assert!(
            !error.contains('\n') && !error.contains('\u{1b}'),
            "{error}"
        );
    }
}
