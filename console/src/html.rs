//! The pages as HTML text: the layout, the login form, the fleet section
//! (also served alone for the 2 s refresh) and the failure groups. Every
//! value that is not a literal of this file goes through [`crate::escape`].

use std::fmt::Write as _;
use std::time::Duration;

use shardline_contract::letters::IndexEntry;
use shardline_contract::status::BreakerState;
use shardline_ops::audit::AuditEntry;
use shardline_ops::dlq::GroupSummary;
use shardline_ops::reconcile::RunSummary;
use shardline_ops::topology::StatusReport;

use crate::api::{Detail, LettersParams, rfc3339};
use crate::escape::{CELL_CHARS, text};
use crate::guard::CSRF_FIELD;
use crate::jobs::{JobState, JobView, Kind};
use crate::session::Principal;
use crate::token::Role;

/// Escaped, capped to a table cell.
fn e(value: &str) -> String {
    text(value, CELL_CHARS)
}

/// Which page the navigation marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nav {
    Fleet,
    DeadLetters,
    Audit,
    Reconcile,
}

/// A whole page around `body`.
pub(crate) fn page(base: &str, title: &str, who: &Principal, nav: Nav, body: &str) -> String {
    let link = |target: Nav, href: &str, label: &str| {
        let class = if target == nav { " class=\"here\"" } else { "" };
        format!("<a href=\"{}\"{class}>{label}</a>", e(href))
    };
    let csrf = who.csrf.as_deref().unwrap_or("");
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta name=\"csrf-token\" content=\"{csrf}\">\
         <title>{title} · shardline</title>\
         <link rel=\"stylesheet\" href=\"{css}\"></head><body>\
         <header><strong>shardline</strong>{fleet}{dead}{audit}{reconcile}\
         <span class=\"who\">{name} ({role}) \
         <form method=\"post\" action=\"{logout}\"><input type=\"hidden\" name=\"{CSRF_FIELD}\" value=\"{csrf}\">\
         <button type=\"submit\">Log out</button></form></span></header>\
         <main>{body}</main><script src=\"{js}\"></script></body></html>\n",
        csrf = e(csrf),
        title = e(title),
        css = e(&format!("{base}assets/console.css")),
        js = e(&format!("{base}assets/console.js")),
        fleet = link(Nav::Fleet, base, "Fleet"),
        dead = link(
            Nav::DeadLetters,
            &format!("{base}dead-letters"),
            "Dead letters"
        ),
        audit = link(Nav::Audit, &format!("{base}audit"), "Audit"),
        reconcile = link(Nav::Reconcile, &format!("{base}reconcile"), "Reconcile"),
        name = e(&who.name),
        role = who.role.as_str(),
        logout = e(&format!("{base}logout")),
    )
}

/// The login form; `refused` when a token was not accepted.
pub(crate) fn login(base: &str, refused: bool) -> String {
    let note = if refused {
        "<p class=\"error\">That token was not accepted.</p>"
    } else {
        ""
    };
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>Log in · shardline</title><link rel=\"stylesheet\" href=\"{css}\"></head><body>\
         <form class=\"login\" method=\"post\" action=\"{action}\"><h1>shardline console</h1>{note}\
         <label for=\"token\">Token</label>\
         <input type=\"password\" id=\"token\" name=\"token\" autocomplete=\"current-password\" required autofocus>\
         <button type=\"submit\">Log in</button></form></body></html>\n",
        css = e(&format!("{base}assets/console.css")),
        action = e(&format!("{base}login")),
    )
}

fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.1}s")
    } else {
        humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
    }
}

