//! The built-in HTTP handler: POSTs each event to one URL and says, for every
//! failure, whose fault it is ([`Fault`](super::Fault)), decided here where
//! the failure happens.
//!
//! - Only 2xx is success. Redirects are never followed: a POST redirected
//!   becomes a body-less GET that may answer 200 without the service ever
//!   seeing the event. Any 3xx is the configuration's fault.
//! - Optional headers (`traceparent`, `tracestate`, `baggage`) whose values
//!   HTTP cannot carry are left out of the request, never fail the event:
//!   the process span records a `header dropped` event naming the header and why.
//! - Error texts name what happened (`connection refused`, `downstream
//!   answered 503`), never the HTTP library's wording, and show the URL with
//!   its password hidden.

use std::error::Error as _;
use std::fmt;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use opentelemetry::KeyValue;
use opentelemetry::trace::TraceContextExt as _;
use reqwest::Url;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, LOCATION, RETRY_AFTER};
use shardline_connect::redact::{PERCENT_ENCODE, redact};
use shardline_contract::headers::{BAGGAGE, TRACEPARENT, TRACESTATE};
use shardline_contract::telemetry::{attr, event as span_event};

use super::{Event, Handler, HandlerError, HandlerSpecError};

/// The answers that are the downstream's configuration when three or more
/// orders get the same one (a rotated token, a wrong path), else the event's.
pub const DEFAULT_CONFIG_STATUSES: [u16; 5] = [401, 403, 404, 405, 410];

/// Longest `tracestate` sent: W3C Trace Context asks that at least 512
/// characters be propagated and lets longer values be dropped.
const TRACESTATE_LIMIT: usize = 512;
/// Longest `baggage` sent: W3C Baggage's limit for the whole header.
const BAGGAGE_LIMIT: usize = 8192;
/// Longest `traceparent` (version 00 is 55 characters; later versions may add fields).
pub(crate) const TRACEPARENT_LIMIT: usize = 512;

/// Forwards each event to a URL (POST, original body).
///
/// 2xx is success. 408, 429, 5xx, timeouts and transport errors are the
/// downstream's availability (retryable; the delay of a `Retry-After` header
/// on 429 and 503, in seconds or as an HTTP date). Any 3xx is its
/// configuration. An answer of [`Http::with_config_statuses`] (default
/// [`DEFAULT_CONFIG_STATUSES`]) is unconfirmed: the configuration's when other
/// orders get it too. Any other status is the event's (permanent).
#[derive(Clone)]
pub struct Http {
    client: reqwest::Client,
    /// The URL without its userinfo: the credentials travel as basic auth
    /// only, so that no error or log line of the HTTP stack can quote them.
    url: Url,
    /// The user and password of the URL, percent-decoded.
    auth: Option<(String, Option<String>)>,
    /// The URL as texts show it: its password hidden.
    shown: String,
    config_statuses: Vec<u16>,
}

/// The URL shown with its password hidden.
impl fmt::Debug for Http {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Http")
            .field("url", &self.shown)
            .field("config_statuses", &self.config_statuses)
            .finish_non_exhaustive()
    }
}

