//! Resharding, N → M shards online: the protocol's pure decisions, without I/O.
//!
//! The fleet's reshard command, its publishers and its workers call these; the
//! model in `contract/tests/reshard_model.rs` runs them against a broker as
//! weak as RabbitMQ. Stages, in the order a reshard meets them:
//!
//! - [`Buckets`]: B buckets fixed with the first shard count N₀, and the bucket of an order.
//! - [`Map`] and [`Plan`]: one shard per bucket, and the sticky plan to M shards.
//! - [`Reshard`] and [`Phase`]: the reshard's steps as data, and where a
//!   bucket's new events go at each generation ([`Destination`]).
//! - [`barrier`]: may a marker go out (every live publisher acknowledged)?
//!   And what a publisher whose lease lapsed sends again ([`must_resend`]).
//! - [`Markers`]: a marker is honoured once, only if its id is pending.
//! - [`verdict`]: what a consumer does with a delivery: process, forward or wait.
//! - [`ReshardState`]: a reshard in progress as the recorded topology stores it.
#![warn(missing_docs)]

mod barrier;
mod buckets;
mod map;
mod marker;
mod route;
mod state;
mod verdict;

pub use barrier::{Barrier, Lease, barrier, may_acknowledge, must_resend};
pub use buckets::{Bucket, Buckets, BucketsError};
pub use map::{
    Generation, GenerationError, MAX_TARGET_SHARDS, Map, MapError, Move, MoveId, Plan, PlanError,
};
pub use marker::{Honour, MarkerError, MarkerId, MarkerKind, Markers};
pub use route::{Destination, Phase, Reshard, RouteError};
pub use state::ReshardState;
pub use verdict::{Progress, Source, Verdict, View, verdict};
