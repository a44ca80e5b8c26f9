//! Whole-transcript load and save: the common prefix is kept, `If-Match`
//! guards against lost updates, an empty list clears.

use std::sync::Arc;

use axum::http::{header, Method, StatusCode};
use chat_history::Limits;
use serde_json::{json, Value};

use crate::on_both_backends;
use crate::support::{request, Backend, Reply, TestApp};

on_both_backends!(
    put_then_get_round_trips_with_etag,
    saving_keeps_the_common_prefix_untouched,
    an_empty_list_clears_and_a_noop_keeps_the_version,
    stale_if_match_is_412_and_changes_nothing,
    concurrent_conditional_puts_one_wins,
    transcript_and_messages_are_one_history,
    transcript_saves_respect_the_cap,
    transcript_bodies_are_validated,
    saves_after_other_writes_compare_the_stored_messages,
    a_missing_transcript_still_names_its_version,
);

fn turns(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("turn {i}")}))
        .collect()
}

async fn put(app: &TestApp, user: &str, messages: &[Value], if_match: Option<&str>) -> Reply {
    let mut req = request(
        Method::PUT,
        &format!("/v1/users/{user}/transcript"),
        Some(json!({ "messages": messages }).to_string()),
    );
    if let Some(tag) = if_match {
        req.headers_mut()
            .insert(header::IF_MATCH, tag.parse().unwrap());
    }
    app.send(req).await
}

fn etag(reply: &Reply) -> String {
    reply.headers[header::ETAG].to_str().unwrap().to_string()
}

async fn put_then_get_round_trips_with_etag(backend: Backend) {
    let app = TestApp::new(backend).await;
    app.get("/v1/users/s/transcript")
        .await
        .problem(StatusCode::NOT_FOUND);
    let messages = vec![
        json!({"role": "system", "content": "be brief"}),
        json!({"role": "user", "content": [{"type": "text", "text": "hi"}], "n": 123456789012345678901234567890u128}),
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}),
    ];
    let saved = put(&app, "s", &messages, None).await;
    assert_eq!(saved.status, StatusCode::OK, "{}", saved.body);
    assert_eq!(
        saved.body,
        json!({"user_id": "s", "version": 1, "kept": 0, "appended": 3, "removed": 0})
    );
    assert_eq!(etag(&saved), "\"1\"");
    let loaded = app.get("/v1/users/s/transcript").await;
    assert_eq!(loaded.status, StatusCode::OK);
    assert_eq!(etag(&loaded), "\"1\"");
    assert_eq!(loaded.body["messages"], Value::Array(messages));
    assert_eq!(loaded.body["version"], 1);
    assert_eq!(loaded.body["user_id"], "s");
}

async fn saving_keeps_the_common_prefix_untouched(backend: Backend) {
    let app = TestApp::new(backend).await;
    let mut transcript = turns(1000);
    put(&app, "s", &transcript, None).await;
    let before = app.get("/v1/users/s/messages?limit=1000&after=0").await;
    transcript.extend(
        turns(2)
            .into_iter()
            .map(|m| json!({"role": m["role"], "content": "new"})),
    );
    let saved = put(&app, "s", &transcript, Some("\"1\"")).await;
    assert_eq!(
        saved.body,
        json!({"user_id": "s", "version": 2, "kept": 1000, "appended": 2, "removed": 0})
    );
    let after = app.get("/v1/users/s/messages?limit=1000&after=0").await;
    assert_eq!(
        before.body["messages"], after.body["messages"],
        "the prefix keeps its seq and created_at"
    );
    let tail = app.get("/v1/users/s/messages?limit=2").await;
    let seqs: Vec<i64> = tail.body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs, [1001, 1002]);
    // Change message 998 (index 997): everything from it is rewritten.
    transcript[997] = json!({"role": "user", "content": "edited"});
    let saved = put(&app, "s", &transcript, None).await;
    assert_eq!(
        saved.body,
        json!({"user_id": "s", "version": 3, "kept": 997, "appended": 5, "removed": 5})
    );
    let loaded = app.get("/v1/users/s/transcript").await;
    assert_eq!(loaded.body["messages"], Value::Array(transcript.clone()));
    let stats = app.get("/v1/users/s").await;
    assert_eq!(stats.body["message_count"], 1002);
    assert_eq!(
        stats.body["last_seq"], 1007,
        "new messages get new seqs, never reused ones"
    );
    // Equal values with keys in another order are the same message.
    let reordered: Vec<Value> = transcript
        .iter()
        .map(|m| {
            serde_json::from_str(&format!(
                r#"{{"content":{},"role":{}}}"#,
                m["content"], m["role"]
            ))
            .unwrap()
        })
        .collect();
    let saved = put(&app, "s", &reordered, None).await;
    assert_eq!(saved.body["kept"], 1002);
    assert_eq!(saved.body["version"], 3);
}

