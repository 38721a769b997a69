//! The one gate every request passes, in this order: the Host header
//! (DNS rebinding), the Origin of a POST, who is asking (session cookie or
//! `Authorization: Bearer`, a token checked under the login throttle), the
//! session's CSRF token on a POST, the role; then the security headers on
//! every response, refusals included.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use shardline_connect::inbound::Peer;
use subtle::ConstantTimeEq as _;

use crate::client::{self, Client};
use crate::session::{COOKIE, Principal};
use crate::state::{Shared, State as ConsoleState, json_error};
use crate::throttle::Wait;
use crate::token::{Role, Token};

/// The Content-Security-Policy of every response: nothing from elsewhere,
/// no inline script or style, no framing, forms only to the console.
pub const CSP: &str =
    "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'";

/// The header that carries the session's CSRF token on a POST (or the form
/// field `csrf`).
pub const CSRF_HEADER: &str = "x-csrf-token";
pub(crate) const CSRF_FIELD: &str = "csrf";

/// Largest form body read for its CSRF field.
const FORM_LIMIT: usize = 64 * 1024;

/// What a path is, for the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The login form and the embedded assets: no login needed.
    Public,
    /// JSON and page fragments: 401 without a login.
    Api,
    /// A page: the login page (a 303 to it) without a login.
    Page,
}

fn kind(base: &str, path: &str) -> Kind {
    let rest = path.strip_prefix(base).unwrap_or(path);
    if rest == "login" || rest.starts_with("assets/") {
        Kind::Public
    } else if rest.starts_with("api/") || rest.starts_with("fragment/") {
        Kind::Api
    } else {
        Kind::Page
    }
}

/// The gate (a middleware over every route and the fallback).
pub(crate) async fn guard(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let mut response = match check(&state, req).await {
        Ok(req) => next.run(req).await,
        Err(refusal) => refusal,
    };
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// The request, with its [`Principal`] as an extension, or the refusal.
async fn check(state: &Shared, mut req: Request) -> Result<Request, Response> {
    let host = match req
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().map(str::to_ascii_lowercase))
    {
        Some(Ok(host)) => host,
        Some(Err(_)) | None => {
            return Err(refuse(StatusCode::BAD_REQUEST, "a Host header is required"));
        }
    };
    if !state.hosts.contains(&host) {
        return Err(refuse(
            StatusCode::MISDIRECTED_REQUEST,
            "this console does not answer to that Host name",
        ));
    }
    // Without the accept loop's peer (a router called directly) nobody is known.
    let peer = req
        .extensions()
        .get::<Peer>()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |p| p.0.ip());
    let client = client::client(peer, req.headers(), &state.proxies);
    req.extensions_mut().insert(client);
    let unsafe_method = !matches!(*req.method(), Method::GET | Method::HEAD);
    if unsafe_method && !same_origin(req.headers(), &host) {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "cross-origin request refused",
        ));
    }
    let what = kind(&state.base, req.uri().path());
    if what == Kind::Public {
        return Ok(req);
    }
    let found = principal(state, req.headers(), client).map_err(|wait| {
        too_many(
            json_error(
                StatusCode::TOO_MANY_REQUESTS,
                "too many failed logins from this address: try again later",
            ),
            wait,
        )
    })?;
    let Some(principal) = found else {
        return Err(match what {
            Kind::Page => see_other(&format!("{}login", state.base)),
            _ => {
                let mut r = json_error(
                    StatusCode::UNAUTHORIZED,
                    "login required: a session cookie or Authorization: Bearer <token>",
                );
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                r
            }
        });
    };
    if unsafe_method {
        if let Some(expected) = &principal.csrf {
            let (presented, rebuilt) = csrf_of(req).await;
            req = rebuilt?;
            let matches =
                presented.is_some_and(|p| bool::from(p.as_bytes().ct_eq(expected.as_bytes())));
            if !matches {
                return Err(refuse(
                    StatusCode::FORBIDDEN,
                    "CSRF token missing or wrong (X-CSRF-Token header or csrf form field)",
                ));
            }
        }
        let logout = req.uri().path() == format!("{}logout", state.base);
        if principal.role != Role::Admin && !logout {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                "this token is read-only: actions need an admin token",
            ));
        }
    }
    req.extensions_mut().insert(principal);
    Ok(req)
}

/// An `Origin` header, when present, names this console (as the Host did).
fn same_origin(headers: &HeaderMap, host: &str) -> bool {
    match headers.get(header::ORIGIN).map(HeaderValue::to_str) {
        None => true,
        Some(Ok(origin)) => {
            let origin = origin.to_ascii_lowercase();
            origin == format!("http://{host}") || origin == format!("https://{host}")
        }
        Some(Err(_)) => false,
    }
}

