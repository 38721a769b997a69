//! A private PostgreSQL 15 (`shardline_testkit::PrivatePostgres`): the
//! outbox installed there survives a clean stop and a start.

use shardline_outbox::{DatabaseUrl, install};
use shardline_testkit::PrivatePostgres;

#[tokio::test]
async fn the_outbox_survives_a_restart_of_a_private_server() {
    let mut pg = PrivatePostgres::start().await;
    let url = DatabaseUrl::parse(&pg.url()).unwrap();
    let mut client = url.connect().await.unwrap();
    let version: String = client
        .query_one("SELECT current_setting('server_version_num')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(version.starts_with("15"), "{version}");
    let installed = install(&mut client, "shop").await.unwrap();
    assert!(!installed.already_installed());
    let append = "SELECT shop.shardline_outbox_append('A-1', 'order.created', '{}')";
    let seq: i64 = client.query_one(append, &[]).await.unwrap().get(0);
    assert_eq!(seq, 1);
    pg.stop().await;
    assert!(
        client.query_one("SELECT 1", &[]).await.is_err(),
        "the server is down"
    );
    pg.start_again().await;
    let mut client = url.connect().await.unwrap();
    let again = install(&mut client, "shop").await.unwrap();
    assert!(again.already_installed(), "{again:?}");
    let seq: i64 = client.query_one(append, &[]).await.unwrap().get(0);
    assert_eq!(seq, 2, "the counter survived the restart");
}
