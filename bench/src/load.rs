//! The load generator `shardline load`, the demo and the bench share: `K`
//! orders with `E` events each, interleaved, published at a rate or as fast
//! as confirms allow.

use std::fmt;
use std::time::{Duration, Instant};

use shardline_contract::{NewEvent, OrderId, OrderIdError};
use shardline_publisher::Publisher;
use tokio_util::sync::CancellationToken;

use crate::error::Error;

/// Event names by seq; every event after the fifth is an `order.updated`.
pub const LOAD_EVENT_NAMES: [&str; 5] = [
    "order.created",
    "inventory.reserved",
    "payment.captured",
    "order.fulfilled",
    "order.closed",
];

/// The id of the `i`-th generated order (1-based): `{prefix}ORD-000001`;
/// refused when the prefix makes it no order id (too long, a control character).
pub fn load_order_id(prefix: &str, i: u64) -> Result<OrderId, OrderIdError> {
    OrderId::new(format!("{prefix}ORD-{i:06}"))
}

/// The load generator's events: `orders` orders with seq `1..=events_per_order`
/// each, interleaved round-robin (seq 1 of every order, then seq 2, …), so each
/// order's events are in order while orders interleave.
pub fn load_events(
    orders: u64,
    events_per_order: u64,
    prefix: &str,
) -> impl Iterator<Item = Result<NewEvent, OrderIdError>> + Send + 'static {
    load_events_seeded(orders, events_per_order, prefix, 0)
}

/// [`load_events`] with the `data` payloads drawn from `seed`.
pub fn load_events_seeded(
    orders: u64,
    events_per_order: u64,
    prefix: &str,
    seed: u64,
) -> impl Iterator<Item = Result<NewEvent, OrderIdError>> + Send + 'static {
    let prefix = prefix.to_owned();
    (1..=events_per_order).flat_map(move |seq| {
        let prefix = prefix.clone();
        (1..=orders).map(move |order| {
            let name = usize::try_from(seq - 1)
                .ok()
                .and_then(|i| LOAD_EVENT_NAMES.get(i))
                .copied()
                .unwrap_or("order.updated");
            let amount = splitmix64(seed ^ splitmix64(order) ^ seq) % 100_000;
            Ok(NewEvent {
                order_id: load_order_id(&prefix, order)?,
                event: name.to_owned(),
                seq: Some(seq),
                event_id: None,
                data: serde_json::json!({ "amount_cents": amount }),
            })
        })
    })
}

/// A fast, well-mixed hash for reproducible payloads (not for security).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What a load run did.
#[derive(Debug, Clone)]
pub struct LoadReport {
    /// Events published by this run.
    pub events: u64,
    /// Of those, confirmed by the broker.
    pub confirmed: u64,
    /// From the first publish until every confirm arrived.
    pub elapsed: Duration,
    /// Publish → confirm latency percentiles of the publisher so far.
    pub p50: Option<Duration>,
    pub p99: Option<Duration>,
    /// Stopped early by the stop signal.
    pub interrupted: bool,
}

impl LoadReport {
    /// Confirmed events per second.
    pub fn rate(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.confirmed as f64 / secs
        } else {
            0.0
        }
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Option<Duration>| {
            d.map_or_else(
                || "n/a".to_owned(),
                |d| format!("{:.1} ms", d.as_secs_f64() * 1000.0),
            )
        };
        write!(
            f,
            "{}published {} ({} confirmed) in {:.2} s: {:.0} events/s; confirm latency p50 {}, p99 {}",
            if self.interrupted {
                "interrupted: "
            } else {
                ""
            },
            events(self.events),
            self.confirmed,
            self.elapsed.as_secs_f64(),
            self.rate(),
            ms(self.p50),
            ms(self.p99),
        )
    }
}

/// One step of [`publish_events`], for a progress display.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadProgress {
    /// One more event was published.
    Published,
    /// Every event is out; the confirms are awaited.
    AwaitingConfirms,
}

