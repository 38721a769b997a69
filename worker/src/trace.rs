//! A delivery's consumer span (`{queue} process`), from its start in the
//! attempt stage (`Processor::start_trace`) to its end where it settles.

use std::time::Duration;

use opentelemetry::trace::{SpanContext, Status, TraceContextExt as _};
use opentelemetry::{Context, KeyValue};
use shardline_contract::headers::FailReason;
use shardline_contract::telemetry::{self, attr, outcome};

use crate::handler::HandlerError;

/// One delivery's consumer span (`{queue} process`) and what is propagated from
/// it: the handler's context and `traceparent`, and a dead letter's trace
/// context. Ends when settled; dropped unsettled (stop, lost connection), it
/// ends with outcome `abandoned`.
pub(crate) struct ProcessTrace {
    cx: Context,
    span_context: SpanContext,
    traceparent: String,
    recording: bool,
    finished: bool,
}

impl ProcessTrace {
    /// The span in `cx`, what it propagates, and whether it records.
    pub(crate) fn new(
        cx: Context,
        span_context: SpanContext,
        traceparent: String,
        recording: bool,
    ) -> Self {
        Self {
            cx,
            span_context,
            traceparent,
            recording,
            finished: false,
        }
    }

    /// The context holding the process span: the parent of handler spans.
    pub(crate) fn context(&self) -> &Context {
        &self.cx
    }

    /// The span context propagated downstream and onto a dead letter: the
    /// process span's, or (no tracer provider) the incoming one, else a fresh one.
    pub(crate) fn span_context(&self) -> &SpanContext {
        &self.span_context
    }

    pub(crate) fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// A failed attempt, to be retried after `after`.
    pub(crate) fn retry(&self, attempt: u32, after: Duration, error: &HandlerError) {
        if self.recording {
            self.cx.span().add_event(
                telemetry::event::RETRY,
                vec![
                    KeyValue::new(attr::ATTEMPT, i64::from(attempt)),
                    KeyValue::new(
                        attr::RETRY_IN_MS,
                        i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                    ),
                    KeyValue::new(attr::ERROR, error.to_string()),
                    KeyValue::new(attr::FAULT, error.fault().as_str()),
                ],
            );
        }
    }

    /// Waiting for another consumer's claim to lapse.
    pub(crate) fn claim_wait(&self, after: Duration) {
        if self.recording {
            self.cx.span().add_event(
                telemetry::event::CLAIM_WAIT,
                vec![KeyValue::new(
                    attr::RETRY_IN_MS,
                    i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                )],
            );
        }
    }

    /// Ends the span with `outcome` (a [`telemetry::outcome`] value) after
    /// `attempts` handler attempts.
    pub(crate) fn finish(mut self, outcome: &'static str, attempts: u32) {
        self.end(outcome, attempts, Vec::new());
    }

    /// Ends the span of a dead-lettered event, with an error status.
    pub(crate) fn dead_lettered(
        mut self,
        reason: FailReason,
        attempts: u32,
        id: &str,
        error: &str,
    ) {
        if self.recording {
            self.cx.span().set_status(Status::error(error.to_owned()));
        }
        self.end(
            outcome::DEAD_LETTERED,
            attempts,
            vec![
                KeyValue::new(attr::FAIL_REASON, reason.as_str()),
                KeyValue::new(attr::DEAD_LETTER_ID, id.to_owned()),
                KeyValue::new(attr::ERROR, error.to_owned()),
            ],
        );
    }

    fn end(&mut self, outcome: &'static str, attempts: u32, mut more: Vec<KeyValue>) {
        self.finished = true;
        if !self.recording {
            return;
        }
        more.push(KeyValue::new(attr::OUTCOME, outcome));
        more.push(KeyValue::new(attr::ATTEMPT, i64::from(attempts)));
        let span = self.cx.span();
        span.set_attributes(more);
        span.end();
    }
}

impl Drop for ProcessTrace {
    fn drop(&mut self) {
        if !self.finished {
            self.end(outcome::ABANDONED, 0, Vec::new());
        }
    }
}
