#![allow(clippy::unwrap_used)]

use std::collections::HashSet;

use super::*;
use crate::findings::tests::{expected, flag};
use shardline_contract::status::HeldRef;
use shardline_contract::{Envelope, Keys};

#[test]
fn expectations_default_and_replace() {
    let defaults = Expectations::new(&[]);
    assert_eq!(defaults.kinds("PAID"), ["payment.captured"]);
    assert_eq!(defaults.kinds("INVENTORY_RESERVED"), ["inventory.reserved"]);
    assert_eq!(defaults.kinds("FULFILLED"), ["order.fulfilled"]);
    assert!(defaults.kinds("CREATED").is_empty());
    assert!(defaults.kinds("paid").is_empty(), "statuses match exactly");

    let pairs = [
        parse_expectation("SHIPPED=order.shipped").unwrap(),
        parse_expectation("SHIPPED = order.packed").unwrap(),
        parse_expectation("SHIPPED=order.shipped").unwrap(),
    ];
    let custom = Expectations::new(&pairs);
    assert_eq!(custom.kinds("SHIPPED"), ["order.shipped", "order.packed"]);
    assert!(
        custom.kinds("PAID").is_empty(),
        "expectations replace the defaults"
    );
    assert_eq!(
        custom.describe(),
        "SHIPPED=order.shipped, SHIPPED=order.packed"
    );
}

#[test]
fn expectations_are_checked() {
    assert!(parse_expectation("PAID").is_err());
    assert!(parse_expectation("=payment.captured").is_err());
    assert!(parse_expectation("PAID=").is_err());
    assert!(parse_expectation("PAID=a\u{7}b").is_err());
    assert!(parse_expectation(&format!("PAID={}", "x".repeat(300))).is_err());
}

#[test]
fn passwords_never_show() {
    assert_eq!(
        shardline_connect::redact("postgres://app:s3cret@db:5432/orders?sslmode=disable"),
        "postgres://app:***@db:5432/orders?sslmode=disable"
    );
    assert_eq!(
        shardline_connect::redact("postgres://db/orders?user=app&password=s3cret&x=1"),
        "postgres://db/orders?user=app&password=***&x=1"
    );
    assert_eq!(
        shardline_connect::redact("host=db user=app password=s3cret dbname=orders"),
        "host=db user=app password=*** dbname=orders"
    );
    assert_eq!(
        shardline_connect::redact("postgres://db/orders"),
        "postgres://db/orders"
    );
    let config = |url: &str| ReconcileConfig {
        orders_url: url.into(),
        ..ReconcileConfig::default()
    };
    let reconciler =
        Reconciler::new(Fleet::default(), config("postgres://app:s3cret@db/orders")).unwrap();
    assert_eq!(
        reconciler.scrub_orders("failed for s3cret\nDETAIL: s3cret"),
        "failed for ***; DETAIL: ***"
    );
    let bad = Reconciler::new(
        Fleet::default(),
        config("postgres://app:s3cret@db:notaport/orders"),
    )
    .err()
    .unwrap()
    .rename_fields(flag);
    assert!(
        bad.starts_with("--orders-url postgres://app:***@db:notaport/orders: "),
        "{bad}"
    );
    assert!(!bad.contains("s3cret") && !bad.contains('\n'), "{bad}");
    let mut grace_too_long = config("postgres://db/orders");
    grace_too_long.grace = grace_too_long.window;
    let e = Reconciler::new(Fleet::default(), grace_too_long)
        .err()
        .unwrap();
    assert_eq!(
        e.rename_fields(flag),
        "--grace (1day) must be shorter than --window (1day)"
    );
    let zero = ReconcileConfig {
        window: Duration::ZERO,
        ..config("postgres://db/orders")
    };
    let e = Reconciler::new(Fleet::default(), zero).err().unwrap();
    assert_eq!(e.rename_fields(flag), "--window must be above 0");
}

#[test]
fn compensation_is_a_seqless_envelope_with_a_stable_id() {
    let e = expected("A:1%", "payment.captured");
    assert_eq!(e.event_id(), "reconcile:A:1%:payment.captured");
    assert_eq!(
        e.emitted_key(&Keys::new("p:")),
        "p:reconcile:A%3A1%25:payment.captured"
    );
    let body = e.compensation().unwrap();
    let envelope = Envelope::parse(&body, usize::MAX).unwrap();
    assert_eq!(envelope.order_id, "A:1%");
    assert_eq!(envelope.event, "payment.captured");
    assert_eq!(
        envelope.seq, None,
        "seq-less: the sequence gate lets it through"
    );
    assert_eq!(
        envelope.event_id.as_deref(),
        Some("reconcile:A:1%:payment.captured")
    );
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["compensation"], true);
    assert_eq!(json["reason"], "status=PAID missing=payment.captured");

    let long = expected(&"x".repeat(250), "payment.captured");
    assert!(long.compensation().unwrap_err().contains("event_id"));
}

