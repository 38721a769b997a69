//! A private Redis Sentinel setup for failover tests: a primary and one
//! replica (`redis-server` without persistence) and three Sentinels (quorum
//! 2, a node is down after 1 s), all on 127.0.0.1 on free ports, files under
//! the test's scratch folder; plain, or TLS only everywhere (certificate from
//! a test [`Pki`]). Every process is killed on drop.
//!
//! Waits are on what the servers say (`SENTINEL get-master-addr-by-name`,
//! `INFO replication`, `SENTINEL CKQUORUM`), through [`wait_until`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::broker::free_port;
use crate::process::Helper;
use crate::tls::Pki;
use crate::wait::wait_until;

/// The service (master) name the Sentinels monitor.
pub const SERVICE: &str = "mymaster";

/// Bound on a failover: down-after (1 s), the election and the promotion.
pub const FAILOVER: Duration = Duration::from_secs(30);

pub struct SentinelSet {
    /// The data nodes by port: the first started as the primary.
    nodes: Vec<Node>,
    sentinels: Vec<Node>,
    dir: PathBuf,
    dialer: Dialer,
}

/// How the kit itself reaches a node: plain, or TLS trusting the test CA;
/// with the data nodes' or the Sentinels' password.
#[derive(Clone, Default)]
struct Dialer {
    ca: Option<Vec<u8>>,
    passwords: Option<Passwords>,
    sentinel_ports: Vec<u16>,
}

/// `requirepass` of the data nodes and of the Sentinels.
#[derive(Clone)]
struct Passwords {
    primary: String,
    sentinel: String,
}

impl Dialer {
    fn client(&self, port: u16) -> Result<redis::Client, String> {
        let auth = match &self.passwords {
            None => String::new(),
            Some(p) if self.sentinel_ports.contains(&port) => format!(":{}@", p.sentinel),
            Some(p) => format!(":{}@", p.primary),
        };
        match &self.ca {
            None => redis::Client::open(format!("redis://{auth}127.0.0.1:{port}")),
            Some(ca) => redis::Client::build_with_tls(
                format!("rediss://{auth}127.0.0.1:{port}"),
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.clone()),
                },
            ),
        }
        .map_err(|e| e.to_string())
    }

    async fn connect(&self, port: u16) -> Result<redis::aio::MultiplexedConnection, String> {
        self.client(port)?
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| format!("{port}: {e}"))
    }
}

struct Node {
    port: u16,
    process: Option<Helper>,
    /// The command line it was started with (data nodes: to start it again).
    args: Vec<std::ffi::OsString>,
}

impl SentinelSet {
    /// Starts the primary, its replica (waiting until it is in sync) and the
    /// three Sentinels (waiting until each knows the replica and a quorum).
    pub async fn start(id: &str) -> Self {
        Self::start_with(id, None, None).await
    }

    /// Like [`Self::start`], every node and Sentinel listening on TLS only
    /// (replication and the Sentinels' links too), with `pki`'s certificate.
    pub async fn start_tls(id: &str, pki: &Pki) -> Self {
        Self::start_with(id, Some(pki), None).await
    }

    /// Like [`Self::start`], the data nodes requiring `primary` (replication
    /// and the Sentinels authenticate with it), the Sentinels `sentinel`.
    pub async fn start_with_passwords(id: &str, primary: &str, sentinel: &str) -> Self {
        let passwords = Passwords {
            primary: primary.to_owned(),
            sentinel: sentinel.to_owned(),
        };
        Self::start_with(id, None, Some(passwords)).await
    }

