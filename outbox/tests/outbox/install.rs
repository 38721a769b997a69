//! `install`: idempotent, safe twice at once, refusing bad schema names.

use shardline_outbox::{OutboxError, Part, install, sql};
use shardline_testkit::ScratchSchema;

use crate::helpers::{Outbox, client};

#[tokio::test]
async fn installing_twice_creates_once_and_says_so() {
    let outbox = Outbox::new("twice").await;
    let first = &outbox.installed;
    assert_eq!(
        first.created,
        Part::ALL.to_vec(),
        "a new schema: everything"
    );
    assert!(first.present.is_empty());
    assert_eq!(
        first.to_string(),
        format!(
            "outbox installed in schema {} (table shardline_outbox, functions \
             shardline_outbox_append, shardline_outbox_seed)",
            outbox.quoted
        )
    );
    let mut client = client().await;
    let again = install(&mut client, outbox.schema.as_str()).await.unwrap();
    assert!(again.already_installed(), "{again:?}");
    assert_eq!(again.present, Part::ALL.to_vec());
    assert!(
        again.to_string().starts_with(&format!(
            "outbox already installed in schema {}",
            outbox.quoted
        )),
        "{again}"
    );
    // The rendered script is idempotent too, and the version is recorded once.
    client
        .batch_execute(&sql::sql(&outbox.schema))
        .await
        .unwrap();
    let versions: Vec<i32> = client
        .query(
            &format!(
                "SELECT version FROM {}.shardline_outbox_meta",
                outbox.quoted
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(versions, [shardline_outbox::VERSION]);
}

#[tokio::test]
async fn a_missing_part_is_created_and_the_rest_left_alone() {
    let outbox = Outbox::new("partial").await;
    let mut client = client().await;
    let seed = format!(
        "DROP FUNCTION {}.shardline_outbox_seed(text, bigint)",
        outbox.quoted
    );
    client.batch_execute(&seed).await.unwrap();
    let again = install(&mut client, outbox.schema.as_str()).await.unwrap();
    assert_eq!(again.created, [Part::Seed]);
    assert!(
        again
            .to_string()
            .ends_with("created function shardline_outbox_seed"),
        "{again}"
    );
}

#[tokio::test]
async fn two_installs_at_once_both_succeed_and_create_once() {
    let scratch = ScratchSchema::new("outbox_concurrent");
    let (mut a, mut b) = (client().await, client().await);
    let (first, second) = tokio::join!(
        install(&mut a, &scratch.name),
        install(&mut b, &scratch.name)
    );
    let (first, second) = (first.unwrap(), second.unwrap());
    let created: Vec<Part> = first
        .created
        .iter()
        .chain(&second.created)
        .copied()
        .collect();
    assert_eq!(created, Part::ALL.to_vec(), "{first:?}\n{second:?}");
    assert!(first.already_installed() || second.already_installed());
}

#[tokio::test]
async fn a_newer_outbox_is_left_alone() {
    let outbox = Outbox::new("newer").await;
    let mut client = client().await;
    client
        .batch_execute(&format!(
            "UPDATE {}.shardline_outbox_meta SET version = 99",
            outbox.quoted
        ))
        .await
        .unwrap();
    let e = install(&mut client, outbox.schema.as_str())
        .await
        .unwrap_err();
    assert!(matches!(e, OutboxError::Newer { found: 99, .. }), "{e:?}");
    assert!(e.to_string().contains("upgrade shardline"), "{e}");
}

#[tokio::test]
async fn an_invalid_schema_name_is_refused_before_anything_is_done() {
    let mut client = client().await;
    for name in [
        "Shop",
        "shop-eu",
        "x\"; DROP TABLE orders; --",
        "",
        "pg_outbox",
    ] {
        let e = install(&mut client, name).await.unwrap_err();
        assert!(
            matches!(e, OutboxError::InvalidSchema { .. }),
            "{name:?}: {e:?}"
        );
        assert!(e.is_usage());
        assert_eq!(e.field(), Some("schema"));
        let exists: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
                &[&name],
            )
            .await
            .unwrap()
            .get(0);
        assert!(!exists, "{name:?} was created");
    }
}
