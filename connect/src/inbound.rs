//! Inbound HTTP/1 connections, guarded: the one accept loop of the worker's
//! metrics and health port and of the console.
//!
//! - A connection has [`Inbound::header_read_timeout`] (10 s) to send a
//!   request's headers; a kept-alive connection waits at most
//!   [`Inbound::idle_timeout`] (5 s) for its next request.
//! - At most [`Inbound::max_connections`] (64) are open at once. At the cap a
//!   new connection evicts the one that has waited longest without sending a
//!   complete request (idle, or its headers half-sent), so that a health probe
//!   or a scrape still gets in; while every connection has a request in
//!   flight, the new one waits for the first to finish.
//! - A request whose `Content-Length` is over [`Inbound::max_body`] (1 MiB)
//!   is answered 413 without calling the service (a server that reads bodies
//!   also limits what it reads: the console's extractors).
//! - A request's body must arrive within [`Inbound::body_read_timeout`]
//!   (10 s) of its headers: past it the body reads as an error and the
//!   connection is closed, so a body that stalls holds no connection.
//! - Each request carries its TCP peer's address as a [`Peer`] extension.
//! - A failed `accept` (out of file descriptors) is retried after a backoff,
//!   10 ms doubling to 1 s, instead of spinning.
//!
//! The file descriptors it may hold are [`Inbound::descriptors`]: the cap, the
//! connection accepted while an evicted one closes, and the listener.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::header::CONTENT_LENGTH;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

/// The limits of an inbound port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inbound {
    /// How long a new connection may take to send its first request's
    /// headers (default 10 s).
    pub header_read_timeout: Duration,
    /// How long a kept-alive connection may wait for its next request after
    /// an answer (default 5 s).
    pub idle_timeout: Duration,
    /// Connections open at once (default 64); at least 1.
    pub max_connections: usize,
    /// The largest request body, in bytes (default 1 MiB).
    pub max_body: u64,
    /// How long a request's body may take to arrive after its headers
    /// (default 10 s); past it the connection is closed.
    pub body_read_timeout: Duration,
}

impl Default for Inbound {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            max_connections: 64,
            max_body: 1 << 20,
            body_read_timeout: Duration::from_secs(10),
        }
    }
}

/// A limit that cannot be served: its field, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InboundError {
    /// The field, as [`Inbound`] names it.
    pub field: &'static str,
    /// What is wrong with it.
    pub message: String,
}

impl Inbound {
    /// Checks the fields; the error names the field.
    pub fn validate(&self) -> Result<(), InboundError> {
        let bad = |field, message: &str| {
            Err(InboundError {
                field,
                message: message.to_owned(),
            })
        };
        if self.max_connections == 0 {
            return bad("max_connections", "at least 1 connection");
        }
        if self.header_read_timeout.is_zero() {
            return bad("header_read_timeout", "must be above zero");
        }
        if self.idle_timeout.is_zero() {
            return bad("idle_timeout", "must be above zero");
        }
        if self.body_read_timeout.is_zero() {
            return bad("body_read_timeout", "must be above zero");
        }
        Ok(())
    }

    /// The file descriptors the port may hold: its connections, one accepted
    /// while the one it evicts closes, and the listener.
    pub fn descriptors(&self) -> usize {
        self.max_connections.saturating_add(2)
    }
}

/// One open connection, as the table sees it.
#[derive(Debug)]
struct Entry {
    /// Requests in flight (from the headers to the answer's last byte).
    busy: usize,
    /// Since when it waits for a request (accepted, or its last answer).
    waiting_since: Instant,
    /// Answered at least once: waiting means idle keep-alive.
    answered: bool,
    evict: CancellationToken,
    /// Wakes its task when `busy` changes.
    changed: Arc<Notify>,
}

/// The open connections.
#[derive(Debug)]
struct Table {
    limits: Inbound,
    conns: Mutex<(u64, HashMap<u64, Entry>)>,
    /// Wakes the accept loop when a connection ends or goes idle.
    freed: Notify,
}

/// Whether a new connection got a place.
#[derive(Debug, PartialEq, Eq)]
enum Admission {
    /// Under the cap, or in the place of an evicted connection.
    Admitted(u64),
    /// Every connection has a request in flight.
    Full,
}

