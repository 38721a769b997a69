//! The worker's HTTP endpoint ([`crate::Config::metrics_addr`]): `/metrics` (Prometheus,
//! OpenMetrics text), `/healthz` (the process is alive) and `/readyz` (broker
//! connected, Redis reachable, every assigned shard consuming or standing by).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use shardline_connect::inbound::{self, Inbound, RequestBody};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::BindError;
use crate::live::ShardState;
use crate::metrics::{self, Metrics};
use crate::status::WriterHealth;
use crate::store::RedisHealth;

/// What `/readyz` looks at.
#[derive(Debug)]
pub(crate) struct Readiness {
    pub(crate) metrics: Arc<Metrics>,
    /// Both broker connections are up (false while reconnecting).
    pub(crate) broker: AtomicBool,
    pub(crate) redis: Arc<RedisHealth>,
    pub(crate) status_writer: Arc<WriterHealth>,
}

impl Readiness {
    /// Whether the worker is ready, and the JSON body that says why not.
    fn check(&self) -> (bool, serde_json::Value) {
        let broker = self.broker.load(Ordering::Relaxed);
        let redis = self.redis.is_up() && self.status_writer.redis_ok();
        let (mut consuming, mut standing_by, mut starting) = (Vec::new(), Vec::new(), Vec::new());
        // With `--assign auto`, the shards the fleet gave this worker.
        for watch in self
            .metrics
            .watches()
            .into_iter()
            .filter(|w| w.is_assigned())
        {
            let shard = watch.shard.get();
            match watch.state() {
                ShardState::Consuming => consuming.push(shard),
                ShardState::StandingBy | ShardState::Registered => standing_by.push(shard),
                ShardState::Idle => starting.push(shard),
            }
        }
        let shards_ok = starting.is_empty();
        let ready = broker && redis && shards_ok;
        let mut not_ready = Vec::new();
        if !broker {
            not_ready.push("broker");
        }
        if !redis {
            not_ready.push("redis");
        }
        if !shards_ok {
            not_ready.push("shards");
        }
        let body = serde_json::json!({
            "ready": ready,
            "not_ready": not_ready,
            "broker": if broker { "connected" } else { "disconnected" },
            "redis": if redis { "reachable" } else { "unreachable" },
            "shards": {
                "consuming": consuming,
                "standing_by": standing_by,
                "not_consuming": starting,
            },
        });
        (ready, body)
    }
}

/// Binds `addr` now, so that a port in use fails the start before anything
/// connects.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, BindError> {
    TcpListener::bind(addr).await.map_err(|e| BindError {
        addr,
        cause: match e.kind() {
            std::io::ErrorKind::AddrInUse => "address in use".into(),
            _ => e.to_string(),
        },
    })
}

/// Serves the endpoints on `listener` under `limits` until `shutdown`, on a
/// task of its own.
pub(crate) fn spawn(
    listener: TcpListener,
    limits: Inbound,
    readiness: &Arc<Readiness>,
    shutdown: &CancellationToken,
) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    let readiness = Arc::clone(readiness);
    tokio::spawn(inbound::serve(
        listener,
        limits,
        shutdown.clone(),
        move |req| respond(readiness.clone(), req),
    ));
}

/// Serves HTTP/1 on `listener` until `shutdown`, answering each request with
/// `respond`, under the default [`Inbound`] limits (a 10 s header-read
/// timeout, 5 s idle keep-alive, 64 connections, at the cap the one waiting
/// longest without a request evicted): the endpoints of a program embedding
/// the worker (the CLI's `reconcile` metrics). The accept loop is
/// [`shardline_connect::inbound::serve`], the console's too.
pub async fn serve_with<F, Fut>(listener: TcpListener, shutdown: CancellationToken, respond: F)
where
    F: Fn(Request<RequestBody>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send + 'static,
{
    inbound::serve(listener, Inbound::default(), shutdown, respond).await;
}

async fn respond(
    readiness: Arc<Readiness>,
    req: Request<RequestBody>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        ));
    }
    let response = match req.uri().path() {
        "/metrics" => match readiness.metrics.encode() {
            Ok(text) => reply(StatusCode::OK, metrics::CONTENT_TYPE, text),
            Err(_) => reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                "cannot encode metrics\n".into(),
            ),
        },
        "/healthz" => reply(
            StatusCode::OK,
            "application/json",
            "{\"alive\":true}\n".into(),
        ),
        "/readyz" => {
            let (ready, body) = readiness.check();
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            reply(status, "application/json", format!("{body}\n"))
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /metrics, /healthz or /readyz\n".into(),
        ),
    };
    Ok(response)
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert(CONTENT_TYPE, value);
    }
    response
}
