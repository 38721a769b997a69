//! What identifies a dead letter in reports and events. Its own module,
//! below `progress`, because replay events name letters; `dlq` reads the
//! letters themselves and re-exports [`LetterRef`].

use std::fmt;

use serde::Serialize;
use shardline_contract::text::shown;

/// What identifies a letter in reports and events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LetterRef {
    /// `x-dead-letter-id`.
    pub id: Option<String>,
    /// `x-fail-reason`, `unknown` without one.
    pub reason: String,
    /// The envelope's order (or the `order_id` of a JSON body that is not one).
    pub order_id: Option<String>,
    pub seq: Option<u64>,
    /// `x-shard`.
    pub shard: Option<i64>,
}

impl LetterRef {
    /// The id, `-` without one.
    pub fn id(&self) -> &str {
        self.id.as_deref().unwrap_or("-")
    }
}

/// A letter as the dead-letter index describes it (its index id: a
/// letter the broker dead-lettered itself has a derived one).
impl From<&shardline_contract::letters::IndexEntry> for LetterRef {
    fn from(e: &shardline_contract::letters::IndexEntry) -> Self {
        Self {
            id: Some(e.id.clone()),
            reason: e.reason.clone(),
            order_id: e.order_id.clone(),
            seq: e.seq,
            shard: e.shard.map(i64::from),
        }
    }
}

/// `{id} reason=… order=… seq=… shard=…`, on one line whatever the letter
/// holds (its texts come from headers and bodies: hidden characters are
/// shown as escapes).
impl fmt::Display for LetterRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} reason={} order={} seq={} shard={}",
            shown(self.id()),
            shown(&self.reason),
            shown(self.order_id.as_deref().unwrap_or("-")),
            opt(self.seq),
            opt(self.shard)
        )
    }
}

/// `v`, or `-` for none.
pub(crate) fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn letter(
        id: &str,
        reason: &str,
        order: Option<&str>,
        seq: Option<u64>,
    ) -> LetterRef {
        LetterRef {
            id: Some(id.into()),
            reason: reason.into(),
            order_id: order.map(Into::into),
            seq,
            shard: Some(3),
        }
    }

    #[test]
    fn letters_describe_themselves_with_dashes_for_the_unknown() {
        assert_eq!(
            letter("d1", "handler", Some("A1"), Some(2)).to_string(),
            "d1 reason=handler order=A1 seq=2 shard=3"
        );
        let none = LetterRef {
            id: None,
            shard: None,
            ..letter("", "decode", None, None)
        };
        assert_eq!(none.to_string(), "- reason=decode order=- seq=- shard=-");
    }
}
