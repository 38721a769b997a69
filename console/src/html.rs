//! The pages as templates (`console/templates/`): the layout, the login
//! form, the fleet section (also served alone for the 2 s refresh), the
//! dead-letters page and a letter, the jobs panel (also served alone), the
//! audit and reconcile pages. Each template has its struct here: the values
//! it shows, worked out in Rust; the markup is the template's alone.
//!
//! The engine is askama: its templates are compiled with the crate, so a
//! misspelt field or a template that does not parse fails the build rather
//! than a page in front of an operator; its `.html` templates escape every
//! `{{ }}` unless told otherwise; and a filter is a plain Rust function, so
//! the console's own escaping is one. (maud writes the markup as Rust
//! macros, minijinja parses its templates at run time.)
//!
//! Untrusted text goes through the `shown` filters, which call
//! [`crate::escape::text`]: the complete HTML escape and the visible bidi,
//! zero-width and control characters. Its result is marked safe, so the
//! engine does not escape it again (`&` becomes `&amp;` once, never
//! `&amp;amp;`). Whatever a template prints without them (numbers, words of
//! the console's own) still gets the engine's escaping.

use std::time::Duration;

use askama::Template;
use askama::filters::HtmlSafe;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use shardline_contract::fleet::MemberRecord;
use shardline_contract::letters::IndexEntry;
use shardline_contract::status::{BreakerState, Level, WorkerReport};
use shardline_ops::audit::AuditEntry;
use shardline_ops::dlq::GroupSummary;
use shardline_ops::reconcile::RunSummary;
use shardline_ops::topology::StatusReport;

use crate::api::{LettersParams, rfc3339};
use crate::guard::CSRF_FIELD;
use crate::history::Chart;
use crate::jobs::{JobState, JobView, Kind};
use crate::letter::{BODY_CAP, Contents, Detail, Shown};
use crate::session::Principal;
use crate::token::Role;

/// The templates' filters: the one escaping function, as `shown` (capped
/// to a table cell) and `shown_up_to(n)`. (askama's `filter_fn` expands each
/// into a `pub` type, which `unreachable_pub` would flag.)
#[allow(unreachable_pub)]
mod filters {
    use std::fmt::Display;

    use askama::filters::Safe;

    use crate::escape::{CELL_CHARS, text};

    /// Untrusted text, escaped and capped to a table cell.
    #[askama::filter_fn]
    pub(super) fn shown(
        value: impl Display,
        _: &dyn askama::Values,
    ) -> askama::Result<Safe<String>> {
        Ok(Safe(text(&value.to_string(), CELL_CHARS)))
    }

    /// Untrusted text, escaped, at most `max_chars` of its characters.
    #[askama::filter_fn]
    pub(super) fn shown_up_to(
        value: impl Display,
        _: &dyn askama::Values,
        max_chars: usize,
    ) -> askama::Result<Safe<String>> {
        Ok(Safe(text(&value.to_string(), max_chars)))
    }
}

/// Which page the navigation marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nav {
    Fleet,
    DeadLetters,
    Audit,
    Reconcile,
}

/// A link of the navigation.
struct Link {
    href: String,
    label: &'static str,
    here: bool,
}

/// A whole page around `body`.
#[derive(Template)]
#[template(path = "layout.html")]
pub(crate) struct Layout<'a, B: Template + HtmlSafe> {
    who: &'a Principal,
    title: &'a str,
    csrf: &'a str,
    csrf_field: &'static str,
    css: String,
    js: String,
    logout: String,
    links: [Link; 4],
    body: B,
}

