//! OTLP/HTTP export from the binaries: `shardline publish` and `shardline
//! worker`, pointed at a small OTLP receiver in the test by
//! `OTEL_EXPORTER_OTLP_ENDPOINT`, export their spans (flushed on exit, the
//! worker's after a SIGTERM drain) under `OTEL_SERVICE_NAME` (docs/semantics.md §5).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use shardline_contract::telemetry::{attr, span};
use tokio::net::TcpListener;
use tokio::process::Command;

use shardline_testkit::dlq::text;
use shardline_testkit::{ChildWorker, Downstream, PROCESSING, TestEnv, order_ids};

/// One request: its path and body.
type Export = (String, Vec<u8>);

/// What an OTLP/HTTP receiver got: one entry per `POST /v1/traces`.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<Export>>>);

impl Received {
    /// Every span exported under `service`, decoded.
    fn spans_of(&self, service: &str) -> Vec<Span> {
        let requests = self.0.lock().unwrap().clone();
        let mut spans = Vec::new();
        for (_, body) in requests {
            let request = ExportTraceServiceRequest::decode(body.as_slice()).unwrap();
            for resource_spans in request.resource_spans {
                let ours = resource_spans.resource.as_ref().is_some_and(|r| {
                    r.attributes.iter().any(|kv| {
                        kv.key == "service.name" && string(kv.value.as_ref()) == Some(service)
                    })
                });
                if ours {
                    spans.extend(resource_spans.scope_spans.into_iter().flat_map(|s| s.spans));
                }
            }
        }
        spans
    }

    fn paths(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(p, _)| p.clone())
            .collect()
    }
}

fn string(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> Option<&str> {
    match value?.value.as_ref()? {
        Value::StringValue(s) => Some(s),
        _ => None,
    }
}

fn span_attr<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| string(kv.value.as_ref()))
}

/// An OTLP/HTTP (protobuf) trace receiver on a free local port.
async fn receiver() -> (String, Received, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received = Received::default();
    let store = received.clone();
    let server = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let store = store.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let store = store.clone();
                    async move {
                        let path = req.uri().path().to_owned();
                        let body = req.into_body().collect().await.map(|b| b.to_bytes());
                        let status = match body {
                            Ok(body) if path == "/v1/traces" => {
                                store.0.lock().unwrap().push((path, body.to_vec()));
                                200
                            }
                            _ => 404,
                        };
                        let response = Response::builder()
                            .status(status)
                            .header("content-type", "application/x-protobuf")
                            .body(Full::new(Bytes::new()))
                            .unwrap();
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), received, server)
}

/// A `shardline` command against `env` (no arguments yet), exporting to
/// `endpoint` as `service`.
fn exporting(env: &TestEnv, endpoint: &str, service: &str) -> Command {
    let mut cmd = env.shardline_command();
    cmd.env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env("OTEL_SERVICE_NAME", service);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binaries_export_their_spans_over_otlp_http() {
    let (endpoint, received, server) = receiver().await;
    let env = TestEnv::new("trace-otlp").await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let publisher_service = format!("shardline-publish-{}", env.id);
    let worker_service = format!("shardline-worker-{}", env.id);

    let orders = order_ids(&format!("{}-", env.id), 3);
    for order in &orders {
        let out = exporting(&env, &endpoint, &publisher_service)
            .args(["publish", "--order-id", order])
            .args(["--event", "order.created", "--seq", "1"])
            .args(env.global_args())
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "shardline publish: {}", text(&out));
    }

    let handler = downstream.url();
    // A process: the point is the binary's exporter, flushed after SIGTERM.
    let mut cmd = exporting(&env, &endpoint, &worker_service);
    cmd.arg("worker").args(env.global_args()).args([
        "--handler",
        &handler,
        "--worker-name",
        "otlp",
    ]);
    let mut worker = ChildWorker::spawn(&env, "otlp", cmd);
    let calls = downstream
        .wait_for("every event delivered", PROCESSING, |calls| {
            orders.iter().all(|o| {
                calls
                    .iter()
                    .any(|c| c.order_id.as_deref() == Some(o) && c.ok())
            })
        })
        .await;
    // The default batch delay is 5 s: what arrives now was flushed on exit.
    worker.sigterm();
    let status = worker.wait_exit(Duration::from_secs(20)).await;
    let log_text = worker.log_text();
    assert_eq!(status.code(), Some(0), "worker log:\n{log_text}");
    server.abort();

    assert!(
        received.paths().iter().all(|p| p == "/v1/traces"),
        "{:?}",
        received.paths()
    );
    let raw: Vec<u8> = received
        .0
        .lock()
        .unwrap()
        .iter()
        .flat_map(|(_, b)| b.clone())
        .collect();
    let contains = |needle: &str| raw.windows(needle.len()).any(|w| w == needle.as_bytes());
    assert!(
        contains(&worker_service),
        "no export under {worker_service}"
    );

    let published = received.spans_of(&publisher_service);
    let processed = received.spans_of(&worker_service);
    for order in &orders {
        let shard = env.shard_of(order);
        let publish = published
            .iter()
            .find(|s| span_attr(s, attr::ORDER_ID) == Some(order.as_str()))
            .unwrap_or_else(|| panic!("{order}: no publish span among {published:#?}"));
        assert_eq!(publish.name, span::publish(&env.names.exchange));
        let process = processed
            .iter()
            .find(|s| span_attr(s, attr::ORDER_ID) == Some(order.as_str()))
            .unwrap_or_else(|| panic!("{order}: no process span; worker log:\n{log_text}"));
        assert_eq!(process.name, span::process(&env.shard_queue(shard)));
        assert!(contains(&process.name));
        assert_eq!(process.trace_id, publish.trace_id, "{order}: one trace");
        assert_eq!(
            process.parent_span_id, publish.span_id,
            "{order}: child of publish"
        );
        let call = calls
            .iter()
            .find(|c| c.order_id.as_deref() == Some(order.as_str()))
            .unwrap();
        let expected = format!("00-{}-{}-01", hex(&process.trace_id), hex(&process.span_id));
        assert_eq!(
            call.header("traceparent"),
            Some(expected.as_str()),
            "{order}"
        );
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