impl Http {
    pub fn new(url: &str) -> Result<Self, HandlerSpecError> {
        let mut parsed = Url::parse(url).map_err(|e| HandlerSpecError::Url {
            url: redact(url),
            cause: format!("{e}; {PERCENT_ENCODE}"),
        })?;
        let shown = redact(parsed.as_str());
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        let auth = (!parsed.username().is_empty() || parsed.password().is_some())
            .then(|| (decode(parsed.username()), parsed.password().map(decode)));
        // An http(s) URL has an authority, so neither can fail.
        let _ = parsed.set_username("");
        let _ = parsed.set_password(None);
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| HandlerSpecError::Client(e.to_string()))?;
        Ok(Self {
            client,
            shown,
            url: parsed,
            auth,
            config_statuses: DEFAULT_CONFIG_STATUSES.to_vec(),
        })
    }

    /// The answers judged the downstream's configuration when three or more
    /// orders get the same one; every other 4xx stays the event's.
    #[must_use]
    pub fn with_config_statuses(mut self, statuses: impl IntoIterator<Item = u16>) -> Self {
        self.config_statuses = statuses.into_iter().collect();
        self
    }

    /// The request's headers. Required ones are percent-encoded, so always
    /// sendable (one that is not would be the event's fault); optional ones
    /// HTTP cannot carry are left out and recorded on the event's span.
    fn headers(&self, event: &Event<'_>) -> Result<HeaderMap, HandlerError> {
        let mut headers = HeaderMap::with_capacity(9);
        let mut required = |name: &'static str, value: String| {
            let value = HeaderValue::try_from(value)
                .map_err(|_| HandlerError::permanent(format!("could not send header {name}")))?;
            headers.insert(HeaderName::from_static(name), value);
            Ok::<(), HandlerError>(())
        };
        required("idempotency-key", percent_encoded(event.dedup_key))?;
        required("x-shard", event.shard.get().to_string())?;
        required("x-order-id", percent_encoded(&event.envelope.order_id))?;
        required("x-attempt", event.attempt.to_string())?;
        if let Some(seq) = event.envelope.seq {
            required("x-seq", seq.to_string())?;
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let span = event.trace.span();
        let state = span.span_context().trace_state().header();
        let optional = [
            (
                TRACEPARENT,
                Some(event.traceparent.as_bytes()),
                TRACEPARENT_LIMIT,
            ),
            (
                TRACESTATE,
                Some(state.as_bytes()).filter(|s| !s.is_empty()),
                TRACESTATE_LIMIT,
            ),
            (BAGGAGE, event.baggage, BAGGAGE_LIMIT),
        ];
        for (name, value, limit) in optional {
            let Some(value) = value else { continue };
            match sendable(value, limit) {
                Ok(value) => {
                    headers.insert(HeaderName::from_static(name), value);
                }
                Err(why) => {
                    tracing::debug!(header = name, %why, "optional header left out of the downstream request");
                    span.add_event(
                        span_event::HEADER_DROPPED,
                        vec![
                            KeyValue::new(attr::HEADER, name),
                            KeyValue::new(attr::DROPPED_BECAUSE, why.to_string()),
                        ],
                    );
                }
            }
        }
        Ok(headers)
    }

    /// The request [`Handler::handle`] sends for `event`, built but not sent
    /// (public for the request-building fuzz target): the credentials as basic
    /// auth, the event's headers (optional ones HTTP cannot carry left out),
    /// the body as published.
    #[doc(hidden)]
    pub fn request(&self, event: &Event<'_>) -> Result<reqwest::Request, HandlerError> {
        let mut request = self.client.post(self.url.clone());
        if let Some((user, password)) = &self.auth {
            request = request.basic_auth(user, password.as_ref());
        }
        request
            .headers(self.headers(event)?)
            .body(event.body.to_vec())
            .build()
            .map_err(|e| self.transport_error(&e))
    }

    /// A request that got no answer, in plain words.
    fn transport_error(&self, error: &reqwest::Error) -> HandlerError {
        if error.is_builder() {
            return HandlerError::permanent(format!(
                "could not build the request to {}: {}",
                self.shown,
                innermost(error)
            ));
        }
        HandlerError::retryable(format!("POST {}: {}", self.shown, transport_cause(error)))
    }

    /// A redirect's target as texts show it: resolved against the handler
    /// URL, without userinfo, query or fragment.
    fn shown_location(&self, location: &str) -> String {
        match self.url.join(location) {
            Ok(mut target) => {
                let _ = target.set_username("");
                let _ = target.set_password(None);
                target.set_query(None);
                target.set_fragment(None);
                target.to_string()
            }
            Err(_) => "a Location that is not a URL".into(),
        }
    }
}

#[async_trait]
impl Handler for Http {
    async fn handle(&self, event: &Event<'_>) -> Result<(), HandlerError> {
        let response = self
            .client
            .execute(self.request(event)?)
            .await
            .map_err(|e| self.transport_error(&e))?;
        let status = response.status().as_u16();
        let header = |name| {
            response
                .headers()
                .get(name)
                .and_then(|v: &HeaderValue| v.to_str().ok())
        };
        let answer = Answer {
            status,
            location: header(LOCATION).map(|l| self.shown_location(l)),
            retry_after: matches!(status, 429 | 503)
                .then(|| header(RETRY_AFTER))
                .flatten()
                .and_then(|v| parse_retry_after(v, SystemTime::now())),
        };
        answer.classify(&self.config_statuses, &self.shown)
    }

    /// HTTP/1: one connection per call in flight, kept in the client's pool
    /// for the next call.
    fn connections(&self, calls: usize) -> usize {
        calls
    }
}

