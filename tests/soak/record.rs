//! What the soak records while it runs (one sample a second) and reads at the
//! end (the downstream's calls, the DLQ), in the check's terms.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::BasicGetOptions;
use lapin::types::AMQPValue;
use shardline_soak::{Backlog, Call, Letter, Sample};
use shardline_testkit::TestEnv;
use shardline_testkit::downstream::Call as DownstreamCall;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::rig::Rig;

/// Samples the fleet once a second until stopped.
pub(crate) struct Recorder {
    stop: CancellationToken,
    task: JoinHandle<Vec<Sample>>,
}

impl Recorder {
    pub(crate) fn start(rig: Arc<Rig>, start: Instant) -> Self {
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut state = Sampling::default();
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    () = stopped.cancelled() => break,
                    _ = tick.tick() => {}
                }
                samples.push(state.sample(&rig, start).await);
            }
            samples
        });
        Self { stop, task }
    }

    pub(crate) async fn stop(self) -> Vec<Sample> {
        self.stop.cancel();
        self.task.await.unwrap()
    }
}

/// How long a call seen in flight is read again: longer than any answer
/// (the slow downstream's 300 ms, a handler timeout), shorter than for ever
/// for a call its worker abandoned.
const ABANDONED: Duration = Duration::from_secs(60);

/// What the sampler carries from one second to the next.
#[derive(Default)]
struct Sampling {
    /// Confirmed events seen so far (an index into the load's log).
    confirmed: usize,
    /// Calls seen so far (an index into the downstream's calls).
    calls: usize,
    /// Confirmed events not yet applied.
    backlog: Backlog,
    /// Calls seen in flight (their index), read again until answered: a call
    /// counts as applied when its 2xx answer is handed back.
    in_flight: Vec<usize>,
    /// The machine's CPU counters at the last sample: (busy, total) jiffies.
    cpu: Option<(u64, u64)>,
}

impl Sampling {
    async fn sample(&mut self, rig: &Rig, start: Instant) -> Sample {
        let new = rig.downstream.calls_since(self.calls);
        let seen = new.len();
        let mut answered: Vec<DownstreamCall> = Vec::with_capacity(seen);
        self.in_flight
            .retain(|&index| match rig.downstream.call(index) {
                Some(call) if call.completed => {
                    answered.push(call);
                    false
                }
                Some(call) => call.started.elapsed() < ABANDONED,
                None => false,
            });
        for (offset, call) in new.into_iter().enumerate() {
            if call.completed {
                answered.push(call);
            } else {
                self.in_flight.push(self.calls + offset);
            }
        }
        self.calls += seen;
        let mut applied = 0_u32;
        for call in answered.iter().filter(|c| c.ok()) {
            applied += 1;
            self.backlog.applied(call.key());
        }
        let confirmed = rig.confirmed_since(self.confirmed).await;
        self.confirmed += confirmed.len();
        for (at, event) in confirmed {
            self.backlog.confirmed(event.key(), at);
        }
        let now = Instant::now();
        let oldest = self.backlog.oldest();
        Sample {
            at: now - start,
            processed_per_sec: f64::from(applied),
            backlog_age_secs: oldest.map_or(0.0, |at| (now - at).as_secs_f64()),
            cpu_percent: self.cpu_percent(),
        }
    }

    /// The machine's CPU use since the last sample, from `/proc/stat`.
    fn cpu_percent(&mut self) -> f64 {
        let Some(now) = cpu_jiffies() else {
            return 0.0;
        };
        let before = self.cpu.replace(now);
        match before {
            Some((busy, total)) if now.1 > total => {
                (now.0 - busy) as f64 * 100.0 / (now.1 - total) as f64
            }
            _ => 0.0,
        }
    }
}

/// (busy, total) jiffies of all CPUs.
fn cpu_jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().sum();
    // idle and iowait are the 4th and 5th fields.
    let idle = fields.get(3)? + fields.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// The downstream's calls as the check reads them, each on the shard that
/// processed it: `shard_of(order, started)`.
pub(crate) fn calls(
    calls: &[shardline_testkit::Call],
    start: Instant,
    shard_of: impl Fn(&str, Instant) -> u16,
) -> Vec<Call> {
    calls
        .iter()
        .map(|c| {
            let order = c.order_id.clone().unwrap_or_default();
            let started = c.started.saturating_duration_since(start);
            Call {
                key: c.key().to_owned(),
                shard: shard_of(&order, c.started),
                order,
                seq: c.seq.unwrap_or(0),
                started,
                ended: c
                    .ended
                    .map_or(started, |e| e.saturating_duration_since(start)),
                status: if c.completed { c.status } else { 0 },
            }
        })
        .collect()
}

/// Every message in the DLQ, taken off it (the soak is over): its reason,
/// and its event's key, order, seq and shard where the body or the message id
/// tells them.
pub(crate) async fn letters(env: &TestEnv) -> Vec<Letter> {
    let conn = env.connect().await;
    let channel = conn.create_channel().await.unwrap();
    let mut letters = Vec::new();
    while let Some(message) = channel
        .basic_get(
            env.names.dead_letter_queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
    {
        let delivery = &message.delivery;
        let header = |name: &str| {
            delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(name).cloned())
        };
        let reason = match header("x-fail-reason") {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
            _ => String::new(),
        };
        let body: Option<serde_json::Value> = serde_json::from_slice(&delivery.data).ok();
        let field = |name: &str| body.as_ref().and_then(|b| b.get(name).cloned());
        let order = field("order_id").and_then(|v| v.as_str().map(str::to_owned));
        let event = field("event").and_then(|v| v.as_str().map(str::to_owned));
        let seq = field("seq").and_then(|v| v.as_u64());
        let key = match (&order, &event, seq) {
            (Some(o), Some(e), Some(s)) => Some(format!("{o}:{e}:{s}")),
            _ => delivery
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.as_str().to_owned()),
        };
        letters.push(Letter {
            key,
            shard: order.as_deref().map(|o| env.shard_of(o)),
            order,
            seq,
            reason,
        });
    }
    letters
}
