//! One redaction (docs/operating/publishing.md, "Passwords in addresses"): a canary password in every
//! URL and connection string the product takes — the broker user's and
//! Redis' (working ones), the HTTP handler's, the OTLP endpoint's, the order
//! database's, wrong AMQP, Redis, management and PostgreSQL ones, some with
//! reserved characters typed raw — reaches no output: the worker's and the
//! console's logs at `RUST_LOG=trace` (lapin's, redis', reqwest's and
//! tokio-postgres' own lines included), the commands' errors, every
//! command's `--help` with the variables set, `dlq list`, `dlq show`,
//! `--json`, `topology status --json`, the metrics text, the dead letter's
//! headers, the console's pages and API with either token, its audit log,
//! and `{:?}` of every configuration that holds an address.

use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

use shardline_testkit::console::{ADMIN, VIEWER};
use shardline_testkit::dlq::{peek_all, text, wait_depth};
use shardline_testkit::metrics::{free_addr, get};
use shardline_testkit::pg::PG_URL;
use shardline_testkit::{
    ChildWorker, Downstream, Event, OrdersDb, PROCESSING, Publisher, Reply, STARTUP, TestEnv,
    wait_until,
};

const CANARY: &str = "Canary7q9Zx";

fn assert_clean(what: &str, shown: &str) {
    assert!(
        !shown.contains(CANARY),
        "{what} shows the canary password:\n{shown}"
    );
}

fn assert_output_clean(what: &str, out: &Output) {
    assert_clean(what, &text(out));
}

/// The addresses of one run, each holding the canary password.
struct Canary {
    /// The environment's vhost as a broker user whose password is the canary.
    amqp: String,
    /// Redis' `default` user (no password set: any password is taken).
    redis: String,
    handler: String,
    /// Nothing listens there: every export fails.
    otlp: String,
    /// The order database (trust authentication: the password is ignored).
    orders: String,
    user: String,
}

impl Canary {
    async fn new(env: &TestEnv, downstream: SocketAddr, orders: &OrdersDb) -> Self {
        let user = format!("secrets-{}", env.id);
        env.broker().run(&["add_user", &user, CANARY]).await;
        env.broker()
            .run(&["set_permissions", "-p", &env.vhost, &user, ".*", ".*", ".*"])
            .await;
        let (_, vhost) = env.amqp_url.rsplit_once('/').unwrap();
        let orders_url = orders.url();
        let (_, database) = orders_url.split_once("@127.0.0.1").unwrap();
        assert!(orders_url.starts_with(PG_URL.split('@').next().unwrap()));
        Self {
            amqp: format!(
                "amqp://{user}:{CANARY}@127.0.0.1:{}/{vhost}",
                env.amqp_port()
            ),
            redis: format!("redis://default:{CANARY}@127.0.0.1:6379"),
            handler: format!("http://user:{CANARY}@{downstream}/events"),
            otlp: format!("http://otel:{CANARY}@127.0.0.1:1"),
            orders: format!("postgres://postgres:{CANARY}@127.0.0.1{database}"),
            user,
        }
    }

