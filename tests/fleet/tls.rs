//! SPEC §6: TLS works. The real binary reaches RabbitMQ over `amqps://` (through a
//! socat TLS terminator in front of the local broker) and Redis over `rediss://`
//! (a private `redis-server` listening on TLS only), both with a certificate
//! issued by a throwaway CA that is trusted only through `SSL_CERT_FILE`.
//!
//! Both URLs carry passwords of their own (a dedicated RabbitMQ user, a Redis
//! `requirepass`) so the test can check that neither ever reaches an output.

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::harness::env::{REDIS_URL, rabbitmqctl};
use crate::harness::{
    Downstream, Event, PROCESSING, SHARDS, STARTUP, TestEnv, all_ok, assert_exactly_once,
    assert_in_order_and_complete, assert_request_shape, describe, interleaved, order_ids,
};

const BIN: &str = env!("CARGO_BIN_EXE_shardline");
/// Bound on a helper process (redis-server, socat) becoming ready.
const HELPER_READY: Duration = Duration::from_secs(15);

/// The worker verifies the TLS Redis against the system roots plus
/// `SSL_CERT_FILE` (redis' rustls with native certs), like lapin does for
/// RabbitMQ; nothing to add to the URL.
const REDIS_URL_FRAGMENT: &str = "";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_and_rediss_with_a_private_ca() {
    let env = TestEnv::new("tls").await;
    let pki = Pki::generate(&env.id);

    // A RabbitMQ user of its own, so its password is distinctive in the logs.
    let user = BrokerUser::create(&env).await;
    let redis = TlsRedis::start(&pki);
    let terminator = TlsTerminator::start(&pki);

    // The vhost path exactly as the harness encodes it for the plain URL.
    let vhost_path = env.amqp_url.rsplit('/').next().unwrap();
    let amqp_url = format!(
        "amqps://{}:{}@localhost:{}/{vhost_path}",
        user.name, user.password, terminator.port
    );
    let redis_url = format!(
        "rediss://:{}@localhost:{}/{REDIS_URL_FRAGMENT}",
        redis.password, redis.port
    );
    let tls = TlsCli {
        env: &env,
        ca: pki.ca.clone(),
        amqp_url,
        redis_url,
    };
    let secrets = [user.password.as_str(), redis.password.as_str()];

    let out = tls.run(&["topology", "apply"]).await;
    assert_success("topology apply", &out, &secrets);

    let conn = env.connect().await;
    let downstream = Downstream::start().await;
    let mut worker = tls.worker(&pki.dir, &downstream.url());
    worker.wait_consuming(&env, &conn).await;

    // Three events for each of four orders, seq-major, as one file: one publisher
    // connection keeps the order of the lines.
    let events = interleaved(&order_ids("tls", 4), 3, env.shards);
    let file = pki.dir.join("events.jsonl");
    write_jsonl(&file, &events);
    let out = tls
        .run(&["publish", "--file", file.to_str().unwrap()])
        .await;
    assert_success("publish --file", &out, &secrets);

    downstream
        .wait_for("every event answered", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;
    let calls = downstream.calls();
    assert_exactly_once(&calls, &events);
    assert_in_order_and_complete(&calls, &events);
    assert_request_shape(&calls, &events, &env);

    // The dedup marks are in the TLS Redis, under this test's prefix, committed.
    let mut redis_con = redis.verified_connection(&pki);
    for e in &events {
        let key = format!("{}dedup:{}", env.redis_prefix, e.key());
        let state: Option<String> = redis::cmd("GET").arg(&key).query(&mut redis_con).unwrap();
        assert_eq!(
            state.as_deref(),
            Some("done"),
            "dedup key {key} in the TLS Redis; calls: {}",
            describe(&calls)
        );
    }

    // The worker's only routes to both servers are their TLS ports; it names the
    // AMQP user with the password redacted and never prints either password.
    let log = worker.log_text();
    assert!(
        log.contains(&format!("{}:***@localhost:{}", user.name, terminator.port)),
        "the worker log does not name the amqps URL with a redacted password:\n{log}"
    );
    assert_no_secret("worker log", &log, &secrets);
}

/// The `amqps://` leg really verifies the broker's certificate: without the test
/// CA in `SSL_CERT_FILE` the same command fails on the certificate, and says so
/// without the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_refuses_a_certificate_from_an_untrusted_ca() {
    let env = TestEnv::new("tls-untrusted").await;
    let pki = Pki::generate(&env.id);
    let user = BrokerUser::create(&env).await;
    let terminator = TlsTerminator::start(&pki);
    let vhost_path = env.amqp_url.rsplit('/').next().unwrap();
    // A CA file that holds a certificate, just not the one that signed the server's.
    let other = Pki::generate(&format!("{}-other", env.id));
    let tls = TlsCli {
        env: &env,
        ca: other.ca.clone(),
        amqp_url: format!(
            "amqps://{}:{}@localhost:{}/{vhost_path}",
            user.name, user.password, terminator.port
        ),
        redis_url: REDIS_URL.to_owned(),
    };
    let out = tokio::time::timeout(STARTUP, tls.run(&["topology", "apply"]))
        .await
        .expect("`topology apply` against an untrusted certificate neither failed nor finished");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "`topology apply` trusted a certificate from a CA it was not given:\n{stderr}"
    );
    assert!(
        stderr.to_ascii_lowercase().contains("certificate"),
        "`topology apply` failed, but not on the certificate:\n{stderr}"
    );
    assert_no_secret(
        "`topology apply` stderr",
        &stderr,
        &[user.password.as_str()],
    );
    assert_no_secret(
        "`topology apply` stdout",
        &String::from_utf8_lossy(&out.stdout),
        &[user.password.as_str()],
    );
}

