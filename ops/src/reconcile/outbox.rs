//! The transactional outbox side of reconcile (`outbox_schema`): the rows
//! the relay has not published yet of the orders whose events are missing,
//! read in the same snapshot as the orders.
//!
//! Why one snapshot makes this sound. An application appends an event
//! (`shardline_outbox_append`) in the transaction that writes its order's
//! status, so the row commits together with the status: in any snapshot
//! either both are visible or neither. The relay deletes a row only after
//! the broker confirmed its publish. Reconcile reads the orders and the
//! outbox in one read-only `REPEATABLE READ` transaction, and only then
//! reads what the fleet did (Redis, the broker). For an order whose status
//! implies an event:
//!
//! - its row is in the snapshot: the event is not published yet, or was
//!   published after the snapshot. Pending, never compensated: the relay
//!   publishes it once.
//! - its status is in the snapshot and its row is not: the row was deleted
//!   before the snapshot, so the broker had confirmed the event before
//!   reconcile looked at the fleet. It is processed, held by the gate, in a
//!   shard backlog or in the DLQ, and the rules every published event meets
//!   decide (`pending`).
//! - its status is not in the snapshot (committed after it): the run does
//!   not expect the event at all; a later run sees status and row together.
//!
//! Two separate reads (two snapshots) would break the middle case: a status
//! read first, its row relayed and deleted before the outbox is read, and
//! the event, published a moment ago and not processed yet, taken for drift.
//!
//! An order with unpublished rows of other kinds only is pending too: the
//! relay publishes an order's rows in seq order and has not finished with
//! the order, so the missing event may have gone out just before them (and
//! wait in a young backlog) or may still be appended behind them. Pending
//! only postpones: once the order's rows are relayed, the next run decides.
//!
//! The existing rules count a shard backlog's age from when its events were
//! published, which for a relayed event is when the relay caught up with
//! its row, not when its order was written. So while the relay is behind by
//! more than the grace (its oldest unpublished row was written longer ago),
//! every missing event of the run is pending ([`Seen::relay_behind`]).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use shardline_outbox::Schema;
use tokio_postgres::Transaction;

/// Orders looked up in the outbox per query.
const ORDERS_PER_QUERY: usize = 500;

/// One order's unpublished rows, as one run saw them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Unpublished {
    pub rows: u64,
    /// Rows by event kind.
    pub kinds: BTreeMap<String, u64>,
    /// How long ago the oldest row was written (by the database's clock).
    pub oldest: Duration,
}

impl Unpublished {
    fn add(&mut self, kind: String, rows: u64, oldest: Duration) {
        self.rows += rows;
        *self.kinds.entry(kind).or_default() += rows;
        self.oldest = self.oldest.max(oldest);
    }

    /// The rows of `kind`.
    pub(super) fn of_kind(&self, kind: &str) -> u64 {
        self.kinds.get(kind).copied().unwrap_or(0)
    }
}

/// What a run read of the outbox, in the orders' snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Seen {
    /// The unpublished rows of the orders asked about, by order id.
    pub unpublished: HashMap<String, Unpublished>,
    /// How long ago the outbox's oldest unpublished row (of any order) was
    /// written, when more than the grace: the relay is behind.
    pub relay_behind: Option<Duration>,
}

/// `(order_id, event, rows, age of the oldest)` groups, as the outbox query
/// returns them, summed per order.
pub(super) fn by_order(
    groups: impl IntoIterator<Item = (String, String, u64, Duration)>,
) -> HashMap<String, Unpublished> {
    let mut out: HashMap<String, Unpublished> = HashMap::new();
    for (order_id, kind, rows, oldest) in groups {
        out.entry(order_id).or_default().add(kind, rows, oldest);
    }
    out
}

/// An age in seconds as the database gives it; none for what is not one.
pub(super) fn age(seconds: Option<f64>) -> Duration {
    seconds
        .and_then(|s| Duration::try_from_secs_f64(s.max(0.0)).ok())
        .unwrap_or(Duration::ZERO)
}

/// The outbox's table in the order database, and the statements reconcile
/// reads it with.
pub(super) struct Outbox {
    /// The table as SQL names it: `"schema".shardline_outbox`.
    table: String,
}

