//! One dead letter as read from the DLQ: its dead-letter headers and, when
//! its body is an envelope, the order and seq.

use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use shardline_contract::headers::{self, header_i64, header_str};
use shardline_contract::text::{shown, shown_lines};
use shardline_contract::{Envelope, Outline};

use crate::letter::{LetterRef, opt};

/// A dead letter, not acked yet while its reader is open.
#[derive(Debug)]
pub struct Letter {
    pub(crate) delivery: Delivery,
    pub info: LetterRef,
    pub error: Option<String>,
    /// `x-retry-count`: handler attempts made.
    pub attempts: Option<i64>,
    pub original_routing_key: Option<String>,
    pub first_failed_at: Option<String>,
    /// The body as an envelope; `None` when it is not one (not replayable).
    pub envelope: Option<Envelope>,
}

impl Letter {
    pub(crate) fn new(delivery: Delivery) -> Self {
        let props = &delivery.properties;
        let text = |name| header_str(props, name).map(str::to_owned);
        let max_body = shardline_publisher::Config::default().max_body_bytes;
        let envelope = Envelope::parse(&delivery.data, max_body).ok();
        // A body that is JSON but not a valid envelope (too deep, say) may
        // still name its order.
        let loose = envelope
            .is_none()
            .then(|| Outline::of(&delivery.data))
            .flatten();
        let order_id = envelope
            .as_ref()
            .map(|e| e.order_id.to_string())
            .or_else(|| Some(loose.as_ref()?.order_id.as_deref()?.to_owned()));
        let seq = envelope
            .as_ref()
            .and_then(|e| e.seq)
            .or_else(|| loose.as_ref()?.seq);
        Self {
            info: LetterRef {
                id: text(headers::DEAD_LETTER_ID),
                reason: text(headers::FAIL_REASON).unwrap_or_else(|| "unknown".into()),
                order_id,
                seq,
                shard: header_i64(props, headers::SHARD),
            },
            error: text(headers::ERROR),
            attempts: header_i64(props, headers::RETRY_COUNT),
            original_routing_key: text(headers::ORIGINAL_ROUTING_KEY),
            first_failed_at: text(headers::FIRST_FAILED_AT),
            envelope,
            delivery,
        }
    }

    /// Its id in the dead-letter index: `x-dead-letter-id`, or for a letter
    /// the broker dead-lettered itself the id derived from its content.
    pub fn index_id(&self) -> String {
        self.info.id.clone().unwrap_or_else(|| {
            shardline_contract::letters::derived_id(self.properties(), self.body())
        })
    }

    /// Its entry in the dead-letter index, as the worker (or `dlq reindex`)
    /// wrote it.
    pub fn entry(&self) -> shardline_contract::letters::IndexEntry {
        shardline_contract::letters::entry_of(self.properties(), self.body())
    }

    pub fn body(&self) -> &[u8] {
        &self.delivery.data
    }

    pub fn properties(&self) -> &BasicProperties {
        &self.delivery.properties
    }

    /// The routing key it was dead-lettered with (the reason).
    pub fn routing_key(&self) -> &str {
        self.delivery.routing_key.as_str()
    }

    /// The event kind: the envelope's, else the `event` of a body that is
    /// JSON but not a valid envelope (however deep).
    pub fn event(&self) -> Option<String> {
        if let Some(envelope) = &self.envelope {
            return Some(envelope.event.clone());
        }
        Some(Outline::of(self.body())?.event?.into_owned())
    }

    /// Its AMQP headers, each value as text (strings as they are, numbers in
    /// decimal, tables and arrays as the AMQP library prints them).
    pub fn headers(&self) -> Vec<(String, String)> {
        self.properties()
            .headers()
            .as_ref()
            .map(|h| {
                h.inner()
                    .iter()
                    .map(|(name, value)| (name.as_str().to_owned(), value_text(value)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Headers and body, as `dlq show` prints them: one line per header
    /// and the body's own lines, hidden characters shown as escapes.
    pub fn text(&self) -> String {
        let p = self.properties();
        let text_of = |s: &Option<lapin::types::ShortString>| {
            shown(s.as_ref().map_or("-", |s| s.as_str())).into_owned()
        };
        let mut lines = vec![
            format!("dead letter {}", shown(self.info.id())),
            format!("routing key: {}", shown(self.routing_key())),
            format!("message id: {}", text_of(p.message_id())),
            format!("content type: {}", text_of(p.content_type())),
            format!("delivery mode: {}", opt(*p.delivery_mode())),
            format!("timestamp: {}", opt(*p.timestamp())),
            "headers:".to_owned(),
        ];
        for (name, value) in self.headers() {
            lines.push(format!("  {}: {}", shown(&name), shown(&value)));
        }
        lines.push(format!("body ({} bytes):", self.body().len()));
        lines.push(shown_lines(&String::from_utf8_lossy(self.body())).into_owned());
        lines.join("\n") + "\n"
    }
}

fn value_text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        other => match headers::value_i64(other) {
            Some(n) => n.to_string(),
            None => format!("{other:?}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(body: &[u8]) -> Letter {
        Letter::new(Delivery::mock(
            1,
            "dlx".into(),
            "invalid".into(),
            false,
            body.to_vec(),
        ))
    }

    #[test]
    fn show_prints_escapes_of_what_a_terminal_would_obey() {
        let hostile = "\u{1b}]0;pwned\u{7}\u{1b}[2J\r\u{202e}";
        let mut delivery = Delivery::mock(1, "dlx".into(), "handler".into(), false, Vec::new());
        delivery.data = format!("{{\"order_id\":\"A\",\n\"x\":\"{hostile}\"}}").into_bytes();
        let mut table = lapin::types::FieldTable::default();
        table.insert(
            format!("x-{hostile}").as_str().into(),
            AMQPValue::LongString(hostile.into()),
        );
        delivery.properties = BasicProperties::default()
            .with_message_id(hostile.into())
            .with_headers(table);
        let text = Letter::new(delivery).text();
        assert!(
            !text.contains(['\u{1b}', '\u{7}', '\r', '\u{202e}']),
            "{text}"
        );
        assert!(text.contains("\\u{1b}]0;pwned"), "{text}");
        assert!(
            text.contains("{\"order_id\":\"A\",\n\"x\""),
            "the body keeps its lines: {text}"
        );
    }

    #[test]
    fn a_letter_names_its_order_however_deep_its_body() {
        // 200 levels: deeper than serde_json builds a tree, and `invalid`.
        let deep = format!(
            r#"{{"order_id":"A7","event":"payment.captured","version":5,"data":{}1{}}}"#,
            "[".repeat(199),
            "]".repeat(199)
        );
        let l = letter(deep.as_bytes());
        assert!(l.envelope.is_none());
        assert_eq!(l.info.order_id.as_deref(), Some("A7"));
        assert_eq!(l.info.seq, Some(5));
        assert_eq!(l.event().as_deref(), Some("payment.captured"));
        assert_eq!(l.entry().order_id.as_deref(), Some("A7"));
        // A valid envelope: its own fields.
        let l = letter(br#"{"order_id":"B1","event":"e","seq":2}"#);
        assert!(l.envelope.is_some());
        assert_eq!(
            (l.info.order_id.as_deref(), l.info.seq, l.event().as_deref()),
            (Some("B1"), Some(2), Some("e"))
        );
        // Not JSON, or not an object: none.
        for body in [&b"\xff{"[..], br#"["A","e",1]"#] {
            let l = letter(body);
            assert_eq!(
                (l.info.order_id.as_deref(), l.info.seq, l.event().as_deref()),
                (None, None, None)
            );
        }
    }
}
