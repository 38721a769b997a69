//! Observability: `/metrics` backlog age and levels behind a slow downstream,
//! `/healthz` and `/readyz`, a `--metrics-addr` already in use, and
//! `topology status` (owner, backlog, exit code 3 at PAGE, DLQ by reason).

use std::time::Duration;

use shardline_testkit::metrics::{free_addr, get, sample, wait_metrics, wait_ok};
use shardline_testkit::{
    ChildWorker, Downstream, Event, PROCESSING, Publisher, Reply, STARTUP, TestEnv, wait_until,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_age_rises_past_warn_behind_a_slow_downstream_then_falls_to_zero() {
    let env = TestEnv::new("obs-backlog").await;
    env.apply_topology().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(250))).await;
    let addr = free_addr();
    let mut worker = env
        .start_worker("obs-backlog", &downstream, |c| {
            c.metrics_addr = Some(addr);
            c.backlog.warn = Duration::from_secs(1);
            c.backlog.page = Duration::from_secs(60);
        })
        .await;

    // One order, so one shard: 12 events of 250 ms each queue up behind each other.
    let order = "OBS-BACKLOG-1";
    let shard = env.shard_of(order);
    let events: Vec<Event> = (1..=12)
        .map(|seq| Event::new(order, seq, env.shards))
        .collect();
    Publisher::connect(&env).await.publish(&events).await;

    let on = format!("shard=\"{shard}\"");
    let behind = wait_metrics(
        addr,
        "backlog age past the 1 s warn threshold at level 1",
        PROCESSING,
        || assert!(!worker.has_ended(), "{}", worker.describe()),
        |m| {
            sample(m, "shardline_backlog_age_seconds", &on) >= 1.0
                && sample(m, "shardline_backlog_level", &on) == 1.0
        },
    )
    .await;
    assert_eq!(sample(&behind, "shardline_shard_active", &on), 1.0);
    assert!(sample(&behind, "shardline_inflight_seconds", &on) > 0.0);
    assert_eq!(sample(&behind, "shardline_stuck", &on), 0.0);
    for other in (0..shardline_testkit::SHARDS).filter(|s| *s != shard) {
        let labels = format!("shard=\"{other}\"");
        assert_eq!(
            sample(&behind, "shardline_backlog_age_seconds", &labels),
            0.0,
            "shard {other} has nothing to do"
        );
    }

    let processed = format!("shard=\"{shard}\",outcome=\"processed\"");
    let drained = wait_metrics(
        addr,
        "all 12 events processed and the backlog back to 0",
        PROCESSING,
        || assert!(!worker.has_ended(), "{}", worker.describe()),
        |m| {
            sample(m, "shardline_events_total", &processed) == 12.0
                && sample(m, "shardline_backlog_age_seconds", &on) == 0.0
                && sample(m, "shardline_backlog_level", &on) == 0.0
        },
    )
    .await;
    let calls = downstream.calls();
    assert_eq!(calls.len(), 12, "{}", shardline_testkit::describe(&calls));
    for (outcome, expected) in [("duplicate", 0.0), ("retried", 0.0), ("dead_lettered", 0.0)] {
        let labels = format!("shard=\"{shard}\",outcome=\"{outcome}\"");
        assert_eq!(
            sample(&drained, "shardline_events_total", &labels),
            expected,
            "{outcome}"
        );
    }
    assert_eq!(
        sample(&drained, "shardline_handler_attempts_total", &on),
        12.0
    );
    assert_eq!(
        sample(&drained, "shardline_processing_seconds_count", &on),
        12.0
    );
    assert!(sample(&drained, "shardline_processing_seconds_sum", &on) >= 12.0 * 0.25);
    assert_eq!(sample(&drained, "shardline_inflight_seconds", &on), 0.0);
    worker.assert_running().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_readiness_endpoints_and_a_metrics_port_in_use() {
    let env = TestEnv::new("obs-health").await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let addr = free_addr();
    let _worker = env
        .start_worker("obs-health", &downstream, |c| c.metrics_addr = Some(addr))
        .await;

    let ready = wait_ok(addr, "/readyz", STARTUP).await;
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(ready["ready"], true, "{ready}");
    assert_eq!(ready["broker"], "connected", "{ready}");
    assert_eq!(ready["redis"], "reachable", "{ready}");
    let consuming = ready["shards"]["consuming"].as_array().unwrap();
    assert_eq!(
        consuming.len(),
        usize::from(shardline_testkit::SHARDS),
        "{ready}"
    );

    let (status, body) = get(addr, "/healthz").await.expect("/healthz answers");
    assert_eq!(status, 200, "{body}");
    let (status, _) = get(addr, "/nothing").await.unwrap();
    assert_eq!(status, 404);

    // A second worker on the same address fails at start, naming the flag: a
    // process, since its exit code and error line are the CLI's.
    let addr_text = addr.to_string();
    let mut second = ChildWorker::start(
        &env,
        "obs-health-2",
        &downstream.url(),
        &["--metrics-addr", &addr_text],
    );
    let exit = second.wait_exit(STARTUP).await;
    assert_eq!(exit.code(), Some(1), "{}", second.log_tail(20));
    let log = second.log_text();
    assert!(
        log.contains(&format!("--metrics-addr {addr}: address in use")),
        "expected the flag named in the error:\n{log}"
    );
    // The first one is unaffected.
    assert_eq!(get(addr, "/healthz").await.map(|r| r.0), Some(200));
}

