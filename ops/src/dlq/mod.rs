//! The dead-letter queue: list, show, replay, purge and release, each on one
//! connection and one reading channel (`reader`).
//!
//! - `letter`: one dead letter and what identifies it.
//! - `reader`: reading without removing; what is not removed returns in order.
//! - [`list`], [`show`]: what is in the DLQ, with a summary by reason and error.
//! - [`replay`]: republish to the order's shard, per order in seq order, each
//!   confirmed before it leaves the DLQ; quarantined orders followed in rounds.
//! - [`purge`]: delete letters; [`release`]: lift an order's quarantine.

mod letter;
mod reader;
mod replay;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use serde::Serialize;

pub use letter::{Letter, LetterRef};
use reader::Reader;
pub(crate) use reader::browse;
pub use replay::{ReplayConfig, ReplayReport, replay};

use crate::fleet::close;
use crate::{Error, Fleet};

/// Longest error text in the `list` table (JSON carries it whole).
const ERROR_CHARS: usize = 60;

/// Which dead letters an operation acts on (all of them by default).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filters {
    /// Only letters with this `x-fail-reason` (`unknown` for letters without one).
    pub reason: Option<String>,
    /// Only letters whose envelope's `order_id` is this.
    pub order_id: Option<String>,
    /// Only letters dead-lettered from this shard (`x-shard`).
    pub shard: Option<u16>,
    /// At most this many matching letters (reading stops there).
    pub limit: Option<usize>,
}

impl Filters {
    pub fn matches(&self, letter: &LetterRef) -> bool {
        self.reason.as_ref().is_none_or(|r| *r == letter.reason)
            && self
                .order_id
                .as_ref()
                .is_none_or(|o| letter.order_id.as_ref() == Some(o))
            && self
                .shard
                .is_none_or(|s| letter.shard == Some(i64::from(s)))
    }

    fn select(&self) -> impl Fn(&Letter) -> bool + '_ {
        |l| self.matches(&l.info)
    }
}

/// Opens the connection and the reading channel, runs `op`, then returns
/// every letter not removed to the queue. `op`'s errors name the DLQ.
async fn with_reader<T>(
    fleet: &Fleet,
    op: impl AsyncFnOnce(&Reader) -> Result<T, Error>,
) -> Result<T, Error> {
    let queue = fleet.names.dead_letter_queue.clone();
    let url = fleet.amqp.to_string();
    let conn = fleet.connect("shardline dlq").await?;
    let reader = Reader::open(&conn, &fleet.names)
        .await
        .map_err(Error::amqp(format!("opening {queue} on {url}")))?;
    let result = op(&reader).await.map_err(|source| Error::Dlq {
        queue,
        url,
        source: Box::new(source),
    });
    reader.release().await;
    close(&conn).await;
    result
}

/// The matching dead letters, read and returned to the queue in order.
#[derive(Debug)]
pub struct ListReport {
    pub letters: Vec<Letter>,
    /// Letters read to find them.
    pub read: usize,
    /// When they were read (their ages are from then).
    pub at: SystemTime,
}

/// Every dead letter matching `filters`; the DLQ is left as it was.
pub async fn list(fleet: &Fleet, filters: &Filters) -> Result<ListReport, Error> {
    with_reader(fleet, async |reader| {
        let selection = reader.select(filters.select(), filters.limit).await?;
        Ok(ListReport {
            letters: selection.matched,
            read: selection.read,
            at: SystemTime::now(),
        })
    })
    .await
}

/// The dead letter whose `x-dead-letter-id` is `id`.
pub async fn show(fleet: &Fleet, id: &str) -> Result<Letter, Error> {
    with_reader(fleet, async |reader| {
        while let Some(letter) = reader.next().await? {
            if letter.info.id.as_deref() == Some(id) {
                return Ok(letter);
            }
        }
        Err(Error::NotFound { id: id.to_owned() })
    })
    .await
}

/// What a purge removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PurgeReport {
    pub removed: Vec<LetterRef>,
    /// Letters read; the others are left in the DLQ.
    pub read: usize,
}

