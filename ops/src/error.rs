//! What an operation reports when it fails. Messages name config fields and
//! what failed, with passwords blanked out; a front end renames the fields
//! (the CLI: to its flags) with [`Error::rename_fields`].

use shardline_connect::{BrokerError, DeclareError, RedisError};
use shardline_publisher::PublishError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A config field is unusable as given, found before anything is
    /// done: a usage error ([`Error::is_usage`]). The message starts with
    /// the field and names the `fields` it mentions.
    #[error("{message}")]
    Config {
        fields: &'static [&'static str],
        message: String,
    },
    /// What a config field points at failed or refused it (the orders
    /// database did not answer, or could not prepare the orders query):
    /// named like [`Error::Config`], but found at run time.
    #[error("{message}")]
    Target {
        fields: &'static [&'static str],
        message: String,
    },
    #[error(transparent)]
    Connect(#[from] BrokerError),
    #[error(transparent)]
    Redis(#[from] RedisError),
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    #[error(transparent)]
    Publisher(#[from] PublishError),
    #[error(transparent)]
    Declare(#[from] DeclareError),
    /// A Redis command of an operation failed or did not answer in time.
    #[error("{what} in Redis {url}: {cause}")]
    RedisCommand {
        what: &'static str,
        url: String,
        cause: String,
    },
    /// Declaring or reading a queue failed.
    #[error("{context}")]
    Queue {
        context: String,
        #[source]
        source: DeclareError,
    },
    /// A broker operation (a channel, a get, an ack) failed.
    #[error("{context}")]
    Amqp {
        context: String,
        #[source]
        source: lapin::Error,
    },
    /// Publishing (a replay, a compensation) failed or was not confirmed.
    #[error("{context}")]
    Publish {
        context: String,
        #[source]
        source: PublishError,
    },
    /// The broker probe refused the operation: the line names the problem
    /// and the fix.
    #[error("{0}")]
    Refused(String),
    /// `dlq show`: no such letter.
    #[error("no dead letter with x-dead-letter-id {id}")]
    NotFound { id: String },
    /// `dlq::show_within`: the letter is not among the first `within`
    /// letters of the DLQ (it may be further back).
    #[error("dead letter {id} is not within the first {within} letters of the DLQ")]
    NotWithin { id: String, within: usize },
    /// The order database failed (connection, query, rows).
    #[error("orders database {url}: {cause}")]
    Orders { url: String, cause: String },
    /// A record (an audit entry, a run summary) could not be written as JSON.
    #[error("encoding {what}: {cause}")]
    Encode { what: &'static str, cause: String },
    /// An operation on the DLQ failed; `source` says how. `queue` is the
    /// DLQ's name, or what was done with it ("reading …").
    #[error("{queue} on {url}")]
    Dlq {
        queue: String,
        url: String,
        #[source]
        source: Box<Error>,
    },
}

impl Error {
    pub(crate) fn config(fields: &'static [&'static str], message: impl Into<String>) -> Self {
        Self::Config {
            fields,
            message: message.into(),
        }
    }

    pub(crate) fn target(fields: &'static [&'static str], message: impl Into<String>) -> Self {
        Self::Target {
            fields,
            message: message.into(),
        }
    }

    /// Whether the operation refused a setting as given ([`Error::Config`]):
    /// a front end reports a usage error (the command line exits 2), not a
    /// failure.
    pub fn is_usage(&self) -> bool {
        matches!(self, Self::Config { .. })
    }

    pub(crate) fn amqp(context: impl Into<String>) -> impl FnOnce(lapin::Error) -> Self {
        let context = context.into();
        move |source| Self::Amqp { context, source }
    }

    pub(crate) fn publish(context: impl Into<String>) -> impl FnOnce(PublishError) -> Self {
        let context = context.into();
        move |source| Self::Publish { context, source }
    }

    pub(crate) fn queue(context: impl Into<String>) -> impl FnOnce(DeclareError) -> Self {
        let context = context.into();
        move |source| Self::Queue { context, source }
    }

    /// No such dead letter (`dlq show`), here or as the cause of a DLQ error.
    pub fn is_not_found(&self) -> bool {
        match self {
            Self::NotFound { .. } => true,
            Self::Dlq { source, .. } => source.is_not_found(),
            _ => false,
        }
    }

    /// How far a bounded read looked for a letter it did not find
    /// (`dlq::show_within`), here or as the cause of a DLQ error.
    pub fn not_within(&self) -> Option<usize> {
        match self {
            Self::NotWithin { within, .. } => Some(*within),
            Self::Dlq { source, .. } => source.not_within(),
            _ => None,
        }
    }

    /// The message with its causes, each config field it names replaced by
    /// `rename(field)` (once, where the message names it).
    pub fn rename_fields(&self, rename: impl Fn(&str) -> String) -> String {
        let mut text = chain(self);
        if let Self::Config { fields, .. } | Self::Target { fields, .. } = self {
            for field in *fields {
                text = text.replacen(field, &rename(field), 1);
            }
        }
        text
    }
}

/// A setting refused as given, in a front end's words (the command line's:
/// naming its flag): a usage error, which the command line reports as clap
/// reports its own, exiting 2. Every other error is a failure (exit 1).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

pub use shardline_contract::text::chain;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_renamed_where_named_and_only_there() {
        let e = Error::config(
            &["grace", "window"],
            "grace (2m) must be shorter than window (24h) in the window",
        );
        assert_eq!(
            e.rename_fields(|f| format!("--{f}")),
            "grace (2m) must be shorter than window (24h) in the window"
                .replacen("grace", "--grace", 1)
                .replacen("window", "--window", 1)
        );
        let nested = Error::Dlq {
            queue: "q".into(),
            url: "amqp://h/".into(),
            source: Box::new(Error::NotFound { id: "x".into() }),
        };
        assert_eq!(
            nested.rename_fields(|f| f.into()),
            "q on amqp://h/: no dead letter with x-dead-letter-id x"
        );
        assert!(nested.is_not_found());
        assert!(!Error::Refused("no".into()).is_not_found());
        let beyond = Error::Dlq {
            queue: "q".into(),
            url: "amqp://h/".into(),
            source: Box::new(Error::NotWithin {
                id: "x".into(),
                within: 3,
            }),
        };
        assert_eq!(beyond.not_within(), Some(3));
        assert!(
            !beyond.is_not_found(),
            "beyond the bound is not \"not found\""
        );
        assert_eq!(nested.not_within(), None);
    }

    #[test]
    fn only_a_setting_refused_as_given_is_a_usage_error() {
        assert!(Error::config(&["rate"], "rate must be above 0").is_usage());
        let target = Error::target(
            &["orders_url"],
            "orders_url postgres://db/o: cannot connect",
        );
        assert!(!target.is_usage());
        assert_eq!(
            target.rename_fields(|f| format!("--{}", f.replace('_', "-"))),
            "--orders-url postgres://db/o: cannot connect"
        );
        assert!(!Error::Refused("classic single-active-consumer".into()).is_usage());
    }
}
