//! `cargo +nightly fuzz run decode`: the envelope decoder on arbitrary bytes.
//! It must never panic; whatever it accepts must obey the envelope rules
//! (docs/semantics.md §2), and its dedup key must be computable.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardline_contract::Envelope;
use shardline_contract::envelope::{MAX_FIELD_BYTES, MAX_SEQ};

/// The worker's default body limit.
const LIMIT: usize = 1 << 20;

fn check_field(name: &str, value: &str) {
    assert!(!value.is_empty(), "empty {name}");
    assert!(value.len() <= MAX_FIELD_BYTES, "{name} over the limit");
    assert!(
        !value.chars().any(char::is_control),
        "{name} with a control character: {value:?}"
    );
}

fuzz_target!(|data: &[u8]| {
    let Ok(envelope) = Envelope::parse(data, LIMIT) else {
        return;
    };
    check_field("order_id", &envelope.order_id);
    check_field("event", &envelope.event);
    if let Some(id) = &envelope.event_id {
        check_field("event_id", id);
    }
    if let Some(seq) = envelope.seq {
        assert!((1..=MAX_SEQ).contains(&seq), "seq {seq} out of range");
    }
    let key = envelope.dedup_key(data);
    assert!(key.len() >= envelope.order_id.len() + envelope.event.len() + 2);
});