/// Deletes the dead letters matching `filters`.
pub async fn purge(fleet: &Fleet, filters: &Filters) -> Result<PurgeReport, Error> {
    with_reader(fleet, async |reader| {
        let selection = reader.select(filters.select(), filters.limit).await?;
        let mut removed = Vec::with_capacity(selection.matched.len());
        for letter in &selection.matched {
            Reader::remove(letter).await?;
            removed.push(letter.info.clone());
        }
        Ok(PurgeReport {
            removed,
            read: selection.read,
        })
    })
    .await
}

/// KEYS: the quarantine, the order's state, its shard's epoch counter. Lifts
/// the quarantine and raises the order's fence to the shard's current epoch.
const LIFT: &str = r"
redis.call('DEL', KEYS[1])
local epoch = redis.call('GET', KEYS[3])
if epoch and redis.call('EXISTS', KEYS[2]) == 1 then
  local f = redis.call('HGET', KEYS[2], 'f')
  if not f or tonumber(f) < tonumber(epoch) then redis.call('HSET', KEYS[2], 'f', epoch) end
end
return 1
";

/// What lifting a quarantine found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReleaseReport {
    pub order_id: String,
    /// The dead letters that held the order, blocker first; empty when it
    /// was not quarantined.
    pub held_by: Vec<String>,
    /// The order's dead letters, which stay in the DLQ.
    pub letters_in_dlq: usize,
}

/// Lifts the quarantine of `order_id` (`--on-dead-letter quarantine`
/// workers): its later events flow again; its dead letters stay.
pub async fn release(fleet: &Fleet, order_id: &str) -> Result<ReleaseReport, Error> {
    with_reader(fleet, async |reader| {
        let order_key = shardline_topology::envelope::order_key_of(order_id);
        let key = fleet.keys.quarantine(&order_key);
        let mut redis = fleet.redis.connect().await?;
        let held: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(&key)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut redis)
            .await
            .map_err(redis_error(fleet, "reading a quarantine"))?;
        // A consumer of the shard older than its current one (a stale owner)
        // must not put the order back in quarantine: its writes are fenced.
        redis::Script::new(LIFT)
            .key(&key)
            .key(fleet.keys.order(&order_key))
            .key(fleet.keys.fence(fleet.shards.shard_of(order_id).get()))
            .invoke_async::<i64>(&mut redis)
            .await
            .map_err(redis_error(fleet, "lifting a quarantine"))?;
        let filters = Filters {
            order_id: Some(order_id.to_owned()),
            ..Filters::default()
        };
        let selection = reader.select(filters.select(), None).await?;
        Ok(ReleaseReport {
            order_id: order_id.to_owned(),
            held_by: held.into_iter().map(|(id, _)| id).collect(),
            letters_in_dlq: selection.matched.len(),
        })
    })
    .await
}

/// A Redis command's error, its password blanked out.
pub(crate) fn redis_error<'a>(
    fleet: &'a Fleet,
    what: &'static str,
) -> impl FnOnce(redis::RedisError) -> Error + 'a {
    move |e| Error::RedisCommand {
        what,
        url: fleet.redis.to_string(),
        cause: fleet.redis.scrub(&e.to_string()),
    }
}

/// Counts and oldest age per reason and per (reason, error).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    pub by_reason: BTreeMap<String, Group>,
    pub by_error: BTreeMap<(String, String), Group>,
}

/// Letters of one reason (or reason and error).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Group {
    pub count: u64,
    pub oldest: Option<Duration>,
}

impl Group {
    fn add(&mut self, age: Option<Duration>) {
        self.count += 1;
        self.oldest = self.oldest.max(age);
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.count,
            "oldest_age_seconds": self.oldest.map(|a| a.as_secs_f64().round()),
        })
    }
}