/// Runs `topology status --json` with `flags`: exit code and the JSON.
async fn topology_status(env: &TestEnv, flags: &[&str]) -> (Option<i32>, serde_json::Value) {
    let mut args = vec!["topology", "status", "--json"];
    args.extend_from_slice(flags);
    let out = env.cli(&args).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "`topology status --json` printed no JSON ({e}), exit {}:\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), json)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_status_reports_owner_and_backlog_and_exits_3_at_page() {
    let env = TestEnv::new("obs-status").await;
    env.apply_topology().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(1500))).await;
    let mut worker = env.start_worker("obs-status", &downstream, |_| {}).await;

    let order = "OBS-STATUS-1";
    let shard = usize::from(env.shard_of(order));
    let events: Vec<Event> = (1..=4)
        .map(|seq| Event::new(order, seq, env.shards))
        .collect();
    let publisher = Publisher::connect(&env).await;
    publisher.publish(&events).await;
    // One poison body on another shard: a `decode` dead letter to count by reason.
    let other = (env.shard_of(order) + 1) % shardline_testkit::SHARDS;
    publisher.publish_raw(other, b"\xff not json").await;

    let page = ["--backlog-warn", "500ms", "--backlog-page", "1s"];
    let stalled = wait_until(
        &format!("topology status to say PAGE for shard {shard} and exit 3"),
        PROCESSING,
        || {
            assert!(!worker.has_ended(), "worker died: {}", worker.describe());
            let env = &env;
            async move {
                let (code, json) = topology_status(env, &page).await;
                if code == Some(3) && json["shards"][shard]["level"] == "PAGE" {
                    Ok(json)
                } else {
                    Err(format!("exit {code:?}:\n{json:#}"))
                }
            }
        },
    )
    .await;
    let line = &stalled["shards"][shard];
    assert_eq!(line["owner"], "obs-status", "{line}");
    assert!(
        line["backlog_age_seconds"].as_f64().unwrap() >= 1.0,
        "{line}"
    );
    assert_eq!(line["consumers"], 1, "{line}");
    assert_eq!(stalled["needs_attention"], true);

    downstream
        .wait_for("every event answered", PROCESSING, |calls| {
            shardline_testkit::all_ok(calls, &events)
        })
        .await;
    let drained = wait_until(
        &format!("topology status to show shard {shard} drained and exit 0"),
        PROCESSING,
        || async {
            let (code, json) = topology_status(&env, &page).await;
            if code == Some(0) && json["shards"][shard]["backlog_age_seconds"] == 0.0 {
                Ok(json)
            } else {
                Err(format!("exit {code:?}:\n{json:#}"))
            }
        },
    )
    .await;
    for s in drained["shards"].as_array().unwrap() {
        assert_eq!(
            s["owner"], "obs-status",
            "every shard reports its owner: {s}"
        );
        assert_eq!(s["level"], "OK", "{s}");
    }
    let dlq = &drained["dead_letter_queue"];
    assert_eq!(dlq["messages"], 1, "{dlq}");
    assert_eq!(
        dlq["by_reason"],
        serde_json::json!({ "decode": 1 }),
        "{dlq}"
    );
    // Browsing requeued it: still there for the next look.
    let (_, again) = topology_status(&env, &page).await;
    assert_eq!(again["dead_letter_queue"]["messages"], 1, "{again}");
    assert_eq!(
        again["dead_letter_queue"]["by_reason"]["decode"], 1,
        "{again}"
    );
    worker.assert_running().await;
}