    async fn start_with(id: &str, pki: Option<&Pki>, passwords: Option<Passwords>) -> Self {
        let dir = crate::paths::scratch("sentinel").join(id);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ports = free_ports(5);
        let dialer = Dialer {
            ca: pki.map(|pki| std::fs::read(&pki.ca).unwrap()),
            passwords: passwords.clone(),
            sentinel_ports: ports[2..].to_vec(),
        };
        let mut set = Self {
            nodes: Vec::new(),
            sentinels: Vec::new(),
            dir,
            dialer: dialer.clone(),
        };
        let primary = ports[0];
        for (i, &port) in ports[..2].iter().enumerate() {
            let node_dir = set.dir.join(format!("redis-{port}"));
            std::fs::create_dir_all(&node_dir).unwrap();
            let mut cmd = Command::new("redis-server");
            cmd.args(["--bind", "127.0.0.1"]);
            match pki {
                None => {
                    cmd.args(["--port", &port.to_string()]);
                }
                Some(pki) => {
                    cmd.args(["--port", "0", "--tls-port", &port.to_string()])
                        .arg("--tls-cert-file")
                        .arg(&pki.cert)
                        .arg("--tls-key-file")
                        .arg(&pki.key)
                        .arg("--tls-ca-cert-file")
                        .arg(&pki.ca)
                        .args(["--tls-auth-clients", "no", "--tls-replication", "yes"]);
                }
            }
            if let Some(p) = &passwords {
                cmd.args(["--requirepass", &p.primary, "--masterauth", &p.primary]);
            }
            cmd.args(["--save", "", "--appendonly", "no"])
                // A replica syncs at once, not after the default 5 s.
                .args([
                    "--repl-diskless-sync",
                    "yes",
                    "--repl-diskless-sync-delay",
                    "0",
                ])
                .arg("--dir")
                .arg(&node_dir);
            if i > 0 {
                cmd.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
            }
            let log = set.dir.join(format!("redis-{port}.log"));
            set.nodes.push(Node {
                port,
                args: cmd.get_args().map(ToOwned::to_owned).collect(),
                process: Some(Helper::spawn("redis-server", &mut cmd, log)),
            });
        }
        for node in &mut set.nodes {
            wait_answering(node, &dialer).await;
        }
        let replica = ports[1];
        wait_until(
            &format!("replica {replica} to sync with primary {primary}"),
            crate::STARTUP,
            || async {
                let info = replication(&dialer, replica).await?;
                if info.contains("master_link_status:up") {
                    Ok(())
                } else {
                    Err(info)
                }
            },
        )
        .await;
        for &port in &ports[2..] {
            let conf = set.dir.join(format!("sentinel-{port}.conf"));
            write_sentinel_conf(&conf, port, primary, &set.dir, pki, passwords.as_ref());
            let mut cmd = Command::new("redis-server");
            cmd.arg(&conf).arg("--sentinel");
            let log = set.dir.join(format!("sentinel-{port}.log"));
            set.sentinels.push(Node {
                port,
                args: cmd.get_args().map(ToOwned::to_owned).collect(),
                process: Some(Helper::spawn("redis-server", &mut cmd, log)),
            });
        }
        for sentinel in &mut set.sentinels {
            wait_answering(sentinel, &dialer).await;
        }
        for sentinel in &set.sentinels {
            let port = sentinel.port;
            wait_until(
                &format!("Sentinel {port} to know the replica and reach a quorum"),
                crate::STARTUP,
                || async {
                    let mut conn = dialer.connect(port).await?;
                    let replicas: Vec<redis::Value> = redis::cmd("SENTINEL")
                        .arg("REPLICAS")
                        .arg(SERVICE)
                        .query_async(&mut conn)
                        .await
                        .map_err(|e| e.to_string())?;
                    let quorum: Result<String, _> = redis::cmd("SENTINEL")
                        .arg("CKQUORUM")
                        .arg(SERVICE)
                        .query_async(&mut conn)
                        .await;
                    match quorum {
                        Ok(ok) if !replicas.is_empty() && ok.contains("3 usable") => Ok(()),
                        other => Err(format!("{} replicas; CKQUORUM {other:?}", replicas.len())),
                    }
                },
            )
            .await;
        }
        set
    }

    /// `redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/mymaster`
    /// (`rediss+sentinel://` for a TLS set; with both passwords if set).
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        let scheme = match self.dialer.ca {
            None => "redis+sentinel",
            Some(_) => "rediss+sentinel",
        };
        match &self.dialer.passwords {
            None => format!("{scheme}://{}/{SERVICE}", hosts.join(",")),
            Some(p) => format!(
                "{scheme}://:{}@{}/{SERVICE}?sentinel_password={}",
                p.primary,
                hosts.join(","),
                p.sentinel
            ),
        }
    }

    /// The data nodes' ports (primary and replica, whichever is which now).
    pub fn data_ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The Sentinels' ports.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|s| s.port).collect()
    }

    /// The primary's port, as the first Sentinel that answers names it.
    pub async fn primary_port(&self) -> u16 {
        for sentinel in &self.sentinels {
            if let Ok(port) = named_primary(&self.dialer, sentinel.port).await {
                return port;
            }
        }
        panic!("no Sentinel names a primary of {SERVICE}")
    }

    /// SIGKILL of the current primary; returns its port.
    pub async fn kill_primary(&mut self) -> u16 {
        let port = self.primary_port().await;
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("the Sentinels name {port}, which is none of the nodes"));
        if let Some(mut process) = node.process.take() {
            process.kill9();
        }
        port
    }

    /// Starts the data node on `port` again (after [`Self::kill_primary`]),
    /// empty, as a replica of the primary the Sentinels name now, and waits
    /// until it answers; the Sentinels keep it as a replica.
    pub async fn restart_node(&mut self, port: u16) {
        let primary = self.primary_port().await;
        let dialer = self.dialer.clone();
        let log = self.dir.join(format!("redis-{port}.log"));
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == port && n.process.is_none())
            .unwrap_or_else(|| panic!("no stopped data node on port {port}"));
        let mut cmd = Command::new("redis-server");
        cmd.args(&node.args)
            .args(["--replicaof", "127.0.0.1", &primary.to_string()]);
        node.process = Some(Helper::spawn("redis-server", &mut cmd, log));
        wait_answering(node, &dialer).await;
    }

    /// `SENTINEL FAILOVER`: the replica is promoted while the primary is up;
    /// returns the old primary's port.
    pub async fn manual_failover(&self) -> u16 {
        let port = self.primary_port().await;
        let mut conn = self.dialer.connect(self.sentinels[0].port).await.unwrap();
        let () = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(SERVICE)
            .query_async(&mut conn)
            .await
            .unwrap();
        port
    }

    /// Waits until every Sentinel names a primary other than `old_port`, that
    /// node says it is a master, and (if it still runs) the old primary says
    /// it is a replica; returns the new primary's port.
    pub async fn wait_failed_over(&self, old_port: u16) -> u16 {
        let sentinels = self.sentinel_ports();
        let old_alive = self
            .nodes
            .iter()
            .any(|n| n.port == old_port && n.process.is_some());
        wait_until(
            &format!("the Sentinels to fail over from {old_port}"),
            FAILOVER,
            || {
                let sentinels = sentinels.clone();
                let dialer = &self.dialer;
                async move {
                    let mut named = BTreeSet::new();
                    for port in sentinels {
                        named.insert(named_primary(dialer, port).await?);
                    }
                    let new = match named.iter().collect::<Vec<_>>()[..] {
                        [&new] if new != old_port => new,
                        _ => return Err(format!("the Sentinels name {named:?}")),
                    };
                    let info = replication(dialer, new).await?;
                    if !info.contains("role:master") {
                        return Err(format!("{new} is named but says {info}"));
                    }
                    if old_alive {
                        let info = replication(dialer, old_port).await?;
                        if !info.contains("role:slave") {
                            return Err(format!("old primary {old_port} says {info}"));
                        }
                    }
                    Ok(new)
                }
            },
        )
        .await
    }

    /// A client of the data node on `port` (over TLS for a TLS set,
    /// trusting the test CA only).
    pub fn node_client(&self, port: u16) -> redis::Client {
        self.dialer.client(port).unwrap()
    }

    /// Where the nodes' files and logs are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        // Sentinels first, so that none acts on the data nodes going away.
        for node in self.sentinels.iter_mut().chain(self.nodes.iter_mut()) {
            if let Some(mut process) = node.process.take() {
                process.kill9();
            }
        }
    }
}

