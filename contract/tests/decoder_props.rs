//! Properties of the envelope decoder (docs/semantics.md §2): it never panics, whatever the
//! bytes; whatever it accepts obeys the envelope rules; and the dedup key tells
//! different events apart.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use serde_json::{Map, Value};
use shardline_contract::envelope::{MAX_FIELD_BYTES, MAX_SEQ};
use shardline_contract::{Envelope, EnvelopeError, OrderId};

/// The worker's default body limit.
const LIMIT: usize = 1 << 20;

/// The rules every accepted envelope satisfies.
fn check_rules(env: &Envelope) -> Result<(), TestCaseError> {
    for (name, field) in [("order_id", env.order_id.as_str()), ("event", &env.event)] {
        prop_assert!(!field.is_empty(), "{name} empty: {env:?}");
        prop_assert!(field.len() <= MAX_FIELD_BYTES, "{name} too long: {env:?}");
        prop_assert!(
            !field.chars().any(char::is_control),
            "{name} has a control character: {env:?}"
        );
    }
    if let Some(id) = &env.event_id {
        prop_assert!(!id.is_empty() && id.len() <= MAX_FIELD_BYTES, "{env:?}");
        prop_assert!(!id.chars().any(char::is_control), "{env:?}");
    }
    if let Some(seq) = env.seq {
        prop_assert!((1..=MAX_SEQ).contains(&seq), "seq out of range: {env:?}");
    }
    Ok(())
}

/// Parses `body`, checks the rules on success, and computes the dedup key (which
/// must not panic either).
fn parse_and_check(body: &[u8], limit: usize) -> Result<(), TestCaseError> {
    match Envelope::parse(body, limit) {
        Ok(env) => {
            prop_assert!(body.len() <= limit);
            check_rules(&env)?;
            let key = env.dedup_key(body);
            prop_assert!(key.starts_with(&escape(&env.order_id)), "{key}");
        }
        Err(EnvelopeError::Decode(msg) | EnvelopeError::Invalid(msg)) => {
            prop_assert!(!msg.is_empty());
        }
    }
    Ok(())
}

fn escape(field: &str) -> String {
    field.replace('%', "%25").replace(':', "%3A")
}

/// Strings that stress the field rules: empty, control characters, separators,
/// multi-byte characters, around the 256-byte limit.
fn field_string() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-zA-Z0-9.:%_-]{0,12}",
        2 => any::<String>(),
        1 => Just(String::new()),
        1 => "[\\x00-\\x1f\\x7f\\u{80}-\\u{9f}a]{1,4}",
        1 => (250usize..260).prop_map(|n| "x".repeat(n)),
        1 => (60usize..70).prop_map(|n| "注".repeat(n)),
    ]
}

/// JSON numbers around the `seq` bounds, and others.
fn json_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        (-2i64..3).prop_map(Value::from),
        Just(Value::from(MAX_SEQ)),
        Just(Value::from(MAX_SEQ + 1)),
        Just(Value::from(u64::MAX)),
        Just(Value::from(1.0)),
    ]
}

/// A JSON value of any type, small.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        json_number(),
        field_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// An envelope-ish object: each envelope field absent or of a random JSON type,
/// biased towards the right type, plus an unknown field now and then.
fn envelope_object() -> impl Strategy<Value = Value> {
    let text = || {
        prop::option::weighted(
            0.85,
            prop_oneof![
                4 => field_string().prop_map(Value::String),
                1 => json_value(),
            ],
        )
    };
    let number = || prop::option::weighted(0.5, prop_oneof![4 => json_number(), 1 => json_value()]);
    (
        text(),
        text(),
        number(),
        number(),
        prop::option::weighted(0.3, json_value()),
        prop::option::weighted(0.3, json_value()),
    )
        .prop_map(|(order_id, event, seq, version, event_id, data)| {
            let mut object = Map::new();
            for (name, value) in [
                ("order_id", order_id),
                ("event", event),
                ("seq", seq),
                ("version", version),
                ("event_id", event_id),
                ("data", data),
            ] {
                if let Some(value) = value {
                    object.insert(name.to_owned(), value);
                }
            }
            Value::Object(object)
        })
}

/// Serialized text with a mutation now and then: truncated, a byte flipped, or a
/// duplicated key spliced in.
fn mutated(body: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let len = body.len();
    prop_oneof![
        3 => Just(body.clone()),
        1 => (0..=len).prop_map({
            let body = body.clone();
            move |cut| body[..cut].to_vec()
        }),
        1 => (0..len.max(1), any::<u8>()).prop_map({
            let body = body.clone();
            move |(at, byte)| {
                let mut b = body.clone();
                if let Some(slot) = b.get_mut(at) {
                    *slot = byte;
                }
                b
            }
        }),
        1 => Just({
            // `{"seq":1,` + rest: a duplicate key when the object has `seq`.
            let mut b = br#"{"seq":1,"#.to_vec();
            if body.len() > 2 {
                b.extend_from_slice(&body[1..]);
            } else {
                b.push(b'}');
            }
            b
        }),
    ]
}

