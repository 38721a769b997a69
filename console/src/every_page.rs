//! Every page and fragment rendered from one set of fixtures (admin,
//! read-only and bearer principals, every error and empty branch), with a
//! hostile value in every text an operator does not write: each renders it
//! escaped once, its control and bidi characters shown.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use askama::Template;

use serde_json::json;
use shardline_connect::declare::ShardStatus;
use shardline_contract::letters::{Group, IndexEntry};
use shardline_contract::status::{Thresholds, WorkerReport};
use shardline_ops::audit::AuditEntry;
use shardline_ops::dlq::GroupSummary;
use shardline_ops::reconcile::RunSummary;
use shardline_ops::topology::{DlqLine, FleetView, ShardLine, StatusReport};

use crate::api::LettersParams;
use crate::history::{self, Sample};
use crate::html::{self, DeadLetters, Nav};
use crate::jobs::{JobState, JobView, Kind};
use crate::letter::{BODY_CAP, Body, Contents, Detail, Shown};
use crate::session::Principal;
use crate::token::Role;

const HOSTILE: &str = "a&b<c\u{0007}\"'>\u{202e}x";

fn q(name: &str, messages: u32, consumers: u32) -> ShardStatus {
    ShardStatus {
        queue: name.into(),
        messages,
        consumers,
    }
}

fn report(read_at_ms: u64) -> StatusReport {
    let t = Thresholds::default();
    let sr = |shard: u16, owner: &str, age: f64, inflight: Option<f64>| {
        serde_json::from_value(json!({
            "shard": shard, "owner": owner, "backlog_age_seconds": age,
            // The PAGE rests on a publisher's claim.
            "backlog_age_source": if age >= 120.0 { "publisher" } else { "received" },
            "inflight_age_seconds": inflight, "inflight_events": 2, "held_events": 1,
            "updated_at_ms": read_at_ms - 1000,
        }))
        .unwrap()
    };
    let shards = vec![
        ShardLine::new(
            0,
            q("s.0", 5, 1),
            Some(sr(0, "w<1>", 0.0, None)),
            read_at_ms,
            &t,
        ),
        ShardLine::new(
            1,
            q("s.1", 7, 1),
            Some(sr(1, HOSTILE, 45.0, Some(3.5))),
            read_at_ms,
            &t,
        ),
        ShardLine::new(
            2,
            q("s.2", 9, 1),
            Some(sr(2, "w2", 500.0, Some(90.0))),
            read_at_ms,
            &t,
        ),
        ShardLine::new(3, q("s.3", 3, 0), None, read_at_ms, &t),
        ShardLine::new(4, q("s.4", 3, 1), None, read_at_ms, &t),
        ShardLine::new(5, q("s.5", 0, 1), None, read_at_ms, &t),
        ShardLine::new(6, q("s.6", 0, 0), None, read_at_ms, &t),
    ];
    let worker = |name: &str, state: &str, reason: &str| -> WorkerReport {
        serde_json::from_value(json!({
            "worker": name, "assigned": [0, 1], "consuming": [0, 1], "updated_at_ms": read_at_ms,
            "breaker": {"state": state, "since_ms": read_at_ms - 65_000, "reason": reason},
        }))
        .unwrap()
    };
    let fleet = FleetView {
        members: vec![
            serde_json::from_value(json!({"member": "m<1>", "worker": HOSTILE,
                "joined_at_ms": 1, "lease_until_ms": read_at_ms + 4000}))
            .unwrap(),
            serde_json::from_value(json!({"member": "m2", "worker": "w2",
                "joined_at_ms": 1, "lease_until_ms": read_at_ms - 1}))
            .unwrap(),
        ],
        assignment: serde_json::from_value(json!({"assignment": {"generation": 7,
            "owners": {"0": "m<1>", "1": "m<1>", "2": "m2"}}}))
        .unwrap(),
    };
    StatusReport {
        url: "amqp://guest:***@127.0.0.1:5672/%2f?x=<y>&z".into(),
        shards,
        dlq: DlqLine {
            queue: q("orders.dlq<&>", 12, 0),
            by_reason: Default::default(),
            browsed: 0,
            indexed: Some(3),
        },
        workers: vec![
            worker("w<1>", "closed", ""),
            worker(HOSTILE, "open", "downstream <down> & out"),
            worker("w2", "half-open", "probe"),
        ],
        thresholds: t,
        status_error: Some("redis <gone> & away".into()),
        read_at_ms,
        fleet: Some(fleet),
        broker: vec![],
        topology: None,
        publishers: Vec::new(),
        relays: Vec::new(),
    }
}

