//! Safe retries with `Idempotency-Key`, bulk deletion, the retention pass
//! and the per-user cap.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use chat_history::domain::{
    digest16, AppendOutcome, HistoryQuery, Idempotency, NewMessage, Tenant, Timestamp, UserId,
};
use chat_history::Limits;
use serde_json::{json, Value};

use crate::on_both_backends;
use crate::support::{request, Backend, Reply, TestApp};

on_both_backends!(
    a_retry_with_the_same_key_replays_and_stores_nothing,
    the_same_key_with_another_body_is_422,
    a_key_outside_its_documented_form_is_400,
    keys_are_scoped_to_the_user,
    bad_keys_are_400,
    concurrent_duplicates_store_once,
    purge_expired_deletes_only_what_is_older,
    purge_passes_gaps_and_stops_at_the_window,
    purge_runs_in_bounded_batches_across_many_users,
    admin_bodies_are_checked,
    clear_all_deletes_everything_and_keeps_seq_moving,
    retention_pass_purges_messages_and_old_keys,
    appends_past_the_cap_evict_the_oldest,
);

fn batch(tag: &str) -> Value {
    json!({"messages": [
        {"role": "user", "content": format!("{tag} question")},
        {"role": "assistant", "content": format!("{tag} answer")},
    ]})
}

async fn post_with_key(app: &TestApp, user: &str, key: &str, body: &Value) -> Reply {
    let mut req = request(
        Method::POST,
        &format!("/v1/users/{user}/messages"),
        Some(body.to_string()),
    );
    req.headers_mut()
        .insert("idempotency-key", key.parse().unwrap());
    app.send(req).await
}

fn old(values: &[&str]) -> Vec<NewMessage> {
    values
        .iter()
        .map(|c| NewMessage::from_value(json!({"role": "user", "content": c}), "m").unwrap())
        .collect()
}

async fn store_append(app: &TestApp, user: &str, contents: &[&str], at: Timestamp) {
    let outcome = app
        .store
        .append_messages(
            &Tenant::default_tenant(),
            &UserId::parse(user).unwrap(),
            &old(contents),
            at,
            None,
            None,
        )
        .await
        .unwrap();
    assert!(matches!(outcome, AppendOutcome::Stored(_)));
}

async fn a_retry_with_the_same_key_replays_and_stores_nothing(backend: Backend) {
    let app = TestApp::new(backend).await;
    let first = post_with_key(&app, "u", "key-1", &batch("a")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.headers.contains_key("idempotent-replayed"));
    // The same value, written differently, is the same body.
    let respelled: Value = serde_json::from_str(
        r#"{ "messages": [ {"content": "a question", "role": "user"},
                           {"content": "a answer", "role": "assistant"} ] }"#,
    )
    .unwrap();
    let retry = post_with_key(&app, "u", "key-1", &respelled).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.body, first.body, "the first response, same seqs");
    let stats = app.get("/v1/users/u").await;
    assert_eq!(stats.body["message_count"], 2);
    assert_eq!(stats.body["version"], 1);
    let next = post_with_key(&app, "u", "key-2", &batch("a")).await;
    assert_eq!(
        next.body["messages"][0]["seq"], 3,
        "a new key is a new append"
    );
}

async fn the_same_key_with_another_body_is_422(backend: Backend) {
    let app = TestApp::new(backend).await;
    post_with_key(&app, "u", "k", &batch("a")).await;
    let detail = post_with_key(&app, "u", "k", &batch("b"))
        .await
        .problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert!(detail.contains("Idempotency-Key"), "{detail}");
    assert_eq!(app.get("/v1/users/u").await.body["message_count"], 2);
}

async fn a_key_outside_its_documented_form_is_400(backend: Backend) {
    let app = TestApp::new(backend).await;
    for bad in ["with\ttab", &"k".repeat(256)] {
        let detail = post_with_key(&app, "u", bad, &batch("a"))
            .await
            .problem(StatusCode::BAD_REQUEST);
        assert!(detail.contains("Idempotency-Key"), "{detail}");
    }
    app.get("/v1/users/u").await.problem(StatusCode::NOT_FOUND);
    let spaced = post_with_key(&app, "u", "a key with spaces", &batch("a")).await;
    assert_eq!(spaced.status, StatusCode::CREATED, "{}", spaced.body);
}