proptest! {
    #[test]
    fn never_panics_on_arbitrary_bytes(body in prop::collection::vec(any::<u8>(), 0..512)) {
        parse_and_check(&body, LIMIT)?;
    }

    #[test]
    fn never_panics_on_envelope_like_json(
        body in envelope_object()
            .prop_map(|v| serde_json::to_vec(&v).unwrap())
            .prop_flat_map(mutated),
        limit in prop_oneof![4 => Just(LIMIT), 1 => 0usize..64],
    ) {
        parse_and_check(&body, limit)?;
    }

    /// A well-typed object is accepted exactly when the rules of docs/semantics.md §2 hold.
    #[test]
    fn accepts_exactly_the_valid_envelopes(
        order_id in field_string(),
        event in field_string(),
        seq in prop::option::of(json_number()),
        as_version in any::<bool>(),
    ) {
        let mut object = Map::new();
        object.insert("order_id".into(), order_id.clone().into());
        object.insert("event".into(), event.clone().into());
        if let Some(seq) = &seq {
            object.insert(if as_version { "version" } else { "seq" }.into(), seq.clone());
        }
        let body = serde_json::to_vec(&Value::Object(object)).unwrap();
        let field_ok = |f: &str| {
            !f.is_empty() && f.len() <= MAX_FIELD_BYTES && !f.chars().any(char::is_control)
        };
        // `null` (what a NaN float serializes to) counts as absent.
        let seq = seq.filter(|n| !n.is_null());
        let seq_ok = seq.as_ref().is_none_or(|n| {
            n.as_u64().is_some_and(|s| (1..=MAX_SEQ).contains(&s))
        });
        let expect_ok = field_ok(&order_id) && field_ok(&event) && seq_ok;
        match Envelope::parse(&body, LIMIT) {
            Ok(env) => {
                prop_assert!(expect_ok, "accepted {}", String::from_utf8_lossy(&body));
                prop_assert_eq!(&env.order_id, &order_id);
                prop_assert_eq!(&env.event, &event);
                prop_assert_eq!(env.seq, seq.as_ref().and_then(Value::as_u64));
                check_rules(&env)?;
            }
            Err(EnvelopeError::Invalid(_)) => {
                prop_assert!(!expect_ok, "rejected {}", String::from_utf8_lossy(&body));
            }
            Err(e) => prop_assert!(false, "valid JSON gave {e:?}"),
        }
    }

    /// Different `(order_id, event, seq)` triples never share a dedup key, even
    /// when the fields are made of the separators `:` and `%`.
    #[test]
    fn dedup_keys_of_different_triples_differ(
        a in ("[a:%3A5]{1,6}", "[a:%3A5]{1,6}", 1..=MAX_SEQ),
        b in ("[a:%3A5]{1,6}", "[a:%3A5]{1,6}", 1..=MAX_SEQ),
        body_a in prop::collection::vec(any::<u8>(), 0..8),
        body_b in prop::collection::vec(any::<u8>(), 0..8),
    ) {
        let env = |(order_id, event, seq): &(String, String, u64)| Envelope {
            order_id: OrderId::new(order_id.clone()).unwrap(),
            event: event.clone(),
            seq: Some(*seq),
            event_id: None,
        };
        let (ka, kb) = (env(&a).dedup_key(&body_a), env(&b).dedup_key(&body_b));
        if a == b {
            prop_assert_eq!(ka, kb, "the key depends on the triple only");
        } else {
            prop_assert_ne!(ka, kb, "{:?} and {:?}", a, b);
        }
    }

    /// Same for events without seq, keyed by `event_id`.
    #[test]
    fn dedup_keys_of_different_event_ids_differ(
        a in ("[a:%3A]{1,4}", "[a:%3A]{1,4}", "[a:%3A5]{1,4}"),
        b in ("[a:%3A]{1,4}", "[a:%3A]{1,4}", "[a:%3A5]{1,4}"),
    ) {
        let env = |(order_id, event, id): &(String, String, String)| Envelope {
            order_id: OrderId::new(order_id.clone()).unwrap(),
            event: event.clone(),
            seq: None,
            event_id: Some(id.clone()),
        };
        let (ka, kb) = (env(&a).dedup_key(b""), env(&b).dedup_key(b""));
        prop_assert_eq!(a == b, ka == kb, "{:?} vs {:?}: {} / {}", a, b, ka, kb);
    }

    /// Parsed from JSON, the same holds end to end.
    #[test]
    fn parsed_dedup_keys_differ(
        a in ("[a:%]{1,4}", "[a:%]{1,4}", 1..=MAX_SEQ),
        b in ("[a:%]{1,4}", "[a:%]{1,4}", 1..=MAX_SEQ),
    ) {
        let key = |(order_id, event, seq): &(String, String, u64)| {
            let body = serde_json::to_vec(&serde_json::json!({
                "order_id": order_id, "event": event, "seq": seq
            }))
            .unwrap();
            Envelope::parse(&body, LIMIT).unwrap().dedup_key(&body)
        };
        prop_assert_eq!(a == b, key(&a) == key(&b));
    }
}

/// docs/semantics.md §3: a body that is not UTF-8 is a `decode` failure. The decoder validates
/// UTF-8 only in the strings it reads, not in the fields it skips, so invalid
/// UTF-8 in `data` (or any unknown field) is accepted and handed to the handler.
/// Ignored until the decoder checks the whole body.
#[test]
fn invalid_utf8_anywhere_is_a_decode_error() {
    for body in [
        &b"{\"order_id\":\"A\",\"event\":\"e\",\"seq\":1,\"data\":\"\xff\"}"[..],
        b"{\"order_id\":\"A\",\"event\":\"e\",\"x\xff\":1}",
    ] {
        assert!(
            matches!(Envelope::parse(body, LIMIT), Err(EnvelopeError::Decode(_))),
            "{:?} => {:?}",
            String::from_utf8_lossy(body),
            Envelope::parse(body, LIMIT)
        );
    }
}