fn free_ports(n: usize) -> Vec<u16> {
    let mut ports = BTreeSet::new();
    while ports.len() < n {
        ports.insert(free_port());
    }
    ports.into_iter().collect()
}

fn write_sentinel_conf(
    path: &Path,
    port: u16,
    primary: u16,
    dir: &Path,
    pki: Option<&Pki>,
    passwords: Option<&Passwords>,
) {
    let sentinel_dir = dir.join(format!("sentinel-{port}"));
    std::fs::create_dir_all(&sentinel_dir).unwrap();
    let listen = match pki {
        None => format!("port {port}\n"),
        Some(pki) => format!(
            "port 0\n\
             tls-port {port}\n\
             tls-cert-file {}\n\
             tls-key-file {}\n\
             tls-ca-cert-file {}\n\
             tls-auth-clients no\n\
             tls-replication yes\n",
            pki.cert.display(),
            pki.key.display(),
            pki.ca.display()
        ),
    };
    let auth = match passwords {
        None => String::new(),
        Some(p) => format!(
            "requirepass {}\n\
             sentinel sentinel-pass {}\n",
            p.sentinel, p.sentinel
        ),
    };
    let data_auth = match passwords {
        None => String::new(),
        Some(p) => format!("sentinel auth-pass {SERVICE} {}\n", p.primary),
    };
    let conf = format!(
        "{listen}{auth}\
         bind 127.0.0.1\n\
         dir {}\n\
         sentinel resolve-hostnames yes\n\
         sentinel announce-ip 127.0.0.1\n\
         sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n\
         sentinel down-after-milliseconds {SERVICE} 1000\n\
         sentinel failover-timeout {SERVICE} 5000\n\
         sentinel parallel-syncs {SERVICE} 1\n\
         {data_auth}",
        sentinel_dir.display()
    );
    std::fs::write(path, conf).unwrap();
}

async fn wait_answering(node: &mut Node, dialer: &Dialer) {
    let port = node.port;
    wait_until(
        &format!("redis-server on port {port} to answer PING"),
        crate::STARTUP,
        || {
            if let Some(process) = node.process.as_mut() {
                process.assert_running();
            }
            async move {
                let mut conn = dialer.connect(port).await?;
                redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        },
    )
    .await;
}

/// `INFO replication` of the data node on `port`.
async fn replication(dialer: &Dialer, port: u16) -> Result<String, String> {
    let mut conn = dialer.connect(port).await?;
    redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("{port}: {e}"))
}

/// The primary's port as the Sentinel on `port` names it.
async fn named_primary(dialer: &Dialer, port: u16) -> Result<u16, String> {
    let mut conn = dialer.connect(port).await?;
    let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(SERVICE)
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("Sentinel {port}: {e}"))?;
    addr.map(|(_, p)| p)
        .ok_or_else(|| format!("Sentinel {port} names no primary"))
}
