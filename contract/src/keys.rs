//! The Redis keyspace, the second wire contract: every key shardline reads or
//! writes is built here, from the configured prefix (default `shardline:`).
//!
//! Order ids and event kinds enter keys through [`key_field`] (`%` and `:`
//! escaped), so that no two orders or kinds share a key.
//!
//! | key | written by | what it holds |
//! |---|---|---|
//! | `order:{order}` | worker | an order's state (a hash): last passed seq, never-processed seqs, the claim of its event in flight, processed kinds ([`Keys::kind_code`]), fence |
//! | `dedup:{dedup_key}` | worker | an unsequenced event's claim (`processing:…`) or `done` |
//! | `fence` | worker | the fleet's epoch counter: every consumer takes its fence token here (fenced writes) |
//! | `fence:{shard}` | worker | the epoch of the shard's newest consumer (`dlq release` raises an order to it; a worker of an earlier release counted here) |
//! | `reshard:markers`, `reshard:drained`, `reshard:closed` | `topology reshard`, the worker honouring a marker | a reshard's marker ids and the moves drained and closed (`connect::reshard`) |
//! | `publishers` | the project's publishers | each registered publisher's lease and the topology generation it acknowledged (resharding's confirm barrier) |
//! | `redis:era` | worker | the Redis failover era and the primary's replication id it was seen with |
//! | `layout` | worker | when the order-state layout was switched on |
//! | `gate:{order}`, `kind:{order}:{kind}` | workers before the order state | read during the dedup TTL after an upgrade |
//! | `quarantine:{order}` | worker, `dlq release` | the dead letters holding an order |
//! | `status:shard:{n}` | worker | the shard status document ([`crate::status`]) |
//! | `status:worker:{name}` | worker | the worker status document |
//! | `status:relay:{name}` | outbox relay | the relay status document ([`crate::status::RelayReport`]) |
//! | `reconcile:{order}:{kind}` | `reconcile` | a compensation was emitted |
//! | `dlq:letter:{id}` | worker, `dlq reindex`; removed by `dlq replay`/`purge` | a dead letter's index entry (a hash, [`crate::letters::IndexEntry`]) |
//! | `dlq:letters` | the same | every indexed letter id, scored by first-failed ms (its `ZCARD` is the index's count) |
//! | `dlq:group:{group}` | the same | a failure group's letter ids, scored by first-failed ms |
//! | `dlq:groups` | the same | group id → `{reason}\n{normalised error}` while the group has letters |
//! | `dlq:order:{order}` | the same | an order's indexed letter ids (reconcile's pending check) |
//! | `dlq:replay:{order}` | `dlq replay` | the order's replay lock: `run:{token}` while a replay of it runs, `done:{token}` for a tail after (reconcile: pending) |
//! | `audit` | the console (`ops::audit::record`) | the operator actions, newest first (a list of JSON entries, capped at `ops::audit::CAP`) |
//! | `reconcile:runs` | `reconcile` at an interval (`ops::reconcile::record_run`) | the runs' summaries, newest first (a list of JSON documents, capped at `ops::reconcile::RUNS_CAP`) |

use md5::{Digest, Md5};

use crate::order_id::key_field;
use crate::shard::ShardId;

