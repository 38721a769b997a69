//! The dead-letter index's contract: a letter's failure group (its reason and
//! normalised error text), the entry every tool reads, and the one Lua
//! function that writes an entry (the worker's dead-letter script and
//! `dlq reindex` both run it). Its keys are built in [`crate::keys`].

use std::collections::HashMap;
use std::time::UNIX_EPOCH;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable};
use md5::{Digest, Md5};

use crate::headers::{self, header, header_i64, header_str};
use crate::outline::Outline;

/// Longest normalised error text; longer texts are cut at a character
/// boundary and end with `…`.
pub const MAX_GROUP_CHARS: usize = 200;

/// Hex digits of a group id.
const GROUP_ID_HEX: usize = 12;

/// Shortest run of hex digits (with at least one digit) read as `<hex>`:
/// shorter ones are ordinary words such as `cafe` or `dead`.
const MIN_HEX: usize = 8;

/// Words after which a number from 100 to 599 is an HTTP status and kept.
const STATUS_WORDS: [&str; 4] = ["http", "status", "answered", "code"];

/// The failure group text of a dead letter's error (`x-error`): what stays
/// when the values that differ between letters of one cause are replaced.
///
/// - a word is a run of letters, digits, `-` and `_`; a word with a digit is
///   replaced: a UUID (8-4-4-4-12 hex digits) by `<uuid>`, a `0x` number or
///   a run of at least 8 hex digits by `<hex>`, digits by `<n>`, digits with
///   a unit (`250ms`, `5s`) by `<n>` and the unit, anything else (`A1024`,
///   `order-77`) by `<id>`;
/// - an HTTP status is kept: a number from 100 to 599 right after `HTTP`,
///   `status`, `answered` or `code` (any case), so `HTTP 503` stays `HTTP 503`
///   and `downstream answered 404` stays as it is;
/// - a quoted value (`"…"`, `'…'`, `` `…` ``; a `'` opens a quote only after
///   a character that is not a letter or digit, so `don't` stays) becomes
///   its quotes around `…`; an unclosed quote is kept as text;
/// - whitespace runs become one space, the ends are trimmed, and the text is
///   cut after [`MAX_GROUP_CHARS`] characters (then ends with `…`).
pub fn normalise_error(error: &str) -> String {
    let chars: Vec<char> = error.chars().collect();
    let mut out = String::with_capacity(error.len().min(MAX_GROUP_CHARS * 4));
    let mut last_word = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if is_word(c) {
            let start = i;
            while i < chars.len() && is_word(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            out.push_str(&word_placeholder(&word, &last_word));
            last_word = word;
            continue;
        }
        if c.is_whitespace() {
            while i < chars.len() && chars[i].is_whitespace() {
                i += 1;
            }
            out.push(' ');
            continue;
        }
        let opens = matches!(c, '"' | '`')
            || (c == '\'' && i.checked_sub(1).is_none_or(|p| !chars[p].is_alphanumeric()));
        if opens && let Some(close) = chars[i + 1..].iter().position(|&q| q == c) {
            out.push(c);
            out.push('…');
            out.push(c);
            i += close + 2;
            last_word.clear();
            continue;
        }
        out.push(c);
        last_word.clear();
        i += 1;
    }
    cap(out.trim(), MAX_GROUP_CHARS)
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '-' || c == '_'
}

/// What a word of an error text becomes ([`normalise_error`]).
fn word_placeholder(word: &str, previous: &str) -> String {
    if !word.chars().any(|c| c.is_ascii_digit()) {
        return word.to_owned();
    }
    if is_uuid(word) {
        return "<uuid>".to_owned();
    }
    let hex = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_hexdigit());
    if word
        .strip_prefix("0x")
        .or_else(|| word.strip_prefix("0X"))
        .is_some_and(hex)
    {
        return "<hex>".to_owned();
    }
    if word.chars().all(|c| c.is_ascii_digit()) {
        let status = word.len() == 3
            && word.parse::<u16>().is_ok_and(|n| (100..600).contains(&n))
            && STATUS_WORDS
                .iter()
                .any(|w| previous.eq_ignore_ascii_case(w));
        return if status {
            word.to_owned()
        } else {
            "<n>".to_owned()
        };
    }
    if word.chars().count() >= MIN_HEX && hex(word) {
        return "<hex>".to_owned();
    }
    let unit = word.trim_start_matches(|c: char| c.is_ascii_digit());
    if unit.len() < word.len() && unit.len() <= 3 && unit.chars().all(|c| c.is_alphabetic()) {
        return format!("<n>{unit}");
    }
    "<id>".to_owned()
}

