//! The resharding protocol (`contract::reshard`, designed in the reshard
//! design's "Resharding: the protocol") run against a broker as weak as
//! RabbitMQ: FIFO per channel only, routing at publish, an arbitrary enqueue
//! delay per (channel, queue) before a message lands and is confirmed,
//! redelivery of a dead consumer's unacked message, and Redis losing its last
//! write on a failover unless the write waited for the replica.
//!
//! Random interleavings of publishes, landings, deliveries, settles, worker,
//! command and publisher crashes, failovers and the reshard's steps, for N → M
//! with N and M in 1..=8; after every step the invariants are checked, and at
//! the end, after draining, that nothing was lost. Planted bugs ([`Bug`]) must
//! be caught.
//!
//! `SHARDLINE_MODEL_CASES` sets the number of cases of the correct protocol's
//! run (default 48).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "reshard_model/world.rs"]
mod world;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestError, TestRng, TestRunner};

use world::{Action, Bug, Cfg, ORDERS, PUBLISHERS, World};

/// One case: the first shard count N₀, the count before the reshard N, the
/// target M, and what happens.
#[derive(Debug, Clone)]
struct Scenario {
    first: u32,
    current: u32,
    target: u32,
    actions: Vec<Action>,
}

fn action() -> impl Strategy<Value = Action> {
    let publishers = PUBLISHERS as u8;
    prop_oneof![
        12 => (0..=publishers, 0..ORDERS.len() as u8, any::<bool>())
            .prop_map(|(p, order, sequenced)| Action::Publish { p, order, sequenced }),
        14 => any::<u8>().prop_map(Action::Land),
        3 => any::<u8>().prop_map(Action::Start),
        10 => any::<u8>().prop_map(Action::Deliver),
        10 => any::<u8>().prop_map(Action::Settle),
        5 => any::<u8>().prop_map(Action::Refresh),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(c, z)| Action::CrashWorker(c, z)),
        1 => any::<u8>().prop_map(Action::ZombieWrite),
        4 => any::<u8>().prop_map(Action::Renew),
        1 => any::<u8>().prop_map(Action::Reregister),
        3 => Just(Action::Tick),
        8 => Just(Action::Command),
        1 => Just(Action::CommandCrash),
        1 => any::<u8>().prop_map(Action::Resend),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(m, d)| Action::Forge(m, d)),
        1 => Just(Action::Failover),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        1u32..=8,
        1u32..=8,
        1u32..=8,
        proptest::collection::vec(action(), 1..160),
    )
        .prop_map(|(first, current, target, actions)| Scenario {
            first,
            current,
            // A reshard to the count it has is refused; take the next one.
            target: if target == current {
                target % 8 + 1
            } else {
                target
            },
            actions,
        })
}

fn run_case(cfg: Cfg, s: &Scenario) -> Result<(), TestCaseError> {
    let mut world = World::new(cfg, s.first, s.current, s.target);
    for (i, &action) in s.actions.iter().enumerate() {
        world
            .step(action)
            .map_err(|e| TestCaseError::fail(format!("step {i} {action:?}: {e}")))?;
    }
    world
        .finish()
        .map_err(|e| TestCaseError::fail(format!("after draining: {e}")))
}

fn run(cfg: Cfg, cases: u32, seed: Option<u8>) -> Result<(), TestError<Scenario>> {
    let config = Config {
        cases,
        max_shrink_iters: if seed.is_some() { 256 } else { 4096 },
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = match seed {
        Some(seed) => TestRunner::new_with_rng(
            config,
            TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
        ),
        None => TestRunner::new(config),
    };
    runner.run(&scenario(), |s| run_case(cfg, &s))
}

fn cases() -> u32 {
    std::env::var("SHARDLINE_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

const CORRECT: Cfg = Cfg {
    bug: None,
    lease_waits: true,
};

#[test]
fn the_protocol_keeps_every_invariant() {
    if let Err(e) = run(CORRECT, cases(), None) {
        panic!("{e}");
    }
}

fn caught(bug: Bug) {
    let cfg = Cfg {
        bug: Some(bug),
        ..CORRECT
    };
    match run(cfg, 2000, Some(7)) {
        Err(TestError::Fail(reason, scenario)) => {
            eprintln!("{bug:?} caught: {reason}\n  minimal case: {scenario:?}");
        }
        Err(e) => panic!("{bug:?}: {e}"),
        Ok(()) => panic!("{bug:?} was not caught"),
    }
}

#[test]
fn unbind_before_bind_is_caught() {
    caught(Bug::UnbindBeforeBind);
}

#[test]
fn marker_without_barrier_is_caught() {
    caught(Bug::MarkerWithoutBarrier);
}

#[test]
fn forged_marker_honoured_is_caught() {
    caught(Bug::ForgedMarkerHonoured);
}

#[test]
fn publish_after_lease_lapse_is_caught() {
    caught(Bug::PublishAfterLeaseLapse);
}

#[test]
fn release_before_marker_is_caught() {
    caught(Bug::ReleaseBeforeMarker);
}

#[test]
fn fence_from_old_scope_is_caught() {
    caught(Bug::FenceFromOldScope);
}