impl Table {
    fn new(limits: Inbound) -> Self {
        Self {
            limits,
            conns: Mutex::new((0, HashMap::new())),
            freed: Notify::new(),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut (u64, HashMap<u64, Entry>)) -> R) -> R {
        let mut conns = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut conns)
    }

    /// A place for a new connection: evicts, at the cap, the connection
    /// waiting longest without a complete request.
    fn admit(&self, now: Instant) -> (Admission, CancellationToken, Arc<Notify>) {
        let evict = CancellationToken::new();
        let changed = Arc::new(Notify::new());
        let admission = self.with(|(next, conns)| {
            if conns.len() >= self.limits.max_connections.max(1) {
                let oldest = conns
                    .iter()
                    .filter(|(_, e)| e.busy == 0)
                    .min_by_key(|(id, e)| (e.waiting_since, **id))
                    .map(|(id, _)| *id);
                match oldest.and_then(|id| conns.remove(&id)) {
                    Some(evicted) => evicted.evict.cancel(),
                    None => return Admission::Full,
                }
            }
            *next += 1;
            conns.insert(
                *next,
                Entry {
                    busy: 0,
                    waiting_since: now,
                    answered: false,
                    evict: evict.clone(),
                    changed: Arc::clone(&changed),
                },
            );
            Admission::Admitted(*next)
        });
        (admission, evict, changed)
    }

    fn begin(&self, id: u64) {
        self.with(|(_, conns)| {
            if let Some(e) = conns.get_mut(&id) {
                e.busy += 1;
            }
        });
    }

    fn end(&self, id: u64, now: Instant) {
        let changed = self.with(|(_, conns)| {
            conns.get_mut(&id).map(|e| {
                e.busy = e.busy.saturating_sub(1);
                e.waiting_since = now;
                e.answered = true;
                Arc::clone(&e.changed)
            })
        });
        if let Some(changed) = changed {
            changed.notify_one();
            self.freed.notify_one();
        }
    }

    /// When the connection's idle keep-alive ends, if it is idle.
    fn idle_deadline(&self, id: u64) -> Option<Instant> {
        self.with(|(_, conns)| {
            conns
                .get(&id)
                .filter(|e| e.busy == 0 && e.answered)
                .map(|e| e.waiting_since + self.limits.idle_timeout)
        })
    }

    fn remove(&self, id: u64) {
        if self.with(|(_, conns)| conns.remove(&id)).is_some() {
            self.freed.notify_one();
        }
    }

    #[cfg(test)]
    fn open(&self) -> usize {
        self.with(|(_, conns)| conns.len())
    }
}

/// Marks a request done (its answer sent or dropped).
struct Busy {
    table: Arc<Table>,
    id: u64,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.table.end(self.id, Instant::now());
    }
}

/// An answer's body that keeps its connection busy until it is sent;
/// `None` is an empty body.
struct Tracked<B> {
    body: Option<B>,
    _busy: Busy,
}

