//! The JSON event envelope (docs/semantics.md §2): parsing, validation and the dedup key.
//!
//! ```json
//! {"order_id": "A1024", "event": "payment.captured", "seq": 3,
//!  "event_id": "optional", "occurred_at": "2026-11-29T10:00:00Z", "data": {}}
//! ```
//! Unknown fields are kept: the worker hands handlers the original bytes, so the
//! envelope is a view onto them, never a re-encoding.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::time::SystemTime;

use md5::{Digest, Md5};

pub use crate::order_id::{MAX_FIELD_BYTES, key_field};
use crate::order_id::{OrderId, escape_into};
use crate::outline::{Kind, outline};
use serde::Deserialize;
use serde_json::Number;

/// Largest accepted `seq`: 2^63 − 1, so it fits every signed 64-bit store.
pub const MAX_SEQ: u64 = i64::MAX as u64;

/// Deepest accepted nesting of arrays and objects, the envelope's own object
/// included (`{"data":{"a":[1]}}` is 3 deep): well below serde_json's
/// recursion limit (128), so every accepted body parses into a tree
/// wherever one is read. Deeper bodies are `invalid`.
pub const MAX_DEPTH: usize = 64;

/// The fields of an event that shardline acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub order_id: OrderId,
    pub event: String,
    /// Per-order sequence number (`seq`, alias `version`); events without one are
    /// deduplicated but not sequence-gated.
    pub seq: Option<u64>,
    pub event_id: Option<String>,
}

/// Why a body is not an envelope. The two kinds are the dead-letter reasons
/// `decode` and `invalid`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// Not UTF-8 JSON at all.
    #[error("not UTF-8 JSON: {0}")]
    Decode(String),
    /// JSON, but not a valid envelope (or over the size limit).
    #[error("invalid envelope: {0}")]
    Invalid(String),
}

#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow, default)]
    order_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    event: Option<Cow<'a, str>>,
    #[serde(default)]
    seq: Option<Number>,
    #[serde(default)]
    version: Option<Number>,
    #[serde(borrow, default)]
    event_id: Option<Cow<'a, str>>,
}

impl Envelope {
    /// Parses and validates a message body of at most `max_bytes`: a JSON
    /// object nested at most [`MAX_DEPTH`] deep.
    pub fn parse(body: &[u8], max_bytes: usize) -> Result<Self, EnvelopeError> {
        if body.len() > max_bytes {
            return Err(EnvelopeError::Invalid(format!(
                "body of {} bytes is over the {max_bytes}-byte limit",
                body.len()
            )));
        }
        // serde_json checks UTF-8 only in the strings it reads into fields; the
        // handler gets the whole body, so all of it must be UTF-8.
        let text = std::str::from_utf8(body)
            .map_err(|e| EnvelopeError::Decode(format!("invalid UTF-8: {e}")))?;
        // One pass without recursion first: serde_json reads a struct from an
        // array too (by position), and skips data of any depth.
        let shape = outline(text).map_err(|e| EnvelopeError::Decode(e.to_string()))?;
        if shape.kind != Kind::Object {
            return Err(invalid(format!(
                "the body is {}, not a JSON object",
                shape.kind.described()
            )));
        }
        if shape.depth > MAX_DEPTH {
            return Err(invalid(format!(
                "the body is nested deeper than {MAX_DEPTH} levels ({} levels)",
                shape.depth
            )));
        }
        let wire: Wire<'_> = serde_json::from_str(text).map_err(|e| match e.classify() {
            serde_json::error::Category::Data => EnvelopeError::Invalid(e.to_string()),
            _ => EnvelopeError::Decode(e.to_string()),
        })?;
        let seq = match (wire.seq, wire.version) {
            (Some(_), Some(_)) => {
                return Err(invalid("both `seq` and its alias `version` are present"));
            }
            (Some(n), None) | (None, Some(n)) => Some(parse_seq(&n)?),
            (None, None) => None,
        };
        Ok(Self {
            order_id: match wire.order_id {
                Some(id) => OrderId::new(id).map_err(|e| invalid(e.to_string()))?,
                None => return Err(invalid("`order_id` is missing")),
            },
            event: required_field("event", wire.event)?,
            seq,
            event_id: wire
                .event_id
                .map(|id| checked_field("event_id", id))
                .transpose()?,
        })
    }

    /// The order id with `%` and `:` escaped, as it appears in Redis keys.
    pub fn order_key(&self) -> crate::OrderKey {
        self.order_id.key()
    }

    /// The dedup key `{order_id}:{event}:{seq | event_id | md5(body)}`, each field
    /// with `%` and `:` escaped, so two different events never share a key.
    pub fn dedup_key(&self, body: &[u8]) -> String {
        let mut key = String::with_capacity(self.order_id.len() + self.event.len() + 34);
        escape_into(&mut key, &self.order_id);
        key.push(':');
        escape_into(&mut key, &self.event);
        key.push(':');
        match (self.seq, &self.event_id) {
            (Some(seq), _) => {
                let _ = write!(key, "{seq}");
            }
            (None, Some(id)) => escape_into(&mut key, id),
            (None, None) => {
                for byte in Md5::digest(body) {
                    let _ = write!(key, "{byte:02x}");
                }
            }
        }
        key
    }
}