/// The fleet section: the DLQ line, the shards, the workers, the members.
/// Wrapped by the page in `<div id="fleet">`, replaced every 2 s.
pub(crate) fn fleet(status: &Result<StatusReport, String>, chart: &str) -> String {
    let report = match status {
        Ok(report) => report,
        Err(error) => {
            return format!(
                "<p class=\"error\">The fleet status could not be read: {}</p>",
                text(error, 1000)
            );
        }
    };
    let mut out = format!(
        "<p>Broker <code>{}</code> · read at {}</p>",
        e(&report.url),
        rfc3339(report.read_at_ms).unwrap_or_default()
    );
    if let Some(error) = &report.status_error {
        let _ = write!(
            out,
            "<p class=\"error\">Shard status unavailable (Redis: {}): owner and backlog unknown.</p>",
            e(error)
        );
    }
    let dlq = &report.dlq;
    let _ = write!(
        out,
        "<p>Dead-letter queue <code>{}</code>: {} letter(s), {} indexed.</p>",
        e(&dlq.queue.queue),
        dlq.queue.messages,
        dlq.indexed.map_or("?".to_owned(), |n| n.to_string()),
    );
    if dlq.reindex_needed() {
        out.push_str(
            "<p class=\"warning\">Reindex needed: the DLQ holds letters its index does not know \
             (<code>shardline dlq reindex</code>).</p>",
        );
    }
    let _ = write!(
        out,
        "<h2>Backlog age, last minutes</h2><div class=\"chart\">{chart}</div>\
         <p class=\"muted\">Sampled every {} s by this console and kept in its memory (a restart \
         starts it empty); Prometheus keeps the workers' <code>shardline_backlog_age_seconds</code> longer.</p>",
        crate::history::EVERY.as_secs()
    );
    out.push_str(
        "<h2>Shards</h2><table id=\"shards\"><thead><tr><th>shard</th><th>depth</th><th>consumers</th>\
         <th>owner</th><th>backlog age</th><th>level</th><th>in flight</th><th>in-flight age</th>\
         <th>held</th><th>breaker</th><th>note</th></tr></thead><tbody>",
    );
    for s in &report.shards {
        let owner = s.report.as_ref().map(|r| r.owner.as_str());
        let breaker = owner
            .and_then(|o| report.workers.iter().find(|w| w.worker == o))
            .map(|w| w.breaker.state);
        let (level_class, level) = match s.level {
            Some(l) => (
                format!(" class=\"level-{}\"", l.as_str().to_ascii_lowercase()),
                l.as_str(),
            ),
            None => (String::new(), "–"),
        };
        let breaker_cell = match breaker {
            Some(b) if b != BreakerState::Closed => {
                format!("<td class=\"breaker-{0}\">{0}</td>", b.as_str())
            }
            Some(b) => format!("<td>{}</td>", b.as_str()),
            None => "<td>–</td>".to_owned(),
        };
        let r = s.report.as_ref();
        let _ = write!(
            out,
            "<tr data-shard=\"{}\"><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td>{}</td><td class=\"num\">{}</td><td{level_class}>{level}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>{breaker_cell}\
             <td class=\"note\">{}</td></tr>",
            s.shard,
            s.shard,
            s.queue.messages,
            s.queue.consumers,
            owner.map_or("–".to_owned(), e),
            s.backlog_age.map_or("–".to_owned(), seconds),
            r.map_or("–".to_owned(), |r| r.inflight_events.to_string()),
            r.and_then(|r| r.inflight_age_seconds)
                .map_or("–".to_owned(), |a| {
                    seconds(Duration::try_from_secs_f64(a).unwrap_or_default())
                }),
            r.map_or("–".to_owned(), |r| r.held_events.to_string()),
            e(s.note()),
        );
    }
    out.push_str("</tbody></table>");
    if !report.workers.is_empty() {
        out.push_str(
            "<h2>Workers</h2><table><thead><tr><th>worker</th><th>consuming</th>\
             <th>breaker</th><th>since</th><th>reason</th></tr></thead><tbody>",
        );
        for w in &report.workers {
            let consuming: Vec<String> = w.consuming.iter().map(u16::to_string).collect();
            let paused = (w.breaker.state != BreakerState::Closed)
                .then(|| seconds(w.breaker.paused_for(report.read_at_ms)));
            let _ = write!(
                out,
                "<tr><td>{worker}</td><td>{consuming}</td><td class=\"breaker-{state}\">{state}</td>\
                 <td>{paused}</td><td>{reason}</td></tr>",
                worker = e(&w.worker),
                consuming = e(&consuming.join(", ")),
                state = w.breaker.state.as_str(),
                paused = paused.unwrap_or_default(),
                reason = e(&w.breaker.reason),
            );
        }
        out.push_str("</tbody></table>");
    }
    if let Some(fleet) = &report.fleet {
        let _ = write!(
            out,
            "<h2>Members</h2><p>Assignment generation {}.</p><table><thead><tr><th>member</th>\
             <th>worker</th><th>shards assigned</th><th>lease</th></tr></thead><tbody>",
            fleet.assignment.assignment.generation
        );
        for m in &fleet.members {
            let left = m.lease_until_ms.saturating_sub(report.read_at_ms);
            let lease = if left == 0 {
                "lapsed".to_owned()
            } else {
                format!("{} left", seconds(Duration::from_millis(left)))
            };
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{lease}</td></tr>",
                e(&m.member),
                e(&m.worker),
                fleet.assignment.assignment.shards_of(&m.member).count(),
            );
        }
        out.push_str("</tbody></table>");
    }
    out
}

