//! [`Schema`]: the PostgreSQL schema the outbox lives in, a name checked once
//! ([`validate_schema`], the only door) and quoted wherever SQL names it.

use std::fmt;
use std::str::FromStr;

use crate::error::OutboxError;

/// The schema of an outbox when none is given.
pub const DEFAULT_SCHEMA: &str = "public";

/// PostgreSQL cuts identifiers at 63 bytes (`NAMEDATALEN` − 1).
const MAX_NAME_BYTES: usize = 63;

/// A schema name the outbox accepts: 1 to 63 bytes of lower-case ASCII
/// letters, digits and `_`, starting with a letter or `_`, not `pg_…`.
///
/// Narrower than PostgreSQL allows, on purpose: an application calls
/// `myschema.shardline_outbox_append(…)` unquoted, and PostgreSQL folds an
/// unquoted name to lower case, so a name with capitals or other characters
/// would only work quoted; `pg_…` names are reserved for the system.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Schema(String);

/// `name` as a [`Schema`], or [`OutboxError::InvalidSchema`] saying why not.
pub fn validate_schema(name: &str) -> Result<Schema, OutboxError> {
    let refuse = |reason: &'static str| OutboxError::InvalidSchema {
        name: name.to_owned(),
        reason,
    };
    let Some(first) = name.chars().next() else {
        return Err(refuse("a schema name cannot be empty"));
    };
    if name.len() > MAX_NAME_BYTES {
        return Err(refuse("PostgreSQL cuts names at 63 bytes"));
    }
    if !(first.is_ascii_lowercase() || first == '_') {
        return Err(refuse("it must start with a lower-case letter or `_`"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(refuse(
            "only lower-case ASCII letters, digits and `_` (PostgreSQL folds unquoted names to lower case)",
        ));
    }
    if name.starts_with("pg_") {
        return Err(refuse(
            "names starting with `pg_` are reserved for PostgreSQL",
        ));
    }
    Ok(Schema(name.to_owned()))
}

impl Schema {
    /// The name as given (`public`).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as an SQL identifier (`"public"`): quoted, so that a name
    /// that is also a keyword (`user`, `order`) is still a name.
    pub fn quoted(&self) -> String {
        quote_identifier(&self.0)
    }

    /// One of the outbox's own objects (plain lower-case names, none a
    /// keyword) in this schema, as SQL names it: `"public".shardline_outbox`.
    pub fn qualify(&self, object: &str) -> String {
        format!("{}.{object}", self.quoted())
    }

    /// The name as an SQL string literal (`'public'`).
    pub fn literal(&self) -> String {
        quote_literal(&self.0)
    }
}

impl Default for Schema {
    fn default() -> Self {
        Self(DEFAULT_SCHEMA.to_owned())
    }
}

impl FromStr for Schema {
    type Err = OutboxError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        validate_schema(s)
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.quoted())
    }
}

impl fmt::Debug for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Schema({})", self.quoted())
    }
}

/// `name` as an SQL identifier: in double quotes, a `"` doubled.
pub(crate) fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `text` as an SQL string literal: in single quotes, a `'` doubled.
pub(crate) fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_lower_case_name_is_a_schema() {
        for name in ["public", "shop", "_private", "orders_2", "user", "a"] {
            let schema = validate_schema(name).unwrap();
            assert_eq!(schema.as_str(), name);
        }
        assert_eq!(Schema::default().as_str(), "public");
        assert_eq!("shop".parse::<Schema>().unwrap().as_str(), "shop");
        assert!(validate_schema(&"s".repeat(63)).is_ok());
    }

    #[test]
    fn other_names_are_refused_saying_why() {
        for (name, why) in [
            ("", "empty"),
            ("Shop", "start with a lower-case letter"),
            ("1shop", "start with a lower-case letter"),
            ("shop-eu", "only lower-case ASCII"),
            ("shop\"; drop table orders; --", "only lower-case ASCII"),
            ("shöp", "only lower-case ASCII"),
            ("my schema", "only lower-case ASCII"),
            ("pg_catalog", "reserved"),
            (&"s".repeat(64), "63 bytes"),
        ] {
            let e = validate_schema(name).unwrap_err();
            assert!(matches!(e, OutboxError::InvalidSchema { .. }), "{e:?}");
            assert!(e.to_string().contains(why), "{name:?}: {e}");
        }
    }

    #[test]
    fn names_are_quoted_for_sql() {
        let schema = validate_schema("user").unwrap();
        assert_eq!(schema.quoted(), "\"user\"");
        assert_eq!(schema.to_string(), "\"user\"");
        assert_eq!(
            schema.qualify("shardline_outbox"),
            "\"user\".shardline_outbox"
        );
        assert_eq!(schema.literal(), "'user'");
        assert_eq!(quote_identifier("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