impl<B> Body for Tracked<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match &mut self.get_mut().body {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

/// The TCP peer of a request (a request extension): the client, or the
/// proxy in front of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer(pub SocketAddr);

/// A request's body did not arrive within [`Inbound::body_read_timeout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimeout(pub Duration);

/// A request's body, read under [`Inbound::body_read_timeout`]: past it, it
/// yields [`BodyTimeout`] and its connection is closed.
pub struct RequestBody {
    body: Incoming,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
    /// Closes the connection when the body stalls.
    close: CancellationToken,
    ended: bool,
}

impl RequestBody {
    fn new(body: Incoming, timeout: Duration, close: CancellationToken) -> Self {
        Self {
            body,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timeout,
            close,
            ended: false,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(None) => {
                this.ended = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(frame)) => Poll::Ready(Some(frame.map_err(Into::into))),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.ended = true;
                    this.close.cancel();
                    tracing::debug!("inbound: a request body stalled; closing its connection");
                    Poll::Ready(Some(Err(BodyTimeout(this.timeout).into())))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The body a request declares, over `max`.
fn too_large<T>(req: &Request<T>, max: u64) -> bool {
    req.headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|len| len > max)
}

/// Serves HTTP/1 on `listener` under `limits` until `shutdown`, answering
/// each request with `respond`. On `shutdown` it stops accepting, and open
/// connections finish the request they are serving, for at most
/// `limits.header_read_timeout`.
pub async fn serve<F, Fut, B>(
    listener: TcpListener,
    limits: Inbound,
    shutdown: CancellationToken,
    respond: F,
) where
    F: Fn(Request<RequestBody>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let table = Arc::new(Table::new(limits));
    let mut connections = tokio::task::JoinSet::new();
    let mut backoff = Duration::ZERO;
    loop {
        let (stream, peer) = tokio::select! {
            accepted = accept(&listener, &mut backoff) => accepted,
            () = shutdown.cancelled() => break,
        };
        let Some((id, evict, changed)) = place(&table, &shutdown).await else {
            break;
        };
        while connections.try_join_next().is_some() {}
        let conn = Conn {
            table: Arc::clone(&table),
            id,
            evict,
            changed,
            shutdown: shutdown.clone(),
            peer,
        };
        connections.spawn(conn.run(stream, respond.clone()));
    }
    // Open connections finish their request; past the bound they are dropped.
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(limits.header_read_timeout, drained)
        .await
        .is_err()
    {
        tracing::debug!("inbound: connections still open at shutdown are closed");
    }
}

/// A place for the connection just accepted, waiting while every open one
/// has a request in flight; `None` on `shutdown`.
async fn place(
    table: &Table,
    shutdown: &CancellationToken,
) -> Option<(u64, CancellationToken, Arc<Notify>)> {
    loop {
        let freed = table.freed.notified();
        let (admission, evict, changed) = table.admit(Instant::now());
        if let Admission::Admitted(id) = admission {
            return Some((id, evict, changed));
        }
        tokio::select! {
            () = freed => {}
            () = shutdown.cancelled() => return None,
        }
    }
}

/// The next connection; a failed accept (out of file descriptors, most
/// often) is retried after `backoff`, which doubles from 10 ms to 1 s.
async fn accept(listener: &TcpListener, backoff: &mut Duration) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => {
                *backoff = Duration::ZERO;
                return accepted;
            }
            // The peer gave up before it was accepted: nothing to wait for.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {}
            Err(e) => {
                if backoff.is_zero() {
                    tracing::warn!(error = %e, "inbound: accept failed; retrying with backoff");
                }
                *backoff = (*backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                tokio::time::sleep(*backoff).await;
            }
        }
    }
}

/// One connection's task.
struct Conn {
    table: Arc<Table>,
    id: u64,
    evict: CancellationToken,
    changed: Arc<Notify>,
    shutdown: CancellationToken,
    peer: SocketAddr,
}

impl Conn {
    async fn run<F, Fut, B>(self, stream: TcpStream, respond: F)
    where
        F: Fn(Request<RequestBody>) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
        B: Body<Data = Bytes> + Unpin + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let limits = self.table.limits;
        let (table, id, peer) = (Arc::clone(&self.table), self.id, self.peer);
        let close = self.evict.clone();
        let service = service_fn(move |req: Request<Incoming>| {
            table.begin(id);
            let busy = Busy {
                table: Arc::clone(&table),
                id,
            };
            let refused = too_large(&req, limits.max_body);
            let respond = respond.clone();
            let close = close.clone();
            async move {
                if refused {
                    let mut response = Response::new(Tracked {
                        body: None,
                        _busy: busy,
                    });
                    *response.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
                    return Ok::<_, Infallible>(response);
                }
                let (mut parts, body) = req.into_parts();
                parts.extensions.insert(Peer(peer));
                let body = RequestBody::new(body, limits.body_read_timeout, close);
                let response = respond(Request::from_parts(parts, body)).await?;
                Ok(response.map(|body| Tracked {
                    body: Some(body),
                    _busy: busy,
                }))
            }
        });
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .serve_connection(TokioIo::new(stream), service);
        let mut conn = std::pin::pin!(conn);
        let mut stopping = false;
        loop {
            let deadline = self.table.idle_deadline(self.id);
            let idle_over = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                served = conn.as_mut() => {
                    if let Err(e) = served {
                        tracing::debug!(error = %e, "inbound: connection ended");
                    }
                    break;
                }
                () = self.evict.cancelled() => {
                    tracing::debug!("inbound: connection evicted at the cap, or its request body stalled");
                    break;
                }
                () = self.changed.notified() => {}
                () = idle_over => {
                    if self.table.idle_deadline(self.id).is_some_and(|at| at <= Instant::now()) {
                        break;
                    }
                }
                () = self.shutdown.cancelled(), if !stopping => {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
        self.table.remove(self.id);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use http_body_util::Full;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn the_production_limits() {
        let limits = Inbound::default();
        assert_eq!(limits.header_read_timeout, Duration::from_secs(10));
        assert_eq!(limits.idle_timeout, Duration::from_secs(5));
        assert_eq!(limits.max_connections, 64);
        assert_eq!(limits.max_body, 1 << 20);
        assert_eq!(limits.body_read_timeout, Duration::from_secs(10));
        assert_eq!(limits.descriptors(), 66);
        assert_eq!(limits.validate(), Ok(()));
        let none = Inbound {
            max_connections: 0,
            ..limits
        };
        assert_eq!(none.validate().unwrap_err().field, "max_connections");
    }

    #[test]
    fn at_the_cap_the_oldest_waiting_connection_is_evicted() {
        let table = Table::new(Inbound {
            max_connections: 3,
            ..Inbound::default()
        });
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let admit = |s| match table.admit(at(s)) {
            (Admission::Admitted(id), evict, _) => (id, evict),
            (Admission::Full, ..) => panic!("full"),
        };
        let (a, a_evict) = admit(0);
        let (b, b_evict) = admit(1);
        let (c, c_evict) = admit(2);
        // `a` is serving a request; `c` answered one and waits since 3 s.
        table.begin(a);
        table.begin(c);
        table.end(c, at(3));
        let (_, d_evict) = admit(4);
        assert!(b_evict.is_cancelled(), "b waited longest without a request");
        assert!(!a_evict.is_cancelled() && !c_evict.is_cancelled());
        assert_eq!(table.open(), 3);
        // Then c, the only one waiting; then d.
        admit(5);
        assert!(c_evict.is_cancelled());
        admit(6);
        assert!(d_evict.is_cancelled());
        // With every connection busy, a new one waits.
        table.with(|(_, conns)| conns.values_mut().for_each(|e| e.busy = 1));
        assert_eq!(table.admit(at(7)).0, Admission::Full);
        table.remove(b);
        table.remove(a);
        assert!(matches!(table.admit(at(8)).0, Admission::Admitted(_)));
    }

    /// A port answering `ok` under `limits`, and its address.
    async fn port(limits: Inbound, shutdown: &CancellationToken) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, limits, shutdown.clone(), |_req| async {
            Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }));
        addr
    }

