//! Fault attribution: every failed attempt is the event's, the downstream's
//! availability, its configuration, or our infrastructure, and only its fault
//! decides what follows. Hostile trace headers are the event's problem and
//! are dropped, never an outage; a redirect is never success and pauses the
//! worker; the same 401 for every order pauses it instead of dead-lettering
//! the stream; a refusal only one order gets is that event's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use lapin::types::{AMQPValue, LongString};
use shardline_contract::headers::{self, event_properties, header_str, new_traceparent};
use shardline_testkit::dlq::{peek_all, reason};
use shardline_testkit::{
    Downstream, Event, Publisher, Reply, STARTUP, TestEnv, Worker,
    assert_all_answered_once_in_order, interleaved, order_ids, wait_until,
};
use shardline_worker::handler::Fault;

/// A downstream that answers `down` while `broken` is set, 200 otherwise.
async fn broken_until_fixed(down: Reply) -> (Downstream, Arc<AtomicBool>) {
    let broken = Arc::new(AtomicBool::new(true));
    let downstream = {
        let broken = Arc::clone(&broken);
        Downstream::scripted(move |_, _| {
            if broken.load(Ordering::SeqCst) {
                down
            } else {
                Reply::ok()
            }
        })
        .await
    };
    (downstream, broken)
}

/// Waits until `topology status` shows the worker paused for the
/// downstream's configuration, and returns the table.
async fn status_naming(env: &TestEnv, answer: &str) -> String {
    wait_until(
        "topology status to name the misconfigured downstream",
        STARTUP,
        || async {
            let out = env.cli(&["topology", "status"]).await;
            let table = String::from_utf8_lossy(&out.stdout).into_owned();
            let named = table.contains("downstream misconfigured") && table.contains(answer);
            // A worker paused for its configuration needs attention at once: exit 3.
            if named && out.status.code() == Some(3) {
                Ok(table)
            } else {
                Err(format!("exit {:?}: {table}", out.status.code()))
            }
        },
    )
    .await
}

/// Waits until the worker pauses for the downstream's configuration, checks
/// that nothing was processed or dead-lettered meanwhile, fixes the
/// downstream, and checks that every event is then processed once, in order.
async fn assert_paused_then_resumed(
    env: &TestEnv,
    worker: &Worker,
    downstream: &Downstream,
    broken: &AtomicBool,
    events: &[Event],
) {
    let paused = worker
        .wait_counts("paused for the downstream's configuration", |c| {
            c.downstream_misconfigured
        })
        .await;
    assert_eq!(paused.processed, 0, "{paused:?}");
    assert_eq!(paused.dead_lettered_total(), 0, "{paused:?}");
    assert!(paused.failures(Fault::Configuration) + paused.failures(Fault::Unconfirmed) >= 1);
    assert_eq!(env.dlq_backlog().await, 0);
    broken.store(false, Ordering::SeqCst);
    assert_all_answered_once_in_order(env, downstream, events).await;
    let counts = worker.wait_settled(events.len() as u64).await;
    assert_eq!(counts.processed, events.len() as u64, "{counts:?}");
    assert!(!counts.downstream_misconfigured, "{counts:?}");
    assert_eq!(env.dlq_backlog().await, 0);
}

/// One hostile header value, set on events of four orders.
struct Hostile {
    name: &'static str,
    header: &'static str,
    value: Vec<u8>,
}

fn hostile_headers() -> Vec<Hostile> {
    let long_state: String = (0..64)
        .map(|i| format!("k{i:02}={}", "v".repeat(250)))
        .collect::<Vec<_>>()
        .join(",");
    let h = |name, header, value: &[u8]| Hostile {
        name,
        header,
        value: value.to_vec(),
    };
    vec![
        h(
            "tracestate CR/LF",
            headers::TRACESTATE,
            b"a=b\r\nX-Injected: 1",
        ),
        h(
            "tracestate 16 KB",
            headers::TRACESTATE,
            long_state.as_bytes(),
        ),
        h("tracestate NUL", headers::TRACESTATE, b"a=b\0c"),
        h("tracestate not UTF-8", headers::TRACESTATE, b"a=\xff\xfe"),
        h("baggage CR/LF", headers::BAGGAGE, b"k=v\r\nX-Injected: 1"),
        h("baggage NUL", headers::BAGGAGE, b"k=v\0"),
        h("baggage not UTF-8", headers::BAGGAGE, b"k=\xc3\x28"),
        h(
            "traceparent CR/LF",
            headers::TRACEPARENT,
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nX-Injected: 1",
        ),
    ]
}

