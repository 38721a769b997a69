//! The dead-letter queue: list, show, replay, purge and release, each on one
//! connection and one reading channel (`reader`).
//!
//! - `letter`: one dead letter as read (what identifies it, [`LetterRef`], is
//!   in `crate::letter`, below `progress`).
//! - `reader`: reading without removing; what is not removed returns in order.
//! - `index`: the dead-letter index in Redis, which [`list`] and reconcile read.
//! - [`list`], [`show`]: what is in the DLQ (from the index), with a summary
//!   by reason and failure group; `show` reads the letter itself
//!   ([`show_within`]: among the first letters only).
//! - [`groups`], [`letters`]: the index as the console browses it: failure
//!   groups with their times and orders, entries by group and time.
//! - [`replay`]: republish to the order's shard, per order in seq order, each
//!   confirmed before it leaves the DLQ; quarantined orders followed in rounds.
//! - [`purge`]: delete letters; [`release`]: lift an order's quarantine.
//! - [`reindex`]: rebuild the index from the DLQ.

mod index;
mod letter;
mod lock;
mod plan;
mod reader;
mod reindex;
mod replay;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use shardline_contract::OrderId;
use shardline_contract::letters::IndexEntry;
use shardline_contract::text::shown;

pub(crate) use index::Index;
pub use index::{GroupCount, GroupSummary, LetterQuery};
pub use letter::Letter;
pub(crate) use lock::locked;
pub use plan::Window;
use reader::Reader;
pub(crate) use reader::browse;
pub use reindex::{ReindexReport, reindex};
pub use replay::{ReplayConfig, ReplayReport, replay};

pub use crate::letter::LetterRef;
pub use crate::progress::Blocked;

use crate::fleet::{close, redis_error};
use crate::letter::opt;
use crate::{Error, Fleet};

/// Longest error text in the `list` table (JSON carries it whole).
const ERROR_CHARS: usize = 60;

/// Which dead letters an operation acts on (all of them by default). Each
/// filter is matched against the letter's index entry, so a selection means
/// the same in the index and in the DLQ.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filters {
    /// Only letters with this reason: `x-fail-reason`, the broker's own
    /// (`delivery-limit`) for letters it dead-lettered itself, `unknown`
    /// for letters without either.
    pub reason: Option<String>,
    /// Only letters whose envelope's `order_id` is this.
    pub order_id: Option<OrderId>,
    /// Only letters dead-lettered from this shard (`x-shard`).
    pub shard: Option<u16>,
    /// Only letters of this failure group (its id).
    pub group: Option<String>,
    /// Only these letters (their index ids: `x-dead-letter-id`, or the id
    /// derived for a letter the broker dead-lettered itself).
    pub ids: Option<BTreeSet<String>>,
    /// At most this many matching letters (reading stops there).
    pub limit: Option<usize>,
}

impl Filters {
    /// The filters on an index entry.
    pub fn matches_entry(&self, entry: &IndexEntry) -> bool {
        self.reason.as_ref().is_none_or(|r| *r == entry.reason)
            && self
                .order_id
                .as_ref()
                .is_none_or(|o| entry.order_id.as_deref() == Some(o.as_str()))
            && self.shard.is_none_or(|s| entry.shard == Some(s))
            && self.group.as_ref().is_none_or(|g| *g == entry.group)
            && self.ids.as_ref().is_none_or(|ids| ids.contains(&entry.id))
    }

    /// The filters on a letter read from the DLQ: on its index entry.
    pub fn matches(&self, letter: &Letter) -> bool {
        self.matches_entry(&letter.entry())
    }

    fn select(&self) -> impl Fn(&Letter) -> bool + '_ {
        |l| self.matches(l)
    }
}

/// Opens a connection to the DLQ's broker, runs `op`, and closes it (every
/// letter read on it and not removed returns to the queue). `op`'s errors
/// name the DLQ.
async fn with_dlq<T>(
    fleet: &Fleet,
    op: impl AsyncFnOnce(&lapin::Connection) -> Result<T, Error>,
) -> Result<T, Error> {
    let queue = fleet.names.dead_letter_queue.clone();
    let url = fleet.amqp.to_string();
    let conn = fleet.connect("shardline dlq").await?;
    let result = op(&conn).await.map_err(|source| Error::Dlq {
        queue,
        url,
        source: Box::new(source),
    });
    close(&conn).await;
    result
}

/// Opens the connection and the reading channel, runs `op`, then returns
/// every letter not removed to the queue. `op`'s errors name the DLQ.
async fn with_reader<T>(
    fleet: &Fleet,
    op: impl AsyncFnOnce(&Reader) -> Result<T, Error>,
) -> Result<T, Error> {
    with_dlq(fleet, async |conn| {
        let queue = &fleet.names.dead_letter_queue;
        let reader = Reader::open(conn, &fleet.names)
            .await
            .map_err(Error::amqp(format!("opening {queue}")))?;
        let result = op(&reader).await;
        reader.release().await;
        result
    })
    .await
}