/// A throwaway CA and a `localhost` server certificate it signed, made with the
/// `openssl` command line.
struct Pki {
    dir: PathBuf,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl Pki {
    fn generate(id: &str) -> Self {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("tls-{id}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("openssl.cnf"),
            "[req]\n\
             distinguished_name = dn\n\
             prompt = no\n\
             [dn]\n\
             CN = shardline test\n\
             [v3_ca]\n\
             basicConstraints = critical, CA:TRUE\n\
             keyUsage = critical, keyCertSign, cRLSign\n\
             subjectKeyIdentifier = hash\n\
             [v3_server]\n\
             basicConstraints = critical, CA:FALSE\n\
             keyUsage = critical, digitalSignature, keyEncipherment\n\
             extendedKeyUsage = serverAuth\n\
             subjectAltName = DNS:localhost, IP:127.0.0.1\n\
             subjectKeyIdentifier = hash\n\
             authorityKeyIdentifier = keyid\n",
        )
        .unwrap();
        let serial = format!("0x{:x}", unique());
        let ca_subject = format!("/CN=shardline test CA {id}");
        let steps: [&[&str]; 5] = [
            &[
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
                "ca.key",
            ],
            &[
                "req",
                "-config",
                "openssl.cnf",
                "-new",
                "-x509",
                "-key",
                "ca.key",
                "-subj",
                &ca_subject,
                "-extensions",
                "v3_ca",
                "-days",
                "2",
                "-out",
                "ca.pem",
            ],
            &[
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
                "server.key",
            ],
            &[
                "req",
                "-config",
                "openssl.cnf",
                "-new",
                "-key",
                "server.key",
                "-subj",
                "/CN=localhost",
                "-out",
                "server.csr",
            ],
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-set_serial",
                &serial,
                "-days",
                "2",
                "-extfile",
                "openssl.cnf",
                "-extensions",
                "v3_server",
                "-out",
                "server.pem",
            ],
        ];
        for args in steps {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .unwrap_or_else(|e| {
                    panic!(
                        "this test needs the `openssl` command line to make its certificates \
                         (apt-get install openssl): cannot run it: {e}"
                    )
                });
            assert!(
                out.status.success(),
                "openssl {args:?} failed with {}:\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Self {
            ca: dir.join("ca.pem"),
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
            dir,
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        // Kept after a failure: the helper logs and the worker log are in there.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A RabbitMQ user with full rights on the test's vhost, deleted on drop.
struct BrokerUser {
    name: String,
    password: String,
}

impl BrokerUser {
    async fn create(env: &TestEnv) -> Self {
        let name = format!("shardline-{}", env.id);
        let password = format!("Amqp{:x}Secret", unique());
        rabbitmqctl(&["add_user", &name, &password]).await;
        rabbitmqctl(&["set_permissions", "-p", &env.vhost, &name, ".*", ".*", ".*"]).await;
        Self { name, password }
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let out = Command::new("rabbitmqctl")
            .args(["-q", "delete_user", &self.name])
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "cleanup: delete_user {} failed: {}",
                self.name,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("cleanup: cannot run rabbitmqctl: {e}"),
        }
    }
}

/// A child process killed (and reaped) on drop, its output in a log file.
struct Helper {
    what: &'static str,
    child: Child,
    log: PathBuf,
}

impl Helper {
    fn spawn(what: &'static str, cmd: &mut Command, log: PathBuf) -> Self {
        let file = File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("this test needs `{what}` (apt-get install {what}): cannot run it: {e}")
            });
        Self { what, child, log }
    }

    /// Polls `ready` until it holds; fails loudly if the process exits first or
    /// it does not hold within [`HELPER_READY`].
    fn wait_ready(&mut self, mut ready: impl FnMut() -> Result<(), String>) {
        let deadline = Instant::now() + HELPER_READY;
        loop {
            let last = match ready() {
                Ok(()) => return,
                Err(e) => e,
            };
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited ({status}) before it was ready; its output:\n{}",
                    self.what,
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} not ready after {HELPER_READY:?}: {last}; its output:\n{}",
                self.what,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- {} output ({}) ----\n{}\n---- end of {} output ----",
                self.what,
                self.log.display(),
                self.log_text(),
                self.what
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `redis-server` listening on TLS only (`--port 0`), with a password, nothing
/// persisted.
struct TlsRedis {
    port: u16,
    password: String,
    _process: Helper,
}

impl TlsRedis {
    fn start(pki: &Pki) -> Self {
        let port = free_port();
        let password = format!("Redis{:x}Secret", unique());
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", "0", "--bind", "127.0.0.1"])
            .args(["--tls-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(&pki.cert)
            .arg("--tls-key-file")
            .arg(&pki.key)
            .arg("--tls-ca-cert-file")
            .arg(&pki.ca)
            .args(["--tls-auth-clients", "no"])
            .args(["--requirepass", &password])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&pki.dir);
        let process = Helper::spawn("redis-server", &mut cmd, pki.dir.join("redis.log"));
        let mut redis = Self {
            port,
            password,
            _process: process,
        };
        let client = redis.verified_client(pki);
        redis._process.wait_ready(|| {
            let mut con = client
                .get_connection_with_timeout(Duration::from_secs(1))
                .map_err(|e| e.to_string())?;
            redis::cmd("PING")
                .query::<String>(&mut con)
                .map(drop)
                .map_err(|e| e.to_string())
        });
        redis
    }

    /// A client that checks the server certificate against the test CA only.
    fn verified_client(&self, pki: &Pki) -> redis::Client {
        redis::Client::build_with_tls(
            format!("rediss://:{}@localhost:{}", self.password, self.port),
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(std::fs::read(&pki.ca).unwrap()),
            },
        )
        .unwrap()
    }

    fn verified_connection(&self, pki: &Pki) -> redis::Connection {
        self.verified_client(pki)
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap()
    }
}

/// `socat` terminating TLS in front of the local RabbitMQ.
struct TlsTerminator {
    port: u16,
    _process: Helper,
}

impl TlsTerminator {
    fn start(pki: &Pki) -> Self {
        let port = free_port();
        let listen = format!(
            "OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,cert={},key={},verify=0",
            pki.cert.display(),
            pki.key.display()
        );
        let mut cmd = Command::new("socat");
        cmd.args([listen.as_str(), "TCP:127.0.0.1:5672"]);
        let mut process = Helper::spawn("socat", &mut cmd, pki.dir.join("socat.log"));
        process.wait_ready(|| {
            TcpStream::connect(("127.0.0.1", port))
                .map(drop)
                .map_err(|e| e.to_string())
        });
        Self {
            port,
            _process: process,
        }
    }
}

/// Runs the binary with the TLS URLs, trusting the test CA through `SSL_CERT_FILE`.
struct TlsCli<'a> {
    env: &'a TestEnv,
    ca: PathBuf,
    amqp_url: String,
    redis_url: String,
}

impl TlsCli<'_> {
    fn command(&self) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(BIN);
        cmd.env("SSL_CERT_FILE", &self.ca)
            .env_remove("SSL_CERT_DIR")
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .env(self.env.queue_type_env().0, self.env.queue_type_env().1)
            .kill_on_drop(true);
        cmd
    }

