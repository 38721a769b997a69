//! The ports shardline serves (`shardline_connect::inbound`): hundreds of idle
//! and half-sent connections to the worker's metrics port and to the console
//! neither keep a probe out nor slow the events, and the server closes them;
//! under a file limit of 64 the worker refuses at start, naming the limit,
//! rather than let its port starve the broker and Redis connections.

use std::net::SocketAddr;
use std::time::Duration;

use shardline_connect::inbound::Inbound;
use shardline_testkit::console::ServedConsole;
use shardline_testkit::metrics::{free_addr, get, wait_ok};
use shardline_testkit::{ChildWorker, Downstream, Event, Publisher, STARTUP, TestEnv};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Connections opened to each port.
const HOSTILE: usize = 300;
/// How long the server has to close them.
const CLOSED_WITHIN: Duration = Duration::from_secs(30);

/// `n` connections to `addr`, every other one idle (connected, nothing sent)
/// or half-sent (a request line and a header, never the blank line); each
/// task ends when the server closes its connection, giving the time it took,
/// or after [`CLOSED_WITHIN`] with `None`.
async fn hostile(addr: SocketAddr, n: usize, closed: &mut JoinSet<Option<Duration>>) {
    for i in 0..n {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        if i % 2 == 1 {
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                .await
                .unwrap();
        }
        let opened = Instant::now();
        closed.spawn(async move {
            let mut buf = [0u8; 256];
            let read = async {
                // A reset counts as closed too.
                while stream.read(&mut buf).await.unwrap_or(0) > 0 {}
            };
            tokio::time::timeout(CLOSED_WITHIN, read)
                .await
                .ok()
                .map(|()| opened.elapsed())
        });
    }
}

/// How many of `closed` the server closed in time, and the latest of those.
async fn tally(mut closed: JoinSet<Option<Duration>>) -> (usize, usize, Duration) {
    let (mut total, mut done, mut latest) = (0, 0, Duration::ZERO);
    while let Some(result) = closed.join_next().await {
        total += 1;
        if let Some(took) = result.unwrap() {
            done += 1;
            latest = latest.max(took);
        }
    }
    (done, total, latest)
}

/// A GET that must answer within 2 s: its status and how long it took.
async fn probe(addr: SocketAddr, path: &str) -> (u16, Duration) {
    let asked = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(2), get(addr, path))
        .await
        .unwrap_or_else(|_| panic!("{path} on {addr} did not answer within 2 s"))
        .unwrap_or_else(|| panic!("{path} on {addr}: no answer"));
    (answer.0, asked.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_sent_connections_keep_no_probe_out_and_are_closed() {
    let env = TestEnv::new("ports-idle").await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    // Short timeouts so that the test is quick; the default cap (64).
    let limits = Inbound {
        header_read_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(1),
        ..Inbound::default()
    };
    let addr = free_addr();
    let worker = env
        .start_worker("ports-idle", &downstream, |c| {
            c.metrics_addr = Some(addr);
            c.metrics_limits = limits;
        })
        .await;
    wait_ok(addr, "/readyz", STARTUP).await;
    let console = ServedConsole::start_with(&env, None, limits).await;

    let mut closed = JoinSet::new();
    hostile(addr, HOSTILE, &mut closed).await;
    let mut console_closed = JoinSet::new();
    hostile(console.addr, HOSTILE, &mut console_closed).await;

    let (status, health) = probe(addr, "/healthz").await;
    assert_eq!(status, 200);
    let (status, login) = probe(console.addr, "/login").await;
    assert_eq!(status, 200);
    eprintln!(
        "with {HOSTILE} hostile connections on each port: /healthz in {health:?}, the console's /login in {login:?}"
    );

    let events: Vec<Event> = (0..20)
        .flat_map(|order| {
            (1..=10).map(move |seq| Event::new(&format!("PORTS-{order}"), seq, env.shards))
        })
        .collect();
    assert_eq!(events.len(), 200);
    Publisher::connect(&env).await.publish(&events).await;
    worker.assert_all_processed(200).await;

    for (port, closed) in [("metrics", closed), ("console", console_closed)] {
        let (done, total, latest) = tally(closed).await;
        eprintln!(
            "{port}: {done} of {total} connections closed by the server, the last after {latest:?}"
        );
        assert!(
            done * 10 >= total * 9,
            "{port}: only {done} of {total} closed within {CLOSED_WITHIN:?}"
        );
    }
    // Still serving.
    assert_eq!(probe(addr, "/healthz").await.0, 200);
    console.stop().await;
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_file_limit_of_64_the_worker_refuses_naming_it() {
    let env = TestEnv::new("ports-nofile").await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let addr = free_addr().to_string();
    let mut cmd = tokio::process::Command::new("prlimit");
    cmd.arg("--nofile=64:64")
        .arg("--")
        .arg(shardline_testkit::paths::shardline())
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "info")
        .env(env.queue_type_env().0, env.queue_type_env().1)
        .arg("worker")
        .args(env.global_args())
        .args([
            "--handler",
            &downstream.url(),
            "--worker-name",
            "ports-nofile",
        ])
        .args(["--metrics-addr", &addr]);
    let mut worker = ChildWorker::spawn(&env, "ports-nofile", cmd);
    let exit = worker.wait_exit(STARTUP).await;
    let log = worker.log_text();
    assert_eq!(exit.code(), Some(1), "{log}");
    assert!(
        log.contains("RLIMIT_NOFILE: the hard limit 64 is below"),
        "the refusal names the limit:\n{log}"
    );
    assert!(log.contains("66 metrics"), "and the port's share:\n{log}");
}
