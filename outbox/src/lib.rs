//! shardline's transactional outbox in PostgreSQL: how an application
//! writes its events in the same transaction as its orders' state, so that
//! an event goes out if and only if its transaction committed.
//!
//! The application calls `shardline_outbox_append(order_id, event, data)`
//! in its own transaction; the function gives the order's next seq and
//! writes the event as a row of `shardline_outbox`. A relay publishes the
//! committed rows and deletes them once the broker confirmed. This crate
//! installs the objects (`shardline outbox install`); the SQL and what it
//! promises are in [`sql`] and `docs/operating/outbox.md`. Modules in the
//! order an installation meets them:
//!
//! - `schema`: [`Schema`], the schema the outbox lives in, checked once
//!   ([`validate_schema`]) and quoted wherever SQL names it.
//! - `database`: [`DatabaseUrl`], where the application's PostgreSQL is,
//!   shown redacted; connecting.
//! - [`sql`]: every object's name and `CREATE` statement ([`Part`]), and the
//!   whole script ([`sql::sql`]).
//! - `install`: [`install()`], idempotent and safe to run twice at once, and
//!   its report [`Installed`].
//! - [`relay`]: [`relay::Relay`], which publishes the committed rows, one
//!   relay at a time per outbox.
//! - `error`: [`OutboxError`], naming what failed, passwords hidden.

mod database;
mod error;
mod install;
pub mod relay;
mod schema;
pub mod sql;

pub use database::DatabaseUrl;
pub use error::OutboxError;
pub use install::{Installed, install};
pub use schema::{DEFAULT_SCHEMA, Schema, validate_schema};
pub use sql::{Part, VERSION};
