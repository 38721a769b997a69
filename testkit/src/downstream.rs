//! The downstream service the worker's HTTP handler calls: records every request
//! and answers as the test scripts it.

use std::collections::{BTreeMap, HashSet};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// One request the downstream received.
#[derive(Debug, Clone)]
pub struct Call {
    /// Position in arrival order.
    pub index: usize,
    pub method: String,
    pub path: String,
    /// Header names lowercased.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
    /// From the JSON body, when it is an envelope.
    pub order_id: Option<String>,
    pub event: Option<String>,
    pub seq: Option<u64>,
    /// The status the script chose.
    pub status: u16,
    /// Whether the answer was handed back (after the scripted delay).
    pub completed: bool,
    /// When the request arrived (its body read).
    pub started: Instant,
    /// When the answer was handed back.
    pub ended: Option<Instant>,
}

impl Call {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    /// The `Idempotency-Key` header.
    pub fn key(&self) -> &str {
        self.header("idempotency-key").unwrap_or("")
    }

    pub fn attempt(&self) -> Option<u32> {
        self.header("x-attempt")?.parse().ok()
    }

    pub fn shard(&self) -> Option<u16> {
        self.header("x-shard")?.parse().ok()
    }

    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }

    fn summary(&self) -> String {
        format!(
            "#{} key={} attempt={} shard={} status={}{}",
            self.index,
            self.key(),
            self.header("x-attempt").unwrap_or("-"),
            self.header("x-shard").unwrap_or("-"),
            self.status,
            if self.completed { "" } else { " (pending)" }
        )
    }
}

/// What the downstream answers to one request.
#[derive(Debug, Clone, Copy)]
pub struct Reply {
    pub status: u16,
    pub delay: Duration,
    /// A `Retry-After` header, in seconds.
    pub retry_after: Option<u64>,
    /// A `Location` header (for redirects).
    pub location: Option<&'static str>,
}

impl Reply {
    pub fn ok() -> Self {
        Self::status(200)
    }

    pub fn status(status: u16) -> Self {
        Self {
            status,
            delay: Duration::ZERO,
            retry_after: None,
            location: None,
        }
    }

    /// With a `Location: {to}` header.
    pub fn location(mut self, to: &'static str) -> Self {
        self.location = Some(to);
        self
    }

    /// With a `Retry-After: {seconds}` header.
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// Chooses the reply to a request, given the requests before it.
pub type Script = dyn Fn(&Call, &[Call]) -> Reply + Send + Sync;

struct State {
    calls: Mutex<Vec<Call>>,
    script: Box<Script>,
    changed: watch::Sender<u64>,
}

pub struct Downstream {
    pub addr: SocketAddr,
    state: Arc<State>,
    /// The accept loop; none while connections are refused.
    server: Mutex<Option<JoinHandle<()>>>,
}

impl Downstream {
    /// Answers 200 at once to everything.
    pub async fn start() -> Self {
        Self::scripted(|_, _| Reply::ok()).await
    }

