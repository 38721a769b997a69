//! `shardline dlq list|show|replay|purge` against dead letters a real worker made:
//! listing leaves the DLQ as it was, replay after the fix delivers the event
//! once and leaves the rest, purge refuses without `--yes`; a replay killed
//! mid-way and run again delivers every dead letter exactly once, in order.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use shardline_testkit::dlq::{
    broker_dead_letter, delete_index, depth, ids, index_entry, index_groups, indexed, list_json,
    run_ok, text, wait_depth, wait_indexed,
};
use shardline_testkit::wait::check;
use shardline_testkit::{
    ChildWorker, Downstream, Event, PROCESSING, Publisher, Reply, TestEnv, all_ok,
    assert_exactly_once, assert_in_order_and_complete, interleaved, order_ids, wait_until,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_show_replay_purge() {
    let env = TestEnv::new("dlq").await;
    env.apply_topology().await;
    let conn = env.connect().await;

    let x: Vec<Event> = (1..=2)
        .map(|s| Event::new("dlq-x", s, env.shards))
        .collect();
    let x2 = x[1].key();
    let fixed = Arc::new(AtomicBool::new(false));
    let downstream = Downstream::failing_until_fixed(x2.clone(), Arc::clone(&fixed)).await;
    let mut worker = env.start_worker("w1", &downstream, |_| {}).await;

    let publisher = Publisher::connect(&env).await;
    publisher.publish(&x).await;
    publisher.publish_raw(x[0].shard, b"not json").await;
    downstream
        .wait_for("X seq 1 answered 2xx", PROCESSING, |calls| {
            all_ok(calls, &x[..1])
        })
        .await;
    wait_depth(&env, &conn, 2, PROCESSING).await;
    // Indexed right after the confirm that made the depth 2.
    wait_indexed(&env, 2, PROCESSING).await;

    // list: both letters, from the index; the DLQ exactly as before.
    let list = list_json(&env, &[]).await;
    assert_eq!(list["matched"], 2, "{list:#}");
    let letters = list["dead_letters"].as_array().unwrap();
    let handler = letters
        .iter()
        .find(|l| l["reason"] == "handler")
        .unwrap_or_else(|| panic!("no handler letter: {list:#}"));
    assert_eq!(handler["order_id"], "dlq-x", "{list:#}");
    assert_eq!(handler["seq"], 2, "{list:#}");
    assert_eq!(handler["attempts"], 1, "{list:#}");
    assert_eq!(handler["shard"], x[1].shard, "{list:#}");
    assert!(handler["age_seconds"].is_number(), "{list:#}");
    // One failure group per letter here; the old name of the groups still read.
    let groups = list["summary"]["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{list:#}");
    assert_eq!(list["summary"]["by_error"], list["summary"]["groups"]);
    let decode = letters
        .iter()
        .find(|l| l["reason"] == "decode")
        .unwrap_or_else(|| panic!("no decode letter: {list:#}"));
    assert_eq!(decode["order_id"], serde_json::Value::Null, "{list:#}");
    // The index entry the worker wrote with the letter.
    let entry = index_entry(&env, handler["id"].as_str().unwrap())
        .await
        .unwrap_or_else(|| panic!("no index entry: {list:#}"));
    assert_eq!(
        (entry.order_id.as_deref(), entry.seq, entry.kind.as_deref()),
        (Some("dlq-x"), Some(2), Some(x[1].event.as_str()))
    );
    assert_eq!(entry.shard, Some(x[1].shard));
    assert_eq!(entry.attempts, Some(1));
    assert_eq!(
        entry.trace_id.as_deref(),
        x[1].traceparent.split('-').nth(1),
        "the failed attempt's trace: {entry:?}"
    );
    assert!(entry.first_failed_ms > 0, "{entry:?}");
    assert_eq!(handler["group"], entry.group.as_str(), "{list:#}");
    let groups = index_groups(&env).await;
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert!(groups.values().all(|(_, count)| *count == 1), "{groups:?}");
    assert_eq!(list["reindex_needed"], false, "{list:#}");
    let by_reason = list["summary"]["by_reason"].as_array().unwrap();
    assert_eq!(by_reason.len(), 2, "{list:#}");
    assert!(by_reason.iter().all(|g| g["count"] == 1), "{list:#}");
    assert_eq!(depth(&env, &conn).await, 2, "list must not remove letters");
    let again = list_json(&env, &[]).await;
    assert_eq!(ids(&again), ids(&list), "list must keep the DLQ's order");
    let only_x = list_json(&env, &["--order-id", "dlq-x"]).await;
    assert_eq!(only_x["matched"], 1, "{only_x:#}");
    let table = run_ok(&env, &["dlq", "list"]).await;
    let table = String::from_utf8_lossy(&table.stdout).into_owned();
    assert!(
        table.contains("by reason:") && table.contains("handler"),
        "{table}"
    );

    // show: headers and body of one letter; an unknown id is an error.
    let handler_id = handler["id"].as_str().unwrap();
    let shown = run_ok(&env, &["dlq", "show", handler_id]).await;
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(
        shown.contains(&String::from_utf8_lossy(&x[1].body).into_owned()),
        "{shown}"
    );
    assert!(shown.contains("x-fail-reason: handler"), "{shown}");
    let missing = env.cli(&["dlq", "show", "no-such-letter"]).await;
    assert!(!missing.status.success(), "{}", text(&missing));
    assert_eq!(depth(&env, &conn).await, 2, "show must not remove letters");

    // replay --dry-run changes nothing.
    let dry = run_ok(&env, &["dlq", "replay", "--order-id", "dlq-x", "--dry-run"]).await;
    assert!(
        String::from_utf8_lossy(&dry.stdout).contains("would replay"),
        "{}",
        text(&dry)
    );
    assert_eq!(
        depth(&env, &conn).await,
        2,
        "a dry run must not remove letters"
    );

    // Fixed downstream: replay X; X seq 2 reaches it once, the decode letter stays.
    fixed.store(true, Ordering::SeqCst);
    let calls_before = downstream.calls().len();
    let replay = run_ok(&env, &["dlq", "replay", "--order-id", "dlq-x"]).await;
    // Audit: the replay is logged with its dead-letter id and the failed
    // attempt's trace id (the one its replay span links to).
    let log = String::from_utf8_lossy(&replay.stderr);
    let failed_trace = x[1].traceparent.split('-').nth(1).unwrap();
    assert!(
        log.lines().any(|line| line.contains("dead letter replayed")
            && line.contains(handler_id)
            && line.contains(&format!("linked_trace_id={failed_trace}"))),
        "{}",
        text(&replay)
    );
    assert!(
        String::from_utf8_lossy(&replay.stdout).contains("replayed 1 of 1"),
        "{}",
        text(&replay)
    );
    downstream
        .wait_for("the replayed X seq 2 answered 2xx", PROCESSING, |calls| {
            all_ok(calls, &x)
        })
        .await;
    // Acked, so settled: no further call can come.
    env.wait_shard_queues_drained(PROCESSING).await;
    let calls = downstream.calls();
    let x2_after: Vec<_> = calls[calls_before..]
        .iter()
        .filter(|c| c.key() == x2)
        .collect();
    assert_eq!(x2_after.len(), 1, "replay must call once: {x2_after:?}");
    assert_eq!(calls.len(), calls_before + 1, "only the replay: {calls:?}");
    assert_eq!(depth(&env, &conn).await, 1, "the decode letter stays");
    assert_eq!(
        indexed(&env).await,
        1,
        "the replayed letter's entry is removed"
    );
    assert!(index_entry(&env, handler_id).await.is_none());
    assert_eq!(index_groups(&env).await.len(), 1, "its group went with it");
    let rest = list_json(&env, &[]).await;
    assert_eq!(rest["dead_letters"][0]["reason"], "decode", "{rest:#}");

    // purge: refused without --yes (exit 2, nothing removed), done with it.
    let refused = env.cli(&["dlq", "purge", "--reason", "decode"]).await;
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert_eq!(depth(&env, &conn).await, 1);
    let purged = run_ok(&env, &["dlq", "purge", "--reason", "decode", "--yes"]).await;
    assert!(
        String::from_utf8_lossy(&purged.stdout).contains("purged 1"),
        "{}",
        text(&purged)
    );
    assert_eq!(depth(&env, &conn).await, 0);
    assert_eq!(
        indexed(&env).await,
        0,
        "the purged letter's entry is removed"
    );
    assert!(index_groups(&env).await.is_empty());
    worker.assert_running().await;
}

/// ~200 dead letters (4 orders × 50 events, all answered 422 until the fix);
/// `dlq replay --rate 50` is SIGKILLed once some letters reached the fixed
/// downstream, then `dlq replay` runs to completion: each letter reached the
/// downstream exactly once (a republished-but-unacked letter is absorbed by
/// dedup), per order in seq order, and the DLQ is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_killed_midway_then_resumed_delivers_each_letter_once() {
    const ORDERS: usize = 4;
    const PER_ORDER: u64 = 50;
    const TOTAL: usize = ORDERS * PER_ORDER as usize;
    let env = TestEnv::new("dlq-kill").await;
    env.apply_topology().await;
    let conn = env.connect().await;

    let events = interleaved(&order_ids("dlq-kill", ORDERS), PER_ORDER, env.shards);
    let fixed = Arc::new(AtomicBool::new(false));
    let downstream = {
        let fixed = Arc::clone(&fixed);
        Downstream::scripted(move |_, _| {
            if fixed.load(Ordering::SeqCst) {
                Reply::ok()
            } else {
                Reply::status(422)
            }
        })
        .await
    };
    let mut worker = env.start_worker("w1", &downstream, |_| {}).await;
    Publisher::connect(&env).await.publish(&events).await;
    wait_depth(&env, &conn, u32::try_from(TOTAL).unwrap(), PROCESSING).await;

    // Fixed downstream; a paced replay, killed once some letters got through.
    fixed.store(true, Ordering::SeqCst);
    let calls_before = downstream.calls().len();
    let mut cmd = env.shardline_command();
    cmd.args(["dlq", "replay", "--rate", "50"])
        .args(env.global_args());
    let mut first = ChildWorker::spawn(&env, "replay", cmd);
    downstream
        .wait_for("20 replayed letters answered", PROCESSING, |calls| {
            calls[calls_before..].iter().filter(|c| c.ok()).count() >= 20
        })
        .await;
    assert!(
        first.exited().is_none(),
        "the paced replay finished before it could be killed"
    );
    first.kill9();
    let status = first.wait_exit(PROCESSING).await;
    assert!(!status.success(), "killed replay exited {status}");
    let at_kill = downstream.calls().len() - calls_before;
    assert!(at_kill < TOTAL, "all {at_kill} replayed before the kill");

    // The broker returns the killed replay's unacked letters to the DLQ.
    wait_until(
        "the DLQ without unacked letters after the kill",
        PROCESSING,
        || async {
            let depths = env.queue_depths().await;
            let dlq = depths.get(&env.names.dead_letter_queue).copied();
            check(dlq.is_some_and(|(_, unacked)| unacked == 0), || {
                format!("depths {depths:?}")
            })
        },
    )
    .await;
    let left = depth(&env, &conn).await;
    assert!(
        left > 0 && (left as usize) < TOTAL,
        "{left} letters left after the kill"
    );

    // Run again, to completion.
    let second = run_ok(&env, &["dlq", "replay"]).await;
    let summary = format!("replayed {left} of {left} matching");
    assert!(
        String::from_utf8_lossy(&second.stdout).contains(&summary),
        "{}",
        text(&second)
    );
    downstream
        .wait_for("every replayed letter answered 2xx", PROCESSING, |calls| {
            all_ok(&calls[calls_before..], &events)
        })
        .await;
    // Acked, so settled: no further call can come.
    env.wait_shard_queues_drained(PROCESSING).await;
    let calls = downstream.calls();
    let replayed = &calls[calls_before..];
    assert_exactly_once(replayed, &events);
    assert_in_order_and_complete(replayed, &events);
    assert_eq!(depth(&env, &conn).await, 0, "the DLQ must be empty");
    worker.assert_running().await;
}