fn is_uuid(word: &str) -> bool {
    let parts: Vec<&str> = word.split('-').collect();
    parts.len() == 5
        && parts
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(p, n)| p.len() == n && p.chars().all(|c| c.is_ascii_hexdigit()))
}

fn cap(s: &str, max_chars: usize) -> String {
    match s.char_indices().nth(max_chars) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s.to_owned(),
    }
}

/// A failure group: a reason and a normalised error text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// [`group_id`] of the two below.
    pub id: String,
    pub reason: String,
    /// [`normalise_error`] of the letters' error.
    pub error: String,
}

impl Group {
    /// The group of a letter with this reason and (raw) error text.
    pub fn of(reason: &str, error: &str) -> Self {
        let error = normalise_error(error);
        Self {
            id: group_id(reason, &error),
            reason: reason.to_owned(),
            error,
        }
    }

    /// How the group descriptions hash stores it: `{reason}\n{error}`.
    pub fn description(&self) -> String {
        format!("{}\n{}", self.reason, self.error)
    }

    /// A group back from its id and [`Self::description`].
    pub fn from_description(id: &str, description: &str) -> Self {
        let (reason, error) = description.split_once('\n').unwrap_or((description, ""));
        Self {
            id: id.to_owned(),
            reason: reason.to_owned(),
            error: error.to_owned(),
        }
    }
}

/// A group's id: the first 12 hex digits of md5 of `{reason}\n{normalised}`
/// (stable across releases and hosts; 48 bits, so two groups of one DLQ
/// collide with odds of about one in 10^10 per pair).
pub fn group_id(reason: &str, normalised: &str) -> String {
    let mut md5 = Md5::new();
    md5.update(reason.as_bytes());
    md5.update(b"\n");
    md5.update(normalised.as_bytes());
    hex(&md5.finalize())[..GROUP_ID_HEX].to_owned()
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    out
}

/// Bodies larger than this are not read for an order (an oversize body is
/// an `invalid` letter that names none anyway).
pub const MAX_INDEXED_BODY: usize = 1024 * 1024;

/// The header RabbitMQ adds when it dead-letters a message itself.
pub const X_DEATH: &str = "x-death";

