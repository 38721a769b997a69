//! shardline's operator web console: the fleet (shards, owners, backlog
//! levels, breakers, members) and its dead letters (failure groups from the
//! dead-letter index) as pages and as a JSON API, always behind a token.
//! Every fact comes from `shardline-ops`; this crate holds no operation
//! logic. Modules, in the order a request meets them:
//!
//! - `server`: [`serve`], the routes under the base path, the shared state.
//! - `guard`: the one gate: Host, Origin, session or bearer token, CSRF,
//!   role; the security headers of every response.
//! - `client`: who a request comes from (the peer, or behind a trusted
//!   proxy, `X-Forwarded-For`).
//! - `throttle`: failed token checks per client address and over all.
//! - [`token`]: named tokens (`admin`, `read-only`), their syntax, the
//!   constant-time lookup.
//! - `session`: login sessions in memory (cookie id → name, role, CSRF token).
//! - `pages`, `html`: login, the fleet page, the dead-letters page and a
//!   letter's detail, the audit and reconcile pages; `html` holds the
//!   templates' structs (the templates are in `console/templates/`).
//! - `api`: the JSON API under `api/` (reads: fleet, its history, the
//!   dead-letter index and one letter, the audit log, reconcile runs).
//! - `letter`: a dead letter as its detail shows it; `recent`: letters an
//!   admin opened lately, kept a few seconds.
//! - `actions`: the POSTs (replay, purge, release, reconcile dry run,
//!   cancel) and the jobs' views over server-sent events.
//! - `jobs`: server-side jobs that outlive the browser tab.
//! - `history`: the backlog-age samples and their chart.
//! - [`escape`]: the one escaping function for untrusted text.
//! - `assets`: the embedded stylesheet and script.
//! - [`config`], [`error`]: the settings and what can go wrong.

// The fleet status's future (broker probe, queues, Redis) is deep.
#![recursion_limit = "256"]

mod actions;
mod api;
mod assets;
mod client;
pub mod config;
pub mod error;
pub mod escape;
#[cfg(test)]
mod every_page;
mod guard;
mod history;
mod html;
mod jobs;
mod letter;
mod pages;
mod recent;
mod server;
mod session;
mod state;
mod throttle;
pub mod token;

pub use config::{Config, LETTERS_READ};
pub use error::Error;
pub use guard::{CSP, CSRF_HEADER};
pub use server::serve;
pub use session::{COOKIE, SESSION_TTL};
pub use token::{MIN_TOKEN_CHARS, Role, Token, TokenError, Tokens};