async fn an_empty_list_clears_and_a_noop_keeps_the_version(backend: Backend) {
    let app = TestApp::new(backend).await;
    put(&app, "s", &turns(3), None).await;
    let same = put(&app, "s", &turns(3), None).await;
    assert_eq!(
        same.body,
        json!({"user_id": "s", "version": 1, "kept": 3, "appended": 0, "removed": 0})
    );
    let shorter = put(&app, "s", &turns(2), None).await;
    assert_eq!(
        shorter.body,
        json!({"user_id": "s", "version": 2, "kept": 2, "appended": 0, "removed": 1})
    );
    let cleared = put(&app, "s", &[], None).await;
    assert_eq!(
        cleared.body,
        json!({"user_id": "s", "version": 3, "kept": 0, "appended": 0, "removed": 2})
    );
    app.get("/v1/users/s/transcript")
        .await
        .problem(StatusCode::NOT_FOUND);
    app.get("/v1/users/s").await.problem(StatusCode::NOT_FOUND);
    let empty_again = put(&app, "s", &[], None).await;
    assert_eq!(empty_again.body["version"], 3);
    // A user never written is at version 0.
    let fresh = put(&app, "fresh", &turns(1), Some("\"0\"")).await;
    assert_eq!(fresh.status, StatusCode::OK, "{}", fresh.body);
    assert_eq!(fresh.body["version"], 1);
}

async fn stale_if_match_is_412_and_changes_nothing(backend: Backend) {
    let app = TestApp::new(backend).await;
    put(&app, "s", &turns(2), None).await;
    app.append(
        "s",
        json!([{"role": "user", "content": "appended meanwhile"}]),
    )
    .await;
    for stale in ["\"1\"", "\"99\"", "1", "W/\"2\"", "garbage"] {
        let reply = put(&app, "s", &turns(5), Some(stale)).await;
        let detail = reply.problem(StatusCode::PRECONDITION_FAILED);
        assert!(detail.contains("\"2\""), "{detail}");
        assert_eq!(etag(&reply), "\"2\"");
    }
    let loaded = app.get("/v1/users/s/transcript").await;
    assert_eq!(loaded.body["messages"].as_array().unwrap().len(), 3);
    assert_eq!(loaded.body["version"], 2);
    let ok = put(&app, "s", &turns(5), Some("\"2\"")).await;
    assert_eq!(ok.status, StatusCode::OK);
    let star = put(&app, "s", &turns(1), Some("*")).await;
    assert_eq!(star.status, StatusCode::OK);
    put(&app, "nobody", &turns(1), Some("*"))
        .await
        .problem(StatusCode::PRECONDITION_FAILED);
    put(&app, "nobody", &turns(1), Some("\"1\""))
        .await
        .problem(StatusCode::PRECONDITION_FAILED);
    app.get("/v1/users/nobody/transcript")
        .await
        .problem(StatusCode::NOT_FOUND);
}

