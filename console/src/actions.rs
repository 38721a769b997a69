//! The console's actions (admin, POST, CSRF-checked by the guard) and the
//! jobs they start: replay a failure group or a selection (key-ordered and
//! rate-limited, as `dlq replay`), purge a selection after a confirmation,
//! a reconcile dry run, cancelling a job; and the jobs' views, live over
//! server-sent events. Every action is written to the audit log with the
//! token's name. The operations are `shardline-ops`'; this module only
//! starts them and reports.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use serde::Deserialize;
use shardline_ops::audit::{self, AuditEntry};
use shardline_ops::{Event, Filters, LetterQuery, ReconcileConfig, Reconciler, ReplayConfig, dlq};

use crate::jobs::{JobState, JobView, Kind, Progress};
use crate::session::Principal;
use crate::state::{Shared, chain, json_error};

/// A replay's rate when the request gives none, events per second: a
/// group replayed from the page should not flood a downstream that was
/// just fixed.
pub(crate) const DEFAULT_RATE: f64 = 50.0;

/// Records `action` by `who` in the audit log; a failed write is logged,
/// never the action's failure (the action is also in the console's log).
pub(crate) async fn audit(state: &Shared, who: &str, action: &str, detail: serde_json::Value) {
    tracing::info!(who, action, %detail, "console: action");
    if let Err(e) = audit::record(&state.fleet, &AuditEntry::now(who, action, detail)).await {
        tracing::warn!(error = %chain(&e), who, action, "console: the audit log could not be written");
    }
}

/// Which letters an action is on: a failure group or a list of letter ids.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Selection {
    group: Option<String>,
    ids: Option<Vec<String>>,
}

impl Selection {
    /// The filters, and the selection in words; an error when it selects
    /// neither a group nor at least one id.
    fn filters(&self) -> Result<(Filters, String), &'static str> {
        let group = self
            .group
            .as_deref()
            .map(str::trim)
            .filter(|g| !g.is_empty());
        let ids: Option<BTreeSet<String>> = self.ids.as_ref().map(|ids| {
            ids.iter()
                .map(|i| i.trim().to_owned())
                .filter(|i| !i.is_empty())
                .collect()
        });
        match (group, ids) {
            (Some(_), Some(_)) => Err("give a group or ids, not both"),
            (Some(group), None) => Ok((
                Filters {
                    group: Some(group.to_owned()),
                    ..Filters::default()
                },
                format!("group {group}"),
            )),
            (None, Some(ids)) if !ids.is_empty() => {
                let what = format!("{} letter(s)", ids.len());
                Ok((
                    Filters {
                        ids: Some(ids),
                        ..Filters::default()
                    },
                    what,
                ))
            }
            _ => Err("select a failure group (`group`) or letters (`ids`)"),
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "group": self.group, "ids": self.ids })
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct ReplayRequest {
    #[serde(flatten)]
    selection: Selection,
    /// Events per second; [`DEFAULT_RATE`] when absent.
    rate: Option<f64>,
}

/// The job's view after a replay event.
fn on_replay_event(view: &mut JobView, event: &Event) {
    match event {
        Event::Replaying { letters } => {
            view.total = Some(view.total.unwrap_or(0) + *letters as u64);
        }
        Event::Replayed { .. } => view.done += 1,
        _ => {}
    }
    view.line(event.to_string());
}

fn started(id: u64) -> Response {
    (StatusCode::ACCEPTED, Json(serde_json::json!({ "job": id }))).into_response()
}

/// `POST api/dlq/replay` `{"group": …}` or `{"ids": […]}`, `"rate"`: starts a
/// replay job; `202 {"job": id}`.
pub(crate) async fn replay(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
    Json(request): Json<ReplayRequest>,
) -> Response {
    let (filters, target) = match request.selection.filters() {
        Ok(selected) => selected,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e),
    };
    let rate = request.rate.unwrap_or(DEFAULT_RATE);
    if !(rate > 0.0 && rate.is_finite()) {
        return json_error(
            StatusCode::BAD_REQUEST,
            "rate: must be above 0 (events per second)",
        );
    }
    let detail = serde_json::json!({ "selection": request.selection.json(), "rate": rate });
    launch(
        &state,
        &who,
        Kind::Replay,
        target,
        detail,
        |shared, p| async move {
            let config = ReplayConfig {
                filters,
                rate: Some(rate),
                ..ReplayConfig::default()
            };
            dlq::replay(&shared.fleet, &config, &p.cancel, |event| {
                p.update(|v| on_replay_event(v, &event));
            })
            .await
            .map(|r| serde_json::to_value(&r).unwrap_or_default())
            .map_err(|e| chain(&e))
        },
    )
    .await
}

