//! The publisher of `bench --latency`, run as a child process of the bench
//! (the hidden `bench-publisher` subcommand) so that its CPU time is apart
//! from the worker's. It sends on the schedule, late when it must, never
//! skipping, and prints one JSON line: what it sent, how far behind the
//! schedule it got and the CPU it used.

use std::time::Duration;

use shardline_contract::{NewEvent, OrderIdError};
use shardline_publisher::{LatencyHistogram, Publisher};
use tokio_util::sync::CancellationToken;

use crate::cpu;
use crate::error::Error;
use crate::load::{load_order_id, padding};
use crate::schedule::{Schedule, event_id, unix_us};

/// What the publisher sends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PacedSettings {
    /// Events per second.
    pub rate: f64,
    /// Events to send in all.
    pub events: u64,
    /// When event 0 is due, µs since the Unix epoch.
    pub start_unix_us: u64,
    /// Events per order (seq 1..E, orders interleaved).
    pub events_per_order: u64,
    /// Approximate body size of each event, in bytes.
    pub event_bytes: usize,
}

/// What the child reports on stdout, one JSON object.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PacedReport {
    pub sent: u64,
    pub cpu: Option<Duration>,
    /// How late sends were against their due time.
    pub behind_p99: Option<Duration>,
    pub behind_max: Option<Duration>,
}

impl PacedReport {
    /// The line the publisher prints.
    pub fn to_json(self) -> serde_json::Value {
        let us = |d: Option<Duration>| d.map(|d| d.as_micros() as u64);
        serde_json::json!({
            "sent": self.sent,
            "cpu_us": us(self.cpu),
            "behind_p99_us": us(self.behind_p99),
            "behind_max_us": us(self.behind_max),
        })
    }

    /// The report a [`PacedReport::to_json`] line holds.
    pub fn from_json(line: &str) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        let us = |k: &str| v.get(k)?.as_u64().map(Duration::from_micros);
        Some(Self {
            sent: v.get("sent")?.as_u64()?,
            cpu: us("cpu_us"),
            behind_p99: us("behind_p99_us"),
            behind_max: us("behind_max_us"),
        })
    }
}

/// Event `i` of the stream: orders in blocks, each order's seqs in order.
fn event(i: u64, due_us: u64, events_per_order: u64, pad: &str) -> Result<NewEvent, OrderIdError> {
    // Blocks of 1000 orders: seq 1 of each, then seq 2, …, so an order's
    // events are spread out in time like a live shop's.
    const BLOCK: u64 = 1000;
    let per_block = BLOCK * events_per_order;
    let (block, within) = (i / per_block, i % per_block);
    Ok(NewEvent {
        order_id: load_order_id("LAT-", block * BLOCK + within % BLOCK + 1)?,
        event: "order.updated".into(),
        seq: Some(within / BLOCK + 1),
        event_id: Some(event_id(i, due_us)),
        data: serde_json::json!({ "pad": pad }),
    })
}

/// Publishes on the schedule `args` describes with a publisher configured by
/// `config`, until done or `shutdown`.
pub async fn publish(
    config: shardline_publisher::Config,
    args: &PacedSettings,
    shutdown: &CancellationToken,
) -> Result<PacedReport, Error> {
    if args.events_per_order == 0 {
        return Err(Error::setting(
            &["events_per_order"],
            "events_per_order must be at least 1",
        ));
    }
    let mut publisher = Publisher::connect(config).await?;
    let schedule = Schedule {
        start_us: args.start_unix_us,
        rate: args.rate,
    };
    let pad = padding(args.event_bytes);
    let mut behind = LatencyHistogram::default();
    let cpu_before = cpu::own();
    let mut sent = 0;
    for i in 0..args.events {
        let due = schedule.due_us(i);
        let now = unix_us();
        if due > now {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(Duration::from_micros(due - now)) => {}
            }
        }
        behind.record(Duration::from_micros(unix_us().saturating_sub(due)));
        publisher
            .publish_event(&event(i, due, args.events_per_order, &pad).map_err(Error::OrderPrefix)?)
            .await?;
        sent += 1;
    }
    publisher.flush().await?;
    let cpu = cpu::spent(cpu_before, cpu::own());
    publisher.close().await?;
    Ok(PacedReport {
        sent,
        cpu,
        behind_p99: behind.percentile(99.0),
        behind_max: behind.max(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::parse_event_id;

    #[test]
    fn the_report_round_trips_through_its_json_line() {
        let report = PacedReport {
            sent: 100,
            cpu: Some(Duration::from_millis(30)),
            behind_p99: Some(Duration::from_micros(700)),
            behind_max: None,
        };
        let line = report.to_json().to_string();
        assert_eq!(PacedReport::from_json(&line), Some(report));
        assert_eq!(PacedReport::from_json("not json"), None);
    }

    #[test]
    fn each_order_gets_its_seqs_in_order_and_ids_carry_the_schedule() {
        let events: Vec<NewEvent> = (0..4000)
            .map(|i| event(i, 7 + i, 2, ""))
            .collect::<Result<_, _>>()
            .unwrap();
        let one: Vec<u64> = events
            .iter()
            .filter(|e| e.order_id == "LAT-ORD-000002")
            .filter_map(|e| e.seq)
            .collect();
        assert_eq!(one, [1, 2]);
        let next_block: Vec<u64> = events
            .iter()
            .filter(|e| e.order_id == "LAT-ORD-001001")
            .filter_map(|e| e.seq)
            .collect();
        assert_eq!(next_block, [1, 2]);
        let id = events[2500].event_id.as_deref().unwrap_or_default();
        assert_eq!(parse_event_id(id), Some((2500, 2507)));
        assert!(events.iter().all(|e| e.to_body().is_ok()));
    }
}
