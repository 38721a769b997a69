//! [`DatabaseUrl`]: where the application's PostgreSQL is, parsed once and
//! shown redacted wherever it is printed; [`DatabaseUrl::connect`] opens a
//! client on it.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use shardline_connect::redact::{PERCENT_ENCODE, redact, scrub};
use tokio_postgres::{Client, NoTls};

use crate::error::{OutboxError, describe};

/// How long a connection attempt may take when the URL does not say
/// (`connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The `application_name` the connection shows in `pg_stat_activity` when
/// the URL does not set one.
const APPLICATION_NAME: &str = "shardline outbox";

/// A PostgreSQL URL (`postgres://user:password@host:5432/db`) or libpq
/// `key=value` string. Its [`fmt::Display`] and [`fmt::Debug`] show it with
/// the password hidden.
#[derive(Clone)]
pub struct DatabaseUrl {
    given: String,
    config: tokio_postgres::Config,
}

impl DatabaseUrl {
    /// `text` parsed, or [`OutboxError::Url`] naming it redacted.
    pub fn parse(text: &str) -> Result<Self, OutboxError> {
        let mut config: tokio_postgres::Config = text.parse().map_err(|e| OutboxError::Url {
            url: redact(text),
            cause: format!(
                "does not parse ({}); {PERCENT_ENCODE}",
                scrub(&describe(&e), text)
            ),
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name(APPLICATION_NAME);
        }
        Ok(Self {
            given: text.to_owned(),
            config,
        })
    }

    /// A client on the database, its connection driven by a task of its
    /// own that ends when the client is dropped. Plain TCP or a Unix socket:
    /// TLS to PostgreSQL is not built in.
    pub async fn connect(&self) -> Result<Client, OutboxError> {
        let (client, connection) = self.connect_raw().await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "the outbox database connection ended");
            }
        });
        Ok(client)
    }

    /// A client and its connection, the caller driving the connection
    /// (the relay reads its `NOTIFY`s from it).
    pub(crate) async fn connect_raw(
        &self,
    ) -> Result<
        (
            Client,
            tokio_postgres::Connection<tokio_postgres::Socket, tokio_postgres::tls::NoTlsStream>,
        ),
        OutboxError,
    > {
        self.config
            .connect(NoTls)
            .await
            .map_err(|e| OutboxError::Connect {
                url: self.to_string(),
                cause: self.scrub(&describe(&e)),
            })
    }

    /// `text` with this URL's password blanked out.
    fn scrub(&self, text: &str) -> String {
        let text = scrub(text, &self.given);
        match self.config.get_password() {
            Some(p) if !p.is_empty() => text.replace(&*String::from_utf8_lossy(p), "***"),
            _ => text,
        }
    }
}

impl FromStr for DatabaseUrl {
    type Err = OutboxError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.given))
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DatabaseUrl({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CANARY: &str = "Canary5Qx";

    #[test]
    fn a_url_shows_without_its_password() {
        let url = DatabaseUrl::parse(&format!("postgres://app:{CANARY}@db:5432/shop")).unwrap();
        assert_eq!(url.to_string(), "postgres://app:***@db:5432/shop");
        assert!(!format!("{url:?}").contains(CANARY));
        let pairs = DatabaseUrl::parse(&format!("host=db user=app password={CANARY}")).unwrap();
        assert_eq!(pairs.to_string(), "host=db user=app password=***");
    }

    #[test]
    fn a_url_that_does_not_parse_is_named_redacted() {
        let e = DatabaseUrl::parse(&format!("postgres://app:{CANARY}@db:port/shop")).unwrap_err();
        assert!(matches!(e, OutboxError::Url { .. }), "{e:?}");
        assert!(e.is_usage());
        assert_eq!(e.field(), Some("database_url"));
        let text = e.to_string();
        assert!(!text.contains(CANARY), "{text}");
        assert!(text.contains("postgres://app:***@db:port/shop"), "{text}");
    }

    #[tokio::test]
    async fn an_unreachable_database_is_named_redacted() {
        // Nothing listens on port 1.
        let url = DatabaseUrl::parse(&format!(
            "postgres://app:{CANARY}@127.0.0.1:1/shop?connect_timeout=5"
        ))
        .unwrap();
        let e = url.connect().await.unwrap_err();
        assert!(matches!(e, OutboxError::Connect { .. }), "{e:?}");
        assert!(!e.is_usage());
        let text = e.to_string();
        assert!(!text.contains(CANARY), "{text}");
        assert!(
            text.starts_with("cannot connect to PostgreSQL at postgres://app:***@127.0.0.1:1/shop"),
            "{text}"
        );
    }
}
