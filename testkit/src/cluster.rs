//! A private three-node RabbitMQ cluster that a test starts, may kill nodes of
//! and restart, and that is stopped and removed on drop.
//!
//! It is started by `scripts/cluster start` (three `scripts/rabbitmq-node`
//! nodes, one shared private Erlang cookie, `pause_minority`, `net_ticktime`
//! 10 s, joined to node 1) into a directory of its own, with free ports and
//! node names of its own (`shardline-test-cluster-<pid>-<n>-{1,2,3}@localhost`),
//! so it never meets a user's `scripts/cluster` on the default ports, nor the
//! machine's default node. A start takes about 20 s on a 2-core machine.
//!
//! Nodes are numbered `0..3` here (index into [`Cluster::names`]); the script
//! and the node names count from 1.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::broker::{Ctl, free_port};
use crate::process::assert_exited_ok;

/// How long `scripts/cluster start` may take (three VMs and two joins on two
/// busy cores), and a restarted node to rejoin.
pub const CLUSTER_START: Duration = Duration::from_secs(180);

/// Nodes in the cluster.
pub const NODES: usize = 3;

/// A running three-node cluster; stopped and its files removed on drop, also
/// when the test fails.
pub struct Cluster {
    /// The nodes' names, `shardline-test-cluster-<pid>-<n>-<1..3>@localhost`.
    pub names: [String; NODES],
    /// The nodes' AMQP ports on 127.0.0.1.
    pub amqp_ports: [u16; NODES],
    dir: PathBuf,
    script: PathBuf,
    ctls: [Ctl; NODES],
}