/// The matching dead letters, as the index has them.
#[derive(Debug)]
pub struct ListReport {
    pub letters: Vec<IndexEntry>,
    /// Letters in the index.
    pub indexed: u64,
    /// Letters in the DLQ (a passive declare); more than `indexed` means
    /// letters the index does not know: run `dlq reindex`.
    pub depth: u64,
    /// When they were read (their ages are from then).
    pub at: SystemTime,
}

/// Every dead letter matching `filters`, from the index; the DLQ is not read.
pub async fn list(fleet: &Fleet, filters: &Filters) -> Result<ListReport, Error> {
    let mut index = Index::open(fleet).await?;
    let letters = index.entries(filters).await?;
    let indexed = index.count().await?;
    let depth = dlq_depth(fleet).await?;
    Ok(ListReport {
        letters,
        indexed,
        depth,
        at: SystemTime::now(),
    })
}

/// The failure groups of the index, with their first and last failure and
/// the orders they hold, largest first; the DLQ is not read.
pub async fn groups(fleet: &Fleet) -> Result<Vec<GroupSummary>, Error> {
    Index::open(fleet).await?.summaries().await
}

/// The index entries matching `query`, oldest first; the DLQ is not read.
pub async fn letters(fleet: &Fleet, query: &LetterQuery) -> Result<Vec<IndexEntry>, Error> {
    Index::open(fleet).await?.query(query).await
}

/// The DLQ's depth, by a passive declare on a connection of its own.
pub(crate) async fn dlq_depth(fleet: &Fleet) -> Result<u64, Error> {
    let queue = &fleet.names.dead_letter_queue;
    let conn = fleet.connect("shardline dlq").await?;
    let status = shardline_connect::declare::queue_status(&conn, queue)
        .await
        .map_err(Error::queue(format!("reading {queue} on {}", fleet.amqp)));
    close(&conn).await;
    Ok(u64::from(status?.messages))
}

/// The dead letter whose index id is `id`: its `x-dead-letter-id`, or the
/// id derived for a letter the broker dead-lettered itself. Reads the DLQ
/// up to the letter, however far back it is.
pub async fn show(fleet: &Fleet, id: &str) -> Result<Letter, Error> {
    show_within(fleet, id, usize::MAX).await
}

/// [`show`] among the first `within` letters of the DLQ only: past them,
/// [`Error::NotWithin`] (not [`Error::NotFound`]: the letter may be further
/// back). A bound on what one request holds unacked and how long it reads.
pub async fn show_within(fleet: &Fleet, id: &str, within: usize) -> Result<Letter, Error> {
    with_reader(fleet, async |reader| {
        let mut read = 0usize;
        while read < within {
            let Some(letter) = reader.next().await? else {
                return Err(Error::NotFound { id: id.to_owned() });
            };
            if letter.index_id() == id {
                return Ok(letter);
            }
            read += 1;
        }
        // At the bound: only a letter behind it makes this "not within".
        match reader.next().await? {
            Some(_) => Err(Error::NotWithin {
                id: id.to_owned(),
                within,
            }),
            None => Err(Error::NotFound { id: id.to_owned() }),
        }
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
        let mut index = Index::open(fleet).await?;
        for letter in &selection.matched {
            Reader::remove(letter).await?;
            index.remove(&[letter.index_id()]).await?;
            removed.push(letter.info.clone());
        }
        Ok(PurgeReport {
            removed,
            read: selection.read,
        })
    })
    .await
}

/// KEYS: the quarantine, the order's state, the epoch of its shard's newest
/// consumer (`Keys::fence`). Lifts the quarantine and raises the order's
/// fence to that epoch: the current consumer's, so only older ones are fenced.
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
    pub order_id: OrderId,
    /// The dead letters that held the order, blocker first; empty when it
    /// was not quarantined.
    pub held_by: Vec<String>,
    /// The order's dead letters, which stay in the DLQ.
    pub letters_in_dlq: usize,
}

