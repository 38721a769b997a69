//! Backlog ages stand on what the worker saw (docs/semantics.md §5): a
//! publisher's `x-published-at-ms` later than the worker received the event
//! is ignored, and an earlier one pages only as `publisher-claimed`. The
//! broker here (RabbitMQ 3.10) does not stamp messages, so the stamp probe
//! trusts none.

use std::time::{Duration, Instant, SystemTime};

use shardline_contract::headers::{event_properties, new_traceparent};
use shardline_testkit::{Downstream, Event, Publisher, STARTUP, TestEnv, wait_until};

/// Runs `topology status` (`--json` when `json`): exit code and what it printed.
async fn topology_status(env: &TestEnv, json: bool) -> (Option<i32>, String) {
    let args: &[&str] = if json {
        &["topology", "status", "--json"]
    } else {
        &["topology", "status"]
    };
    let out = env.cli(args).await;
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Seq 2 of a new order, published with `x-published-at-ms` set to `at`:
/// the gate holds it, waiting for seq 1.
async fn publish_held(env: &TestEnv, publisher: &Publisher, order: &str, at: SystemTime) -> u16 {
    let event = Event::new(order, 2, env.shards);
    let props = event_properties(&event.key(), at, &new_traceparent());
    publisher
        .publish_with(event.shard, &event.body, props)
        .await;
    event.shard
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publishers_stamp_moves_the_backlog_age_only_as_a_labelled_claim() {
    let env = TestEnv::new("stamps").await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    // Seq 1 never comes: the held events stay held for the whole test.
    let worker = env
        .start_worker("stamps", &downstream, |c| {
            c.start_grace = Duration::from_secs(600);
            c.gap_grace = Duration::from_secs(600);
        })
        .await;
    let publisher = Publisher::connect(&env).await;
    let hour = Duration::from_secs(3600);

    // An hour ahead: ignored, the age counts from the receipt.
    let published = Instant::now();
    let ahead = "STAMP-AHEAD-1";
    let shard = usize::from(publish_held(&env, &publisher, ahead, SystemTime::now() + hour).await);
    worker.wait_held(1).await;
    let line = wait_until(
        "topology status to show the held event's age from its receipt",
        STARTUP,
        || async {
            let (code, out) = topology_status(&env, true).await;
            let json: serde_json::Value =
                serde_json::from_str(&out).map_err(|e| format!("{e}: {out}"))?;
            let line = json["shards"][shard].clone();
            let counted = line["held_events"] == 1
                && line["backlog_age_seconds"]
                    .as_f64()
                    .is_some_and(|a| a > 0.0);
            if counted && code == Some(0) {
                Ok(line)
            } else {
                Err(format!("exit {code:?}: {line}"))
            }
        },
    )
    .await;
    let seen = published.elapsed().as_secs_f64();
    assert!(
        line["backlog_age_seconds"].as_f64().unwrap() <= seen,
        "no older than the {seen:.1}s since it was published: {line}"
    );
    assert_eq!(line["backlog_age_source"], "received", "{line}");
    assert_eq!(line["level"], "OK", "{line}");
    assert_eq!(line["level_label"], serde_json::Value::Null, "{line}");

    // An hour behind, on another shard: a PAGE, labelled, exiting 3.
    let behind = (0..)
        .map(|i| format!("STAMP-BEHIND-{i}"))
        .find(|id| usize::from(env.shard_of(id)) != shard)
        .unwrap();
    let paged =
        usize::from(publish_held(&env, &publisher, &behind, SystemTime::now() - hour).await);
    worker.wait_held(2).await;
    let table = wait_until(
        "topology status to page on the publisher's claim and exit 3",
        STARTUP,
        || async {
            let (code, table) = topology_status(&env, false).await;
            if code == Some(3) && table.contains("PAGE (publisher-claimed): shard(s)") {
                Ok(table)
            } else {
                Err(format!("exit {code:?}:\n{table}"))
            }
        },
    )
    .await;
    assert!(
        table.contains(&format!(
            "PAGE (publisher-claimed): shard(s) {paged} behind"
        )),
        "{table}"
    );
    assert!(
        !table.contains("PAGE: shard(s)"),
        "nothing the worker saw pages:\n{table}"
    );
    let (code, out) = topology_status(&env, true).await;
    assert_eq!(code, Some(3), "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    let line = &json["shards"][paged];
    assert_eq!(line["level"], "PAGE", "{line}");
    assert_eq!(line["level_label"], "publisher-claimed", "{line}");
    assert_eq!(line["backlog_age_source"], "publisher", "{line}");
    assert!(
        line["backlog_age_seconds"].as_f64().unwrap() >= 3000.0,
        "the claimed hour: {line}"
    );
    assert_eq!(
        json["shards"][shard]["level_label"],
        serde_json::Value::Null
    );
    assert_eq!(downstream.calls().len(), 0, "nothing was released");
}
