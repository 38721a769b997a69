//! `cargo +nightly fuzz run decode`: the envelope decoder and the streaming
//! outline on arbitrary bytes. Neither may panic; whatever the decoder
//! accepts must obey the envelope rules (docs/semantics.md §2): an object
//! nested at most `MAX_DEPTH` deep whose outline names the same order, event
//! and seq; and its dedup key must be computable.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardline_contract::envelope::{MAX_DEPTH, MAX_FIELD_BYTES, MAX_SEQ};
use shardline_contract::outline::Kind;
use shardline_contract::{Envelope, Outline};

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
    let outline = Outline::of(data);
    let Ok(envelope) = Envelope::parse(data, LIMIT) else {
        return;
    };
    let Some(outline) = outline else {
        panic!("accepted a body the outline does not read");
    };
    assert_eq!(outline.kind, Kind::Object);
    assert!(outline.depth <= MAX_DEPTH, "accepted {} levels", outline.depth);
    assert_eq!(outline.order_id.as_deref(), Some(envelope.order_id.as_str()));
    assert_eq!(outline.event.as_deref(), Some(envelope.event.as_str()));
    assert_eq!(outline.seq, envelope.seq);
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
