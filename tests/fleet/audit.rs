//! The audit log in the shared Redis: entries read back newest first, at most
//! `audit::CAP` of them kept, one log per key prefix, an entry that does not
//! parse read as `unreadable` without hiding the others.

use serde_json::json;
use shardline_contract::Keys;
use shardline_ops::Fleet;
use shardline_ops::audit::{self, AuditEntry, CAP, UNREADABLE};
use shardline_testkit::TestEnv;

async fn len(env: &TestEnv, fleet: &Fleet) -> usize {
    redis::cmd("LLEN")
        .arg(fleet.keys.audit())
        .query_async(&mut env.redis().await)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_log_keeps_the_newest_actions_first_capped_per_prefix() {
    let env = TestEnv::new("audit").await;
    let fleet = env.ops_fleet();
    // Another fleet on the same Redis, under a prefix of its own (inside the
    // environment's, so that its keys go with it).
    let other = Fleet {
        keys: Keys::new(&format!("{}other:", env.redis_prefix)),
        ..fleet.clone()
    };
    assert!(audit::recent(&fleet, 10).await.unwrap().is_empty());

    let replay = AuditEntry::now(
        "ops",
        "replay",
        json!({ "group": "0a1b2c3d4e5f", "letters": 3, "rate": 5.0 }),
    );
    let release = AuditEntry::now("oncall", "release", json!({ "order_id": "A1024" }));
    audit::record(&fleet, &replay).await.unwrap();
    audit::record(&fleet, &release).await.unwrap();
    assert_eq!(
        audit::recent(&fleet, 10).await.unwrap(),
        [release.clone(), replay.clone()]
    );
    assert_eq!(
        audit::recent(&fleet, 1).await.unwrap(),
        std::slice::from_ref(&release)
    );
    assert!(audit::recent(&fleet, 0).await.unwrap().is_empty());

    // One log per prefix.
    assert!(audit::recent(&other, 10).await.unwrap().is_empty());
    let purge = AuditEntry::now("ops", "purge", json!({ "ids": ["d-1", "d-2"] }));
    audit::record(&other, &purge).await.unwrap();
    assert_eq!(audit::recent(&other, 10).await.unwrap(), [purge]);
    assert_eq!(audit::recent(&fleet, 10).await.unwrap().len(), 2);

    // An entry that does not parse is read as such; the others still are.
    redis::cmd("LPUSH")
        .arg(fleet.keys.audit())
        .arg("not json")
        .query_async::<()>(&mut env.redis().await)
        .await
        .unwrap();
    let read = audit::recent(&fleet, 10).await.unwrap();
    assert_eq!(read.len(), 3, "{read:?}");
    assert_eq!(read[0].action, UNREADABLE, "{read:?}");
    assert_eq!(read[0].detail["text"], "not json", "{read:?}");
    assert_eq!(read[1..], [release, replay]);

    // The cap: the log keeps the CAP newest entries.
    for i in 0..CAP {
        let entry = AuditEntry {
            at_ms: i as u64,
            ..AuditEntry::now("bulk", "purge", json!({ "i": i }))
        };
        audit::record(&fleet, &entry).await.unwrap();
    }
    assert_eq!(len(&env, &fleet).await, CAP);
    let all = audit::recent(&fleet, CAP + 10).await.unwrap();
    assert_eq!(all.len(), CAP);
    assert_eq!(all[0].detail["i"], CAP - 1);
    assert_eq!(
        all[CAP - 1].detail["i"],
        0,
        "the earlier entries went first"
    );
    assert!(all.windows(2).all(|w| w[0].at_ms > w[1].at_ms));
    audit::record(
        &fleet,
        &AuditEntry::now("bulk", "purge", json!({ "i": CAP })),
    )
    .await
    .unwrap();
    let all = audit::recent(&fleet, CAP).await.unwrap();
    assert_eq!((all.len(), len(&env, &fleet).await), (CAP, CAP));
    assert_eq!(all[0].detail["i"], CAP);
    assert_eq!(all[CAP - 1].detail["i"], 1);
    assert_eq!(audit::recent(&other, 10).await.unwrap().len(), 1);
}
