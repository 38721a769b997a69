//! The rows the relay reads and what it publishes for each: the reads and
//! deletes of one batch, and a row's envelope and headers.

use std::time::{Duration, SystemTime};

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use shardline_contract::{NewEvent, OrderId, headers};
use tokio_postgres::Client;

use crate::schema::Schema;
use crate::sql::TABLE;

/// One unpublished row of the outbox.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Row {
    pub(super) id: i64,
    pub(super) event_id: String,
    pub(super) order_id: String,
    pub(super) event: String,
    pub(super) seq: i64,
    pub(super) data: serde_json::Value,
    pub(super) traceparent: Option<String>,
    pub(super) written_at: SystemTime,
}

impl Row {
    /// The event's envelope: its `event_id` the row's uuid, its
    /// `occurred_at` when the row was written. `None` when the order id is
    /// not one the fleet accepts (the append function refuses those, so
    /// only a row written around it).
    pub(super) fn event(&self) -> Option<NewEvent> {
        Some(NewEvent {
            order_id: OrderId::new(self.order_id.as_str()).ok()?,
            event: self.event.clone(),
            seq: u64::try_from(self.seq).ok(),
            event_id: Some(self.event_id.clone()),
            data: self.data.clone(),
        })
    }

    /// The headers the relay adds: when the row was written, and by which relay.
    pub(super) fn headers(&self, relay: &str) -> FieldTable {
        let mut table = FieldTable::default();
        let written_ms = self
            .written_at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        table.insert(
            ShortString::from(headers::WRITTEN_AT_MS),
            AMQPValue::LongLongInt(written_ms),
        );
        table.insert(
            ShortString::from(headers::RELAY),
            AMQPValue::LongString(LongString::from(relay)),
        );
        table
    }

    /// `row 17 (order A-1 seq 3)`: how messages name it.
    pub(super) fn describe(&self) -> String {
        format!("row {} (order {} seq {})", self.id, self.order_id, self.seq)
    }
}

/// The oldest row's age: how long the oldest unpublished row has waited
/// since it was written (zero for no rows).
pub(super) fn lag(rows: &[Row], now: SystemTime) -> Duration {
    rows.iter()
        .map(|r| r.written_at)
        .min()
        .and_then(|oldest| now.duration_since(oldest).ok())
        .unwrap_or_default()
}

/// The statements of one relay on one schema, prepared once per connection.
pub(super) struct Statements {
    read: tokio_postgres::Statement,
    delete: tokio_postgres::Statement,
}

impl Statements {
    pub(super) async fn prepare(
        client: &Client,
        schema: &Schema,
    ) -> Result<Self, tokio_postgres::Error> {
        let table = schema.qualify(TABLE);
        // Every row visible to this snapshot, in id order: no high-water
        // mark, so a row committed after a later id was read is read the
        // next time, never skipped.
        let read = client
            .prepare(&format!(
                "SELECT id, event_id::text, order_id, event, seq, data, traceparent, written_at \
                 FROM {table} ORDER BY id LIMIT $1"
            ))
            .await?;
        let delete = client
            .prepare(&format!("DELETE FROM {table} WHERE id = ANY($1)"))
            .await?;
        Ok(Self { read, delete })
    }

    /// Up to `limit` unpublished rows, lowest id first.
    pub(super) async fn read(
        &self,
        client: &Client,
        limit: i64,
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let rows = client.query(&self.read, &[&limit]).await?;
        rows.iter()
            .map(|r| {
                Ok(Row {
                    id: r.try_get(0)?,
                    event_id: r.try_get(1)?,
                    order_id: r.try_get(2)?,
                    event: r.try_get(3)?,
                    seq: r.try_get(4)?,
                    data: r.try_get(5)?,
                    traceparent: r.try_get(6)?,
                    written_at: r.try_get(7)?,
                })
            })
            .collect()
    }

    /// Deletes the rows the broker confirmed.
    pub(super) async fn delete(
        &self,
        client: &Client,
        ids: &[i64],
    ) -> Result<u64, tokio_postgres::Error> {
        client.execute(&self.delete, &[&ids]).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, written_secs: u64) -> Row {
        Row {
            id,
            event_id: "7d9f1f0e-8d55-4a55-9d3c-0d6f0b1f2a3c".into(),
            order_id: "A-1".into(),
            event: "order.created".into(),
            seq: id,
            data: serde_json::json!({"total": 3}),
            traceparent: None,
            written_at: SystemTime::UNIX_EPOCH + Duration::from_secs(written_secs),
        }
    }

    #[test]
    fn a_row_becomes_an_envelope_with_its_uuid_and_seq() {
        let event = row(4, 10).event().expect("a valid order id");
        assert_eq!(event.order_id.as_str(), "A-1");
        assert_eq!(event.seq, Some(4));
        assert_eq!(
            event.event_id.as_deref(),
            Some("7d9f1f0e-8d55-4a55-9d3c-0d6f0b1f2a3c")
        );
        let body = event
            .to_body_at(SystemTime::UNIX_EPOCH + Duration::from_secs(10))
            .expect("a valid body");
        let text = String::from_utf8(body).expect("JSON is UTF-8");
        assert!(
            text.contains(r#""occurred_at":"1970-01-01T00:00:10.000Z""#),
            "{text}"
        );
    }

    #[test]
    fn the_headers_stamp_the_time_of_writing_and_the_relay() {
        let table = row(1, 12).headers("relay-a");
        assert_eq!(
            table.inner().get(headers::WRITTEN_AT_MS),
            Some(&AMQPValue::LongLongInt(12_000))
        );
        assert_eq!(
            table.inner().get(headers::RELAY),
            Some(&AMQPValue::LongString("relay-a".into()))
        );
    }

    #[test]
    fn the_lag_is_the_oldest_rows_age() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        assert_eq!(lag(&[], now), Duration::ZERO);
        assert_eq!(lag(&[row(2, 90), row(1, 70)], now), Duration::from_secs(30));
    }
}
