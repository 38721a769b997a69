//! The audit log: every operator action the console performs, who did it
//! (a token's name) and what, newest first in one capped Redis list
//! ([`shardline_contract::Keys::audit`]). The console records; any front end
//! may read.

use serde::{Deserialize, Serialize};
use shardline_contract::status::unix_ms;

use crate::{Error, Fleet, capped};

/// Entries the log keeps: a record beyond them drops the oldest.
pub const CAP: usize = 1000;

/// The action of an entry read back that does not parse; its `detail`
/// holds the stored text (cut) and why it did not parse.
pub const UNREADABLE: &str = "unreadable";

/// Characters of an unreadable entry's text kept in its `detail`.
const EXCERPT_CHARS: usize = 200;

/// Bytes an entry may take as stored: a larger `detail` is kept as an
/// excerpt of its first 500 characters with its size, so that no caller can
/// grow the log beyond [`CAP`] × this.
pub const MAX_ENTRY_BYTES: usize = 4096;

/// Characters of an oversize `detail` kept, as JSON text (with the who and
/// action cut to [`NAME_CHARS`], even characters JSON writes as six bytes
/// keep the entry within [`MAX_ENTRY_BYTES`]).
const DETAIL_EXCERPT_CHARS: usize = 500;

/// Characters of an oversize entry's who and action kept.
const NAME_CHARS: usize = 50;

/// One operator action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// When, Unix ms.
    pub at_ms: u64,
    /// Who: the name of the token the action came with.
    pub who: String,
    /// What, in a word or two (`replay`, `release`, `purge`…).
    pub action: String,
    /// The action's arguments and outcome, as the caller describes them.
    pub detail: serde_json::Value,
}

impl AuditEntry {
    /// An entry stamped with the current time.
    pub fn now(who: &str, action: &str, detail: serde_json::Value) -> Self {
        Self {
            at_ms: unix_ms(),
            who: who.to_owned(),
            action: action.to_owned(),
            detail,
        }
    }

    /// The entry stored as `text`; one of action [`UNREADABLE`] when it does
    /// not parse, so that one bad entry never hides the others.
    fn parse(text: &str) -> Self {
        serde_json::from_str(text).unwrap_or_else(|e| Self {
            at_ms: 0,
            who: String::new(),
            action: UNREADABLE.into(),
            detail: serde_json::json!({
                "text": capped::excerpt(text, EXCERPT_CHARS),
                "error": e.to_string(),
            }),
        })
    }
}

/// Appends `entry` to the fleet's audit log (the oldest entries beyond
/// [`CAP`] go).
pub async fn record(fleet: &Fleet, entry: &AuditEntry) -> Result<(), Error> {
    let text = stored(entry)?;
    capped::push(
        fleet,
        &fleet.keys.audit(),
        &text,
        CAP,
        "writing the audit log",
    )
    .await
}

/// `entry` as stored: at most [`MAX_ENTRY_BYTES`] (the who and action of
/// the console's entries are short; an oversize `detail` becomes
/// `{"excerpt": …, "bytes": n}`).
fn stored(entry: &AuditEntry) -> Result<String, Error> {
    let encode = |entry: &AuditEntry| {
        serde_json::to_string(entry).map_err(|e| Error::Encode {
            what: "an audit entry",
            cause: e.to_string(),
        })
    };
    let text = encode(entry)?;
    if text.len() <= MAX_ENTRY_BYTES {
        return Ok(text);
    }
    let detail = entry.detail.to_string();
    let cut = AuditEntry {
        who: capped::excerpt(&entry.who, NAME_CHARS),
        action: capped::excerpt(&entry.action, NAME_CHARS),
        detail: serde_json::json!({
            "excerpt": capped::excerpt(&detail, DETAIL_EXCERPT_CHARS),
            "bytes": detail.len(),
        }),
        ..entry.clone()
    };
    encode(&cut)
}

/// The `limit` newest entries (at most [`CAP`]), newest first.
pub async fn recent(fleet: &Fleet, limit: usize) -> Result<Vec<AuditEntry>, Error> {
    let texts = capped::newest(
        fleet,
        &fleet.keys.audit(),
        limit,
        CAP,
        "reading the audit log",
    )
    .await?;
    Ok(texts.iter().map(|t| AuditEntry::parse(t)).collect())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_oversize_entry_is_stored_as_an_excerpt_with_its_size() {
        let small = AuditEntry::now("ops", "replay", serde_json::json!({"group": "0a1b"}));
        assert_eq!(
            stored(&small).unwrap(),
            serde_json::to_string(&small).unwrap()
        );
        let huge = "\u{1}".repeat(1_500_000);
        let entry = AuditEntry::now(&huge, "replay", serde_json::json!({"note": huge}));
        let text = stored(&entry).unwrap();
        assert!(text.len() <= MAX_ENTRY_BYTES, "{} bytes", text.len());
        let back = AuditEntry::parse(&text);
        assert_eq!(back.action, "replay");
        assert_eq!(back.detail["bytes"], 6 * 1_500_000 + r#"{"note":""}"#.len());
        assert!(
            back.detail["excerpt"]
                .as_str()
                .unwrap()
                .starts_with(r#"{"note":"\u0001"#)
        );
    }

    #[test]
    fn an_entry_reads_back_as_written_and_garbage_as_unreadable() {
        let entry = AuditEntry::now("ops", "replay", serde_json::json!({"group": "0a1b"}));
        assert!(entry.at_ms > 0);
        let text = serde_json::to_string(&entry).unwrap();
        assert_eq!(AuditEntry::parse(&text), entry);

        let garbage = format!("{{\"who\": 1, {}", "x".repeat(300));
        let unreadable = AuditEntry::parse(&garbage);
        assert_eq!(unreadable.action, UNREADABLE);
        assert_eq!((unreadable.at_ms, unreadable.who.as_str()), (0, ""));
        let kept = unreadable.detail["text"].as_str().unwrap();
        assert_eq!(kept.chars().count(), EXCERPT_CHARS + 1, "{kept}");
        assert!(kept.ends_with('…'));
        assert!(unreadable.detail["error"].as_str().is_some());
    }
}