/// A whole page around `body`.
pub(crate) fn page<'a, B: Template + HtmlSafe>(
    base: &str,
    title: &'a str,
    who: &'a Principal,
    nav: Nav,
    body: B,
) -> Layout<'a, B> {
    let link = |target: Nav, href: String, label: &'static str| Link {
        href,
        label,
        here: target == nav,
    };
    Layout {
        who,
        title,
        csrf: who.csrf.as_deref().unwrap_or(""),
        csrf_field: CSRF_FIELD,
        css: format!("{base}assets/console.css"),
        js: format!("{base}assets/console.js"),
        logout: format!("{base}logout"),
        links: [
            link(Nav::Fleet, base.to_owned(), "Fleet"),
            link(
                Nav::DeadLetters,
                format!("{base}dead-letters"),
                "Dead letters",
            ),
            link(Nav::Audit, format!("{base}audit"), "Audit"),
            link(Nav::Reconcile, format!("{base}reconcile"), "Reconcile"),
        ],
        body,
    }
}

/// The login form; `refused` when a token was not accepted, `wait_s` when
/// the address must wait before its next attempt is checked.
#[derive(Template)]
#[template(path = "login.html")]
pub(crate) struct Login {
    css: String,
    action: String,
    refused: bool,
    wait_s: Option<u64>,
}

pub(crate) fn login(base: &str, refused: bool) -> Login {
    Login {
        css: format!("{base}assets/console.css"),
        action: format!("{base}login"),
        refused,
        wait_s: None,
    }
}

/// The login form of an address that must wait `seconds`.
pub(crate) fn login_throttled(base: &str, seconds: u64) -> Login {
    Login {
        wait_s: Some(seconds),
        ..login(base, false)
    }
}

fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.1}s")
    } else {
        humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
    }
}

/// `value`, or `–` when there is none.
fn or_dash<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "–".to_owned(), |v| v.to_string())
}

/// The fleet page: the fleet section in its refreshed `<div>`.
#[derive(Template)]
#[template(path = "fleet_page.html")]
pub(crate) struct FleetPage<'a> {
    src: String,
    section: Fleet<'a>,
}

impl HtmlSafe for FleetPage<'_> {}

pub(crate) fn fleet_page<'a>(base: &str, section: Fleet<'a>) -> FleetPage<'a> {
    FleetPage {
        src: format!("{base}fragment/fleet"),
        section,
    }
}

/// The fleet section: the DLQ line, the chart, the shards, the workers, the
/// members. Wrapped by the page in `<div id="fleet">`, replaced every 2 s.
#[derive(Template)]
#[template(path = "fleet.html")]
pub(crate) struct Fleet<'a> {
    report: Result<Report<'a>, &'a str>,
    chart: Chart,
    every: u64,
}

impl HtmlSafe for Fleet<'_> {}

struct Report<'a> {
    report: &'a StatusReport,
    /// The recorded topology, a reshard in progress, retired queues, old
    /// routing still in use, the registered publishers (`topology status`'s lines).
    topology: Vec<String>,
    read_at: String,
    indexed: String,
    shards: Vec<ShardRow<'a>>,
    workers: Vec<WorkerRow<'a>>,
    members: Option<Members<'a>>,
}

struct ShardRow<'a> {
    shard: u16,
    messages: u32,
    consumers: u32,
    owner: &'a str,
    backlog_age: String,
    level: Option<Level>,
    /// `publisher-claimed` on a level resting on a publisher's claim.
    label: Option<&'static str>,
    inflight: String,
    inflight_age: String,
    held: String,
    breaker: Option<BreakerState>,
    note: &'static str,
}

struct WorkerRow<'a> {
    report: &'a WorkerReport,
    consuming: String,
    paused: String,
}

struct Members<'a> {
    generation: u64,
    rows: Vec<MemberRow<'a>>,
}

struct MemberRow<'a> {
    record: &'a MemberRecord,
    shards: usize,
    lease: String,
}

pub(crate) fn fleet<'a>(status: &'a Result<StatusReport, String>, chart: Chart) -> Fleet<'a> {
    Fleet {
        report: status.as_ref().map(report).map_err(String::as_str),
        chart,
        every: crate::history::EVERY.as_secs(),
    }
}

