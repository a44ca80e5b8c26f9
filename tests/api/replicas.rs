//! Scale-out: two service processes on one Postgres take interleaved
//! appends for the same users, and share the retention work without ever
//! running it at the same time; a page that one keeps from its reads
//! follows every kind of write that the other makes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chat_history::domain::{NewMessage, Tenant, Timestamp, UserId};
use serde_json::{json, Value};

use crate::support::{Backend, Replica, TestDb};

const EXPIRED_USERS: usize = 100;
const EXPIRED_PER_USER: usize = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_postgres() {
    let db = TestDb::new(Backend::Postgres).await;
    let store = db.store().await;
    // Expired history, enough that a retention run takes a while.
    let old = Timestamp::now().minus_seconds(2 * 3600);
    let batch: Vec<NewMessage> = (0..EXPIRED_PER_USER)
        .map(|i| {
            NewMessage::from_value(json!({"role": "user", "content": format!("old {i}")}), "m")
                .unwrap()
        })
        .collect();
    for user in 0..EXPIRED_USERS {
        store
            .append_messages(
                &Tenant::default_tenant(),
                &UserId::parse(format!("old-{user}")).unwrap(),
                &batch,
                old,
                None,
                None,
            )
            .await
            .unwrap();
    }

    let replicas = Arc::new([Replica::start(&db.url), Replica::start(&db.url)]);

    // Eight writers, each alternating between the replicas, on four shared users.
    let mut writers = Vec::new();
    for writer in 0..8 {
        let replicas = replicas.clone();
        writers.push(tokio::task::spawn_blocking(move || {
            let mut acknowledged = Vec::new();
            for round in 0..40 {
                let user = format!("shared-{}", (writer + round) % 4);
                let content = format!("w{writer} r{round}");
                let body = json!({"messages": [{"role": "user", "content": content}]});
                let (status, reply) = replicas[round % 2].http(
                    "POST",
                    &format!("/v1/users/{user}/messages"),
                    Some(&body),
                );
                assert_eq!(status, 201, "{reply}");
                let seq = serde_json::from_str::<Value>(&reply).unwrap()["messages"][0]["seq"]
                    .as_i64()
                    .unwrap();
                acknowledged.push((user, seq, content));
            }
            acknowledged
        }));
    }
    let mut acknowledged: HashMap<String, Vec<(i64, String)>> = HashMap::new();
    for writer in writers {
        for (user, seq, content) in writer.await.unwrap() {
            acknowledged.entry(user).or_default().push((seq, content));
        }
    }
    for (user, mut written) in acknowledged {
        written.sort();
        let (status, page) = replicas[1].http(
            "GET",
            &format!("/v1/users/{user}/messages?after=0&limit=1000"),
            None,
        );
        assert_eq!(status, 200);
        let stored: Vec<(i64, String)> = serde_json::from_str::<Value>(&page).unwrap()["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["seq"].as_i64().unwrap(),
                    m["message"]["content"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            stored, written,
            "{user}: every acknowledged message once, in seq order"
        );
        assert!(stored.windows(2).all(|w| w[0].0 < w[1].0));
    }

    // Retention: wait until the expired messages are gone.
    let expired = (EXPIRED_USERS * EXPIRED_PER_USER) as f64;
    let deadline = Instant::now() + Duration::from_secs(60);
    let purged = loop {
        let purged: f64 = replicas
            .iter()
            .map(|r| r.metric("chat_history_messages_purged_total"))
            .sum();
        if purged >= expired {
            break purged;
        }
        assert!(
            Instant::now() < deadline,
            "retention did not finish: {purged} of {expired}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(
        purged, expired,
        "each expired message purged once, by one replica"
    );
    let skipped: f64 = replicas
        .iter()
        .map(|r| r.metric("chat_history_cleanup_runs_total{outcome=\"skipped\"}"))
        .sum();
    assert!(
        skipped >= 1.0,
        "a replica found the retention lock taken at least once"
    );
    let (first, second) = (replicas[0].retention_runs(), replicas[1].retention_runs());
    assert!(!first.is_empty() || !second.is_empty());
    for a in &first {
        for b in &second {
            assert!(
                a.1 <= b.0 || b.1 <= a.0,
                "retention ran on both replicas at once: {a:?} and {b:?}"
            );
        }
    }
}

/// Replica `a` reads one user's newest page (as many times as a client
/// would, so that it keeps it and answers from it) while replica `b` makes
/// every kind of write to that user: each read on `a` shows each write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_page_follows_every_write_made_elsewhere() {
    let db = TestDb::new(Backend::Postgres).await;
    let (a, b) = (Replica::start(&db.url), Replica::start(&db.url));
    let path = "/v1/users/kept/messages";
    // Contents of the user's messages, oldest first, and their seqs.
    let mut expected: Vec<(i64, String)> = Vec::new();
    let append = |expected: &mut Vec<(i64, String)>, contents: Vec<String>| {
        let messages: Vec<Value> = contents
            .iter()
            .map(|c| json!({"role": "user", "content": c}))
            .collect();
        let (status, reply) = b.http("POST", path, Some(&json!({ "messages": messages })));
        assert_eq!(status, 201, "{reply}");
        let reply: Value = serde_json::from_str(&reply).unwrap();
        for (stored, content) in reply["messages"].as_array().unwrap().iter().zip(contents) {
            expected.push((stored["seq"].as_i64().unwrap(), content));
        }
    };
    let page = |query: &str| -> Vec<(i64, String)> {
        let (status, reply) = a.http("GET", &format!("{path}?{query}"), None);
        assert_eq!(status, 200, "{reply}");
        let reply: Value = serde_json::from_str(&reply).unwrap();
        reply["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let content = m["message"]["content"].as_str().unwrap().to_string();
                (m["seq"].as_i64().unwrap(), content)
            })
            .collect()
    };
    let newest = |expected: &[(i64, String)], n: usize| {
        expected[expected.len().saturating_sub(n)..].to_vec()
    };
    // Reads the newest page twice (the second from what `a` kept) and
    // checks both against what was written.
    let check = |expected: &[(i64, String)], step: &str| {
        for _ in 0..2 {
            assert_eq!(page("limit=20"), newest(expected, 20), "after {step}");
        }
    };

    append(&mut expected, (0..30).map(|i| format!("m{i}")).collect());
    check(&expected, "the first append");
    let hits = a.metric("chat_history_read_cache_total{outcome=\"hit\"}");
    assert!(
        hits >= 1.0,
        "a second read of an unchanged page was read again: {hits} hits"
    );
    // Smaller pages and pages further back, from the page kept.
    assert_eq!(page("limit=5"), newest(&expected, 5));
    let cursor = expected[25].0;
    assert_eq!(
        page(&format!("limit=5&before={cursor}")),
        expected[20..25].to_vec()
    );
    assert!(a.metric("chat_history_read_cache_total{outcome=\"hit\"}") >= hits + 2.0);

    append(&mut expected, vec!["one more".into()]);
    check(&expected, "an append");

    // An append through `a` itself, read back there: the page it keeps
    // follows the append, and the read needs no messages from Postgres.
    let (status, reply) = a.http(
        "POST",
        path,
        Some(&json!({"messages": [{"role": "user", "content": "through a"}]})),
    );
    assert_eq!(status, 201, "{reply}");
    let seq = serde_json::from_str::<Value>(&reply).unwrap()["messages"][0]["seq"]
        .as_i64()
        .unwrap();
    expected.push((seq, "through a".into()));
    let hits = a.metric("chat_history_read_cache_total{outcome=\"hit\"}");
    assert_eq!(page("limit=20"), newest(&expected, 20));
    assert_eq!(
        a.metric("chat_history_read_cache_total{outcome=\"hit\"}"),
        hits + 1.0,
        "the page kept did not follow an append through the same replica"
    );
    append(&mut expected, vec!["then b".into()]);
    check(&expected, "an append through b after one through a");

    let (last, _) = expected.pop().unwrap();
    let (status, reply) = b.http("DELETE", &format!("{path}/{last}"), None);
    assert_eq!(status, 200, "{reply}");
    check(&expected, "deleting the newest message");

    let (middle, _) = expected.remove(expected.len() - 3);
    let (status, reply) = b.http("DELETE", &format!("{path}/{middle}"), None);
    assert_eq!(status, 200, "{reply}");
    check(&expected, "deleting a message inside the page");

    // The transcript saved with its last message changed: that one is
    // replaced, the rest kept.
    let mut transcript: Vec<Value> = expected
        .iter()
        .map(|(_, c)| json!({"role": "user", "content": c}))
        .collect();
    *transcript.last_mut().unwrap() = json!({"role": "user", "content": "rewritten"});
    let (status, reply) = b.http(
        "PUT",
        "/v1/users/kept/transcript",
        Some(&json!({ "messages": transcript })),
    );
    assert_eq!(status, 200, "{reply}");
    expected.pop();
    let (status, stats) = b.http("GET", "/v1/users/kept", None);
    assert_eq!(status, 200, "{stats}");
    let last_seq = serde_json::from_str::<Value>(&stats).unwrap()["last_seq"]
        .as_i64()
        .unwrap();
    expected.push((last_seq, "rewritten".into()));
    check(&expected, "saving the transcript");

    let (status, reply) = b.http("DELETE", "/v1/users/kept", None);
    assert_eq!(status, 200, "{reply}");
    expected.clear();
    check(&expected, "clearing the user");

    append(
        &mut expected,
        (0..3).map(|i| format!("again {i}")).collect(),
    );
    check(&expected, "appending after the clear");

    // Purging what is older than a second.
    std::thread::sleep(Duration::from_millis(1100));
    let (status, reply) = b.http(
        "POST",
        "/v1/admin/purge-expired",
        Some(&json!({"max_age": 1})),
    );
    assert_eq!(status, 200, "{reply}");
    expected.clear();
    check(&expected, "purging expired messages");

    append(&mut expected, vec!["last".into()]);
    check(&expected, "an append after the purge");
}

