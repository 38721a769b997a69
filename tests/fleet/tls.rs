//! docs/semantics.md §6: TLS works. The real binary reaches RabbitMQ over `amqps://` (through a
//! socat TLS terminator in front of the local broker) and Redis over `rediss://`
//! (a private `redis-server` listening on TLS only), both with a certificate
//! issued by a throwaway CA that is trusted only through `SSL_CERT_FILE`.
//!
//! Both URLs carry passwords of their own (a dedicated RabbitMQ user, a Redis
//! `requirepass`) so the test can check that neither ever reaches an output.

use std::path::{Path, PathBuf};
use std::process::Output;

use shardline_testkit::redis::RedisServer;
use shardline_testkit::tls::{BrokerUser, Pki, TlsTerminator, unique};
use shardline_testkit::{
    ChildWorker, Downstream, Event, STARTUP, TestEnv, assert_all_delivered_once_in_order,
    assert_request_shape, describe, interleaved, order_ids,
};

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
    let redis_password = format!("Redis{:x}Secret", unique());
    let redis = RedisServer::start_tls(&pki, &redis_password).await;
    let terminator = TlsTerminator::start(&pki, env.amqp_port()).await;

    // The vhost path exactly as the harness encodes it for the plain URL.
    let vhost_path = env.amqp_url.rsplit('/').next().unwrap();
    let amqp_url = format!(
        "amqps://{}:{}@localhost:{}/{vhost_path}",
        user.name, user.password, terminator.port
    );
    let redis_url = format!(
        "rediss://:{}@localhost:{}/{REDIS_URL_FRAGMENT}",
        redis_password, redis.port
    );
    let tls = TlsCli {
        env: &env,
        ca: pki.ca.clone(),
        amqp_url,
        redis_url,
    };
    let secrets = [user.password.as_str(), redis_password.as_str()];

    let out = tls.run(&["topology", "apply"]).await;
    assert_success("topology apply", &out, &secrets);
    // The broker probe reads the server properties over TLS too.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        ["3.10.8", "4.0.5"]
            .iter()
            .any(|v| stdout.contains(&format!("broker: RabbitMQ {v}"))),
        "{stdout}"
    );

    let downstream = Downstream::start().await;
    let mut worker = tls.worker(&downstream.url());
    worker.wait_consuming(&env).await;

    // Three events for each of four orders, seq-major, as one file: one publisher
    // connection keeps the order of the lines.
    let events = interleaved(&order_ids("tls", 4), 3, env.shards);
    let file = pki.dir.join("events.jsonl");
    write_jsonl(&file, &events);
    let out = tls
        .run(&["publish", "--file", file.to_str().unwrap()])
        .await;
    assert_success("publish --file", &out, &secrets);

    let calls = assert_all_delivered_once_in_order(&env, &downstream, &events).await;
    assert_request_shape(&calls, &events, &env);

    // The order state is in the TLS Redis, under this test's prefix, committed
    // up to each order's last seq.
    let mut redis_con = redis.connection();
    for e in events.iter().filter(|e| e.seq == 3) {
        let key = env.keys().order(&e.order_id);
        let last: Option<String> = redis::cmd("HGET")
            .arg(&key)
            .arg("l")
            .query(&mut redis_con)
            .unwrap();
        assert_eq!(
            last.as_deref(),
            Some("3"),
            "order state {key} in the TLS Redis; calls: {}",
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
    let terminator = TlsTerminator::start(&pki, env.amqp_port()).await;
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
        redis_url: shardline_testkit::env::REDIS_URL.to_owned(),
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

/// Runs the binary with the TLS URLs, trusting the test CA through `SSL_CERT_FILE`.
struct TlsCli<'a> {
    env: &'a TestEnv,
    ca: PathBuf,
    amqp_url: String,
    redis_url: String,
}

impl TlsCli<'_> {
    fn command(&self) -> tokio::process::Command {
        let mut cmd = self.env.shardline_command();
        cmd.env("SSL_CERT_FILE", &self.ca)
            .env_remove("SSL_CERT_DIR");
        cmd
    }

    fn global_args(&self) -> Vec<String> {
        self.env.global_args_with(&self.amqp_url, &self.redis_url)
    }

    async fn run(&self, args: &[&str]) -> Output {
        self.command()
            .args(args)
            .args(self.global_args())
            .output()
            .await
            .unwrap()
    }

    /// `shardline worker` over TLS: a process, since what it prints (a redacted
    /// URL, never a password) is under test.
    fn worker(&self, handler: &str) -> ChildWorker {
        let mut cmd = self.command();
        cmd.arg("worker")
            .args(self.global_args())
            .args(["--handler", handler, "--worker-name", "tls-w1"])
            .args(["--retry-base", "10ms", "--retry-cap", "100ms"]);
        ChildWorker::spawn(self.env, "tls-w1", cmd)
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