async fn keys_are_scoped_to_the_user(backend: Backend) {
    let app = TestApp::new(backend).await;
    let a = post_with_key(&app, "alice", "k", &batch("a")).await;
    let b = post_with_key(&app, "bob", "k", &batch("b")).await;
    assert_eq!(b.status, StatusCode::CREATED);
    assert!(!b.headers.contains_key("idempotent-replayed"));
    assert_eq!(a.body["messages"][0]["seq"], 1);
    assert_eq!(b.body["messages"][0]["seq"], 1);
    assert_eq!(app.get("/v1/users/bob").await.body["message_count"], 2);
    // Replays survive a clear: the key still names the first request.
    app.delete("/v1/users/alice").await;
    let replay = post_with_key(&app, "alice", "k", &batch("a")).await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    app.get("/v1/users/alice")
        .await
        .problem(StatusCode::NOT_FOUND);
}

async fn bad_keys_are_400(backend: Backend) {
    let app = TestApp::new(backend).await;
    let longest = "k".repeat(255);
    assert_eq!(
        post_with_key(&app, "u", &longest, &batch("a")).await.status,
        StatusCode::CREATED
    );
    let detail = post_with_key(&app, "u", &"k".repeat(256), &batch("a"))
        .await
        .problem(StatusCode::BAD_REQUEST);
    assert!(detail.contains("255"), "{detail}");
    post_with_key(&app, "u", "", &batch("a"))
        .await
        .problem(StatusCode::BAD_REQUEST);
    assert_eq!(app.get("/v1/users/u").await.body["message_count"], 2);
}

async fn concurrent_duplicates_store_once(backend: Backend) {
    let app = Arc::new(TestApp::new(backend).await);
    for round in 0..3 {
        let key = format!("retry-storm-{round}");
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let app = app.clone();
            let key = key.clone();
            tasks.push(tokio::spawn(async move {
                post_with_key(&app, "u", &key, &batch(&format!("r{round}"))).await
            }));
        }
        let mut replies = Vec::new();
        for task in tasks {
            replies.push(task.await.unwrap());
        }
        assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
        assert!(
            replies.iter().all(|r| r.body == replies[0].body),
            "one answer for all"
        );
        let fresh = replies
            .iter()
            .filter(|r| !r.headers.contains_key("idempotent-replayed"))
            .count();
        assert_eq!(fresh, 1, "exactly one request stored the batch");
    }
    let stats = app.get("/v1/users/u").await;
    assert_eq!(stats.body["message_count"], 6);
    assert_eq!(stats.body["last_seq"], 6);
}

async fn purge_expired_deletes_only_what_is_older(backend: Backend) {
    let app = TestApp::new(backend).await;
    let now = Timestamp::now();
    store_append(&app, "u", &["ancient", "old"], now.minus_seconds(7200)).await;
    store_append(&app, "u", &["recent"], now.minus_seconds(60)).await;
    store_append(&app, "v", &["ancient"], now.minus_seconds(7200)).await;
    store_append(&app, "w", &["fresh"], now).await;
    let reply = app
        .post_json("/v1/admin/purge-expired", &json!({"max_age": 3600}))
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, json!({"deleted": 3}));
    let u = app.get("/v1/users/u").await;
    assert_eq!(u.body["message_count"], 1);
    assert_eq!(u.body["first_seq"], 3);
    assert_eq!(
        u.body["version"], 3,
        "a purge is a write to each user it touches"
    );
    app.get("/v1/users/v").await.problem(StatusCode::NOT_FOUND);
    assert_eq!(app.get("/v1/users/w").await.body["version"], 1);
    let again = app
        .post_json("/v1/admin/purge-expired", &json!({"max_age": 3600.0}))
        .await;
    assert_eq!(
        again.body,
        json!({"deleted": 0}),
        "3600.0 is the whole number 3600, as JSON Schema counts integers"
    );
    let users = app.get("/v1/users").await;
    assert_eq!(users.body["users"].as_array().unwrap().len(), 2);
}

/// Retention with no index on `created_at`: gaps left by deleted messages
/// do not stop it, and nothing from the first message that is not
/// expired on goes.
async fn purge_passes_gaps_and_stops_at_the_window(backend: Backend) {
    let app = TestApp::new(backend).await;
    let now = Timestamp::now();
    let old: Vec<String> = (0..6).map(|i| format!("old {i}")).collect();
    let old: Vec<&str> = old.iter().map(String::as_str).collect();
    store_append(&app, "u", &old[..3], now.minus_seconds(9000)).await; // 1..=3
    store_append(&app, "u", &old[3..], now.minus_seconds(7200)).await; // 4..=6
    store_append(&app, "u", &["recent", "newer"], now.minus_seconds(60)).await; // 7, 8
    for gone in [1, 3, 4, 7] {
        let reply = app.delete(&format!("/v1/users/u/messages/{gone}")).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    }
    let reply = app
        .post_json("/v1/admin/purge-expired", &json!({"max_age": 3600}))
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(
        reply.body,
        json!({"deleted": 3}),
        "seqs 2, 5 and 6 were left of the old"
    );
    let u = app.get("/v1/users/u").await;
    assert_eq!(u.body["message_count"], 1);
    assert_eq!(u.body["first_seq"], 8);
}

