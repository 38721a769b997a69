//! A private `redis-server` on its own port, without persistence: killing it
//! loses every key, like a cache node being replaced. Plain, or TLS only with
//! a password (certificate from a test [`crate::tls::Pki`]). Killed on drop.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::broker::free_port;
use crate::process::Helper;
use crate::tls::Pki;
use crate::wait::wait_until;

pub struct RedisServer {
    pub port: u16,
    /// `requirepass`, for the TLS server.
    pub password: Option<String>,
    tls: Option<Tls>,
    log: PathBuf,
    process: Option<Helper>,
}

struct Tls {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
    dir: PathBuf,
}

impl RedisServer {
    /// A plain server on a free port, answering PING.
    pub async fn start(id: &str) -> Self {
        let mut redis = Self {
            port: free_port(),
            password: None,
            tls: None,
            log: crate::paths::scratch("redis").join(format!("{id}-redis-server.log")),
            process: None,
        };
        redis.restart().await;
        redis
    }

    /// A server listening on TLS only (`--port 0`), with `password`, its
    /// certificate issued by `pki`'s CA.
    pub async fn start_tls(pki: &Pki, password: &str) -> Self {
        let mut redis = Self {
            port: free_port(),
            password: Some(password.to_owned()),
            tls: Some(Tls {
                cert: pki.cert.clone(),
                key: pki.key.clone(),
                ca: pki.ca.clone(),
                dir: pki.dir.clone(),
            }),
            log: pki.dir.join("redis.log"),
            process: None,
        };
        redis.restart().await;
        redis
    }

    /// `redis://127.0.0.1:PORT` (plain servers).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill9(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.kill9();
        }
    }

    /// Starts the server (again) on the same port, empty, and waits until it
    /// answers PING.
    pub async fn restart(&mut self) {
        assert!(self.process.is_none(), "redis-server is already running");
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
        match &self.tls {
            None => {
                cmd.args(["--port", &self.port.to_string()]);
            }
            Some(tls) => {
                cmd.args(["--port", "0", "--tls-port", &self.port.to_string()])
                    .arg("--tls-cert-file")
                    .arg(&tls.cert)
                    .arg("--tls-key-file")
                    .arg(&tls.key)
                    .arg("--tls-ca-cert-file")
                    .arg(&tls.ca)
                    .args(["--tls-auth-clients", "no"])
                    .args(["--requirepass", self.password.as_deref().unwrap_or("")])
                    .arg("--dir")
                    .arg(&tls.dir);
            }
        }
        self.process = Some(Helper::spawn("redis-server", &mut cmd, self.log.clone()));
        let client = self.client();
        wait_until(
            &format!("redis-server on port {} to answer PING", self.port),
            crate::STARTUP,
            || {
                self.process.as_mut().unwrap().assert_running();
                let client = &client;
                async move {
                    let mut con = client
                        .get_connection_with_timeout(Duration::from_secs(1))
                        .map_err(|e| e.to_string())?;
                    redis::cmd("PING")
                        .query::<String>(&mut con)
                        .map(drop)
                        .map_err(|e| e.to_string())
                }
            },
        )
        .await;
    }

    /// A client of this server; for TLS it checks the server certificate
    /// against the test CA only.
    pub fn client(&self) -> redis::Client {
        match &self.tls {
            None => redis::Client::open(self.url()).unwrap(),
            Some(tls) => redis::Client::build_with_tls(
                format!(
                    "rediss://:{}@localhost:{}",
                    self.password.as_deref().unwrap_or(""),
                    self.port
                ),
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(std::fs::read(&tls.ca).unwrap()),
                },
            )
            .unwrap(),
        }
    }

    pub fn connection(&self) -> redis::Connection {
        self.client()
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap()
    }
}
