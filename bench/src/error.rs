//! What a measurement reports when it fails. Messages about settings name
//! their fields; a front end renames them (the CLI: to its flags) with
//! [`Error::rename_fields`].

use shardline_connect::{BrokerError, RedisError};
use shardline_publisher::PublishError;
use shardline_worker::{BindError, HandlerSpecError, WorkerError};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is unusable as given (a usage error, [`Error::is_usage`]);
    /// the message names the `fields` it mentions.
    #[error("{message}")]
    Setting {
        fields: &'static [&'static str],
        message: String,
    },
    /// What a setting points at failed (the `peer` program did not start
    /// or drain); the message names the `fields` it mentions.
    #[error("{message}")]
    Target {
        fields: &'static [&'static str],
        message: String,
    },
    /// A generated order id is no order id (its prefix: too long, a control
    /// character).
    #[error("order_prefix")]
    OrderPrefix(#[source] shardline_contract::OrderIdError),
    /// Declaring or removing the run's throwaway names failed.
    #[error(transparent)]
    Ops(Box<shardline_ops::Error>),
    #[error(transparent)]
    Publish(#[from] PublishError),
    #[error(transparent)]
    Connect(#[from] BrokerError),
    #[error(transparent)]
    Redis(#[from] RedisError),
    #[error(transparent)]
    RedisCommand(#[from] redis::RedisError),
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error(transparent)]
    Handler(#[from] HandlerSpecError),
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Join(#[from] tokio::task::JoinError),
    /// A measurement did not complete: a deadline passed, a process failed,
    /// the run was interrupted.
    #[error("{0}")]
    Failed(String),
    /// What was being done when `source` failed.
    #[error("{context}")]
    Context {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl From<shardline_ops::Error> for Error {
    fn from(e: shardline_ops::Error) -> Self {
        Self::Ops(Box::new(e))
    }
}

impl Error {
    pub(crate) fn setting(fields: &'static [&'static str], message: impl Into<String>) -> Self {
        Self::Setting {
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

    /// Whether a setting was refused as given, here or in the library that
    /// checked it: a front end reports a usage error (the command line
    /// exits 2), not a failed measurement.
    pub fn is_usage(&self) -> bool {
        match self {
            Self::Setting { .. } | Self::OrderPrefix(_) => true,
            Self::Ops(e) => e.is_usage(),
            Self::Worker(e) => e.is_usage(),
            Self::Handler(e) => e.is_usage(),
            _ => false,
        }
    }

    pub(crate) fn context<E>(context: impl Into<String>) -> impl FnOnce(E) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let context = context.into();
        move |source| Self::Context {
            context,
            source: Box::new(source),
        }
    }

    /// Whether the message names settings (or, for [`Error::Ops`], config
    /// fields) that [`Error::rename_fields`] renames.
    pub fn names_fields(&self) -> bool {
        matches!(
            self,
            Self::Setting { .. } | Self::Target { .. } | Self::OrderPrefix(_) | Self::Ops(_)
        )
    }

    /// The message with its causes, each field it names replaced by
    /// `rename(field)` (once, where the message names it).
    pub fn rename_fields(&self, rename: impl Fn(&str) -> String) -> String {
        let (text, fields): (String, &[&str]) = match self {
            Self::Ops(e) => return e.rename_fields(rename),
            Self::Setting { fields, .. } | Self::Target { fields, .. } => {
                (shardline_ops::error::chain(self), fields)
            }
            Self::OrderPrefix(_) => (shardline_ops::error::chain(self), &["order_prefix"]),
            _ => (shardline_ops::error::chain(self), &[]),
        };
        fields
            .iter()
            .fold(text, |text, field| text.replacen(field, &rename(field), 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_renamed_where_named() {
        let e = Error::setting(&["rate", "duration"], "rate × duration gives no events");
        assert!(e.names_fields());
        assert_eq!(
            e.rename_fields(|f| format!("--{f}")),
            "--rate × --duration gives no events"
        );
        assert!(e.is_usage());
        let peer = Error::target(&["peer"], "peer ./p: did not drain 10 events in time");
        assert!(!peer.is_usage());
        assert_eq!(
            peer.rename_fields(|f| format!("--{f}")),
            "--peer ./p: did not drain 10 events in time"
        );
        let failed = Error::Failed("rate too low".into());
        assert!(!failed.is_usage());
        assert!(!failed.names_fields());
        assert_eq!(failed.rename_fields(|f| format!("--{f}")), "rate too low");
    }
}
