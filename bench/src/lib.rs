//! shardline's measurements as a library: what `shardline bench` and
//! `shardline load` do, for the command line and Rust users alike.
//!
//! [`run`] takes plain settings ([`BenchSettings`]) and where the fleet is
//! ([`Fleet`](shardline_ops::Fleet): its broker, Redis and shard count),
//! measures on throwaway names beside it, reports each step as a
//! [`BenchEvent`] through a callback and returns a [`BenchReport`]; it never
//! prints. The worker drains a pre-published load next to raw lapin
//! consume-and-ack loops (with one Redis `SET NX EX` per event, and without
//! Redis), in alternating rounds of the same run on the same broker, Redis
//! and shard count. With a downstream latency the worker calls a local HTTP
//! downstream that answers after that long (the `http` handler), once per
//! concurrency, and the rates are compared with the first one's. With
//! [`LatencySettings`] it measures open-loop latency at a fixed rate instead.
//! Modules, in the order a run uses them:
//!
//! - `settings`: what a run measures, checked.
//! - `run`: a run, its steps and its report.
//! - [`rounds`]: the kinds of a round, per-round ratios, medians and spreads, the table.
//! - `drain`: one drain measurement (pre-publish, drain, clean up), the baselines.
//! - [`latency`]: open-loop latency: the worker with a recording handler, the table.
//! - `schedule`: the intended send times and the event ids that carry them.
//! - [`paced`]: the publisher of a latency run, run as a child process.
//! - `cpu`: CPU time per process from `/proc`.
//! - [`demo`]: the whole pipeline on throwaway names, with injected faults.
//! - [`load`]: the load generator (`shardline load`, the demo, the bench).
//! - [`receive`]: a stand-in for the user's service while trying shardline out.
//! - [`scratch`]: throwaway names for the demo and the bench.
//! - [`error`]: what went wrong, naming settings, never flags.

mod cpu;
pub mod demo;
mod drain;
pub mod error;
pub mod latency;
pub mod load;
pub mod paced;
pub mod receive;
pub mod rounds;
mod run;
mod schedule;
pub mod scratch;
mod settings;

pub use error::Error;
pub use latency::LatencyRow;
pub use load::{LoadProgress, LoadReport, publish_events};
pub use paced::{PacedReport, PacedSettings};
pub use rounds::{Baseline, Spread, Summary};
pub use run::{BenchEvent, BenchReport, run};
pub use scratch::Scratch;
pub use settings::{BenchSettings, LatencySettings, Setting};
