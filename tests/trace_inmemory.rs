//! One trace from publish to the downstream call, seen by an in-memory span
//! exporter: the publisher and worker libraries run in this process (docs/semantics.md §5).
//!
//! The tracer provider is the process's global one, installed once for this
//! test binary (its own: an in-process worker of another test would export
//! into it); spans are picked out by this test's order ids.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::trace::{SpanId, SpanKind, Status, TraceId};
use opentelemetry::{Key, Value, global};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use shardline_contract::NewEvent;
use shardline_contract::headers::{self, header_str};
use shardline_contract::telemetry::{self, attr, outcome};
use shardline_worker::{Config, RetryPolicy};

use shardline_testkit::{Downstream, PROCESSING, Reply, TestEnv, Worker, dlq, order_ids};

/// The in-memory exporter behind the global tracer provider.
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        global::set_tracer_provider(provider);
        exporter
    })
}

fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == Key::from(key.to_owned()))
        .map(|kv| &kv.value)
}

fn attr_str(span: &SpanData, key: &str) -> Option<String> {
    attr(span, key).map(|v| v.as_str().into_owned())
}

/// Trace id and parent (span) id of a W3C `traceparent`.
fn parse_traceparent(tp: &str) -> (TraceId, SpanId) {
    let parts: Vec<&str> = tp.split('-').collect();
    (
        TraceId::from_hex(parts[1]).unwrap(),
        SpanId::from_hex(parts[2]).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_process_and_downstream_call_share_one_trace() {
    let exporter = exporter();
    let env = TestEnv::new("trace-mem").await;
    env.apply_topology().await;
    let orders = order_ids(&format!("{}-", env.id), 3);
    // The last order's event is refused (dead-lettered), the first one's fails
    // once with 503 (one retry).
    let (flaky, refused) = (orders[0].clone(), orders[2].clone());
    let downstream = Downstream::scripted(move |call, before| {
        let order = call.order_id.as_deref();
        if order == Some(refused.as_str()) {
            Reply::status(422)
        } else if order == Some(flaky.as_str())
            && !before.iter().any(|c| c.order_id == call.order_id)
        {
            Reply::status(503)
        } else {
            Reply::ok()
        }
    })
    .await;

    let config = Config {
        retry: RetryPolicy {
            base: Duration::from_millis(10),
            cap: Duration::from_millis(50),
            ..RetryPolicy::default()
        },
        ..env.worker_config(&format!("{}-w1", env.id))
    };
    let worker = Worker::spawn(config, downstream.handler());

    let mut publisher = shardline_publisher::Publisher::connect(shardline_publisher::Config {
        amqp: env.amqp_target(),
        names: env.names.clone(),
        shards: env.shards,
        ..shardline_publisher::Config::default()
    })
    .await
    .unwrap();
    for order in &orders {
        publisher
            .publish_event(&NewEvent {
                order_id: shardline_contract::OrderId::new(order.clone()).unwrap(),
                event: "order.created".into(),
                seq: Some(1),
                event_id: None,
                data: serde_json::json!({}),
            })
            .await
            .unwrap();
    }
    publisher.close().await.unwrap();

    let conn = env.connect().await;
    let letters = dlq::take(&env, &conn, 1, PROCESSING).await;
    let calls = downstream
        .wait_for("every order answered 2xx or 422", PROCESSING, |calls| {
            orders.iter().all(|o| {
                calls
                    .iter()
                    .any(|c| c.order_id.as_deref() == Some(o) && c.status != 503)
            })
        })
        .await;
    worker.stop().await;

    let spans: Vec<SpanData> = exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| attr_str(s, attr::ORDER_ID).is_some_and(|o| orders.contains(&o)))
        .collect();
    for order in &orders {
        let of = |kind: SpanKind| {
            let found: Vec<&SpanData> = spans
                .iter()
                .filter(|s| {
                    s.span_kind == kind && attr_str(s, attr::ORDER_ID).as_ref() == Some(order)
                })
                .collect();
            assert_eq!(found.len(), 1, "{order}: one {kind:?} span, got {found:#?}");
            found[0]
        };
        let publish = of(SpanKind::Producer);
        let process = of(SpanKind::Consumer);
        let shard = env.shard_of(order);
        let queue = env.shard_queue(shard);

        assert_eq!(publish.name, telemetry::span::publish(&env.names.exchange));
        assert_eq!(process.name, telemetry::span::process(&queue));
        for span in [publish, process] {
            assert_eq!(
                attr_str(span, attr::MESSAGING_SYSTEM).as_deref(),
                Some("rabbitmq")
            );
            assert_eq!(
                attr_str(span, attr::MESSAGING_DESTINATION_NAME).as_deref(),
                Some(env.names.exchange.as_str())
            );
            assert_eq!(
                attr_str(span, attr::MESSAGING_ROUTING_KEY),
                Some(format!("shard.{shard}"))
            );
            assert_eq!(attr(span, attr::SHARD), Some(&Value::I64(i64::from(shard))));
            assert_eq!(attr(span, attr::SEQ), Some(&Value::I64(1)));
            assert!(attr_str(span, attr::MESSAGING_MESSAGE_ID).is_some());
        }
        assert_eq!(
            attr_str(publish, attr::MESSAGING_MESSAGE_ID),
            attr_str(process, attr::MESSAGING_MESSAGE_ID)
        );
        assert_eq!(
            attr_str(process, attr::DEDUP_KEY),
            Some(format!("{order}:order.created:1"))
        );

        // publish → process: same trace, the publish span is the parent.
        let trace_id = publish.span_context.trace_id();
        assert_eq!(process.span_context.trace_id(), trace_id, "{order}");
        assert_eq!(
            process.parent_span_id,
            publish.span_context.span_id(),
            "{order}"
        );
        assert!(process.parent_span_is_remote);

        // process → downstream: the call's traceparent names the process span.
        let order_calls: Vec<_> = calls
            .iter()
            .filter(|c| c.order_id.as_deref() == Some(order))
            .collect();
        assert!(!order_calls.is_empty());
        for call in &order_calls {
            let tp = call
                .header("traceparent")
                .expect("traceparent sent downstream");
            assert_eq!(
                parse_traceparent(tp),
                (trace_id, process.span_context.span_id()),
                "{order}: downstream traceparent {tp}"
            );
        }

        let outcome_of = attr_str(process, attr::OUTCOME);
        if *order == orders[2] {
            assert_eq!(outcome_of.as_deref(), Some(outcome::DEAD_LETTERED));
            assert_eq!(
                attr_str(process, attr::FAIL_REASON).as_deref(),
                Some("handler")
            );
            assert!(matches!(process.status, Status::Error { .. }));
            // The dead letter carries the process span's context.
            assert_eq!(letters.len(), 1, "{}", dlq::describe(&letters));
            let tp = header_str(&letters[0].properties, headers::TRACEPARENT).unwrap();
            assert_eq!(
                parse_traceparent(tp),
                (trace_id, process.span_context.span_id())
            );
        } else {
            assert_eq!(outcome_of.as_deref(), Some(outcome::PROCESSED), "{order}");
        }
        let retries: Vec<_> = process
            .events
            .iter()
            .filter(|e| e.name == telemetry::event::RETRY)
            .collect();
        if *order == orders[0] {
            assert_eq!(retries.len(), 1, "{order}: one retry event");
            let attempt = retries[0]
                .attributes
                .iter()
                .find(|kv| kv.key.as_str() == attr::ATTEMPT)
                .map(|kv| kv.value.clone());
            assert_eq!(attempt, Some(Value::I64(1)));
            assert_eq!(attr(process, attr::ATTEMPT), Some(&Value::I64(2)));
            assert_eq!(order_calls.len(), 2);
        } else {
            assert!(retries.is_empty(), "{order}: {retries:?}");
        }
    }
}
