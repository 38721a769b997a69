//! The brokers a test talks to: the machine's RabbitMQ node (shared by every
//! test, never stopped), or a private [`BrokerNode`] that the test starts,
//! may stop and start, and that is removed on drop.
//!
//! A private node is started by `scripts/rabbitmq-node`: its own node name
//! (`shardline-test-<pid>-<n>@localhost`), AMQP and distribution ports (free
//! ones), data, log, config and enabled-plugins files in a directory of its
//! own, and a random Erlang cookie in that directory (`HOME` points there for
//! the server and for `rabbitmqctl`), so neither it nor its `rabbitmqctl` can
//! reach the machine's default node. It registers with the machine's epmd,
//! which nothing here stops. A start takes about 4 s on an idle machine.
//! Three such nodes, joined, are a [`Cluster`](crate::Cluster).

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::process::assert_exited_ok;
use crate::wait::wait_until;

/// How long a private node may take to start, or to come back after `start_app`.
pub const NODE_START: Duration = Duration::from_secs(120);

/// Where `rabbitmqctl` goes.
#[derive(Debug, Clone)]
pub enum Ctl {
    /// The machine's default node, through the packaged `rabbitmqctl`.
    Default,
    /// A private node, through `scripts/rabbitmq-node ctl DIR`.
    Private { script: PathBuf, dir: PathBuf },
}

impl Ctl {
    fn command(&self) -> std::process::Command {
        match self {
            Self::Default => std::process::Command::new("rabbitmqctl"),
            Self::Private { script, dir } => {
                let mut cmd = std::process::Command::new(script);
                cmd.arg("ctl").arg(dir);
                cmd
            }
        }
    }