fn entry(id: &str, order: Option<&str>) -> IndexEntry {
    IndexEntry {
        id: id.into(),
        reason: "handler<&>".into(),
        error: format!("boom {HOSTILE}"),
        order_id: order.map(Into::into),
        seq: Some(4),
        kind: Some("OrderPaid<x>".into()),
        shard: Some(2),
        first_failed_ms: 1_764_000_000_123,
        trace_id: Some("0af7651916cd43dd8448eb211c80319c".into()),
        attempts: Some(3),
        ..IndexEntry::default()
    }
    .grouped()
}

fn jobs() -> Vec<JobView> {
    let mut a = JobView::new(7, Kind::Replay, "ops<&>", format!("group {HOSTILE}"));
    a.started_ms = 1_764_000_000_000;
    a.done = 2;
    a.total = Some(5);
    a.lines = vec!["replayed <d1>".into(), String::new(), HOSTILE.into()];
    let mut b = JobView::new(8, Kind::ReconcileDryRun, "ops", "the fleet".into());
    b.started_ms = 1_764_000_001_000;
    b.state = JobState::Failed;
    b.error = Some("db <down> & out".into());
    let mut c = JobView::new(9, Kind::Purge, "ops", "2 letters".into());
    c.started_ms = 1_764_000_002_000;
    c.state = JobState::Done;
    c.total = Some(2);
    c.done = 2;
    vec![a, b, c]
}

fn who(role: Role, csrf: Option<&str>) -> Principal {
    Principal {
        name: format!("ops {HOSTILE}"),
        role,
        csrf: csrf.map(Into::into),
    }
}