/// Lifts the quarantine of `order_id` (`--on-dead-letter quarantine`
/// workers): its later events flow again; its dead letters stay.
pub async fn release(fleet: &Fleet, order_id: &OrderId) -> Result<ReleaseReport, Error> {
    with_reader(fleet, async |reader| {
        let order_key = order_id.key();
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
        // The shard is the one writing the order now (after a reshard, or
        // during its move, by the recorded topology).
        let shard = crate::fleet::OrderShards::read(fleet)
            .await?
            .of(order_id.as_str());
        redis::Script::new(LIFT)
            .key(&key)
            .key(fleet.keys.order(&order_key))
            .key(fleet.keys.fence(shard.get()))
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

/// Counts and oldest age per reason and per failure group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    pub by_reason: BTreeMap<String, Group>,
    /// By (reason, normalised error): the failure groups.
    pub by_error: BTreeMap<(String, String), Group>,
}

/// Letters of one reason (or failure group).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Group {
    pub count: u64,
    pub oldest: Option<Duration>,
    /// The failure group's id (by error only).
    pub id: Option<String>,
}

impl Group {
    fn add(&mut self, age: Option<Duration>) {
        self.count += 1;
        self.oldest = self.oldest.max(age);
    }

    fn json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "count": self.count,
            "oldest_age_seconds": self.oldest.map(|a| a.as_secs_f64().round()),
        });
        if let Some(id) = &self.id {
            v["group"] = id.as_str().into();
        }
        v
    }
}

/// The entry's first-failed time, RFC 3339 (none when unknown).
fn failed_at(e: &IndexEntry) -> Option<String> {
    (e.first_failed_ms > 0).then(|| {
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(e.first_failed_ms);
        humantime::format_rfc3339_millis(at).to_string()
    })
}

fn age(e: &IndexEntry, now: SystemTime) -> Option<Duration> {
    (e.first_failed_ms > 0).then(|| {
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(e.first_failed_ms);
        now.duration_since(at).unwrap_or_default()
    })
}

impl ListReport {
    /// The DLQ holds letters the index does not know.
    pub fn reindex_needed(&self) -> bool {
        self.depth > self.indexed
    }

