//! A worker's HTTP endpoints (`--metrics-addr`): `GET` and the samples of a
//! `/metrics` scrape.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::wait::wait_until;

/// A local address nothing listens on now (for `metrics_addr`).
pub fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// `GET path` on `addr`: status code and body; `None` while nothing answers.
pub async fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut response))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Samples of a scrape: `name{labels}` → value.
pub type Samples = BTreeMap<String, f64>;

pub fn samples(text: &str) -> Samples {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// The value of `name{labels}`, NaN when absent.
pub fn sample(m: &Samples, name: &str, labels: &str) -> f64 {
    m.get(&format!("{name}{{{labels}}}"))
        .copied()
        .unwrap_or(f64::NAN)
}

/// Scrapes `/metrics` on `addr` until `done` holds, and returns that scrape.
/// `alive` is checked on every round (e.g. that the worker still runs).
pub async fn wait_metrics(
    addr: SocketAddr,
    what: &str,
    timeout: Duration,
    mut alive: impl FnMut(),
    done: impl Fn(&Samples) -> bool,
) -> Samples {
    wait_until(&format!("{what} on /metrics at {addr}"), timeout, || {
        alive();
        let done = &done;
        async move {
            match get(addr, "/metrics").await {
                Some((200, body)) => {
                    let m = samples(&body);
                    if done(&m) {
                        Ok(m)
                    } else {
                        Err(format!("last scrape:\n{body}"))
                    }
                }
                other => Err(format!("no scrape: {other:?}")),
            }
        }
    })
    .await
}

/// Waits until `path` answers 200 and returns the body.
pub async fn wait_ok(addr: SocketAddr, path: &str, timeout: Duration) -> String {
    wait_until(
        &format!("{path} on {addr} to answer 200"),
        timeout,
        || async {
            match get(addr, path).await {
                Some((200, body)) => Ok(body),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
}