/// The index entry of a dead letter as it sits in the DLQ: its dead-letter
/// headers, and the `order_id`, `event` and `seq` (or `version`) of a JSON
/// body's top-level object ([`Outline`]), whether or not it is a valid
/// envelope, however deep it is nested. A letter the broker
/// dead-lettered itself (the quorum backstop: `x-death`, no
/// `x-dead-letter-id`) gets [`derived_id`] and the reason its first `x-death`
/// entry gives (`delivery_limit` → `delivery-limit`). The worker builds its
/// letters' entries with this too, so `dlq reindex` rebuilds the same ones.
pub fn entry_of(props: &BasicProperties, body: &[u8]) -> IndexEntry {
    let text = |name| header_str(props, name).map(str::to_owned);
    let death = first_death(props);
    let death_text = |name: &str| {
        death.and_then(|d| match d.inner().get(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        })
    };
    // One pass without a tree: a body too deep for one is read too.
    let outline = (body.len() <= MAX_INDEXED_BODY)
        .then(|| Outline::of(body))
        .flatten();
    let (reason, error) = match (text(headers::FAIL_REASON), death_text("reason")) {
        (Some(reason), _) => (reason, text(headers::ERROR).unwrap_or_default()),
        (None, Some(broker)) => {
            let queue = death_text("queue").unwrap_or_else(|| "?".to_owned());
            let error = format!("dead-lettered by the broker ({broker}) from {queue}");
            (broker.replace('_', "-"), error)
        }
        (None, None) => (
            "unknown".to_owned(),
            text(headers::ERROR).unwrap_or_default(),
        ),
    };
    let first_failed_ms = text(headers::FIRST_FAILED_AT)
        .and_then(|at| humantime::parse_rfc3339_weak(&at).ok())
        .or_else(|| {
            let AMQPValue::Timestamp(secs) = death.and_then(|d| d.inner().get("time"))? else {
                return None;
            };
            UNIX_EPOCH.checked_add(std::time::Duration::from_secs(*secs))
        })
        .and_then(|at| at.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    IndexEntry {
        id: text(headers::DEAD_LETTER_ID).unwrap_or_else(|| derived_id(props, body)),
        reason,
        group: String::new(),
        error,
        order_id: outline
            .as_ref()
            .and_then(|o| Some(o.order_id.as_deref()?.to_owned())),
        seq: outline.as_ref().and_then(|o| o.seq),
        kind: outline
            .as_ref()
            .and_then(|o| Some(o.event.as_deref()?.to_owned())),
        shard: header_i64(props, headers::SHARD).and_then(|s| u16::try_from(s).ok()),
        first_failed_ms,
        trace_id: headers::remote_span_context(props).map(|sc| sc.trace_id().to_string()),
        attempts: header_i64(props, headers::RETRY_COUNT).and_then(|a| u32::try_from(a).ok()),
    }
    .grouped()
}

/// The id of a letter without `x-dead-letter-id`: `x-` and 32 hex digits of
/// md5 over its message id, publish time, timestamp and body — what stays
/// the same each time the letter is read (`x-death` counts change). Two
/// letters alike in all four share an id (and one index entry).
pub fn derived_id(props: &BasicProperties, body: &[u8]) -> String {
    let mut md5 = Md5::new();
    md5.update(props.message_id().as_ref().map_or("", |m| m.as_str()));
    md5.update(b"\n");
    md5.update(
        header_i64(props, headers::PUBLISHED_AT_MS)
            .unwrap_or(0)
            .to_be_bytes(),
    );
    md5.update(props.timestamp().unwrap_or(0).to_be_bytes());
    md5.update(body);
    format!("x-{}", hex(&md5.finalize()))
}

/// The newest `x-death` entry (RabbitMQ puts it first).
fn first_death(props: &BasicProperties) -> Option<&FieldTable> {
    match header(props, X_DEATH)? {
        AMQPValue::FieldArray(deaths) => deaths.as_slice().iter().find_map(|d| match d {
            AMQPValue::FieldTable(t) => Some(t),
            _ => None,
        }),
        _ => None,
    }
}

/// One dead letter's index entry (a hash; [`crate::Keys::dlq_letter`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IndexEntry {
    /// `x-dead-letter-id`, or for a letter the broker dead-lettered itself
    /// an id derived from its content (`dlq reindex`).
    pub id: String,
    /// `x-fail-reason` (`unknown` when there is none).
    pub reason: String,
    /// [`group_id`] of the reason and the normalised error ([`Self::grouped`]).
    pub group: String,
    /// The error text as the letter carries it (`x-error`).
    pub error: String,
    /// The envelope's order, when the body has one.
    pub order_id: Option<String>,
    pub seq: Option<u64>,
    /// The event kind (the envelope's `event`).
    pub kind: Option<String>,
    pub shard: Option<u16>,
    /// `x-first-failed-at`, in ms since the Unix epoch (0 when unknown).
    pub first_failed_ms: u64,
    /// The trace id of the attempt that failed.
    pub trace_id: Option<String>,
    /// Handler attempts made.
    pub attempts: Option<u32>,
}

const F_ID: &str = "id";
const F_REASON: &str = "reason";
const F_GROUP: &str = "group";
const F_ERROR: &str = "error";
const F_ORDER: &str = "order";
const F_SEQ: &str = "seq";
const F_KIND: &str = "kind";
const F_SHARD: &str = "shard";
const F_FAILED: &str = "failed_ms";
const F_TRACE: &str = "trace";
const F_ATTEMPTS: &str = "attempts";

