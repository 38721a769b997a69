//! The broker probe with `--management-url`, on a private node with the
//! management plugin: the policies in effect on the shard queues, which AMQP
//! cannot show, are read and judged. A policy whose delivery limit is below
//! the workers' `--delivery-limit` (the broker would dead-letter before the
//! worker counts) refuses the worker in one line; so does a TTL that would
//! expire events.

use shardline_testkit::{BrokerNode, QueueType, TestEnv, wait_until};

/// `topology status --json`'s broker findings about `topic`, as text lines.
async fn findings(env: &TestEnv, management: &str, topic: &str) -> Vec<String> {
    let mut cmd = env.shardline_command();
    cmd.args([
        "topology",
        "status",
        "--json",
        "--management-url",
        management,
    ])
    .args(env.global_args());
    let out = cmd.output().await.unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&out.stderr));
    });
    json["broker"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["topic"] == topic)
        .map(|f| format!("{} {} [{}]", f["verdict"], f["text"], f["source"]))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn policies_seen_through_the_management_api_refuse_a_worker_they_would_undercut() {
    let node = BrokerNode::start_with_management().await;
    let management = node.management_url();
    let env = TestEnv::on_node("probe-policies", QueueType::Quorum, &node).await;
    env.apply_topology().await;

    let clean = findings(&env, &management, "policies").await;
    assert!(
        clean.len() == 1 && clean[0].starts_with("\"ok\"") && clean[0].contains("0 with a policy"),
        "{clean:?}"
    );
    assert!(
        clean[0].contains("management API http://guest:***@127.0.0.1:"),
        "{clean:?}"
    );

    let seen = set_policy(
        &env,
        &management,
        r#"{"delivery-limit": 5}"#,
        "\"warn\"",
        "delivery-limit 5",
    )
    .await;
    assert!(
        seen.contains("`shop-wide`"),
        "status has no --delivery-limit to judge by: {seen}"
    );

    let worker = |extra: &[&str]| {
        let mut cmd = env.shardline_command();
        cmd.args(["worker", "--handler", "noop", "--delivery-limit", "20"])
            .args(extra)
            .args(env.global_args());
        async move { cmd.output().await.unwrap() }
    };
    let out = worker(&["--management-url", &management]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].contains("delivery-limit 5 is below --delivery-limit 20")
            && errors[0].contains("`shop-wide`")
            && errors[0].contains(&env.shard_queue(0)),
        "{stderr}"
    );
    assert!(
        !stderr.contains("guest:guest"),
        "the password printed: {stderr}"
    );

    set_policy(
        &env,
        &management,
        r#"{"message-ttl": 60000}"#,
        "\"refuse\"",
        "message-ttl 60000",
    )
    .await;
}

/// Sets the policy `shop-wide` on the shard queues to `definition` and waits
/// until `topology status` reports a `policies` finding with `verdict` that
/// mentions `seen` (policies apply asynchronously); returns that finding.
async fn set_policy(
    env: &TestEnv,
    management: &str,
    definition: &str,
    verdict: &str,
    seen: &str,
) -> String {
    let pattern = format!("^{}", regex_escape(&env.names.queue_prefix));
    env.broker()
        .run(&[
            "set_policy",
            "-p",
            &env.vhost,
            "--apply-to",
            "queues",
            "shop-wide",
            &pattern,
            definition,
        ])
        .await;
    wait_until(
        &format!("the policy {definition} applies"),
        std::time::Duration::from_secs(30),
        || async {
            let found = findings(env, management, "policies").await;
            match found
                .iter()
                .find(|l| l.starts_with(verdict) && l.contains(seen))
            {
                Some(line) => Ok(line.clone()),
                None => Err(format!("{found:?}")),
            }
        },
    )
    .await
}

/// `s` with the regex metacharacters a queue prefix may hold escaped.
fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '.' | '*' | '+' | '?' | '(' | ')' | '[' | ']' | '{' | '}' | '|' | '^' | '$' | '\\' => {
                vec!['\\', c]
            }
            c => vec![c],
        })
        .collect()
}