/// Appends through one replica that share commits (each user's versions in
/// between never reach the database), with reads of the same users in
/// between: every page read matches the history read forwards, which
/// nothing keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_pages_follow_shared_commits_through_their_replica() {
    let db = TestDb::new(Backend::Postgres).await;
    let a = Arc::new(Replica::start(&db.url));
    let mut callers = Vec::new();
    for caller in 0..8 {
        let a = a.clone();
        callers.push(tokio::task::spawn_blocking(move || {
            for round in 0..30 {
                let user = format!("busy-{}", round % 3);
                let body = json!({"messages": [{"role": "user", "content": format!("c{caller} r{round}")}]});
                let (status, reply) = a.http("POST", &format!("/v1/users/{user}/messages"), Some(&body));
                assert_eq!(status, 201, "{reply}");
                let (status, reply) =
                    a.http("GET", &format!("/v1/users/{user}/messages?limit=20"), None);
                assert_eq!(status, 200, "{reply}");
            }
        }));
    }
    for caller in callers {
        caller.await.unwrap();
    }
    let hits = a.metric("chat_history_read_cache_total{outcome=\"hit\"}");
    for user in ["busy-0", "busy-1", "busy-2"] {
        let (_, all) = a.http(
            "GET",
            &format!("/v1/users/{user}/messages?after=0&limit=1000"),
            None,
        );
        let all: Value = serde_json::from_str(&all).unwrap();
        let all = all["messages"].as_array().unwrap();
        assert_eq!(all.len(), 80);
        for _ in 0..2 {
            let (_, page) = a.http("GET", &format!("/v1/users/{user}/messages?limit=20"), None);
            let page: Value = serde_json::from_str(&page).unwrap();
            assert_eq!(
                page["messages"].as_array().unwrap(),
                &all[60..].to_vec(),
                "{user}"
            );
            assert_eq!(page["has_more"], true);
        }
    }
    assert!(
        a.metric("chat_history_read_cache_total{outcome=\"hit\"}") >= hits + 3.0,
        "the second read of each user was not answered from its kept page"
    );
}

