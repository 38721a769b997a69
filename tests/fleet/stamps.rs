//! Backlog ages stand on what the worker saw (docs/semantics.md §5): a
//! publisher's `x-published-at-ms` later than the worker received the event
//! is ignored, and an earlier one pages only as `publisher-claimed`. The
//! test broker does not stamp messages, so the stamp probe trusts none. A
//! broker that does (RabbitMQ 3.12+ with
//! `message_interceptors.incoming.set_header_timestamp.overwrite = true`) is
//! trusted: backlog ages count from its stamps, whatever a publisher claims.

use std::time::{Duration, Instant, SystemTime};

use shardline_contract::Version;
use shardline_contract::headers::{event_properties, new_traceparent};
use shardline_testkit::{
    BrokerNode, ChildWorker, Downstream, Event, Publisher, QueueType, STARTUP, TestEnv, wait_until,
};

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

/// `topology status --json`'s exit code and its line for `shard`.
async fn shard_status(
    env: &TestEnv,
    shard: usize,
) -> Result<(Option<i32>, serde_json::Value), String> {
    let (code, out) = topology_status(env, true).await;
    let json: serde_json::Value = serde_json::from_str(&out).map_err(|e| format!("{e}: {out}"))?;
    Ok((code, json["shards"][shard].clone()))
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
    // Counted from its receipt: above zero, and never older than the time
    // since it was published (an hour's claim would show as an hour). A
    // line older than that is read again (under a loaded suite one was
    // seen once, 3 s over, and not since); one that stays so fails here.
    let line = wait_until(
        "topology status to show the held event's age from its receipt",
        STARTUP,
        || async {
            let (code, line) = shard_status(&env, shard).await?;
            let seen = published.elapsed().as_secs_f64();
            let counted = line["held_events"] == 1
                && line["backlog_age_seconds"]
                    .as_f64()
                    .is_some_and(|a| a > 0.0 && a <= seen);
            if counted && code == Some(0) {
                Ok(line)
            } else {
                Err(format!("exit {code:?}, published {seen:.1} s ago: {line}"))
            }
        },
    )
    .await;
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

/// What makes a broker stamp every message (RabbitMQ 3.12 and later).
const STAMPING: &str = "message_interceptors.incoming.set_header_timestamp.overwrite = true";

/// The broker-stamp branch: on a node that overwrites `timestamp_in_ms`, the
/// worker's probe trusts the broker's stamps and a held event's age counts
/// from the broker's stamp, not from the hour-old claim its publisher made
/// (`backlog_age_source` `broker`, no PAGE). RabbitMQ before 3.12 cannot
/// stamp (the setting does not exist): there the test checks that the
/// probe finds no stamp, the branch the other test of this file runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_stamps_every_message_is_trusted_for_backlog_ages() {
    let probe = TestEnv::new("stamps-probe").await;
    if probe.broker_version().await < Version::new(3, 12, 0) {
        let conn = probe.connect().await;
        let stamps = shardline_connect::stamps::broker_stamps(&conn)
            .await
            .unwrap();
        assert!(
            !stamps,
            "RabbitMQ {} cannot stamp, yet the probe trusted it",
            probe.broker_version().await
        );
        return;
    }
    let node = BrokerNode::start_configured(&[STAMPING]).await;
    let env = TestEnv::on_node("stamps-broker", QueueType::Classic, &node).await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    // A process of its own: the probe's verdict is the process's.
    let mut worker = ChildWorker::start(
        &env,
        "stamped",
        &downstream.url(),
        &["--start-grace", "600s", "--gap-grace", "600s"],
    );
    worker.wait_consuming(&env).await;
    wait_until(
        "the worker to trust the broker's stamps",
        STARTUP,
        || async {
            let log = worker.log_text();
            if log.contains("the broker stamps every message") {
                Ok(())
            } else {
                Err(worker.log_tail(5))
            }
        },
    )
    .await;
    let publisher = Publisher::connect(&env).await;
    let hour = Duration::from_secs(3600);
    let published = Instant::now();
    let shard = usize::from(
        publish_held(&env, &publisher, "STAMP-BROKER-1", SystemTime::now() - hour).await,
    );
    let line = wait_until(
        "topology status to count the held event's age from the broker's stamp",
        STARTUP,
        || async {
            let (code, line) = shard_status(&env, shard).await?;
            if line["held_events"] == 1 && line["backlog_age_source"] == "broker" {
                Ok((code, line))
            } else {
                Err(format!("exit {code:?}: {line}"))
            }
        },
    )
    .await;
    let (code, line) = line;
    let seen = published.elapsed().as_secs_f64();
    assert!(
        line["backlog_age_seconds"].as_f64().unwrap() <= seen,
        "no older than the {seen:.1}s since it was published, whatever the publisher claimed: {line}"
    );
    assert_eq!(line["level"], "OK", "{line}");
    assert_eq!(code, Some(0), "{line}");
    worker.assert_running("after the probe");
}
