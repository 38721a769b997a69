//! `shardline_outbox_append`: seqs per order without gaps, writers of one
//! order serialised, nothing aborted, the row as the relay reads it.

use std::time::Duration;

use futures_util::StreamExt as _;
use shardline_testkit::{STARTUP, wait_until};
use tokio_postgres::AsyncMessage;
use tokio_postgres::error::SqlState;

use crate::helpers::{BLOCKED, Outbox, client, pid, waits_on_a_lock};

#[tokio::test]
async fn seqs_count_from_1_per_order_and_the_row_is_complete() {
    let outbox = Outbox::new("seqs").await;
    let client = client().await;
    assert_eq!(outbox.append(&client, "A-1", "order.created").await, 1);
    assert_eq!(outbox.append(&client, "A-1", "payment.captured").await, 2);
    assert_eq!(outbox.append(&client, "B-1", "order.created").await, 1);
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let seq: i64 = client
        .query_one(
            &format!(
                "SELECT {}.shardline_outbox_append('A-1', 'order.shipped', '{{\"carrier\": \"dhl\"}}', $1)",
                outbox.quoted
            ),
            &[&traceparent],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(seq, 3);
    let rows = client
        .query(
            &format!(
                "SELECT order_id, event, seq, data::text, traceparent, event_id::text,
                        written_at <= clock_timestamp()
                 FROM {}.shardline_outbox ORDER BY id",
                outbox.quoted
            ),
            &[],
        )
        .await
        .unwrap();
    let seen: Vec<(String, String, i64, String, Option<String>)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    assert_eq!(
        seen,
        [
            ("A-1".into(), "order.created".into(), 1, "{}".into(), None),
            (
                "A-1".into(),
                "payment.captured".into(),
                2,
                "{}".into(),
                None
            ),
            ("B-1".into(), "order.created".into(), 1, "{}".into(), None),
            (
                "A-1".into(),
                "order.shipped".into(),
                3,
                "{\"carrier\": \"dhl\"}".into(),
                Some(traceparent.into())
            ),
        ]
    );
    let mut event_ids: Vec<String> = rows.iter().map(|r| r.get(5)).collect();
    event_ids.sort();
    event_ids.dedup();
    assert_eq!(event_ids.len(), 4, "every row has an event id of its own");
    assert!(rows.iter().all(|r| r.get::<_, bool>(6)));
}

#[tokio::test]
async fn two_first_appends_of_a_new_order_both_commit() {
    let outbox = Outbox::new("first").await;
    let (a, b) = (client().await, client().await);
    a.batch_execute("BEGIN").await.unwrap();
    b.batch_execute("BEGIN").await.unwrap();
    // Both take the order's first seq at once: one inserts the counter, the
    // other waits for it and then updates it; neither transaction aborts.
    let (first, second) = tokio::join!(
        async {
            let seq = outbox.append(&a, "NEW-1", "order.created").await;
            tokio::time::sleep(BLOCKED).await;
            a.batch_execute("COMMIT").await.unwrap();
            seq
        },
        async {
            let seq = outbox.append(&b, "NEW-1", "order.created").await;
            b.batch_execute("COMMIT").await.unwrap();
            seq
        }
    );
    let mut seqs = [first, second];
    seqs.sort_unstable();
    assert_eq!(seqs, [1, 2]);
    let rows = outbox.rows(&a, "NEW-1").await;
    assert_eq!(
        rows.iter().map(|(seq, _)| *seq).collect::<Vec<_>>(),
        [1, 2],
        "both committed, in id order = seq order"
    );
}

#[tokio::test]
async fn a_rolled_back_append_leaves_no_gap() {
    let outbox = Outbox::new("rollback").await;
    let client = client().await;
    assert_eq!(outbox.append(&client, "R-1", "order.created").await, 1);
    client.batch_execute("BEGIN").await.unwrap();
    assert_eq!(outbox.append(&client, "R-1", "payment.captured").await, 2);
    client.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(outbox.append(&client, "R-1", "payment.failed").await, 2);
    assert_eq!(
        outbox.rows(&client, "R-1").await,
        [
            (1, "order.created".to_owned()),
            (2, "payment.failed".to_owned())
        ]
    );
}

#[tokio::test]
async fn one_orders_writers_wait_for_each_other_and_commit_in_seq_order() {
    let outbox = Outbox::new("serial").await;
    let (first, second, observer) = (client().await, client().await, client().await);
    assert_eq!(outbox.append(&observer, "S-1", "order.created").await, 1);
    let second_pid = pid(&second).await;
    first.batch_execute("BEGIN").await.unwrap();
    assert_eq!(outbox.append(&first, "S-1", "payment.captured").await, 2);
    // Another order is not held up by it.
    assert_eq!(outbox.append(&observer, "S-2", "order.created").await, 1);
    second.batch_execute("BEGIN").await.unwrap();
    let append = outbox.append_sql();
    let waiting = tokio::spawn(async move {
        let seq: i64 = second
            .query_one(&append, &[&"S-1", &"order.shipped", &"{}"])
            .await
            .unwrap()
            .get(0);
        second.batch_execute("COMMIT").await.unwrap();
        seq
    });
    wait_until(
        "the second writer's append to wait on the first's row lock",
        STARTUP,
        || waits_on_a_lock(&observer, second_pid),
    )
    .await;
    tokio::time::sleep(BLOCKED).await;
    assert!(
        !waiting.is_finished(),
        "the second append returned before the first committed"
    );
    first.batch_execute("COMMIT").await.unwrap();
    let seq = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the second append returns once the first committed")
        .unwrap();
    assert_eq!(seq, 3);
    assert_eq!(
        outbox.rows(&observer, "S-1").await,
        [
            (1, "order.created".to_owned()),
            (2, "payment.captured".to_owned()),
            (3, "order.shipped".to_owned())
        ]
    );
}

#[tokio::test]
async fn what_the_envelope_refuses_is_refused_at_the_append() {
    let outbox = Outbox::new("refused").await;
    let client = client().await;
    let long = "x".repeat(257);
    for (order, event, says) in [
        (
            "",
            "order.created",
            "shardline_outbox_append: order_id is empty",
        ),
        ("A-1", "", "shardline_outbox_append: event is empty"),
        (
            "A\u{1b}[31m",
            "order.created",
            "shardline_outbox_append: order_id contains a control character",
        ),
        (
            "A-1",
            "order\u{85}created",
            "shardline_outbox_append: event contains a control character",
        ),
        (
            long.as_str(),
            "order.created",
            "shardline_outbox_append: order_id is 257 bytes, over the 256-byte limit",
        ),
    ] {
        let e = client
            .query_one(&outbox.append_sql(), &[&order, &event, &"{}"])
            .await
            .unwrap_err();
        let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
        assert_eq!(
            db.code(),
            &SqlState::INVALID_PARAMETER_VALUE,
            "{order:?} {event:?}"
        );
        assert_eq!(db.message(), says);
    }
    // A NULL order id too, and nothing was counted or written.
    let e = client
        .query_one(
            &format!(
                "SELECT {}.shardline_outbox_append(NULL, 'order.created', '{{}}')",
                outbox.quoted
            ),
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(
        e.as_db_error().unwrap().message(),
        "shardline_outbox_append: order_id is empty"
    );
    let written: i64 = client
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM {0}.shardline_outbox)
                      + (SELECT count(*) FROM {0}.shardline_outbox_counter)",
                outbox.quoted
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(written, 0);
    // At the limit, with a non-ASCII character, it is taken.
    let at_limit = format!("{}é", "x".repeat(254));
    assert_eq!(outbox.append(&client, &at_limit, "order.created").await, 1);
}

#[tokio::test]
async fn the_append_notifies_at_commit_with_the_schema() {
    let outbox = Outbox::new("notify").await;
    let (listener, mut connection) =
        tokio_postgres::connect(shardline_testkit::pg::PG_URL, tokio_postgres::NoTls)
            .await
            .unwrap();
    let (sent, mut notifications) = tokio::sync::mpsc::unbounded_channel();
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    // Other tests append in schemas of their own, on the same channel.
    let schema = outbox.schema.as_str().to_owned();
    tokio::spawn(async move {
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(n) = message
                && n.payload() == schema
            {
                let _ = sent.send((n.channel().to_owned(), n.payload().to_owned()));
            }
        }
    });
    listener
        .batch_execute("LISTEN shardline_outbox")
        .await
        .unwrap();
    let writer = client().await;
    writer.batch_execute("BEGIN").await.unwrap();
    outbox.append(&writer, "N-1", "order.created").await;
    outbox.append(&writer, "N-2", "order.created").await;
    tokio::time::sleep(BLOCKED).await;
    assert!(
        notifications.try_recv().is_err(),
        "notified before the commit"
    );
    writer.batch_execute("COMMIT").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), notifications.recv())
        .await
        .expect("a notification after the commit")
        .unwrap();
    assert_eq!(
        got,
        (
            "shardline_outbox".to_owned(),
            outbox.schema.as_str().to_owned()
        )
    );
    tokio::time::sleep(BLOCKED).await;
    assert!(
        notifications.try_recv().is_err(),
        "one notification per transaction and schema"
    );
}
