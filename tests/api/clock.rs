//! Retention trusts the database's clock: a replica whose own clock has
//! jumped two months ahead (libfaketime, from Debian's `faketime`, which
//! scripts/test installs) runs retention of 30 days against Postgres and
//! deletes only what the database's clock says has expired.

use std::time::{Duration, Instant};

use chat_history::domain::{NewMessage, Tenant, Timestamp, UserId};
use serde_json::{json, Value};

use crate::support::{Backend, Replica, TestDb};

const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_clock_jumps_ahead_deletes_nothing_unexpired() {
    assert!(
        std::path::Path::new(LIBFAKETIME).exists(),
        "this test needs {LIBFAKETIME}: install Debian's faketime (scripts/test does)"
    );
    let db = TestDb::new(Backend::Postgres).await;
    let store = db.store().await;
    let tenant = Tenant::default_tenant();
    let message = |text: &str| {
        [NewMessage::from_value(json!({"role": "user", "content": text}), "m").unwrap()]
    };
    let now = Timestamp::now();
    store
        .append_messages(
            &tenant,
            &UserId::parse("fresh").unwrap(),
            &message("a day old"),
            now.minus_seconds(86_400),
            None,
            None,
        )
        .await
        .unwrap();
    store
        .append_messages(
            &tenant,
            &UserId::parse("stale").unwrap(),
            &message("40 days old"),
            now.minus_seconds(40 * 86_400),
            None,
            None,
        )
        .await
        .unwrap();

    let replica = Replica::start_with(
        &db.url,
        &[
            ("LD_PRELOAD", LIBFAKETIME),
            ("FAKETIME", "+60d"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            ("CHAT_HISTORY_RETENTION", "30d"),
            ("CHAT_HISTORY_CLEANUP_INTERVAL", "1s"),
        ],
    );
    // The replica's clock really is two months ahead: what it stamps shows it.
    let (status, body) = replica.http(
        "POST",
        "/v1/users/skewed/messages",
        Some(&json!({"messages": [{"role": "user"}]})),
    );
    assert_eq!(status, 201, "{body}");
    let stamped: Value = serde_json::from_str(&body).unwrap();
    let stamped = chrono::DateTime::parse_from_rfc3339(
        stamped["messages"][0]["created_at"].as_str().unwrap(),
    )
    .unwrap();
    let ahead = stamped.timestamp() - chrono::Utc::now().timestamp();
    assert!(
        ahead > 59 * 86_400,
        "the replica's clock is not skewed ({ahead} s ahead)"
    );

    let deadline = Instant::now() + Duration::from_secs(30);
    while replica.metric("chat_history_cleanup_runs_total{outcome=\"ok\"}") < 1.0 {
        assert!(
            Instant::now() < deadline,
            "no retention run finished: {}",
            replica.logs.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(replica);
    let count = |user: &str| {
        let store = store.clone();
        let user = UserId::parse(user).unwrap();
        async move {
            store
                .user_stats(&Tenant::default_tenant(), &user)
                .await
                .unwrap()
                .map_or(0, |stats| stats.message_count)
        }
    };
    assert_eq!(
        count("stale").await,
        0,
        "what expired by the database's clock is gone"
    );
    assert_eq!(count("fresh").await, 1, "what had not expired is kept");
    assert_eq!(
        count("skewed").await,
        1,
        "even what the replica stamped in its future"
    );
}