    pub fn summary(&self) -> Summary {
        let mut summary = Summary::default();
        for l in &self.letters {
            let age = age(l, self.at);
            let group = l.group();
            summary
                .by_reason
                .entry(l.reason.clone())
                .or_default()
                .add(age);
            let g = summary
                .by_error
                .entry((group.reason, group.error))
                .or_default();
            g.add(age);
            g.id = Some(group.id);
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
        let letter = |l: &IndexEntry| {
            serde_json::json!({
                "id": l.id,
                "reason": l.reason,
                "error": l.error,
                "group": l.group,
                "attempts": l.attempts,
                "order_id": l.order_id,
                "event": l.kind,
                "seq": l.seq,
                "shard": l.shard,
                "first_failed_at": failed_at(l),
                "age_seconds": age(l, self.at).map(|a| a.as_secs_f64().round()),
                "trace_id": l.trace_id,
            })
        };
        let groups: Vec<_> = summary
            .by_error
            .iter()
            .map(|((r, e), g)| group(g, &[("reason", r), ("error", e)]))
            .collect();
        serde_json::json!({
            "read": self.indexed,
            "indexed": self.indexed,
            "dlq_depth": self.depth,
            "reindex_needed": self.reindex_needed(),
            "matched": self.letters.len(),
            "dead_letters": self.letters.iter().map(letter).collect::<Vec<_>>(),
            "summary": {
                "by_reason": summary.by_reason.iter()
                    .map(|(r, g)| group(g, &[("reason", r)])).collect::<Vec<_>>(),
                "groups": groups,
                // The name before `groups`; read for one more release.
                "by_error": groups,
            },
        })
    }

    /// As `dlq list` prints it: the letters, then counts by reason and by
    /// failure group.
    pub fn table(&self) -> String {
        let letters = &self.letters;
        let mut out = format!(
            "{} dead letter(s) matched of {} indexed\n",
            letters.len(),
            self.indexed
        );
        if self.reindex_needed() {
            let _ = writeln!(
                out,
                "reindex needed: the DLQ holds {} letter(s), the index {} (`shardline dlq reindex`)",
                self.depth, self.indexed
            );
        }
        if letters.is_empty() {
            return out;
        }
        let id_w = letters
            .iter()
            .map(|l| shown(&l.id).len())
            .max()
            .unwrap_or(2)
            .max(2);
        let order_w = letters
            .iter()
            .map(|l| l.order_id.as_deref().map_or(1, |o| shown(o).len()))
            .max()
            .unwrap_or(5)
            .max(5);
        let _ = writeln!(
            out,
            "{:<id_w$}  {:<11}  {:>8}  {:<order_w$}  {:>5}  {:>5}  {:<24}  {:>10}  error",
            "id", "reason", "attempts", "order", "seq", "shard", "first failed", "age"
        );
        for l in letters {
            let _ = writeln!(
                out,
                "{:<id_w$}  {:<11}  {:>8}  {:<order_w$}  {:>5}  {:>5}  {:<24}  {:>10}  {}",
                shown(&l.id),
                shown(&l.reason),
                opt(l.attempts),
                shown(l.order_id.as_deref().unwrap_or("-")),
                opt(l.seq),
                opt(l.shard),
                failed_at(l).as_deref().unwrap_or("-"),
                age_text(age(l, self.at)),
                cut(
                    &shown(if l.error.is_empty() { "-" } else { &l.error }),
                    ERROR_CHARS
                ),
            );
        }
        let summary = self.summary();
        out.push_str("by reason:\n");
        for (reason, g) in &summary.by_reason {
            let _ = writeln!(
                out,
                "  {:<11}  {:>6}  oldest {}",
                shown(reason),
                g.count,
                age_text(g.oldest)
            );
        }
        out.push_str("failure groups:\n");
        for ((reason, error), g) in &summary.by_error {
            let _ = writeln!(
                out,
                "  {:<11}  {:>6}  oldest {:>10}  {}  {}",
                shown(reason),
                g.count,
                age_text(g.oldest),
                g.id.as_deref().unwrap_or("-"),
                cut(
                    &shown(if error.is_empty() { "-" } else { error }),
                    ERROR_CHARS
                )
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

    /// What a letter can hold that a terminal would obey: escape sequences
    /// (title, clear screen), a carriage return, a bidi override.
    const HOSTILE: &str = "x\u{1b}]0;pwned\u{7}\u{1b}[2J\r\nforged\u{202e}";

    #[test]
    fn the_table_shows_escapes_and_keeps_one_line_per_letter() {
        let entry = IndexEntry {
            id: format!("dl-{HOSTILE}"),
            reason: format!("handler{HOSTILE}"),
            error: format!("downstream said {HOSTILE}"),
            order_id: Some(format!("A{HOSTILE}")),
            ..IndexEntry::default()
        }
        .grouped();
        let report = ListReport {
            letters: vec![entry],
            indexed: 1,
            depth: 1,
            at: SystemTime::now(),
        };
        let table = report.table();
        assert!(
            !table.contains(['\u{1b}', '\u{7}', '\r', '\u{202e}']),
            "{table}"
        );
        assert!(table.contains("\\u{1b}]0;pwned"), "{table}");
        let rows = table.lines().filter(|l| l.starts_with("dl-")).count();
        assert_eq!(rows, 1, "{table}");
        assert!(!table.lines().any(|l| l.starts_with("forged")), "{table}");
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
            shardline_contract::Keys::new(&format!("test:lift:{}:{nanos}:", std::process::id()));
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
    fn filters_match_reason_order_shard_group_and_ids() {
        let entry = |id: &str, reason: &str, order: Option<&str>, shard: Option<u16>| {
            IndexEntry {
                id: id.into(),
                reason: reason.into(),
                error: "HTTP 500 from downstream".into(),
                order_id: order.map(Into::into),
                shard,
                ..IndexEntry::default()
            }
            .grouped()
        };
        let l = entry("d1", "handler", Some("A1"), Some(3));
        assert!(Filters::default().matches_entry(&l));
        let by = |reason: Option<&str>, order: Option<&str>, shard: Option<u16>| Filters {
            reason: reason.map(Into::into),
            order_id: order.map(|o| OrderId::new(o).unwrap()),
            shard,
            ..Filters::default()
        };
        assert!(by(Some("handler"), Some("A1"), Some(3)).matches_entry(&l));
        assert!(!by(Some("decode"), None, None).matches_entry(&l));
        assert!(!by(None, Some("A2"), None).matches_entry(&l));
        assert!(!by(None, None, Some(4)).matches_entry(&l));
        let bodyless = entry("d2", "unknown", None, None);
        assert!(by(Some("unknown"), None, None).matches_entry(&bodyless));
        // No order filter matches a letter without an order (an empty one
        // cannot be asked for: `OrderId` refuses it).
        assert!(!by(None, Some("A1"), None).matches_entry(&bodyless));
        assert!(!by(None, None, Some(3)).matches_entry(&bodyless));
        let group = Filters {
            group: Some(l.group.clone()),
            ..Filters::default()
        };
        assert!(group.matches_entry(&l));
        assert!(
            !group.matches_entry(&bodyless),
            "another reason, another group"
        );
        let ids = Filters {
            ids: Some(BTreeSet::from(["d2".to_owned(), "d9".to_owned()])),
            ..Filters::default()
        };
        assert!(!ids.matches_entry(&l));
        assert!(ids.matches_entry(&bodyless));
    }

    #[test]
    fn long_errors_are_cut_on_a_character() {
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(cut("ääää", 2), "ää…");
        assert_eq!(age_text(Some(Duration::from_millis(61_500))), "1m 1s");
        assert_eq!(age_text(None), "-");
    }
}
