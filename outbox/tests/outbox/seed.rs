//! `shardline_outbox_seed`: an order with events published before the
//! outbox continues after them; a counter never moves back.

use tokio_postgres::error::SqlState;

use crate::helpers::{Outbox, client};

fn seed_sql(outbox: &Outbox) -> String {
    format!("SELECT {}.shardline_outbox_seed($1, $2)", outbox.quoted)
}

#[tokio::test]
async fn a_seeded_order_continues_at_the_seq_asked() {
    let outbox = Outbox::new("seed").await;
    let client = client().await;
    // Seqs 1 to 5 were published before the outbox.
    let next: i64 = client
        .query_one(&seed_sql(&outbox), &[&"P-1", &6_i64])
        .await
        .unwrap()
        .get(0);
    assert_eq!(next, 6);
    assert_eq!(outbox.append(&client, "P-1", "order.shipped").await, 6);
    assert_eq!(outbox.append(&client, "P-1", "order.delivered").await, 7);
    // Asking for the seq that comes next anyway changes nothing.
    let same: i64 = client
        .query_one(&seed_sql(&outbox), &[&"P-1", &8_i64])
        .await
        .unwrap()
        .get(0);
    assert_eq!(same, 8);
    assert_eq!(outbox.append(&client, "P-1", "order.returned").await, 8);
    // Seeding 1 for a new order is what its first append does anyway.
    client
        .query_one(&seed_sql(&outbox), &[&"P-2", &1_i64])
        .await
        .unwrap();
    assert_eq!(outbox.append(&client, "P-2", "order.created").await, 1);
}

#[tokio::test]
async fn a_counter_is_never_moved_back() {
    let outbox = Outbox::new("backwards").await;
    let client = client().await;
    for _ in 0..3 {
        outbox.append(&client, "Q-1", "order.updated").await;
    }
    let e = client
        .query_one(&seed_sql(&outbox), &[&"Q-1", &2_i64])
        .await
        .unwrap_err();
    let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
    assert_eq!(db.code(), &SqlState::INVALID_PARAMETER_VALUE);
    assert_eq!(
        db.message(),
        "shardline_outbox_seed: order Q-1 has had seq 3 given already; its next seq is 4, not 2"
    );
    assert!(db.hint().is_some_and(|h| h.contains("never moves back")));
    assert_eq!(outbox.append(&client, "Q-1", "order.updated").await, 4);
    for (order, next, says) in [
        (
            "Q-2",
            0_i64,
            "shardline_outbox_seed: next_seq must be 1 or more, not 0",
        ),
        ("", 5, "shardline_outbox_seed: order_id is empty"),
    ] {
        let e = client
            .query_one(&seed_sql(&outbox), &[&order, &next])
            .await
            .unwrap_err();
        assert_eq!(e.as_db_error().map(|db| db.message()), Some(says));
    }
}