    pub async fn scripted(
        script: impl Fn(&Call, &[Call]) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            calls: Mutex::new(Vec::new()),
            script: Box::new(script),
            changed: watch::channel(0).0,
        });
        let server = serve(listener, Arc::clone(&state));
        Self {
            addr,
            state,
            server: Mutex::new(Some(server)),
        }
    }

    /// Goes away: the listener closes (new connections are refused) and every
    /// open connection is dropped, as when the service is down.
    pub fn refuse_connections(&self) {
        if let Some(server) = self.server.lock().unwrap().take() {
            server.abort();
        }
    }

    /// Comes back on the same address after [`Downstream::refuse_connections`].
    pub async fn accept_connections(&self) {
        let listener = TcpListener::bind(self.addr).await.unwrap();
        let server = serve(listener, Arc::clone(&self.state));
        if let Some(old) = self.server.lock().unwrap().replace(server) {
            old.abort();
        }
    }

    /// Answers 422 (a permanent failure) to the calls for dedup key `key`
    /// until `fixed` is set, 200 to everything else.
    pub async fn failing_until_fixed(key: String, fixed: Arc<AtomicBool>) -> Self {
        Self::scripted(move |call, _| {
            if call.key() == key && !fixed.load(Ordering::SeqCst) {
                Reply::status(422)
            } else {
                Reply::ok()
            }
        })
        .await
    }

    /// Answers 200 to everything after `latency`.
    pub async fn with_latency(latency: Duration) -> Self {
        Self::scripted(move |_, _| Reply::ok().after(latency)).await
    }

    /// The `--handler` URL of a worker calling this downstream.
    pub fn url(&self) -> String {
        format!("http://{}/events", self.addr)
    }

    /// The worker's built-in HTTP handler calling this downstream (what
    /// `--handler URL` makes), for an in-process worker.
    pub fn handler(&self) -> Arc<dyn shardline_worker::Handler> {
        handler_at(&self.url())
    }

    /// [`Self::handler`] calling `/events/{name}`: the calls of the worker
    /// it is given carry that path, so a test can tell whose a call was.
    pub fn handler_named(&self, name: &str) -> Arc<dyn shardline_worker::Handler> {
        handler_at(&format!("{}/{name}", self.url()))
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state.calls.lock().unwrap().clone()
    }

    /// The `index`-th call (arrival order), as it is now: a poller that saw
    /// it in flight reads it again for its answer.
    pub fn call(&self, index: usize) -> Option<Call> {
        self.state.calls.lock().unwrap().get(index).cloned()
    }

    /// The calls from the `from`-th on (arrival order): what a poller that
    /// saw `from` calls has not seen yet, without copying the rest.
    pub fn calls_since(&self, from: usize) -> Vec<Call> {
        let calls = self.state.calls.lock().unwrap();
        calls.get(from..).unwrap_or_default().to_vec()
    }

    /// Waits until `done(calls)` holds; fails the test with what was seen if it
    /// does not within `timeout`. Re-checked on every request and every answer.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[Call]) -> bool,
    ) -> Vec<Call> {
        let mut changes = self.state.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            changes.borrow_and_update();
            {
                let calls = self.state.calls.lock().unwrap();
                if done(&calls) {
                    return calls.clone();
                }
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                let calls = self.calls();
                panic!(
                    "downstream: timed out after {timeout:?} waiting for {what}\n{}",
                    describe(&calls)
                );
            }
        }
    }
}

impl Drop for Downstream {
    fn drop(&mut self) {
        self.refuse_connections();
    }
}

/// The accept loop; aborting it drops the listener and every connection.
fn serve(listener: TcpListener, state: Arc<State>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            while connections.try_join_next().is_some() {}
            let state = Arc::clone(&state);
            connections.spawn(async move {
                let service = service_fn(move |req| handle(Arc::clone(&state), req));
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}

/// A summary of `calls` for failure messages: counts and the last few calls.
pub fn describe(calls: &[Call]) -> String {
    let keys: HashSet<&str> = calls.iter().map(Call::key).collect();
    let ok: HashSet<&str> = calls.iter().filter(|c| c.ok()).map(Call::key).collect();
    let mut s = format!(
        "saw {} call(s), {} distinct key(s), {} key(s) answered 2xx; last calls:\n",
        calls.len(),
        keys.len(),
        ok.len()
    );
    for call in calls.iter().rev().take(15).rev() {
        let _ = writeln!(s, "  {}", call.summary());
    }
    s
}

async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes().to_vec(),
        Err(_) => Vec::new(),
    };
    let json: Option<serde_json::Value> = serde_json::from_slice(&body).ok();
    let field = |name: &str| {
        json.as_ref()
            .and_then(|j| j.get(name))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    let mut call = Call {
        index: 0,
        method: parts.method.to_string(),
        path: parts.uri.path().to_owned(),
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_ascii_lowercase(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        order_id: field("order_id"),
        event: field("event"),
        seq: json
            .as_ref()
            .and_then(|j| j.get("seq"))
            .and_then(serde_json::Value::as_u64),
        body,
        status: 0,
        completed: false,
        started: Instant::now(),
        ended: None,
    };
    let (index, reply) = {
        let mut calls = state.calls.lock().unwrap();
        call.index = calls.len();
        let reply = (state.script)(&call, &calls);
        call.status = reply.status;
        calls.push(call);
        (calls.len() - 1, reply)
    };
    state.changed.send_modify(|n| *n += 1);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    {
        let mut calls = state.calls.lock().unwrap();
        calls[index].completed = true;
        calls[index].ended = Some(Instant::now());
    }
    state.changed.send_modify(|n| *n += 1);
    let mut response = Response::builder().status(reply.status);
    if let Some(seconds) = reply.retry_after {
        response = response.header("retry-after", seconds.to_string());
    }
    if let Some(to) = reply.location {
        response = response.header("location", to);
    }
    let response = response.body(Full::new(Bytes::from_static(b"{}"))).unwrap();
    Ok(response)
}

/// The worker's built-in HTTP handler calling `url`.
fn handler_at(url: &str) -> Arc<dyn shardline_worker::Handler> {
    Arc::new(shardline_worker::handler::Http::new(url).unwrap())
}