#[test]
fn pending_reasons_in_their_order() {
    let e = expected("A1", "payment.captured");
    let report = |backlog: f64, held: Vec<HeldRef>| ShardReport {
        forwarded_per_second: 0.0,
        shard: e.shard.get(),
        owner: "w".into(),
        backlog_age_seconds: backlog,
        backlog_age_source: None,
        inflight_age_seconds: None,
        inflight_events: 0,
        waiting_events: 0,
        held_events: held.len() as u64,
        held,
        updated_at_ms: 1_000_000,
        stopped_at_ms: None,
    };
    let mut seen = Whereabouts {
        reports: HashMap::from([(e.shard, report(0.0, Vec::new()))]),
        unreported: HashMap::new(),
        dead_letters: HashMap::new(),
        replaying: HashSet::new(),
        index_behind: None,
        outbox: HashMap::new(),
        relay_behind: None,
        grace: Duration::from_secs(120),
        now_ms: 1_000_000,
    };
    assert_eq!(
        seen.on_its_way(&e, false),
        None,
        "nothing suggests it will arrive"
    );
    assert_eq!(seen.on_its_way(&e, true), Some(OnItsWay::Compensated));

    // Behind by the grace exactly: not yet; the report ages from when it was written.
    seen.reports.insert(e.shard, report(120.0, Vec::new()));
    assert_eq!(seen.on_its_way(&e, false), None);
    seen.now_ms += 1_000;
    assert_eq!(
        seen.on_its_way(&e, false),
        Some(OnItsWay::Backlog {
            age: Duration::from_secs(121)
        })
    );

    seen.dead_letters
        .insert(("A1".into(), "payment.captured".into()), "dl-1".into());
    assert_eq!(
        seen.on_its_way(&e, false),
        Some(OnItsWay::DeadLettered { id: "dl-1".into() })
    );
    let other_kind = expected("A1", "order.fulfilled");
    assert!(matches!(
        seen.on_its_way(&other_kind, false),
        Some(OnItsWay::Backlog { .. })
    ));

    let held = |order_key: &str, event: &str| HeldRef {
        order_key: order_key.into(),
        event: event.into(),
    };
    seen.reports.insert(
        e.shard,
        report(
            0.0,
            vec![held("A2", "payment.captured"), held("A1", "order.packed")],
        ),
    );
    seen.dead_letters.clear();
    assert_eq!(seen.on_its_way(&e, false), None, "held events of others");
    seen.reports
        .insert(e.shard, report(0.0, vec![held("A1", "payment.captured")]));
    assert_eq!(seen.on_its_way(&e, false), Some(OnItsWay::Held));

    // Nobody reports the shard: its queued messages may hold the event.
    seen.reports.clear();
    seen.unreported.insert(e.shard, 0);
    assert_eq!(seen.on_its_way(&e, false), None);
    seen.unreported.insert(e.shard, 3);
    assert_eq!(
        seen.on_its_way(&e, false),
        Some(OnItsWay::Unconsumed { messages: 3 })
    );
    seen.unreported.clear();
    seen.replaying.insert("A1".into());
    assert_eq!(seen.on_its_way(&e, false), Some(OnItsWay::Replaying));
    assert_eq!(
        seen.on_its_way(&expected("A2", "payment.captured"), false),
        None,
        "another order's replay"
    );
    seen.replaying.clear();
    seen.index_behind = Some((5, 3));
    let behind = seen.on_its_way(&e, false).unwrap();
    assert_eq!(
        behind,
        OnItsWay::IndexBehind {
            depth: 5,
            indexed: 3
        }
    );
    assert_eq!(
        behind.detail(),
        "the DLQ holds 5 letters and its index 3: reindex needed (`shardline dlq reindex`)"
    );
    seen.index_behind = None;
    seen.relay_behind = Some(Duration::from_secs(300));
    assert_eq!(
        seen.on_its_way(&e, false),
        Some(OnItsWay::RelayBehind {
            lag: Duration::from_secs(300)
        }),
        "a relay behind by more than the grace: any missing event"
    );
}

