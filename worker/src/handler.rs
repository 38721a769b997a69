//! What the worker calls for each event, and the built-in handlers.
//!
//! Handlers never see broker types: they get the decoded [`Event`] and answer
//! with success, a retryable error or a permanent one.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use opentelemetry::Context;
use opentelemetry::trace::TraceContextExt as _;
use shardline_topology::headers::{TRACEPARENT, TRACESTATE};
use shardline_topology::{Envelope, ShardId};

/// One event as a handler sees it.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    pub envelope: &'a Envelope,
    /// The message body exactly as published (unknown fields included).
    pub body: &'a [u8],
    /// The dedup key; pass it downstream so that side can be idempotent too.
    pub dedup_key: &'a str,
    pub shard: ShardId,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// The context of the worker's process span for this event: the parent
    /// of any span the handler opens (it is also the current context while
    /// the handler runs).
    pub trace: &'a Context,
    /// The W3C `traceparent` to send downstream: the process span's (without
    /// a tracer provider: the one the event arrived with, else a fresh one).
    pub traceparent: &'a str,
    /// When the publisher sent it (`x-published-at-ms`), when known.
    pub published_at_ms: Option<i64>,
}

/// How a handler failed, shaped by what the worker does next. Build one with
/// [`HandlerError::retryable`] or [`HandlerError::permanent`]: the variants
/// will grow fields (a `Retry-After` hint next), so they are matched with `..`
/// and never built field by field outside this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Worth another attempt (downstream busy, 5xx, connection refused…);
    /// `retry_after` when the downstream said when (`Retry-After`).
    #[error("{message}")]
    #[non_exhaustive]
    Retryable {
        message: String,
        retry_after: Option<Duration>,
    },
    /// Will never succeed as is: dead-letter now.
    #[error("{message}")]
    #[non_exhaustive]
    Permanent { message: String },
    /// The attempt took longer than the handler timeout; retryable.
    #[error("handler timed out after {after:?}")]
    #[non_exhaustive]
    Timeout { after: Duration },
}

impl HandlerError {
    /// A failure worth another attempt.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::Retryable {
            message: message.into(),
            retry_after: None,
        }
    }

    /// A failure worth another attempt no sooner than `after` (the
    /// downstream's `Retry-After`): it sets this event's next delay (capped
    /// by `RetryPolicy::retry_after_cap`), never the other events'.
    pub fn retryable_after(message: impl Into<String>, after: Duration) -> Self {
        Self::Retryable {
            message: message.into(),
            retry_after: Some(after),
        }
    }

    /// The delay the downstream asked for, if it did.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Retryable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// A failure no retry will fix: the event is dead-lettered at once.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::Permanent {
            message: message.into(),
        }
    }

    /// An attempt that ran out of time (the worker's handler timeout).
    pub fn timeout(after: Duration) -> Self {
        Self::Timeout { after }
    }

    /// Whether another attempt may succeed.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, Self::Permanent { .. })
    }
}

/// Processes one event. Called serially per shard; must be safe to call again
/// for the same event (the dedup key tells repeats apart).
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    async fn handle(&self, event: &Event<'_>) -> Result<(), HandlerError>;
}

/// Acknowledges every event: for benchmarks and dry runs.
#[derive(Debug, Default)]
pub struct Noop;