async fn concurrent_conditional_puts_one_wins(backend: Backend) {
    let app = Arc::new(TestApp::new(backend).await);
    put(&app, "s", &turns(10), None).await;
    for round in 0..5 {
        let version = app.get("/v1/users/s").await.body["version"]
            .as_i64()
            .unwrap();
        let tag = format!("\"{version}\"");
        let mut racers = Vec::new();
        for racer in 0..2 {
            let app = app.clone();
            let tag = tag.clone();
            racers.push(tokio::spawn(async move {
                let mut mine = turns(10);
                mine.push(
                    json!({"role": "user", "content": format!("round {round} racer {racer}")}),
                );
                put(&app, "s", &mine, Some(&tag)).await.status
            }));
        }
        let mut statuses = Vec::new();
        for racer in racers {
            statuses.push(racer.await.unwrap());
        }
        statuses.sort();
        assert_eq!(
            statuses,
            [StatusCode::OK, StatusCode::PRECONDITION_FAILED],
            "round {round}"
        );
        let after = app.get("/v1/users/s").await;
        assert_eq!(after.body["version"], version + 1);
        assert_eq!(after.body["message_count"], 11);
    }
}

async fn transcript_and_messages_are_one_history(backend: Backend) {
    let app = TestApp::new(backend).await;
    app.append("s", json!(turns(2))).await;
    let loaded = app.get("/v1/users/s/transcript").await;
    assert_eq!(loaded.body["messages"], json!(turns(2)));
    assert_eq!(loaded.body["version"], 1);
    app.delete("/v1/users/s/messages/1").await;
    let loaded = app.get("/v1/users/s/transcript").await;
    assert_eq!(loaded.body["messages"], json!(turns(2)[1..]));
    assert_eq!(loaded.body["version"], 2);
}

async fn transcript_saves_respect_the_cap(backend: Backend) {
    let limits = Limits {
        max_messages_per_user: Some(4),
        ..Limits::default()
    };
    let app = TestApp::with_limits(backend, limits).await;
    let saved = put(&app, "s", &turns(6), None).await;
    assert_eq!(saved.status, StatusCode::OK);
    assert_eq!(saved.body["appended"], 6);
    assert_eq!(saved.body["removed"], 2);
    let loaded = app.get("/v1/users/s/transcript").await;
    assert_eq!(loaded.body["messages"], json!(turns(6)[2..]));
    assert_eq!(app.get("/v1/users/s").await.body["message_count"], 4);
}

async fn transcript_bodies_are_validated(backend: Backend) {
    let app = TestApp::new(backend).await;
    put(&app, "s", &[json!({"content": "no role"})], None)
        .await
        .problem(StatusCode::UNPROCESSABLE_ENTITY);
    put(
        &app,
        "s",
        &[json!({"role": "user", "content": "nul \u{0}"})],
        None,
    )
    .await
    .problem(StatusCode::UNPROCESSABLE_ENTITY);
    let not_json = app
        .send(
            axum::http::Request::builder()
                .method(Method::PUT)
                .uri("/v1/users/s/transcript")
                .body(axum::body::Body::from("[]"))
                .unwrap(),
        )
        .await;
    not_json.problem(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    app.send(request(
        Method::PUT,
        "/v1/users/s/transcript",
        Some("{".into()),
    ))
    .await
    .problem(StatusCode::BAD_REQUEST);
    app.get("/v1/users/%01/transcript")
        .await
        .problem(StatusCode::BAD_REQUEST);
    app.get("/v1/users/s/transcript")
        .await
        .problem(StatusCode::NOT_FOUND);
}

/// A save that waits for the user's lock while another write commits must
/// compare against what that write left, not against its older snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_save_after_waiting_for_the_lock_sees_the_newer_transcript() {
    use sqlx::Connection;
    let app = Arc::new(TestApp::new(Backend::Postgres).await);
    // Built by an append, so the save cannot take the fast path for
    // transcripts it wrote itself, and must lock and compare.
    app.append("s", json!(turns(3))).await;
    let mut blocker = sqlx::PgConnection::connect(&app.db_url()).await.unwrap();
    let mut held = blocker.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM chat_users WHERE user_id = 's' FOR UPDATE")
        .execute(&mut *held)
        .await
        .unwrap();
    let saver = {
        let app = app.clone();
        tokio::spawn(async move { put(&app, "s", &turns(4), None).await })
    };
    // Let the save take its snapshot and wait for the lock.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // Meanwhile, as an append would: a 4th message that differs from turns(4)[3].
    sqlx::query(
        "INSERT INTO chat_messages (tenant, user_id, seq, created_at, message, digest)
         SELECT tenant, user_id, 4, last_created_at, '{\"role\":\"tool\"}', '\\x00000000000000000000000000000000'::bytea
         FROM chat_users WHERE user_id = 's'",
    )
    .execute(&mut *held)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE chat_users SET last_seq = 4, version = version + 1, message_count = 4 WHERE user_id = 's'",
    )
    .execute(&mut *held)
    .await
    .unwrap();
    held.commit().await.unwrap();
    let saved = saver.await.unwrap();
    assert_eq!(saved.status, StatusCode::OK, "{}", saved.body);
    assert_eq!(
        saved.body,
        json!({"user_id": "s", "version": 3, "kept": 3, "appended": 1, "removed": 1})
    );
    let loaded = app.get("/v1/users/s/transcript").await;
    assert_eq!(loaded.body["messages"], Value::Array(turns(4)));
    assert_eq!(app.get("/v1/users/s").await.body["message_count"], 4);
}

