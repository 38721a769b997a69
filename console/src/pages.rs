//! The page handlers: login and logout (the session cookie), the fleet
//! page and its refreshed section, the dead-letters page and a letter's
//! detail, the jobs panel, the audit and reconcile pages.

use axum::Form;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use shardline_ops::{audit, dlq, reconcile};

use crate::api::{AUDIT_SHOWN, LettersParams, RUNS_SHOWN, read_letter};
use crate::client::Client;
use crate::guard::{Door, Refused, authenticate, see_other, session_id, too_many};
use crate::history;
use crate::html::{self, Nav};
use crate::session::{COOKIE, Principal, SESSION_TTL};
use crate::state::{Shared, Status, chain};
use crate::token::Role;

#[derive(Debug, Deserialize)]
pub(crate) struct LoginQuery {
    token: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct LoginForm {
    token: String,
}

/// `GET login`: the form; with `?token=` (the URL printed at start) a
/// login as by the form.
pub(crate) async fn login_form(
    State(state): State<Shared>,
    Extension(client): Extension<Client>,
    headers: HeaderMap,
    Query(query): Query<LoginQuery>,
) -> Response {
    match query.token {
        Some(token) => log_in(&state, client, &headers, &token),
        None => html::respond(&html::login(&state.base, false)),
    }
}

/// `POST login`: the token from the form.
pub(crate) async fn login(
    State(state): State<Shared>,
    Extension(client): Extension<Client>,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    log_in(&state, client, &headers, &form.token)
}

/// A session for the token and a 303 to the fleet page, or the form again
/// (401; 429 while the client's address waits).
fn log_in(state: &Shared, client: Client, headers: &HeaderMap, token: &str) -> Response {
    let token = match authenticate(state, client, token, Door::Login) {
        Ok(token) => token,
        Err(Refused::Wrong) => {
            return (
                StatusCode::UNAUTHORIZED,
                html::respond(&html::login(&state.base, true)),
            )
                .into_response();
        }
        Err(Refused::Wait(wait)) => {
            let page = html::respond(&html::login_throttled(&state.base, wait.seconds()));
            return too_many(page, wait);
        }
    };
    let (id, _) = state.sessions.open(token);
    tracing::info!(who = %token.name, role = token.role.as_str(), "console: logged in");
    let mut response = see_other(&state.base);
    let cookie = format!(
        "{COOKIE}={id}; Path={}; HttpOnly; SameSite=Strict; Max-Age={}{}",
        cookie_path(&state.base),
        SESSION_TTL.as_secs(),
        if over_tls(headers) { "; Secure" } else { "" },
    );
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// `POST logout` (with the session's CSRF token): ends the session.
pub(crate) async fn logout(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if let Some(id) = session_id(&headers) {
        state.sessions.close(&id);
    }
    let mut response = see_other(&format!("{}login", state.base));
    let cookie = format!(
        "{COOKIE}=; Path={}; HttpOnly; SameSite=Strict; Max-Age=0",
        cookie_path(&state.base)
    );
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// The cookie's `Path`: the base path without its trailing `/` (but `/`).
fn cookie_path(base: &str) -> &str {
    match base.trim_end_matches('/') {
        "" => "/",
        path => path,
    }
}

/// The request reached the console over TLS: a proxy says so. (The
/// console itself speaks plain HTTP.)
fn over_tls(headers: &HeaderMap) -> bool {
    headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("https"))
}

/// The fleet section with its chart.
fn fleet_section<'a>(state: &Shared, status: &'a Status) -> html::Fleet<'a> {
    let chart = history::chart(&state.history.samples(), &state.status.thresholds);
    html::fleet(status, chart)
}

/// `GET {base}`: the fleet page.
pub(crate) async fn fleet(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
) -> Response {
    let status = state.status().await;
    let body = html::fleet_page(&state.base, fleet_section(&state, &status));
    html::respond(&html::page(&state.base, "Fleet", &who, Nav::Fleet, body))
}

/// `GET fragment/fleet`: the fleet section alone, for the page's refresh.
pub(crate) async fn fleet_fragment(State(state): State<Shared>) -> Response {
    html::respond(&fleet_section(&state, &state.status().await))
}

/// `GET dead-letters?group=&reason=&order=&shard=&from=&to=&q=`: the
/// failure groups, the letters the filters select, the jobs.
pub(crate) async fn dead_letters(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
    Query(params): Query<LettersParams>,
) -> Response {
    let groups = dlq::groups(&state.fleet).await.map_err(|e| chain(&e));
    let letters = match params.query() {
        Ok(query) => dlq::letters(&state.fleet, &query)
            .await
            .map_err(|e| format!("The dead-letter index could not be read: {}", chain(&e))),
        Err(e) => Err(format!("Filters: {e}")),
    };
    let jobs = state.jobs.views();
    let body = html::dead_letters(
        &state.base,
        &who,
        &html::DeadLetters {
            groups: &groups,
            letters: &letters,
            params: &params,
            jobs: &jobs,
        },
    );
    html::respond(&html::page(
        &state.base,
        "Dead letters",
        &who,
        Nav::DeadLetters,
        body,
    ))
}

/// `GET dead-letters/letter/{id}`: one letter, read from the DLQ.
pub(crate) async fn letter(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Response {
    let detail = read_letter(&state, &id, who.role).await;
    let body = html::letter(&state.base, &id, &detail);
    html::respond(&html::page(
        &state.base,
        "Dead letter",
        &who,
        Nav::DeadLetters,
        body,
    ))
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct JobsQuery {
    kind: Option<String>,
}

/// `GET fragment/jobs?kind=`: the jobs panel alone, for the page's refresh.
pub(crate) async fn jobs_fragment(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
    Query(query): Query<JobsQuery>,
) -> Response {
    let jobs: Vec<_> = state
        .jobs
        .views()
        .into_iter()
        .filter(|j| query.kind.as_deref().is_none_or(|k| k == j.kind.as_str()))
        .collect();
    html::respond(&html::jobs(&jobs, who.role == Role::Admin))
}

/// `GET audit`: the latest actions.
pub(crate) async fn audit(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
) -> Response {
    let entries = audit::recent(&state.fleet, AUDIT_SHOWN)
        .await
        .map_err(|e| chain(&e));
    html::respond(&html::page(
        &state.base,
        "Audit",
        &who,
        Nav::Audit,
        html::audit(&entries),
    ))
}

/// `GET reconcile`: the latest reconcile runs, the dry-run button.
pub(crate) async fn reconcile(
    State(state): State<Shared>,
    Extension(who): Extension<Principal>,
) -> Response {
    let runs = reconcile::runs(&state.fleet, RUNS_SHOWN)
        .await
        .map_err(|e| chain(&e));
    let jobs = state.jobs.views();
    let body = html::reconcile(
        &state.base,
        who.role == Role::Admin,
        state.reconcile.is_some(),
        &runs,
        &jobs,
    );
    html::respond(&html::page(
        &state.base,
        "Reconcile",
        &who,
        Nav::Reconcile,
        body,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cookie_path_is_the_base_path() {
        assert_eq!(cookie_path("/"), "/");
        assert_eq!(cookie_path("/console/"), "/console");
        let mut headers = HeaderMap::new();
        assert!(!over_tls(&headers));
        headers.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        assert!(over_tls(&headers));
    }
}
