//! Appends racing each other, and a reader paging forward while they run.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use crate::on_both_backends;
use crate::support::{Backend, TestApp};

on_both_backends!(
    concurrent_appends_to_one_user_all_land_once,
    forward_reader_never_misses_a_committed_message,
);

fn seqs(body: &Value) -> Vec<i64> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["seq"].as_i64().unwrap())
        .collect()
}

async fn concurrent_appends_to_one_user_all_land_once(backend: Backend) {
    let app = Arc::new(TestApp::new(backend).await);
    let mut writers = JoinSet::new();
    for writer in 0..64 {
        let app = app.clone();
        writers.spawn(async move {
            let reply = app
                .post_json(
                    "/v1/users/shared/messages",
                    &json!({"messages": [
                        {"role": "user", "content": format!("w{writer}-a")},
                        {"role": "assistant", "content": format!("w{writer}-b")},
                    ]}),
                )
                .await;
            assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
            seqs(&reply.body)
        });
    }
    let mut all = Vec::new();
    while let Some(batch) = writers.join_next().await {
        let batch = batch.unwrap();
        assert_eq!(batch[1], batch[0] + 1, "a batch gets consecutive seqs");
        all.extend(batch);
    }
    all.sort_unstable();
    assert_eq!(all, (1..=128).collect::<Vec<i64>>());
    let read = app.get("/v1/users/shared/messages?limit=1000").await;
    let messages = read.body["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 128);
    let contents: HashSet<&str> = messages
        .iter()
        .map(|m| m["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents.len(), 128, "every message present exactly once");
    for pair in messages.windows(2) {
        assert!(pair[0]["seq"].as_i64() < pair[1]["seq"].as_i64());
        assert!(pair[0]["created_at"].as_str() <= pair[1]["created_at"].as_str());
        // Each writer's two messages stay adjacent and in order.
        let first = pair[0]["message"]["content"].as_str().unwrap();
        let second = pair[1]["message"]["content"].as_str().unwrap();
        if first.ends_with("-a") {
            assert_eq!(second, first.replace("-a", "-b"));
        }
    }
    let stats = app.get("/v1/users/shared").await;
    assert_eq!(stats.body["message_count"], 128);
    assert_eq!(stats.body["version"], 64);
}

async fn forward_reader_never_misses_a_committed_message(backend: Backend) {
    let app = Arc::new(TestApp::new(backend).await);
    let mut writers = JoinSet::new();
    for writer in 0..8 {
        let app = app.clone();
        writers.spawn(async move {
            let mut acknowledged = Vec::new();
            for round in 0..25 {
                let size = 1 + (writer + round) % 3;
                let batch: Vec<Value> = (0..size)
                    .map(|i| json!({"role": "user", "content": format!("{writer}/{round}/{i}")}))
                    .collect();
                let reply = app
                    .post_json("/v1/users/tail/messages", &json!({"messages": batch}))
                    .await;
                assert_eq!(reply.status, StatusCode::CREATED);
                acknowledged.extend(seqs(&reply.body));
            }
            acknowledged
        });
    }
    let writers_done = Arc::new(AtomicBool::new(false));
    let reader = {
        let app = app.clone();
        let writers_done = writers_done.clone();
        tokio::spawn(async move {
            let mut seen: Vec<i64> = Vec::new();
            loop {
                // Read the flag before the page: once it is set, an empty
                // page means everything acknowledged has been seen.
                let done = writers_done.load(Ordering::SeqCst);
                let after = seen.last().copied().unwrap_or(0);
                let page = app
                    .get(&format!("/v1/users/tail/messages?after={after}&limit=7"))
                    .await;
                assert_eq!(page.status, StatusCode::OK);
                let got = seqs(&page.body);
                if got.is_empty() {
                    if done {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
                seen.extend(got);
            }
            seen
        })
    };
    let mut acknowledged = Vec::new();
    while let Some(batch) = writers.join_next().await {
        acknowledged.extend(batch.unwrap());
    }
    writers_done.store(true, Ordering::SeqCst);
    acknowledged.sort_unstable();
    let seen = reader.await.unwrap();
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "pages are in seq order"
    );
    assert_eq!(
        seen, acknowledged,
        "the reader saw every acknowledged message, once"
    );
    assert_eq!(
        acknowledged,
        (1..=acknowledged.len() as i64).collect::<Vec<_>>()
    );
}