async fn purge_runs_in_bounded_batches_across_many_users(backend: Backend) {
    let app = TestApp::new(backend).await;
    let tenant = Tenant::default_tenant();
    let long_ago = Timestamp::now().minus_seconds(86_400);
    // More users than one batch locks, and one user with more rows than one batch deletes.
    for i in 0..150 {
        store_append(&app, &format!("user-{i:03}"), &["a", "b"], long_ago).await;
    }
    let big: Vec<String> = (0..2500).map(|i| format!("m{i}")).collect();
    let big: Vec<&str> = big.iter().map(String::as_str).collect();
    store_append(&app, "big", &big, long_ago).await;
    store_append(&app, "big", &["keep"], Timestamp::now()).await;
    let deleted = app
        .store
        .purge_expired(&tenant, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(deleted, 300 + 2500);
    let (users, _) = app.store.list_users(&tenant, None, 1000).await.unwrap();
    assert_eq!(users.len(), 1);
    assert_eq!(users[0].user_id.as_str(), "big");
    assert_eq!(users[0].message_count, 1);
    let page = app
        .store
        .history_window(
            &tenant,
            &UserId::parse("big").unwrap(),
            HistoryQuery {
                limit: 10,
                not_before: None,
                before: None,
                after: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(page.messages.len(), 1);
    assert_eq!(page.messages[0].seq, 2501);
}

async fn admin_bodies_are_checked(backend: Backend) {
    let app = TestApp::new(backend).await;
    app.append("u", json!([{"role": "user"}])).await;
    for bad in [
        json!({}),
        json!({"max_age": 0}),
        json!({"max_age": -1}),
        json!({"max_age": "3600"}),
        json!({"max_age": 1.5}),
        json!({"max_age": 0.0}),
        json!({"max_age": 9_223_372_036_854_775_808_u64}),
        json!({"max_age": 1e19}),
        json!([]),
    ] {
        app.post_json("/v1/admin/purge-expired", &bad)
            .await
            .problem(StatusCode::UNPROCESSABLE_ENTITY);
    }
    for bad in [
        json!({}),
        json!({"confirm": false}),
        json!({"confirm": "true"}),
        json!({"confirm": 1}),
    ] {
        let detail = app
            .post_json("/v1/admin/clear-all", &bad)
            .await
            .problem(StatusCode::BAD_REQUEST);
        assert!(detail.contains("confirm"), "{detail}");
    }
    app.send(request(
        Method::POST,
        "/v1/admin/clear-all",
        Some("{".into()),
    ))
    .await
    .problem(StatusCode::BAD_REQUEST);
    let no_type = axum::http::Request::builder()
        .method(Method::POST)
        .uri("/v1/admin/purge-expired")
        .body(axum::body::Body::from(r#"{"max_age": 5}"#))
        .unwrap();
    app.send(no_type)
        .await
        .problem(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    app.get("/v1/admin/clear-all")
        .await
        .problem(StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        app.get("/v1/users/u").await.body["message_count"],
        1,
        "nothing was deleted"
    );
}

async fn clear_all_deletes_everything_and_keeps_seq_moving(backend: Backend) {
    let app = TestApp::new(backend).await;
    for i in 0..120 {
        app.append(
            &format!("u{i}"),
            json!([{"role": "user"}, {"role": "assistant"}]),
        )
        .await;
    }
    let reply = app
        .post_json("/v1/admin/clear-all", &json!({"confirm": true}))
        .await;
    assert_eq!(reply.body, json!({"deleted": 240}));
    let users = app.get("/v1/users").await;
    assert_eq!(users.body["users"], json!([]));
    let after = app.append("u7", json!([{"role": "user"}])).await;
    assert_eq!(after["messages"][0]["seq"], 3, "seq is never reused");
    assert_eq!(after["version"], 3);
    let again = app
        .post_json("/v1/admin/clear-all", &json!({"confirm": true}))
        .await;
    assert_eq!(again.body, json!({"deleted": 1}));
}

async fn retention_pass_purges_messages_and_old_keys(backend: Backend) {
    let app = TestApp::new(backend).await;
    let now = Timestamp::now();
    let (a, b) = (Tenant::new("a"), Tenant::new("b"));
    for tenant in [&a, &b] {
        app.store
            .append_messages(
                tenant,
                &UserId::parse("u").unwrap(),
                &old(&["old"]),
                now.minus_seconds(100),
                None,
                None,
            )
            .await
            .unwrap();
        app.store
            .append_messages(
                tenant,
                &UserId::parse("u").unwrap(),
                &old(&["new"]),
                now,
                None,
                None,
            )
            .await
            .unwrap();
    }
    let key = Idempotency::new("k", digest16(r#"{"x":1}"#)).unwrap();
    app.store
        .append_messages(
            &a,
            &UserId::parse("keyed").unwrap(),
            &old(&["k"]),
            now,
            None,
            Some(&key),
        )
        .await
        .unwrap();
    let report = app
        .store
        .retention_pass(Some(Duration::from_secs(50)), Duration::from_secs(1000))
        .await
        .unwrap()
        .expect("no other replica holds the retention lock");
    assert_eq!(report.messages, 2, "one old message in each tenant");
    assert_eq!(
        report.idempotency_keys, 0,
        "the key is younger than its cut-off"
    );
    // Cut-offs come from the database's clock: let the key grow older than one.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let report = app
        .store
        .retention_pass(None, Duration::from_secs(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.messages, 0, "retention off deletes no messages");
    assert_eq!(report.idempotency_keys, 1);
    // With the key forgotten, the same request is a new append.
    let again = app
        .store
        .append_messages(
            &a,
            &UserId::parse("keyed").unwrap(),
            &old(&["k"]),
            now,
            None,
            Some(&key),
        )
        .await
        .unwrap();
    assert!(matches!(again, AppendOutcome::Stored(_)));
}

async fn appends_past_the_cap_evict_the_oldest(backend: Backend) {
    let limits = Limits {
        max_messages_per_user: Some(3),
        ..Limits::default()
    };
    let app = TestApp::with_limits(backend, limits).await;
    app.append(
        "u",
        json!([{"role": "user", "content": "1"}, {"role": "user", "content": "2"}]),
    )
    .await;
    let reply = app
        .append(
            "u",
            json!([
                {"role": "user", "content": "3"},
                {"role": "user", "content": "4"},
                {"role": "user", "content": "5"},
                {"role": "user", "content": "6"},
            ]),
        )
        .await;
    assert_eq!(
        reply["messages"].as_array().unwrap().len(),
        4,
        "the reply lists all appended"
    );
    let page = app.get("/v1/users/u/messages").await;
    let contents: Vec<&str> = page.body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["4", "5", "6"]);
    let stats = app.get("/v1/users/u").await;
    assert_eq!(stats.body["message_count"], 3);
    assert_eq!(stats.body["first_seq"], 4);
}

/// With several replicas on one Postgres, the retention run takes a lease:
/// while another replica holds it, this one skips its turn; a lease left by
/// a replica that died is taken over once it expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_retention_runs_on_one_replica_at_a_time() {
    use sqlx::Connection;
    let app = TestApp::new(Backend::Postgres).await;
    let now = Timestamp::now();
    store_append(&app, "u", &["old"], now.minus_seconds(100)).await;
    let mut other_replica = sqlx::PgConnection::connect(&app.db_url()).await.unwrap();
    sqlx::query(
        "INSERT INTO chat_leases (name, holder, expires_at)
         VALUES ('retention', 'another replica', now() + interval '1 minute')",
    )
    .execute(&mut other_replica)
    .await
    .unwrap();
    let retention_pass = || {
        app.store
            .retention_pass(Some(Duration::from_secs(10)), Duration::from_secs(86_400))
    };
    assert_eq!(
        retention_pass().await.unwrap(),
        None,
        "another replica is running retention"
    );
    assert_eq!(app.get("/v1/users/u").await.body["message_count"], 1);
    // That replica died: its lease runs out.
    sqlx::query("UPDATE chat_leases SET expires_at = now() - interval '1 second'")
        .execute(&mut other_replica)
        .await
        .unwrap();
    let ran = retention_pass()
        .await
        .unwrap()
        .expect("an expired lease is taken over");
    assert_eq!(ran.messages, 1);
    // The lease was released after the run: another replica can take it.
    let leases: i64 = sqlx::query_scalar("SELECT count(*) FROM chat_leases")
        .fetch_one(&mut other_replica)
        .await
        .unwrap();
    assert_eq!(leases, 0);
}
