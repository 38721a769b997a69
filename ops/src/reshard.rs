//! `topology reshard --to M --plan`: what a reshard of the recorded topology
//! to M shards would move (ARCHITECTURE.md, "Resharding: the protocol"): the
//! sticky plan of `contract::reshard`, read from the record, described for an
//! operator. Nothing is declared; like every reader of the record, it
//! adopts a topology made before records (at the broker's count) first.

use std::fmt::Write as _;

use serde::Serialize;
use shardline_contract::reshard::{MAX_TARGET_SHARDS, Plan};
use shardline_contract::topology::TopologyRecord;

use crate::error::Error;
use crate::fleet::Fleet;

/// One move of the plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoveLine {
    pub from: u16,
    pub to: u16,
    /// Buckets moving, and their share of all orders (buckets / B).
    pub buckets: usize,
    pub share: f64,
    /// The holding queue the move's new events wait in.
    pub holding_queue: String,
}

/// What a reshard to M shards would do.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanReport {
    pub generation: u64,
    pub from_shards: u16,
    pub to_shards: u16,
    pub buckets: u16,
    pub moves: Vec<MoveLine>,
    /// The share of orders whose shard changes.
    pub moved_share: f64,
    /// Buckets per shard after the reshard, indexed by shard.
    pub loads_after: Vec<usize>,
    /// Shard queues to declare (growing), or to retire (shrinking): kept
    /// consumed and forwarding while legacy publishers still use them.
    pub new_queues: Vec<String>,
    pub retired_queues: Vec<String>,
}

/// The plan of a reshard of `fleet`'s recorded topology to `to` shards.
pub async fn plan(fleet: &Fleet, to: u32) -> Result<PlanReport, Error> {
    if !(1..=MAX_TARGET_SHARDS).contains(&to) {
        return Err(Error::config(
            &["to"],
            format!("to must be 1 to {MAX_TARGET_SHARDS} shards, got {to}"),
        ));
    }
    let record = crate::topology::recorded(fleet, "topology reshard")
        .await?
        .ok_or_else(|| {
            Error::config(
                &[],
                "no topology to reshard: run `shardline topology apply` first",
            )
        })?;
    describe(&record, to, fleet)
}

fn describe(record: &TopologyRecord, to: u32, fleet: &Fleet) -> Result<PlanReport, Error> {
    if let Some(running) = &record.reshard {
        return Err(Error::config(
            &[],
            format!(
                "a reshard to {} shards is in progress (started by {}, phase {:?})",
                running.to, running.started_by, running.phase
            ),
        ));
    }
    let routing = record
        .routing()
        .map_err(|e| Error::config(&[], e.to_string()))?;
    let map = routing.map();
    let plan: Plan = map
        .plan(to)
        .map_err(|e| Error::config(&["to"], e.to_string()))?;
    let b = map.bucket_count().max(1);
    let share = |n: usize| n as f64 / b as f64;
    let g = record.generation;
    let moves: Vec<MoveLine> = plan
        .moves
        .iter()
        .map(|m| MoveLine {
            from: m.from.get(),
            to: m.to.get(),
            buckets: m.buckets.len(),
            share: share(m.buckets.len()),
            holding_queue: fleet.names.hold_queue(g, m.from, m.to),
        })
        .collect();
    let (from_n, to_n) = (map.shard_count().get(), plan.target.shard_count().get());
    let queues = |range: std::ops::Range<u16>| -> Vec<String> {
        range
            .map(|i| fleet.names.shard_queue_named(u32::from(i)))
            .collect()
    };
    Ok(PlanReport {
        generation: g,
        from_shards: from_n,
        to_shards: to_n,
        buckets: u16::try_from(b).unwrap_or(u16::MAX),
        moved_share: share(plan.moved()),
        moves,
        loads_after: plan.target.loads(),
        new_queues: queues(from_n..to_n.max(from_n)),
        retired_queues: queues(to_n..from_n.max(to_n)),
    })
}

impl PlanReport {
    /// As `topology reshard --plan` prints it.
    pub fn text(&self) -> String {
        let mut out = format!(
            "reshard {} → {} shards (generation {}, {} buckets): {:.1} % of orders move, in {} moves\n",
            self.from_shards,
            self.to_shards,
            self.generation,
            self.buckets,
            self.moved_share * 100.0,
            self.moves.len()
        );
        for m in &self.moves {
            let _ = writeln!(
                out,
                "  shard {:>4} → {:<4} {:>5} buckets ({:>5.1} % of orders) through {}",
                m.from,
                m.to,
                m.buckets,
                m.share * 100.0,
                m.holding_queue
            );
        }
        let (least, most) = (
            self.loads_after.iter().min().copied().unwrap_or(0),
            self.loads_after.iter().max().copied().unwrap_or(0),
        );
        let _ = writeln!(
            out,
            "after it: {least} to {most} buckets per shard; orders that do not move never pause"
        );
        if !self.new_queues.is_empty() {
            let _ = writeln!(out, "new shard queues: {}", span(&self.new_queues));
        }
        if !self.retired_queues.is_empty() {
            let _ = writeln!(
                out,
                "retired (forwarding) queues: {} (kept consumed while events still arrive on them)",
                span(&self.retired_queues)
            );
        }
        out
    }
}

/// `a … z (n queues)`, or the one queue.
fn span(queues: &[String]) -> String {
    match queues {
        [] => String::new(),
        [one] => one.clone(),
        [first, .., last] => format!("{first} … {last} ({} queues)", queues.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_contract::ShardCount;

    fn fleet() -> Fleet {
        Fleet::default()
    }

    #[test]
    fn a_plan_names_its_moves_queues_and_share() {
        let record = TopologyRecord::first(ShardCount::new(8).unwrap(), "t", 0);
        let grow = describe(&record, 12, &fleet()).unwrap();
        assert_eq!((grow.from_shards, grow.to_shards), (8, 12));
        assert_eq!(grow.new_queues.len(), 4);
        assert!(grow.retired_queues.is_empty());
        let moved: usize = grow.moves.iter().map(|m| m.buckets).sum();
        assert!((grow.moved_share - moved as f64 / f64::from(grow.buckets)).abs() < 1e-9);
        // Growing 8 → 12 moves a third of the orders, no more.
        assert!(
            (grow.moved_share - 1.0 / 3.0).abs() < 0.01,
            "{}",
            grow.moved_share
        );
        let text = grow.text();
        assert!(
            text.starts_with("reshard 8 → 12 shards (generation 1"),
            "{text}"
        );
        assert!(text.contains("order.events.move.1."), "{text}");

        let shrink = describe(&record, 6, &fleet()).unwrap();
        assert_eq!(shrink.retired_queues.len(), 2);
        assert!(
            shrink.text().contains(
                "retired (forwarding) queues: order.events.shard.6 … order.events.shard.7"
            ),
            "{}",
            shrink.text()
        );
        assert!(describe(&record, 8, &fleet()).is_err(), "the same count");
    }
}
