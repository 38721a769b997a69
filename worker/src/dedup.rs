//! The Redis state of events and orders, one Lua script per step (SPEC §3).
//!
//! - `admit`: before the handler. Reads the event's dedup key and its order's
//!   gate (last seq passed) and, when the event may run, claims it: the value
//!   `processing:{lease deadline ms}:{starts}` counts handler starts that never
//!   finished, so an event that kills the process is recognised across restarts.
//! - `commit`: after the handler. `done` for the dedup TTL and the gate moved
//!   to this seq, atomically.
//! - `renew`, `release`, `pass` (a dead-lettered event counts as passed).
//!
//! One round trip each; `commit` and the next event's `admit` travel together
//! when the next delivery is already here.

use std::time::Duration;

use std::time::{SystemTime, UNIX_EPOCH};

use redis::{Cmd, Pipeline, Script};
use shardline_topology::Keys;

use crate::config::{Config, OnDeadLetter};
use crate::quarantine::{self, Blocker};
use crate::store::RedisSlot;

/// Lua helpers: seqs go up to 2^63-1, beyond a Lua number's precision, so they
/// are compared as decimal strings.
const LUA_COMMON: &str = r"
local function cmp(a, b)
  if #a ~= #b then return #a < #b and -1 or 1 end
  if a == b then return 0 end
  return a < b and -1 or 1
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function advance(gate, seq, ttl)
  local last = redis.call('GET', gate)
  if not last or cmp(seq, last) > 0 then
    redis.call('SET', gate, seq, 'EX', ttl)
  else
    redis.call('EXPIRE', gate, ttl)
  end
end
";

/// KEYS: dedup, gate. ARGV: lease ms, seq ('' without), seq-1, redelivered,
/// bypass gate, max starts, evidence ms, claim token (so that a retried admit
/// whose first reply was lost recognises its own claim).
const ADMIT: &str = r"
local v = redis.call('GET', KEYS[1])
if v == 'done' then return {'duplicate', 0} end
if ARGV[2] ~= '' and ARGV[5] ~= '1' then
  local last = redis.call('GET', KEYS[2])
  if not last then
    if ARGV[2] ~= '1' then return {'start', 0} end
  elseif cmp(ARGV[2], last) <= 0 then return {'late', 0}
  elseif cmp(ARGV[3], last) > 0 then return {'gap', 0}
  end
end
local now = now_ms()
local starts = 1
local verdict = 'claimed'
if v then
  local deadline, n, token = string.match(v, '^processing:(%d+):(%d+):(.*)$')
  deadline = tonumber(deadline) or 0
  n = tonumber(n) or 1
  if token == ARGV[8] then return {'claimed', n} end
  if ARGV[4] ~= '1' and deadline > now then return {'wait', deadline - now} end
  if n >= tonumber(ARGV[6]) then return {'crashloop', n} end
  starts = n + 1
  verdict = 'takeover'
end
redis.call('SET', KEYS[1], 'processing:' .. (now + tonumber(ARGV[1])) .. ':' .. starts .. ':' .. ARGV[8], 'PX', ARGV[7])
return {verdict, starts}
";

/// KEYS: dedup, gate. ARGV: ttl s, seq ('' without).
const COMMIT: &str = r"
redis.call('SET', KEYS[1], 'done', 'EX', ARGV[1])
if ARGV[2] ~= '' then advance(KEYS[2], ARGV[2], ARGV[1]) end
return 1
";

/// KEYS: dedup. ARGV: lease ms, evidence ms, change of the unfinished starts
/// (+1 a call begins, -1 it ended, 0 the claim is only kept alive).
const RENEW: &str = r"
local v = redis.call('GET', KEYS[1])
local n, token = 1, ''
if v then
  local _, c, t = string.match(v, '^processing:(%d+):(%d+):(.*)$')
  n = tonumber(c) or 1
  token = t or ''
end
n = math.max(n + tonumber(ARGV[3]), 0)
redis.call('SET', KEYS[1], 'processing:' .. (now_ms() + tonumber(ARGV[1])) .. ':' .. n .. ':' .. token, 'PX', ARGV[2])
return n
";

/// KEYS: dedup. Deletes a claim, never a `done` mark.
const RELEASE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 11) == 'processing:' then return redis.call('DEL', KEYS[1]) end
return 0
";