/// What the downstream answered, as far as attribution cares.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    status: u16,
    /// A redirect's target, as shown.
    location: Option<String>,
    retry_after: Option<Duration>,
}

impl Answer {
    /// The answer's verdict: success, or the failure with its fault.
    fn classify(&self, config_statuses: &[u16], url: &str) -> Result<(), HandlerError> {
        let status = self.status;
        match status {
            200..=299 => Ok(()),
            300..=399 => Err(HandlerError::misconfigured(match &self.location {
                Some(to) => format!(
                    "downstream answered {status}, a redirect to {to}: point the handler URL at the final URL (POST {url})"
                ),
                None => format!(
                    "downstream answered {status}, a redirect without a Location: point the handler URL at the service (POST {url})"
                ),
            })),
            408 | 429 | 500..=599 => {
                let message = format!("downstream answered {status}");
                Err(match self.retry_after {
                    Some(after) => HandlerError::retryable_after(message, after),
                    None => HandlerError::retryable(message),
                })
            }
            s if config_statuses.contains(&s) => Err(HandlerError::refused(
                format!("downstream answered {status} (POST {url})"),
                status.to_string(),
            )),
            _ => Err(HandlerError::permanent(format!(
                "downstream answered {status}"
            ))),
        }
    }
}

/// Why an optional header's value cannot travel in HTTP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unsendable {
    NotUtf8,
    LineBreak,
    Nul,
    Control,
    Over(usize),
}

impl fmt::Display for Unsendable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotUtf8 => f.write_str("not UTF-8"),
            Self::LineBreak => f.write_str("CR/LF"),
            Self::Nul => f.write_str("NUL"),
            Self::Control => f.write_str("a control character"),
            Self::Over(limit) => write!(f, "over {limit} bytes"),
        }
    }
}

/// `value` as a header value, when HTTP can carry it: UTF-8 text without
/// control characters (tab aside), at most `limit` bytes. A rule of
/// transport, not of display: a value holding characters that do not show
/// as themselves but are no controls ([`shardline_contract::text::hidden`]:
/// a bidi override, a zero-width joiner) travels; what prints it escapes it.
pub(crate) fn sendable(value: &[u8], limit: usize) -> Result<HeaderValue, Unsendable> {
    let text = std::str::from_utf8(value).map_err(|_| Unsendable::NotUtf8)?;
    if text.contains(['\r', '\n']) {
        return Err(Unsendable::LineBreak);
    }
    if text.contains('\0') {
        return Err(Unsendable::Nul);
    }
    if text.chars().any(|c| c.is_control() && c != '\t') {
        return Err(Unsendable::Control);
    }
    if value.len() > limit {
        return Err(Unsendable::Over(limit));
    }
    HeaderValue::from_bytes(value).map_err(|_| Unsendable::Control)
}

/// What went wrong with a request that got no answer: the I/O error's kind
/// when there is one, else the innermost cause's own words.
fn transport_cause(error: &reqwest::Error) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = error.source();
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind;
            let words = match io.kind() {
                ErrorKind::ConnectionRefused => "connection refused",
                ErrorKind::ConnectionReset => "connection reset",
                ErrorKind::ConnectionAborted => "connection aborted",
                ErrorKind::TimedOut => "timed out",
                ErrorKind::UnexpectedEof => "connection closed before an answer",
                _ => break,
            };
            return words.into();
        }
        source = cause.source();
    }
    if error.is_timeout() {
        return "timed out".into();
    }
    let cause = innermost(error);
    if error.is_connect() {
        format!("could not connect: {cause}")
    } else {
        cause
    }
}

/// The words of the innermost cause of `error`: the library's outer layers
/// only repeat the URL ("error sending request for url …").
fn innermost(error: &reqwest::Error) -> String {
    let mut words = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        words = cause.to_string();
        source = cause.source();
    }
    words
}