impl ListReport {
    pub fn summary(&self) -> Summary {
        let mut summary = Summary::default();
        for l in &self.letters {
            let age = l.age(self.at);
            let reason = l.info.reason.clone();
            let error = l.error.clone().unwrap_or_else(|| "-".into());
            summary
                .by_reason
                .entry(reason.clone())
                .or_default()
                .add(age);
            summary
                .by_error
                .entry((reason, error))
                .or_default()
                .add(age);
        }
        summary
    }

    /// As `dlq list --json` prints it.
    pub fn json(&self) -> serde_json::Value {
        let summary = self.summary();
        let group = |g: &Group, fields: &[(&str, &str)]| {
            let mut v = g.json();
            for (name, value) in fields {
                v[*name] = (*value).into();
            }
            v
        };
        serde_json::json!({
            "read": self.read,
            "matched": self.letters.len(),
            "dead_letters": self.letters.iter().map(|l| l.json(self.at)).collect::<Vec<_>>(),
            "summary": {
                "by_reason": summary.by_reason.iter()
                    .map(|(r, g)| group(g, &[("reason", r)])).collect::<Vec<_>>(),
                "by_error": summary.by_error.iter()
                    .map(|((r, e), g)| group(g, &[("reason", r), ("error", e)])).collect::<Vec<_>>(),
            },
        })
    }

    /// As `dlq list` prints it: the letters, then counts by reason and by error.
    pub fn table(&self) -> String {
        let letters = &self.letters;
        let mut out = format!(
            "{} dead letter(s) matched of {} read\n",
            letters.len(),
            self.read
        );
        if letters.is_empty() {
            return out;
        }
        let id_w = letters
            .iter()
            .map(|l| l.info.id().len())
            .max()
            .unwrap_or(2)
            .max(2);
        let order_w = letters
            .iter()
            .map(|l| l.info.order_id.as_deref().map_or(1, str::len))
            .max()
            .unwrap_or(5)
            .max(5);
        let _ = writeln!(
            out,
            "{:<id_w$}  {:<11}  {:>8}  {:<order_w$}  {:>5}  {:>5}  {:<24}  {:>10}  error",
            "id", "reason", "attempts", "order", "seq", "shard", "first failed", "age"
        );
        for l in letters {
            let i = &l.info;
            let _ = writeln!(
                out,
                "{:<id_w$}  {:<11}  {:>8}  {:<order_w$}  {:>5}  {:>5}  {:<24}  {:>10}  {}",
                i.id(),
                i.reason,
                letter::opt(l.attempts),
                i.order_id.as_deref().unwrap_or("-"),
                letter::opt(i.seq),
                letter::opt(i.shard),
                l.first_failed_at.as_deref().unwrap_or("-"),
                age_text(l.age(self.at)),
                cut(l.error.as_deref().unwrap_or("-"), ERROR_CHARS),
            );
        }
        let summary = self.summary();
        out.push_str("by reason:\n");
        for (reason, g) in &summary.by_reason {
            let _ = writeln!(
                out,
                "  {reason:<11}  {:>6}  oldest {}",
                g.count,
                age_text(g.oldest)
            );
        }
        out.push_str("by error:\n");
        for ((reason, error), g) in &summary.by_error {
            let _ = writeln!(
                out,
                "  {reason:<11}  {:>6}  oldest {:>10}  {}",
                g.count,
                age_text(g.oldest),
                cut(error, ERROR_CHARS)
            );
        }
        out
    }
}

fn age_text(age: Option<Duration>) -> String {
    age.map_or_else(
        || "-".into(),
        |a| humantime::format_duration(Duration::from_secs(a.as_secs())).to_string(),
    )
}