/// Who is asking: a bearer token (a wrong one is nobody, even with a
/// cookie), else a live session; a throttled client's bearer token is
/// refused unchecked (429).
fn principal(
    state: &Shared,
    headers: &HeaderMap,
    client: Client,
) -> Result<Option<Principal>, Wait> {
    if let Some(auth) = headers.get(header::AUTHORIZATION) {
        let Some(bearer) = auth.to_str().ok().and_then(|a| a.strip_prefix("Bearer ")) else {
            return Ok(None);
        };
        return match authenticate(state, client, bearer, Door::Bearer) {
            Ok(token) => Ok(Some(Principal {
                name: token.name.clone(),
                role: token.role,
                csrf: None,
            })),
            Err(Refused::Wrong) => Ok(None),
            Err(Refused::Wait(wait)) => Err(wait),
        };
    }
    Ok(session_id(headers).and_then(|id| state.sessions.get(&id)))
}

/// Where a token was presented, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Door {
    /// The login form, or `GET login?token=`.
    Login,
    /// `Authorization: Bearer`.
    Bearer,
}

/// Why a presented token let nobody in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// No token matches.
    Wrong,
    /// The client waits (or every client does): not checked.
    Wait(Wait),
}

/// The token `presented` by `client`, checked under the login throttle. A
/// failure is logged with the client's address (and the proxy it came
/// through), never with what was typed.
pub(crate) fn authenticate<'a>(
    state: &'a ConsoleState,
    client: Client,
    presented: &str,
    door: Door,
) -> Result<&'a Token, Refused> {
    let now = Instant::now();
    let proxy = client.via.map(tracing::field::display);
    if let Err(wait) = state.throttle.admit(client.addr, now) {
        // At debug: a flood of refusals must not flood the log.
        tracing::debug!(client = %client.addr, proxy, retry_after_s = wait.seconds(), "console: a login attempt was throttled");
        return Err(Refused::Wait(wait));
    }
    let Some(token) = state.tokens.find(presented.trim()) else {
        let wait = state.throttle.failed(client.addr, now);
        let wait_s = wait.map(|w| w.as_secs());
        match door {
            Door::Login => {
                tracing::warn!(client = %client.addr, proxy, wait_s, "console: a login with a wrong token was refused");
            }
            Door::Bearer => {
                tracing::warn!(client = %client.addr, proxy, wait_s, "console: a request with a wrong bearer token was refused");
            }
        }
        return Err(Refused::Wrong);
    };
    state.throttle.succeeded(client.addr);
    Ok(token)
}

/// `response` as a 429 with `Retry-After`.
pub(crate) fn too_many(mut response: Response, wait: Wait) -> Response {
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(wait.seconds()));
    response
}

/// The session cookie's value.
pub(crate) fn session_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE && !value.is_empty()).then(|| value.to_owned())
        })
}

/// The CSRF token of a POST: its header, else the `csrf` field of a form
/// body (read, then put back for the handler).
async fn csrf_of(req: Request) -> (Option<String>, Result<Request, Response>) {
    if let Some(value) = req.headers().get(CSRF_HEADER) {
        let presented = value.to_str().ok().map(str::to_owned);
        return (presented, Ok(req));
    }
    let form = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if !form {
        return (None, Ok(req));
    }
    let (parts, body) = req.into_parts();
    let bytes = match to_bytes(body, FORM_LIMIT).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return (
                None,
                Err(refuse(StatusCode::PAYLOAD_TOO_LARGE, "form body too large")),
            );
        }
    };
    let presented = form_urlencoded::parse(&bytes)
        .find(|(name, _)| name == CSRF_FIELD)
        .map(|(_, value)| value.into_owned());
    (presented, Ok(Request::from_parts(parts, Body::from(bytes))))
}

fn refuse(status: StatusCode, message: &str) -> Response {
    json_error(status, message)
}

/// A 303 to `location`.
pub(crate) fn see_other(location: &str) -> Response {
    match HeaderValue::from_str(location) {
        Ok(value) => (StatusCode::SEE_OTHER, [(header::LOCATION, value)]).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_public_api_or_pages() {
        assert_eq!(kind("/", "/login"), Kind::Public);
        assert_eq!(kind("/", "/assets/console.js"), Kind::Public);
        assert_eq!(kind("/", "/api/fleet"), Kind::Api);
        assert_eq!(kind("/", "/fragment/fleet"), Kind::Api);
        assert_eq!(kind("/", "/"), Kind::Page);
        assert_eq!(kind("/", "/dead-letters"), Kind::Page);
        assert_eq!(kind("/c/", "/c/login"), Kind::Public);
        assert_eq!(kind("/c/", "/c/api/me"), Kind::Api);
        assert_eq!(kind("/c/", "/login/../api/me"), Kind::Page);
        assert_eq!(kind("/", "/loginx"), Kind::Page);
    }

    #[test]
    fn an_origin_must_name_the_console() {
        let mut headers = HeaderMap::new();
        assert!(same_origin(&headers, "127.0.0.1:8088"), "no Origin");
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:8088"),
        );
        assert!(same_origin(&headers, "127.0.0.1:8088"));
        headers.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example"),
        );
        assert!(!same_origin(&headers, "127.0.0.1:8088"));
        headers.insert(header::ORIGIN, HeaderValue::from_static("null"));
        assert!(!same_origin(&headers, "127.0.0.1:8088"));
    }

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; shardline_session=abc; b=2"),
        );
        assert_eq!(session_id(&headers).as_deref(), Some("abc"));
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("shardline_session="),
        );
        assert_eq!(session_id(&headers), None);
    }
}
