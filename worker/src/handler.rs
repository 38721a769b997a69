//! What the worker calls for each event, and the built-in handlers.
//!
//! Handlers never see broker types: they get the decoded [`Event`] and answer
//! with success or a [`HandlerError`] that says whose [`Fault`] the failure is.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use opentelemetry::Context;
use shardline_contract::{Envelope, ShardId};

mod http;

pub use http::{DEFAULT_CONFIG_STATUSES, Http};
pub(crate) use http::{TRACEPARENT_LIMIT, sendable};

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
    /// The W3C `baggage` it arrived with, as published (unchecked: the HTTP
    /// handler forwards it only when HTTP can carry it).
    pub baggage: Option<&'a [u8]>,
}

/// Whose fault a failed attempt is. Decided once, where the failure happens
/// (the handler's [`HandlerError`], or the worker for its own connections);
/// the worker decides what follows from it alone:
///
/// | fault | what follows |
/// |---|---|
/// | [`Fault::Event`] | dead letter (at once when permanent); never breaker evidence |
/// | [`Fault::Availability`] | retried in place; breaker evidence (an outage pauses every shard) |
/// | [`Fault::Configuration`] | every shard paused like an open breaker, with an alert; never a mass dead letter |
/// | [`Fault::Unconfirmed`] | retried; the configuration's once three orders got the same answer, the event's once other orders succeed |
/// | [`Fault::Infrastructure`] | the shard pauses and reconnects; neither an attempt nor evidence |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Fault {
    /// The event itself: it cannot be decoded or sent, or the downstream
    /// refuses this one event.
    Event = 0,
    /// The downstream is down or overloaded: connection refused or reset,
    /// a timeout, 408, 429, 5xx.
    Availability,
    /// The downstream's configuration (or the handler URL) is wrong: a redirect,
    /// or an answer every order gets.
    Configuration,
    /// An answer that is the configuration's when other orders get it too,
    /// else the event's (by default 401, 403, 404, 405 and 410).
    Unconfirmed,
    /// Our own infrastructure: the broker or Redis. Never a handler's answer.
    Infrastructure,
}

impl Fault {
    /// Every fault, in the order of the metric's series.
    pub const ALL: [Self; 5] = [
        Self::Event,
        Self::Availability,
        Self::Configuration,
        Self::Unconfirmed,
        Self::Infrastructure,
    ];

    /// Its name in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Event => "event",
            Self::Availability => "availability",
            Self::Configuration => "configuration",
            Self::Unconfirmed => "unconfirmed",
            Self::Infrastructure => "infrastructure",
        }
    }

    /// Its position in [`Fault::ALL`] (the declaration order).
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a handler failed, by whose fault it is ([`HandlerError::fault`]).
/// Build one with its constructors ([`HandlerError::retryable`],
/// [`HandlerError::permanent`], [`HandlerError::misconfigured`],
/// [`HandlerError::refused`]): the variants may grow fields, so they are
/// matched with `..` and never built field by field outside this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// The downstream is unavailable (busy, 5xx, connection refused…): worth
    /// another attempt; `retry_after` when the downstream said when
    /// (`Retry-After`).
    #[error("{message}")]
    #[non_exhaustive]
    Retryable {
        message: String,
        retry_after: Option<Duration>,
    },
    /// The event's own fault; will never succeed as is: dead-letter now.
    #[error("{message}")]
    #[non_exhaustive]
    Permanent { message: String },
    /// The attempt took longer than the handler timeout: the downstream's
    /// availability.
    #[error("timed out after {}", humantime::format_duration(*after))]
    #[non_exhaustive]
    Timeout { after: Duration },
    /// The downstream's configuration is wrong whatever the event (a
    /// redirect): the worker pauses its shards.
    #[error("{message}")]
    #[non_exhaustive]
    Misconfigured { message: String },
    /// The downstream refused the event with `answer`, which is its
    /// configuration's fault if other orders get the same answer, else the
    /// event's.
    #[error("{message}")]
    #[non_exhaustive]
    Refused { message: String, answer: String },
}

