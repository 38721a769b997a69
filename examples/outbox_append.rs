//! Writing events through the transactional outbox with tokio-postgres: the
//! order's new status and its event commit together, or neither does.
//!
//! What it shows, in a schema of its own that it drops at the end:
//!
//! 1. installing the outbox (what `shardline outbox install` does);
//! 2. one transaction that updates an order's status and appends its event
//!    with `shardline_outbox_append`, which returns the event's seq;
//! 3. one transaction that appends for several orders, in `order_id` order
//!    (so that two such transactions never wait for each other in a cycle);
//! 4. a rolled-back transaction, which leaves no event and no gap;
//! 5. seeding the counter of an order whose seqs 1 to 5 were published
//!    before the outbox, so that its next event gets 6.
//!
//! It checks the seqs it got and exits non-zero when one is not what the
//! outbox promises.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run --example outbox_append
//! ```

use std::error::Error;

use tokio_postgres::{Client, NoTls};

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let schema = format!("outbox_example_{}", std::process::id());
    let (mut client, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    let shown = example(&mut client, &schema).await;
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await?;
    shown
}

async fn example(client: &mut Client, schema: &str) -> Result<()> {
    // 1. Once per database (or schema), by whoever migrates it.
    let installed = shardline_outbox::install(client, schema).await?;
    println!("{installed}");
    // The application's own table; the outbox's functions are found by the
    // search path like any other.
    client
        .batch_execute(&format!(
            "SET search_path TO {schema};
             CREATE TABLE orders (order_id text PRIMARY KEY, status text NOT NULL);
             INSERT INTO orders VALUES ('A-1001', 'NEW'), ('A-1002', 'NEW'), ('A-1003', 'NEW');"
        ))
        .await?;

    // 2. The status and the event in one transaction.
    let tx = client.transaction().await?;
    tx.execute(
        "UPDATE orders SET status = 'PAID' WHERE order_id = $1",
        &[&"A-1001"],
    )
    .await?;
    let seq = append(&tx, "A-1001", "payment.captured", r#"{"amount": 4200}"#).await?;
    tx.commit().await?;
    println!("A-1001 payment.captured: seq {seq}");
    check("A-1001's first event", seq, 1)?;

    // 3. Several orders in one transaction: in order_id order, always. Each
    // append locks its order's counter until the commit; two transactions
    // that took the same orders in different orders could each hold the
    // lock the other waits for, and PostgreSQL would abort one of them.
    let mut shipped = vec!["A-1003", "A-1001", "A-1002"];
    shipped.sort_unstable();
    let tx = client.transaction().await?;
    let mut seqs = Vec::new();
    for order in &shipped {
        tx.execute(
            "UPDATE orders SET status = 'SHIPPED' WHERE order_id = $1",
            &[order],
        )
        .await?;
        seqs.push(append(&tx, order, "order.shipped", "{}").await?);
    }
    tx.commit().await?;
    for (order, seq) in shipped.iter().zip(&seqs) {
        println!("{order} order.shipped: seq {seq}");
    }
    check("A-1001's second event", seqs[0], 2)?;
    check("A-1002's first event", seqs[1], 1)?;
    check("A-1003's first event", seqs[2], 1)?;

    // 4. A rollback takes its events with it, and gives their seqs back.
    let tx = client.transaction().await?;
    append(&tx, "A-1002", "order.cancelled", "{}").await?;
    tx.rollback().await?;
    let tx = client.transaction().await?;
    let seq = append(&tx, "A-1002", "order.delivered", "{}").await?;
    tx.commit().await?;
    println!("A-1002 order.delivered: seq {seq} (the rolled-back event left no gap)");
    check("A-1002's event after a rollback", seq, 2)?;

    // 5. Seqs 1 to 5 of order L-7 went out before the outbox: its next is 6.
    let next: i64 = client
        .query_one("SELECT shardline_outbox_seed($1, $2)", &[&"L-7", &6_i64])
        .await?
        .get(0);
    let tx = client.transaction().await?;
    let seq = append(&tx, "L-7", "order.returned", "{}").await?;
    tx.commit().await?;
    println!("L-7 seeded at {next}; order.returned: seq {seq}");
    check("L-7's first event through the outbox", seq, 6)?;

    // What the relay will publish, in id order; event_id is the message id,
    // {order}:{event}:{seq} the dedup key.
    let rows = client
        .query(
            "SELECT order_id, event, seq, event_id::text FROM shardline_outbox ORDER BY id",
            &[],
        )
        .await?;
    for row in &rows {
        let (order, event, seq, id): (String, String, i64, String) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        println!("outbox: {order}:{event}:{seq} event_id={id}");
    }
    check("rows in the outbox", i64::try_from(rows.len())?, 6)?;
    println!("outbox example: ok");
    Ok(())
}

/// Appends `event` of `order` in `tx`; returns its seq.
async fn append(
    tx: &tokio_postgres::Transaction<'_>,
    order: &str,
    event: &str,
    data: &str,
) -> Result<i64> {
    let row = tx
        .query_one(
            "SELECT shardline_outbox_append($1, $2, $3::text::jsonb)",
            &[&order, &event, &data],
        )
        .await?;
    Ok(row.get(0))
}

fn check(what: &str, got: i64, wanted: i64) -> Result<()> {
    if got == wanted {
        Ok(())
    } else {
        Err(format!("{what}: {got}, expected {wanted}").into())
    }
}
