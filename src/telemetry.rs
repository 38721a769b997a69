//! Logging and tracing set-up. (The stop signal is the worker library's
//! `shardline_worker::cancel_on_signal`.)
//!
//! Tracing (docs/semantics.md §5) is OpenTelemetry, configured by the standard `OTEL_*`
//! variables and off unless an OTLP endpoint is set: then spans are batched
//! and exported over OTLP/HTTP (protobuf) from a one-thread runtime of their
//! own, so that exporting never competes with shard tasks and still runs
//! while the main runtime drains. Without it no tracer provider is installed:
//! spans are no-ops and only the W3C context is propagated.

use std::collections::HashMap;
use std::env;
use std::io::IsTerminal as _;
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
use shardline_connect::redact::{PERCENT_ENCODE, redact, scrub};
use tracing_subscriber::EnvFilter;

use crate::LogFormat;

/// Service name when `OTEL_SERVICE_NAME` is not set.
pub(crate) const DEFAULT_SERVICE_NAME: &str = "shardline";

/// Most time spent exporting the last spans on exit.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// The log filter: `RUST_LOG` (default `info`), with lapin's own logs off
/// unless `RUST_LOG` names lapin. Every broker failure reaches us as an error
/// we log or report with its context; lapin's line about it would say it a
/// second time, and about what we expect too (the 404 of a passive declare
/// that finds no queue is how the shard-count check asks).
fn directives(rust_log: Option<&str>) -> String {
    match rust_log.map(str::trim).filter(|s| !s.is_empty()) {
        None => "info,lapin=off".to_owned(),
        Some(given) if given.contains("lapin") => given.to_owned(),
        Some(given) => format!("{given},lapin=off"),
    }
}

/// Whether log lines are coloured: only on a terminal, and not when
/// `NO_COLOR` is set to anything but the empty string (no-color.org). Files,
/// pipes and CI logs get plain text.
fn colours(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Logs to stderr, filtered by `RUST_LOG` (see [`directives`]), and installs the
/// OTLP trace exporter when the environment asks for one. Log lines inside a
/// delivery's processing carry its `trace_id` and `span_id` (JSON: in `span`).
/// Keep the returned guard until exit: dropping it flushes the spans.
pub(crate) fn init(format: LogFormat) -> Telemetry {
    let filter = EnvFilter::try_new(directives(env::var("RUST_LOG").ok().as_deref()))
        .unwrap_or_else(|_| EnvFilter::new(directives(None)));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colours(
            std::io::stderr().is_terminal(),
            env::var_os("NO_COLOR").as_deref(),
        ))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    let endpoint = otlp_endpoint();
    let exporter = match endpoint {
        Some((variable, ref endpoint)) if !tracing_disabled() => {
            Exporter::start(variable, endpoint)
        }
        _ => Ok(None),
    };
    let endpoint = endpoint.map(|(_, endpoint)| endpoint);
    match exporter {
        Ok(Some(exporter)) => {
            let endpoint = endpoint.as_deref().map(redact);
            tracing::debug!(endpoint = ?endpoint, "exporting traces over OTLP/HTTP");
            Telemetry {
                exporter: Some(exporter),
            }
        }
        Ok(None) => Telemetry { exporter: None },
        Err(e) => {
            // Tracing is an aid: a bad OTEL_* setting must not stop the fleet.
            // The exporter's error may quote the endpoint as given.
            let error = scrub(&e.to_string(), endpoint.as_deref().unwrap_or_default());
            tracing::error!(%error, "OTLP trace export is off");
            Telemetry { exporter: None }
        }
    }
}

/// The variable naming the endpoint of traces alone, used as given.
const TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
/// The variable naming the collector: the exporter appends `/v1/traces`.
const ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// The OTLP endpoint for traces, when set, with the variable it came from:
/// [`TRACES_ENDPOINT`], else [`ENDPOINT`].
fn otlp_endpoint() -> Option<(&'static str, String)> {
    [TRACES_ENDPOINT, ENDPOINT]
        .into_iter()
        .filter_map(|name| Some((name, env::var(name).ok()?)))
        .find(|(_, value)| !value.trim().is_empty())
}

/// An endpoint's user and password, percent-decoded, and the endpoint
/// without them: the HTTP stack logs the URL it is given at trace level
/// (its connection pool's key), so credentials travel as basic auth only.
/// `Ok(None)` when it holds none; an error when its userinfo holds reserved
/// characters typed raw (an `@` past the first `/`, `?` or `#`).
fn credentials(endpoint: &str) -> anyhow::Result<Option<(String, String)>> {
    let Some((scheme, rest)) = endpoint.split_once("://") else {
        return Ok(None);
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..end].rfind('@') else {
        if rest[end..].contains('@') {
            anyhow::bail!(
                "the OTLP endpoint {} does not parse: {PERCENT_ENCODE}",
                redact(endpoint)
            );
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

/// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`.
fn tracing_disabled() -> bool {
    let is = |name: &str, value: &str| {
        env::var(name).is_ok_and(|v| v.trim().eq_ignore_ascii_case(value))
    };
    is("OTEL_SDK_DISABLED", "true") || is("OTEL_TRACES_EXPORTER", "none")
}

/// Installed telemetry; flushes and shuts the exporter down when dropped.
#[must_use = "dropping it flushes and stops the trace exporter"]
pub(crate) struct Telemetry {
    exporter: Option<Exporter>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(exporter) = self.exporter.take() {
            exporter.shutdown();
        }
    }
}

struct Exporter {
    provider: SdkTracerProvider,
    runtime: tokio::runtime::Runtime,
}

impl Exporter {
    fn start(variable: &str, endpoint: &str) -> anyhow::Result<Option<Self>> {
        if let Ok(protocol) = env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|_| env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
            && protocol.trim() != "http/protobuf"
        {
            anyhow::bail!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={protocol} is not supported: shardline exports http/protobuf"
            );
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otel-export")
            .enable_all()
            .build()?;
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
        let exporter = exporter.build()?;
        let processor = BatchSpanProcessor::builder(exporter, runtime::Tokio).build();
        let mut resource = Resource::builder();
        if env::var("OTEL_SERVICE_NAME").is_ok_and(|name| !name.trim().is_empty()) {
            // The environment detector has it already.
        } else {
            resource = resource.with_service_name(DEFAULT_SERVICE_NAME);
        }
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource.build())
            .build();
        global::set_tracer_provider(provider.clone());
        global::set_text_map_propagator(TraceContextPropagator::new());
        Ok(Some(Self { provider, runtime }))
    }

    /// Exports what is buffered and stops, within [`FLUSH_TIMEOUT`].
    fn shutdown(self) {
        if let Err(e) = self.provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
            tracing::warn!(error = %e, "flushing the last spans failed");
        }
        self.runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::{ENDPOINT, TRACES_ENDPOINT, colours, credentials, directives, traces_url};

    #[test]
    fn lapin_is_quiet_unless_named() {
        assert_eq!(directives(None), "info,lapin=off");
        assert_eq!(directives(Some(" ")), "info,lapin=off");
        assert_eq!(directives(Some("error")), "error,lapin=off");
        assert_eq!(directives(Some("warn,lapin=debug")), "warn,lapin=debug");
    }

    #[test]
    fn colours_only_on_a_terminal_without_no_color() {
        assert!(colours(true, None));
        assert!(colours(true, Some(OsStr::new(""))));
        assert!(!colours(true, Some(OsStr::new("1"))));
        assert!(!colours(false, None));
        assert!(!colours(false, Some(OsStr::new(""))));
    }

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