/// Connections to Postgres that end under a replica that keeps pages: the
/// reads after them are answered rightly, through new connections, and
/// what is written meanwhile elsewhere shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_pages_stay_right_when_connections_to_postgres_end() {
    use sqlx::Connection;
    let db = TestDb::new(Backend::Postgres).await;
    let (a, b) = (Replica::start(&db.url), Replica::start(&db.url));
    let path = "/v1/users/reconnected/messages";
    let body = json!({"messages": [{"role": "user", "content": "kept"}]});
    assert_eq!(a.http("POST", path, Some(&body)).0, 201);
    for _ in 0..2 {
        assert_eq!(a.http("GET", &format!("{path}?limit=20"), None).0, 200);
    }
    assert!(a.metric("chat_history_read_cache_total{outcome=\"hit\"}") >= 1.0);

    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let ended: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = 'chat-history'
         AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    assert!(!ended.is_empty());
    // Each replica's first request may meet a connection that ended (503),
    // and behind PgBouncer the pool may wait before it connects again.
    let deadline = Instant::now() + Duration::from_secs(60);
    let until_ok = |replica: &Replica, method: &str, path: &str, body: Option<&Value>, ok: u16| loop {
        let (status, reply) = replica.http(method, path, body);
        if status == ok {
            break reply;
        }
        assert_eq!(status, 503, "{reply}");
        assert!(
            Instant::now() < deadline,
            "no answer after the connections ended"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // Written meanwhile through the other replica.
    let body = json!({"messages": [{"role": "user", "content": "meanwhile"}]});
    until_ok(&b, "POST", path, Some(&body), 201);
    let page = until_ok(&a, "GET", &format!("{path}?limit=20"), None, 200);
    let page: Value = serde_json::from_str(&page).unwrap();
    let contents: Vec<&str> = page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["kept", "meanwhile"]);
}
