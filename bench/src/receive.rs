//! A stand-in for the user's service while trying shardline out (`shardline
//! receive`): it answers every `POST` with 200 and hands each request, as
//! the worker's `http` handler sent it, to a callback (the command line
//! prints it). Other methods get 405. Bodies above [`BODY_LIMIT`] get 413.

use std::convert::Infallible;
use std::net::SocketAddr;

use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Bytes;
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use shardline_connect::inbound::RequestBody;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::Error;

/// The largest body the receiver reads.
pub const BODY_LIMIT: usize = 1 << 20;

/// One request the receiver answered 200.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub path: String,
    /// `X-Order-Id`, `X-Seq`, `X-Shard`, `X-Attempt`, `Idempotency-Key`, as sent
    /// (the order id and the key percent-encoded); empty when absent.
    pub order_id: String,
    pub seq: String,
    pub shard: String,
    pub attempt: String,
    pub idempotency_key: String,
    /// The event's body as it was published.
    pub body: Bytes,
}

/// Binds `addr` (port 0: a free one) and returns the listener's address
/// with the serving future, which runs until `stop`.
pub async fn bind<F>(
    addr: SocketAddr,
    stop: CancellationToken,
    on_request: F,
) -> Result<(SocketAddr, impl Future<Output = ()>), Error>
where
    F: Fn(Received) + Clone + Send + Sync + 'static,
{
    let listener: TcpListener = shardline_worker::http::bind(addr).await?;
    let addr = listener.local_addr()?;
    let serve = shardline_worker::http::serve_with(listener, stop, move |req| {
        let on_request = on_request.clone();
        async move { Ok::<_, Infallible>(answer(req, &on_request).await) }
    });
    Ok((addr, serve))
}

async fn answer(
    req: Request<RequestBody>,
    on_request: &impl Fn(Received),
) -> Response<Full<Bytes>> {
    if req.method() != Method::POST {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "POST events here\n");
    }
    let path = req.uri().path().to_owned();
    let (parts, body) = req.into_parts();
    let Ok(body) = Limited::new(body, BODY_LIMIT).collect().await else {
        return reply(StatusCode::PAYLOAD_TOO_LARGE, "body too large or cut off\n");
    };
    on_request(received(path, &parts.headers, body.to_bytes()));
    reply(StatusCode::OK, "{}")
}

fn received(path: String, headers: &HeaderMap, body: Bytes) -> Received {
    let header = |name: &str| {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default()
    };
    Received {
        path,
        order_id: header("x-order-id"),
        seq: header("x-seq"),
        shard: header("x-shard"),
        attempt: header("x-attempt"),
        idempotency_key: header("idempotency-key"),
        body,
    }
}

fn reply(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    async fn post(addr: SocketAddr, method: &str, body: Vec<u8>) -> u16 {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} /events HTTP/1.1\r\nhost: x\r\nx-order-id: A1\r\nx-seq: 2\r\n\
             idempotency-key: A1%3Aorder.paid%3A2\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(&body).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer[9..12].parse().unwrap()
    }

    #[tokio::test]
    async fn a_post_is_answered_200_and_handed_over_as_sent() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let record = {
            let seen = seen.clone();
            move |r: Received| seen.lock().unwrap().push(r)
        };
        let (addr, serve) = bind(SocketAddr::from(([127, 0, 0, 1], 0)), stop.clone(), record)
            .await
            .unwrap();
        tokio::spawn(serve);
        assert_eq!(
            post(addr, "POST", br#"{"order_id":"A1"}"#.to_vec()).await,
            200
        );
        assert_eq!(post(addr, "GET", Vec::new()).await, 405);
        assert_eq!(post(addr, "POST", vec![b' '; BODY_LIMIT + 1]).await, 413);
        stop.cancel();
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(
            (
                seen[0].path.as_str(),
                seen[0].order_id.as_str(),
                seen[0].seq.as_str()
            ),
            ("/events", "A1", "2")
        );
        assert_eq!(seen[0].idempotency_key, "A1%3Aorder.paid%3A2");
        assert_eq!(seen[0].shard, "");
        assert_eq!(&seen[0].body[..], br#"{"order_id":"A1"}"#);
    }
}