/// Writes "`kind` started" to the audit log, starts `run` as a job, and
/// when it ends writes how it ended; `202 {"job": id}`.
async fn launch<F>(
    state: &Shared,
    who: &Principal,
    kind: Kind,
    target: String,
    detail: serde_json::Value,
    run: impl FnOnce(Shared, Progress) -> F,
) -> Response
where
    F: Future<Output = Result<serde_json::Value, String>> + Send + 'static,
{
    let what = kind.action();
    audit(state, &who.name, &format!("{what} started"), detail.clone()).await;
    let shared = Shared::clone(state);
    let name = who.name.clone();
    let id = state.jobs.start(kind, &who.name, target, move |p| {
        let work = run(Shared::clone(&shared), p.clone());
        async move {
            let outcome = work.await;
            end(&shared, &name, what, detail, &p, outcome).await;
        }
    });
    started(id)
}

/// Ends a job and writes how it ended to the audit log.
async fn end(
    state: &Shared,
    who: &str,
    what: &str,
    detail: serde_json::Value,
    p: &Progress,
    outcome: Result<serde_json::Value, String>,
) {
    let (how, result) = match &outcome {
        Ok(_) if p.cancel.is_cancelled() => ("cancelled", serde_json::Value::Null),
        Ok(report) => ("finished", summary(report)),
        Err(e) => ("failed", serde_json::json!({ "error": e })),
    };
    p.end(outcome);
    let mut detail = detail;
    if let Some(object) = detail.as_object_mut() {
        object.insert("result".into(), result);
    }
    audit(state, who, &format!("{what} {how}"), detail).await;
}

/// A report's counts, for the audit log (not its lists of letters).
fn summary(report: &serde_json::Value) -> serde_json::Value {
    match report.as_object() {
        Some(fields) => fields
            .iter()
            .map(|(k, v)| match v {
                serde_json::Value::Array(items) => (k.clone(), items.len().into()),
                other => (k.clone(), other.clone()),
            })
            .collect(),
        None => report.clone(),
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct PurgeRequest {
    #[serde(flatten)]
    selection: Selection,
    #[serde(default)]
    confirm: bool,
}

/// `POST api/dlq/purge` `{"ids": […], "confirm": true}` (or a `group`):
/// deletes the letters for good. Without `confirm` nothing is deleted:
/// 400 with the count it would delete, the page's confirmation step.
pub(crate) async fn purge(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
    Json(request): Json<PurgeRequest>,
) -> Response {
    let (filters, target) = match request.selection.filters() {
        Ok(selected) => selected,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e),
    };
    if !request.confirm {
        let query = LetterQuery {
            filters: filters.clone(),
            ..LetterQuery::default()
        };
        return match dlq::letters(&state.fleet, &query).await {
            Ok(letters) => (
                StatusCode::BAD_REQUEST,
                Json(serde_json::json!({
                    "error": format!("confirm: purging deletes {} letter(s) for good; send \"confirm\": true", letters.len()),
                    "would_purge": letters.len(),
                })),
            )
                .into_response(),
            Err(e) => json_error(StatusCode::BAD_GATEWAY, &chain(&e)),
        };
    }
    let detail = serde_json::json!({ "selection": request.selection.json() });
    launch(
        &state,
        &who,
        Kind::Purge,
        target,
        detail,
        |shared, p| async move {
            let report = dlq::purge(&shared.fleet, &filters)
                .await
                .map_err(|e| chain(&e))?;
            p.update(|v| {
                v.done = report.removed.len() as u64;
                v.total = Some(v.done);
                for letter in &report.removed {
                    v.line(format!("purged {letter}"));
                }
            });
            Ok(serde_json::to_value(&report).unwrap_or_default())
        },
    )
    .await
}

/// `POST api/reconcile/dry-run`: one reconcile run that emits and writes
/// nothing, as a job; 404 when the console was given no orders URL.
pub(crate) async fn reconcile_dry_run(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
) -> Response {
    let Some(config) = state.reconcile.clone() else {
        return json_error(
            StatusCode::NOT_FOUND,
            "the console was started without --orders-url: no dry run",
        );
    };
    let reconciler = match Reconciler::new(
        state.fleet.clone(),
        ReconcileConfig {
            dry_run: true,
            ..config
        },
    ) {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &chain(&e)),
    };
    let target = "the order database".to_owned();
    let detail = serde_json::json!({});
    launch(
        &state,
        &who,
        Kind::ReconcileDryRun,
        target,
        detail,
        |_, p| async move {
            let report = reconciler
                .run_once(&p.cancel)
                .await
                .map_err(|e| chain(&e))?;
            p.update(|v| {
                v.done = 1;
                v.total = Some(1);
                v.line(report.summary());
            });
            Ok(report.json(&|s: &str| s.to_owned()))
        },
    )
    .await
}