fn report(report: &StatusReport) -> Report<'_> {
    let shards = report
        .shards
        .iter()
        .map(|s| {
            let r = s.report.as_ref();
            let owner = s.owner();
            ShardRow {
                shard: s.shard,
                messages: s.queue.messages,
                consumers: s.queue.consumers,
                owner: owner.unwrap_or("–"),
                backlog_age: or_dash(s.backlog_age.map(seconds)),
                level: s.level,
                label: s.label,
                inflight: or_dash(r.map(|r| r.inflight_events)),
                inflight_age: or_dash(
                    r.and_then(|r| r.inflight_age_seconds)
                        .map(|a| seconds(Duration::try_from_secs_f64(a).unwrap_or_default())),
                ),
                held: or_dash(r.map(|r| r.held_events)),
                breaker: owner
                    .and_then(|o| report.workers.iter().find(|w| w.worker == o))
                    .map(|w| w.breaker.state),
                note: s.note(),
            }
        })
        .collect();
    let workers = report
        .workers
        .iter()
        .map(|w| WorkerRow {
            report: w,
            consuming: w
                .consuming
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            paused: if w.breaker.state == BreakerState::Closed {
                String::new()
            } else {
                seconds(w.breaker.paused_for(report.read_at_ms))
            },
        })
        .collect();
    let members = report.fleet.as_ref().map(|fleet| Members {
        generation: fleet.assignment.assignment.generation,
        rows: fleet
            .members
            .iter()
            .map(|m| {
                let left = m.lease_until_ms.saturating_sub(report.read_at_ms);
                MemberRow {
                    record: m,
                    shards: fleet.assignment.assignment.shards_of(&m.member).count(),
                    lease: if left == 0 {
                        "lapsed".to_owned()
                    } else {
                        format!("{} left", seconds(Duration::from_millis(left)))
                    },
                }
            })
            .collect(),
    });
    Report {
        topology: report.topology_lines(),
        report,
        read_at: rfc3339(report.read_at_ms).unwrap_or_default(),
        indexed: report.dlq.indexed.map_or("?".to_owned(), |n| n.to_string()),
        shards,
        workers,
        members,
    }
}

/// What the dead-letters page shows: the groups, the letters the filters
/// select, the filters as given, the jobs.
pub(crate) struct DeadLetters<'a> {
    pub(crate) groups: &'a Result<Vec<GroupSummary>, String>,
    pub(crate) letters: &'a Result<Vec<IndexEntry>, String>,
    pub(crate) params: &'a LettersParams,
    pub(crate) jobs: &'a [JobView],
}

/// The dead-letters page: filters, failure groups (a replay button each
/// for an admin), the matching letters (selectable for an admin, with
/// replay and purge), the release form, the jobs.
#[derive(Template)]
#[template(path = "dead_letters.html")]
pub(crate) struct DeadLettersPage<'a> {
    admin: bool,
    page_href: String,
    api_href: String,
    release_href: String,
    jobs_src: String,
    jobs_api: String,
    rate: f64,
    filters: [Filter<'a>; 6],
    group: Option<&'a String>,
    groups: Result<Vec<GroupRow<'a>>, &'a str>,
    letters: Result<Vec<LetterRow<'a>>, &'a str>,
    jobs: Jobs<'a>,
}

impl HtmlSafe for DeadLettersPage<'_> {}

/// A text input of the filter form, holding its value.
struct Filter<'a> {
    name: &'static str,
    label: &'static str,
    value: &'a str,
    placeholder: &'static str,
}

struct GroupRow<'a> {
    summary: &'a GroupSummary,
    first: String,
    last: String,
    href: String,
}

struct LetterRow<'a> {
    facts: Facts<'a>,
    href: String,
}

/// An entry's order, seq, event, shard, attempts and first failure.
struct Facts<'a> {
    entry: &'a IndexEntry,
    order: &'a str,
    seq: String,
    kind: &'a str,
    shard: String,
    attempts: String,
    failed: String,
}