    /// `shardline ARGS` on these addresses, at trace level, exporting traces.
    fn command(&self, env: &TestEnv, args: &[&str]) -> tokio::process::Command {
        let mut cmd = env.shardline_command();
        cmd.env("RUST_LOG", "trace")
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &self.otlp)
            .args(args)
            .args(env.global_args_with(&self.amqp, &self.redis));
        cmd
    }

    async fn run_ok(&self, env: &TestEnv, args: &[&str]) -> Output {
        let out = self.command(env, args).output().await.unwrap();
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        assert_output_clean(&args.join(" "), &out);
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_password_reaches_no_output() {
    let env = TestEnv::new("secrets").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let orders = OrdersDb::new(&env).await;

    // The downstream refuses every event (400: the event's fault), so a
    // letter is dead-lettered.
    let downstream = Downstream::scripted(|_, _| Reply::status(400)).await;
    let canary = Canary::new(&env, downstream.addr, &orders).await;
    let metrics = free_addr();
    let metrics_text = metrics.to_string();
    let mut worker = ChildWorker::spawn(
        &env,
        "secrets",
        canary.command(
            &env,
            &[
                "worker",
                "--handler",
                &canary.handler,
                "--worker-name",
                "secrets",
                "--metrics-addr",
                &metrics_text,
            ],
        ),
    );
    worker.wait_consuming(&env).await;
    let events = vec![Event::new("secrets-a", 1, env.shards)];
    Publisher::connect(&env).await.publish(&events).await;
    wait_depth(&env, &conn, 1, PROCESSING).await;

    // The credentials reached the downstream as basic auth.
    let calls = downstream.calls();
    assert!(
        calls.iter().all(|c| c
            .header("authorization")
            .is_some_and(|a| a.starts_with("Basic "))),
        "{calls:?}"
    );

    // The dead letter's headers (x-error among them).
    let channel = conn.create_channel().await.unwrap();
    let letters = peek_all(&env, &channel).await;
    assert_eq!(letters.len(), 1);
    for letter in &letters {
        assert_clean(
            "the dead letter's headers",
            &format!("{:?}", letter.properties.headers()),
        );
    }
    // Closing the channel puts the letter back.
    channel.close(200, "done".into()).await.unwrap();

    let (status, scrape) = get(metrics, "/metrics").await.expect("a metrics scrape");
    assert_eq!(status, 200);
    assert_clean("the metrics text", &scrape);

    let id = the_commands_show_no_canary(&env, &canary).await;
    the_console_shows_no_canary(&env, &canary, &id).await;
    every_help_shows_no_canary(&env, &canary).await;
    wrong_addresses_show_no_canary(&env, &canary).await;
    configurations_show_no_canary(&env, &canary);

    // The worker's own log at trace level, after all of it.
    worker.assert_running("the end of the test");
    assert_clean("the worker's log", &worker.log_text());
    worker.sigterm();
    worker.wait_exit(STARTUP).await;
    assert_clean("the worker's log", &worker.log_text());
    env.broker().run(&["delete_user", &canary.user]).await;
}

/// `dlq list`, `dlq show`, `--json` and `topology status --json` on the
/// canary's addresses; the dead letter's id.
async fn the_commands_show_no_canary(env: &TestEnv, canary: &Canary) -> String {
    let out = canary.run_ok(env, &["dlq", "list", "--json"]).await;
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = shardline_testkit::dlq::ids(&list)
        .into_iter()
        .next()
        .expect("one dead letter");
    for args in [
        vec!["dlq", "list"],
        vec!["dlq", "show", id.as_str()],
        vec!["topology", "status", "--json"],
    ] {
        canary.run_ok(env, &args).await;
    }
    id
}

/// The console on the canary's addresses, with an order database: every
/// page and API answer to either token, an action and its audit entry, a
/// reconcile dry run, and its log.
async fn the_console_shows_no_canary(env: &TestEnv, canary: &Canary, letter: &str) {
    let tokens = shardline_testkit::paths::scratch("secrets").join(format!("{}-tokens", env.id));
    std::fs::write(
        &tokens,
        format!("ops:admin:{ADMIN}\nviewer:read-only:{VIEWER}\n"),
    )
    .unwrap();
    let listen = free_addr();
    let (listen_text, tokens_text) = (listen.to_string(), tokens.display().to_string());
    let args = [
        "console",
        "--listen",
        &listen_text,
        "--token-file",
        &tokens_text,
        "--orders-url",
        &canary.orders,
    ];
    let mut console = ChildWorker::spawn(env, "secrets-console", canary.command(env, &args));
    wait_until("the console listens", STARTUP, || async move {
        tokio::net::TcpStream::connect(listen)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    let http = reqwest::Client::new();
    let origin = format!("http://{listen}");
    let post = |path: &str, body: &'static str| {
        http.post(format!("{origin}{path}"))
            .bearer_auth(ADMIN)
            .header("origin", &origin)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let released = post("/api/dlq/release", r#"{"order_id": "secrets-a"}"#)
        .await
        .unwrap();
    assert!(released.status().is_success(), "{released:?}");
    assert_clean("the release's answer", &released.text().await.unwrap());
    let dry_run = post("/api/reconcile/dry-run", "{}").await.unwrap();
    assert!(dry_run.status().is_success(), "{dry_run:?}");
    assert_clean("the dry run's answer", &dry_run.text().await.unwrap());
    tokio::time::sleep(Duration::from_secs(2)).await;

    let letter_page = format!("/dead-letters/letter/{letter}");
    let letter_api = format!("/api/dlq/letter/{letter}");
    for token in [ADMIN, VIEWER] {
        for path in [
            "/",
            "/fragment/fleet",
            "/dead-letters",
            letter_page.as_str(),
            "/audit",
            "/reconcile",
            "/fragment/jobs",
            "/api/me",
            "/api/fleet",
            "/api/fleet/history",
            "/api/dlq/groups",
            "/api/dlq/letters",
            letter_api.as_str(),
            "/api/audit",
            "/api/reconcile/runs",
            "/api/jobs",
        ] {
            let answer = http
                .get(format!("{origin}{path}"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap();
            let status = answer.status();
            let body = answer.text().await.unwrap();
            assert!(status.is_success(), "{path}: {status} {body}");
            assert_clean(&format!("the console's {path}"), &body);
        }
    }
    let audit = shardline_ops::audit::recent(&env.ops_fleet(), 100)
        .await
        .unwrap();
    assert!(!audit.is_empty(), "the release left no audit entry");
    assert_clean("the audit log", &format!("{audit:?}"));
    console.assert_running("the end of the console's checks");
    console.sigterm();
    console.wait_exit(STARTUP).await;
    assert_clean("the console's log", &console.log_text());
}

/// Every command's `--help` and `-h`, with every address in the environment.
async fn every_help_shows_no_canary(env: &TestEnv, canary: &Canary) {
    let mut commands: Vec<Vec<String>> = vec![vec![]];
    let mut seen = 0;
    while let Some(path) = commands.pop() {
        for flag in ["--help", "-h"] {
            let help = env
                .shardline_command()
                .env("SHARDLINE_AMQP_URL", &canary.amqp)
                .env("SHARDLINE_REDIS_URL", &canary.redis)
                .env("SHARDLINE_HANDLER", &canary.handler)
                .env("SHARDLINE_ORDERS_URL", &canary.orders)
                .env("OTEL_EXPORTER_OTLP_ENDPOINT", &canary.otlp)
                .env(
                    "SHARDLINE_MANAGEMENT_URL",
                    format!("http://guest:{CANARY}@127.0.0.1:15672/"),
                )
                .args(&path)
                .arg(flag)
                .output()
                .await
                .unwrap();
            assert!(help.status.success(), "{path:?}: {}", text(&help));
            assert_output_clean(&format!("{} {flag}", path.join(" ")), &help);
            let help = text(&help);
            assert!(!help.contains("guest:guest"), "{path:?} {flag}:\n{help}");
            if flag == "--help" {
                commands.extend(subcommands(&help).into_iter().map(|sub| {
                    let mut path = path.clone();
                    path.push(sub);
                    path
                }));
            }
            seen += 1;
        }
    }
    assert!(seen > 30, "only {seen} helps read");
}

/// The subcommands a help lists (`help` aside).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| !line.trim().is_empty())
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// Wrong addresses: errors name them redacted, at trace level too.
async fn wrong_addresses_show_no_canary(env: &TestEnv, canary: &Canary) {
    let bad_amqp = format!("amqp://guest:{CANARY}/x#y?z@127.0.0.1:5672/%2f");
    let good_redis = "redis://127.0.0.1:6379".to_owned();
    let management = |url: String| vec!["--management-url".to_owned(), url];
    let wrong: Vec<(String, String, Vec<String>)> = vec![
        (bad_amqp.clone(), good_redis.clone(), vec![]),
        (
            format!("amqp://guest:{CANARY}@127.0.0.1:5672/%2f"),
            good_redis.clone(),
            vec![],
        ),
        (
            format!("amqp://a:{CANARY}@127.0.0.1:1/%2f,{}", env.amqp_url),
            good_redis.clone(),
            vec![],
        ),
        (
            env.amqp_url.clone(),
            format!("redis://:{CANARY}/ss@127.0.0.1:6390"),
            vec![],
        ),
        (
            env.amqp_url.clone(),
            format!("redis://:{CANARY}@127.0.0.1:6379"),
            vec![],
        ),
        (
            env.amqp_url.clone(),
            format!("redis+sentinel://127.0.0.1:1/m?sentinel_password={CANARY}"),
            vec![],
        ),
        (
            env.amqp_url.clone(),
            good_redis.clone(),
            management(format!("http://guest:{CANARY}@127.0.0.1:15672/")),
        ),
        (
            env.amqp_url.clone(),
            good_redis.clone(),
            management(format!("http://guest:{CANARY}#x@127.0.0.1:15672/")),
        ),
    ];
    for (amqp, redis, extra) in &wrong {
        let out = env
            .shardline_command()
            .env("RUST_LOG", "trace")
            .args(["topology", "status"])
            .args(env.global_args_with(amqp, redis))
            .args(extra)
            .output()
            .await
            .unwrap();
        assert_output_clean(
            &format!("topology status with {amqp} {redis} {extra:?}"),
            &out,
        );
    }

    // OTLP endpoints that do not parse, or name no collector.
    for otlp in [
        format!("http://otel:{CANARY}/x@127.0.0.1:1"),
        format!("http://otel:{CANARY}@[::1"),
        canary.otlp.clone(),
    ] {
        let out = env
            .shardline_command()
            .env("RUST_LOG", "trace")
            .env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &otlp)
            .args(["topology", "status"])
            .args(env.global_args())
            .output()
            .await
            .unwrap();
        assert_output_clean(&format!("topology status exporting to {otlp}"), &out);
    }

    // Wrong PostgreSQL URLs and key=value strings.
    for orders in [
        format!("postgres://postgres:{CANARY}/x@127.0.0.1:5432/test"),
        format!("postgres://postgres:{CANARY}@127.0.0.1:1/test"),
        format!("postgres://127.0.0.1:1/test?user=postgres&password={CANARY}"),
        format!("host=127.0.0.1 port=1 user=postgres password='{CANARY} x' dbname=test"),
        format!("host=127.0.0.1 port=1 password = \"{CANARY}\" dbname=test"),
        format!("host=127.0.0.1 port=1 password='{CANARY}"),
    ] {
        let out = env
            .shardline_command()
            .env("RUST_LOG", "trace")
            .args(["reconcile", "--orders-url", &orders, "--dry-run"])
            .args(env.global_args())
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{orders}: {}", text(&out));
        assert_output_clean(&format!("reconcile --orders-url {orders}"), &out);
    }
}

/// `{:?}` of every configuration that holds an address.
fn configurations_show_no_canary(env: &TestEnv, canary: &Canary) {
    let management: shardline_connect::management::ManagementTarget =
        format!("http://guest:{CANARY}@127.0.0.1:15672/")
            .parse()
            .unwrap();
    let mut worker = env.worker_config("secrets");
    worker.amqp = canary.amqp.parse().unwrap();
    worker.redis = canary.redis.parse().unwrap();
    worker.management = Some(management.clone());
    assert_clean("the worker's Config", &format!("{worker:?}"));
    let fleet = shardline_ops::Fleet {
        amqp: canary.amqp.parse().unwrap(),
        redis: canary.redis.parse().unwrap(),
        management: Some(management),
        ..env.ops_fleet()
    };
    assert_clean("the operator tools' Fleet", &format!("{fleet:?}"));
    let publisher = shardline_publisher::Config {
        amqp: canary.amqp.parse().unwrap(),
        ..shardline_publisher::Config::default()
    };
    assert_clean("the publisher's Config", &format!("{publisher:?}"));
    let reconcile = shardline_ops::ReconcileConfig {
        orders_url: canary.orders.clone(),
        ..shardline_ops::ReconcileConfig::default()
    };
    assert_clean("the ReconcileConfig", &format!("{reconcile:?}"));
    let console = shardline_console::Config {
        reconcile: Some(reconcile),
        ..shardline_console::Config::default()
    };
    assert_clean("the console's Config", &format!("{console:?}"));
    let handler = shardline_worker::handler::Http::new(&canary.handler).unwrap();
    assert_clean("the HTTP handler", &format!("{handler:?}"));
}
