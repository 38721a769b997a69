//! [`OrderId`]: what a valid order id is, decided in one place. Its
//! constructor is the only door: an envelope's `order_id`, a `--order-id`
//! flag, a published event and a dead-letter filter all pass through it, and
//! its refusal is the text a dead letter carries (`invalid`).

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize};

/// Longest `order_id`, `event` or `event_id`, in bytes: they travel in Redis keys
/// and HTTP headers.
pub const MAX_FIELD_BYTES: usize = 256;

/// Any field with `%` and `:` escaped, so that it cannot split a `:`-separated
/// Redis key.
pub fn key_field(field: &str) -> String {
    let mut key = String::with_capacity(field.len());
    escape_into(&mut key, field);
    key
}

pub(crate) fn escape_into(out: &mut String, field: &str) {
    for c in field.chars() {
        match c {
            '%' => out.push_str("%25"),
            ':' => out.push_str("%3A"),
            c => out.push(c),
        }
    }
}

/// An order id: 1 to [`MAX_FIELD_BYTES`] bytes of text without control
/// characters (it travels in Redis keys and HTTP headers). Reads as a `&str`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct OrderId(String);

/// Why a text is not an order id; its display is the dead letter's `x-error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OrderIdError {
    #[error("`order_id` is empty")]
    Empty,
    #[error("`order_id` is {0} bytes, over the {MAX_FIELD_BYTES}-byte limit")]
    TooLong(usize),
    #[error("`order_id` contains a control character")]
    Control,
}

impl OrderId {
    /// `id` as an order id, when it is one.
    pub fn new(id: impl Into<String>) -> Result<Self, OrderIdError> {
        let id = id.into();
        if id.is_empty() {
            return Err(OrderIdError::Empty);
        }
        if id.len() > MAX_FIELD_BYTES {
            return Err(OrderIdError::TooLong(id.len()));
        }
        if id.chars().any(char::is_control) {
            return Err(OrderIdError::Control);
        }
        Ok(Self(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as it appears in Redis keys: `%` and `:` escaped.
    pub fn key(&self) -> OrderKey {
        OrderKey(key_field(&self.0))
    }
}

/// An order's key: its [`OrderId`] with `%` and `:` escaped, as it appears in
/// Redis keys and as the worker's gate, order state and quarantine name the
/// order. Made only from an `OrderId` ([`OrderId::key`]); reads as a `&str`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OrderKey(String);

impl OrderKey {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for OrderKey {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for OrderKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for OrderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<OrderKey> for String {
    fn from(key: OrderKey) -> Self {
        key.0
    }
}

impl PartialEq<str> for OrderKey {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for OrderKey {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl Deref for OrderId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for OrderId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for OrderId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for OrderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for OrderId {
    type Err = OrderIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for OrderId {
    type Error = OrderIdError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl TryFrom<&str> for OrderId {
    type Error = OrderIdError;

    fn try_from(s: &str) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl From<OrderId> for String {
    fn from(id: OrderId) -> Self {
        id.0
    }
}

impl PartialEq<str> for OrderId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for OrderId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for OrderId {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl<'de> Deserialize<'de> for OrderId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let id = String::deserialize(deserializer)?;
        Self::new(id).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_constructor_is_the_only_door() {
        assert_eq!(OrderId::new("A1024").unwrap(), "A1024");
        assert_eq!(OrderId::new("注文-42").unwrap().as_str(), "注文-42");
        assert_eq!(OrderId::new(""), Err(OrderIdError::Empty));
        assert_eq!(
            OrderId::new("x".repeat(MAX_FIELD_BYTES + 1)),
            Err(OrderIdError::TooLong(MAX_FIELD_BYTES + 1))
        );
        assert!(OrderId::new("x".repeat(MAX_FIELD_BYTES)).is_ok());
        for control in ["A\u{7}", "A\nB", "\u{0}", "A\u{9f}"] {
            assert_eq!(
                OrderId::new(control),
                Err(OrderIdError::Control),
                "{control:?}"
            );
        }
    }

    #[test]
    fn refusals_read_as_the_dead_letters_reason() {
        assert_eq!(OrderIdError::Empty.to_string(), "`order_id` is empty");
        assert_eq!(
            OrderIdError::TooLong(300).to_string(),
            "`order_id` is 300 bytes, over the 256-byte limit"
        );
        assert_eq!(
            OrderIdError::Control.to_string(),
            "`order_id` contains a control character"
        );
    }

    #[test]
    fn its_key_escapes_what_would_split_a_redis_key() {
        assert_eq!(OrderId::new("A:1%").unwrap().key(), "A%3A1%25");
    }

    #[test]
    fn json_goes_through_the_same_door() {
        let id: OrderId = serde_json::from_str("\"A1\"").unwrap();
        assert_eq!(id, "A1");
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"A1\"");
        let refused = serde_json::from_str::<OrderId>("\"\"").unwrap_err();
        assert!(
            refused.to_string().contains("`order_id` is empty"),
            "{refused}"
        );
    }
}