/// Publishes `events`, at most `rate` per second, until done or `shutdown`;
/// then flushes. Reports each step to `progress`.
pub async fn publish_events(
    publisher: &mut Publisher,
    events: impl Iterator<Item = Result<NewEvent, OrderIdError>>,
    rate: Option<f64>,
    shutdown: &CancellationToken,
    mut progress: impl FnMut(LoadProgress),
) -> Result<LoadReport, Error> {
    let before = publisher.counts();
    let started = Instant::now();
    let mut pacer = rate.map(Pacer::new);
    let mut interrupted = false;
    for event in events {
        let event = event.map_err(Error::OrderPrefix)?;
        if shutdown.is_cancelled() {
            interrupted = true;
            break;
        }
        if let Some(pacer) = pacer.as_mut() {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => {
                    interrupted = true;
                    break;
                }
                () = pacer.wait() => {}
            }
        }
        if let Err(e) = publisher.publish_event(&event).await {
            let published = publisher.counts().published - before.published;
            return Err(Error::context(format!("stopped after {published} events"))(
                e,
            ));
        }
        progress(LoadProgress::Published);
    }
    progress(LoadProgress::AwaitingConfirms);
    publisher.flush().await?;
    if interrupted {
        tracing::info!("stop signal: stopped generating, flushed what was sent");
    }
    let after = publisher.counts();
    Ok(LoadReport {
        events: after.published - before.published,
        confirmed: after.confirmed - before.confirmed,
        elapsed: started.elapsed(),
        p50: publisher.latency().percentile(50.0),
        p99: publisher.latency().percentile(99.0),
        interrupted,
    })
}

/// Paces publishing to an average rate with a timer tick, not a sleep per
/// event: at high rates each tick releases a batch.
struct Pacer {
    rate: f64,
    start: tokio::time::Instant,
    granted: u64,
    /// Most events released at once after a stall (a broker pause is not
    /// followed by a flood).
    burst: u64,
    tick: tokio::time::Interval,
}

impl Pacer {
    fn new(rate: f64) -> Self {
        let period = Duration::from_secs_f64((1.0 / rate).max(0.001));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        Self {
            rate,
            start: tokio::time::Instant::now(),
            granted: 0,
            burst: ((rate / 20.0).ceil() as u64).max(1),
            tick,
        }
    }

    async fn wait(&mut self) {
        loop {
            let due = due(self.start.elapsed(), self.rate);
            self.granted = self.granted.max(due.saturating_sub(self.burst));
            if self.granted < due {
                self.granted += 1;
                return;
            }
            self.tick.tick().await;
        }
    }
}

/// Events allowed by `elapsed` at `rate` per second (the first at once).
fn due(elapsed: Duration, rate: f64) -> u64 {
    (elapsed.as_secs_f64() * rate) as u64 + 1
}

/// `1 event`, `2 events`.
pub fn events(n: u64) -> String {
    if n == 1 {
        "1 event".to_owned()
    } else {
        format!("{n} events")
    }
}

/// The `pad` field that brings a generated event to about `event_bytes`.
pub fn padding(event_bytes: usize) -> String {
    "x".repeat(event_bytes.saturating_sub(130))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_events_interleave_orders_and_keep_each_order_in_seq() {
        let events: Vec<NewEvent> = load_events(3, 7, "run1-")
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(events.len(), 21);
        let firsts: Vec<&str> = events[..3].iter().map(|e| e.order_id.as_str()).collect();
        assert_eq!(
            firsts,
            ["run1-ORD-000001", "run1-ORD-000002", "run1-ORD-000003"]
        );
        let one: Vec<(u64, &str)> = events
            .iter()
            .filter(|e| e.order_id == "run1-ORD-000002")
            .map(|e| (e.seq.unwrap_or(0), e.event.as_str()))
            .collect();
        assert_eq!(
            one,
            [
                (1, "order.created"),
                (2, "inventory.reserved"),
                (3, "payment.captured"),
                (4, "order.fulfilled"),
                (5, "order.closed"),
                (6, "order.updated"),
                (7, "order.updated"),
            ]
        );
        for event in &events {
            assert!(event.to_body().is_ok());
        }
    }

    #[test]
    fn load_payloads_follow_the_seed() {
        let data = |seed| -> Vec<_> {
            load_events_seeded(2, 2, "", seed)
                .map(|e| e.unwrap().data)
                .collect()
        };
        let (a, b, c) = (data(7), data(7), data(8));
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn a_prefix_that_makes_no_order_id_is_refused() {
        let long = "p".repeat(300);
        let first = load_events(1, 1, &long).next().unwrap();
        assert!(matches!(first, Err(OrderIdError::TooLong(_))));
        assert!(load_order_id("a\n", 1).is_err());
    }

    #[test]
    fn pacing_allows_rate_per_second() {
        assert_eq!(due(Duration::ZERO, 100.0), 1);
        assert_eq!(due(Duration::from_millis(500), 100.0), 51);
        assert_eq!(due(Duration::from_secs(2), 0.5), 2);
    }

    #[test]
    fn report_line_has_rate_and_latency() {
        let report = LoadReport {
            events: 1000,
            confirmed: 1000,
            elapsed: Duration::from_secs(2),
            p50: Some(Duration::from_micros(1500)),
            p99: None,
            interrupted: false,
        };
        assert_eq!(
            report.to_string(),
            "published 1000 events (1000 confirmed) in 2.00 s: 500 events/s; confirm latency p50 1.5 ms, p99 n/a"
        );
    }
}