impl HandlerError {
    /// The downstream is unavailable; another attempt may succeed.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::Retryable {
            message: message.into(),
            retry_after: None,
        }
    }

    /// The downstream is unavailable and asked for no attempt sooner than
    /// `after` (`Retry-After`): it sets this event's next delay (capped by
    /// `RetryPolicy::retry_after_cap`), never the other events'.
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

    /// The event's own failure, which no retry will fix: dead-lettered at once.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::Permanent {
            message: message.into(),
        }
    }

    /// An attempt that ran out of time (the worker's handler timeout).
    pub fn timeout(after: Duration) -> Self {
        Self::Timeout { after }
    }

    /// The downstream's configuration is wrong for every event (a redirect:
    /// the handler URL is not the service's).
    pub fn misconfigured(message: impl Into<String>) -> Self {
        Self::Misconfigured {
            message: message.into(),
        }
    }

    /// The downstream refused the event with `answer` (such as `401`): its
    /// configuration's fault when three or more orders get the same answer,
    /// else the event's.
    pub fn refused(message: impl Into<String>, answer: impl Into<String>) -> Self {
        Self::Refused {
            message: message.into(),
            answer: answer.into(),
        }
    }

    /// Whose fault it is.
    pub fn fault(&self) -> Fault {
        match self {
            Self::Permanent { .. } => Fault::Event,
            Self::Retryable { .. } | Self::Timeout { .. } => Fault::Availability,
            Self::Misconfigured { .. } => Fault::Configuration,
            Self::Refused { .. } => Fault::Unconfirmed,
        }
    }

    /// Whether another attempt may succeed: all but the event's permanent faults.
    pub fn is_retryable(&self) -> bool {
        self.fault() != Fault::Event
    }
}

/// Processes one event. Called serially per shard; must be safe to call again
/// for the same event (the dedup key tells repeats apart).
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    async fn handle(&self, event: &Event<'_>) -> Result<(), HandlerError>;

    /// File descriptors the handler may hold with `calls` calls in flight at
    /// once (every shard's), for the worker's start-up check of the process's
    /// limit: a handler that opens a connection per call must say so, or a
    /// worker of many shards runs out of descriptors mid-stream. None by default.
    fn connections(&self, calls: usize) -> usize {
        let _ = calls;
        0
    }
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
        let line = log_line(
            event.shard.get(),
            event.dedup_key,
            event.attempt,
            event.body,
        );
        std::io::stdout()
            .lock()
            .write_all(line.as_bytes())
            .map_err(|e| HandlerError::retryable(format!("writing to stdout: {e}")))
    }
}

