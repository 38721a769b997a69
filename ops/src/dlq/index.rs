//! The dead-letter index in Redis (`topology::letters`, keys in
//! `topology::keys`): what `list`, reconcile and `topology status` read
//! instead of browsing the DLQ; what replay and purge remove letters from;
//! what `reindex` rebuilds.

use std::collections::{BTreeMap, HashMap, HashSet};

use redis::aio::MultiplexedConnection;
use shardline_contract::letters::{Group, INDEX_LUA, IndexEntry};
use shardline_contract::{Keys, OrderId, envelope::order_key_of, replay};

use super::Filters;
use crate::fleet::redis_error;
use crate::{Error, Fleet};

/// Entries read (or removed) per round trip.
const BATCH: usize = 500;

/// Removes one entry. KEYS: [`IndexEntry::script_keys`] of the stored entry;
/// ARGV: its id, its group id. The group's description goes with its last letter.
const REMOVE: &str = r"
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
if redis.call('ZCARD', KEYS[3]) == 0 then redis.call('HDEL', KEYS[4], ARGV[2]) end
return 1
";

/// The index of one fleet, on one connection.
pub(crate) struct Index<'a> {
    fleet: &'a Fleet,
    redis: MultiplexedConnection,
}

/// A failure group and its letters' count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupCount {
    pub group: Group,
    pub count: u64,
}

/// A failure group as an operator browses it: its count, when its letters
/// failed and how many orders they hold up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSummary {
    pub group: Group,
    /// Letters in the group.
    pub count: u64,
    /// Earliest and latest first-failed time of its letters, Unix ms (0
    /// when none of them has one).
    pub first_failed_ms: u64,
    pub last_failed_ms: u64,
    /// Distinct orders among its letters (letters without an order not counted).
    pub orders: u64,
}

/// Which index entries to read: the [`Filters`] (reason, order, shard,
/// failure group, ids, limit), a first-failed time range, a search.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LetterQuery {
    pub filters: Filters,
    /// Only letters first failed at or after this Unix ms.
    pub from_ms: Option<u64>,
    /// Only letters first failed at or before this Unix ms.
    pub to_ms: Option<u64>,
    /// Only the letter with this id, or the letters of the order with this id.
    pub search: Option<String>,
}

impl LetterQuery {
    fn matches(&self, entry: &IndexEntry) -> bool {
        self.filters.matches_entry(entry)
            && self
                .from_ms
                .is_none_or(|from| entry.first_failed_ms >= from)
            && self.to_ms.is_none_or(|to| entry.first_failed_ms <= to)
            && self
                .search
                .as_ref()
                .is_none_or(|q| entry.id == *q || entry.order_id.as_ref() == Some(q))
    }
}

impl<'a> Index<'a> {
    pub(crate) async fn open(fleet: &'a Fleet) -> Result<Self, Error> {
        Ok(Self {
            fleet,
            redis: fleet.redis.connect().await?,
        })
    }

    /// The index on an open connection.
    pub(crate) fn on(fleet: &'a Fleet, redis: MultiplexedConnection) -> Self {
        Self { fleet, redis }
    }

    fn keys(&self) -> &Keys {
        &self.fleet.keys
    }

    /// Writes the replay record `id` (`shardline_contract::replay`) before
    /// its event is republished; it lives [`replay::RECORD_TTL`] unless a
    /// worker spends it first.
    pub(crate) async fn record_replay(&mut self, id: &str, record: &str) -> Result<(), Error> {
        redis::cmd("SET")
            .arg(self.keys().replay_record(id))
            .arg(record)
            .arg("EX")
            .arg(replay::RECORD_TTL.as_secs())
            .query_async::<()>(&mut self.redis)
            .await
            .map_err(redis_error(self.fleet, "writing a replay record"))
    }

    /// How many letters the index holds.
    pub(crate) async fn count(&mut self) -> Result<u64, Error> {
        redis::cmd("ZCARD")
            .arg(self.keys().dlq_letters())
            .query_async(&mut self.redis)
            .await
            .map_err(redis_error(self.fleet, "counting the dead-letter index"))
    }

    /// The entries of `ids`, in their order; ids without an entry left out.
    async fn entries_of(&mut self, ids: &[String]) -> Result<Vec<IndexEntry>, Error> {
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(BATCH) {
            let mut pipe = redis::pipe();
            for id in chunk {
                pipe.cmd("HGETALL").arg(self.keys().dlq_letter(id));
            }
            let hashes: Vec<HashMap<String, String>> = pipe
                .query_async(&mut self.redis)
                .await
                .map_err(redis_error(self.fleet, "reading the dead-letter index"))?;
            out.extend(hashes.iter().filter_map(IndexEntry::from_fields));
        }
        Ok(out)
    }

    /// Every entry matching `filters`, oldest first, at most `filters.limit`.
    pub(crate) async fn entries(&mut self, filters: &Filters) -> Result<Vec<IndexEntry>, Error> {
        let ids = match &filters.order_id {
            Some(order) => self.order_ids(order).await?,
            None => self.all_ids().await?,
        };
        let mut entries = self.entries_of(&ids).await?;
        entries.sort_by(|a, b| (a.first_failed_ms, &a.id).cmp(&(b.first_failed_ms, &b.id)));
        entries.retain(|e| filters.matches_entry(e));
        if let Some(limit) = filters.limit {
            entries.truncate(limit);
        }
        Ok(entries)
    }

