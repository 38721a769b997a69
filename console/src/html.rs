//! The pages as HTML text: the layout, the login form, the fleet section
//! (also served alone for the 2 s refresh) and the failure groups. Every
//! value that is not a literal of this file goes through [`crate::escape`].

use std::fmt::Write as _;
use std::time::Duration;

use shardline_ops::dlq::GroupSummary;
use shardline_ops::topology::StatusReport;
use shardline_topology::status::BreakerState;

use crate::api::rfc3339;
use crate::escape::{CELL_CHARS, text};
use crate::guard::CSRF_FIELD;
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
         <header><strong>shardline</strong>{fleet}{dead}\
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
pub(crate) fn fleet(status: &Result<StatusReport, String>) -> String {
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
    out.push_str(
        "<h2>Shards</h2><table><thead><tr><th>shard</th><th>depth</th><th>consumers</th>\
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
            "<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td>{}</td><td class=\"num\">{}</td><td{level_class}>{level}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>{breaker_cell}\
             <td class=\"note\">{}</td></tr>",
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

/// The failure groups table, and the release form for an admin.
pub(crate) fn dead_letters(
    base: &str,
    who: &Principal,
    groups: &Result<Vec<GroupSummary>, String>,
) -> String {
    let mut out = String::from("<h1>Dead letters</h1>");
    match groups {
        Err(error) => {
            let _ = write!(
                out,
                "<p class=\"error\">The dead-letter index could not be read: {}</p>",
                text(error, 1000)
            );
        }
        Ok(groups) if groups.is_empty() => {
            out.push_str("<p>No dead letters in the index.</p>");
        }
        Ok(groups) => {
            out.push_str(
                "<h2>Failure groups</h2><table><thead><tr><th>reason</th><th>error (normalised)</th>\
                 <th>letters</th><th>orders</th><th>first failure</th><th>last failure</th>\
                 <th>group</th></tr></thead><tbody>",
            );
            for g in groups {
                let letters = format!("{base}api/dlq/letters?group={}", g.group.id);
                let _ = write!(
                    out,
                    "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
                     <td>{}</td><td>{}</td><td><a href=\"{}\"><code>{}</code></a></td></tr>",
                    e(&g.group.reason),
                    e(&g.group.error),
                    g.count,
                    g.orders,
                    rfc3339(g.first_failed_ms).unwrap_or_default(),
                    rfc3339(g.last_failed_ms).unwrap_or_default(),
                    e(&letters),
                    e(&g.group.id),
                );
            }
            out.push_str("</tbody></table>");
        }
    }
    if who.role == Role::Admin {
        let _ = write!(
            out,
            "<h2>Release a quarantined order</h2>\
             <form id=\"release\" data-api=\"{}\"><label for=\"order_id\">Order id</label> \
             <input id=\"order_id\" name=\"order_id\" required> <button type=\"submit\">Release</button></form>\
             <p id=\"release-result\" class=\"muted\"></p>",
            e(&format!("{base}api/dlq/release")),
        );
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use shardline_topology::letters::Group;

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
        let html = dead_letters("/", &admin(), &Ok(vec![group]));
        assert!(!html.contains("<script"), "{html}");
        assert!(!html.contains("<img"), "{html}");
        assert!(!html.contains('\u{202e}') && !html.contains('\u{200b}') && !html.contains('\0'));
        assert!(
            html.contains("&lt;script&gt;alert(1)&lt;/script&gt;\\u{200b}\\u{0}"),
            "{html}"
        );
        assert!(html.contains("handler\\u{202e}"), "{html}");
        assert!(html.contains("id=\"release\""), "an admin sees the action");
        let page = page("/", "Dead letters", &admin(), Nav::DeadLetters, &html);
        assert!(page.contains("ops&lt;b&gt; (admin)"), "{page}");
        let read_only = Principal {
            role: Role::ReadOnly,
            ..admin()
        };
        assert!(!dead_letters("/", &read_only, &Ok(Vec::new())).contains("id=\"release\""));
    }

    #[test]
    fn an_unreadable_fleet_says_why() {
        let html = fleet(&Err("connection refused <x>".into()));
        assert!(html.contains("connection refused &lt;x&gt;"), "{html}");
    }
}
