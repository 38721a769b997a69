//! The JSON API under `{base}api/`, which the pages use too: who am I, the
//! fleet, the dead-letter index's groups and letters, and the one action of
//! this step, releasing a quarantined order. Each handler calls
//! `shardline-ops` and shapes its report; none holds operation logic.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::Json;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use shardline_contract::OrderId;
use shardline_contract::letters::IndexEntry;
use shardline_ops::dlq::{self, GroupSummary};
use shardline_ops::{Filters, LetterQuery, audit, reconcile};

use crate::letter::{Detail, Shown};
use crate::session::Principal;
use crate::state::{Shared, chain, json_error};
use crate::token::Role;

/// Letters returned when the query gives no `limit`, and the most it may ask.
const DEFAULT_LETTERS: usize = 500;
const MAX_LETTERS: usize = 5000;

/// `GET api/me`: the token's name and role, and the session's CSRF token.
pub(crate) async fn me(Extension(who): Extension<Principal>) -> Response {
    Json(serde_json::json!({
        "name": who.name,
        "role": who.role.as_str(),
        "csrf": who.csrf,
    }))
    .into_response()
}

/// `GET api/fleet`: `topology status --json` without browsing the DLQ.
pub(crate) async fn fleet(State(state): State<Shared>) -> Response {
    match &*state.status().await {
        Ok(report) => Json(report.json()).into_response(),
        Err(e) => json_error(StatusCode::BAD_GATEWAY, e),
    }
}

