//! shardline's operator web console: the fleet (shards, owners, backlog
//! levels, breakers, members) and its dead letters (failure groups from the
//! dead-letter index) as pages and as a JSON API, always behind a token.
//! Every fact comes from `shardline-ops`; this crate holds no operation
//! logic. Modules, in the order a request meets them:
//!
//! - `server`: [`serve`], the routes under the base path, the shared state.
//! - `guard`: the one gate: Host, Origin, session or bearer token, CSRF,
//!   role; the security headers of every response.
//! - [`token`]: named tokens (`admin`, `read-only`), their syntax, the
//!   constant-time lookup.
//! - `session`: login sessions in memory (cookie id → name, role, CSRF token).
//! - `pages`, `html`: login, the fleet page, the dead-letters page and a
//!   letter's detail, the audit and reconcile pages; `html` holds the
//!   templates' structs (the templates are in `console/templates/`).
//! - `api`: the JSON API under `api/` (reads: fleet, its history, the
//!   dead-letter index and one letter, the audit log, reconcile runs).
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
pub mod config;
pub mod error;
pub mod escape;
#[cfg(test)]
mod every_page;
mod guard;
mod history;
mod html;
mod jobs;
mod pages;
mod server;
mod session;
mod state;
pub mod token;

pub use config::Config;
pub use error::Error;
pub use guard::{CSP, CSRF_HEADER};
pub use server::serve;
pub use session::{COOKIE, SESSION_TTL};
pub use token::{MIN_TOKEN_CHARS, Role, Token, TokenError, Tokens};