/// Events of four orders per hostile header, then 40 healthy events: all 40
/// are processed within 5 s of publishing, the breaker never opens, and the
/// hostile events are processed with the header left out of the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_trace_headers_are_dropped_and_never_stall_the_worker() {
    let env = TestEnv::new("attribution-headers").await.with_shards(4);
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let publisher = Publisher::connect(&env).await;

    let mut hostile_keys = Vec::new();
    for (i, hostile) in hostile_headers().iter().enumerate() {
        for order in order_ids(&format!("hostile-{i}"), 4) {
            let event = Event::new(&order, 1, env.shards);
            let props = event_properties(&event.key(), SystemTime::now(), &new_traceparent());
            let mut table = props.headers().clone().unwrap_or_default();
            table.insert(
                hostile.header.into(),
                AMQPValue::LongString(LongString::from(hostile.value.clone())),
            );
            publisher
                .publish_with(event.shard, &event.body, props.with_headers(table))
                .await;
            hostile_keys.push((hostile.name, hostile.header, event.key()));
        }
    }
    let healthy = interleaved(&order_ids("healthy", 20), 2, env.shards);
    publisher.publish(&healthy).await;
    let published = Instant::now();

    let keys: Vec<String> = healthy.iter().map(Event::key).collect();
    downstream
        .wait_for(
            "the 40 healthy events within 5 s",
            Duration::from_secs(5),
            move |calls| {
                keys.iter()
                    .all(|k| calls.iter().any(|c| c.key() == k && c.ok() && c.completed))
            },
        )
        .await;
    let took = published.elapsed();

    let total = (healthy.len() + hostile_keys.len()) as u64;
    let counts = worker.wait_settled(total).await;
    assert_eq!(counts.processed, total, "{counts:?} after {took:?}");
    assert_eq!(counts.breaker_trips, 0, "{counts:?}");
    assert_eq!(counts.failures(Fault::Availability), 0, "{counts:?}");
    assert_eq!(env.dlq_backlog().await, 0);

    let calls = downstream.calls();
    for (name, header, key) in &hostile_keys {
        let call = calls
            .iter()
            .find(|c| c.key() == key)
            .unwrap_or_else(|| panic!("{name}: {key} never reached the downstream"));
        assert!(call.header("x-injected").is_none(), "{name}: {call:?}");
        assert_eq!(call.attempt(), Some(1), "{name}: one attempt");
        match *header {
            // A fresh trace stands in for the dropped one.
            h if h == headers::TRACEPARENT => {
                let sent = call.header(headers::TRACEPARENT).unwrap_or_default();
                assert!(headers::is_valid_traceparent(sent), "{name}: {sent}");
                assert!(!sent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736"));
            }
            other => assert!(
                call.header(other).is_none(),
                "{name}: {other} reached the downstream: {:?}",
                call.header(other)
            ),
        }
    }
    worker.stop().await;
}

/// A downstream that redirects every event: nothing counts as processed; the
/// worker pauses, and `topology status` names the redirect's target; fixed,
/// every event is processed once. The POST is never turned into a GET.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_never_success_and_pauses_the_worker() {
    let env = TestEnv::new("attribution-redirect").await.with_shards(4);
    env.apply_topology().await;
    let (downstream, broken) = broken_until_fixed(Reply::status(302).location("/landed")).await;
    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let events = interleaved(&order_ids("redirected", 8), 2, env.shards);
    Publisher::connect(&env).await.publish(&events).await;

    let table = status_naming(&env, "/landed").await;
    assert!(
        table.contains("answered 302") && table.contains("point the handler URL"),
        "{table}"
    );
    assert_paused_then_resumed(&env, &worker, &downstream, &broken, &events).await;
    let calls = downstream.calls();
    assert!(
        calls
            .iter()
            .all(|c| c.method == "POST" && c.path == "/events"),
        "a redirect was followed: {:?}",
        calls.iter().find(|c| c.path != "/events")
    );
    worker.stop().await;
}

