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

use shardline_connect::otlp::Exporter;
use tracing_subscriber::EnvFilter;

use crate::LogFormat;

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
    match Exporter::from_env() {
        Ok(Some(exporter)) => {
            tracing::debug!(endpoint = %exporter.endpoint, "exporting traces over OTLP/HTTP");
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
