//! The OTLP trace exporter, configured by the standard `OTEL_*` variables
//! (docs/semantics.md §5): off unless an endpoint is set; then spans are
//! batched and exported over OTLP/HTTP (protobuf) from a one-thread runtime
//! of their own, so that exporting never competes with shard tasks and still
//! runs while the main runtime drains.
//!
//! An endpoint's user and password travel as basic auth, never in the URL
//! the HTTP stack is given: it logs that URL at trace level (its connection
//! pool's key).

use std::collections::HashMap;
use std::env;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use opentelemetry::global;
use opentelemetry_otlp::{Protocol, WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::runtime;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;

use crate::redact::{PERCENT_ENCODE, redact, scrub};

/// Service name when `OTEL_SERVICE_NAME` is not set.
pub const DEFAULT_SERVICE_NAME: &str = "shardline";

/// Most time spent exporting the last spans on exit.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// The variable naming the endpoint of traces alone, used as given.
const TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
/// The variable naming the collector: the exporter appends `/v1/traces`.
const ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Why the exporter could not start; its text shows the endpoint redacted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OtlpError {
    #[error("OTEL_EXPORTER_OTLP_PROTOCOL={0} is not supported: shardline exports http/protobuf")]
    Protocol(String),
    #[error("the OTLP endpoint {0} does not parse: {PERCENT_ENCODE}")]
    Endpoint(String),
    #[error("the OTLP exporter's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("the OTLP exporter: {0}")]
    Exporter(String),
}

/// A running exporter; [`Exporter::shutdown`] flushes it.
pub struct Exporter {
    provider: SdkTracerProvider,
    runtime: tokio::runtime::Runtime,
    /// The endpoint, its password hidden.
    pub endpoint: String,
}

impl Exporter {
    /// Starts the exporter the environment asks for and installs it as the
    /// global tracer provider; `Ok(None)` when no endpoint is set or tracing
    /// is off (`OTEL_SDK_DISABLED=true`, `OTEL_TRACES_EXPORTER=none`).
    pub fn from_env() -> Result<Option<Self>, OtlpError> {
        let Some((variable, endpoint)) = endpoint() else {
            return Ok(None);
        };
        if tracing_disabled() {
            return Ok(None);
        }
        Self::start(variable, &endpoint)
            .map(Some)
            .map_err(|e| match e {
                OtlpError::Exporter(text) => OtlpError::Exporter(scrub(&text, &endpoint)),
                other => other,
            })
    }

    fn start(variable: &str, endpoint: &str) -> Result<Self, OtlpError> {
        if let Ok(protocol) = env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|_| env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
            && protocol.trim() != "http/protobuf"
        {
            return Err(OtlpError::Protocol(protocol));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otel-export")
            .enable_all()
            .build()
            .map_err(OtlpError::Runtime)?;
        // The batch processor spawns its task on the current runtime.
        let _entered = runtime.enter();
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary);
        if let Some((without, authorization)) = credentials(endpoint)? {
            // OTEL_EXPORTER_OTLP_HEADERS, read by the exporter, still wins.
            let headers = HashMap::from([("authorization".to_owned(), authorization)]);
            exporter = exporter
                .with_endpoint(traces_url(variable, &without))
                .with_headers(headers);
        }
        let exporter = exporter
            .build()
            .map_err(|e| OtlpError::Exporter(e.to_string()))?;
        let processor = BatchSpanProcessor::builder(exporter, runtime::Tokio).build();
        let mut resource = Resource::builder();
        // With OTEL_SERVICE_NAME set the environment detector has it already.
        if !env::var("OTEL_SERVICE_NAME").is_ok_and(|name| !name.trim().is_empty()) {
            resource = resource.with_service_name(DEFAULT_SERVICE_NAME);
        }
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource.build())
            .build();
        global::set_tracer_provider(provider.clone());
        global::set_text_map_propagator(TraceContextPropagator::new());
        Ok(Self {
            provider,
            runtime,
            endpoint: redact(endpoint),
        })
    }

    /// Exports what is buffered and stops, within 5 s.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
            tracing::warn!(error = %e, "flushing the last spans failed");
        }
        self.runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

/// The OTLP endpoint for traces, when set, with the variable it came from:
/// [`TRACES_ENDPOINT`], else [`ENDPOINT`].
fn endpoint() -> Option<(&'static str, String)> {
    [TRACES_ENDPOINT, ENDPOINT]
        .into_iter()
        .filter_map(|name| Some((name, env::var(name).ok()?)))
        .find(|(_, value)| !value.trim().is_empty())
}

/// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`.
fn tracing_disabled() -> bool {
    let is = |name: &str, value: &str| {
        env::var(name).is_ok_and(|v| v.trim().eq_ignore_ascii_case(value))
    };
    is("OTEL_SDK_DISABLED", "true") || is("OTEL_TRACES_EXPORTER", "none")
}

/// The endpoint without its user and password, and those as a basic
/// `Authorization` value (percent-decoded); `Ok(None)` when it holds none.
/// Refused when its userinfo holds reserved characters typed raw (an `@`
/// past the first `/`, `?` or `#`, as the redaction reads it).
fn credentials(endpoint: &str) -> Result<Option<(String, String)>, OtlpError> {
    let Some((scheme, rest)) = endpoint.split_once("://") else {
        return Ok(None);
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..end].rfind('@') else {
        if rest[end..].contains('@') {
            return Err(OtlpError::Endpoint(redact(endpoint)));
        }
        return Ok(None);
    };
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let userinfo = &rest[..at];
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let auth = STANDARD.encode(format!("{}:{}", decode(user), decode(password)));
    Ok(Some((
        format!("{scheme}://{}", &rest[at + 1..]),
        format!("Basic {auth}"),
    )))
}

/// The URL spans go to, from `endpoint` of `variable` without its
/// credentials, as the exporter would build it.
fn traces_url(variable: &str, endpoint: &str) -> String {
    match variable {
        ENDPOINT => format!("{}/v1/traces", endpoint.trim_end_matches('/')),
        _ => endpoint.to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoints_credentials_go_as_basic_auth_never_in_its_url() {
        let (url, auth) = credentials("https://u%40x:p%2Fw@otel:4318/base/")
            .unwrap()
            .unwrap();
        assert_eq!(url, "https://otel:4318/base/");
        // base64 of `u@x:p/w`
        assert_eq!(auth, "Basic dUB4OnAvdw==");
        assert_eq!(
            traces_url(ENDPOINT, &url),
            "https://otel:4318/base/v1/traces"
        );
        assert_eq!(traces_url(TRACES_ENDPOINT, &url), url);
        assert!(credentials("http://otel:4318").unwrap().is_none());
        // An `@` past the host reads as a raw reserved character, as the redaction reads it.
        assert!(credentials("http://otel:4318/a@b").is_err());
        let refused = credentials("http://u:s3/cr@otel:4318")
            .unwrap_err()
            .to_string();
        assert!(
            !refused.contains("s3/cr") && refused.contains("percent-encode"),
            "{refused}"
        );
    }
}