fn facts(entry: &IndexEntry) -> Facts<'_> {
    Facts {
        entry,
        order: entry.order_id.as_deref().unwrap_or("–"),
        seq: or_dash(entry.seq),
        kind: entry.kind.as_deref().unwrap_or("–"),
        shard: or_dash(entry.shard),
        attempts: or_dash(entry.attempts),
        failed: rfc3339(entry.first_failed_ms).unwrap_or_default(),
    }
}

pub(crate) fn dead_letters<'a>(
    base: &str,
    who: &Principal,
    page: &DeadLetters<'a>,
) -> DeadLettersPage<'a> {
    let admin = who.role == Role::Admin;
    let p = page.params;
    let filter = |name, label, value: &'a Option<String>, placeholder| Filter {
        name,
        label,
        value: value.as_deref().unwrap_or(""),
        placeholder,
    };
    DeadLettersPage {
        admin,
        page_href: format!("{base}dead-letters"),
        api_href: format!("{base}api/"),
        release_href: format!("{base}api/dlq/release"),
        jobs_src: format!("{base}fragment/jobs"),
        jobs_api: format!("{base}api/jobs/"),
        rate: crate::actions::DEFAULT_RATE,
        filters: [
            filter("q", "Search", &p.q, "order id or dead-letter id"),
            filter("reason", "Reason", &p.reason, "handler"),
            filter("order", "Order", &p.order, ""),
            filter("shard", "Shard", &p.shard, ""),
            filter("from", "From", &p.from, "2026-12-01T10:00:00Z"),
            filter("to", "To", &p.to, ""),
        ],
        group: p.group.as_ref(),
        groups: page
            .groups
            .as_ref()
            .map(|groups| {
                groups
                    .iter()
                    .map(|g| GroupRow {
                        summary: g,
                        first: rfc3339(g.first_failed_ms).unwrap_or_default(),
                        last: rfc3339(g.last_failed_ms).unwrap_or_default(),
                        href: format!("{base}dead-letters?group={}", g.group.id),
                    })
                    .collect()
            })
            .map_err(String::as_str),
        letters: page
            .letters
            .as_ref()
            .map(|letters| {
                letters
                    .iter()
                    .map(|l| LetterRow {
                        facts: facts(l),
                        href: format!(
                            "{base}dead-letters/letter/{}",
                            percent_encoding::utf8_percent_encode(
                                &l.id,
                                percent_encoding::NON_ALPHANUMERIC
                            )
                        ),
                    })
                    .collect()
            })
            .map_err(String::as_str),
        jobs: jobs(page.jobs.iter(), admin),
    }
}

/// The jobs panel (also served alone, refreshed when a job starts).
#[derive(Template)]
#[template(path = "jobs.html")]
pub(crate) struct Jobs<'a> {
    jobs: Vec<JobRow<'a>>,
}

impl HtmlSafe for Jobs<'_> {}

struct JobRow<'a> {
    view: &'a JobView,
    started: String,
    progress: String,
    cancel: bool,
}

pub(crate) fn jobs<'a>(jobs: impl IntoIterator<Item = &'a JobView>, admin: bool) -> Jobs<'a> {
    Jobs {
        jobs: jobs
            .into_iter()
            .map(|view| JobRow {
                view,
                started: rfc3339(view.started_ms).unwrap_or_default(),
                progress: view.progress(),
                cancel: admin && view.state == JobState::Running,
            })
            .collect(),
    }
}

/// A letter's detail: what the index knows; for an admin, its headers and
/// body too.
#[derive(Template)]
#[template(path = "letter.html")]
pub(crate) struct Letter<'a> {
    back: String,
    id: &'a str,
    detail: Result<Lookup<'a>, &'a str>,
    body_cap_kib: usize,
}

impl HtmlSafe for Letter<'_> {}

/// What the letter page found.
enum Lookup<'a> {
    Letter(LetterDetail<'a>),
    NotFound,
    NotWithin(String),
}

struct LetterDetail<'a> {
    facts: Facts<'a>,
    group_href: String,
    trace_id: &'a str,
    /// `None` for a read-only token: metadata only.
    contents: Option<&'a Contents>,
    hex_lines: String,
}

