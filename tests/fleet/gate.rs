//! The sequence gate (docs/semantics.md §3): events ahead of their order's sequence are held
//! (unacked) while the shard's other orders keep flowing, gaps that never fill
//! are dead-lettered `seq-gap` (or applied), late events are dead-lettered
//! `late`, a new order waits a short start grace, and held events are bounded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::Connection;
use lapin::message::Delivery;
use shardline_contract::NewEvent;

use shardline_testkit::wait::check;
use shardline_testkit::{
    Call, Downstream, Event, PROCESSING, Publisher, Reply, TestEnv, Worker, all_ok,
    assert_exactly_once, describe, dlq, wait_until,
};
use shardline_worker::{Config, OnGap};

/// Bound on a gap given up early or after a 1 s grace: well below any long grace
/// a test sets, well above the short ones.
const GIVE_UP: Duration = Duration::from_secs(20);

struct Fleet {
    env: TestEnv,
    conn: Connection,
    downstream: Downstream,
    worker: Worker,
    publisher: Publisher,
}

/// A fresh environment, its topology, an in-process worker on every shard
/// calling `downstream` with its config changed by `configure`, and a publisher.
async fn fleet(name: &str, downstream: Downstream, configure: impl FnOnce(&mut Config)) -> Fleet {
    let env = TestEnv::new(name).await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let worker = env.start_worker("w1", &downstream, configure).await;
    let publisher = Publisher::connect(&env).await;
    Fleet {
        env,
        conn,
        downstream,
        worker,
        publisher,
    }
}

/// `n` order ids `{prefix}-{i}` that all hash to the same shard.
fn same_shard_orders(env: &TestEnv, prefix: &str, n: usize) -> Vec<String> {
    let shard = env.shard_of(&format!("{prefix}-0"));
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|id| env.shard_of(id) == shard)
        .take(n)
        .collect()
}

fn ev(env: &TestEnv, order: &str, seq: u64) -> Event {
    Event::new(order, seq, env.shards)
}

/// The seqs of the calls for `order`, in arrival order.
fn seqs(calls: &[Call], order: &str) -> Vec<u64> {
    calls
        .iter()
        .filter(|c| c.order_id.as_deref() == Some(order))
        .filter_map(|c| c.seq)
        .collect()
}

/// The arrival position of the (only) call of `event`.
fn index_of(calls: &[Call], event: &Event) -> usize {
    let key = event.key();
    let found: Vec<usize> = calls
        .iter()
        .filter(|c| c.key() == key)
        .map(|c| c.index)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{key}: expected exactly one call\n{}",
        describe(calls)
    );
    found[0]
}

/// Letters' reasons and bodies match `expected` (reason, event), in order; each
/// carries `x-retry-count` 0 (the handler never ran).
fn assert_letters(letters: &[Delivery], expected: &[(&str, &Event)]) {
    let report = dlq::describe(letters);
    assert_eq!(letters.len(), expected.len(), "dead letters:\n{report}");
    for (letter, (reason, event)) in letters.iter().zip(expected) {
        assert_eq!(dlq::reason(letter), *reason, "dead letters:\n{report}");
        assert_eq!(
            letter.data,
            event.body,
            "{}: dead letter must carry the original body:\n{report}",
            event.key()
        );
        assert_eq!(dlq::retry_count(letter), Some(0), "dead letters:\n{report}");
    }
}

