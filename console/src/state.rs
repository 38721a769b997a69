//! What every request handler shares: the console's state (the fleet, tokens,
//! sessions, the login throttle, jobs, the chart's history, letters read
//! lately), the fleet status read once for every
//! page of a second, and the JSON error answer. Below the handlers (`actions`,
//! `api`, `guard`, `pages`), which the router in `server` puts together.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::response::{IntoResponse as _, Response};
use shardline_ops::topology::{self, StatusConfig, StatusReport};
use shardline_ops::{Fleet, ReconcileConfig};

use crate::history::{History, Sample};
use crate::jobs::Jobs;
use crate::recent::Recent;
use crate::session::Sessions;
use crate::throttle::Throttle;
use crate::token::Tokens;

/// How long one fleet status serves every page and poll: tabs refreshing
/// every 2 s share one read of the broker and Redis.
const STATUS_REUSE: Duration = Duration::from_secs(1);

/// What every handler shares.
pub(crate) struct State {
    pub(crate) fleet: Fleet,
    pub(crate) tokens: Tokens,
    pub(crate) sessions: Sessions,
    /// The base path, with its trailing `/`.
    pub(crate) base: String,
    /// Host headers answered to, lower case.
    pub(crate) hosts: Vec<String>,
    pub(crate) jobs: Jobs,
    pub(crate) history: History,
    /// The order database, for the reconcile dry run; `None`: no dry run.
    pub(crate) reconcile: Option<ReconcileConfig>,
    pub(crate) status: StatusConfig,
    pub(crate) last_status: tokio::sync::Mutex<Option<(Instant, Status)>>,
    /// Failed token checks, per client address and over all.
    pub(crate) throttle: Throttle,
    /// Proxies whose `X-Forwarded-For` is believed.
    pub(crate) proxies: Vec<ipnet::IpNet>,
    /// Letters an admin opened lately, read from the DLQ.
    pub(crate) recent: Recent,
    /// How far into the DLQ a letter's detail looks.
    pub(crate) letters_read: usize,
}

pub(crate) type Shared = Arc<State>;

/// A fleet status as read (its error as text), shared by the requests of
/// [`STATUS_REUSE`].
pub(crate) type Status = Arc<Result<StatusReport, String>>;

impl State {
    /// The fleet status (cheap form: the DLQ is not browsed), at most
    /// [`STATUS_REUSE`] old; its error as text fit to show.
    pub(crate) async fn status(&self) -> Status {
        let mut last = self.last_status.lock().await;
        if let Some((at, status)) = &*last
            && at.elapsed() < STATUS_REUSE
        {
            return Arc::clone(status);
        }
        let status = Arc::new(
            topology::status(&self.fleet, &self.status)
                .await
                .map_err(|e| chain(&e)),
        );
        if let Ok(report) = &*status {
            self.history.push(Sample::of(report));
        }
        *last = Some((Instant::now(), Arc::clone(&status)));
        status
    }
}

pub(crate) use shardline_ops::error::chain;

/// A JSON `{"error": …}` with `status`.
pub(crate) fn json_error(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
}