/// Hex digits in pairs, 32 bytes a line.
fn hex_lines(hex: &str) -> String {
    let pairs: Vec<&str> = hex
        .as_bytes()
        .chunks(2)
        .filter_map(|p| std::str::from_utf8(p).ok())
        .collect();
    pairs
        .chunks(32)
        .map(|line| line.join(" "))
        .collect::<Vec<_>>()
        .join("\n")
}

fn letter_detail<'a>(base: &str, d: &'a Detail) -> LetterDetail<'a> {
    let contents = d.contents.as_ref();
    LetterDetail {
        facts: facts(&d.entry),
        group_href: format!("{base}dead-letters?group={}", d.entry.group),
        trace_id: d.entry.trace_id.as_deref().unwrap_or("–"),
        contents,
        hex_lines: match contents {
            Some(c) if c.body.hex => hex_lines(&c.body.text),
            _ => String::new(),
        },
    }
}

pub(crate) fn letter<'a>(base: &str, id: &'a str, shown: &'a Result<Shown, String>) -> Letter<'a> {
    Letter {
        back: format!("{base}dead-letters"),
        id,
        detail: shown
            .as_ref()
            .map(|shown| match shown {
                Shown::Letter(d) => Lookup::Letter(letter_detail(base, d)),
                Shown::NotFound => Lookup::NotFound,
                Shown::NotWithin(within) => Lookup::NotWithin(crate::api::not_within(id, *within)),
            })
            .map_err(String::as_str),
        body_cap_kib: BODY_CAP / 1024,
    }
}

/// The audit log's latest entries.
#[derive(Template)]
#[template(path = "audit.html")]
pub(crate) struct Audit<'a> {
    cap: usize,
    entries: Result<Vec<AuditRow<'a>>, &'a str>,
}

impl HtmlSafe for Audit<'_> {}

struct AuditRow<'a> {
    entry: &'a AuditEntry,
    at: String,
}

pub(crate) fn audit(entries: &Result<Vec<AuditEntry>, String>) -> Audit<'_> {
    Audit {
        cap: shardline_ops::audit::CAP,
        entries: entries
            .as_ref()
            .map(|entries| {
                entries
                    .iter()
                    .map(|entry| AuditRow {
                        entry,
                        at: rfc3339(entry.at_ms).unwrap_or_default(),
                    })
                    .collect()
            })
            .map_err(String::as_str),
    }
}

/// The reconcile runs, and the dry-run button when the console has the
/// order database.
#[derive(Template)]
#[template(path = "reconcile.html")]
pub(crate) struct Reconcile<'a> {
    cap: usize,
    admin: bool,
    dry_run: bool,
    dry_run_href: String,
    runs: Result<Vec<RunRow<'a>>, &'a str>,
    jobs_src: String,
    jobs_api: String,
    jobs: Jobs<'a>,
}

impl HtmlSafe for Reconcile<'_> {}

struct RunRow<'a> {
    run: &'a RunSummary,
    at: String,
    took: String,
}

pub(crate) fn reconcile<'a>(
    base: &str,
    admin: bool,
    dry_run: bool,
    runs: &'a Result<Vec<RunSummary>, String>,
    jobs_now: &'a [JobView],
) -> Reconcile<'a> {
    Reconcile {
        cap: shardline_ops::reconcile::RUNS_CAP,
        admin,
        dry_run,
        dry_run_href: format!("{base}api/reconcile/dry-run"),
        runs: runs
            .as_ref()
            .map(|runs| {
                runs.iter()
                    .map(|run| RunRow {
                        run,
                        at: rfc3339(run.at_ms).unwrap_or_default(),
                        took: seconds(Duration::from_millis(run.took_ms)),
                    })
                    .collect()
            })
            .map_err(String::as_str),
        jobs_src: format!(
            "{base}fragment/jobs?kind={}",
            Kind::ReconcileDryRun.as_str()
        ),
        jobs_api: format!("{base}api/jobs/"),
        jobs: jobs(
            jobs_now.iter().filter(|j| j.kind == Kind::ReconcileDryRun),
            admin,
        ),
    }
}

