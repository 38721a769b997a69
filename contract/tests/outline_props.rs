//! The streaming outline of a body (docs/semantics.md §2) against serde_json:
//! on JSON shallow enough for serde_json's tree, the outline's kind, depth
//! and envelope fields are the tree's; it reads as JSON exactly what
//! serde_json reads when it skips a value; it reads bodies of any depth; and
//! the fields of an accepted envelope are the outline's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use serde_json::{Map, Value};
use shardline_contract::envelope::MAX_DEPTH;
use shardline_contract::outline::{Kind, outline};
use shardline_contract::{Envelope, EnvelopeError};

/// The worker's default body limit.
const LIMIT: usize = 1 << 20;

type Fields = (Kind, usize, Option<String>, Option<String>, Option<u64>);

/// What the outline must say of `v`, read off serde_json's tree.
fn reference(v: &Value) -> Fields {
    fn depth(v: &Value) -> usize {
        match v {
            Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
            Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
            _ => 0,
        }
    }
    let kind = match v {
        Value::Object(_) => Kind::Object,
        Value::Array(_) => Kind::Array,
        Value::String(_) => Kind::String,
        Value::Number(_) => Kind::Number,
        Value::Bool(_) => Kind::Bool,
        Value::Null => Kind::Null,
    };
    let text = |name: &str| v.get(name).and_then(Value::as_str).map(str::to_owned);
    let seq = v
        .get("seq")
        .filter(|s| !s.is_null())
        .or_else(|| v.get("version"))
        .and_then(Value::as_u64);
    (kind, depth(v), text("order_id"), text("event"), seq)
}

fn outlined(text: &str) -> Option<Fields> {
    let o = outline(text).ok()?;
    Some((
        o.kind,
        o.depth,
        o.order_id.map(|s| s.into_owned()),
        o.event.map(|s| s.into_owned()),
        o.seq,
    ))
}

/// A pseudo-random stream (xorshift) that decides how a value is written.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn one_in(&mut self, n: u64) -> bool {
        self.next().is_multiple_of(n)
    }

    /// Whitespace between tokens, now and then.
    fn space(&mut self, out: &mut String) {
        if self.one_in(3) {
            let spaces = [" ", "\n", "\t", "\r\n", "  \n\t "];
            out.push_str(spaces[(self.next() % 5) as usize]);
        }
    }
}

/// `v` as JSON, with whitespace between tokens and characters of strings
/// written as `\u` escapes now and then.
fn write(v: &Value, noise: &mut Noise, out: &mut String) {
    noise.space(out);
    match v {
        Value::Object(o) => {
            out.push('{');
            for (i, (k, v)) in o.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                noise.space(out);
                write_str(k, noise, out);
                noise.space(out);
                out.push(':');
                write(v, noise, out);
            }
            noise.space(out);
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(v, noise, out);
            }
            noise.space(out);
            out.push(']');
        }
        Value::String(s) => write_str(s, noise, out),
        other => out.push_str(&other.to_string()),
    }
    noise.space(out);
}

fn write_str(s: &str, noise: &mut Noise, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        let short = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '\n' => Some("\\n"),
            '\t' => Some("\\t"),
            '/' => Some("\\/"),
            _ => None,
        };
        if let Some(short) = short.filter(|_| !noise.one_in(3)) {
            out.push_str(short);
        } else if c < ' ' || c == '"' || c == '\\' || noise.one_in(4) {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                if noise.one_in(2) {
                    out.push_str(&format!("\\u{unit:04x}"));
                } else {
                    out.push_str(&format!("\\u{unit:04X}"));
                }
            }
        } else {
            out.push(c);
        }
    }
    out.push('"');
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-zA-Z0-9._-]{0,8}",
        2 => any::<String>(),
        1 => "[\"\\\\/\\n\\t\\x00-\\x1f\\u{80}-\\u{9f}\\u{10000}-\\u{10ffff}a]{1,4}",
    ]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        (-2i64..5).prop_map(Value::from),
        Just(Value::from(u64::MAX)),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        text().prop_map(Value::String),
    ]
}

