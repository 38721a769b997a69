//! `bench --latency`: open-loop latency. A child process publishes on a fixed
//! schedule while the in-process worker consumes with a handler that
//! records, for each event, the time from its intended send time to the
//! handler call (the dedup commit and the ack follow it). CPU time is read
//! per process: the worker (this process), the publisher (the child), and
//! RabbitMQ and Redis when they run here.

use std::fmt::Write as _;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use shardline_ops::Fleet;
use shardline_publisher::LatencyHistogram;
use shardline_worker::{Event, Handler, HandlerError, Worker};
use tokio::io::AsyncBufReadExt as _;
use tokio_util::sync::CancellationToken;

use crate::cpu::{self, Service};
use crate::drain;
use crate::error::Error;
use crate::paced::PacedReport;
use crate::schedule::{Schedule, parse_event_id, unix_us};
use crate::scratch::Scratch;
use crate::settings::{BenchSettings, LatencySettings, Setting};

/// The noop handler that records latencies of the measured events (index at
/// or past `first_measured`).
#[derive(Debug, Default)]
struct Recorder {
    first_measured: u64,
    seen: AtomicU64,
    unreadable: AtomicU64,
    latencies: Mutex<LatencyHistogram>,
}

#[async_trait]
impl Handler for Recorder {
    async fn handle(&self, event: &Event<'_>) -> Result<(), HandlerError> {
        let now = unix_us();
        self.seen.fetch_add(1, Ordering::Relaxed);
        match event.envelope.event_id.as_deref().and_then(parse_event_id) {
            Some((i, due)) if i >= self.first_measured => self
                .latencies
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .record(Duration::from_micros(now.saturating_sub(due))),
            Some(_) => {}
            None => {
                self.unreadable.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

/// One setting's latency run.
#[derive(Debug, Clone)]
pub struct LatencyRow {
    pub setting: Setting,
    /// Events per second the schedule asked for.
    pub rate: f64,
    pub latencies: LatencyHistogram,
    /// Events published in all (warm-up included) and handled of them.
    pub sent: u64,
    pub handled: u64,
    /// CPU per event, over all events (warm-up included).
    pub worker_cpu: Option<Duration>,
    pub publisher_cpu: Option<Duration>,
    pub broker_cpu: Option<Duration>,
    pub redis_cpu: Option<Duration>,
    pub publisher_behind_p99: Option<Duration>,
    pub publisher_behind_max: Option<Duration>,
}

pub(crate) async fn measure(
    global: &Fleet,
    args: &BenchSettings,
    latency: &LatencySettings,
    setting: Setting,
    rate: f64,
    shutdown: &CancellationToken,
) -> Result<LatencyRow, Error> {
    let scratch = Scratch::create(global, "bench-latency").await?;
    let run = Run {
        global,
        args,
        latency,
        scratch: &scratch,
    };
    let result = run.one(setting, rate, shutdown).await;
    scratch.remove().await?;
    result
}

/// What one latency run works with.
struct Run<'a> {
    global: &'a Fleet,
    args: &'a BenchSettings,
    latency: &'a LatencySettings,
    scratch: &'a Scratch,
}

impl Run<'_> {
    async fn one(
        &self,
        setting: Setting,
        rate: f64,
        shutdown: &CancellationToken,
    ) -> Result<LatencyRow, Error> {
        let Self {
            global,
            args,
            latency,
            scratch,
        } = *self;
        let mut schedule = Schedule { start_us: 0, rate };
        let first_measured = schedule.events_within(latency.warmup);
        let total = schedule.events_within(latency.warmup + latency.duration);
        if total <= first_measured {
            return Err(Error::setting(
                &["rate", "duration"],
                "rate × duration gives no events to measure",
            ));
        }
        let recorder = Arc::new(Recorder {
            first_measured,
            ..Recorder::default()
        });
        let stop = CancellationToken::new();
        let _stop = stop.clone().drop_guard();
        let worker = Worker::new(
            drain::worker_config(scratch, args, setting),
            recorder.clone(),
        )?;
        let progress = worker.progress();
        let mut worker = tokio::spawn(worker.run(stop.clone()));
        let subscribed = Instant::now() + Duration::from_secs(30);
        while !progress.all_consuming() {
            if Instant::now() >= subscribed || worker.is_finished() {
                return Err(Error::Failed(
                    "the worker did not consume every shard within 30 s".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The publisher connects in this second; the warm-up absorbs the rest.
        schedule.start_us = unix_us() + 1_000_000;
        let mut child = self.spawn_publisher(schedule, total)?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| Error::Failed("publisher's stdout".into()))?;
        let report_line = tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            let mut last = None;
            while let Ok(Some(line)) = lines.next_line().await {
                last = Some(line);
            }
            last
        });

        let services = [
            Service::find("beam.smp", None),
            Service::find("redis-server", redis_port(global).as_deref()),
        ];
        tokio::time::sleep(Duration::from_micros(
            schedule.start_us.saturating_sub(unix_us()),
        ))
        .await;
        let worker_before = cpu::own();
        let services_before = services.each_ref().map(Service::cpu);

        let deadline = Instant::now() + latency.warmup + latency.duration + Duration::from_secs(30);
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        loop {
            tick.tick().await;
            if recorder.seen.load(Ordering::Relaxed) >= total || Instant::now() >= deadline {
                break;
            }
            if shutdown.is_cancelled() {
                return Err(Error::Failed("interrupted".into()));
            }
            if worker.is_finished() {
                let ended = (&mut worker).await;
                return Err(Error::Failed(format!(
                    "the worker stopped during the run: {ended:?}"
                )));
            }
        }
        let worker_cpu = cpu::spent(worker_before, cpu::own());
        let services_cpu = [0, 1].map(|i| cpu::spent(services_before[i], services[i].cpu()));

        stop.cancel();
        worker.await??;
        let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .map_err(Error::context("the publisher did not exit"))??;
        if !status.success() {
            return Err(Error::Failed(format!("the publisher failed: {status}")));
        }
        let line = report_line.await?.unwrap_or_default();
        let published = PacedReport::from_json(&line)
            .ok_or_else(|| Error::Failed(format!("unreadable publisher report: {line:?}")))?;

        let handled = recorder.seen.load(Ordering::Relaxed);
        let unreadable = recorder.unreadable.load(Ordering::Relaxed);
        if unreadable > 0 {
            tracing::warn!(unreadable, "events without the bench's event id");
        }
        let per_event = |d: Option<Duration>| {
            let n = u32::try_from(handled.max(1)).unwrap_or(u32::MAX);
            d.map(|d| d / n)
        };
        let latencies = recorder
            .latencies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Ok(LatencyRow {
            setting,
            rate,
            latencies,
            sent: published.sent,
            handled,
            worker_cpu: per_event(worker_cpu),
            publisher_cpu: published
                .cpu
                .map(|d| d / u32::try_from(published.sent.max(1)).unwrap_or(u32::MAX)),
            broker_cpu: per_event(services_cpu[0]),
            redis_cpu: per_event(services_cpu[1]),
            publisher_behind_p99: published.behind_p99,
            publisher_behind_max: published.behind_max,
        })
    }
}

/// `:6379` from the Redis URL, to tell its server from other local ones.
fn redis_port(global: &Fleet) -> Option<String> {
    let url = global.redis.url();
    let host = url.split("://").nth(1)?.split('/').next()?;
    let port = host.rsplit_once(':')?.1;
    Some(format!(":{port}"))
}

impl Run<'_> {
    /// The child publisher ([`LatencySettings::publisher`]), on the run's names.
    /// The broker URL goes through the environment, not the command line.
    fn spawn_publisher(
        &self,
        schedule: Schedule,
        total: u64,
    ) -> Result<tokio::process::Child, Error> {
        let Self {
            global,
            args,
            latency,
            scratch,
        } = *self;
        tokio::process::Command::new(&latency.publisher)
            .arg("bench-publisher")
            .arg(format!("--rate={}", schedule.rate))
            .arg(format!("--events={total}"))
            .arg(format!("--start-unix-us={}", schedule.start_us))
            .arg(format!("--events-per-order={}", args.events_per_order))
            .arg(format!("--event-bytes={}", args.event_bytes))
            .env("SHARDLINE_AMQP_URL", global.amqp.addresses().join(","))
            .env(
                "SHARDLINE_AMQP_ADDRESS_ORDER",
                global.amqp.order().to_string(),
            )
            .env("SHARDLINE_SHARDS", global.shards.to_string())
            .env("SHARDLINE_EXCHANGE", &scratch.names.exchange)
            .env("SHARDLINE_QUEUE_PREFIX", &scratch.names.queue_prefix)
            .env(
                "SHARDLINE_DEAD_LETTER_EXCHANGE",
                &scratch.names.dead_letter_exchange,
            )
            .env(
                "SHARDLINE_DEAD_LETTER_QUEUE",
                &scratch.names.dead_letter_queue,
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(Error::context("starting the publisher process"))
    }
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "n/a".into(), |d| format!("{:.2}", d.as_secs_f64() * 1e3))
}

fn us(d: Option<Duration>) -> String {
    d.map_or_else(|| "n/a".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e6))
}

/// The latency table: one row per setting.
pub(crate) fn table(rows: &[LatencyRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>8}  {:>11}  {:>7}  {:>8}  {:>7}  {:>7}  {:>7}  {:>7}  {:>7}  {:>7}  {:>7}  {:>7}  {:>16}",
        "prefetch",
        "concurrency",
        "rate/s",
        "measured",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "max ms",
        "worker",
        "publish",
        "rabbit",
        "redis",
        "pub late p99/max"
    );
    for r in rows {
        let h = &r.latencies;
        let _ = writeln!(
            out,
            "{:>8}  {:>11}  {:>7.0}  {:>8}  {:>7}  {:>7}  {:>7}  {:>7}  {:>7}  {:>7}  {:>7}  {:>7}  {:>13} ms",
            r.setting.prefetch,
            r.setting.concurrency,
            r.rate,
            h.count(),
            ms(h.percentile(50.0)),
            ms(h.percentile(99.0)),
            ms(h.percentile(99.9)),
            ms(h.max()),
            us(r.worker_cpu),
            us(r.publisher_cpu),
            us(r.broker_cpu),
            us(r.redis_cpu),
            format!(
                "{}/{}",
                ms(r.publisher_behind_p99),
                ms(r.publisher_behind_max)
            ),
        );
    }
    out.push_str(
        "latency: from each event's intended send time (open loop) to its handler call; the dedup commit and the ack come after.\n\
         worker, publish, rabbit, redis: CPU µs per event of each process (n/a: its /proc stat not found or not readable).\n",
    );
    for r in rows.iter().filter(|r| r.handled < r.sent) {
        let _ = writeln!(
            out,
            "prefetch {} concurrency {}: only {} of {} events were handled before the deadline; the percentiles are optimistic",
            r.setting.prefetch, r.setting.concurrency, r.handled, r.sent
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(latencies_ms: &[u64], sent: u64, handled: u64) -> LatencyRow {
        let mut latencies = LatencyHistogram::default();
        for &l in latencies_ms {
            latencies.record(Duration::from_millis(l));
        }
        LatencyRow {
            setting: Setting {
                prefetch: 32,
                concurrency: 1,
            },
            rate: 2000.0,
            latencies,
            sent,
            handled,
            worker_cpu: Some(Duration::from_micros(150)),
            publisher_cpu: Some(Duration::from_nanos(80_500)),
            broker_cpu: None,
            redis_cpu: Some(Duration::from_micros(20)),
            publisher_behind_p99: Some(Duration::from_micros(900)),
            publisher_behind_max: None,
        }
    }

    #[test]
    fn the_table_reports_percentiles_and_cpu_per_process() {
        // 10 000 events: 0.1 % of them at 40 ms, one at 900 ms.
        let mut values = vec![2; 9980];
        values.extend([40; 19]);
        values.push(900);
        let text = table(&[row(&values, 10_000, 10_000)]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].contains("p999 ms"), "{text}");
        let cells: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            cells[..6],
            ["32", "1", "2000", "10000", "2.01", "2.01"],
            "{text}"
        );
        assert!(cells[6].starts_with("40."), "{text}");
        assert_eq!(
            cells[7..],
            ["900.00", "150.0", "80.5", "n/a", "20.0", "0.90/n/a", "ms"],
            "{text}"
        );
        assert!(text.contains("the ack come after"), "{text}");
        assert!(!text.contains("optimistic"), "{text}");
    }