pub(crate) fn pages() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut add = |name: &str, html: String| out.push((name.to_owned(), html));
    add("login", html::login("/", false).render().unwrap());
    add(
        "login-refused",
        html::login("/con<s>ole/", true).render().unwrap(),
    );
    add(
        "login-throttled",
        html::login_throttled("/", 300).render().unwrap(),
    );
    let t = Thresholds::default();
    let samples = vec![
        Sample {
            at_ms: 1_000,
            ages: vec![Some(0.0), None, Some(10.0)],
        },
        Sample {
            at_ms: 6_000,
            ages: vec![Some(200.0), Some(3.0), None],
        },
        Sample {
            at_ms: 11_000,
            ages: vec![Some(20.0), Some(4.0), Some(1.0)],
        },
    ];
    add("chart", history::chart(&samples, &t).render().unwrap());
    add("chart-empty", history::chart(&[], &t).render().unwrap());
    let status = Ok(report(1_764_000_100_000));
    let fleet = || html::fleet(&status, history::chart(&samples, &t));
    let shown = fleet().render().unwrap();
    assert!(
        shown.contains(r#"<td class="level-page">PAGE (publisher-claimed)</td>"#),
        "the fleet page names the label"
    );
    add("fleet", shown);
    let mut lean = report(1_764_000_100_000);
    lean.workers.clear();
    lean.fleet = None;
    lean.status_error = None;
    lean.dlq.indexed = None;
    let lean = Ok(lean);
    let err = Err(format!("refused {HOSTILE}"));
    add(
        "fleet-lean",
        html::fleet(&lean, history::chart(&[], &t))
            .render()
            .unwrap()
            .replace(&history::chart(&[], &t).render().unwrap(), ""),
    );
    add(
        "fleet-error",
        html::fleet(&err, history::chart(&[], &t)).render().unwrap(),
    );
    for (name, w) in [
        ("admin", who(Role::Admin, Some("c0ffee"))),
        ("viewer", who(Role::ReadOnly, Some("beef"))),
        ("bearer", who(Role::ReadOnly, None)),
    ] {
        for (base, bname) in [("/", "root"), ("/con\"sole/", "base")] {
            for (nav, nname) in [
                (Nav::Fleet, "fleet"),
                (Nav::DeadLetters, "dl"),
                (Nav::Audit, "audit"),
                (Nav::Reconcile, "rec"),
            ] {
                add(
                    &format!("page-{name}-{bname}-{nname}"),
                    html::page(base, "T<i>tle", &w, nav, html::fleet_page(base, fleet()))
                        .render()
                        .unwrap(),
                );
            }
        }
        let admin = w.role == Role::Admin;
        let groups = Ok(vec![GroupSummary {
            group: Group {
                id: "g\"1".into(),
                reason: "handler".into(),
                error: HOSTILE.into(),
            },
            count: 2,
            first_failed_ms: 1_764_000_000_000,
            last_failed_ms: 0,
            orders: 1,
        }]);
        let letters = Ok(vec![
            entry("d1\u{202e}/x y", Some("<o>")),
            entry("d2", None),
        ]);
        let full = LettersParams {
            group: Some("g\"1".into()),
            reason: Some("handler".into()),
            order: Some("<o>".into()),
            shard: Some("2".into()),
            from: Some(HOSTILE.into()),
            to: Some("".into()),
            q: Some("\"><script>".into()),
            limit: None,
        };
        let empty = LettersParams::default();
        let js = jobs();
        for (vname, g, l, p, j) in [
            ("full", &groups, &letters, &full, &js[..]),
            ("empty", &Ok(vec![]), &Ok(vec![]), &empty, &[][..]),
            (
                "errors",
                &Err(format!("index {HOSTILE}")),
                &Err("filters <x>".to_owned()),
                &empty,
                &js[..1],
            ),
        ] {
            let view = DeadLetters {
                groups: g,
                letters: l,
                params: p,
                jobs: j,
            };
            add(
                &format!("dead-{name}-{vname}"),
                html::dead_letters("/b<a>se/", &w, &view).render().unwrap(),
            );
        }
        add(
            &format!("jobs-{name}"),
            html::jobs(&js, admin).render().unwrap(),
        );
        add(
            &format!("jobs-{name}-none"),
            html::jobs(std::iter::empty(), admin).render().unwrap(),
        );
        for (dname, dry) in [("dry", true), ("nodry", false)] {
            let runs = Ok(vec![
                RunSummary {
                    at_ms: 1_764_000_000_000,
                    took_ms: 1500,
                    dry_run: false,
                    scanned: 10,
                    fresh: 1,
                    drifted: 2,
                    emitted: 2,
                    pending: 0,
                    error: None,
                },
                RunSummary {
                    at_ms: 1_764_000_000_000,
                    took_ms: 75_000,
                    dry_run: true,
                    scanned: 10,
                    fresh: 1,
                    drifted: 2,
                    emitted: 0,
                    pending: 1,
                    error: None,
                },
                RunSummary {
                    at_ms: 1_764_000_000_000,
                    ..RunSummary::failed(format!("pg {HOSTILE}"), Duration::from_millis(5))
                },
            ]);
            add(
                &format!("reconcile-{name}-{dname}"),
                html::reconcile("/", admin, dry, &runs, &js)
                    .render()
                    .unwrap(),
            );
            add(
                &format!("reconcile-{name}-{dname}-none"),
                html::reconcile("/x/", admin, dry, &Ok(vec![]), &[])
                    .render()
                    .unwrap(),
            );
            add(
                &format!("reconcile-{name}-{dname}-err"),
                html::reconcile("/", admin, dry, &Err(format!("r {HOSTILE}")), &js)
                    .render()
                    .unwrap(),
            );
        }
    }
    let audit = Ok(vec![
        AuditEntry {
            at_ms: 1_764_000_000_000,
            who: HOSTILE.into(),
            action: "replay<&>".into(),
            detail: json!({"group": HOSTILE, "n": 3}),
        },
        AuditEntry {
            at_ms: 0,
            who: "x".into(),
            action: "purge".into(),
            detail: json!(null),
        },
    ]);
    add("audit", html::audit(&audit).render().unwrap());
    add("audit-none", html::audit(&Ok(vec![])).render().unwrap());
    add(
        "audit-err",
        html::audit(&Err(format!("redis {HOSTILE}")))
            .render()
            .unwrap(),
    );
    let detail = |body: &[u8], headers: Vec<(String, String)>| Detail {
        entry: entry("d1<&>", Some("o\"1")),
        contents: Some(Contents {
            routing_key: format!("rk {HOSTILE}"),
            headers,
            body: Body::of(body),
        }),
    };
    let shown = |d: Detail| Ok(Shown::Letter(std::sync::Arc::new(d)));
    let headers = vec![
        (
            "x-error".to_owned(),
            format!("<svg onload=alert(1)>\u{2066}{HOSTILE}"),
        ),
        ("x<n>".to_owned(), "v".to_owned()),
    ];
    add(
        "letter-text",
        html::letter(
            "/b/",
            "d1",
            &shown(detail(
                format!("{{\"a\":\"{HOSTILE}\"}}\nline2\n").as_bytes(),
                headers.clone(),
            )),
        )
        .render()
        .unwrap(),
    );
    add(
        "letter-hex",
        html::letter(
            "/",
            "d1",
            &shown(detail(
                &(0..100u8).chain([0xff, 0xfe]).collect::<Vec<_>>(),
                vec![],
            )),
        )
        .render()
        .unwrap(),
    );
    add(
        "letter-big",
        html::letter(
            "/",
            "d1",
            &shown(detail(&vec![b'a'; BODY_CAP + 5], headers.clone())),
        )
        .render()
        .unwrap(),
    );
    let mut no_trace = detail(b"", vec![]);
    no_trace.entry.trace_id = None;
    no_trace.entry.order_id = None;
    no_trace.entry.seq = None;
    no_trace.entry.kind = None;
    no_trace.entry.shard = None;
    no_trace.entry.attempts = None;
    add(
        "letter-bare",
        html::letter("/", "d1", &shown(no_trace)).render().unwrap(),
    );
    let mut metadata = detail(b"", headers);
    metadata.contents = None;
    add(
        "letter-metadata",
        html::letter("/", "d1", &shown(metadata)).render().unwrap(),
    );
    add(
        "letter-beyond",
        html::letter("/", &format!("x{HOSTILE}"), &Ok(Shown::NotWithin(10_000)))
            .render()
            .unwrap(),
    );
    add(
        "letter-none",
        html::letter("/", &format!("x{HOSTILE}"), &Ok(Shown::NotFound))
            .render()
            .unwrap(),
    );
    add(
        "letter-err",
        html::letter("/", "x", &Err(format!("dlq {HOSTILE}")))
            .render()
            .unwrap(),
    );
    out
}

#[test]
fn every_page_shows_hostile_text_escaped_once() {
    let pages = pages();
    assert_eq!(pages.len(), 76);
    let mut shown = 0;
    for (name, html) in &pages {
        for raw in ['\u{7}', '\u{202e}'] {
            assert!(!html.contains(raw), "{name} shows a raw {raw:?}");
        }
        for markup in [
            "b<c",
            "<o>",
            "<y>",
            "<d1>",
            "<svg onload",
            "<script>",
            "&amp;amp;",
            "&amp;lt;",
        ] {
            assert!(!html.contains(markup), "{name} holds {markup}");
        }
        if html.contains("a&amp;b&lt;c\\u{7}&quot;&#39;&gt;\\u{202e}x") {
            shown += 1;
        }
    }
    assert!(shown > 50, "the hostile value appears in {shown} pages");
}