    pub(crate) async fn all_ids(&mut self) -> Result<Vec<String>, Error> {
        redis::cmd("ZRANGE")
            .arg(self.keys().dlq_letters())
            .arg(0)
            .arg(-1)
            .query_async(&mut self.redis)
            .await
            .map_err(redis_error(self.fleet, "reading the dead-letter index"))
    }

    async fn order_ids(&mut self, order_id: &OrderId) -> Result<Vec<String>, Error> {
        redis::cmd("SMEMBERS")
            .arg(self.keys().dlq_order(&order_id.key()))
            .query_async(&mut self.redis)
            .await
            .map_err(redis_error(self.fleet, "reading the dead-letter index"))
    }

    /// The entries of the orders `order_ids`, by order id (for reconcile).
    pub(crate) async fn of_orders(
        &mut self,
        order_ids: &[&str],
    ) -> Result<HashMap<String, Vec<IndexEntry>>, Error> {
        let mut ids = Vec::new();
        for chunk in order_ids.chunks(BATCH) {
            let mut pipe = redis::pipe();
            for order in chunk {
                pipe.cmd("SMEMBERS")
                    .arg(self.keys().dlq_order(&order_key_of(order)));
            }
            let sets: Vec<Vec<String>> = pipe
                .query_async(&mut self.redis)
                .await
                .map_err(redis_error(self.fleet, "reading the dead-letter index"))?;
            ids.extend(sets.into_iter().flatten());
        }
        let mut out: HashMap<String, Vec<IndexEntry>> = HashMap::new();
        for entry in self.entries_of(&ids).await? {
            if let Some(order) = entry.order_id.clone() {
                out.entry(order).or_default().push(entry);
            }
        }
        Ok(out)
    }

    /// The failure groups that have letters, largest first.
    pub(crate) async fn groups(&mut self) -> Result<Vec<GroupCount>, Error> {
        let described: BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(self.keys().dlq_groups())
            .query_async(&mut self.redis)
            .await
            .map_err(redis_error(self.fleet, "reading the failure groups"))?;
        if described.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in described.keys() {
            pipe.cmd("ZCARD").arg(self.keys().dlq_group(id));
        }
        let counts: Vec<u64> = pipe
            .query_async(&mut self.redis)
            .await
            .map_err(redis_error(self.fleet, "reading the failure groups"))?;
        let mut groups: Vec<GroupCount> = described
            .iter()
            .zip(counts)
            .map(|((id, description), count)| GroupCount {
                group: Group::from_description(id, description),
                count,
            })
            .collect();
        groups.sort_by(|a, b| b.count.cmp(&a.count).then(a.group.id.cmp(&b.group.id)));
        Ok(groups)
    }

    /// The entries matching `query`, oldest first, at most its limit: the
    /// searched id and order's set, or the order's set, or one sorted-set
    /// range (the group's, or all letters'); then the entries themselves.
    pub(crate) async fn query(&mut self, query: &LetterQuery) -> Result<Vec<IndexEntry>, Error> {
        let ids = match (&query.search, &query.filters.order_id, &query.filters.group) {
            (Some(q), _, _) => {
                // The search is a dead-letter id or an order id.
                let mut ids = match OrderId::new(q.as_str()) {
                    Ok(order) => self.order_ids(&order).await?,
                    Err(_) => Vec::new(),
                };
                ids.push(q.clone());
                ids.sort();
                ids.dedup();
                ids
            }
            (None, Some(order), _) => self.order_ids(order).await?,
            (None, None, group) => {
                let key = match group {
                    Some(g) => self.keys().dlq_group(g),
                    None => self.keys().dlq_letters(),
                };
                let from = query.from_ms.map_or("-inf".to_owned(), |ms| ms.to_string());
                let to = query.to_ms.map_or("+inf".to_owned(), |ms| ms.to_string());
                redis::cmd("ZRANGEBYSCORE")
                    .arg(key)
                    .arg(from)
                    .arg(to)
                    .query_async(&mut self.redis)
                    .await
                    .map_err(redis_error(self.fleet, "reading the dead-letter index"))?
            }
        };
        let mut entries = self.entries_of(&ids).await?;
        entries.sort_by(|a, b| (a.first_failed_ms, &a.id).cmp(&(b.first_failed_ms, &b.id)));
        entries.retain(|e| query.matches(e));
        if let Some(limit) = query.filters.limit {
            entries.truncate(limit);
        }
        Ok(entries)
    }

