//! The routes under the base path, the shared state, and [`serve`]: the
//! guarded accept loop (`shardline_connect::inbound`: timeouts, a connection
//! cap, body limits) until the stop token fires.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::{get, post};
use shardline_connect::inbound;
use shardline_ops::Fleet;
use shardline_ops::topology::StatusConfig;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower_service::Service;

use crate::history::{self, History};
use crate::jobs::Jobs;
use crate::recent::Recent;
use crate::session::Sessions;
use crate::state::{Shared, State, json_error};
use crate::throttle::Throttle;
use crate::{Config, Error, actions, api, assets, client, config, guard, pages};

/// Reads the fleet every [`history::EVERY`] (the chart's samples) until
/// `stop`; a read within that time by a page counts too.
async fn sample(state: Shared, stop: CancellationToken) {
    let mut tick = tokio::time::interval(history::EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                state.status().await;
            }
        }
    }
}

/// The Host headers the console answers to: its listen address,
/// `localhost` and the loopback addresses on its port, and `extra`.
fn hosts(addr: SocketAddr, extra: &[String]) -> Vec<String> {
    let port = addr.port();
    let mut hosts = vec![
        addr.to_string(),
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
    ];
    hosts.extend(extra.iter().map(|h| h.to_ascii_lowercase()));
    hosts
}

fn router(state: Shared) -> Router {
    let b = state.base.clone();
    let at = |path: &str| format!("{b}{path}");
    let mut router = Router::new()
        .route(&b, get(pages::fleet))
        .route(&at("dead-letters"), get(pages::dead_letters))
        .route(&at("dead-letters/letter/{id}"), get(pages::letter))
        .route(&at("audit"), get(pages::audit))
        .route(&at("reconcile"), get(pages::reconcile))
        .route(&at("fragment/fleet"), get(pages::fleet_fragment))
        .route(&at("fragment/jobs"), get(pages::jobs_fragment))
        .route(&at("login"), get(pages::login_form).post(pages::login))
        .route(&at("logout"), post(pages::logout))
        .route(&at("assets/console.css"), get(assets::css))
        .route(&at("assets/console.js"), get(assets::js))
        .route(&at("api/me"), get(api::me))
        .route(&at("api/fleet"), get(api::fleet))
        .route(&at("api/dlq/groups"), get(api::groups))
        .route(&at("api/dlq/letters"), get(api::letters))
        .route(&at("api/dlq/release"), post(api::release))
        .route(&at("api/dlq/letter/{id}"), get(api::letter))
        .route(&at("api/dlq/replay"), post(actions::replay))
        .route(&at("api/dlq/purge"), post(actions::purge))
        .route(&at("api/fleet/history"), get(api::fleet_history))
        .route(&at("api/audit"), get(api::audit_log))
        .route(&at("api/reconcile/runs"), get(api::reconcile_runs))
        .route(
            &at("api/reconcile/dry-run"),
            post(actions::reconcile_dry_run),
        )
        .route(&at("api/jobs"), get(actions::jobs))
        .route(&at("api/jobs/{id}"), get(actions::job))
        .route(&at("api/jobs/{id}/events"), get(actions::events))
        .route(&at("api/jobs/{id}/cancel"), post(actions::cancel));
    if b != "/" {
        let base = b.clone();
        router = router.route(
            b.trim_end_matches('/'),
            get(move || async move { guard::see_other(&base) }),
        );
    }
    router
        .fallback(|| async { json_error(StatusCode::NOT_FOUND, "no such page") })
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            guard::guard,
        ))
        .with_state(state)
}

/// Serves the console on `listener` until `shutdown` fires. The Host
/// headers it answers to follow from the listener's address.
pub async fn serve(
    config: Config,
    fleet: Fleet,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    config.validate()?;
    let base = config::base_path(&config.base_path)?;
    let addr = listener.local_addr()?;
    config.validate_listen(addr)?;
    let state = Arc::new(State {
        fleet,
        tokens: config.tokens,
        sessions: Sessions::default(),
        base,
        hosts: hosts(addr, &config.allowed_hosts),
        jobs: Jobs::default(),
        history: History::default(),
        reconcile: config.reconcile,
        status: StatusConfig {
            thresholds: config.thresholds,
            dlq_browse: None,
        },
        last_status: tokio::sync::Mutex::new(None),
        throttle: Throttle::new(crate::throttle::Limits {
            base: config.login_backoff,
            ..crate::throttle::Limits::default()
        }),
        proxies: client::trusted(&config.trusted_proxies).map_err(|message| Error::Config {
            field: "trusted_proxies",
            message,
        })?,
        recent: Recent::default(),
        letters_read: config.letters_read,
    });
    tracing::info!(%addr, base = %state.base, tokens = state.tokens.len(), "console listening");
    let sampler = tokio::spawn(sample(Arc::clone(&state), shutdown.clone()));
    let router = router(Arc::clone(&state)).layer(DefaultBodyLimit::max(
        usize::try_from(config.limits.max_body).unwrap_or(usize::MAX),
    ));
    inbound::serve(listener, config.limits, shutdown.clone(), move |req| {
        let mut router = router.clone();
        async move { router.call(req).await }
    })
    .await;
    shutdown.cancel();
    state.jobs.stop().await;
    if let Err(e) = sampler.await {
        tracing::debug!(error = %e, "console: the fleet sampler ended");
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_listen_address_and_loopback_names_are_answered_to() {
        let hosts = hosts(
            "127.0.0.1:8088".parse().unwrap(),
            &["Console.Example".to_owned()],
        );
        assert!(hosts.contains(&"127.0.0.1:8088".to_owned()));
        assert!(hosts.contains(&"localhost:8088".to_owned()));
        assert!(hosts.contains(&"console.example".to_owned()));
        assert!(!hosts.contains(&"localhost".to_owned()));
    }
}