/// `gap_grace` and `start_grace` of a worker's config.
fn graces(gap: Duration, start: Duration) -> impl FnOnce(&mut Config) {
    move |c| {
        c.gap_grace = gap;
        c.start_grace = start;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_events_are_held_while_the_shard_keeps_flowing() {
    out_of_order_events_are_held(1).await;
}

/// The same with 4 calls in flight per shard (`concurrency.rs` has the rest).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_events_are_held_at_concurrency_4() {
    out_of_order_events_are_held(4).await;
}

pub(crate) async fn out_of_order_events_are_held(concurrency: u16) {
    let f = fleet("gate-ooo", Downstream::start().await, |c| {
        graces(Duration::from_secs(60), Duration::from_secs(30))(c);
        c.concurrency = concurrency;
    })
    .await;
    let ids = same_shard_orders(&f.env, "ooo", 2);
    let (a, b) = (&ids[0], &ids[1]);
    let a_ev: Vec<Event> = (1..=4).map(|s| ev(&f.env, a, s)).collect();
    let b_ev: Vec<Event> = (1..=3).map(|s| ev(&f.env, b, s)).collect();

    // A: 1, then 3 (ahead of its sequence: held).
    f.publisher
        .publish(&[a_ev[0].clone(), a_ev[2].clone()])
        .await;
    f.downstream
        .wait_for("A seq 1", PROCESSING, |calls| all_ok(calls, &a_ev[..1]))
        .await;
    // B, behind A's 3 in the same queue, flows while A's 3 waits for its 2.
    f.publisher.publish(&b_ev).await;
    let calls = f
        .downstream
        .wait_for("order B, while A's seq 3 is held", PROCESSING, |calls| {
            all_ok(calls, &b_ev)
        })
        .await;
    // The queue is FIFO: A's 3 was taken (and held) before B's 1 (and, with
    // concurrency, B's 1 started after A's 3 was admitted), so its absence now
    // is not a race.
    assert_eq!(
        seqs(&calls, a),
        [1],
        "A's seq 3 must wait for seq 2\n{}",
        describe(&calls)
    );

    f.publisher
        .publish(&[a_ev[1].clone(), a_ev[3].clone()])
        .await;
    f.downstream
        .wait_for("A seqs 2, 3, 4", PROCESSING, |calls| all_ok(calls, &a_ev))
        .await;
    f.env.wait_shard_queues_drained(PROCESSING).await;
    let calls = f.downstream.calls();
    assert_eq!(seqs(&calls, a), [1, 2, 3, 4], "{}", describe(&calls));
    assert_eq!(seqs(&calls, b), [1, 2, 3], "{}", describe(&calls));
    let a2 = index_of(&calls, &a_ev[1]);
    for e in &b_ev {
        assert!(
            index_of(&calls, e) < a2,
            "B ran after A's gap filled\n{}",
            describe(&calls)
        );
    }
    let all: Vec<Event> = a_ev.iter().chain(&b_ev).cloned().collect();
    assert_exactly_once(&calls, &all);
    assert_eq!(dlq::depth(&f.env, &f.conn).await, 0);
}

/// Publishes C 1, 3, 4 (no 2) and waits until the 1 s gap grace ended for 3
/// and 4 (dead-lettered or applied, as `on_gap` says).
async fn gap_never_fills(on_gap: &str) {
    let f = fleet(
        &format!("gate-gap-{on_gap}"),
        Downstream::start().await,
        |c| {
            graces(Duration::from_secs(1), Duration::from_millis(500))(c);
            c.on_gap = if on_gap == "apply" {
                OnGap::Apply
            } else {
                OnGap::DeadLetter
            };
        },
    )
    .await;
    let c = "gap-c";
    let c_ev: Vec<Event> = (1..=5).map(|s| ev(&f.env, c, s)).collect();
    let (c1, c2, c3, c4, c5) = (&c_ev[0], &c_ev[1], &c_ev[2], &c_ev[3], &c_ev[4]);
    f.publisher
        .publish(&[c1.clone(), c3.clone(), c4.clone()])
        .await;

    if on_gap == "dead-letter" {
        let letters = dlq::take(&f.env, &f.conn, 2, GIVE_UP).await;
        assert_letters(&letters, &[("seq-gap", c3), ("seq-gap", c4)]);
        // The order continues after the highest dead-lettered seq.
        f.publisher.publish(std::slice::from_ref(c5)).await;
        f.downstream
            .wait_for("C seq 5 after the gap", PROCESSING, |calls| {
                all_ok(calls, std::slice::from_ref(c5))
            })
            .await;
        // The missing seq, now behind the order: never dropped silently.
        f.publisher.publish(std::slice::from_ref(c2)).await;
        let letters = dlq::take(&f.env, &f.conn, 1, GIVE_UP).await;
        assert_letters(&letters, &[("late", c2)]);
        f.env.wait_shard_queues_drained(PROCESSING).await;
        let calls = f.downstream.calls();
        assert_eq!(seqs(&calls, c), [1, 5], "{}", describe(&calls));
        assert_exactly_once(&calls, &[c1.clone(), c5.clone()]);
    } else {
        f.downstream
            .wait_for("C seqs 3 and 4 applied past the gap", GIVE_UP, |calls| {
                all_ok(calls, &[c1.clone(), c3.clone(), c4.clone()])
            })
            .await;
        f.publisher.publish(std::slice::from_ref(c5)).await;
        f.downstream
            .wait_for("C seq 5 after the gap", PROCESSING, |calls| {
                all_ok(calls, std::slice::from_ref(c5))
            })
            .await;
        f.env.wait_shard_queues_drained(PROCESSING).await;
        let calls = f.downstream.calls();
        assert_eq!(seqs(&calls, c), [1, 3, 4, 5], "{}", describe(&calls));
        assert_exactly_once(&calls, &[c1.clone(), c3.clone(), c4.clone(), c5.clone()]);
        assert_eq!(
            dlq::depth(&f.env, &f.conn).await,
            0,
            "--on-gap apply dead-letters nothing"
        );
    }
    // The gap is reported: C's, the only gap this worker saw (C started at 1,
    // so it is no gap at start).
    assert_eq!(
        f.worker.counts().gaps,
        1,
        "no gap report for order {c}: {}",
        f.worker.describe()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_that_never_fills_is_dead_lettered_and_late_events_too() {
    gap_never_fills("dead-letter").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_gap_apply_skips_the_gap() {
    gap_never_fills("apply").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_order_waits_the_start_grace_for_earlier_events() {
    // Arrival time of every call, by Idempotency-Key (the script runs on arrival).
    let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let downstream = {
        let arrivals = Arc::clone(&arrivals);
        Downstream::scripted(move |call, _| {
            arrivals
                .lock()
                .unwrap()
                .entry(call.key().to_owned())
                .or_insert_with(Instant::now);
            Reply::ok()
        })
        .await
    };
    let f = fleet(
        "gate-start",
        downstream,
        graces(Duration::from_secs(60), Duration::from_millis(500)),
    )
    .await;

    // D starts at seq 3: accepted as the start once the grace is over, then 4.
    let d = "start-d";
    let d3 = ev(&f.env, d, 3);
    let d4 = ev(&f.env, d, 4);
    let published = Instant::now();
    f.publisher.publish(&[d3.clone(), d4.clone()]).await;
    let calls = f
        .downstream
        .wait_for("D seqs 3 and 4", PROCESSING, |calls| {
            all_ok(calls, &[d3.clone(), d4.clone()])
        })
        .await;
    let waited = arrivals.lock().unwrap()[&d3.key()] - published;
    assert!(
        waited >= Duration::from_millis(400),
        "D's seq 3 reached the downstream {waited:?} after it was published, \
         before the 500ms start grace\n{}",
        describe(&calls)
    );
    assert_eq!(seqs(&calls, d), [3, 4], "{}", describe(&calls));
    // D's gap at start, the only gap so far (the gap grace is a minute).
    assert_eq!(
        f.worker.counts().gaps,
        1,
        "no gap-at-start report for order {d}: {}",
        f.worker.describe()
    );

    // E: seq 2 first, seq 1 right behind it, within the grace: 1 then 2.
    let e = "start-e";
    let e1 = ev(&f.env, e, 1);
    let e2 = ev(&f.env, e, 2);
    f.publisher.publish(&[e2.clone(), e1.clone()]).await;
    f.downstream
        .wait_for("E seqs 1 and 2", PROCESSING, |calls| {
            all_ok(calls, &[e1.clone(), e2.clone()])
        })
        .await;
    f.env.wait_shard_queues_drained(PROCESSING).await;
    let calls = f.downstream.calls();
    assert_eq!(seqs(&calls, e), [1, 2], "{}", describe(&calls));
    assert_exactly_once(&calls, &[d3, d4, e1, e2]);
    assert_eq!(
        f.worker.counts().gaps,
        1,
        "order {e} had its seq 1 within the grace, yet a gap at start was reported: {}",
        f.worker.describe()
    );
    assert_eq!(dlq::depth(&f.env, &f.conn).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_copy_of_a_held_event_is_acked_as_a_duplicate() {
    let f = fleet(
        "gate-copy",
        Downstream::start().await,
        graces(Duration::from_secs(60), Duration::from_secs(30)),
    )
    .await;
    let o = "copy-f";
    let f_ev: Vec<Event> = (1..=3).map(|s| ev(&f.env, o, s)).collect();
    f.publisher.publish(&f_ev[..1]).await;
    f.downstream
        .wait_for("F seq 1", PROCESSING, |calls| all_ok(calls, &f_ev[..1]))
        .await;

    f.publisher
        .publish(&[f_ev[2].clone(), f_ev[2].clone()])
        .await;
    // One copy held (unacked), the other acked: the queue holds exactly one.
    let queue = f.env.shard_queue(f_ev[2].shard);
    wait_until(
        "one copy of F's seq 3 held, the other acked as a duplicate",
        PROCESSING,
        || async {
            let depths = f.env.queue_depths().await;
            let depth = depths.get(&queue).copied();
            let counts = f.worker.counts();
            check(
                depth == Some((1, 1)) && counts.held == 1 && counts.duplicates == 1,
                || {
                    format!(
                        "{queue}: (messages, unacked) = {depth:?}, expected (1, 1), and one \
                         event held, one duplicate; {}",
                        f.worker.describe()
                    )
                },
            )
        },
    )
    .await;
    assert_eq!(seqs(&f.downstream.calls(), o), [1]);

    f.publisher.publish(&f_ev[1..2]).await;
    f.downstream
        .wait_for("F seqs 2 and 3", PROCESSING, |calls| all_ok(calls, &f_ev))
        .await;
    f.env.wait_shard_queues_drained(PROCESSING).await;
    let calls = f.downstream.calls();
    assert_eq!(seqs(&calls, o), [1, 2, 3], "{}", describe(&calls));
    assert_exactly_once(&calls, &f_ev);
    assert_eq!(dlq::depth(&f.env, &f.conn).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_without_seq_bypass_the_gate() {
    let f = fleet(
        "gate-noseq",
        Downstream::start().await,
        graces(Duration::from_secs(60), Duration::from_secs(60)),
    )
    .await;
    let h = "noseq-h";
    // Seq 3 of a new order: held for the (long) start grace.
    let h3 = ev(&f.env, h, 3);
    f.publisher.publish(std::slice::from_ref(&h3)).await;
    // Unsequenced events of the same order, in no particular order.
    let ids = ["n3", "n1", "n2"];
    let shard = f.env.shard_of(h);
    let started = Instant::now();
    for id in ids {
        let body = NewEvent {
            order_id: shardline_contract::OrderId::new(h).unwrap(),
            event: "note.added".into(),
            seq: None,
            event_id: Some(id.to_owned()),
            data: serde_json::json!({ "test": true }),
        }
        .to_body()
        .unwrap();
        f.publisher.publish_raw(shard, &body).await;
    }
    let keys: Vec<String> = ids
        .iter()
        .map(|id| format!("{h}:note.added:{id}"))
        .collect();
    // Well inside the 60 s start grace: they did not wait for it.
    let calls = f
        .downstream
        .wait_for(
            "the unsequenced events while seq 3 is held",
            Duration::from_secs(30),
            |calls| {
                keys.iter()
                    .all(|k| calls.iter().any(|c| c.key() == k && c.ok() && c.completed))
            },
        )
        .await;
    let order: Vec<&str> = calls
        .iter()
        .filter(|c| c.order_id.as_deref() == Some(h))
        .map(Call::key)
        .collect();
    assert_eq!(
        order,
        keys.iter().map(String::as_str).collect::<Vec<_>>(),
        "unsequenced events each once, in publish order, and H's seq 3 still held \
         ({:?} after publishing)\n{}",
        started.elapsed(),
        describe(&calls)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_max_held_the_oldest_gap_times_out_early() {
    let f = fleet("gate-max", Downstream::start().await, |c| {
        graces(Duration::from_secs(60), Duration::from_secs(60))(c);
        c.max_held = 2;
    })
    .await;
    let ids = same_shard_orders(&f.env, "max", 3);
    let (g, p, k) = (&ids[0], &ids[1], &ids[2]);
    let g_ev: Vec<Event> = (1..=5).map(|s| ev(&f.env, g, s)).collect();

    // G: 1, then 3, 4 held (the bound, 2), then 5: G's gap is given up at once.
    let started = Instant::now();
    f.publisher
        .publish(&[
            g_ev[0].clone(),
            g_ev[2].clone(),
            g_ev[3].clone(),
            g_ev[4].clone(),
        ])
        .await;
    let letters = dlq::take(&f.env, &f.conn, 2, GIVE_UP).await;
    let elapsed = started.elapsed();
    assert_letters(&letters, &[("seq-gap", &g_ev[2]), ("seq-gap", &g_ev[3])]);
    assert!(
        elapsed < Duration::from_secs(30),
        "the gap was given up after {elapsed:?}: not early"
    );
    // The order continues after the highest given up.
    f.downstream
        .wait_for("G seqs 1 and 5", PROCESSING, |calls| {
            all_ok(calls, &[g_ev[0].clone(), g_ev[4].clone()])
        })
        .await;

    // P and K: P's 3 held first, then K's 3, then K's 4 at the bound: the
    // oldest gap (P's) is given up, K's keep waiting for K's 2.
    let p1 = ev(&f.env, p, 1);
    let p3 = ev(&f.env, p, 3);
    let k_ev: Vec<Event> = (1..=4).map(|s| ev(&f.env, k, s)).collect();
    f.publisher
        .publish(&[
            p1.clone(),
            k_ev[0].clone(),
            p3.clone(),
            k_ev[2].clone(),
            k_ev[3].clone(),
        ])
        .await;
    let letters = dlq::take(&f.env, &f.conn, 1, GIVE_UP).await;
    assert_letters(&letters, &[("seq-gap", &p3)]);
    let calls = f
        .downstream
        .wait_for("P seq 1 and K seq 1", PROCESSING, |calls| {
            all_ok(calls, &[p1.clone(), k_ev[0].clone()])
        })
        .await;
    assert_eq!(
        seqs(&calls, k),
        [1],
        "K's 3 and 4 must still wait for K's 2\n{}",
        describe(&calls)
    );
    f.publisher.publish(&k_ev[1..2]).await;
    f.downstream
        .wait_for("K seqs 2, 3, 4", PROCESSING, |calls| all_ok(calls, &k_ev))
        .await;
    f.env.wait_shard_queues_drained(PROCESSING).await;
    let calls = f.downstream.calls();
    assert_eq!(seqs(&calls, g), [1, 5], "{}", describe(&calls));
    assert_eq!(seqs(&calls, p), [1], "{}", describe(&calls));
    assert_eq!(seqs(&calls, k), [1, 2, 3, 4], "{}", describe(&calls));
    let processed: Vec<Event> = [g_ev[0].clone(), g_ev[4].clone(), p1]
        .into_iter()
        .chain(k_ev)
        .collect();
    assert_exactly_once(&calls, &processed);
    assert_eq!(dlq::depth(&f.env, &f.conn).await, 0);
}

/// Seq `seq` of `order` with a body of about `pad` bytes more than usual.
fn padded(env: &TestEnv, order: &str, seq: u64, pad: usize) -> Event {
    let mut event = ev(env, order, seq);
    event.body = NewEvent {
        order_id: shardline_contract::OrderId::new(order).unwrap(),
        event: event.event.clone(),
        seq: Some(seq),
        event_id: None,
        data: serde_json::json!({ "pad": "x".repeat(pad) }),
    }
    .to_body()
    .unwrap();
    event
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_max_held_bytes_the_shard_takes_no_new_delivery() {
    // Bodies of about 4 KB against a bound of 10,000 bytes: the third is
    // taken (8 KB held, below it), a fourth is not. `--max-held` (5) is not
    // reached: its window (prefetch 1 + 5) leaves the rest ready in the queue.
    const BOUND: usize = 10_000;
    let f = fleet("gate-bytes", Downstream::start().await, |c| {
        graces(Duration::from_secs(60), Duration::from_secs(3))(c);
        c.max_held_bytes = BOUND;
        c.max_held = 5;
    })
    .await;
    let order = "bytes-a";
    // A new order from seq 3: each is held for the start grace.
    let events: Vec<Event> = (3..=12).map(|s| padded(&f.env, order, s, 4_000)).collect();
    let largest = events
        .iter()
        .map(|e| e.body.len())
        .max()
        .unwrap_or_default();
    f.publisher.publish(&events).await;

    let counts = f.worker.wait_held(3).await;
    let ready = f.env.shard_statuses(&f.conn).await[usize::from(events[0].shard)].messages;
    assert_eq!(
        (counts.held, counts.processed),
        (3, 0),
        "{}",
        f.worker.describe()
    );
    assert!(
        ready >= 4,
        "the rest waits in the queue: {ready} ready\n{}",
        f.worker.describe()
    );

    // Held stay held until the start grace ends (nothing is given up for
    // bytes), then all run in order. Polled throughout: never more held.
    let most = std::cell::Cell::new((0_u64, 0_u64));
    let calls = wait_until("every event of the order processed", PROCESSING, || {
        let counts = f.worker.counts();
        let (held, bytes) = most.get();
        most.set((held.max(counts.held), bytes.max(counts.held_bytes)));
        let calls = f.downstream.calls();
        let done = check(all_ok(&calls, &events), || f.worker.describe());
        async move { done.map(|()| calls) }
    })
    .await;
    let (most_held, most_bytes) = most.get();
    assert_eq!(most_held, 3, "at the byte bound, never more held");
    let bound = u64::try_from(BOUND + largest).unwrap_or(u64::MAX);
    assert!(
        most_bytes >= 3 * 4_000 && most_bytes < bound,
        "held bytes {most_bytes}: at most one body past the bound"
    );
    assert_eq!(
        seqs(&calls, order),
        (3..=12).collect::<Vec<_>>(),
        "{}",
        describe(&calls)
    );
    assert_exactly_once(&calls, &events);
    f.worker.assert_all_processed(10).await;
    assert_eq!(f.worker.counts().gaps, 1, "the gap at start, only");
    assert_eq!(dlq::depth(&f.env, &f.conn).await, 0);
}
