//! What the outage tests add to the fleet harness: finding a client's broker
//! connection, stopping the broker under a guard that always restarts it, a
//! private Redis server, and a worker pointed at it.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::env::rabbitmqctl;
use crate::harness::{STARTUP, TestEnv};

/// How long the broker may take to come back after `start_app`.
pub const BROKER_RESTART: Duration = Duration::from_secs(90);

/// Polls `done` every 50 ms until it holds; fails the test with `what` and
/// `context()` if it does not within `timeout`.
pub async fn wait_until(
    what: &str,
    timeout: Duration,
    mut done: impl FnMut() -> bool,
    context: impl Fn() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}\n{}",
            context()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Erlang pids of the connections in `vhost` whose client-given
/// `connection_name` starts with `name_prefix`.
pub async fn connection_pids(vhost: &str, name_prefix: &str) -> Vec<String> {
    let text = rabbitmqctl(&[
        "-q",
        "list_connections",
        "--no-table-headers",
        "pid",
        "vhost",
        "client_properties",
    ])
    .await;
    // Client properties print as Erlang-ish terms: {"connection_name","…"}.
    let needle = format!("{{\"connection_name\",\"{name_prefix}");
    text.lines()
        .filter_map(|line| {
            let mut cols = line.splitn(3, '\t');
            let (pid, host, props) = (cols.next()?, cols.next()?, cols.next()?);
            (host == vhost && props.contains(&needle)).then(|| pid.to_owned())
        })
        .collect()
}

/// Waits until exactly one connection of `vhost` is named `name_prefix…`, and
/// returns its pid.
pub async fn one_connection(vhost: &str, name_prefix: &str) -> String {
    let deadline = Instant::now() + STARTUP;
    loop {
        let pids = connection_pids(vhost, name_prefix).await;
        if let [pid] = pids.as_slice() {
            return pid.clone();
        }
        assert!(
            Instant::now() < deadline,
            "expected one connection named `{name_prefix}…` in vhost {vhost} after {STARTUP:?}, found {pids:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `rabbitmqctl close_connection <pid> test`: the broker closes the connection
/// with 320 CONNECTION_FORCED, as on an operator's "force close".
pub async fn close_connection(pid: &str) {
    rabbitmqctl(&["close_connection", pid, "test"]).await;
}

/// A stopped broker (`rabbitmqctl stop_app`), started again by [`Self::start`]
/// or, if the test fails first, on drop: the broker is never left stopped.
pub struct StoppedBroker {
    stopped: bool,
}

impl StoppedBroker {
    /// Stops the broker application (the Erlang node stays up; durable queues and
    /// persistent messages survive). The guard is armed before the command runs,
    /// so a failing `stop_app` still ends in a `start_app`.
    pub async fn stop() -> Self {
        let guard = Self { stopped: true };
        rabbitmqctl(&["stop_app"]).await;
        guard
    }

    /// `start_app`, then `await_startup`: the broker accepts connections again.
    pub async fn start(mut self) {
        rabbitmqctl(&["start_app"]).await;
        rabbitmqctl(&[
            "await_startup",
            "--timeout",
            &BROKER_RESTART.as_secs().to_string(),
        ])
        .await;
        self.stopped = false;
    }
}

impl Drop for StoppedBroker {
    fn drop(&mut self) {
        if !self.stopped {
            return;
        }
        eprintln!("restarting the broker after a failed test");
        for args in [
            vec!["start_app".to_owned()],
            vec![
                "await_startup".to_owned(),
                "--timeout".to_owned(),
                BROKER_RESTART.as_secs().to_string(),
            ],
        ] {
            match Command::new("rabbitmqctl").args(&args).output() {
                Ok(out) if out.status.success() => {}
                Ok(out) => eprintln!(
                    "rabbitmqctl {args:?} failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
                Err(e) => eprintln!("cannot run rabbitmqctl {args:?}: {e}"),
            }
        }
    }
}

/// A free TCP port on 127.0.0.1 (free when asked; nothing holds it afterwards).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A throwaway `redis-server` on its own port, without persistence: killing it
/// loses every key, like a cache node being replaced. Killed on drop.
pub struct PrivateRedis {
    pub port: u16,
    log: PathBuf,
    child: Option<Child>,
}

impl PrivateRedis {
    pub fn start(env: &TestEnv) -> Self {
        let mut redis = Self {
            port: free_port(),
            log: log_dir().join(format!("{}-redis-server.log", env.id)),
            child: None,
        };
        redis.restart();
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// Starts the server (again) on the same port, empty, and waits until it
    /// answers PING.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "redis-server is already running");
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("cannot run redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + STARTUP;
        loop {
            let pong = redis::Client::open(self.url())
                .and_then(|c| c.get_connection())
                .and_then(|mut con| redis::cmd("PING").query::<String>(&mut con));
            match pong {
                Ok(_) => return,
                Err(e) => {
                    if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                        panic!(
                            "redis-server on port {} exited ({status}); log:\n{}",
                            self.port,
                            std::fs::read_to_string(&self.log).unwrap_or_default()
                        );
                    }
                    assert!(
                        Instant::now() < deadline,
                        "redis-server on port {} not answering after {STARTUP:?}: {e}",
                        self.port
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn log_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("outages");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Fails the test if the dead-letter queue holds anything: an outage is no
/// reason to give up on an event.
pub async fn assert_nothing_dead_lettered(env: &TestEnv) {
    let depths = env.queue_depths().await;
    let dlq = depths.get(&env.names.dead_letter_queue).map_or(0, |d| d.0);
    assert_eq!(dlq, 0, "events dead-lettered during the outage: {depths:?}");
}
