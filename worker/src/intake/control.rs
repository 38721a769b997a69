//! Control messages: messages on a shard queue that are instructions to the
//! worker rather than events (resharding's drain markers will be the first),
//! recognised by their `x-shardline-control` header before any decoding, so
//! that no control message is ever processed as an event.
//!
//! This worker knows no kind of control message yet: each one is
//! dead-lettered with the reason `control` (and counted in
//! `shardline_dead_letters_total{reason="control"}`), its kind in `x-error`.
//! A kind added later gets its own verdict here, after verifying the message
//! (a control message anyone could publish must not move anything).

use lapin::BasicProperties;
use shardline_contract::headers::{self, FailReason};

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

/// What to do with `message`.
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