    /// Runs `rabbitmqctl args`; fails the test with its output unless it succeeds.
    pub async fn run(&self, args: &[&str]) -> String {
        self.try_run(args).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `rabbitmqctl args`; its output, or why it failed (for a probe
    /// that tries again: a cluster node may be restarting its app).
    pub async fn try_run(&self, args: &[&str]) -> Result<String, String> {
        let out = tokio::process::Command::from(self.command())
            .args(args)
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| format!("cannot run rabbitmqctl: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "rabbitmqctl {args:?} ({self:?}): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// Runs `rabbitmqctl args` outside async code (for `Drop`), without failing.
    pub fn run_blocking(&self, args: &[&str]) -> std::io::Result<Output> {
        self.command().args(args).output()
    }

    /// The client connections of `vhost`: each one's Erlang pid
    /// (`<node.x.y.z>`) and client-given `connection_name`.
    pub async fn connections(&self, vhost: &str) -> Vec<(String, String)> {
        let text = self
            .run(&[
                "-q",
                "list_connections",
                "--no-table-headers",
                "pid",
                "vhost",
                "client_properties",
            ])
            .await;
        // Client properties print as Erlang-ish terms: {"connection_name","…"}.
        let needle = "{\"connection_name\",\"";
        text.lines()
            .filter_map(|line| {
                let mut cols = line.splitn(3, '\t');
                let (pid, host, props) = (cols.next()?, cols.next()?, cols.next()?);
                let name = props.split_once(needle)?.1.split('"').next()?;
                (host == vhost).then(|| (pid.to_owned(), name.to_owned()))
            })
            .collect()
    }

    /// Erlang pids of the connections in `vhost` whose client-given
    /// `connection_name` starts with `name_prefix`.
    pub async fn connection_pids(&self, vhost: &str, name_prefix: &str) -> Vec<String> {
        self.connections(vhost)
            .await
            .into_iter()
            .filter(|(_, name)| name.starts_with(name_prefix))
            .map(|(pid, _)| pid)
            .collect()
    }

    /// Waits until exactly one connection of `vhost` is named `name_prefix…`,
    /// and returns its pid.
    pub async fn one_connection(&self, vhost: &str, name_prefix: &str) -> String {
        wait_until(
            &format!("one connection named `{name_prefix}…` in vhost {vhost}"),
            crate::STARTUP,
            || async {
                match self.connection_pids(vhost, name_prefix).await.as_slice() {
                    [pid] => Ok(pid.clone()),
                    pids => Err(format!("connections {pids:?}")),
                }
            },
        )
        .await
    }

    /// `rabbitmqctl close_connection <pid> test`: the broker closes the
    /// connection with 320 CONNECTION_FORCED, as on an operator's "force close".
    pub async fn close_connection(&self, pid: &str) {
        self.run(&["close_connection", pid, "test"]).await;
    }
}

/// A private RabbitMQ node; stopped and its files removed on drop, also when
/// the test fails.
pub struct BrokerNode {
    /// `shardline-test-<pid>-<n>@localhost`.
    pub name: String,
    pub amqp_port: u16,
    pub dist_port: u16,
    /// The management API's port, when the node has the plugin.
    pub management_port: Option<u16>,
    dir: PathBuf,
    ctl: Ctl,
}

impl BrokerNode {
    /// Starts a node and waits until it serves AMQP (guest/guest from loopback).
    pub async fn start() -> Self {
        Self::start_with(None, &[]).await
    }

    /// [`Self::start`] with the management plugin, and waits until its HTTP
    /// API listens too (the plugin costs the start a few seconds).
    pub async fn start_with_management() -> Self {
        let node = Self::start_with(Some(free_port()), &[]).await;
        let port = node.management_port.unwrap_or_default();
        crate::wait::wait_until("the management API listens", NODE_START, || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .map_err(|e| e.to_string())
        })
        .await;
        node
    }

    /// [`Self::start`] with `lines` appended to the node's `rabbitmq.conf`.
    pub async fn start_configured(lines: &[&str]) -> Self {
        Self::start_with(None, lines).await
    }

    /// `http://guest:guest@127.0.0.1:<port>`: the management API (a node
    /// started with [`Self::start_with_management`]).
    pub fn management_url(&self) -> String {
        format!(
            "http://guest:guest@127.0.0.1:{}",
            self.management_port
                .expect("the node was started without the management plugin")
        )
    }

    async fn start_with(management_port: Option<u16>, conf: &[&str]) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let script = crate::paths::scripts().join("rabbitmq-node");
        // A node left behind by a test process that was killed goes first.
        let _ = tokio::process::Command::new(&script)
            .arg("sweep")
            .status()
            .await;
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("shardline-test-{}-{n}@localhost", std::process::id());
        let (amqp_port, dist_port) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!(
            "shardline-rabbitmq-{}-{n}-{amqp_port}",
            std::process::id()
        ));
        let node = Self {
            ctl: Ctl::Private {
                script: script.clone(),
                dir: dir.clone(),
            },
            name,
            amqp_port,
            dist_port,
            management_port,
            dir,
        };
        let started = std::time::Instant::now();
        let mut start = tokio::process::Command::new(&script);
        if let Some(port) = management_port {
            start.env("RABBITMQ_NODE_MANAGEMENT_PORT", port.to_string());
        }
        if !conf.is_empty() {
            let extra = std::env::temp_dir().join(format!(
                "shardline-rabbitmq-{}-{n}-{amqp_port}.conf",
                std::process::id()
            ));
            std::fs::write(&extra, conf.join("\n") + "\n").unwrap();
            start.env("RABBITMQ_NODE_EXTRA_CONF", extra);
        }
        let out = start
            .arg("start")
            .arg(&node.dir)
            .args([
                node.name.as_str(),
                &amqp_port.to_string(),
                &dist_port.to_string(),
            ])
            .env("RABBITMQ_NODE_OWNER", std::process::id().to_string())
            .env("START_TIMEOUT", NODE_START.as_secs().to_string())
            .kill_on_drop(true)
            .output()
            .await
            .expect("cannot run scripts/rabbitmq-node");
        assert_exited_ok(
            &format!("starting private RabbitMQ node {}", node.name),
            &out,
        );
        eprintln!(
            "private RabbitMQ node {} on AMQP port {amqp_port} started in {:?}",
            node.name,
            started.elapsed()
        );
        node
    }

    /// `rabbitmqctl` against this node only.
    pub fn ctl(&self) -> &Ctl {
        &self.ctl
    }

    /// `amqp://guest:guest@127.0.0.1:<port>`, without a vhost.
    pub fn amqp_base(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}", self.amqp_port)
    }

    /// The node's directory (logs in `log/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `stop_app`: the broker application stops, the Erlang VM stays up; durable
    /// queues and persistent messages survive.
    pub async fn stop_app(&self) {
        self.ctl.run(&["stop_app"]).await;
    }

    /// `start_app`, then `await_startup`: the node accepts connections again.
    pub async fn start_app(&self) {
        self.ctl.run(&["start_app"]).await;
        self.ctl
            .run(&[
                "await_startup",
                "--timeout",
                &NODE_START.as_secs().to_string(),
            ])
            .await;
    }
}

impl Drop for BrokerNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.dir.join("log").join(format!("{}.log", self.name));
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            eprintln!(
                "---- private node {} log, last lines ----\n{}\n---- end ----",
                self.name,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        let Ctl::Private { script, dir } = &self.ctl else {
            return;
        };
        match std::process::Command::new(script)
            .arg("stop")
            .arg(dir)
            .output()
        {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "cleanup: stopping private node {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("cleanup: cannot run {}: {e}", script.display()),
        }
    }
}

/// A TCP port on 127.0.0.1 that is free when asked (nothing holds it afterwards).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
