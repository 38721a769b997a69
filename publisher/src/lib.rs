//! shardline's publisher: confirmed, ordered publishing to the shard exchange.
//!
//! Each event goes to `shard.{md5(order_id) mod N}` on the sharding exchange,
//! persistent, `mandatory`, with publisher confirms. At most
//! [`Config::window`] events are unconfirmed at a time (backpressure); a nack
//! or a return is a typed [`PublishError`], never a log line. Per-order order
//! holds across reconnects: unconfirmed events are re-sent in their original
//! order before anything new. Each event gets a producer span, `{exchange}
//! publish`, from the global OpenTelemetry tracer (ended by its confirm), whose
//! W3C context travels in its `traceparent`/`tracestate` headers. Modules, in
//! the order an event meets them:
//!
//! - [`config`]: connection, window and reconnect settings.
//! - [`publisher`]: shard routing, sending, confirms and reconnection.
//! - `lease`: the publisher's registration in resharding's confirm barrier
//!   and the routing of the generation it acknowledged.
//! - `window`: the unconfirmed events, in order; backpressure and re-send order.
//! - [`confirm`]: the one confirmed-publish path (a confirm-mode channel, typed
//!   confirms), also used for the worker's dead letters.
//! - [`latency`]: publish → confirm latency histogram (p50/p99).
//! - [`error`]: what went wrong, shaped by what the caller does next.
//!
//! ```no_run
//! # async fn demo() -> Result<(), shardline_publisher::PublishError> {
//! use shardline_publisher::{Config, Publisher};
//! let mut publisher = Publisher::connect(Config::default()).await?;
//! publisher
//!     .publish(br#"{"order_id":"A1024","event":"order.created","seq":1}"#.to_vec())
//!     .await?;
//! publisher.close().await?;
//! # Ok(()) }
//! ```

pub mod config;
pub mod confirm;
pub mod error;
pub mod latency;
mod lease;
pub mod publisher;
mod window;

pub use config::Config;
pub use confirm::{ConfirmChannel, ConfirmError, Refusal};
pub use error::PublishError;
pub use latency::LatencyHistogram;
pub use publisher::{Counts, Publisher, Written};