/// Builds the keys under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Default for Keys {
    fn default() -> Self {
        Self::new("shardline:")
    }
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `{prefix}{tag}{rest}`, allocated once: these are built for every event.
    fn key(&self, tag: &str, rest: &str) -> String {
        let mut key = String::with_capacity(self.prefix.len() + tag.len() + rest.len());
        key.push_str(&self.prefix);
        key.push_str(tag);
        key.push_str(rest);
        key
    }

    /// An order's state (a hash; fields in the worker's `dedup` module), by
    /// its order key ([`crate::envelope::order_key_of`]).
    pub fn order(&self, order_key: &str) -> String {
        self.key("order:", order_key)
    }

    /// How an order's state names a processed kind: 8 hex digits of the
    /// kind's md5, appended to its field `k` (what `shardline reconcile`
    /// checks). 32 bits: two kinds of one order collide with odds of about
    /// one in 10^9 per pair; a name would cost 20-odd bytes per kind per order.
    pub fn kind_code(event: &str) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let digest = Md5::digest(event.as_bytes());
        let mut code = String::with_capacity(8);
        for b in &digest[..4] {
            code.push(char::from(HEX[usize::from(b >> 4)]));
            code.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        code
    }

    /// Whether the `k` field of an order's state holds `code`.
    pub fn has_kind(field: &str, code: &str) -> bool {
        field.as_bytes().chunks(8).any(|c| c == code.as_bytes())
    }

    /// The fleet's epoch counter: each consumer of a shard, and each owner
    /// taking over moved keys, takes the next value with its first write and
    /// writes order state with it (one counter for the fleet, so an epoch
    /// taken on any shard is above every epoch taken before it anywhere).
    pub fn epochs(&self) -> String {
        format!("{}fence", self.prefix)
    }

    /// The epoch of the shard's newest consumer, written when it takes one
    /// (before the fleet-wide counter, each shard counted its own epochs
    /// here; taking one raises the fleet's counter above it).
    pub fn fence(&self, shard: u16) -> String {
        format!("{}fence:{shard}", self.prefix)
    }

    /// The recorded topology (JSON: [`crate::topology::TopologyRecord`]).
    pub fn topology(&self) -> String {
        format!("{}topology", self.prefix)
    }

    /// The registered publishers of the resharding protocol's confirm
    /// barrier (a hash: publisher id → lease; `connect::publishers`).
    pub fn publishers(&self) -> String {
        format!("{}publishers", self.prefix)
    }

    /// A reshard's marker ids (a hash: id → `{move}:{drain|close}:{pending|spent}`).
    pub fn reshard_markers(&self) -> String {
        format!("{}reshard:markers", self.prefix)
    }

    /// A reshard's moves whose drain marker was honoured (a set of move ids).
    pub fn reshard_drained(&self) -> String {
        format!("{}reshard:drained", self.prefix)
    }

    /// A reshard's moves whose holding queue's marker was honoured (a set).
    pub fn reshard_closed(&self) -> String {
        format!("{}reshard:closed", self.prefix)
    }

    /// The Redis failover era (a hash: `era`, `replid`).
    pub fn redis_era(&self) -> String {
        format!("{}redis:era", self.prefix)
    }

    /// When the order-state layout was switched on (JSON).
    pub fn layout(&self) -> String {
        format!("{}layout", self.prefix)
    }

    /// An event's dedup state, by its dedup key (already escaped, docs/semantics.md §2):
    /// unsequenced events, and sequenced ones of the layout before the order
    /// state (read during the dedup TTL after an upgrade).
    pub fn dedup(&self, dedup_key: &str) -> String {
        self.key("dedup:", dedup_key)
    }

    /// An order's last passed seq in the layout before the order state (read
    /// during the dedup TTL after an upgrade).
    pub fn gate(&self, order_key: &str) -> String {
        self.key("gate:", order_key)
    }

    /// In the layout before the order state: exists while an event of kind
    /// `event` of the order was processed within the kinds TTL (reconcile
    /// still reads it after an upgrade).
    pub fn kind(&self, order_key: &str, event: &str) -> String {
        format!("{}kind:{order_key}:{}", self.prefix, key_field(event))
    }

    /// The dead letters holding an order in quarantine (a sorted set).
    pub fn quarantine(&self, order_key: &str) -> String {
        self.key("quarantine:", order_key)
    }

    /// A shard's status document.
    pub fn shard_status(&self, shard: ShardId) -> String {
        self.shard_status_of(shard.get())
    }

    /// [`Self::shard_status`] by shard number.
    pub fn shard_status_of(&self, shard: u16) -> String {
        format!("{}status:shard:{shard}", self.prefix)
    }

    /// A worker's status document, by worker (member) name.
    pub fn worker_status(&self, worker: &str) -> String {
        format!("{}status:worker:{}", self.prefix, key_field(worker))
    }

    /// The pattern matching every worker status document (for `SCAN`).
    pub fn worker_status_pattern(&self) -> String {
        format!("{}status:worker:*", glob_escape(&self.prefix))
    }

    /// An outbox relay's status document, by relay name.
    pub fn relay_status(&self, relay: &str) -> String {
        format!("{}status:relay:{}", self.prefix, key_field(relay))
    }

    /// The pattern matching every relay status document (for `SCAN`).
    pub fn relay_status_pattern(&self) -> String {
        format!("{}status:relay:*", glob_escape(&self.prefix))
    }

    /// The fleet's downstream breaker while one of its workers has it open
    /// (`status::FleetBreaker`, refreshed by that worker's status writer,
    /// expiring soon after it closes): a worker that starts reads it.
    pub fn fleet_breaker(&self) -> String {
        format!("{}status:breaker", self.prefix)
    }

    /// The elastic fleet's members (`--assign auto`): a hash, member id →
    /// `fleet::MemberRecord` (JSON).
    pub fn fleet_members(&self) -> String {
        format!("{}fleet:members", self.prefix)
    }

    /// The elastic fleet's assignment (`fleet::FleetAssignment`, JSON).
    pub fn fleet_assignment(&self) -> String {
        format!("{}fleet:assignment", self.prefix)
    }

    /// Shards consumed by workers with a fixed `--assign`: a hash, worker
    /// name → `fleet::StaticRecord` (JSON). `auto` members leave them alone.
    pub fn fleet_static(&self) -> String {
        format!("{}fleet:static", self.prefix)
    }

    /// `shardline reconcile`'s record of a compensation it emitted.
    pub fn reconcile_emitted(&self, order_key: &str, kind: &str) -> String {
        format!("{}reconcile:{order_key}:{}", self.prefix, key_field(kind))
    }

    /// The audit log of operator actions: a list of JSON entries, newest
    /// first, capped by its writer.
    pub fn audit(&self) -> String {
        format!("{}audit", self.prefix)
    }

    /// The summaries of reconcile's runs at an interval: a list of JSON
    /// documents, newest first, capped by its writer. No compensation record
    /// ([`Self::reconcile_emitted`]) has this name: theirs have two parts
    /// after `reconcile:`.
    pub fn reconcile_runs(&self) -> String {
        format!("{}reconcile:runs", self.prefix)
    }

    /// A dead letter's index entry (a hash), by dead-letter id.
    pub fn dlq_letter(&self, id: &str) -> String {
        self.key("dlq:letter:", &key_field(id))
    }

    /// Every indexed dead letter's id, scored by its first-failed time (ms).
    pub fn dlq_letters(&self) -> String {
        format!("{}dlq:letters", self.prefix)
    }

    /// A failure group's letter ids (a sorted set by first-failed time), by
    /// group id ([`crate::letters::group_id`]).
    pub fn dlq_group(&self, group: &str) -> String {
        self.key("dlq:group:", &key_field(group))
    }

    /// The failure groups that have letters: group id → description
    /// ([`crate::letters::Group::description`]).
    pub fn dlq_groups(&self) -> String {
        format!("{}dlq:groups", self.prefix)
    }

    /// An order's indexed dead-letter ids (a set), by order key.
    pub fn dlq_order(&self, order_key: &str) -> String {
        self.key("dlq:order:", order_key)
    }

    /// An order's replay lock (`SET NX` with a TTL, renewed while the replay
    /// runs), by order key.
    pub fn dlq_replay_lock(&self, order_key: &str) -> String {
        self.key("dlq:replay:", order_key)
    }

    /// The pattern matching every order's replay lock (for `SCAN`).
    pub fn dlq_replay_lock_pattern(&self) -> String {
        format!("{}dlq:replay:*", glob_escape(&self.prefix))
    }

    /// A replay's record ([`crate::replay`]), by the dead-letter id its
    /// event carries in `x-shardline-replay`.
    pub fn replay_record(&self, id: &str) -> String {
        self.key("dlq:replayed:", &key_field(id))
    }

    /// The pattern matching every key of the dead-letter index (for `SCAN`).
    pub fn dlq_pattern(&self) -> String {
        format!("{}dlq:*", glob_escape(&self.prefix))
    }

    /// A key of this prefix that the bench's raw baseline loop writes.
    pub fn bench_raw(&self, id: &str) -> String {
        format!("{}raw:{id}", self.prefix)
    }

    /// The pattern matching every key under the prefix (for `SCAN`): the
    /// prefix with glob characters escaped, then `*`.
    pub fn everything_pattern(&self) -> String {
        format!("{}*", glob_escape(&self.prefix))
    }
}

