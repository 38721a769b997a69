//! Cluster tests: shardline on a private three-node RabbitMQ cluster
//! ([`shardline_testkit::Cluster`], started by `scripts/cluster` with free ports
//! and node names of its own, stopped and removed when the test ends, also on
//! failure), whose nodes the tests kill -9, pause, cut off and restart.
//!
//! None of them touches the machine's RabbitMQ. They are `#[ignore]`d so that
//! the parallel suite skips them: a cluster costs three VMs and about 20 s of
//! start on two cores, and their timing matters. `scripts/test` runs them
//! after the outage tests, one at a time:
//!
//! ```sh
//! cargo test --features test-support --test cluster -- --ignored --test-threads=1
//! ```
//!
//! - [`smoke`]: the cluster itself: a quorum queue has a member on each node,
//!   a killed node leaves the other two serving, it rejoins after a restart,
//!   and nothing runs after the handle is dropped.
//! - [`spread`]: `topology apply` spreads quorum leaders over the nodes; a
//!   worker and a publisher given the three addresses process everything.
//! - [`home_node`]: classic shard queues on a cluster: a shard whose node is
//!   down waits (404 "home node … is down" is not a missing topology) while
//!   the others run; it resumes when its node is back.
//! - [`failover`]: under load, kill -9 of the node the worker and the publisher
//!   are on, which leads the most shard queues: nothing lost, order kept, at
//!   most one repeated call per shard, publishing resumed within seconds, the
//!   DLQ still there; the node rejoins.
//! - [`rolling`]: under load, `stop_app` and `start_app` of each node in turn,
//!   the next only once no node is quorum-critical: the same guarantees.
//! - [`reshard`]: 8 → 12 quorum shards under load, a node killed -9 and
//!   restarted during it: the command run again resumes; nothing lost.
//! - [`partition`]: under load, the active worker's node separated while a
//!   standby waits on another — frozen (SIGSTOP) for twice the net tick time,
//!   or cut off at the network level (nftables) for 30 s and healed: the
//!   separated side's consumer, while it still works, is fenced; nothing lost, order
//!   kept, overlapping calls of one order only within the fault's window, the
//!   order state in Redis intact.
//! - [`confirms`]: the publisher's node frozen (SIGSTOP: no error, no
//!   confirms): after `confirm_timeout` the publisher moves to another node
//!   and sends its window again; nothing lost.
//!
//! [`load`] is what the tests under load share: the pinned clients, the
//! steady stream of confirmed batches and the guarantees they check.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod confirms;
mod failover;
mod home_node;
mod load;
mod partition;
mod reshard;
mod rolling;
mod smoke;
mod spread;