    fn global_args(&self) -> Vec<String> {
        vec![
            "--amqp-url".into(),
            self.amqp_url.clone(),
            "--redis-url".into(),
            self.redis_url.clone(),
            "--redis-prefix".into(),
            self.env.redis_prefix.clone(),
            "--shards".into(),
            SHARDS.to_string(),
        ]
    }

    async fn run(&self, args: &[&str]) -> Output {
        self.command()
            .args(args)
            .args(self.global_args())
            .output()
            .await
            .unwrap()
    }

    fn worker(&self, dir: &Path, handler: &str) -> TlsWorker {
        let log = dir.join("worker.log");
        let file = File::create(&log).unwrap();
        let child = self
            .command()
            .arg("worker")
            .args(self.global_args())
            .args(["--handler", handler, "--worker-name", "tls-w1"])
            .args(["--retry-base", "10ms", "--retry-cap", "100ms"])
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        TlsWorker { child, log }
    }
}

/// The `shardline worker` child process, killed on drop.
struct TlsWorker {
    child: tokio::process::Child,
    log: PathBuf,
}

impl TlsWorker {
    /// Waits until every shard queue has exactly one consumer; fails loudly, at
    /// once if the worker exits.
    async fn wait_consuming(&mut self, env: &TestEnv, conn: &lapin::Connection) {
        let deadline = Instant::now() + STARTUP;
        loop {
            let statuses = env.shard_statuses(conn).await;
            if statuses.iter().all(|s| s.consumers == 1) {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "worker exited ({status}) before consuming every shard; log:\n{}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "shard queues without exactly one consumer after {STARTUP:?}: {statuses:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for TlsWorker {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- worker log ({}) ----\n{}\n---- end of worker log ----",
                self.log.display(),
                self.log_text()
            );
        }
        let _ = self.child.start_kill();
    }
}

fn write_jsonl(path: &Path, events: &[Event]) {
    let mut text = Vec::new();
    for e in events {
        text.extend_from_slice(&e.body);
        text.push(b'\n');
    }
    std::fs::write(path, text).unwrap();
}

fn assert_success(what: &str, out: &Output, secrets: &[&str]) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "`shardline {what}` over TLS failed with {}:\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert_no_secret(&format!("`shardline {what}` stdout"), &stdout, secrets);
    assert_no_secret(&format!("`shardline {what}` stderr"), &stderr, secrets);
}

fn assert_no_secret(what: &str, text: &str, secrets: &[&str]) {
    for secret in secrets {
        assert!(
            !text.contains(secret),
            "{what} shows the password {secret:?}:\n{text}"
        );
    }
}

/// A port nobody listens on right now, for a helper process to bind.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Distinct per call, for serials and passwords.
fn unique() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        ^ (u128::from(std::process::id()) << 64)
}