/// `s` cut to `max` characters, with `…` when cut.
fn cut(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    pub(crate) fn letter(
        id: &str,
        reason: &str,
        order: Option<&str>,
        seq: Option<u64>,
    ) -> LetterRef {
        LetterRef {
            id: Some(id.into()),
            reason: reason.into(),
            order_id: order.map(Into::into),
            seq,
            shard: Some(3),
        }
    }

    /// `dlq release` lifts the quarantine and raises the order's fence to
    /// the shard's current epoch, so a stale owner's dead letter (epoch below
    /// it: fenced, `worker/src/dedup`) cannot quarantine the order again.
    #[tokio::test]
    async fn lifting_a_quarantine_raises_the_orders_fence_to_the_shards_epoch() {
        let url = std::env::var("SHARDLINE_TEST_REDIS")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let client = redis::Client::open(url).unwrap();
        let mut redis = client.get_multiplexed_async_connection().await.unwrap();
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let keys =
            shardline_topology::Keys::new(&format!("test:lift:{}:{nanos}:", std::process::id()));
        let (quarantine, order, fence) = (keys.quarantine("A"), keys.order("A"), keys.fence(3));
        let lift = async |redis: &mut redis::aio::MultiplexedConnection| {
            redis::Script::new(LIFT)
                .key(&quarantine)
                .key(&order)
                .key(&fence)
                .invoke_async::<i64>(redis)
                .await
                .unwrap();
        };
        let _: () = redis::pipe()
            .cmd("ZADD")
            .arg(&quarantine)
            .arg(2)
            .arg("dl-1")
            .cmd("HSET")
            .arg(&order)
            .arg("l")
            .arg(1)
            .arg("f")
            .arg(1)
            .cmd("SET")
            .arg(&fence)
            .arg(3)
            .query_async(&mut redis)
            .await
            .unwrap();
        lift(&mut redis).await;
        let (held, f): (i64, Option<String>) = redis::pipe()
            .cmd("EXISTS")
            .arg(&quarantine)
            .cmd("HGET")
            .arg(&order)
            .arg("f")
            .query_async(&mut redis)
            .await
            .unwrap();
        assert_eq!((held, f.as_deref()), (0, Some("3")));
        // An order without state gets none.
        let _: () = redis::cmd("DEL")
            .arg(&order)
            .query_async(&mut redis)
            .await
            .unwrap();
        lift(&mut redis).await;
        let exists: i64 = redis::cmd("EXISTS")
            .arg(&order)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert_eq!(exists, 0);
        let _: () = redis::cmd("DEL")
            .arg(&quarantine)
            .arg(&order)
            .arg(&fence)
            .query_async(&mut redis)
            .await
            .unwrap();
    }

    #[test]
    fn filters_match_reason_order_and_shard() {
        let l = letter("d1", "handler", Some("A1"), Some(2));
        assert!(Filters::default().matches(&l));
        let by = |reason: Option<&str>, order: Option<&str>, shard: Option<u16>| Filters {
            reason: reason.map(Into::into),
            order_id: order.map(Into::into),
            shard,
            limit: None,
        };
        assert!(by(Some("handler"), Some("A1"), Some(3)).matches(&l));
        assert!(!by(Some("decode"), None, None).matches(&l));
        assert!(!by(None, Some("A2"), None).matches(&l));
        assert!(!by(None, None, Some(4)).matches(&l));
        let bodyless = LetterRef {
            order_id: None,
            shard: None,
            ..letter("d2", "unknown", None, None)
        };
        assert!(by(Some("unknown"), None, None).matches(&bodyless));
        assert!(!by(None, Some(""), None).matches(&bodyless));
        assert!(!by(None, None, Some(3)).matches(&bodyless));
    }

    #[test]
    fn letters_describe_themselves_with_dashes_for_the_unknown() {
        assert_eq!(
            letter("d1", "handler", Some("A1"), Some(2)).to_string(),
            "d1 reason=handler order=A1 seq=2 shard=3"
        );
        let none = LetterRef {
            id: None,
            shard: None,
            ..letter("", "decode", None, None)
        };
        assert_eq!(none.to_string(), "- reason=decode order=- seq=- shard=-");
    }

    #[test]
    fn long_errors_are_cut_on_a_character() {
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(cut("ääää", 2), "ää…");
        assert_eq!(age_text(Some(Duration::from_millis(61_500))), "1m 1s");
        assert_eq!(age_text(None), "-");
    }
}