/// What the dead-letters page shows: the groups, the letters the filters
/// select, the filters as given, the jobs.
pub(crate) struct DeadLetters<'a> {
    pub(crate) groups: &'a Result<Vec<GroupSummary>, String>,
    pub(crate) letters: &'a Result<Vec<IndexEntry>, String>,
    pub(crate) params: &'a LettersParams,
    pub(crate) jobs: &'a [JobView],
}

/// A text input of the filter form, holding its value.
fn input(name: &str, label: &str, value: Option<&String>, placeholder: &str) -> String {
    format!(
        "<label>{label} <input name=\"{name}\" value=\"{}\" placeholder=\"{}\"></label> ",
        e(value.map_or("", String::as_str)),
        e(placeholder)
    )
}

/// The dead-letters page: filters, failure groups (a replay button each
/// for an admin), the matching letters (selectable for an admin, with
/// replay and purge), the release form, the jobs.
pub(crate) fn dead_letters(base: &str, who: &Principal, page: &DeadLetters<'_>) -> String {
    let admin = who.role == Role::Admin;
    let p = page.params;
    let mut out = String::from("<h1>Dead letters</h1>");
    let _ = write!(
        out,
        "<form id=\"filters\" method=\"get\" action=\"{}\">{}{}{}{}{}{}{}\
         <button type=\"submit\">Filter</button> <a href=\"{}\">clear</a></form>",
        e(&format!("{base}dead-letters")),
        input("q", "Search", p.q.as_ref(), "order id or dead-letter id"),
        input("reason", "Reason", p.reason.as_ref(), "handler"),
        input("order", "Order", p.order.as_ref(), ""),
        input("shard", "Shard", p.shard.as_ref(), ""),
        input("from", "From", p.from.as_ref(), "2026-12-01T10:00:00Z"),
        input("to", "To", p.to.as_ref(), ""),
        p.group.as_ref().map_or(String::new(), |g| format!(
            "<input type=\"hidden\" name=\"group\" value=\"{}\">",
            e(g)
        )),
        e(&format!("{base}dead-letters")),
    );
    if admin {
        let _ = write!(
            out,
            "<p class=\"actions\" data-api=\"{api}\"><label>Replay rate \
             <input id=\"replay-rate\" type=\"number\" min=\"0.1\" step=\"any\" value=\"{rate}\"> events/s</label> \
             (key-ordered: each order's letters in seq order, one confirmed at a time)</p>\
             <p id=\"action-result\" class=\"muted\"></p>",
            api = e(&format!("{base}api/")),
            rate = crate::actions::DEFAULT_RATE,
        );
    }
    let _ = write!(
        out,
        "<div id=\"index-view\">{}{}</div>",
        groups_table(base, admin, page.groups),
        letters_table(base, admin, page.letters)
    );
    if admin {
        let _ = write!(
            out,
            "<h2>Release a quarantined order</h2>\
             <form id=\"release\" data-api=\"{}\"><label for=\"order_id\">Order id</label> \
             <input id=\"order_id\" name=\"order_id\" required> <button type=\"submit\">Release</button></form>\
             <p id=\"release-result\" class=\"muted\"></p>",
            e(&format!("{base}api/dlq/release")),
        );
    }
    let _ = write!(
        out,
        "<h2>Jobs</h2><div id=\"jobs\" data-src=\"{}\" data-api=\"{}\">{}</div>",
        e(&format!("{base}fragment/jobs")),
        e(&format!("{base}api/jobs/")),
        jobs(page.jobs, admin),
    );
    out
}