/// `GET api/jobs`: every job of this console process, newest first.
pub(crate) async fn jobs(State(state): State<Shared>) -> Response {
    let views: Vec<serde_json::Value> = state.jobs.views().iter().map(JobView::json).collect();
    Json(serde_json::json!({ "jobs": views })).into_response()
}

/// `GET api/jobs/{id}`.
pub(crate) async fn job(State(state): State<Shared>, Path(id): Path<u64>) -> Response {
    match state.jobs.get(id) {
        Some(job) => Json(job.view().json()).into_response(),
        None => json_error(StatusCode::NOT_FOUND, "no such job"),
    }
}

/// `POST api/jobs/{id}/cancel`: the job stops at its next step.
pub(crate) async fn cancel(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
    Path(id): Path<u64>,
) -> Response {
    let Some(job) = state.jobs.get(id) else {
        return json_error(StatusCode::NOT_FOUND, "no such job");
    };
    let view = job.view();
    if view.state != JobState::Running {
        return json_error(StatusCode::CONFLICT, "the job has ended");
    }
    job.cancel();
    audit(
        &state,
        &who.name,
        "job cancelled",
        serde_json::json!({ "job": id, "kind": view.kind.as_str(), "target": view.target }),
    )
    .await;
    Json(serde_json::json!({ "job": id, "cancelling": true })).into_response()
}

/// How long an events stream may wait between a job's changes before a
/// comment keeps proxies from closing it.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// At most this many progress events a second per stream: a fast replay
/// changes its view per letter.
const EVENTS_EVERY: Duration = Duration::from_millis(200);

/// `GET api/jobs/{id}/events`: the job's view as server-sent events,
/// `progress` on each change (at most five a second) and `end` once it ended.
pub(crate) async fn events(State(state): State<Shared>, Path(id): Path<u64>) -> Response {
    let Some(job) = state.jobs.get(id) else {
        return json_error(StatusCode::NOT_FOUND, "no such job");
    };
    Sse::new(job_stream(job.subscribe()))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
}

fn job_stream(
    rx: tokio::sync::watch::Receiver<JobView>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    // The view as it is first, then after each change (throttled), until
    // the `end` event has gone out.
    stream::unfold(
        (rx, None::<Instant>, false),
        |(mut rx, last, ended)| async move {
            if ended {
                return None;
            }
            if let Some(last) = last {
                tokio::time::sleep_until((last + EVENTS_EVERY).into()).await;
                // Err: every sender is gone, so the view is final; it goes out below.
                let _ = rx.changed().await;
            }
            let view = rx.borrow_and_update().clone();
            let ended = view.state != JobState::Running;
            let event = SseEvent::default()
                .event(if ended { "end" } else { "progress" })
                .data(view.json().to_string());
            Some((Ok(event), (rx, Some(Instant::now()), ended)))
        },
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_selection_is_a_group_or_ids_never_both_nor_nothing() {
        let group = Selection {
            group: Some(" g1 ".into()),
            ids: None,
        };
        let (filters, what) = group.filters().unwrap();
        assert_eq!(filters.group.as_deref(), Some("g1"));
        assert_eq!(what, "group g1");
        let ids = Selection {
            group: None,
            ids: Some(vec!["a".into(), "b".into(), " ".into(), "a".into()]),
        };
        let (filters, what) = ids.filters().unwrap();
        assert_eq!(filters.ids.unwrap().len(), 2);
        assert_eq!(what, "2 letter(s)");
        assert!(Selection::default().filters().is_err());
        assert!(
            Selection {
                group: None,
                ids: Some(vec![])
            }
            .filters()
            .is_err()
        );
        assert!(
            Selection {
                group: Some("g".into()),
                ids: Some(vec!["a".into()])
            }
            .filters()
            .is_err()
        );
    }

    #[test]
    fn a_replay_counts_what_it_replayed_of_what_it_found() {
        let mut view = JobView::new(1, Kind::Replay, "ops", "group g".into());
        on_replay_event(&mut view, &Event::Replaying { letters: 3 });
        let letter = shardline_ops::LetterRef {
            id: Some("d1".into()),
            reason: "handler".into(),
            order_id: Some("o1".into()),
            seq: Some(1),
            shard: Some(2),
        };
        on_replay_event(&mut view, &Event::Replayed { letter, shard: 2 });
        on_replay_event(&mut view, &Event::Replaying { letters: 1 });
        assert_eq!(view.progress(), "replayed 1 of 4");
        assert_eq!(view.lines.len(), 3);
        assert!(view.lines[1].starts_with("replayed d1"), "{:?}", view.lines);
        assert_eq!(
            summary(&serde_json::json!({"replayed": 2, "skipped": [1, 2]})),
            serde_json::json!({"replayed": 2, "skipped": 2})
        );
    }
}
