//! The worker's HTTP endpoint ([`crate::Config::metrics_addr`]): `/metrics` (Prometheus,
//! OpenMetrics text), `/healthz` (the process is alive) and `/readyz` (broker
//! connected, Redis reachable, every assigned shard consuming or standing by).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::CONTENT_TYPE;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::error::BindError;
use crate::limits::METRICS_CONNECTIONS;
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
        for watch in self.metrics.watches().filter(|w| w.is_assigned()) {
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

/// Serves the endpoints on `listener` until `shutdown`.
pub(crate) async fn serve(
    listener: TcpListener,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
) {
    serve_with(listener, shutdown, move |req| {
        respond(readiness.clone(), req)
    })
    .await;
}

/// How long a connection may take to send a request's headers, the first or
/// the next on a kept-alive connection, before it is closed: a client that
/// connects and says nothing does not keep one of the [`METRICS_CONNECTIONS`]
/// for longer.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves HTTP/1 on `listener` until `shutdown`, answering each request with
/// `respond`: the worker's endpoints, and any other a program embedding the
/// worker serves (the CLI's `reconcile` metrics).
///
/// At most 64 connections are served at once (the file descriptors the worker
/// counts at start): at the cap the next connection waits in the listen
/// backlog until one ends, so a scrape may wait up to 10 s behind clients that
/// hold connections and say nothing, which are closed then.
pub async fn serve_with<F, Fut>(listener: TcpListener, shutdown: CancellationToken, respond: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(METRICS_CONNECTIONS));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = accept(&listener, &slots) => accepted,
            _ = shutdown.cancelled() => return,
        };
        let (stream, slot) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::debug!(error = %e, "metrics endpoint: accept failed");
                continue;
            }
        };
        while connections.try_join_next().is_some() {}
        let respond = respond.clone();
        connections.spawn(async move {
            let served = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service_fn(respond))
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "metrics endpoint: connection ended");
            }
            drop(slot);
        });
    }
}

/// The next connection, once fewer than [`METRICS_CONNECTIONS`] are served.
async fn accept(
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
) -> std::io::Result<(TcpStream, OwnedSemaphorePermit)> {
    // The semaphore is never closed, so this cannot fail; were it to, the
    // endpoint would stop accepting, which the error below reports.
    let slot = slots
        .clone()
        .acquire_owned()
        .await
        .map_err(std::io::Error::other)?;
    let (stream, _) = listener.accept().await?;
    Ok((stream, slot))
}

async fn respond(
    readiness: Arc<Readiness>,
    req: Request<Incoming>,
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    /// An endpoint answering `ok` to every request, and its address.
    async fn endpoint(shutdown: &CancellationToken) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_with(listener, shutdown.clone(), |_req| async {
            Ok(reply(StatusCode::OK, "text/plain", "ok".to_owned()))
        }));
        addr
    }

    /// Sends one request on `stream` and reads its answer to the body.
    async fn ask(stream: &mut TcpStream) -> String {
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: worker\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 512];
        while !answer.ends_with(b"\r\n\r\nok") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the answer: {answer:?}");
            answer.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(answer).unwrap()
    }

    #[tokio::test]
    async fn serves_at_most_its_connection_cap_at_once() {
        let shutdown = CancellationToken::new();
        let addr = endpoint(&shutdown).await;
        // Each kept-alive connection has been answered, so each holds a slot.
        let mut held = Vec::new();
        for _ in 0..METRICS_CONNECTIONS {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            assert!(ask(&mut stream).await.starts_with("HTTP/1.1 200"));
            held.push(stream);
        }
        let mut next = TcpStream::connect(addr).await.unwrap();
        let waiting = tokio::spawn(async move { ask(&mut next).await });
        // A served connection would answer in microseconds; at the cap it waits.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "a connection over the cap was served"
        );
        drop(held.pop());
        let answer = waiting.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        shutdown.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn closes_a_connection_that_sends_no_request() {
        let shutdown = CancellationToken::new();
        let addr = endpoint(&shutdown).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 64];
        let read = silent.read(&mut buf).await;
        assert!(matches!(read, Ok(0)), "{read:?}");
        assert!(started.elapsed() >= HEADER_READ_TIMEOUT);
        shutdown.cancel();
    }
}