/// The statements of one run, prepared in its transaction.
pub(super) struct Statements {
    rows: tokio_postgres::Statement,
    oldest: tokio_postgres::Statement,
}

impl Outbox {
    pub(super) fn new(schema: &Schema) -> Self {
        Self {
            table: schema.qualify(shardline_outbox::sql::TABLE),
        }
    }

    /// The table as SQL names it.
    pub(super) fn table(&self) -> &str {
        &self.table
    }

    /// Prepares the reads in `tx`: a missing table or a missing `SELECT`
    /// privilege fails here, before anything else is read.
    pub(super) async fn prepare(
        &self,
        tx: &Transaction<'_>,
    ) -> Result<Statements, tokio_postgres::Error> {
        // Ages by the database's clock, the one `written_at` was taken by.
        let rows = tx
            .prepare(&format!(
                "SELECT order_id, event, count(*)::int8, \
                 extract(epoch FROM clock_timestamp() - min(written_at))::float8 \
                 FROM {} WHERE order_id = ANY($1::text[]) GROUP BY order_id, event",
                self.table
            ))
            .await?;
        // The lowest id is the oldest row the relay has not published: it
        // reads in id order.
        let oldest = tx
            .prepare(&format!(
                "SELECT extract(epoch FROM clock_timestamp() - written_at)::float8 \
                 FROM {} ORDER BY id LIMIT 1",
                self.table
            ))
            .await?;
        Ok(Statements { rows, oldest })
    }
}

impl Statements {
    /// The unpublished rows of `orders` and how far behind the relay is
    /// (against `grace`), in `tx`'s snapshot.
    pub(super) async fn read(
        &self,
        tx: &Transaction<'_>,
        orders: &[&str],
        grace: Duration,
    ) -> Result<Seen, tokio_postgres::Error> {
        let mut groups = Vec::new();
        for chunk in orders.chunks(ORDERS_PER_QUERY) {
            for row in tx.query(&self.rows, &[&chunk]).await? {
                let rows = u64::try_from(row.try_get::<_, i64>(2)?).unwrap_or(0);
                groups.push((
                    row.try_get::<_, String>(0)?,
                    row.try_get::<_, String>(1)?,
                    rows,
                    age(row.try_get(3)?),
                ));
            }
        }
        let oldest = match tx.query_opt(&self.oldest, &[]).await? {
            Some(row) => Some(age(row.try_get(0)?)),
            None => None,
        };
        Ok(Seen {
            unpublished: by_order(groups),
            relay_behind: oldest.filter(|age| *age > grace),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_summed_per_order_with_their_oldest() {
        let s = Duration::from_secs;
        let seen = by_order([
            ("A1".into(), "payment.captured".into(), 1, s(12)),
            ("A1".into(), "order.fulfilled".into(), 2, s(3)),
            ("A2".into(), "inventory.reserved".into(), 1, s(40)),
        ]);
        let a1 = &seen["A1"];
        assert_eq!(a1.rows, 3);
        assert_eq!(a1.oldest, s(12), "the oldest of all its kinds");
        assert_eq!(a1.of_kind("payment.captured"), 1);
        assert_eq!(a1.of_kind("order.fulfilled"), 2);
        assert_eq!(a1.of_kind("inventory.reserved"), 0);
        assert_eq!(seen["A2"].rows, 1);
        assert!(!seen.contains_key("A3"));
    }

    #[test]
    fn ages_are_never_negative_nor_made_up() {
        assert_eq!(age(Some(1.5)), Duration::from_millis(1500));
        assert_eq!(
            age(Some(-0.2)),
            Duration::ZERO,
            "a row written by a clock ahead"
        );
        assert_eq!(age(Some(f64::NAN)), Duration::ZERO);
        assert_eq!(age(Some(f64::INFINITY)), Duration::ZERO);
        assert_eq!(age(None), Duration::ZERO);
    }

    #[test]
    fn the_table_is_named_in_its_schema_quoted() {
        let schema = shardline_outbox::validate_schema("user").unwrap();
        assert_eq!(Outbox::new(&schema).table(), "\"user\".shardline_outbox");
    }
}
