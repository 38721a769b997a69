//! Connecting to Redis: the one place a Redis address is parsed, a connection
//! or a pool is opened, and a Redis error is made fit to print (password
//! redacted, one line).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::broker::{redact_url, scrub};

/// How long a command-line tool waits for Redis to answer before giving up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, thiserror::Error)]
pub enum RedisError {
    /// The address is not a Redis URL, or Redis refused or failed.
    #[error("Redis {url}: {cause}")]
    Failed { url: String, cause: String },
    /// Redis did not answer within [`CONNECT_TIMEOUT`].
    #[error("Redis {url}: no answer within 5 s")]
    Timeout { url: String },
}

/// Where Redis is: a `redis://` or `rediss://` (TLS) URL; a path `/N` selects
/// database N.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTarget {
    url: String,
}

impl RedisTarget {
    /// Checks that `url` is a Redis URL the client understands.
    pub fn parse(url: &str) -> Result<Self, RedisError> {
        let target = Self {
            url: url.to_owned(),
        };
        redis::Client::open(url).map_err(|e| target.error(&e))?;
        Ok(target)
    }

    /// The URL as given (with its password: for clients only, never for output).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `text` with the password blanked out.
    pub fn scrub(&self, text: &str) -> String {
        scrub(text, &self.url)
    }

    /// A Redis error as [`RedisError::Failed`]: this address, redacted, and the
    /// error's text with the password blanked out.
    pub fn error(&self, e: &redis::RedisError) -> RedisError {
        RedisError::Failed {
            url: self.to_string(),
            cause: self.scrub(&e.to_string()),
        }
    }

    /// One multiplexed connection, within [`CONNECT_TIMEOUT`].
    pub async fn connect(&self) -> Result<redis::aio::MultiplexedConnection, RedisError> {
        let connect = async {
            redis::Client::open(self.url.as_str())
                .map_err(|e| self.error(&e))?
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| self.error(&e))
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(result) => result,
            Err(_) => Err(RedisError::Timeout {
                url: self.to_string(),
            }),
        }
    }

    /// A pool of at most `size` connections (opened when first asked for).
    pub fn pool(&self, size: usize) -> Result<deadpool_redis::Pool, RedisError> {
        let mut config = deadpool_redis::Config::from_url(self.url.as_str());
        let mut pool = deadpool_redis::PoolConfig::new(size.max(1));
        // A checkout that cannot be served in time fails like an outage (and
        // is retried) instead of waiting forever.
        pool.timeouts.wait = Some(POOL_WAIT);
        config.pool = Some(pool);
        config
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .map_err(|e| RedisError::Failed {
                url: self.to_string(),
                cause: self.scrub(&e.to_string()),
            })
    }
}

/// Longest wait for a free pooled connection.
const POOL_WAIT: Duration = Duration::from_secs(5);

impl Default for RedisTarget {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
        }
    }
}

impl FromStr for RedisTarget {
    type Err = RedisError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The URL with its password redacted.
impl fmt::Display for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.url))
    }
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedisTarget({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_never_shown_with_their_password() {
        let target = RedisTarget::parse("redis://:s3cret@127.0.0.1:6379/2").unwrap();
        assert_eq!(target.to_string(), "redis://:***@127.0.0.1:6379/2");
        assert!(!format!("{target:?}").contains("s3cret"));
        assert_eq!(target.scrub("auth s3cret failed"), "auth *** failed");
        let bad = RedisTarget::parse("http://u:s3cret@h/")
            .unwrap_err()
            .to_string();
        assert!(bad.starts_with("Redis http://u:***@h/: "), "{bad}");
        assert!(!bad.contains("s3cret"), "{bad}");
    }
}