/// `--breaker off --max-attempts 2`: a redirect is retried, then
/// dead-lettered with what the downstream answered in its `x-error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_breaker_a_redirect_is_dead_lettered_with_its_answer() {
    let env = TestEnv::new("attribution-redirect-off")
        .await
        .with_shards(2);
    env.apply_topology().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::status(307).location("/v2/events?sig=s")).await;
    let worker = env
        .start_worker("w1", &downstream, |c| {
            c.breaker.enabled = false;
            c.retry.max_attempts = 2;
        })
        .await;
    let event = Event::new("redirected-off", 1, env.shards);
    Publisher::connect(&env)
        .await
        .publish(std::slice::from_ref(&event))
        .await;
    let counts = worker.wait_settled(1).await;
    assert_eq!(counts.processed, 0, "{counts:?}");
    assert_eq!(counts.failures(Fault::Configuration), 2, "{counts:?}");

    let conn = env.connect().await;
    let channel = conn.create_channel().await.unwrap();
    let letters = peek_all(&env, &channel).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(reason(&letters[0]), "handler");
    let error = header_str(&letters[0].properties, headers::ERROR).unwrap_or_default();
    assert!(
        error.contains("answered 307")
            && error.contains("/v2/events")
            && !error.contains("sig=s")
            && error.contains("point the handler URL at the final URL"),
        "{error}"
    );
    assert_eq!(downstream.calls().len(), 2);
    worker.stop().await;
}

/// The same 401 for every order (a rotated token) pauses the worker after
/// three orders, on four shards and on one (where the breaker's evidence
/// attempts find the other orders); nothing is dead-lettered, and it
/// resumes when the downstream answers 200 again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_401_for_every_order_pauses_the_worker_and_dead_letters_nothing() {
    for shards in [4, 1] {
        let env = TestEnv::new(&format!("attribution-401-{shards}"))
            .await
            .with_shards(shards);
        env.apply_topology().await;
        let (downstream, broken) = broken_until_fixed(Reply::status(401)).await;
        let worker = env.start_worker("w1", &downstream, |_| {}).await;
        let events = interleaved(&order_ids("token", 8), 2, env.shards);
        Publisher::connect(&env).await.publish(&events).await;

        status_naming(&env, "answered 401").await;
        let refused_orders: std::collections::HashSet<_> = downstream
            .calls()
            .iter()
            .filter(|c| c.status == 401)
            .filter_map(|c| c.order_id.clone())
            .collect();
        assert!(
            (3..=3 + usize::from(shards)).contains(&refused_orders.len()),
            "{shards} shards: paused after {} orders",
            refused_orders.len()
        );
        assert_paused_then_resumed(&env, &worker, &downstream, &broken, &events).await;
        worker.stop().await;
    }
}

/// A refusal only one order gets (404 for an order the downstream does not
/// know) while the others succeed is that event's: dead-lettered after its
/// attempts, the breaker closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_only_one_order_gets_is_the_events() {
    let env = TestEnv::new("attribution-404").await.with_shards(4);
    env.apply_topology().await;
    let unknown = Event::new("unknown-order", 1, env.shards);
    let downstream = {
        let key = unknown.key();
        Downstream::scripted(move |call, _| {
            if call.key() == key {
                Reply::status(404)
            } else {
                Reply::ok().after(Duration::from_millis(5))
            }
        })
        .await
    };
    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let healthy = interleaved(&order_ids("known", 30), 3, env.shards);
    let publisher = Publisher::connect(&env).await;
    publisher.publish(std::slice::from_ref(&unknown)).await;
    publisher.publish(&healthy).await;

    assert_all_answered_once_in_order(&env, &downstream, &healthy).await;
    let counts = worker.wait_settled(healthy.len() as u64 + 1).await;
    assert_eq!(counts.dead_lettered_total(), 1, "{counts:?}");
    assert_eq!(counts.breaker_trips, 0, "{counts:?}");
    assert!(!counts.downstream_misconfigured);
    let max_attempts = env.worker_config("w1").retry.max_attempts as usize;
    let attempts = downstream
        .calls()
        .iter()
        .filter(|c| c.key() == unknown.key())
        .count();
    assert_eq!(attempts, max_attempts);
    worker.stop().await;
}