    #[test]
    fn missing_events_are_called_out() {
        let text = table(&[row(&[1], 10, 7)]);
        assert!(text.contains("only 7 of 10"), "{text}");
    }

    #[tokio::test]
    async fn the_recorder_measures_only_after_the_warm_up() {
        use shardline_contract::{Envelope, ShardCount};
        let Some(shard) = ShardCount::default().ids().next() else {
            panic!("no shard 0");
        };
        let recorder = Recorder {
            first_measured: 1,
            ..Recorder::default()
        };
        let now = unix_us();
        for (i, id) in [(0, format!("0@{now}")), (1, format!("1@{now}"))] {
            let body = format!(
                r#"{{"order_id":"A","event":"e","seq":{},"event_id":"{id}"}}"#,
                i + 1
            );
            let envelope = Envelope::parse(body.as_bytes(), 1 << 20).map_err(|e| e.to_string());
            let Ok(envelope) = envelope else {
                panic!("{envelope:?}");
            };
            let trace = opentelemetry::Context::new();
            let event = Event {
                envelope: &envelope,
                body: body.as_bytes(),
                dedup_key: "k",
                shard,
                attempt: 1,
                trace: &trace,
                traceparent: "",
                published_at_ms: None,
                baggage: None,
            };
            assert!(recorder.handle(&event).await.is_ok());
        }
        assert_eq!(recorder.seen.load(Ordering::Relaxed), 2);
        assert_eq!(
            recorder
                .latencies
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .count(),
            1
        );
    }
}