    /// The failure groups with their first and last failure and the orders
    /// they hold, largest first. Reads every entry (pipelined), so its cost
    /// grows with the index.
    pub(crate) async fn summaries(&mut self) -> Result<Vec<GroupSummary>, Error> {
        let groups = self.groups().await?;
        if groups.is_empty() {
            return Ok(Vec::new());
        }
        let ids = self.all_ids().await?;
        let mut seen: HashMap<String, (u64, u64, HashSet<String>)> = HashMap::new();
        for entry in self.entries_of(&ids).await? {
            let (first, last, orders) = seen
                .entry(entry.group.clone())
                .or_insert_with(|| (u64::MAX, 0, HashSet::new()));
            if entry.first_failed_ms > 0 {
                *first = (*first).min(entry.first_failed_ms);
                *last = (*last).max(entry.first_failed_ms);
            }
            if let Some(order) = entry.order_id {
                orders.insert(order);
            }
        }
        Ok(groups
            .into_iter()
            .map(|g| {
                let (first, last, orders) = seen.remove(&g.group.id).unwrap_or_default();
                GroupSummary {
                    count: g.count,
                    first_failed_ms: if first == u64::MAX { 0 } else { first },
                    last_failed_ms: last,
                    orders: orders.len() as u64,
                    group: g.group,
                }
            })
            .collect())
    }

    /// Writes entries (each as the worker does, [`INDEX_LUA`]).
    pub(crate) async fn write(&mut self, entries: &[IndexEntry]) -> Result<(), Error> {
        let script = format!("{INDEX_LUA}\nindex_letter(KEYS, ARGV)\nreturn 1");
        for chunk in entries.chunks(BATCH).filter(|c| !c.is_empty()) {
            let mut pipe = redis::pipe();
            for entry in chunk {
                let keys = entry.script_keys(self.keys());
                pipe.add_command(eval(&script, &keys, &entry.script_args()));
            }
            pipe.query_async::<()>(&mut self.redis)
                .await
                .map_err(redis_error(self.fleet, "writing the dead-letter index"))?;
        }
        Ok(())
    }

    /// Writes entries over what the index holds for their ids: an entry
    /// stored with another group or order (say, written by a release that
    /// normalised errors differently) is removed first, so that no set keeps
    /// its id.
    pub(crate) async fn rewrite(&mut self, entries: &[IndexEntry]) -> Result<(), Error> {
        let ids: Vec<String> = entries.iter().map(|e| e.id.clone()).collect();
        let stored: HashMap<String, IndexEntry> = self
            .entries_of(&ids)
            .await?
            .into_iter()
            .map(|e| (e.id.clone(), e))
            .collect();
        let moved: Vec<String> = entries
            .iter()
            .filter(|e| {
                stored
                    .get(&e.id)
                    .is_some_and(|s| (&s.group, &s.order_id) != (&e.group, &e.order_id))
            })
            .map(|e| e.id.clone())
            .collect();
        self.remove(&moved).await?;
        self.write(entries).await
    }

    /// Removes the entries of `ids` (letters that left the DLQ), by the
    /// entries as stored (their group and order as written); an id without
    /// an entry only leaves the set of all letters.
    pub(crate) async fn remove(&mut self, ids: &[String]) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        let stored = self.entries_of(ids).await?;
        let found: HashSet<&str> = stored.iter().map(|e| e.id.as_str()).collect();
        let mut pipe = redis::pipe();
        for entry in &stored {
            let keys = entry.script_keys(self.keys());
            pipe.add_command(eval(
                REMOVE,
                &keys,
                &[entry.id.clone(), entry.group.clone()],
            ));
        }
        for id in ids.iter().filter(|id| !found.contains(id.as_str())) {
            pipe.cmd("ZREM").arg(self.keys().dlq_letters()).arg(id);
        }
        pipe.query_async::<()>(&mut self.redis)
            .await
            .map_err(redis_error(
                self.fleet,
                "removing from the dead-letter index",
            ))
    }
}

/// `EVAL` of a small script (Redis caches it by its text).
fn eval(body: &str, keys: &[String], args: &[String]) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(body).arg(keys.len()).arg(keys).arg(args);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_letter_query_filters_by_group_time_and_the_filters() {
        let entry = IndexEntry {
            id: "a".into(),
            reason: "handler".into(),
            group: "g1".into(),
            order_id: Some("o-1".into()),
            shard: Some(2),
            first_failed_ms: 1_000,
            ..IndexEntry::default()
        };
        let matches = |set: fn(&mut LetterQuery)| {
            let mut query = LetterQuery::default();
            set(&mut query);
            query.matches(&entry)
        };
        assert!(matches(|_| {}));
        assert!(matches(|q| q.filters.group = Some("g1".into())));
        assert!(!matches(|q| q.filters.group = Some("g2".into())));
        assert!(matches(|q| q.search = Some("a".into())));
        assert!(matches(|q| q.search = Some("o-1".into())));
        assert!(!matches(|q| q.search = Some("o-2".into())));
        assert!(matches(|q| {
            q.from_ms = Some(1_000);
            q.to_ms = Some(1_000);
        }));
        assert!(!matches(|q| q.from_ms = Some(1_001)));
        assert!(!matches(|q| q.to_ms = Some(999)));
        assert!(!matches(|q| q.filters.shard = Some(3)));
        assert!(matches(|q| q.filters.reason = Some("handler".into())));
        assert!(!matches(
            |q| q.filters.order_id = Some(OrderId::new("o-2").unwrap())
        ));
    }
}