/// `s` with the glob characters of `SCAN MATCH` escaped.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 1);
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::order_key_of;
    use crate::shard::ShardCount;

    #[test]
    fn the_keyspace() {
        let k = Keys::new("p:");
        let order = order_key_of("A:1%");
        assert_eq!(order, "A%3A1%25");
        assert_eq!(
            k.dedup("A1:payment.captured:3"),
            "p:dedup:A1:payment.captured:3"
        );
        assert_eq!(k.gate(&order), "p:gate:A%3A1%25");
        assert_eq!(k.kind(&order, "pay:x"), "p:kind:A%3A1%25:pay%3Ax");
        assert_eq!(k.quarantine("A1"), "p:quarantine:A1");
        assert_eq!(k.order(&order), "p:order:A%3A1%25");
        let code = Keys::kind_code("payment.captured");
        assert_eq!(code.len(), 8);
        assert_ne!(code, Keys::kind_code("payment.refunded"));
        assert!(Keys::has_kind(&format!("0badc0de{code}"), &code));
        assert!(!Keys::has_kind(&format!("0{code}"), &code));
        assert_eq!(k.fence(3), "p:fence:3");
        assert_eq!(k.epochs(), "p:fence");
        let shard = ShardId::new(3, ShardCount::default()).unwrap_or_else(|_| unreachable!());
        assert_eq!(k.shard_status(shard), "p:status:shard:3");
        assert_eq!(k.worker_status("host-1"), "p:status:worker:host-1");
        assert_eq!(
            k.reconcile_emitted(&order, "payment.captured"),
            "p:reconcile:A%3A1%25:payment.captured"
        );
        assert_eq!(Keys::default().gate("A1"), "shardline:gate:A1");
        assert_eq!(k.dlq_letter("a:b"), "p:dlq:letter:a%3Ab");
        assert_eq!(k.dlq_letters(), "p:dlq:letters");
        assert_eq!(k.dlq_group("0123456789ab"), "p:dlq:group:0123456789ab");
        assert_eq!(k.dlq_groups(), "p:dlq:groups");
        assert_eq!(k.dlq_order(&order), "p:dlq:order:A%3A1%25");
        assert_eq!(k.dlq_replay_lock(&order), "p:dlq:replay:A%3A1%25");
        assert_eq!(k.audit(), "p:audit");
        assert_eq!(k.reconcile_runs(), "p:reconcile:runs");
    }

    #[test]
    fn patterns_escape_the_prefix() {
        let k = Keys::new("t[1]*:");
        assert_eq!(k.everything_pattern(), "t\\[1\\]\\*:*");
        assert_eq!(k.worker_status_pattern(), "t\\[1\\]\\*:status:worker:*");
    }
}