impl IndexEntry {
    /// The entry's fields and values, as the hash holds them (absent values
    /// are left out).
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        let mut fields = vec![
            (F_ID, self.id.clone()),
            (F_REASON, self.reason.clone()),
            (F_GROUP, self.group.clone()),
            (F_ERROR, self.error.clone()),
            (F_FAILED, self.first_failed_ms.to_string()),
        ];
        let mut opt = |name, value: Option<String>| {
            if let Some(value) = value {
                fields.push((name, value));
            }
        };
        opt(F_ORDER, self.order_id.clone());
        opt(F_SEQ, self.seq.map(|s| s.to_string()));
        opt(F_KIND, self.kind.clone());
        opt(F_SHARD, self.shard.map(|s| s.to_string()));
        opt(F_TRACE, self.trace_id.clone());
        opt(F_ATTEMPTS, self.attempts.map(|a| a.to_string()));
        fields
    }

    /// An entry back from its hash; `None` when the hash has no id (gone).
    pub fn from_fields(fields: &HashMap<String, String>) -> Option<Self> {
        let text = |name: &str| fields.get(name).cloned();
        Some(Self {
            id: text(F_ID)?,
            reason: text(F_REASON).unwrap_or_else(|| "unknown".to_owned()),
            group: text(F_GROUP).unwrap_or_default(),
            error: text(F_ERROR).unwrap_or_default(),
            order_id: text(F_ORDER),
            seq: text(F_SEQ).and_then(|s| s.parse().ok()),
            kind: text(F_KIND),
            shard: text(F_SHARD).and_then(|s| s.parse().ok()),
            first_failed_ms: text(F_FAILED).and_then(|s| s.parse().ok()).unwrap_or(0),
            trace_id: text(F_TRACE),
            attempts: text(F_ATTEMPTS).and_then(|s| s.parse().ok()),
        })
    }

    /// The group it belongs to.
    pub fn group(&self) -> Group {
        Group::of(&self.reason, &self.error)
    }

    /// The entry with its `group` set from its reason and error.
    pub fn grouped(mut self) -> Self {
        self.group = self.group().id;
        self
    }

    /// The keys [`INDEX_LUA`]'s `index_letter` takes, in its order.
    pub fn script_keys(&self, keys: &crate::Keys) -> [String; 5] {
        let order = self.order_id.as_deref().unwrap_or_default();
        [
            keys.dlq_letter(&self.id),
            keys.dlq_letters(),
            keys.dlq_group(&self.group),
            keys.dlq_groups(),
            keys.dlq_order(&crate::envelope::order_key_of(order)),
        ]
    }

    /// The arguments [`INDEX_LUA`]'s `index_letter` takes, in its order.
    pub fn script_args(&self) -> Vec<String> {
        let mut args = vec![
            self.id.clone(),
            self.first_failed_ms.to_string(),
            self.group.clone(),
            self.group().description(),
            if self.order_id.is_some() { "1" } else { "0" }.to_owned(),
        ];
        for (name, value) in self.fields() {
            args.push(name.to_owned());
            args.push(value);
        }
        args
    }
}

/// The Lua function `index_letter(k, a)` that writes one entry: O(1) writes
/// (a hash, two sorted-set adds, a set add, a group description set once).
/// `k`: [`IndexEntry::script_keys`]; `a`: [`IndexEntry::script_args`]. Keys
/// and arguments are given as tables, so a script can pass a slice of its own.
pub const INDEX_LUA: &str = r"
local function index_letter(k, a)
  local id = a[1]
  redis.call('DEL', k[1])
  redis.call('HSET', k[1], unpack(a, 6))
  redis.call('ZADD', k[2], a[2], id)
  redis.call('ZADD', k[3], a[2], id)
  redis.call('HSETNX', k[4], a[3], a[4])
  if a[5] == '1' then redis.call('SADD', k[5], id) end
end
";