/// Unix ms as RFC 3339 (none for 0: unknown).
pub(crate) fn rfc3339(ms: u64) -> Option<String> {
    (ms > 0).then(|| {
        humantime::format_rfc3339_millis(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
            .to_string()
    })
}

pub(crate) fn group_json(g: &GroupSummary) -> serde_json::Value {
    serde_json::json!({
        "group": g.group.id,
        "reason": g.group.reason,
        "error": g.group.error,
        "count": g.count,
        "orders": g.orders,
        "first_failed_at": rfc3339(g.first_failed_ms),
        "last_failed_at": rfc3339(g.last_failed_ms),
        "first_failed_ms": g.first_failed_ms,
        "last_failed_ms": g.last_failed_ms,
    })
}

/// `GET api/dlq/groups`: the failure groups, largest first.
pub(crate) async fn groups(State(state): State<Shared>) -> Response {
    match dlq::groups(&state.fleet).await {
        Ok(groups) => Json(serde_json::json!({
            "groups": groups.iter().map(group_json).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => json_error(StatusCode::BAD_GATEWAY, &chain(&e)),
    }
}

/// The query of `api/dlq/letters`; empty values count as absent (a form
/// sends `reason=`).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct LettersParams {
    pub(crate) group: Option<String>,
    pub(crate) reason: Option<String>,
    pub(crate) order: Option<String>,
    pub(crate) shard: Option<String>,
    pub(crate) from: Option<String>,
    pub(crate) to: Option<String>,
    /// An order id or a dead-letter id.
    pub(crate) q: Option<String>,
    pub(crate) limit: Option<String>,
}

fn given(value: Option<&String>) -> Option<&str> {
    value.map(|v| v.trim()).filter(|v| !v.is_empty())
}

/// A time bound: Unix ms, or RFC 3339 (`2026-12-01T10:00:00Z`).
fn time_ms(name: &str, value: &str) -> Result<u64, String> {
    if let Ok(ms) = value.parse::<u64>() {
        return Ok(ms);
    }
    let at = humantime::parse_rfc3339_weak(value)
        .map_err(|_| format!("{name}: expected Unix milliseconds or an RFC 3339 time"))?;
    let since = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|_| format!("{name}: before 1970"))?;
    Ok(u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

impl LettersParams {
    pub(crate) fn query(&self) -> Result<LetterQuery, String> {
        let shard = given(self.shard.as_ref())
            .map(|s| {
                s.parse::<u16>()
                    .map_err(|_| "shard: expected a shard number")
            })
            .transpose()?;
        let limit = given(self.limit.as_ref())
            .map(|s| s.parse::<usize>().map_err(|_| "limit: expected a number"))
            .transpose()?
            .unwrap_or(DEFAULT_LETTERS)
            .min(MAX_LETTERS);
        Ok(LetterQuery {
            filters: Filters {
                reason: given(self.reason.as_ref()).map(str::to_owned),
                order_id: given(self.order.as_ref())
                    .map(|o| OrderId::new(o).map_err(|e| format!("order: {e}")))
                    .transpose()?,
                shard,
                group: given(self.group.as_ref()).map(str::to_owned),
                ids: None,
                limit: Some(limit),
            },
            search: given(self.q.as_ref()).map(str::to_owned),
            from_ms: given(self.from.as_ref())
                .map(|v| time_ms("from", v))
                .transpose()?,
            to_ms: given(self.to.as_ref())
                .map(|v| time_ms("to", v))
                .transpose()?,
        })
    }
}

pub(crate) fn letter_json(l: &IndexEntry) -> serde_json::Value {
    serde_json::json!({
        "id": l.id,
        "reason": l.reason,
        "group": l.group,
        "error": l.error,
        "order_id": l.order_id,
        "seq": l.seq,
        "event": l.kind,
        "shard": l.shard,
        "first_failed_at": rfc3339(l.first_failed_ms),
        "first_failed_ms": l.first_failed_ms,
        "trace_id": l.trace_id,
        "attempts": l.attempts,
    })
}

/// `GET api/dlq/letters?group=&reason=&order=&shard=&from=&to=&q=&limit=`:
/// index entries, oldest first.
pub(crate) async fn letters(
    State(state): State<Shared>,
    Query(params): Query<LettersParams>,
) -> Response {
    let query = match params.query() {
        Ok(query) => query,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &e),
    };
    match dlq::letters(&state.fleet, &query).await {
        Ok(letters) => {
            let letters: Vec<_> = letters.iter().map(letter_json).collect();
            Json(serde_json::json!({
                "dead_letters": letters,
                // The name before `dead_letters`; served for one more release.
                "letters": letters,
                "limit": query.filters.limit,
            }))
        }
        .into_response(),
        Err(e) => json_error(StatusCode::BAD_GATEWAY, &chain(&e)),
    }
}

/// A letter's detail as the API answers it.
fn detail_json(detail: &Detail) -> serde_json::Value {
    let mut json = letter_json(&detail.entry);
    let Some(object) = json.as_object_mut() else {
        return json;
    };
    let Some(contents) = &detail.contents else {
        object.insert("metadata_only".into(), true.into());
        return json;
    };
    object.insert("routing_key".into(), contents.routing_key.clone().into());
    object.insert(
        "headers".into(),
        contents
            .headers
            .iter()
            .map(|(name, value)| serde_json::json!({ "name": name, "value": value }))
            .collect(),
    );
    let body = &contents.body;
    object.insert(
        "body".into(),
        serde_json::json!({
            "encoding": if body.hex { "hex" } else { "utf-8" },
            "text": body.text,
            "bytes": body.bytes,
            "capped": body.capped,
        }),
    );
    json
}

/// The letter `id` as `role` sees it: an admin's from the DLQ (among its
/// first `letters_read`, or read within the last seconds), a read-only
/// token's from the index, metadata only.
pub(crate) async fn read_letter(state: &Shared, id: &str, role: Role) -> Result<Shown, String> {
    if role != Role::Admin {
        return index_letter(state, id).await;
    }
    if let Some(detail) = state.recent.get(id, Instant::now()) {
        return Ok(Shown::Letter(detail));
    }
    match dlq::show_within(&state.fleet, id, state.letters_read).await {
        Ok(letter) => {
            let detail = Arc::new(Detail::of(&letter));
            state.recent.put(Arc::clone(&detail), Instant::now());
            Ok(Shown::Letter(detail))
        }
        Err(e) if e.is_not_found() => Ok(Shown::NotFound),
        Err(e) => e
            .not_within()
            .map(Shown::NotWithin)
            .ok_or_else(|| chain(&e)),
    }
}

/// The letter `id`'s index entry: no DLQ read.
async fn index_letter(state: &Shared, id: &str) -> Result<Shown, String> {
    let query = LetterQuery {
        filters: Filters {
            ids: Some(BTreeSet::from([id.to_owned()])),
            limit: Some(1),
            ..Filters::default()
        },
        search: Some(id.to_owned()),
        ..LetterQuery::default()
    };
    let entries = dlq::letters(&state.fleet, &query)
        .await
        .map_err(|e| chain(&e))?;
    Ok(entries.into_iter().next().map_or(Shown::NotFound, |entry| {
        Shown::Letter(Arc::new(Detail {
            entry,
            contents: None,
        }))
    }))
}

/// What a letter past the bound is told.
pub(crate) fn not_within(id: &str, within: usize) -> String {
    format!(
        "dead letter {id} is not within the first {within} letters of the DLQ: the console reads no further (shardline dlq show reads them all)"
    )
}

/// `GET api/dlq/letter/{id}`: the letter's index fields; for an admin also
/// its routing key, headers and body, read from the DLQ.
pub(crate) async fn letter(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Response {
    match read_letter(&state, &id, who.role).await {
        Ok(Shown::Letter(detail)) => Json(detail_json(&detail)).into_response(),
        Ok(Shown::NotFound) => json_error(StatusCode::NOT_FOUND, "no such dead letter in the DLQ"),
        Ok(Shown::NotWithin(within)) => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({ "error": not_within(&id, within), "not_within": within })),
        )
            .into_response(),
        Err(e) => json_error(StatusCode::BAD_GATEWAY, &e),
    }
}

/// Entries the audit view reads when the query gives no `limit`, and the most.
pub(crate) const AUDIT_SHOWN: usize = 100;
const AUDIT_MAX: usize = 1000;

#[derive(Debug, Default, Deserialize)]
pub(crate) struct LimitParams {
    limit: Option<usize>,
}

/// `GET api/audit?limit=`: the latest actions, newest first.
pub(crate) async fn audit_log(
    State(state): State<Shared>,
    Query(params): Query<LimitParams>,
) -> Response {
    let limit = params.limit.unwrap_or(AUDIT_SHOWN).min(AUDIT_MAX);
    match audit::recent(&state.fleet, limit).await {
        Ok(entries) => Json(serde_json::json!({ "entries": entries })).into_response(),
        Err(e) => json_error(StatusCode::BAD_GATEWAY, &chain(&e)),
    }
}

/// Reconcile runs the view reads.
pub(crate) const RUNS_SHOWN: usize = 20;

/// `GET api/reconcile/runs`: the latest runs of `reconcile --interval`,
/// newest first, and whether this console can start a dry run.
pub(crate) async fn reconcile_runs(State(state): State<Shared>) -> Response {
    match reconcile::runs(&state.fleet, RUNS_SHOWN).await {
        Ok(runs) => Json(serde_json::json!({
            "runs": runs,
            "dry_run_available": state.reconcile.is_some(),
        }))
        .into_response(),
        Err(e) => json_error(StatusCode::BAD_GATEWAY, &chain(&e)),
    }
}

/// `GET api/fleet/history`: the backlog-age samples of the last minutes
/// (this process's memory).
pub(crate) async fn fleet_history(State(state): State<Shared>) -> Response {
    Json(serde_json::json!({
        "every_seconds": crate::history::EVERY.as_secs(),
        "samples": state.history.samples(),
    }))
    .into_response()
}

#[derive(Debug, Deserialize)]
pub(crate) struct ReleaseRequest {
    order_id: String,
}

/// `POST api/dlq/release` `{"order_id": …}` (admin): lifts the order's
/// quarantine, as `dlq release` does.
pub(crate) async fn release(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
    Json(request): Json<ReleaseRequest>,
) -> impl IntoResponse {
    let order_id = request.order_id.trim();
    if order_id.is_empty() {
        return json_error(StatusCode::BAD_REQUEST, "order_id: required");
    }
    let order_id = match OrderId::new(order_id) {
        Ok(id) => id,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    match dlq::release(&state.fleet, &order_id).await {
        Ok(report) => {
            let detail = serde_json::to_value(&report).unwrap_or_default();
            crate::actions::audit(&state, &who.name, "release", detail).await;
            Json(report).into_response()
        }
        Err(e) => json_error(StatusCode::BAD_GATEWAY, &chain(&e)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn letter_queries_read_empty_values_as_absent_and_check_the_rest() {
        let params = LettersParams {
            reason: Some(String::new()),
            shard: Some("3".into()),
            from: Some("2026-12-01T10:00:00Z".into()),
            to: Some("1796119200000".into()),
            ..LettersParams::default()
        };
        let query = params.query().unwrap();
        assert_eq!(query.filters.reason, None);
        assert_eq!(query.filters.shard, Some(3));
        assert_eq!(query.filters.limit, Some(DEFAULT_LETTERS));
        assert_eq!(query.from_ms, Some(1_796_119_200_000));
        assert_eq!(query.to_ms, Some(1_796_119_200_000));
        let bad = LettersParams {
            shard: Some("x".into()),
            ..LettersParams::default()
        };
        assert!(bad.query().unwrap_err().starts_with("shard"));
        let huge = LettersParams {
            limit: Some("999999".into()),
            ..LettersParams::default()
        };
        assert_eq!(huge.query().unwrap().filters.limit, Some(MAX_LETTERS));
    }
}
