//! The publisher's trace reaches the downstream: one trace from publish to the
//! HTTP call (docs/semantics.md §5, Tracing).

use shardline_testkit::{
    Downstream, PROCESSING, Publisher, TestEnv, all_ok, interleaved, order_ids,
};

fn trace_id(traceparent: &str) -> Option<&str> {
    traceparent.split('-').nth(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downstream_calls_continue_the_publishers_trace() {
    let env = TestEnv::new("trace").await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let _worker = env.start_worker("w1", &downstream, |_| {}).await;

    let events = interleaved(&order_ids("trace", 4), 2, env.shards);
    Publisher::connect(&env).await.publish(&events).await;
    let calls = downstream
        .wait_for("all events answered", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;

    for e in &events {
        let call = calls
            .iter()
            .find(|c| c.key() == e.key())
            .unwrap_or_else(|| panic!("no call for {}", e.key()));
        let sent = trace_id(&e.traceparent);
        let got = call.header("traceparent").and_then(trace_id);
        assert_eq!(
            got,
            sent,
            "{}: published traceparent {}, downstream got {:?}",
            e.key(),
            e.traceparent,
            call.header("traceparent")
        );
    }
}