/// KEYS: gate. ARGV: ttl s, seq.
const PASS: &str = r"
advance(KEYS[1], ARGV[2], ARGV[1])
return 1
";

/// How long the evidence of an unfinished handler start is kept, whatever the
/// lease: a process that crash-loops slowly is still caught.
const EVIDENCE: Duration = Duration::from_secs(24 * 3600);

/// The dedup mark of a processed event.
const DONE: &str = "done";

/// What a lease renewal says about the claim's handler start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// A handler call begins now.
    Begins,
    /// The call returned (it failed; the event waits for another attempt).
    Ended,
    /// Nothing runs; the claim is kept alive while the event waits.
    Waits,
}

/// What `admit` decided.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// The event is ours to run (`starts` = this start included).
    Claimed,
    /// Taken over from a consumer that died mid-handler.
    TakenOver,
    /// Processed before: ack and do nothing.
    Duplicate,
    /// Its seq is at or below the order's last, yet it never ran: its gap was
    /// given up. Dead-letter `late`.
    Late,
    /// A seq gap before it: hold it until the gap fills or the grace ends.
    Gap,
    /// No state for its order and seq > 1: hold it for the start grace.
    Start,
    /// A live lease on a first delivery (two copies in flight at once): wait.
    Wait(Duration),
    /// Its handler was started this many times and never finished.
    CrashLoop(u32),
    /// Its order is quarantined behind this dead letter (quarantine mode);
    /// the claim was given back.
    Quarantined(Blocker),
}

/// An `admit` request: the event and how to treat it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admission<'a> {
    pub(crate) dedup_key: &'a str,
    pub(crate) order_key: &'a str,
    pub(crate) seq: Option<u64>,
    pub(crate) redelivered: bool,
    /// Skip the sequence gate (a replay, an applied gap, an accepted start).
    pub(crate) bypass_gate: bool,
    /// A replay's dead-letter id (what the quarantine check needs).
    pub(crate) replay_of: Option<&'a str>,
    /// Unique per delivery.
    pub(crate) token: u64,
}

/// An event whose handler succeeded, to commit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Done<'a> {
    pub(crate) dedup_key: &'a str,
    pub(crate) order_key: &'a str,
    /// Its kind, recorded per order for `shardline reconcile`.
    pub(crate) event: &'a str,
    pub(crate) seq: Option<u64>,
    /// A replay's dead-letter id: applied, it no longer holds its order in
    /// quarantine.
    pub(crate) replay_of: Option<&'a str>,
    /// It ran past the gate (replay, accepted start, applied gap).
    pub(crate) bypassed: bool,
}

/// What a fast admit's pipeline answered.
struct FastAdmit {
    /// The dedup key's value before the `SET NX GET` (none: claimed now).
    previous: Option<String>,
    /// The order's last passed seq.
    last: Option<String>,
    /// Quarantine mode: the order's quarantine head.
    head: Option<quarantine::Head>,
}

/// Key layout, timings and scripts of the Redis state.
#[derive(Debug, Clone)]
pub(crate) struct Dedup {
    keys: Keys,
    lease_ms: u64,
    ttl_secs: u64,
    kinds_ttl_secs: u64,
    max_starts: u32,
    /// Quarantine mode: admit also checks the order's quarantine.
    quarantine: bool,
    admit: Script,
    commit: Script,
    renew: Script,
    release: Script,
    pass: Script,
}

impl Dedup {
    pub(crate) fn new(config: &Config) -> Self {
        let script = |body: &str| Script::new(&format!("{LUA_COMMON}{body}"));
        Self {
            keys: config.keys(),
            lease_ms: u64::try_from(config.lease().as_millis()).unwrap_or(u64::MAX),
            ttl_secs: config.dedup_ttl.as_secs().max(1),
            kinds_ttl_secs: config.kinds_ttl().as_secs(),
            max_starts: config.max_deliveries.max(1),
            quarantine: config.on_dead_letter == OnDeadLetter::Quarantine,
            admit: script(ADMIT),
            commit: script(COMMIT),
            renew: script(RENEW),
            release: script(RELEASE),
            pass: script(PASS),
        }
    }

    /// Every script's source, for loading after a Redis restart.
    pub(crate) fn scripts(&self) -> Vec<Script> {
        vec![
            self.admit.clone(),
            self.commit.clone(),
            self.renew.clone(),
            self.release.clone(),
            self.pass.clone(),
        ]
    }