/// The index the worker writes is the one `dlq reindex` rebuilds: 6 letters
/// of one cause (3 orders × 2 events answered 422), a decode letter and one
/// the broker dead-lettered itself (no `x-dead-letter-id`, not indexed until
/// a reindex). A DLQ deeper than its index says "reindex needed" in
/// `dlq list` and `topology status`; after deleting the environment's index
/// keys (its prefix only), `dlq reindex` rebuilds the same groups, the broker's
/// letter in a group of its own, and leaves the DLQ as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_reindex_rebuilds_the_groups_the_worker_wrote() {
    let env = TestEnv::new("dlq-reindex").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let events = interleaved(&order_ids("dlq-ri", 3), 2, env.shards);
    let downstream = Downstream::scripted(|_, _| Reply::status(422)).await;
    let mut worker = env.start_worker("w1", &downstream, |_| {}).await;
    let publisher = Publisher::connect(&env).await;
    publisher.publish(&events).await;
    publisher.publish_raw(events[0].shard, b"not json").await;
    wait_depth(&env, &conn, 7, PROCESSING).await;
    wait_indexed(&env, 7, PROCESSING).await;
    let written = index_groups(&env).await;
    let counts: Vec<u64> = written.values().map(|(_, n)| *n).collect();
    assert_eq!(counts.iter().sum::<u64>(), 7, "{written:?}");
    assert!(counts.contains(&6), "one group for the 422s: {written:?}");
    assert!(
        written
            .values()
            .any(|(d, n)| *n == 6 && d == "handler\ndownstream answered 422"),
        "{written:?}"
    );

    broker_dead_letter(&env, &conn, &events[0].body).await;
    wait_depth(&env, &conn, 8, PROCESSING).await;
    let list = list_json(&env, &[]).await;
    assert_eq!(list["reindex_needed"], true, "{list:#}");
    assert_eq!(
        (list["indexed"].as_u64(), list["dlq_depth"].as_u64()),
        (Some(7), Some(8))
    );
    let status = run_ok(&env, &["topology", "status", "--json"]).await;
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        status["dead_letter_queue"]["reindex_needed"], true,
        "{status:#}"
    );
    let table = run_ok(&env, &["topology", "status"]).await;
    assert!(
        String::from_utf8_lossy(&table.stdout).contains("reindex needed"),
        "{}",
        text(&table)
    );

    // A Redis loss of the index: rebuilt from the queue.
    delete_index(&env).await;
    assert_eq!(indexed(&env).await, 0);
    let out = run_ok(&env, &["dlq", "reindex"]).await;
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("reindexed 8 dead letter(s) of 8 read (1 without a dead-letter id"),
        "{}",
        text(&out)
    );
    let rebuilt = index_groups(&env).await;
    let broker_groups: Vec<_> = rebuilt
        .iter()
        .filter(|(id, _)| !written.contains_key(*id))
        .collect();
    assert_eq!(broker_groups.len(), 1, "{rebuilt:?}");
    assert!(
        broker_groups[0].1.0.starts_with("delivery-limit\n"),
        "{rebuilt:?}"
    );
    let mut without_broker = rebuilt.clone();
    without_broker.retain(|id, _| written.contains_key(id));
    assert_eq!(without_broker, written, "the same groups, the same counts");
    let list = list_json(&env, &[]).await;
    assert_eq!(list["reindex_needed"], false, "{list:#}");
    assert_eq!(
        depth(&env, &conn).await,
        8,
        "reindex must not remove letters"
    );

    // Again, over an entry written with another group (as by a release that
    // normalised errors differently): the same index, the stale group gone.
    let some = ids(&list_json(&env, &["--limit", "1"]).await).remove(0);
    let stale = "000000000000";
    let keys = env.keys();
    let mut redis = env.redis().await;
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg(keys.dlq_letter(&some))
        .arg("group")
        .arg(stale)
        .cmd("ZADD")
        .arg(keys.dlq_group(stale))
        .arg(1)
        .arg(&some)
        .cmd("HSET")
        .arg(keys.dlq_groups())
        .arg(stale)
        .arg("handler\nold text")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(index_groups(&env).await.contains_key(stale));
    run_ok(&env, &["dlq", "reindex"]).await;
    assert_eq!(index_groups(&env).await, rebuilt);
    assert_eq!(indexed(&env).await, 8);
    worker.assert_running().await;
}