/// A template as the response's HTML; a 500 when it could not be rendered.
pub(crate) fn respond(template: &impl Template) -> Response {
    match template.render() {
        Ok(html) => Html(html).into_response(),
        Err(error) => {
            tracing::error!(%error, "console: a page could not be rendered");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use shardline_contract::letters::Group;

    use super::*;

    fn admin() -> Principal {
        Principal {
            name: "ops<b>".into(),
            role: Role::Admin,
            csrf: Some("c".repeat(64)),
        }
    }

    #[test]
    fn a_hostile_failure_group_renders_as_text() {
        let group = GroupSummary {
            group: Group {
                id: "abc\"><script>".into(),
                reason: "handler\u{202e}".into(),
                error: "<script>alert(1)</script>\u{200b}\0 <img src=x onerror=alert(1)>".into(),
            },
            count: 2,
            first_failed_ms: 1,
            last_failed_ms: 2,
            orders: 1,
        };
        let letter = IndexEntry {
            id: "d1\u{202e}".into(),
            reason: "handler".into(),
            error: "<b>bold</b>".into(),
            order_id: Some("<o>".into()),
            ..IndexEntry::default()
        };
        let groups = Ok(vec![group]);
        let letters = Ok(vec![letter]);
        let params = LettersParams {
            q: Some("\"><script>".into()),
            ..LettersParams::default()
        };
        let view = DeadLetters {
            groups: &groups,
            letters: &letters,
            params: &params,
            jobs: &[],
        };
        let html = dead_letters("/", &admin(), &view).render().unwrap();
        assert!(!html.contains("<script"), "{html}");
        assert!(!html.contains("<img") && !html.contains("<b>") && !html.contains("<o>"));
        assert!(!html.contains('\u{202e}') && !html.contains('\u{200b}') && !html.contains('\0'));
        assert!(
            html.contains("&lt;script&gt;alert(1)&lt;/script&gt;\\u{200b}\\u{0}"),
            "{html}"
        );
        assert!(html.contains("handler\\u{202e}"), "{html}");
        assert!(
            html.contains("value=\"&quot;&gt;&lt;script&gt;\""),
            "{html}"
        );
        assert!(html.contains("dead-letters/letter/d1%E2%80%AE"), "{html}");
        for admin_only in [
            "id=\"release\"",
            "class=\"replay-group\"",
            "id=\"purge-selected\"",
            "class=\"select\"",
        ] {
            assert!(html.contains(admin_only), "an admin sees {admin_only}");
        }
        let body = dead_letters("/", &admin(), &view);
        let page = page("/", "Dead letters", &admin(), Nav::DeadLetters, body)
            .render()
            .unwrap();
        assert!(page.contains("ops&lt;b&gt; (admin)"), "{page}");
        let read_only = Principal {
            role: Role::ReadOnly,
            ..admin()
        };
        let html = dead_letters("/", &read_only, &view).render().unwrap();
        for admin_only in [
            "id=\"release\"",
            "replay-group",
            "purge-selected",
            "class=\"select\"",
            "replay-rate",
        ] {
            assert!(!html.contains(admin_only), "read-only sees no {admin_only}");
        }
    }

    #[test]
    fn a_hostile_letter_renders_as_text_or_hex() {
        let detail = |body: &[u8]| Detail {
            entry: IndexEntry {
                id: "d1".into(),
                reason: "decode".into(),
                error: "not JSON".into(),
                trace_id: Some("0af7651916cd43dd8448eb211c80319c".into()),
                attempts: Some(3),
                ..IndexEntry::default()
            }
            .grouped(),
            contents: Some(Contents {
                routing_key: "decode".into(),
                headers: vec![("x-error".into(), "<svg onload=alert(1)>\u{2066}".into())],
                body: crate::letter::Body::of(body),
            }),
        };
        let shown = |d: Detail| Ok(Shown::Letter(std::sync::Arc::new(d)));
        let hostile = shown(detail(
            "<script>window.__pwned=1</script>\u{202e}\u{200b}".as_bytes(),
        ));
        let html = letter("/", "d1", &hostile).render().unwrap();
        assert!(
            !html.contains("<script") && !html.contains("<svg"),
            "{html}"
        );
        assert!(
            html.contains("&lt;script&gt;window.__pwned=1&lt;/script&gt;\\u{202e}\\u{200b}"),
            "{html}"
        );
        assert!(
            html.contains("&lt;svg onload=alert(1)&gt;\\u{2066}"),
            "{html}"
        );
        assert!(html.contains("<code id=\"trace-id\">0af7651916cd43dd8448eb211c80319c</code>"));
        assert!(html.contains("<td id=\"attempts\">3</td>"));
        let hex = shown(detail(b"<a>\xff\xfe"));
        let html = letter("/", "d1", &hex).render().unwrap();
        assert!(
            html.contains("<pre id=\"body\" class=\"hex\">3c 61 3e ff fe</pre>"),
            "{html}"
        );
        let big = vec![b'a'; BODY_CAP + 1];
        let big = shown(detail(&big));
        let html = letter("/", "d1", &big).render().unwrap();
        assert!(html.contains("id=\"body-note\""));
        assert!(
            letter("/", "x<", &Ok(Shown::NotFound))
                .render()
                .unwrap()
                .contains("No dead letter <code>x&lt;</code>")
        );
        let beyond = letter("/", "x<", &Ok(Shown::NotWithin(10_000)))
            .render()
            .unwrap();
        assert!(
            beyond.contains("id=\"not-within\"")
                && beyond.contains("x&lt; is not within the first 10000 letters of the DLQ"),
            "{beyond}"
        );
        // A read-only token: the index's facts, no routing key, headers or body.
        let mut metadata = detail(b"secret body");
        metadata.contents = None;
        let html = letter("/", "d1", &shown(metadata)).render().unwrap();
        assert!(
            html.contains("<td id=\"attempts\">3</td>") && html.contains("id=\"metadata-only\"")
        );
        for hidden in [
            "secret body",
            "x-error",
            "id=\"body\"",
            "id=\"headers\"",
            "routing key",
        ] {
            assert!(!html.contains(hidden), "read-only sees {hidden}");
        }
    }

    #[test]
    fn a_job_shows_its_progress_and_a_cancel_button_while_it_runs() {
        let mut view = JobView::new(7, Kind::Replay, "ops", "group <g>".into());
        view.done = 2;
        view.total = Some(5);
        view.lines = vec!["replayed <d1>".into()];
        let html = jobs([&view], true).render().unwrap();
        assert!(
            html.contains("data-job=\"7\" data-state=\"running\""),
            "{html}"
        );
        assert!(html.contains("replayed 2 of 5") && html.contains("class=\"cancel\""));
        assert!(html.contains("group &lt;g&gt;") && html.contains("replayed &lt;d1&gt;"));
        let html = jobs([&view], false).render().unwrap();
        assert!(!html.contains("class=\"cancel\""));
        view.state = JobState::Done;
        assert!(
            !jobs([&view], true)
                .render()
                .unwrap()
                .contains("class=\"cancel\"")
        );
    }

    #[test]
    fn untrusted_text_is_escaped_once_with_its_control_characters_shown() {
        let view = JobView::new(1, Kind::Replay, "a&b<c\u{0007}", "a&b<c\u{0007}".into());
        let html = jobs([&view], false).render().unwrap();
        assert!(
            html.contains("of a&amp;b&lt;c\\u{7} by a&amp;b&lt;c\\u{7}, started"),
            "{html}"
        );
    }

    #[test]
    fn an_unreadable_fleet_says_why() {
        let status = Err("connection refused <x>".into());
        let html = fleet(&status, crate::history::chart(&[], &Default::default()))
            .render()
            .unwrap();
        assert!(html.contains("connection refused &lt;x&gt;"), "{html}");
    }
}
