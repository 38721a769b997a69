//! What the outbox tests share: a client, an installed outbox in a scratch
//! schema, and appends through the function.

use std::time::Duration;

use shardline_outbox::{DatabaseUrl, Installed, Schema, install};
use shardline_testkit::ScratchSchema;
use shardline_testkit::pg::PG_URL;
use tokio_postgres::Client;

/// A client on the machine's test database.
pub(crate) async fn client() -> Client {
    DatabaseUrl::parse(PG_URL)
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("{e} (scripts/services starts PostgreSQL)"))
}

/// An outbox installed in a schema of its own, dropped with the value.
pub(crate) struct Outbox {
    pub(crate) schema: Schema,
    pub(crate) installed: Installed,
    /// The schema's name in SQL (`"outbox_…"`).
    pub(crate) quoted: String,
    _scratch: ScratchSchema,
}

impl Outbox {
    pub(crate) async fn new(test: &str) -> Self {
        let scratch = ScratchSchema::new(&format!("outbox_{test}"));
        let installed = install(&mut client().await, &scratch.name).await.unwrap();
        let schema = installed.schema.clone();
        Self {
            quoted: schema.quoted(),
            schema,
            installed,
            _scratch: scratch,
        }
    }

    /// `SELECT schema.shardline_outbox_append($1, $2, $3::jsonb)`.
    pub(crate) fn append_sql(&self) -> String {
        format!(
            "SELECT {}.shardline_outbox_append($1, $2, $3::text::jsonb)",
            self.quoted
        )
    }

    /// Appends `event` to `order` on `client` (in its transaction, if one is open).
    pub(crate) async fn append(&self, client: &Client, order: &str, event: &str) -> i64 {
        client
            .query_one(&self.append_sql(), &[&order, &event, &"{}"])
            .await
            .unwrap_or_else(|e| panic!("appending {order} {event}: {e:?}"))
            .get(0)
    }

    /// The rows of `order` in the outbox: `(seq, event)` in `id` order.
    pub(crate) async fn rows(&self, client: &Client, order: &str) -> Vec<(i64, String)> {
        client
            .query(
                &format!(
                    "SELECT seq, event FROM {}.shardline_outbox WHERE order_id = $1 ORDER BY id",
                    self.quoted
                ),
                &[&order],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect()
    }
}

/// The backend of `client` waits on a lock (another transaction's row lock).
pub(crate) async fn waits_on_a_lock(observer: &Client, pid: i32) -> Result<(), String> {
    let row = observer
        .query_one(
            "SELECT coalesce(wait_event_type, ''), coalesce(wait_event, ''), state
             FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .map_err(|e| e.to_string())?;
    let (kind, event, state): (String, String, String) = (row.get(0), row.get(1), row.get(2));
    if kind == "Lock" {
        Ok(())
    } else {
        Err(format!(
            "backend {pid}: {state}, waiting on {kind:?} {event:?}"
        ))
    }
}

/// The backend process id of `client`.
pub(crate) async fn pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// How long a blocked append is watched to show it does not return.
pub(crate) const BLOCKED: Duration = Duration::from_millis(300);
