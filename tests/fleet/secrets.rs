//! One redaction (docs/operating/publishing.md, "Passwords in addresses"): a canary password in every
//! URL and connection string the product takes — the HTTP handler's, wrong
//! AMQP, Redis, management and PostgreSQL ones, some with reserved characters
//! typed raw — reaches no output: the worker's log at `RUST_LOG=trace`
//! (lapin's, redis', reqwest's and tokio-postgres' own lines included), the
//! commands' errors, `worker --help` with the variables set, `dlq list`,
//! `dlq show`, `--json`, `topology status --json`, the metrics text and the
//! dead letter's headers.

use std::process::Output;

use shardline_testkit::dlq::{ids, list_json, peek_all, run_ok, text, wait_depth};
use shardline_testkit::metrics::{free_addr, get};
use shardline_testkit::{
    ChildWorker, Downstream, Event, PROCESSING, Publisher, Reply, STARTUP, TestEnv,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_password_reaches_no_output() {
    let env = TestEnv::new("secrets").await;
    env.apply_topology().await;
    let conn = env.connect().await;

    // The handler's URL carries the canary; the downstream refuses every
    // event (400: the event's fault), so a letter is dead-lettered.
    let downstream = Downstream::scripted(|_, _| Reply::status(400)).await;
    let handler = format!("http://user:{CANARY}@{}/events", downstream.addr);
    let metrics = free_addr();
    let metrics_text = metrics.to_string();
    let mut cmd = env.shardline_command();
    cmd.env("RUST_LOG", "trace")
        .arg("worker")
        .args(env.global_args())
        .args(["--handler", &handler, "--worker-name", "secrets"])
        .args(["--metrics-addr", &metrics_text]);
    let mut worker = ChildWorker::spawn(&env, "secrets", cmd);
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

    let list = list_json(&env, &[]).await;
    assert_clean("dlq list --json", &list.to_string());
    let id = ids(&list).into_iter().next().expect("one dead letter");
    for args in [
        vec!["dlq", "list"],
        vec!["dlq", "show", id.as_str()],
        vec!["topology", "status", "--json"],
    ] {
        let out = run_ok(&env, &args).await;
        assert_output_clean(&args.join(" "), &out);
    }

    // `worker --help` with every URL in the environment.
    let bad_amqp = format!("amqp://guest:{CANARY}/x#y?z@127.0.0.1:5672/%2f");
    let help = env
        .shardline_command()
        .env("SHARDLINE_HANDLER", &handler)
        .env("SHARDLINE_AMQP_URL", &bad_amqp)
        .env(
            "SHARDLINE_REDIS_URL",
            format!("redis://:{CANARY}@127.0.0.1:6379"),
        )
        .env(
            "SHARDLINE_MANAGEMENT_URL",
            format!("http://guest:{CANARY}@127.0.0.1:15672/"),
        )
        .args(["worker", "--help"])
        .output()
        .await
        .unwrap();
    assert!(help.status.success(), "{}", text(&help));
    assert_output_clean("worker --help", &help);

    // Wrong addresses: errors name them redacted, at trace level too.
    let good_redis = "redis://127.0.0.1:6379".to_owned();
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
            vec![
                "--management-url".into(),
                format!("http://guest:{CANARY}@127.0.0.1:15672/"),
            ],
        ),
        (
            env.amqp_url.clone(),
            good_redis.clone(),
            vec![
                "--management-url".into(),
                format!("http://guest:{CANARY}#x@127.0.0.1:15672/"),
            ],
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

    // The worker's own log at trace level, after all of it.
    worker.assert_running("the end of the test");
    assert_clean("the worker's log", &worker.log_text());
    worker.sigterm();
    worker.wait_exit(STARTUP).await;
    assert_clean("the worker's log", &worker.log_text());
}