/// A letter full of what a terminal would obey — escape sequences that
/// retitle and clear it, a bell, a carriage return, a bidi override — in its
/// order id, its body and a header: `dlq list` and `dlq show` print their
/// escapes, never an ESC or BEL byte, and `--json` still carries the exact text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_and_show_print_escapes_not_escape_sequences() {
    const HOSTILE: &str = "\u{1b}]0;pwned\u{7}\u{1b}[2J\r\u{202e}";
    let env = TestEnv::new("dlq-terminal").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let downstream = Downstream::start().await;
    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let order = format!("term{HOSTILE}");
    let body = serde_json::json!({"order_id": order, "event": "e", "seq": 1, "note": HOSTILE});
    let mut headers = lapin::types::FieldTable::default();
    headers.insert(
        "x-note".into(),
        lapin::types::AMQPValue::LongString(HOSTILE.into()),
    );
    let props = lapin::BasicProperties::default().with_headers(headers);
    Publisher::connect(&env)
        .await
        .publish_with(0, body.to_string().as_bytes(), props)
        .await;
    wait_depth(&env, &conn, 1, PROCESSING).await;
    wait_indexed(&env, 1, PROCESSING).await;
    worker.stop().await;

    let list = run_ok(&env, &["dlq", "list"]).await;
    let id = ids(&list_json(&env, &[]).await).remove(0);
    let show = run_ok(&env, &["dlq", "show", &id]).await;
    for (what, out) in [("list", &list), ("show", &show)] {
        let stdout = &out.stdout;
        assert!(
            !stdout.iter().any(|b| matches!(b, 0x1b | 0x07 | b'\r')),
            "dlq {what} printed a raw escape: {}",
            text(out)
        );
        assert!(
            String::from_utf8_lossy(stdout).contains("\\u{1b}]0;pwned\\u{7}"),
            "dlq {what} shows the escapes: {}",
            text(out)
        );
    }
    let json = list_json(&env, &[]).await;
    assert_eq!(
        json["dead_letters"][0]["order_id"],
        order.as_str(),
        "{json}"
    );
}