#[async_trait]
impl Handler for Noop {
    async fn handle(&self, _event: &Event<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// Prints each event to stdout as one JSON line.
#[derive(Debug, Default)]
pub struct Log;

#[async_trait]
impl Handler for Log {
    async fn handle(&self, event: &Event<'_>) -> Result<(), HandlerError> {
        // The body parsed as an envelope, so it is a JSON object and embeds as is.
        let body = String::from_utf8_lossy(event.body);
        let line = format!(
            "{{\"shard\":{},\"dedup_key\":{},\"attempt\":{},\"event\":{}}}\n",
            event.shard,
            serde_json::Value::from(event.dedup_key),
            event.attempt,
            body.trim(),
        );
        std::io::stdout()
            .lock()
            .write_all(line.as_bytes())
            .map_err(|e| HandlerError::retryable(format!("writing to stdout: {e}")))
    }
}

/// Forwards each event to a URL (POST, original body).
///
/// 2xx is success; 408, 429, 5xx and transport errors are retryable (with
/// the delay of a `Retry-After` header on 429 and 503, in seconds or as an
/// HTTP date); any other status is permanent.
#[derive(Debug, Clone)]
pub struct Http {
    client: reqwest::Client,
    url: reqwest::Url,
}

impl Http {
    pub fn new(url: &str) -> Result<Self, HandlerSpecError> {
        let url = reqwest::Url::parse(url).map_err(|e| HandlerSpecError::Url {
            url: url.to_owned(),
            cause: e.to_string(),
        })?;
        let client = reqwest::Client::builder()
            .build()
            .map_err(|e| HandlerSpecError::Client(e.to_string()))?;
        Ok(Self { client, url })
    }
}

#[async_trait]
impl Handler for Http {
    async fn handle(&self, event: &Event<'_>) -> Result<(), HandlerError> {
        let mut request = self
            .client
            .post(self.url.clone())
            .header("content-type", "application/json")
            .header("idempotency-key", header_value(event.dedup_key))
            .header("x-shard", event.shard.get().to_string())
            .header("x-order-id", header_value(&event.envelope.order_id))
            .header("x-attempt", event.attempt.to_string());
        if let Some(seq) = event.envelope.seq {
            request = request.header("x-seq", seq.to_string());
        }
        request = request.header(TRACEPARENT, event.traceparent);
        let span = event.trace.span();
        let state = span.span_context().trace_state().header();
        if !state.is_empty() {
            request = request.header(TRACESTATE, state);
        }
        let response = request
            .body(event.body.to_vec())
            .send()
            .await
            .map_err(|e| HandlerError::retryable(format!("POST {}: {e}", self.url)))?;
        let status = response.status().as_u16();
        let retry_after = matches!(status, 429 | 503)
            .then(|| response.headers().get(reqwest::header::RETRY_AFTER))
            .flatten()
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, std::time::SystemTime::now()));
        match (classify(status), retry_after) {
            (Err(HandlerError::Retryable { message, .. }), Some(after)) => {
                Err(HandlerError::retryable_after(message, after))
            }
            (result, _) => result,
        }
    }
}

/// A `Retry-After` value: delay seconds, or an HTTP date (a date in the
/// past is no delay). `None` when it is neither.
fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The status mapping of SPEC §3.
fn classify(status: u16) -> Result<(), HandlerError> {
    match status {
        200..=299 => Ok(()),
        408 | 429 | 500..=599 => Err(HandlerError::retryable(format!(
            "downstream answered {status}"
        ))),
        _ => Err(HandlerError::permanent(format!(
            "downstream answered {status}"
        ))),
    }
}

/// `value` with `%`, control characters and non-ASCII bytes percent-encoded, so
/// any order id travels in an HTTP header.
fn header_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if (0x20..0x7f).contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// A handler spec that names no built-in handler. Messages speak of "the
/// handler spec"; a command line says which flag it came from.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerSpecError {
    #[error("handler spec must be an http(s):// URL, `log` or `noop`, got `{0}`")]
    Unknown(String),
    #[error("handler URL `{url}` is not valid: {cause}")]
    Url { url: String, cause: String },
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

/// The built-in handler a spec names: `noop`, `log` or an `http(s)://` URL
/// ([`Http`]).
pub fn from_spec(spec: &str) -> Result<Arc<dyn Handler>, HandlerSpecError> {
    match spec {
        "noop" => Ok(Arc::new(Noop)),
        "log" => Ok(Arc::new(Log)),
        s if s.starts_with("http://") || s.starts_with("https://") => Ok(Arc::new(Http::new(s)?)),
        other => Err(HandlerSpecError::Unknown(other.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_mapping() {
        assert_eq!(classify(200), Ok(()));
        assert_eq!(classify(204), Ok(()));
        for retryable in [408, 429, 500, 503, 599] {
            assert!(matches!(
                classify(retryable),
                Err(HandlerError::Retryable { .. })
            ));
        }
        for permanent in [400, 404, 409, 422, 301] {
            assert!(matches!(
                classify(permanent),
                Err(HandlerError::Permanent { .. })
            ));
        }
    }

    #[test]
    fn retry_after_takes_seconds_or_a_date() {
        let now = std::time::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-5", now), None);
    }

    #[test]
    fn header_values_are_percent_encoded() {
        assert_eq!(
            header_value("A1024:order.created:3"),
            "A1024:order.created:3"
        );
        assert_eq!(header_value("é"), "%C3%A9");
        assert_eq!(header_value("100%"), "100%25");
        assert_eq!(header_value("a\nb"), "a%0Ab");
    }

    #[test]
    fn handler_specs() {
        assert!(from_spec("noop").is_ok());
        assert!(from_spec("log").is_ok());
        assert!(from_spec("http://127.0.0.1:8080/events").is_ok());
        assert!(matches!(
            from_spec("ftp://x"),
            Err(HandlerSpecError::Unknown(_))
        ));
        assert!(matches!(
            from_spec("http://"),
            Err(HandlerSpecError::Url { .. })
        ));
    }
}
