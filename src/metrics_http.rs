//! `/metrics` (and `/healthz`) of the commands that serve nothing else
//! (`reconcile --interval`, `outbox relay`) on `--metrics-addr`, through the
//! worker's guarded accept loop.

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// What `/metrics` answers with: the OpenMetrics text format.
use shardline_ops::reconcile::METRICS_CONTENT_TYPE as CONTENT_TYPE;

/// Serves `/metrics` (what `encode` renders) and `/healthz` on `listener`
/// until `shutdown`.
pub(crate) async fn serve<F>(listener: TcpListener, shutdown: CancellationToken, encode: F)
where
    F: Fn() -> Result<String, std::fmt::Error> + Send + Sync + 'static,
{
    let encode = Arc::new(encode);
    shardline_worker::http::serve_with(listener, shutdown, move |req| {
        let encode = Arc::clone(&encode);
        async move { respond(encode.as_ref(), &req) }
    })
    .await;
}

fn respond<F>(
    encode: &F,
    req: &Request<shardline_connect::inbound::RequestBody>,
) -> Result<Response<Full<Bytes>>, Infallible>
where
    F: Fn() -> Result<String, std::fmt::Error>,
{
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&hyper::Method::GET | &hyper::Method::HEAD, "/metrics") => match encode() {
            Ok(text) => (StatusCode::OK, CONTENT_TYPE, text),
            Err(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                "cannot encode metrics\n".into(),
            ),
        },
        (&hyper::Method::GET | &hyper::Method::HEAD, "/healthz") => (
            StatusCode::OK,
            "application/json",
            "{\"alive\":true}\n".into(),
        ),
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    Ok(response)
}