async fn saves_after_other_writes_compare_the_stored_messages(backend: Backend) {
    let app = TestApp::new(backend).await;
    put(&app, "s", &turns(3), None).await;
    // Pure extensions of what the last save stored.
    let grown = put(&app, "s", &turns(5), Some("\"1\"")).await;
    assert_eq!(
        grown.body,
        json!({"user_id": "s", "version": 2, "kept": 3, "appended": 2, "removed": 0})
    );
    assert_eq!(etag(&grown), "\"2\"");
    put(&app, "s", &turns(5), Some("\"1\""))
        .await
        .problem(StatusCode::PRECONDITION_FAILED);
    // Each other kind of write changes what is stored; the next save sees it.
    app.append("s", json!([{"role": "tool", "content": "appended"}]))
        .await;
    let after_append = put(&app, "s", &turns(6), None).await;
    assert_eq!(
        after_append.body,
        json!({"user_id": "s", "version": 4, "kept": 5, "appended": 1, "removed": 1})
    );
    app.delete("/v1/users/s/messages/2").await;
    let after_delete = put(&app, "s", &turns(6), None).await;
    assert_eq!(
        after_delete.body,
        json!({"user_id": "s", "version": 6, "kept": 1, "appended": 5, "removed": 4})
    );
    app.delete("/v1/users/s").await;
    let after_clear = put(&app, "s", &turns(2), None).await;
    assert_eq!(
        after_clear.body,
        json!({"user_id": "s", "version": 8, "kept": 0, "appended": 2, "removed": 0})
    );
    let loaded = app.get("/v1/users/s/transcript").await;
    assert_eq!(loaded.body["messages"], Value::Array(turns(2)));
    let stats = app.get("/v1/users/s").await;
    assert_eq!(stats.body["message_count"], 2);
    assert_eq!(stats.body["version"], 8);
}

/// The 404 of a transcript carries the user's version, so that a client can
/// create the transcript with `If-Match` and never overwrite one that another
/// client created after its load.
async fn a_missing_transcript_still_names_its_version(backend: Backend) {
    let app = TestApp::new(backend).await;
    let never = app.get("/v1/users/s/transcript").await;
    assert_eq!(etag(&never), "\"0\"");
    never.problem(StatusCode::NOT_FOUND);

    // Two clients load the missing transcript; the first save wins.
    let first = put(&app, "s", &turns(2), Some("\"0\"")).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    put(&app, "s", &turns(3), Some("\"0\""))
        .await
        .problem(StatusCode::PRECONDITION_FAILED);
    assert_eq!(
        app.get("/v1/users/s/transcript").await.body["messages"],
        Value::Array(turns(2))
    );

    // After a clear, the version goes on.
    assert_eq!(app.delete("/v1/users/s").await.status, StatusCode::OK);
    let cleared = app.get("/v1/users/s/transcript").await;
    assert_eq!(etag(&cleared), "\"2\"");
    cleared.problem(StatusCode::NOT_FOUND);
    let again = put(&app, "s", &turns(1), Some("\"2\"")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(etag(&again), "\"3\"");
}