    async fn ask(stream: &mut TcpStream, request: &[u8]) -> String {
        stream.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 512];
        let done = |a: &[u8]| {
            a.ends_with(b"\r\n\r\nok")
                || (a.starts_with(b"HTTP/1.1 413") && a.ends_with(b"\r\n\r\n"))
        };
        while !done(&answer) {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the answer: {answer:?}");
            answer.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(answer).unwrap()
    }

    const GET: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";

    /// Reads until the server closes the connection.
    async fn closed(stream: &mut TcpStream) {
        let mut buf = [0u8; 64];
        while stream.read(&mut buf).await.unwrap_or(0) > 0 {}
    }

    #[tokio::test]
    async fn a_request_gets_in_past_silent_connections_at_the_cap() {
        let shutdown = CancellationToken::new();
        let limits = Inbound {
            max_connections: 4,
            ..Inbound::default()
        };
        let addr = port(limits, &shutdown).await;
        // Answered once each, so each is known to the server, oldest first.
        let mut held = Vec::new();
        for _ in 0..4 {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            assert!(ask(&mut stream, GET).await.starts_with("HTTP/1.1 200"));
            held.push(stream);
        }
        let mut probe = TcpStream::connect(addr).await.unwrap();
        assert!(ask(&mut probe, GET).await.starts_with("HTTP/1.1 200"));
        closed(&mut held[0]).await;
        shutdown.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn silent_and_idle_connections_are_closed() {
        let shutdown = CancellationToken::new();
        let limits = Inbound::default();
        let addr = port(limits, &shutdown).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let started = Instant::now();
        closed(&mut silent).await;
        assert!(started.elapsed() >= limits.header_read_timeout);

        let mut kept = TcpStream::connect(addr).await.unwrap();
        assert!(ask(&mut kept, GET).await.starts_with("HTTP/1.1 200"));
        let answered = Instant::now();
        closed(&mut kept).await;
        assert!(answered.elapsed() >= limits.idle_timeout);
        assert!(answered.elapsed() < limits.header_read_timeout);
        shutdown.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_closes_its_connection_after_the_timeout() {
        use http_body_util::BodyExt as _;
        let shutdown = CancellationToken::new();
        let limits = Inbound::default();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (peers, mut peer_seen) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(serve(listener, limits, shutdown.clone(), move |req| {
            let peers = peers.clone();
            async move {
                let _ = peers.send(req.extensions().get::<Peer>().copied());
                let body = match req.into_body().collect().await {
                    Ok(body) => body.to_bytes(),
                    Err(e) => Bytes::from(e.to_string()),
                };
                Ok(Response::new(Full::new(body)))
            }
        }));
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let local = stream.local_addr().unwrap();
        stream
            .write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly ten b")
            .await
            .unwrap();
        let sent = Instant::now();
        assert_eq!(peer_seen.recv().await.unwrap(), Some(Peer(local)));
        closed(&mut stream).await;
        assert!(sent.elapsed() >= limits.body_read_timeout);
        assert!(sent.elapsed() < limits.body_read_timeout + Duration::from_secs(1));
        // A body that arrives is read whole.
        let mut whole = TcpStream::connect(addr).await.unwrap();
        let answer = ask(
            &mut whole,
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        shutdown.cancel();
    }

    #[tokio::test]
    async fn a_declared_body_over_the_limit_is_refused() {
        let shutdown = CancellationToken::new();
        let addr = port(
            Inbound {
                max_body: 10,
                ..Inbound::default()
            },
            &shutdown,
        )
        .await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let answer = ask(
            &mut stream,
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        shutdown.cancel();
    }
}