/// A JSON value whose objects often have the envelope's keys.
fn value() -> impl Strategy<Value = Value> {
    let leaf = leaf();
    let key = prop_oneof![
        Just("order_id".to_owned()),
        Just("event".to_owned()),
        Just("seq".to_owned()),
        Just("version".to_owned()),
        Just("data".to_owned()),
        text(),
    ];
    leaf.prop_recursive(4, 32, 5, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// An object with the envelope's fields, mostly of the right types.
fn envelope_value() -> impl Strategy<Value = Value> {
    (
        text(),
        text(),
        prop::option::of(number()),
        any::<bool>(),
        prop::option::of(value()),
    )
        .prop_map(|(order_id, event, seq, as_version, data)| {
            let mut object = Map::new();
            object.insert("order_id".into(), order_id.into());
            object.insert("event".into(), event.into());
            if let Some(seq) = seq {
                object.insert(if as_version { "version" } else { "seq" }.into(), seq);
            }
            if let Some(data) = data {
                object.insert("data".into(), data);
            }
            Value::Object(object)
        })
}

/// A value or an envelope written with noise, and now and then a top-level
/// key given twice (a duplicate `order_id`, `seq`… spliced in front; a
/// scalar, so that the tree, which keeps the last, is as deep as the text).
fn written() -> impl Strategy<Value = String> {
    (
        prop_oneof![value(), envelope_value()],
        any::<u64>(),
        prop::option::weighted(0.2, (0usize..4, leaf())),
    )
        .prop_map(|(v, seed, dup)| {
            let mut out = String::new();
            write(&v, &mut Noise(seed | 1), &mut out);
            if let (Some((key, dup)), Some(start)) = (dup, out.find('{'))
                && v.as_object().is_some_and(|o| !o.is_empty())
            {
                let key = ["order_id", "event", "seq", "version"][key];
                out.insert_str(start + 1, &format!("\"{key}\":{dup},"));
            }
            out
        })
}

/// Text with a mutation now and then: cut, a character replaced or inserted.
fn mutated(text: String) -> impl Strategy<Value = String> {
    let chars: Vec<char> = text.chars().collect();
    let len = chars.len();
    let noise = prop_oneof![
        Just('"'),
        Just('\\'),
        Just('{'),
        Just('}'),
        Just('['),
        Just(']'),
        Just(','),
        Just(':'),
        Just('0'),
        Just('-'),
        Just('e'),
        Just('.'),
        Just(' '),
        Just('\u{1}'),
        any::<char>(),
    ];
    prop_oneof![
        2 => Just(text),
        1 => (0..=len).prop_map({
            let chars = chars.clone();
            move |cut| chars[..cut].iter().collect()
        }),
        1 => (0..=len, noise.clone(), any::<bool>()).prop_map(move |(at, c, replace)| {
            let mut chars = chars.clone();
            if replace && at < chars.len() {
                chars[at] = c;
            } else {
                chars.insert(at, c);
            }
            chars.into_iter().collect()
        }),
    ]
}

fn is_json(text: &str) -> bool {
    serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()
}

proptest! {
    /// On JSON serde_json reads into a tree, the outline is the tree's.
    #[test]
    fn agrees_with_serde_json_on_json(text in written()) {
        let tree: Value = serde_json::from_str(&text)
            .map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
        prop_assert_eq!(outlined(&text), Some(reference(&tree)), "{}", text);
    }

    /// It reads as JSON exactly what serde_json reads, whatever the text;
    /// where serde_json builds a tree, the outline is the tree's.
    #[test]
    fn reads_json_exactly_as_serde_json(text in prop_oneof![
        1 => any::<String>(),
        1 => "[ \\[\\]{}\",:0-9.eE+\\-tfrulnas\\\\]{0,24}",
        4 => written().prop_flat_map(mutated),
    ]) {
        let got = outlined(&text);
        prop_assert_eq!(got.is_some(), is_json(&text), "{:?}: {:?}", text, outline(&text));
        if let Ok(tree) = serde_json::from_str::<Value>(&text) {
            prop_assert_eq!(got, Some(reference(&tree)), "{:?}", text);
        }
    }

    /// Bodies of any depth: the fields at the top, the depth measured, and
    /// an envelope is accepted exactly to `MAX_DEPTH`.
    #[test]
    fn reads_any_depth(depth in 1usize..400, objects in any::<u64>(), seq in 1u64..1000) {
        // `data` holds depth − 1 levels of arrays and objects.
        let mut open = String::new();
        let mut close = String::new();
        for level in 1..depth {
            if objects >> (level % 64) & 1 == 1 {
                open.push_str("{\"x\":");
                close.insert(0, '}');
            } else {
                open.push('[');
                close.insert(0, ']');
            }
        }
        let body = format!(
            r#"{{"order_id":"deep-{depth}","event":"e","seq":{seq},"data":{open}1{close}}}"#
        );
        let o = outline(&body).unwrap();
        prop_assert_eq!(o.depth, depth);
        let order = format!("deep-{depth}");
        prop_assert_eq!(o.order_id.as_deref(), Some(order.as_str()));
        prop_assert_eq!(o.event.as_deref(), Some("e"));
        prop_assert_eq!(o.seq, Some(seq));
        prop_assert!(is_json(&body));
        if depth < 100 {
            let tree: Value = serde_json::from_str(&body).unwrap();
            prop_assert_eq!(reference(&tree).1, depth);
        }
        match Envelope::parse(body.as_bytes(), LIMIT) {
            Ok(env) => {
                prop_assert!(depth <= MAX_DEPTH);
                prop_assert_eq!(env.seq, Some(seq));
            }
            Err(EnvelopeError::Invalid(msg)) => {
                prop_assert!(depth > MAX_DEPTH, "{}", msg);
                prop_assert!(msg.contains("nested deeper than 64 levels"), "{}", msg);
            }
            Err(e) => prop_assert!(false, "{e:?}"),
        }
    }

    /// An accepted envelope is an object of at most `MAX_DEPTH`, and its
    /// fields are the outline's.
    #[test]
    fn an_accepted_envelope_is_outlined_with_its_fields(text in written().prop_flat_map(mutated)) {
        if let Ok(env) = Envelope::parse(text.as_bytes(), LIMIT) {
            let o = outline(&text).unwrap();
            prop_assert_eq!(o.kind, Kind::Object);
            prop_assert!(o.depth <= MAX_DEPTH);
            prop_assert_eq!(o.order_id.as_deref(), Some(env.order_id.as_str()));
            prop_assert_eq!(o.event.as_deref(), Some(env.event.as_str()));
            prop_assert_eq!(o.seq, env.seq);
        }
    }
}