#[test]
fn unpublished_outbox_rows_make_their_order_pending() {
    let e = expected("A1", "payment.captured");
    let s = Duration::from_secs;
    let mut seen = Whereabouts {
        grace: s(120),
        now_ms: 1_000_000,
        ..Whereabouts::default()
    };
    assert_eq!(seen.on_its_way(&e, false), None);

    // A row of another order: nothing to do with this one.
    seen.outbox = outbox::by_order([("A2".into(), "payment.captured".into(), 1, s(5))]);
    assert_eq!(seen.on_its_way(&e, false), None);

    // The event's own row, not relayed yet.
    seen.outbox = outbox::by_order([("A1".into(), "payment.captured".into(), 1, s(5))]);
    assert_eq!(
        seen.on_its_way(&e, false),
        Some(OnItsWay::Outbox {
            rows: 1,
            of_kind: 1,
            oldest: s(5)
        })
    );
    // Rows of the order, none of the kind: the relay is not done with the
    // order, so it is pending too.
    seen.outbox = outbox::by_order([
        ("A1".into(), "order.fulfilled".into(), 2, s(7)),
        ("A1".into(), "order.packed".into(), 1, s(9)),
    ]);
    assert_eq!(
        seen.on_its_way(&e, false),
        Some(OnItsWay::Outbox {
            rows: 3,
            of_kind: 0,
            oldest: s(9)
        })
    );
    // Reconcile's own compensation still comes first; a relay behind
    // changes nothing for an order with rows of its own.
    assert_eq!(seen.on_its_way(&e, true), Some(OnItsWay::Compensated));
    seen.relay_behind = Some(s(600));
    assert!(matches!(
        seen.on_its_way(&e, false),
        Some(OnItsWay::Outbox { rows: 3, .. })
    ));
}

#[test]
fn the_outbox_schema_is_checked_and_named() {
    let config = |schema: &str| ReconcileConfig {
        orders_url: "postgres://db/orders".into(),
        outbox_schema: Some(schema.into()),
        ..ReconcileConfig::default()
    };
    for ok in ["public", "shop", "_private", "user"] {
        assert!(
            Reconciler::new(Fleet::default(), config(ok)).is_ok(),
            "{ok}"
        );
    }
    for (bad, why) in [
        ("", "empty"),
        ("Shop", "lower-case"),
        ("shop\"; drop table orders; --", "lower-case ASCII"),
        ("pg_catalog", "reserved"),
    ] {
        let e = Reconciler::new(Fleet::default(), config(bad))
            .err()
            .unwrap();
        assert!(e.is_usage(), "{bad:?}");
        let text = e.rename_fields(flag);
        assert!(
            text.starts_with(&format!("--outbox-schema {bad:?}: ")) && text.contains(why),
            "{text}"
        );
    }
    let none = ReconcileConfig {
        orders_url: "postgres://db/orders".into(),
        ..ReconcileConfig::default()
    };
    assert_eq!(none.outbox_schema, None, "no outbox unless asked");
    assert!(
        Reconciler::new(Fleet::default(), none)
            .unwrap()
            .outbox
            .is_none()
    );
}

#[test]
fn metrics_are_exposed_under_their_names() {
    let metrics = Metrics::new();
    let report = ReconcileReport {
        scanned: 4,
        skipped_fresh: 1,
        drift: vec![Drift {
            expected: expected("A1", "payment.captured"),
            compensation: Compensation::Emitted,
        }],
        pending: vec![Pending {
            expected: expected("A2", "payment.captured"),
            why: OnItsWay::Outbox {
                rows: 1,
                of_kind: 1,
                oldest: Duration::from_secs(3),
            },
        }],
        ..ReconcileReport::default()
    };
    metrics.record(Some(&report));
    metrics.record(None);
    let text = metrics.encode().unwrap();
    for line in [
        "shardline_reconcile_scanned_total 4",
        "shardline_reconcile_skipped_fresh_total 1",
        "shardline_reconcile_no_expectation_total 0",
        "shardline_reconcile_drifted_total 1",
        "shardline_reconcile_emitted_total 1",
        "shardline_reconcile_pending_total 1",
        "shardline_reconcile_runs_total{outcome=\"ok\"} 1",
        "shardline_reconcile_runs_total{outcome=\"error\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("shardline_reconcile_last_run_timestamp_seconds ")),
        "{text}"
    );
}