/// The line [`Log`] prints: one line of JSON whatever the fields hold. The
/// body parsed as an envelope, so it is a JSON object and embeds as such;
/// whitespace between its tokens (where a publisher could put line breaks)
/// is dropped, and the characters that do not show as themselves
/// ([`shardline_contract::text::hidden`]: C1 controls, bidi overrides, line
/// separators…, in the body's strings or the dedup key) are written as JSON
/// `\u` escapes.
fn log_line(shard: u16, dedup_key: &str, attempt: u32, body: &[u8]) -> String {
    let body = String::from_utf8_lossy(body);
    let line = format!(
        "{{\"shard\":{shard},\"dedup_key\":{},\"attempt\":{attempt},\"event\":{}}}",
        serde_json::Value::from(dedup_key),
        body.trim(),
    );
    let mut line = shardline_contract::text::json_line(&line).into_owned();
    line.push('\n');
    line
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

impl HandlerSpecError {
    /// Whether the spec itself is wrong (names no handler, or a URL that does
    /// not parse): a usage error. An HTTP client that cannot be built is not.
    pub fn is_usage(&self) -> bool {
        matches!(self, Self::Unknown(_) | Self::Url { .. })
    }
}

/// The built-in handler a spec names: `noop`, `log` or an `http(s)://` URL
/// ([`Http`]).
pub fn from_spec(spec: &str) -> Result<Arc<dyn Handler>, HandlerSpecError> {
    match spec {
        "noop" => Ok(Arc::new(Noop)),
        "log" => Ok(Arc::new(Log)),
        s if s.starts_with("http://") || s.starts_with("https://") => Ok(Arc::new(Http::new(s)?)),
        other => Err(HandlerSpecError::Unknown(shardline_connect::redact(other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_line_is_one_line_of_json_that_shows_what_it_holds() {
        for body in [
            // Lines forged in the whitespace between tokens.
            "{\"order_id\":\"A\",\n\"event\":\"e\"\r\n,\"seq\":1}\n{\"forged\":1}",
            // C1 controls, a bidi override, line separators raw in strings.
            "{\"order_id\":\"A\",\"event\":\"e\",\"x\":\"\u{85}\u{9b}31m\u{202e}gpj.exe\u{2028}\u{2029}\"}",
            // Escapes are JSON's own, and fine as they are.
            r#"{"order_id":"A","event":"e","x":"\u001b[31m\n\" }"}"#,
        ] {
            let line = log_line(3, "A\u{202e}:e:1", 2, body.as_bytes());
            let (one, end) = line.split_at(line.len() - 1);
            assert_eq!(end, "\n");
            assert!(!one.contains(['\n', '\r']), "{line:?}");
            assert!(
                !one.chars().any(shardline_contract::text::hidden),
                "{line:?}"
            );
            if body.contains("forged") {
                continue;
            }
            let parsed: serde_json::Value = serde_json::from_str(one).unwrap();
            let event: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(parsed["event"], event, "{line}");
            assert_eq!(parsed["dedup_key"], "A\u{202e}:e:1");
            assert_eq!(
                (parsed["shard"].as_u64(), parsed["attempt"].as_u64()),
                (Some(3), Some(2))
            );
        }
        assert_eq!(
            log_line(
                0,
                "A:e:1",
                1,
                b" {\"order_id\": \"A\", \"x\": \"\xc2\x85\"}\n"
            ),
            "{\"shard\":0,\"dedup_key\":\"A:e:1\",\"attempt\":1,\"event\":{\"order_id\":\"A\",\"x\":\"\\u0085\"}}\n"
        );
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
        assert!(from_spec("ftp://x").err().is_some_and(|e| e.is_usage()));
        assert!(from_spec("http://").err().is_some_and(|e| e.is_usage()));
        assert!(!HandlerSpecError::Client("no TLS roots".into()).is_usage());
        assert!(matches!(
            from_spec("http://"),
            Err(HandlerSpecError::Url { .. })
        ));
    }

    #[test]
    fn a_handler_url_that_does_not_parse_is_shown_without_its_password() {
        let Err(HandlerSpecError::Url { url, .. }) = from_spec("http://u:secret@[::1") else {
            panic!("refused");
        };
        assert!(!url.contains("secret"), "{url}");
    }

    #[test]
    fn each_error_says_whose_fault_it_is() {
        assert_eq!(HandlerError::permanent("x").fault(), Fault::Event);
        assert_eq!(HandlerError::retryable("x").fault(), Fault::Availability);
        assert_eq!(
            HandlerError::timeout(Duration::from_secs(1)).fault(),
            Fault::Availability
        );
        assert_eq!(
            HandlerError::misconfigured("x").fault(),
            Fault::Configuration
        );
        assert_eq!(
            HandlerError::refused("x", "401").fault(),
            Fault::Unconfirmed
        );
        assert!(!HandlerError::permanent("x").is_retryable());
        assert!(HandlerError::refused("x", "401").is_retryable());
        let labels: Vec<&str> = Fault::ALL.iter().map(|f| f.as_str()).collect();
        assert_eq!(
            labels,
            [
                "event",
                "availability",
                "configuration",
                "unconfirmed",
                "infrastructure"
            ]
        );
        assert!(Fault::ALL.iter().enumerate().all(|(i, f)| f.index() == i));
    }
}