/// How many [`IndexEntry::script_args`] precede the fields.
pub const INDEX_ARGS_HEAD: usize = 5;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workers_own_error_texts() {
        for (error, group) in [
            ("downstream answered 503", "downstream answered 503"),
            ("downstream answered 404", "downstream answered 404"),
            (
                "POST http://127.0.0.1:38211/hook: error sending request for url (http://127.0.0.1:38211/hook)",
                "POST http://<n>.<n>.<n>.<n>:<n>/hook: error sending request for url (http://<n>.<n>.<n>.<n>:<n>/hook)",
            ),
            (
                "handler timed out after 2.5s",
                "handler timed out after <n>.<n>s",
            ),
            (
                "handler timed out after 250ms",
                "handler timed out after <n>ms",
            ),
            (
                "seq 17 arrived after its order moved past it (its gap was given up)",
                "seq <n> arrived after its order moved past it (its gap was given up)",
            ),
            (
                "order A1024 is quarantined behind seq 2 (dead letter 0193a4f2-7c1e-7b3d-9a10-5f6e7d8c9b0a); replay the order's dead letters or `shardline dlq release --order-id A1024`",
                "order <id> is quarantined behind seq <n> (dead letter <uuid>); replay the order's dead letters or `…`",
            ),
            (
                "the handler was started 5 times and the worker died each time",
                "the handler was started <n> times and the worker died each time",
            ),
            (
                "delivered 19 times; the queue's delivery limit is 20",
                "delivered <n> times; the queue's delivery limit is <n>",
            ),
            (
                "invalid envelope: missing field `order_id` at line 1 column 27",
                "invalid envelope: missing field `…` at line <n> column <n>",
            ),
        ] {
            assert_eq!(normalise_error(error), group, "{error}");
        }
    }

    #[test]
    fn ids_hex_and_quotes_are_replaced() {
        assert_eq!(
            normalise_error(
                r#"user "alice" not found, token 'abc 123', trace 4bf92f3577b34da6a3ce929d0e0e4736"#
            ),
            r#"user "…" not found, token '…', trace <hex>"#
        );
        assert_eq!(
            normalise_error("pointer 0xDEADbeef, order-77"),
            "pointer <hex>, <id>"
        );
        // Short hex words are words; a `'` inside a word is no quote.
        assert_eq!(
            normalise_error("cafe doesn't decode"),
            "cafe doesn't decode"
        );
        assert_eq!(
            normalise_error("unclosed \"quote 12"),
            "unclosed \"quote <n>"
        );
    }

    #[test]
    fn the_http_status_is_kept_and_only_it() {
        assert_eq!(
            normalise_error("HTTP 503 from upstream"),
            "HTTP 503 from upstream"
        );
        assert_eq!(normalise_error("status 429, retry"), "status 429, retry");
        assert_eq!(normalise_error("http 999"), "http <n>");
        assert_eq!(normalise_error("503 HTTP"), "<n> HTTP");
        assert_eq!(normalise_error("got 503"), "got <n>");
    }

    #[test]
    fn whitespace_collapses_and_length_is_capped() {
        assert_eq!(normalise_error("  a\n\t b   c  "), "a b c");
        let long = normalise_error(&"word ".repeat(100));
        assert_eq!(long.chars().count(), MAX_GROUP_CHARS + 1);
        assert!(long.ends_with('…'));
    }

    #[test]
    fn letters_of_one_cause_share_a_group() {
        let a = Group::of("handler", "order A1 seq 3: downstream answered 503");
        let b = Group::of("handler", "order B77 seq 12:   downstream answered 503");
        assert_eq!(a, b);
        assert_eq!(a.id.len(), GROUP_ID_HEX);
        assert_ne!(
            a.id,
            Group::of("timeout", "order A1 seq 3: downstream answered 503").id
        );
        assert_ne!(a.id, Group::of("handler", "downstream answered 502").id);
        assert_eq!(Group::from_description(&a.id, &a.description()), a);
    }

    #[test]
    fn entries_of_the_workers_letters() {
        use crate::headers::{DeadLetter, FailReason, event_properties, new_traceparent};
        let original = event_properties("m-1", std::time::SystemTime::now(), &new_traceparent());
        let letter = DeadLetter {
            reason: FailReason::Handler,
            error: "downstream answered 503".into(),
            retry_count: 5,
            shard: 3,
            original_routing_key: "shard.3".into(),
            first_failed_at: UNIX_EPOCH + std::time::Duration::from_millis(1_700_000_000_123),
            id: "dl-1".into(),
            trace: Some(crate::w3c::random_span_context()),
        };
        let props = letter.properties(&original);
        let body = br#"{"order_id":"A1","event":"payment.captured","seq":3}"#;
        let entry = entry_of(&props, body);
        assert_eq!(entry.id, "dl-1");
        assert_eq!(entry.reason, "handler");
        assert_eq!(
            entry.group,
            Group::of("handler", "downstream answered 503").id
        );
        assert_eq!(entry.order_id.as_deref(), Some("A1"));
        assert_eq!(entry.seq, Some(3));
        assert_eq!(entry.kind.as_deref(), Some("payment.captured"));
        assert_eq!(entry.shard, Some(3));
        assert_eq!(entry.attempts, Some(5));
        assert_eq!(entry.first_failed_ms, 1_700_000_000_123);
        assert_eq!(
            entry.trace_id,
            letter.trace.map(|t| t.trace_id().to_string())
        );
        // Too deep for a tree, or not an envelope: still under its order.
        let deep = format!(
            r#"{{"order_id":"A2","event":"e","version":4,"data":{}{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        assert!(serde_json::from_str::<serde_json::Value>(&deep).is_err());
        let entry = entry_of(&props, deep.as_bytes());
        assert_eq!(entry.order_id.as_deref(), Some("A2"));
        assert_eq!(entry.kind.as_deref(), Some("e"));
        assert_eq!(entry.seq, Some(4));
        let entry = entry_of(&props, br#"{"order_id":"A3","event":"","seq":0}"#);
        assert_eq!(entry.order_id.as_deref(), Some("A3"));
        assert_eq!(entry.seq, Some(0));
        // Not JSON: no order.
        let bare = entry_of(&props, b"\xff\xfe");
        assert_eq!((bare.order_id, bare.seq, bare.kind), (None, None, None));
    }

    #[test]
    fn letters_the_broker_dead_lettered_get_a_stable_id() {
        let mut death = FieldTable::default();
        death.insert(
            "reason".into(),
            AMQPValue::LongString("delivery_limit".into()),
        );
        death.insert(
            "queue".into(),
            AMQPValue::LongString("order.events.shard.2".into()),
        );
        death.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        death.insert("count".into(), AMQPValue::LongLongInt(1));
        let mut headers = FieldTable::default();
        headers.insert(
            X_DEATH.into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
        );
        let props = BasicProperties::default()
            .with_message_id("m-9".into())
            .with_headers(headers);
        let body = br#"{"order_id":"B2","event":"order.fulfilled","version":4}"#;
        let entry = entry_of(&props, body);
        assert_eq!(entry.reason, "delivery-limit");
        assert!(
            entry.id.starts_with("x-") && entry.id.len() == 34,
            "{}",
            entry.id
        );
        assert_eq!(entry.id, entry_of(&props, body).id);
        assert_ne!(entry.id, entry_of(&props, b"{}").id);
        assert_eq!(entry.first_failed_ms, 1_700_000_000_000);
        assert_eq!(entry.seq, Some(4));
        assert_eq!(
            entry.error,
            "dead-lettered by the broker (delivery_limit) from order.events.shard.2"
        );
        let unknown = entry_of(&BasicProperties::default(), b"{}");
        assert_eq!(unknown.reason, "unknown");
    }

    #[test]
    fn entries_round_trip_through_their_hash() {
        let entry = IndexEntry {
            id: "0193a4f2-7c1e-7b3d-9a10-5f6e7d8c9b0a".into(),
            reason: "handler".into(),
            group: Group::of("handler", "downstream answered 503").id,
            error: "downstream answered 503".into(),
            order_id: Some("A1".into()),
            seq: Some(3),
            kind: Some("payment.captured".into()),
            shard: Some(5),
            first_failed_ms: 1_700_000_000_000,
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
            attempts: Some(5),
        };
        let hash: HashMap<String, String> = entry
            .fields()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        assert_eq!(IndexEntry::from_fields(&hash), Some(entry.clone()));
        let bare = IndexEntry {
            order_id: None,
            seq: None,
            kind: None,
            shard: None,
            trace_id: None,
            attempts: None,
            ..entry
        };
        assert_eq!(bare.fields().len(), 5);
        assert_eq!(bare.script_args()[INDEX_ARGS_HEAD - 1], "0");
        assert_eq!(IndexEntry::from_fields(&HashMap::new()), None);
    }
}
