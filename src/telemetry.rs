//! Logging and tracing set-up. (The stop signal is the worker library's
//! `shardline_worker::cancel_on_signal`.)
//!
//! Tracing (docs/semantics.md §5) is OpenTelemetry, configured by the standard `OTEL_*`
//! variables and off unless an OTLP endpoint is set: then spans are batched
//! and exported over OTLP/HTTP (protobuf) from a one-thread runtime of their
//! own, so that exporting never competes with shard tasks and still runs
//! while the main runtime drains. Without it no tracer provider is installed:
//! spans are no-ops and only the W3C context is propagated.

use std::env;
use std::io::IsTerminal as _;
use std::time::Duration;

use opentelemetry::global;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::runtime;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
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
        Some(ref endpoint) if !tracing_disabled() => Exporter::start(),
        _ => Ok(None),
    };
    match exporter {
        Ok(Some(exporter)) => {
            tracing::debug!(endpoint = ?endpoint, "exporting traces over OTLP/HTTP");
            Telemetry {
                exporter: Some(exporter),
            }
        }
        Ok(None) => Telemetry { exporter: None },
        Err(e) => {
            // Tracing is an aid: a bad OTEL_* setting must not stop the fleet.
            tracing::error!(error = %e, "OTLP trace export is off");
            Telemetry { exporter: None }
        }
    }
}

/// The OTLP endpoint for traces, when set: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
/// else `OTEL_EXPORTER_OTLP_ENDPOINT` (the exporter appends `/v1/traces`).
fn otlp_endpoint() -> Option<String> {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .into_iter()
    .filter_map(|name| env::var(name).ok())
    .find(|value| !value.trim().is_empty())
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
    fn start() -> anyhow::Result<Option<Self>> {
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
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build()?;
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

    use super::{colours, directives};

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
}