/// A `Retry-After` value: delay seconds, or an HTTP date (a date in the
/// past is no delay). `None` when it is neither.
fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// `value` with `%`, control characters and non-ASCII bytes percent-encoded, so
/// any order id travels in an HTTP header.
fn percent_encoded(value: &str) -> String {
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::TcpListener;

    use super::*;
    use crate::handler::Fault;

    const URL: &str = "http://127.0.0.1:9/events";

    fn answer(status: u16) -> Answer {
        Answer {
            status,
            location: None,
            retry_after: None,
        }
    }

    fn fault_of(answer: &Answer) -> Option<Fault> {
        answer
            .classify(&DEFAULT_CONFIG_STATUSES, URL)
            .err()
            .map(|e| e.fault())
    }

    #[test]
    fn only_2xx_is_success() {
        for ok in [200, 201, 202, 204, 299] {
            assert_eq!(answer(ok).classify(&DEFAULT_CONFIG_STATUSES, URL), Ok(()));
        }
    }

    #[test]
    fn every_redirect_is_the_configurations_fault_and_names_its_target() {
        for status in [300, 301, 302, 303, 304, 307, 308] {
            let redirect = Answer {
                location: Some("http://127.0.0.1:9/landed".into()),
                ..answer(status)
            };
            let error = redirect
                .classify(&DEFAULT_CONFIG_STATUSES, URL)
                .unwrap_err();
            assert_eq!(error.fault(), Fault::Configuration, "{status}");
            let text = error.to_string();
            assert!(
                text.contains(&format!("answered {status}"))
                    && text.contains("http://127.0.0.1:9/landed")
                    && text.contains("point the handler URL at the final URL"),
                "{text}"
            );
        }
        let bare = answer(302)
            .classify(&DEFAULT_CONFIG_STATUSES, URL)
            .unwrap_err();
        assert!(bare.to_string().contains("without a Location"), "{bare}");
    }

    #[test]
    fn availability_answers_are_retryable_with_their_retry_after() {
        for status in [408, 429, 500, 502, 503, 504, 599] {
            let error = answer(status)
                .classify(&DEFAULT_CONFIG_STATUSES, URL)
                .unwrap_err();
            assert_eq!(error.fault(), Fault::Availability, "{status}");
            assert_eq!(error.to_string(), format!("downstream answered {status}"));
            assert_eq!(error.retry_after(), None);
        }
        for status in [429, 503] {
            let asked = Answer {
                retry_after: Some(Duration::from_secs(7)),
                ..answer(status)
            };
            let error = asked.classify(&DEFAULT_CONFIG_STATUSES, URL).unwrap_err();
            assert_eq!(error.fault(), Fault::Availability);
            assert_eq!(error.retry_after(), Some(Duration::from_secs(7)));
        }
    }

    #[test]
    fn answers_of_the_configuration_set_are_unconfirmed_and_others_the_events() {
        for status in [401, 403, 404, 405, 410] {
            let error = answer(status)
                .classify(&DEFAULT_CONFIG_STATUSES, URL)
                .unwrap_err();
            assert_eq!(error.fault(), Fault::Unconfirmed, "{status}");
            assert!(
                matches!(&error, HandlerError::Refused { answer, .. } if *answer == status.to_string())
            );
            assert!(error.to_string().contains(URL), "{error}");
        }
        for status in [400, 409, 413, 422, 451] {
            assert_eq!(fault_of(&answer(status)), Some(Fault::Event), "{status}");
        }
        // The set is the flag's: 404 alone, 401 is then the event's.
        let only_404 = [404];
        assert_eq!(
            answer(401).classify(&only_404, URL).unwrap_err().fault(),
            Fault::Event
        );
        assert_eq!(
            answer(404).classify(&only_404, URL).unwrap_err().fault(),
            Fault::Unconfirmed
        );
    }

    #[test]
    fn a_timeout_is_the_downstreams_availability_in_plain_words() {
        let error = HandlerError::timeout(Duration::from_secs(5));
        assert_eq!(error.fault(), Fault::Availability);
        assert_eq!(error.to_string(), "timed out after 5s");
    }

    #[test]
    fn headers_http_cannot_carry_are_unsendable_with_their_reason() {
        assert!(sendable(b"a=b,c=d", 512).is_ok());
        assert!(sendable(b"with\ttab", 512).is_ok());
        assert_eq!(
            sendable(b"a=b\r\nX-Injected: 1", 512),
            Err(Unsendable::LineBreak)
        );
        assert_eq!(sendable(b"a=b\nc", 512), Err(Unsendable::LineBreak));
        assert_eq!(sendable(b"a=\0b", 512), Err(Unsendable::Nul));
        assert_eq!(sendable(b"a=\x1bb", 512), Err(Unsendable::Control));
        assert_eq!(sendable(b"a=\x7fb", 512), Err(Unsendable::Control));
        assert_eq!(sendable(&[0x61, 0xff, 0xfe], 512), Err(Unsendable::NotUtf8));
        assert_eq!(
            sendable("a=b".repeat(6000).as_bytes(), 512),
            Err(Unsendable::Over(512))
        );
        assert_eq!(Unsendable::LineBreak.to_string(), "CR/LF");
        assert_eq!(Unsendable::Over(512).to_string(), "over 512 bytes");
    }

    #[test]
    fn header_values_are_percent_encoded() {
        assert_eq!(
            percent_encoded("A1024:order.created:3"),
            "A1024:order.created:3"
        );
        assert_eq!(percent_encoded("é"), "%C3%A9");
        assert_eq!(percent_encoded("100%"), "100%25");
        assert_eq!(percent_encoded("a\nb"), "a%0Ab");
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
    fn a_redirects_location_is_shown_without_userinfo_or_query() {
        let http = Http::new("http://user:secret@10.0.0.1:8080/events?token=t").unwrap();
        assert_eq!(http.shown, "http://user:***@10.0.0.1:8080/events?token=***");
        assert_eq!(
            http.shown_location("/landed?sig=abc#x"),
            "http://10.0.0.1:8080/landed"
        );
        assert_eq!(
            http.shown_location("https://u:p@other.example/v2/events?k=1"),
            "https://other.example/v2/events"
        );
    }

    #[test]
    fn the_credentials_travel_as_basic_auth_never_in_the_url() {
        let http = Http::new("http://us%40er:p%2Fw%23CANARY@10.0.0.1:8080/events").unwrap();
        assert_eq!(http.url.as_str(), "http://10.0.0.1:8080/events");
        assert_eq!(
            http.auth,
            Some(("us@er".to_owned(), Some("p/w#CANARY".to_owned())))
        );
        assert!(!format!("{http:?}").contains("CANARY"), "{http:?}");
        // Typed raw, reserved characters make a URL that does not parse (or
        // another one); the error never quotes the password.
        for raw in [
            "http://user:CANARY/x@127.0.0.1:1/",
            "http://user:CANARY?x@127.0.0.1:1/",
        ] {
            match Http::new(raw) {
                Err(e) => {
                    let e = e.to_string();
                    assert!(!e.contains("CANARY") && e.contains("percent-encode"), "{e}");
                }
                Ok(http) => assert!(!format!("{http:?}").contains("CANARY"), "{http:?}"),
            }
        }
    }

    /// A port nothing listens on: bound, then closed.
    fn closed_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    async fn send(url: &str) -> reqwest::Error {
        reqwest::Client::new()
            .post(url)
            .body("{}")
            .send()
            .await
            .unwrap_err()
    }

    #[tokio::test]
    async fn transport_errors_say_what_happened_and_are_the_downstreams_availability() {
        let http = Http::new(&format!("http://u:pw@127.0.0.1:{}/events", closed_port())).unwrap();
        let refused = http.transport_error(&send(http.url.as_str()).await);
        assert_eq!(refused.fault(), Fault::Availability);
        assert!(
            refused.to_string().ends_with(": connection refused")
                && refused.to_string().contains("u:***@")
                && !refused.to_string().contains("pw"),
            "{refused}"
        );

        // Reset: the peer accepts, reads the request, and closes with RST.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            use tokio::io::AsyncReadExt as _;
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0_u8; 1024];
            let _ = socket.read(&mut buf).await;
            socket.set_zero_linger().unwrap();
        });
        let reset = http.transport_error(&send(&format!("http://{addr}/events")).await);
        server.await.unwrap();
        assert_eq!(reset.fault(), Fault::Availability);
        let text = reset.to_string();
        assert!(
            text.ends_with(": connection reset")
                || text.ends_with(": connection closed before an answer"),
            "{text}"
        );
        assert!(!text.contains("error sending request"), "{text}");
    }

    #[tokio::test]
    async fn a_request_that_cannot_be_built_is_the_events_fault() {
        let http = Http::new(URL).unwrap();
        let error = reqwest::Client::new()
            .post(URL)
            .header("x-bad", "a\r\nb")
            .send()
            .await
            .unwrap_err();
        assert!(error.is_builder());
        let attributed = http.transport_error(&error);
        assert_eq!(attributed.fault(), Fault::Event);
        assert!(
            attributed
                .to_string()
                .starts_with("could not build the request"),
            "{attributed}"
        );
    }
}
