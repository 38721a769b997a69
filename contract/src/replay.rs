//! Replay records: the proof that a replayed event is one the operator tools
//! made (docs/semantics.md §3, "Replays").
//!
//! A replay passes the sequence gate and may lead its order out of
//! quarantine, so a header alone cannot be the proof: any publisher can set
//! one. Before it republishes a dead letter, the replay tool writes a record
//! under [`crate::Keys::replay_record`] (the letter's id) whose value is
//! [`record`] of the event, and marks the event with that id
//! ([`crate::headers::REPLAY`]). The worker honours the marker only when the
//! record holds the same value for the event it received; the commit or the
//! new dead letter deletes the record in the same script, so a record admits
//! one replay (its redeliveries before the commit included).

use std::fmt::Write as _;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::Envelope;

/// How long a replay record waits for its event: the worker's default
/// `--dedup-ttl`. A replayed event that reaches a worker later is gated
/// like a fresh one.
pub const RECORD_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// The record's value for a replayed event: its order, its seq (or, without
/// one, its kind) and the SHA-256 of its body, so that no other event —
/// another order's, another seq, the same seq with another body — matches it.
///
/// `v1:{order key}:s{seq}:{sha256}` or `v1:{order key}:k{kind}:{sha256}`;
/// the order key and the kind have `%` and `:` escaped, so the fields never
/// run into each other.
pub fn record(envelope: &Envelope, body: &[u8]) -> String {
    let mut out = format!("v1:{}:", envelope.order_key());
    match envelope.seq {
        Some(seq) => {
            let _ = write!(out, "s{seq}");
        }
        None => {
            out.push('k');
            out.push_str(&crate::order_id::key_field(&envelope.event));
        }
    }
    out.push(':');
    for byte in Sha256::digest(body) {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(body: &[u8]) -> Envelope {
        Envelope::parse(body, 1 << 20).unwrap()
    }

    #[test]
    fn the_record_names_the_order_the_seq_and_the_body() {
        let body = br#"{"order_id":"A:1","event":"paid","seq":3}"#;
        let r = record(&envelope(body), body);
        assert!(r.starts_with("v1:A%3A1:s3:"), "{r}");
        // python3: hashlib.sha256(b'{"order_id":"A:1","event":"paid","seq":3}').hexdigest()
        assert_eq!(r.len(), "v1:A%3A1:s3:".len() + 64);
    }

    #[test]
    fn another_order_seq_or_body_never_matches() {
        let body = br#"{"order_id":"A","event":"paid","seq":3}"#;
        let base = record(&envelope(body), body);
        for other in [
            &br#"{"order_id":"B","event":"paid","seq":3}"#[..],
            br#"{"order_id":"A","event":"paid","seq":4}"#,
            br#"{"order_id":"A","event":"paid","seq":3,"data":1}"#,
            br#"{"order_id":"A", "event":"paid","seq":3}"#,
        ] {
            assert_ne!(record(&envelope(other), other), base, "{other:?}");
        }
        assert_eq!(record(&envelope(body), body), base);
    }

    #[test]
    fn an_unsequenced_event_is_recorded_by_its_kind() {
        let body = br#"{"order_id":"A","event":"note:added","event_id":"e1"}"#;
        let r = record(&envelope(body), body);
        assert!(r.starts_with("v1:A:knote%3Aadded:"), "{r}");
    }
}