fn groups_table(base: &str, admin: bool, groups: &Result<Vec<GroupSummary>, String>) -> String {
    let groups = match groups {
        Err(error) => {
            return format!(
                "<p class=\"error\">The dead-letter index could not be read: {}</p>",
                text(error, 1000)
            );
        }
        Ok(groups) if groups.is_empty() => {
            return "<h2>Failure groups</h2><p id=\"no-groups\">No dead letters in the index.</p>"
                .to_owned();
        }
        Ok(groups) => groups,
    };
    let mut out = String::from(
        "<h2>Failure groups</h2><table id=\"groups\"><thead><tr><th>reason</th><th>error (normalised)</th>\
         <th>letters</th><th>orders</th><th>first failure</th><th>last failure</th>\
         <th>group</th>",
    );
    if admin {
        out.push_str("<th>action</th>");
    }
    out.push_str("</tr></thead><tbody>");
    for g in groups {
        let letters = format!("{base}dead-letters?group={}", g.group.id);
        let _ = write!(
            out,
            "<tr data-group=\"{id}\"><td>{}</td><td>{}</td><td class=\"num count\">{}</td><td class=\"num\">{}</td>\
             <td>{}</td><td>{}</td><td><a href=\"{}\"><code>{id}</code></a></td>",
            e(&g.group.reason),
            e(&g.group.error),
            g.count,
            g.orders,
            rfc3339(g.first_failed_ms).unwrap_or_default(),
            rfc3339(g.last_failed_ms).unwrap_or_default(),
            e(&letters),
            id = e(&g.group.id),
        );
        if admin {
            let _ = write!(
                out,
                "<td><button type=\"button\" class=\"replay-group\" data-group=\"{}\">Replay group</button></td>",
                e(&g.group.id)
            );
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
    out
}

fn letters_table(base: &str, admin: bool, letters: &Result<Vec<IndexEntry>, String>) -> String {
    let letters = match letters {
        Err(error) => return format!("<p class=\"error\">{}</p>", text(error, 1000)),
        Ok(letters) if letters.is_empty() => {
            return "<h2>Letters</h2><p id=\"no-letters\">No letters match.</p>".to_owned();
        }
        Ok(letters) => letters,
    };
    let mut out = format!(
        "<h2>Letters</h2><p class=\"muted\">{} letter(s), oldest first.</p>",
        letters.len()
    );
    if admin {
        out.push_str(
            "<p><button type=\"button\" id=\"replay-selected\">Replay selected</button> \
             <button type=\"button\" id=\"purge-selected\">Purge selected…</button></p>\
             <div id=\"purge-confirm\" hidden><p class=\"warning\" id=\"purge-confirm-text\"></p>\
             <button type=\"button\" id=\"purge-confirm-yes\">Purge for good</button> \
             <button type=\"button\" id=\"purge-confirm-no\">Keep them</button></div>",
        );
    }
    out.push_str("<table id=\"letters\"><thead><tr>");
    if admin {
        out.push_str(
            "<th><input type=\"checkbox\" id=\"select-all\" aria-label=\"select all\"></th>",
        );
    }
    out.push_str(
        "<th>dead letter</th><th>reason</th><th>error</th><th>order</th><th>seq</th><th>event</th>\
         <th>shard</th><th>attempts</th><th>first failed</th></tr></thead><tbody>",
    );
    for l in letters {
        let _ = write!(out, "<tr data-letter=\"{}\">", e(&l.id));
        if admin {
            let _ = write!(
                out,
                "<td><input type=\"checkbox\" class=\"select\" value=\"{}\"></td>",
                e(&l.id)
            );
        }
        let [order, seq, kind, shard, attempts, failed] = facts(l);
        let href = format!(
            "{base}dead-letters/letter/{}",
            percent_encoding::utf8_percent_encode(&l.id, percent_encoding::NON_ALPHANUMERIC)
        );
        let _ = write!(
            out,
            "<td><a class=\"letter\" href=\"{}\"><code>{}</code></a></td><td>{}</td><td>{}</td><td>{}</td>\
             <td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            e(&href),
            e(&l.id),
            e(&l.reason),
            e(&l.error),
            order,
            seq,
            kind,
            shard,
            attempts,
            failed,
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// An entry's order, seq, event, shard, attempts and first failure, as cells.
fn facts(l: &IndexEntry) -> [String; 6] {
    [
        l.order_id.as_deref().map_or("–".to_owned(), e),
        opt(l.seq),
        l.kind.as_deref().map_or("–".to_owned(), e),
        opt(l.shard),
        opt(l.attempts),
        rfc3339(l.first_failed_ms).unwrap_or_default(),
    ]
}

fn opt<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "–".to_owned(), |v| v.to_string())
}

/// The jobs panel (also served alone, refreshed when a job starts).
pub(crate) fn jobs(jobs: &[JobView], admin: bool) -> String {
    if jobs.is_empty() {
        return "<p class=\"muted\">No jobs since this console started.</p>".to_owned();
    }
    let mut out = String::new();
    for j in jobs {
        let state = j.state.as_str();
        let _ = write!(
            out,
            "<div class=\"job job-{state}\" data-job=\"{}\" data-state=\"{state}\">\
             <strong>{} #{}</strong> of {} by {}, started {}: <span class=\"state\">{state}</span>, \
             <span class=\"progress\">{}</span>",
            j.id,
            j.kind.as_str(),
            j.id,
            e(&j.target),
            e(&j.who),
            rfc3339(j.started_ms).unwrap_or_default(),
            e(&j.progress()),
        );
        if admin && j.state == JobState::Running {
            out.push_str(" <button type=\"button\" class=\"cancel\">Cancel</button>");
        }
        if let Some(error) = &j.error {
            let _ = write!(out, "<p class=\"error\">{}</p>", text(error, 1000));
        }
        out.push_str("<pre class=\"lines\">");
        for line in &j.lines {
            out.push_str(&e(line));
            out.push('\n');
        }
        out.push_str("</pre></div>");
    }
    out
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

/// A letter's detail: what the index knows, its headers, its body.
pub(crate) fn letter(base: &str, id: &str, detail: &Result<Option<Detail>, String>) -> String {
    let back = format!(
        "<p><a href=\"{}\">← dead letters</a></p>",
        e(&format!("{base}dead-letters"))
    );
    let d = match detail {
        Err(error) => {
            return format!(
                "{back}<p class=\"error\">The DLQ could not be read: {}</p>",
                text(error, 1000)
            );
        }
        Ok(None) => {
            return format!(
                "{back}<p class=\"warning\" id=\"not-found\">No dead letter <code>{}</code> in the DLQ \
                 (replayed or purged since, or the id is wrong).</p>",
                e(id)
            );
        }
        Ok(Some(d)) => d,
    };
    let l = &d.entry;
    let [order, seq, kind, shard, attempts, failed] = facts(l);
    let mut out = format!(
        "{back}<h1>Dead letter <code id=\"letter-id\">{}</code></h1><table id=\"facts\"><tbody>\
         <tr><th>reason</th><td>{}</td></tr><tr><th>error</th><td>{}</td></tr>\
         <tr><th>failure group</th><td><a href=\"{}\"><code>{}</code></a></td></tr>\
         <tr><th>order</th><td>{}</td></tr><tr><th>seq</th><td>{}</td></tr><tr><th>event</th><td>{}</td></tr>\
         <tr><th>shard</th><td>{}</td></tr><tr><th>attempts</th><td id=\"attempts\">{}</td></tr>\
         <tr><th>first failed</th><td>{}</td></tr><tr><th>trace id</th><td><code id=\"trace-id\">{}</code></td></tr>\
         <tr><th>routing key</th><td>{}</td></tr></tbody></table>",
        e(&l.id),
        e(&l.reason),
        text(&l.error, 2000),
        e(&format!("{base}dead-letters?group={}", l.group)),
        e(&l.group),
        order,
        seq,
        kind,
        shard,
        attempts,
        failed,
        l.trace_id.as_deref().map_or("–".to_owned(), e),
        e(&d.routing_key),
    );
    out.push_str("<h2>Headers</h2><table id=\"headers\"><tbody>");
    for (name, value) in &d.headers {
        let _ = write!(
            out,
            "<tr><th>{}</th><td>{}</td></tr>",
            e(name),
            text(value, 2000)
        );
    }
    out.push_str("</tbody></table>");
    let b = &d.body;
    let _ = write!(
        out,
        "<h2>Body</h2><p class=\"muted\">{} bytes, {}.</p>",
        b.bytes,
        if b.hex {
            "not UTF-8: shown as hex"
        } else {
            "UTF-8 text, escaped"
        }
    );
    if b.hex {
        let _ = write!(
            out,
            "<pre id=\"body\" class=\"hex\">{}</pre>",
            hex_lines(&b.text)
        );
    } else {
        let _ = write!(out, "<pre id=\"body\">{}</pre>", text(&b.text, usize::MAX));
    }
    if b.capped {
        let _ = write!(
            out,
            "<p id=\"body-note\" class=\"muted\">Only the first {} KiB are shown (<code>shardline dlq show</code> prints it all).</p>",
            crate::api::BODY_CAP / 1024
        );
    }
    out
}

/// The audit log's latest entries.
pub(crate) fn audit(entries: &Result<Vec<AuditEntry>, String>) -> String {
    let mut out = format!(
        "<h1>Audit</h1><p class=\"muted\">The console's actions, newest first, kept in Redis \
         (the latest {}).</p>",
        shardline_ops::audit::CAP
    );
    let entries = match entries {
        Err(error) => {
            let _ = write!(
                out,
                "<p class=\"error\">The audit log could not be read: {}</p>",
                text(error, 1000)
            );
            return out;
        }
        Ok(entries) if entries.is_empty() => {
            out.push_str("<p id=\"no-audit\">No actions yet.</p>");
            return out;
        }
        Ok(entries) => entries,
    };
    out.push_str(
        "<table id=\"audit\"><thead><tr><th>when</th><th>who</th><th>action</th><th>detail</th></tr></thead><tbody>",
    );
    for a in entries {
        let _ = write!(
            out,
            "<tr class=\"audit\"><td>{}</td><td class=\"who\">{}</td><td class=\"action\">{}</td>\
             <td class=\"detail\"><code>{}</code></td></tr>",
            rfc3339(a.at_ms).unwrap_or_default(),
            e(&a.who),
            e(&a.action),
            text(&a.detail.to_string(), 1000),
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// The reconcile runs, and the dry-run button when the console has the
/// order database.
pub(crate) fn reconcile(
    base: &str,
    admin: bool,
    dry_run: bool,
    runs: &Result<Vec<RunSummary>, String>,
    jobs_now: &[JobView],
) -> String {
    let mut out = format!(
        "<h1>Reconcile</h1><p class=\"muted\">The latest runs of <code>shardline reconcile --interval</code>, \
         newest first, as each run writes its summary to Redis (the latest {}).</p>",
        shardline_ops::reconcile::RUNS_CAP
    );
    if admin && dry_run {
        let _ = write!(
            out,
            "<p><button type=\"button\" id=\"reconcile-dry-run\" data-api=\"{}\">Dry run now</button> \
             (compares the order database with the fleet; emits and writes nothing)</p>\
             <p id=\"action-result\" class=\"muted\"></p>",
            e(&format!("{base}api/reconcile/dry-run")),
        );
    } else if !dry_run {
        out.push_str(
            "<p class=\"muted\">Start the console with <code>--orders-url</code> for a dry-run button.</p>",
        );
    }
    match runs {
        Err(error) => {
            let _ = write!(
                out,
                "<p class=\"error\">The runs could not be read: {}</p>",
                text(error, 1000)
            );
        }
        Ok(runs) if runs.is_empty() => {
            out.push_str("<p id=\"no-runs\">No runs recorded: is reconcile running with <code>--interval</code>?</p>");
        }
        Ok(runs) => {
            out.push_str(
                "<table id=\"reconcile-runs\"><thead><tr><th>ended</th><th>took</th><th>scanned</th>\
                 <th>fresh</th><th>drifted</th><th>emitted</th><th>pending</th><th>outcome</th></tr></thead><tbody>",
            );
            for r in runs {
                let outcome = match &r.error {
                    Some(error) => format!("<td class=\"error\">{}</td>", e(error)),
                    None if r.dry_run => "<td>dry run</td>".to_owned(),
                    None => "<td>ok</td>".to_owned(),
                };
                let _ = write!(
                    out,
                    "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
                     <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>{outcome}</tr>",
                    rfc3339(r.at_ms).unwrap_or_default(),
                    seconds(Duration::from_millis(r.took_ms)),
                    r.scanned,
                    r.fresh,
                    r.drifted,
                    r.emitted,
                    r.pending,
                );
            }
            out.push_str("</tbody></table>");
        }
    }
    let dry_runs: Vec<JobView> = jobs_now
        .iter()
        .filter(|j| j.kind == Kind::ReconcileDryRun)
        .cloned()
        .collect();
    let _ = write!(
        out,
        "<h2>Dry runs</h2><div id=\"jobs\" data-src=\"{}\" data-api=\"{}\">{}</div>",
        e(&format!(
            "{base}fragment/jobs?kind={}",
            Kind::ReconcileDryRun.as_str()
        )),
        e(&format!("{base}api/jobs/")),
        jobs(&dry_runs, admin),
    );
    out
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
        let html = dead_letters("/", &admin(), &view);
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
        let page = page("/", "Dead letters", &admin(), Nav::DeadLetters, &html);
        assert!(page.contains("ops&lt;b&gt; (admin)"), "{page}");
        let read_only = Principal {
            role: Role::ReadOnly,
            ..admin()
        };
        let html = dead_letters("/", &read_only, &view);
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
            routing_key: "decode".into(),
            headers: vec![("x-error".into(), "<svg onload=alert(1)>\u{2066}".into())],
            body: crate::api::Body::of(body),
        };
        let html = letter(
            "/",
            "d1",
            &Ok(Some(detail(
                "<script>window.__pwned=1</script>\u{202e}\u{200b}".as_bytes(),
            ))),
        );
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
        let html = letter("/", "d1", &Ok(Some(detail(b"<a>\xff\xfe"))));
        assert!(
            html.contains("<pre id=\"body\" class=\"hex\">3c 61 3e ff fe</pre>"),
            "{html}"
        );
        let big = vec![b'a'; crate::api::BODY_CAP + 1];
        let html = letter("/", "d1", &Ok(Some(detail(&big))));
        assert!(html.contains("id=\"body-note\""));
        assert!(letter("/", "x<", &Ok(None)).contains("No dead letter <code>x&lt;</code>"));
    }

    #[test]
    fn a_job_shows_its_progress_and_a_cancel_button_while_it_runs() {
        let mut view = JobView::new(7, Kind::Replay, "ops", "group <g>".into());
        view.done = 2;
        view.total = Some(5);
        view.lines = vec!["replayed <d1>".into()];
        let html = jobs(std::slice::from_ref(&view), true);
        assert!(
            html.contains("data-job=\"7\" data-state=\"running\""),
            "{html}"
        );
        assert!(html.contains("replayed 2 of 5") && html.contains("class=\"cancel\""));
        assert!(html.contains("group &lt;g&gt;") && html.contains("replayed &lt;d1&gt;"));
        assert!(!jobs(std::slice::from_ref(&view), false).contains("class=\"cancel\""));
        view.state = JobState::Done;
        assert!(!jobs(&[view], true).contains("class=\"cancel\""));
    }

    #[test]
    fn an_unreadable_fleet_says_why() {
        let html = fleet(&Err("connection refused <x>".into()), "");
        assert!(html.contains("connection refused &lt;x&gt;"), "{html}");
    }
}