impl Cluster {
    /// Starts the cluster and waits until its three nodes run as one
    /// (`scripts/cluster start` returns only then).
    pub async fn start() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let scripts = crate::paths::scripts();
        // Nodes left behind by a test process that was killed go first.
        let _ = tokio::process::Command::new(scripts.join("rabbitmq-node"))
            .arg("sweep")
            .status()
            .await;
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let prefix = format!("shardline-test-cluster-{}-{n}", std::process::id());
        let ports = distinct_free_ports();
        let amqp_ports = [ports[0], ports[1], ports[2]];
        let dist_ports = [ports[3], ports[4], ports[5]];
        let dir = std::env::temp_dir().join(&prefix);
        let script = scripts.join("cluster");
        let cluster = Self {
            names: [1, 2, 3].map(|i| format!("{prefix}-{i}@localhost")),
            amqp_ports,
            ctls: [1, 2, 3].map(|i| Ctl::Private {
                script: scripts.join("rabbitmq-node"),
                dir: dir.join(format!("node-{i}")),
            }),
            dir,
            script,
        };
        let started = std::time::Instant::now();
        let out = tokio::process::Command::new(&cluster.script)
            .arg("start")
            .arg(&cluster.dir)
            .env("SHARDLINE_CLUSTER_NAME", &prefix)
            .env("SHARDLINE_CLUSTER_PORTS", join(&amqp_ports))
            .env("SHARDLINE_CLUSTER_DIST_PORTS", join(&dist_ports))
            .env("RABBITMQ_NODE_OWNER", std::process::id().to_string())
            .env("START_TIMEOUT", CLUSTER_START.as_secs().to_string())
            .kill_on_drop(true)
            .output()
            .await
            .expect("cannot run scripts/cluster");
        let stdout = assert_exited_ok(
            &format!("starting the cluster {prefix} in {}", cluster.dir.display()),
            &out,
        );
        assert_eq!(
            stdout.trim().split(',').collect::<Vec<_>>(),
            cluster.amqp_urls(),
            "scripts/cluster start printed other URLs than the ports it was given"
        );
        eprintln!(
            "cluster {prefix} on AMQP ports {amqp_ports:?} started in {:?}",
            started.elapsed()
        );
        cluster
    }

    /// `amqp://guest:guest@127.0.0.1:<port>` of node `i`, without a vhost.
    pub fn amqp_base(&self, i: usize) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}", self.amqp_ports[i])
    }

    /// Node `i`'s URL on `vhost`.
    pub fn amqp_url(&self, i: usize, vhost: &str) -> String {
        format!(
            "{}/{}",
            self.amqp_base(i),
            crate::env::percent_encode(vhost)
        )
    }

    /// The three nodes' URLs on the default vhost, `amqp://…:<port>/%2f`.
    pub fn amqp_urls(&self) -> Vec<String> {
        (0..NODES)
            .map(|i| format!("{}/%2f", self.amqp_base(i)))
            .collect()
    }

    /// `rabbitmqctl` against node `i` only.
    pub fn ctl(&self, i: usize) -> &Ctl {
        &self.ctls[i]
    }

    /// `tool args` (`rabbitmq-diagnostics`, `rabbitmq-queues`, …) against node
    /// `i`; fails the test with its output unless it succeeds.
    pub async fn cli(&self, i: usize, tool: &str, args: &[&str]) -> String {
        let out = self.node_script(i, "cli", &[&[tool], args].concat()).await;
        assert_exited_ok(&format!("{tool} {args:?} on {}", self.names[i]), &out)
    }

    /// `Ok` when stopping node `i` would leave every quorum queue a majority
    /// (`rabbitmq-queues check_if_node_is_quorum_critical` exits 0); `Err`
    /// with the tool's answer while a queue would lose its quorum (exit 69)
    /// or the node cannot answer. A probe for [`crate::wait_until`].
    pub async fn check_not_quorum_critical(&self, i: usize) -> Result<(), String> {
        let out = self
            .node_script(
                i,
                "cli",
                &["rabbitmq-queues", "-q", "check_if_node_is_quorum_critical"],
            )
            .await;
        if out.status.success() {
            return Ok(());
        }
        Err(format!(
            "{} ({}): {}{}",
            self.names[i],
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }

    /// `scripts/cluster VERB N` for node `i` (numbered from 1 there), `what`
    /// naming it in a failure.
    async fn cluster_node_script(&self, verb: &str, i: usize, what: &str) {
        self.cluster_script(
            &[verb, &(i + 1).to_string()],
            &format!("{what} {}", self.names[i]),
        )
        .await;
    }

    /// kill -9 of node `i`'s Erlang VM; returns once it is gone. Its data stays.
    pub async fn kill9(&self, i: usize) {
        self.cluster_node_script("kill9", i, "kill -9 of").await;
    }

    /// Starts node `i` again with its data; returns once it is back in the cluster.
    pub async fn restart(&self, i: usize) {
        self.cluster_node_script("restart", i, "restarting").await;
    }

    /// SIGSTOP of node `i`'s VM: a partition once `net_ticktime` (10 s) passes.
    pub async fn pause(&self, i: usize) {
        self.cluster_node_script("pause", i, "pausing").await;
    }

    /// SIGCONT of node `i`'s VM.
    pub async fn resume(&self, i: usize) {
        self.cluster_node_script("resume", i, "resuming").await;
    }

    /// Cuts node `i` off from the other two at the network level (`scripts/cluster
    /// partition`: nftables drops every packet between them; its VM runs and
    /// its clients reach it). One cut at a time.
    pub async fn partition(&self, i: usize) {
        self.cluster_node_script("partition", i, "cutting off")
            .await;
    }

    /// Removes the cut of [`Self::partition`].
    pub async fn heal(&self) {
        self.cluster_script(&["heal"], "healing the cut").await;
    }

    /// Whether node `i` answers a ping of node `from` over the distribution
    /// (`net_adm:ping`): false while a cut separates them.
    pub async fn pings(&self, from: usize, i: usize) -> bool {
        let call = format!("net_adm:ping('{}').", self.names[i]);
        self.ctl(from).run(&["-q", "eval", &call]).await.trim() == "pong"
    }

    /// The nodes that node `i` sees running in its cluster (itself included).
    pub async fn running_nodes(&self, i: usize) -> Vec<String> {
        let text = self
            .ctl(i)
            .run(&["-q", "eval", "rabbit_nodes:all_running()."])
            .await;
        let mut nodes: Vec<String> = text
            .split(['[', ']', ',', '\'', ' ', '\n'])
            .filter(|s| s.contains('@'))
            .map(str::to_owned)
            .collect();
        nodes.sort();
        nodes
    }

    /// The cluster's directory (node `i`'s logs in `node-<i+1>/log/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// OS pids of the Erlang VMs whose command line names `dir`: the nodes of
    /// the cluster in `dir` that still run.
    pub fn vms_under(dir: &Path) -> Vec<u32> {
        let needle = format!("{}/", dir.display());
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        procs
            .filter_map(|entry| {
                let entry = entry.ok()?;
                let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
                let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
                let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
                (comm.trim() == "beam.smp"
                    && String::from_utf8_lossy(&cmdline)
                        .replace('\0', " ")
                        .contains(&needle))
                .then_some(pid)
            })
            .collect()
    }

    async fn cluster_script(&self, args: &[&str], what: &str) {
        let out = tokio::process::Command::new(&self.script)
            .args(args)
            .arg(&self.dir)
            .kill_on_drop(true)
            .output()
            .await
            .expect("cannot run scripts/cluster");
        assert_exited_ok(what, &out);
    }

    async fn node_script(&self, i: usize, command: &str, args: &[&str]) -> Output {
        let Ctl::Private { script, dir } = &self.ctls[i] else {
            unreachable!("a cluster's nodes are private");
        };
        tokio::process::Command::new(script)
            .arg(command)
            .arg(dir)
            .args(args)
            .kill_on_drop(true)
            .output()
            .await
            .expect("cannot run scripts/rabbitmq-node")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for (i, name) in self.names.iter().enumerate() {
                let log = self
                    .dir
                    .join(format!("node-{}", i + 1))
                    .join("log")
                    .join(format!("{name}.log"));
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(20).collect();
                eprintln!(
                    "---- cluster node {name} log, last lines ----\n{}\n---- end ----",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
        }
        match std::process::Command::new(&self.script)
            .arg("stop")
            .arg(&self.dir)
            .output()
        {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "cleanup: stopping the cluster in {}: {}",
                self.dir.display(),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("cleanup: cannot run {}: {e}", self.script.display()),
        }
    }
}

/// Six different free ports: three AMQP, three distribution.
fn distinct_free_ports() -> [u16; 6] {
    let mut ports = Vec::with_capacity(6);
    while ports.len() < 6 {
        let port = free_port();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    [ports[0], ports[1], ports[2], ports[3], ports[4], ports[5]]
}

fn join(ports: &[u16]) -> String {
    ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",")
}
