//! What installing or reaching the outbox reports when it fails: messages
//! name what failed, with passwords blanked out; [`OutboxError::field`] says
//! which setting a front end should name (the CLI: its flag).

/// Why the outbox could not be reached or installed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The schema name is not one the outbox accepts (see [`crate::Schema`]).
    #[error("schema {name:?}: {reason}")]
    InvalidSchema { name: String, reason: &'static str },
    /// The database URL does not parse; `url` is shown redacted.
    #[error("PostgreSQL address `{url}`: {cause}")]
    Url { url: String, cause: String },
    /// The database did not answer or refused the connection.
    #[error("cannot connect to PostgreSQL at {url}: {cause}")]
    Connect { url: String, cause: String },
    /// The server is older than the outbox needs (`gen_random_uuid()` is
    /// built in from PostgreSQL 13).
    #[error("PostgreSQL {found} is too old: the outbox needs 13 or newer")]
    Unsupported { found: String },
    /// The schema holds a newer outbox than this shardline knows: it is
    /// left as it is.
    #[error(
        "schema {schema} holds outbox version {found}, newer than this shardline's ({supported}): upgrade shardline"
    )]
    Newer {
        schema: String,
        found: i32,
        supported: i32,
    },
    /// A statement failed; `what` says which step.
    #[error("{what} in schema {schema}: {cause}")]
    Database {
        what: &'static str,
        schema: String,
        cause: String,
    },
}

impl OutboxError {
    /// The setting the error is about (`database_url`, `schema`), for a
    /// front end to name as it calls it; `None` for what failed in the
    /// database itself.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            Self::InvalidSchema { .. } => Some("schema"),
            Self::Url { .. } | Self::Connect { .. } => Some("database_url"),
            _ => None,
        }
    }

    /// Whether a setting was refused as given, before anything was done: a
    /// usage error, not a failure.
    pub fn is_usage(&self) -> bool {
        matches!(self, Self::InvalidSchema { .. } | Self::Url { .. })
    }
}

/// A PostgreSQL error on one line: the server's message with its detail and
/// hint, or the client's error with its causes.
pub(crate) fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut text = format!("{}: {}", db.severity(), db.message());
        if let Some(detail) = db.detail() {
            text.push_str(&format!(" ({detail})"));
        }
        if let Some(hint) = db.hint() {
            text.push_str(&format!("; hint: {hint}"));
        }
        return text;
    }
    shardline_contract::text::chain(e).replace('\n', " ")
}
