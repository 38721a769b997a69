//! The outbox against PostgreSQL: the machine's (`shardline_testkit::pg::PG_URL`,
//! each test in a schema of its own, dropped afterwards) and a private
//! server for a restart. One binary, one harness (`helpers`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod append;
mod helpers;
mod install;
mod private;
mod seed;
