//! Is re-saving a long transcript with a few new messages about as cheap as
//! appending them? For each backend, in one run: save a 1,000-message
//! transcript plus 2 new messages (after a save, as a transcript store does,
//! and after appends, when the stored messages must be compared), append 2
//! messages to a user with 1,000, and (for reference) clear and rewrite all
//! 1,002; at the store and through the HTTP router (which also parses the
//! 1,002-message body).
//!
//! cargo bench --bench transcript_save
//! BENCH_ROUNDS=20 BENCH_BACKENDS=postgres cargo bench --bench transcript_save

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use chat_history::domain::{Tenant, Timestamp, UserId};
use chat_history::store::Store;
use chat_history::{router, AppState, Limits};
use serde_json::{json, Value};
use tower::ServiceExt;

use common::{append, compare, micros, turns};

/// Messages in the stored transcript (`BENCH_LENGTH`, default 1,000).
fn length() -> usize {
    common::setting("BENCH_LENGTH", 1000)
}

#[tokio::main]
async fn main() {
    let rounds = common::setting("BENCH_ROUNDS", 100);
    for backend in common::backends() {
        let (store, cleanup) = common::open(&backend, "chat_history_bench_transcript").await;
        println!("\n{backend}: {rounds} rounds, a fresh user per round and candidate");
        println!("{:<60} {:>10} {:>8}", "median", "time", "÷ append");
        at_the_store(&*store, rounds).await;
        through_http(store.clone(), rounds).await;
        store.close().await;
        cleanup.await;
    }
}

async fn at_the_store(store: &dyn Store, rounds: usize) {
    let tenant = Tenant::default_tenant();
    let transcript = turns(length(), "t");
    let mut saved = transcript.clone();
    saved.extend(turns(2, "new"));
    let now = Timestamp::now();
    for round in 0..rounds {
        // As a transcript store keeps it: written by the previous save.
        let user = UserId::parse(format!("save-{round}")).unwrap();
        store
            .save_transcript(&tenant, &user, &transcript, None, now, None, usize::MAX)
            .await
            .unwrap();
        // Written by appends: the save must compare the stored messages.
        for role in ["appended", "append", "rewrite"] {
            append(store, &format!("{role}-{round}"), &transcript, now).await;
        }
    }
    let save = |prefix: &'static str| {
        let (saved, tenant) = (&saved, &tenant);
        move |round: usize| async move {
            let user = UserId::parse(format!("{prefix}-{round}")).unwrap();
            store
                .save_transcript(
                    tenant,
                    &user,
                    saved,
                    None,
                    Timestamp::now(),
                    None,
                    usize::MAX,
                )
                .await
                .unwrap();
        }
    };
    let (after_save, add) = compare(rounds, save("save"), |round| async move {
        append(
            store,
            &format!("append-{round}"),
            &turns(2, "new"),
            Timestamp::now(),
        )
        .await;
    })
    .await;
    let (after_appends, rewrite) = compare(rounds, save("appended"), |round| {
        let (saved, tenant) = (&saved, &tenant);
        async move {
            let user = format!("rewrite-{round}");
            store
                .clear_user(tenant, &UserId::parse(user.as_str()).unwrap())
                .await
                .unwrap();
            append(store, &user, saved, Timestamp::now()).await;
        }
    })
    .await;
    report("store: append 2 to a user with 1,000", add, add);
    report(
        "store: save 1,000 + 2 new, last written by a save",
        after_save,
        add,
    );
    report(
        "store: save 1,000 + 2 new, last written by appends",
        after_appends,
        add,
    );
    report(
        "store: clear and rewrite 1,002 (for reference)",
        rewrite,
        add,
    );
}

async fn through_http(store: std::sync::Arc<dyn Store>, rounds: usize) {
    let app = router(AppState::open(store.clone(), Limits::default()));
    let messages = |n: usize, tag: &str| -> Vec<Value> {
        (0..n)
            .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" },
                            "content": format!("{tag} message {i}: a sentence of ordinary length for a chat turn.")}))
            .collect()
    };
    let transcript = messages(length(), "t");
    let mut saved = transcript.clone();
    saved.extend(messages(2, "new"));
    let saved_body = json!({ "messages": saved }).to_string();
    let append_body = json!({ "messages": messages(2, "new") }).to_string();
    let seed = json!({ "messages": transcript }).to_string();
    for round in 0..rounds {
        // The transcript as its previous save left it, and as appends left it.
        let uri = format!("/v1/users/http-save-{round}/transcript");
        assert_eq!(send(&app, Method::PUT, &uri, &seed).await, StatusCode::OK);
        let uri = format!("/v1/users/http-append-{round}/messages");
        assert_eq!(
            send(&app, Method::POST, &uri, &seed).await,
            StatusCode::CREATED
        );
    }
    let (save, add) = compare(
        rounds,
        |round| {
            let (app, body) = (&app, &saved_body);
            async move {
                let status = send(
                    app,
                    Method::PUT,
                    &format!("/v1/users/http-save-{round}/transcript"),
                    body,
                )
                .await;
                assert_eq!(status, StatusCode::OK);
            }
        },
        |round| {
            let (app, body) = (&app, &append_body);
            async move {
                let status = send(
                    app,
                    Method::POST,
                    &format!("/v1/users/http-append-{round}/messages"),
                    body,
                )
                .await;
                assert_eq!(status, StatusCode::CREATED);
            }
        },
    )
    .await;
    report("http: POST 2 messages", add, add);
    report("http: PUT 1,002-message transcript (2 new)", save, add);
}

async fn send(app: &axum::Router, method: Method, uri: &str, body: &str) -> StatusCode {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

fn report(name: &str, time: Duration, append: Duration) {
    println!(
        "{name:<60} {:>8.0}µs {:>8.2}",
        micros(time),
        time.as_secs_f64() / append.as_secs_f64()
    );
}