fn invalid(msg: impl Into<String>) -> EnvelopeError {
    EnvelopeError::Invalid(msg.into())
}

fn parse_seq(n: &Number) -> Result<u64, EnvelopeError> {
    match n.as_u64() {
        Some(seq) if (1..=MAX_SEQ).contains(&seq) => Ok(seq),
        _ => Err(invalid(format!(
            "`seq` must be an integer from 1 to 2^63-1, got {n}"
        ))),
    }
}

fn required_field(name: &str, value: Option<Cow<'_, str>>) -> Result<String, EnvelopeError> {
    match value {
        Some(v) => checked_field(name, v),
        None => Err(invalid(format!("`{name}` is missing"))),
    }
}

fn checked_field(name: &str, value: Cow<'_, str>) -> Result<String, EnvelopeError> {
    if value.is_empty() {
        return Err(invalid(format!("`{name}` is empty")));
    }
    if value.len() > MAX_FIELD_BYTES {
        return Err(invalid(format!(
            "`{name}` is {} bytes, over the {MAX_FIELD_BYTES}-byte limit",
            value.len()
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid(format!("`{name}` contains a control character")));
    }
    Ok(value.into_owned())
}

/// An order id as it appears in Redis keys ([`OrderId::key`]), for callers
/// that read ids of orders from elsewhere (`shardline reconcile`'s database).
pub fn order_key_of(order_id: &str) -> String {
    key_field(order_id)
}

/// An event to publish, built from command-line flags or by the load generator.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub order_id: OrderId,
    pub event: String,
    pub seq: Option<u64>,
    pub event_id: Option<String>,
    /// The `data` object; `null` when absent.
    pub data: serde_json::Value,
}

impl NewEvent {
    /// The envelope's JSON body, with `occurred_at` set to now. Fails when the
    /// fields would not pass [`Envelope::parse`].
    pub fn to_body(&self) -> Result<Vec<u8>, EnvelopeError> {
        self.to_body_at(SystemTime::now())
    }

    /// [`to_body`](Self::to_body) with `occurred_at` set to `occurred_at`
    /// (an outbox row's time of writing).
    pub fn to_body_at(&self, occurred_at: SystemTime) -> Result<Vec<u8>, EnvelopeError> {
        let mut object = serde_json::Map::new();
        object.insert("order_id".into(), self.order_id.as_str().into());
        object.insert("event".into(), self.event.clone().into());
        if let Some(seq) = self.seq {
            object.insert("seq".into(), seq.into());
        }
        if let Some(id) = &self.event_id {
            object.insert("event_id".into(), id.clone().into());
        }
        object.insert(
            "occurred_at".into(),
            humantime::format_rfc3339_millis(occurred_at)
                .to_string()
                .into(),
        );
        if !self.data.is_null() {
            object.insert("data".into(), self.data.clone());
        }
        let body = serde_json::to_vec(&serde_json::Value::Object(object))
            .map_err(|e| EnvelopeError::Invalid(e.to_string()))?;
        Envelope::parse(&body, usize::MAX)?;
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: usize = 1024 * 1024;

    fn parse(body: &str) -> Result<Envelope, EnvelopeError> {
        Envelope::parse(body.as_bytes(), LIMIT)
    }

    fn is_invalid(body: &str) -> bool {
        matches!(parse(body), Err(EnvelopeError::Invalid(_)))
    }

    #[test]
    fn parses_a_full_envelope() {
        let env = parse(
            r#"{"order_id":"A1024","event":"payment.captured","seq":3,"event_id":"e-1","data":{"x":1},"extra":true}"#,
        )
        .unwrap();
        assert_eq!(env.order_id, "A1024");
        assert_eq!(env.event, "payment.captured");
        assert_eq!(env.seq, Some(3));
        assert_eq!(env.event_id.as_deref(), Some("e-1"));
    }

    #[test]
    fn version_is_an_alias_of_seq() {
        assert_eq!(
            parse(r#"{"order_id":"A","event":"e","version":7}"#)
                .unwrap()
                .seq,
            Some(7)
        );
        assert!(is_invalid(
            r#"{"order_id":"A","event":"e","version":7,"seq":7}"#
        ));
    }

    #[test]
    fn seq_must_be_a_positive_63_bit_integer() {
        for bad in [
            "0",
            "-1",
            "\"3\"",
            "3.0",
            "1.5",
            "1180591620717411303424",
            "9223372036854775808",
        ] {
            assert!(
                is_invalid(&format!(r#"{{"order_id":"A","event":"e","seq":{bad}}}"#)),
                "{bad}"
            );
        }
        let max = parse(r#"{"order_id":"A","event":"e","seq":9223372036854775807}"#).unwrap();
        assert_eq!(max.seq, Some(MAX_SEQ));
    }

    #[test]
    fn required_fields_are_checked() {
        assert!(is_invalid(r#"{"event":"e"}"#));
        assert!(is_invalid(r#"{"order_id":"","event":"e"}"#));
        assert!(is_invalid(r#"{"order_id":12,"event":"e"}"#));
        assert!(is_invalid(r#"{"order_id":"A\u0007","event":"e"}"#));
        assert!(is_invalid(&format!(
            r#"{{"order_id":"{}","event":"e"}}"#,
            "x".repeat(257)
        )));
        assert!(is_invalid(r#"[1,2]"#));
        assert!(is_invalid(r#""text""#));
        assert!(is_invalid(r#"{"order_id":"A","event":"e","event_id":5}"#));
    }

    #[test]
    fn only_an_object_is_an_envelope() {
        // serde's derived struct reads this one by position.
        for (body, kind) in [
            (r#"["A","e",1]"#, "an array"),
            (r#"[{"order_id":"A","event":"e","seq":1}]"#, "an array"),
            (r#""A""#, "a string"),
            ("12", "a number"),
            ("true", "a boolean"),
            ("null", "null"),
        ] {
            let Err(EnvelopeError::Invalid(msg)) = parse(body) else {
                panic!("{body} accepted or not invalid: {:?}", parse(body));
            };
            assert_eq!(msg, format!("the body is {kind}, not a JSON object"));
        }
    }

    /// `{"order_id":"A","event":"e","seq":1,"data":…}` nested `depth` deep.
    fn nested(depth: usize) -> String {
        let inner = depth - 1;
        format!(
            r#"{{"order_id":"A","event":"e","seq":1,"data":{}1{}}}"#,
            "[".repeat(inner),
            "]".repeat(inner)
        )
    }

    #[test]
    fn nesting_is_limited() {
        let at_limit = nested(MAX_DEPTH);
        assert_eq!(
            crate::outline::outline(&at_limit).map(|o| o.depth),
            Ok(MAX_DEPTH)
        );
        assert_eq!(parse(&at_limit).unwrap().order_id, "A");
        // It parses everywhere: as a tree too.
        assert!(serde_json::from_str::<serde_json::Value>(&at_limit).is_ok());
        for depth in [MAX_DEPTH + 1, 200, 100_000] {
            let Err(EnvelopeError::Invalid(msg)) = parse(&nested(depth)) else {
                panic!("{depth} deep: {:?}", parse(&nested(depth)));
            };
            assert_eq!(
                msg,
                format!("the body is nested deeper than 64 levels ({depth} levels)")
            );
        }
    }

    #[test]
    fn non_json_is_a_decode_error() {
        for body in [
            &b"not json"[..],
            b"{\"order_id\":",
            b"",
            b"{\"order_id\":\"\xff\",\"event\":\"e\"}",
            b"[\"A\",\"e\",1",
            b"{\"order_id\":1,",
            b"{\"order_id\":\"A\",\"event\":\"e\"} x",
        ] {
            assert!(
                matches!(Envelope::parse(body, LIMIT), Err(EnvelopeError::Decode(_))),
                "{body:?}"
            );
        }
    }

    #[test]
    fn oversize_bodies_are_invalid() {
        let body = format!(
            r#"{{"order_id":"A","event":"e","pad":"{}"}}"#,
            "x".repeat(100)
        );
        assert!(matches!(
            Envelope::parse(body.as_bytes(), 50),
            Err(EnvelopeError::Invalid(_))
        ));
    }

    #[test]
    fn dedup_key_prefers_seq_then_event_id_then_body_digest() {
        let with_seq = parse(r#"{"order_id":"A","event":"e","seq":3,"event_id":"x"}"#).unwrap();
        assert_eq!(with_seq.dedup_key(b""), "A:e:3");
        let with_id = parse(r#"{"order_id":"A","event":"e","event_id":"x:1"}"#).unwrap();
        assert_eq!(with_id.dedup_key(b""), "A:e:x%3A1");
        let body = br#"{"order_id":"A","event":"e"}"#;
        let bare = Envelope::parse(body, LIMIT).unwrap();
        // python3: hashlib.md5(b'{"order_id":"A","event":"e"}').hexdigest()
        assert_eq!(bare.dedup_key(body), "A:e:89617dba872fbb2d4224d2aa3640f7ba");
    }

    #[test]
    fn dedup_key_escapes_separators() {
        let a = parse(r#"{"order_id":"A:e","event":"1","seq":2}"#).unwrap();
        let b = parse(r#"{"order_id":"A","event":"e:1","seq":2}"#).unwrap();
        assert_ne!(a.dedup_key(b""), b.dedup_key(b""));
        assert_eq!(a.dedup_key(b""), "A%3Ae:1:2");
        let pct = parse(r#"{"order_id":"100%3A","event":"e","seq":1}"#).unwrap();
        assert_eq!(pct.dedup_key(b""), "100%253A:e:1");
    }

    #[test]
    fn new_event_round_trips_through_parse() {
        let event = NewEvent {
            order_id: OrderId::new("注文-42").unwrap(),
            event: "order.created".into(),
            seq: Some(1),
            event_id: None,
            data: serde_json::json!({"total": 10}),
        };
        let body = event.to_body().unwrap();
        let env = Envelope::parse(&body, LIMIT).unwrap();
        assert_eq!(env.order_id, "注文-42");
        assert_eq!(env.seq, Some(1));
        // An empty order id cannot be built at all; an empty event is refused here.
        let bad = NewEvent {
            event: String::new(),
            ..event
        };
        assert!(bad.to_body().is_err());
    }
}