    fn evalsha(script: &Script, keys: &[String], args: &[String]) -> Cmd {
        let mut cmd = Cmd::new();
        cmd.arg("EVALSHA")
            .arg(script.get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        cmd
    }

    fn admit_cmd(&self, a: &Admission<'_>) -> Cmd {
        let seq = a.seq.map(|s| s.to_string()).unwrap_or_default();
        let prev = a.seq.map(|s| (s - 1).to_string()).unwrap_or_default();
        let flag = |b: bool| if b { "1" } else { "0" }.to_owned();
        Self::evalsha(
            &self.admit,
            &[self.keys.dedup(a.dedup_key), self.keys.gate(a.order_key)],
            &[
                self.lease_ms.to_string(),
                seq,
                prev,
                flag(a.redelivered),
                flag(a.bypass_gate),
                self.max_starts.to_string(),
                EVIDENCE.as_millis().to_string(),
                a.token.to_string(),
            ],
        )
    }

    fn commit_cmd(&self, dedup_key: &str, order_key: &str, seq: Option<u64>) -> Cmd {
        Self::evalsha(
            &self.commit,
            &[self.keys.dedup(dedup_key), self.keys.gate(order_key)],
            &[
                self.ttl_secs.to_string(),
                seq.map(|s| s.to_string()).unwrap_or_default(),
            ],
        )
    }

    /// Decides whether an event may run now and, if so, claims it: one round
    /// trip of plain commands on the usual path, the `admit` script when the key
    /// holds a claim already (a crash, a copy in flight).
    pub(crate) async fn admit(&self, redis: &mut RedisSlot, admission: &Admission<'_>) -> Verdict {
        if admission.redelivered {
            return self.admit_scripted(redis, admission).await;
        }
        let mut pipe = redis::pipe();
        self.add_fast_admit(&mut pipe, admission);
        let answers = self.query_fast_admit(redis, &pipe).await;
        self.finish_admit(redis, admission, answers).await
    }

    /// The full `admit` script (takeover, crash-loop count, lease wait), then
    /// the quarantine check apart: this path is rare.
    async fn admit_scripted(&self, redis: &mut RedisSlot, admission: &Admission<'_>) -> Verdict {
        let answer: (String, i64) = redis.query(&self.admit_cmd(admission)).await;
        self.after_script(redis, admission, verdict(answer)).await
    }

    /// A claim the script granted, checked against the order's quarantine in
    /// quarantine mode (a round trip of its own).
    async fn after_script(
        &self,
        redis: &mut RedisSlot,
        a: &Admission<'_>,
        verdict: Verdict,
    ) -> Verdict {
        if !self.quarantine || !matches!(verdict, Verdict::Claimed | Verdict::TakenOver) {
            return verdict;
        }
        let mut pipe = redis::pipe();
        quarantine::add_head_query(&mut pipe, &self.keys, a.order_key, a.replay_of);
        let head: quarantine::Head = redis.query_pipeline(&pipe).await;
        self.quarantine_verdict(redis, a, Some(head), verdict).await
    }

    /// Claims with `SET NX GET` and reads the order's gate alongside.
    fn add_fast_admit(&self, pipe: &mut Pipeline, a: &Admission<'_>) {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let deadline = now_ms.saturating_add(self.lease_ms);
        pipe.cmd("SET")
            .arg(self.keys.dedup(a.dedup_key))
            .arg(format!("processing:{deadline}:1:{}", a.token))
            .arg("NX")
            .arg("PX")
            .arg(EVIDENCE.as_millis().to_string())
            .arg("GET");
        pipe.cmd("GET").arg(self.keys.gate(a.order_key));
        if self.quarantine {
            quarantine::add_head_query(pipe, &self.keys, a.order_key, a.replay_of);
        }
    }

    /// Runs a pipeline ending in a fast admit: the claim's previous value, the
    /// gate, and in quarantine mode the order's quarantine head.
    async fn query_fast_admit(&self, redis: &mut RedisSlot, pipe: &Pipeline) -> FastAdmit {
        if self.quarantine {
            let (previous, last, head, own) = redis.query_pipeline(pipe).await;
            FastAdmit {
                previous,
                last,
                head: Some((head, own)),
            }
        } else {
            let (previous, last) = redis.query_pipeline(pipe).await;
            FastAdmit {
                previous,
                last,
                head: None,
            }
        }
    }

    /// The verdict from a fast admit's answers; gives the claim back when the
    /// gate says the event must wait or is late, or its order is quarantined.
    async fn finish_admit(
        &self,
        redis: &mut RedisSlot,
        a: &Admission<'_>,
        answers: FastAdmit,
    ) -> Verdict {
        match answers.previous.as_deref() {
            Some(DONE) => return Verdict::Duplicate,
            Some(_) => return self.admit_scripted(redis, a).await,
            None => {}
        }
        let held = a.seq.filter(|_| !a.bypass_gate).and_then(|seq| {
            match answers.last.and_then(|l| l.parse::<u64>().ok()) {
                None if seq > 1 => Some(Verdict::Start),
                Some(last) if seq <= last => Some(Verdict::Late),
                Some(last) if seq > last.saturating_add(1) => Some(Verdict::Gap),
                _ => None,
            }
        });
        if let Some(verdict) = held {
            self.release(redis, a.dedup_key).await;
            return verdict;
        }
        self.quarantine_verdict(redis, a, answers.head, Verdict::Claimed)
            .await
    }

    /// `claimed` unless the order's quarantine head (when asked for) blocks
    /// the event: then the claim is given back.
    async fn quarantine_verdict(
        &self,
        redis: &mut RedisSlot,
        a: &Admission<'_>,
        head: Option<quarantine::Head>,
        claimed: Verdict,
    ) -> Verdict {
        match head.and_then(|head| quarantine::blocker(head, a.seq, a.replay_of)) {
            Some(blocker) => {
                self.release(redis, a.dedup_key).await;
                Verdict::Quarantined(blocker)
            }
            None => claimed,
        }
    }

    /// Adds the commit of `done` to `pipe`. An event that ran in sequence moves
    /// its gate with a plain `SET` (its shard is the order's only writer and the
    /// admit saw seq = last + 1); one that bypassed the gate (a replay, an
    /// accepted start, an applied gap) needs the script, which only moves it
    /// forward.
    /// Either way the order's processed kind is recorded (one `SET`; off with
    /// a kinds TTL of 0), and an applied replay leaves its order's quarantine.
    fn add_commit(&self, pipe: &mut Pipeline, done: &Done<'_>) {
        if self.kinds_ttl_secs > 0 {
            pipe.cmd("SET")
                .arg(self.keys.kind(done.order_key, done.event))
                .arg(1)
                .arg("EX")
                .arg(self.kinds_ttl_secs)
                .ignore();
        }
        if let Some(id) = done.replay_of {
            pipe.cmd("ZREM")
                .arg(self.keys.quarantine(done.order_key))
                .arg(id)
                .ignore();
        }
        if done.bypassed {
            pipe.add_command(self.commit_cmd(done.dedup_key, done.order_key, done.seq))
                .ignore();
            return;
        }
        pipe.cmd("SET")
            .arg(self.keys.dedup(done.dedup_key))
            .arg(DONE)
            .arg("EX")
            .arg(self.ttl_secs)
            .ignore();
        if let Some(seq) = done.seq {
            pipe.cmd("SET")
                .arg(self.keys.gate(done.order_key))
                .arg(seq)
                .arg("EX")
                .arg(self.ttl_secs)
                .ignore();
        }
    }

    /// Commits one event and admits the next in one round trip (one MULTI).
    /// Redis runs them in order, so a next event that repeats this one finds it
    /// `done`.
    pub(crate) async fn commit_and_admit(
        &self,
        redis: &mut RedisSlot,
        done: &Done<'_>,
        next: &Admission<'_>,
    ) -> Verdict {
        let mut pipe = redis::pipe();
        pipe.atomic();
        self.add_commit(&mut pipe, done);
        if next.redelivered {
            pipe.add_command(self.admit_cmd(next));
            let (answer,): ((String, i64),) = redis.query_pipeline(&pipe).await;
            return self.after_script(redis, next, verdict(answer)).await;
        }
        self.add_fast_admit(&mut pipe, next);
        let answers = self.query_fast_admit(redis, &pipe).await;
        self.finish_admit(redis, next, answers).await
    }

    /// Marks the event processed and moves its order's gate, atomically.
    pub(crate) async fn commit(&self, redis: &mut RedisSlot, done: &Done<'_>) {
        let mut pipe = redis::pipe();
        pipe.atomic();
        self.add_commit(&mut pipe, done);
        redis.query_pipeline::<()>(&pipe).await;
    }

    /// Extends the claim's lease, counting a handler start that begins or
    /// ended: the count is of calls that began and never returned, so a
    /// worker that dies while an event waits (for its retry, the breaker or a
    /// rate token) leaves no start behind for crash-loop protection.
    pub(crate) async fn renew(&self, redis: &mut RedisSlot, dedup_key: &str, start: Start) {
        let delta = match start {
            Start::Begins => "1",
            Start::Ended => "-1",
            Start::Waits => "0",
        };
        let cmd = Self::evalsha(
            &self.renew,
            &[self.keys.dedup(dedup_key)],
            &[
                self.lease_ms.to_string(),
                EVIDENCE.as_millis().to_string(),
                delta.to_owned(),
            ],
        );
        redis.query::<i64>(&cmd).await;
    }

    /// Gives the claim up, so that a replay is not suppressed.
    pub(crate) async fn release(&self, redis: &mut RedisSlot, dedup_key: &str) {
        redis.query::<i64>(&self.release_cmd(dedup_key)).await;
    }

    fn release_cmd(&self, dedup_key: &str) -> Cmd {
        Self::evalsha(&self.release, &[self.keys.dedup(dedup_key)], &[])
    }

    /// Adds to `pipe` what follows a confirmed dead letter: the claim given
    /// up and `seq` (if any) counted as passed for its order.
    pub(crate) fn add_dead_lettered(
        &self,
        pipe: &mut Pipeline,
        dedup_key: &str,
        order_key: &str,
        seq: Option<u64>,
    ) {
        pipe.add_command(self.release_cmd(dedup_key)).ignore();
        if let Some(seq) = seq {
            pipe.add_command(Self::evalsha(
                &self.pass,
                &[self.keys.gate(order_key)],
                &[self.ttl_secs.to_string(), seq.to_string()],
            ))
            .ignore();
        }
    }
}

fn verdict((kind, n): (String, i64)) -> Verdict {
    match kind.as_str() {
        "claimed" => Verdict::Claimed,
        "takeover" => Verdict::TakenOver,
        "duplicate" => Verdict::Duplicate,
        "late" => Verdict::Late,
        "gap" => Verdict::Gap,
        "start" => Verdict::Start,
        "wait" => Verdict::Wait(Duration::from_millis(u64::try_from(n).unwrap_or(0).max(1))),
        "crashloop" => Verdict::CrashLoop(u32::try_from(n).unwrap_or(u32::MAX)),
        // The script returns nothing else; treat surprises as a claim to re-check.
        _ => Verdict::Wait(Duration::from_millis(100)),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use redis::Arg;

    use super::*;

    /// The keys `add_commit` writes with `SET`.
    fn set_keys(config: &Config, done: &Done<'_>) -> Vec<String> {
        let mut pipe = redis::pipe();
        Dedup::new(config).add_commit(&mut pipe, done);
        pipe.cmd_iter()
            .filter_map(|cmd| {
                let args: Vec<Vec<u8>> = cmd
                    .args_iter()
                    .filter_map(|a| match a {
                        Arg::Simple(bytes) => Some(bytes.to_vec()),
                        _ => None,
                    })
                    .collect();
                match args.as_slice() {
                    [name, key, ..] if name == b"SET" => {
                        Some(String::from_utf8_lossy(key).into_owned())
                    }
                    _ => None,
                }
            })
            .collect()
    }

    #[test]
    fn a_commit_records_the_kind_unless_the_kinds_ttl_is_zero() {
        let done = Done {
            dedup_key: "A1:payment.captured:3",
            order_key: "A1",
            event: "payment.captured",
            seq: Some(3),
            replay_of: None,
            bypassed: false,
        };
        let config = Config::default();
        assert_eq!(
            set_keys(&config, &done),
            [
                "shardline:kind:A1:payment.captured",
                "shardline:dedup:A1:payment.captured:3",
                "shardline:gate:A1",
            ]
        );
        let off = Config {
            kinds_ttl: Some(Duration::ZERO),
            ..Config::default()
        };
        assert_eq!(
            set_keys(&off, &done),
            ["shardline:dedup:A1:payment.captured:3", "shardline:gate:A1"]
        );
    }
}
