//! A PostgreSQL schema per test, dropped on drop: with an `orders` table,
//! the order database `shardline reconcile` reads ([`OrdersDb`]); or a bare
//! name for a test that creates the schema itself ([`ScratchSchema`], the
//! outbox tests).

use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls};

use crate::env::TestEnv;

/// The test database (trust authentication).
pub const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// A client on `url`, its connection driven by a task of its own.
pub async fn try_client(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// A client on the test database ([`PG_URL`]); fails the test when it cannot connect.
pub async fn client() -> Client {
    try_client(PG_URL)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {PG_URL}: {e}"))
}

pub struct OrdersDb {
    /// The schema, unique to the test.
    pub schema: String,
    client: Client,
    connection: JoinHandle<()>,
}

impl OrdersDb {
    /// Creates the environment's schema ([`TestEnv::pg_schema`]) with an empty
    /// table `orders(order_id text, status text, updated_at timestamptz)`.
    pub async fn new(env: &TestEnv) -> Self {
        let schema = env.pg_schema.clone();
        let (client, connection) = tokio_postgres::connect(PG_URL, NoTls)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {PG_URL}: {e}"));
        let connection = tokio::spawn(async move {
            let _ = connection.await;
        });
        client
            .batch_execute(&format!(
                "CREATE SCHEMA {schema};
                 CREATE TABLE {schema}.orders (
                     order_id text PRIMARY KEY,
                     status text NOT NULL,
                     updated_at timestamptz NOT NULL
                 );"
            ))
            .await
            .unwrap();
        Self {
            schema,
            client,
            connection,
        }
    }

    /// The `--orders-url` that finds the schema's `orders` table.
    pub fn url(&self) -> String {
        format!("{PG_URL}?options=-csearch_path%3D{}", self.schema)
    }

    /// Inserts or updates an order, last updated `age` ago.
    pub async fn set(&self, order_id: &str, status: &str, age: Duration) {
        let updated_at = SystemTime::now() - age;
        self.client
            .execute(
                &format!(
                    "INSERT INTO {}.orders (order_id, status, updated_at) VALUES ($1, $2, $3)
                     ON CONFLICT (order_id) DO UPDATE SET status = $2, updated_at = $3",
                    self.schema
                ),
                &[&order_id, &status, &updated_at],
            )
            .await
            .unwrap();
    }
}

impl Drop for OrdersDb {
    fn drop(&mut self) {
        self.connection.abort();
        drop_schema(&self.schema);
    }
}

/// A schema name unique to the test (`{prefix}_{pid}_{n}_{stamp}`, lower
/// case), not created: the test creates it. Dropped with everything in it
/// on drop, if it exists.
pub struct ScratchSchema {
    pub name: String,
}

impl ScratchSchema {
    pub fn new(prefix: &str) -> Self {
        let name = crate::env::unique_name(prefix, '_');
        assert!(name.len() <= 63, "schema name {name} over 63 bytes");
        Self { name }
    }
}

impl Drop for ScratchSchema {
    fn drop(&mut self) {
        drop_schema(&self.name);
    }
}

/// `DROP SCHEMA IF EXISTS schema CASCADE` on [`PG_URL`]. Drop runs outside
/// any async context: a thread of its own with a one-off runtime, joined so
/// that the schema is gone when it returns.
fn drop_schema(schema: &str) {
    let owned = schema.to_owned();
    let dropped = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime.block_on(async {
            let (client, connection) = tokio_postgres::connect(PG_URL, NoTls)
                .await
                .map_err(|e| e.to_string())?;
            let connection = tokio::spawn(connection);
            let dropped = client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{owned}\" CASCADE"))
                .await
                .map_err(|e| e.to_string());
            drop(client);
            let _ = connection.await;
            dropped
        })
    })
    .join();
    match dropped {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("cleanup: DROP SCHEMA {schema}: {e}"),
        Err(_) => eprintln!("cleanup: DROP SCHEMA {schema} panicked"),
    }
}
