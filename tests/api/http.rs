//! Every endpoint and every error status, through the real router, on both
//! backends.

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use chat_history::Limits;
use serde_json::{json, Value};

use crate::on_both_backends;
use crate::support::{request, Backend, TestApp};

on_both_backends!(
    append_then_read_round_trips_verbatim,
    history_query_parameters,
    start_user_drops_a_leading_tool_result,
    stats_head_and_clear,
    single_message_get_and_delete,
    list_users_pages_by_user_id,
    user_ids_are_opaque_percent_decoded_keys,
    bad_user_ids_are_400,
    bad_query_parameters_are_400,
    bodies_are_checked_before_anything_is_stored,
    batch_limits_are_422,
    body_size_limit_is_413_and_inclusive,
    routing_errors_are_problems,
    health_readiness_and_openapi,
);

fn seqs(body: &Value) -> Vec<i64> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["seq"].as_i64().unwrap())
        .collect()
}

fn chat(n: usize) -> Value {
    Value::Array(
        (0..n)
            .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("m{i}")}))
            .collect(),
    )
}

async fn append_then_read_round_trips_verbatim(backend: Backend) {
    let app = TestApp::new(backend).await;
    let raw = r#"{"messages":[
        {"role":"user","content":"hi 👋","n":123456789012345678901234567890,"f":1.5e-300},
        {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
        {"role":"tool","tool_call_id":"c1","content":[{"type":"text","text":"ok"}],"metadata":{"k":[1,{"x":null}]}}
    ]}"#;
    let written: Value = serde_json::from_str(raw).unwrap();
    let reply = app
        .send(request(
            Method::POST,
            "/v1/users/alice/messages",
            Some(raw.into()),
        ))
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    assert_eq!(reply.body["user_id"], "alice");
    assert_eq!(reply.body["version"], 1);
    assert_eq!(seqs(&reply.body), [1, 2, 3]);
    for (stored, original) in reply.body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .zip(written["messages"].as_array().unwrap())
    {
        assert_eq!(&stored["message"], original);
        let at = stored["created_at"].as_str().unwrap();
        assert_eq!(at.len(), "2026-11-30T19:00:00.123456Z".len(), "{at}");
        assert!(at.ends_with('Z') && at.as_bytes()[19] == b'.', "{at}");
    }
    let read = app.get("/v1/users/alice/messages").await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(read.body["messages"], reply.body["messages"]);
    assert_eq!(read.body["has_more"], false);
    // The 30-digit integer survives as text, not only as a value.
    let raw_read = app
        .router
        .clone()
        .oneshot_text("/v1/users/alice/messages")
        .await;
    assert!(
        raw_read.contains("123456789012345678901234567890"),
        "{raw_read}"
    );
}

async fn history_query_parameters(backend: Backend) {
    let app = TestApp::new(backend).await;
    app.append("u", chat(10)).await;
    let page = app.get("/v1/users/u/messages?limit=3").await;
    assert_eq!(seqs(&page.body), [8, 9, 10]);
    assert_eq!(page.body["has_more"], true);
    let page = app.get("/v1/users/u/messages?limit=3&before=8").await;
    assert_eq!(seqs(&page.body), [5, 6, 7]);
    let page = app.get("/v1/users/u/messages?limit=3&after=0").await;
    assert_eq!(seqs(&page.body), [1, 2, 3]);
    assert_eq!(page.body["has_more"], true);
    let page = app.get("/v1/users/u/messages?after=8").await;
    assert_eq!(seqs(&page.body), [9, 10]);
    assert_eq!(page.body["has_more"], false);
    let page = app.get("/v1/users/u/messages?after=2&before=6").await;
    assert_eq!(seqs(&page.body), [3, 4, 5]);
    let page = app
        .get("/v1/users/u/messages?max_age=3600&limit=1000")
        .await;
    assert_eq!(seqs(&page.body).len(), 10);
    let page = app.get("/v1/users/nobody/messages").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(page.body["messages"], json!([]));
    assert_eq!(page.body["has_more"], false);
}

async fn start_user_drops_a_leading_tool_result(backend: Backend) {
    let app = TestApp::new(backend).await;
    app.append(
        "u",
        json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "assistant", "content": "18C in Paris"},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "you're welcome"},
        ]),
    )
    .await;
    let plain = app.get("/v1/users/u/messages?limit=4").await;
    assert_eq!(seqs(&plain.body), [3, 4, 5, 6]);
    let page = app.get("/v1/users/u/messages?limit=4&start=user").await;
    assert_eq!(seqs(&page.body), [5, 6]);
    assert_eq!(page.body["messages"][0]["message"]["role"], "user");
    assert_eq!(
        page.body["has_more"], true,
        "the dropped messages lie behind the page"
    );
    let none = app.get("/v1/users/u/messages?limit=1&start=user").await;
    assert_eq!(seqs(&none.body), Vec::<i64>::new());
    let bad = app.get("/v1/users/u/messages?start=assistant").await;
    bad.problem(StatusCode::BAD_REQUEST);
}

async fn stats_head_and_clear(backend: Backend) {
    let app = TestApp::new(backend).await;
    app.get("/v1/users/u").await.problem(StatusCode::NOT_FOUND);
    let head = app.send(request(Method::HEAD, "/v1/users/u", None)).await;
    assert_eq!(head.status, StatusCode::NOT_FOUND);
    app.append("u", chat(3)).await;
    app.append("u", chat(2)).await;
    let stats = app.get("/v1/users/u").await;
    assert_eq!(stats.status, StatusCode::OK);
    assert_eq!(stats.body["user_id"], "u");
    assert_eq!(stats.body["message_count"], 5);
    assert_eq!(stats.body["first_seq"], 1);
    assert_eq!(stats.body["last_seq"], 5);
    assert_eq!(stats.body["version"], 2);
    assert!(stats.body["oldest_at"].as_str().unwrap() <= stats.body["newest_at"].as_str().unwrap());
    let head = app.send(request(Method::HEAD, "/v1/users/u", None)).await;
    assert_eq!(head.status, StatusCode::OK);
    assert_eq!(head.body, Value::Null);
    let cleared = app.delete("/v1/users/u").await;
    assert_eq!(cleared.status, StatusCode::OK);
    assert_eq!(cleared.body, json!({"deleted": 5}));
    let again = app.delete("/v1/users/u").await;
    assert_eq!(again.body, json!({"deleted": 0}));
    app.get("/v1/users/u").await.problem(StatusCode::NOT_FOUND);
    let after = app.append("u", chat(1)).await;
    assert_eq!(seqs(&after), [6]);
    assert_eq!(after["version"], 4);
}

async fn single_message_get_and_delete(backend: Backend) {
    let app = TestApp::new(backend).await;
    app.append("u", chat(3)).await;
    let one = app.get("/v1/users/u/messages/2").await;
    assert_eq!(one.status, StatusCode::OK);
    assert_eq!(one.body["seq"], 2);
    assert_eq!(
        one.body["message"],
        json!({"role": "assistant", "content": "m1"})
    );
    let deleted = app.delete("/v1/users/u/messages/2").await;
    assert_eq!(deleted.body, json!({"deleted": 1}));
    app.get("/v1/users/u/messages/2")
        .await
        .problem(StatusCode::NOT_FOUND);
    app.delete("/v1/users/u/messages/2")
        .await
        .problem(StatusCode::NOT_FOUND);
    app.get("/v1/users/u/messages/99")
        .await
        .problem(StatusCode::NOT_FOUND);
    for bad in ["0", "-1", "abc", "1.5", "99999999999999999999"] {
        let detail = app
            .get(&format!("/v1/users/u/messages/{bad}"))
            .await
            .problem(StatusCode::BAD_REQUEST);
        assert!(detail.contains("seq"), "{detail}");
    }
    assert_eq!(app.get("/v1/users/u").await.body["message_count"], 2);
}

async fn list_users_pages_by_user_id(backend: Backend) {
    let app = TestApp::new(backend).await;
    for id in ["carol", "alice", "bob", "Zed"] {
        app.append(id, chat(1)).await;
    }
    let page = app.get("/v1/users?limit=2").await;
    assert_eq!(page.status, StatusCode::OK);
    let ids: Vec<&str> = page.body["users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["user_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["Zed", "alice"]);
    assert_eq!(page.body["has_more"], true);
    assert_eq!(page.body["users"][0]["message_count"], 1);
    assert!(page.body["users"][0]["newest_at"].is_string());
    let page = app.get("/v1/users?limit=2&after=alice").await;
    let ids: Vec<&str> = page.body["users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["user_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["bob", "carol"]);
    assert_eq!(page.body["has_more"], false);
    app.get("/v1/users?limit=0")
        .await
        .problem(StatusCode::BAD_REQUEST);
    app.get("/v1/users?limit=1001")
        .await
        .problem(StatusCode::BAD_REQUEST);
    app.get("/v1/users?after=%01")
        .await
        .problem(StatusCode::BAD_REQUEST);
}

async fn user_ids_are_opaque_percent_decoded_keys(backend: Backend) {
    let app = TestApp::new(backend).await;
    let ids = [
        ("%2B15551234567", "+15551234567"),
        ("whatsapp:%2B447700900123", "whatsapp:+447700900123"),
        ("a%2Fb%3Fc%23d", "a/b?c#d"),
        ("alice%40example.com", "alice@example.com"),
        ("%C3%A9t%C3%A9%20space", "été space"),
    ];
    for (encoded, decoded) in ids {
        let reply = app.append(encoded, chat(1)).await;
        assert_eq!(reply["user_id"], decoded);
        let stats = app.get(&format!("/v1/users/{encoded}")).await;
        assert_eq!(stats.body["user_id"], decoded);
    }
    let long = "x".repeat(256);
    app.append(&long, chat(1)).await;
}

async fn bad_user_ids_are_400(backend: Backend) {
    let app = TestApp::new(backend).await;
    let too_long = "x".repeat(257);
    for bad in [
        too_long.as_str(),
        "a%00b",
        "a%0Ab",
        "a%7Fb",
        "a%C2%85b",
        "%FF%FE",
    ] {
        for uri in [
            format!("/v1/users/{bad}/messages"),
            format!("/v1/users/{bad}"),
            format!("/v1/users/{bad}/messages/1"),
        ] {
            let detail = app.get(&uri).await.problem(StatusCode::BAD_REQUEST);
            assert!(!detail.is_empty());
        }
        let reply = app
            .post_json(
                &format!("/v1/users/{bad}/messages"),
                &json!({"messages": chat(1)}),
            )
            .await;
        reply.problem(StatusCode::BAD_REQUEST);
    }
    let detail = app
        .get(&format!("/v1/users/{too_long}"))
        .await
        .problem(StatusCode::BAD_REQUEST);
    assert!(
        detail.contains("user_id") && detail.contains("256"),
        "{detail}"
    );
    let (users, _) = app
        .store
        .list_users(&chat_history::domain::Tenant::default_tenant(), None, 10)
        .await
        .unwrap();
    assert!(users.is_empty(), "nothing was stored");
}

async fn bad_query_parameters_are_400(backend: Backend) {
    let app = TestApp::new(backend).await;
    for (query, names) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("limit=-1", "limit"),
        ("max_age=0", "max_age"),
        ("max_age=-5", "max_age"),
        ("max_age=1.5", "max_age"),
        ("before=-1", "before"),
        ("after=x", "after"),
        ("start=tool", "start"),
        ("limt=5", "limt"),
    ] {
        let detail = app
            .get(&format!("/v1/users/u/messages?{query}"))
            .await
            .problem(StatusCode::BAD_REQUEST);
        assert!(detail.contains(names), "{query}: {detail}");
    }
}

async fn bodies_are_checked_before_anything_is_stored(backend: Backend) {
    let app = TestApp::new(backend).await;
    let post = |body: &'static str, content_type: Option<&'static str>| {
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri("/v1/users/u/messages");
        if let Some(ct) = content_type {
            builder = builder.header(header::CONTENT_TYPE, ct);
        }
        builder.body(Body::from(body)).unwrap()
    };
    let ok = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
    app.send(post(ok, None))
        .await
        .problem(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    app.send(post(ok, Some("text/plain")))
        .await
        .problem(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    app.send(post(ok, Some("application/x-www-form-urlencoded")))
        .await
        .problem(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    for malformed in [
        r#"{"messages":[{"role":"user"}"#,
        "",
        "not json",
        r#"{"messages":[{"role":"user","content":"\ud800"}]}"#,
        r#"{"messages":[{"role":"user","content":"\udc00 lone trail"}]}"#,
    ] {
        app.send(post(malformed, Some("application/json")))
            .await
            .problem(StatusCode::BAD_REQUEST);
    }
    for (wrong_shape, hint) in [
        (r#"{}"#, "messages"),
        (r#"[]"#, "object"),
        (r#"{"messages":{"role":"user"}}"#, "list"),
        (r#"{"messages":["hi"]}"#, "messages[0]"),
        (r#"{"messages":[{"content":"hi"}]}"#, "role"),
        (r#"{"messages":[{"role":""}]}"#, "role"),
        (r#"{"messages":[{"role":7}]}"#, "role"),
        (
            r#"{"messages":[{"role":"user"},{"role":null}]}"#,
            "messages[1]",
        ),
        (r#"{"messages":[]}"#, "empty"),
        (
            r#"{"messages":[{"role":"user","content":"a\u0000b"}]}"#,
            "NUL",
        ),
        (
            r#"{"messages":[{"role":"user","meta":{"k\u0000":1}}]}"#,
            "NUL",
        ),
        (r#"{"messages":[{"role":"us\u0000er"}]}"#, "NUL"),
    ] {
        let detail = app
            .send(post(wrong_shape, Some("application/json")))
            .await
            .problem(StatusCode::UNPROCESSABLE_ENTITY);
        assert!(detail.contains(hint), "{wrong_shape}: {detail}");
    }
    let charset = app
        .send(post(ok, Some("application/json; charset=utf-8")))
        .await;
    assert_eq!(charset.status, StatusCode::CREATED);
    let stats = app.get("/v1/users/u").await;
    assert_eq!(
        stats.body["message_count"], 1,
        "only the good request stored anything"
    );
    assert_eq!(stats.body["version"], 1);
}

async fn batch_limits_are_422(backend: Backend) {
    let app = TestApp::with_limits(
        backend,
        Limits {
            max_batch: 3,
            ..Limits::default()
        },
    )
    .await;
    app.append("u", chat(3)).await;
    let detail = app
        .post_json("/v1/users/u/messages", &json!({"messages": chat(4)}))
        .await
        .problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        detail.contains("max_batch") && detail.contains('3'),
        "{detail}"
    );
    assert_eq!(app.get("/v1/users/u").await.body["message_count"], 3);
}

async fn body_size_limit_is_413_and_inclusive(backend: Backend) {
    let limit = 256;
    let app = TestApp::with_limits(
        backend,
        Limits {
            max_body_bytes: limit,
            ..Limits::default()
        },
    )
    .await;
    let exact = |size: usize| {
        let prefix = r#"{"messages":[{"role":"user","content":""#;
        let suffix = r#""}]}"#;
        format!(
            "{prefix}{}{suffix}",
            "x".repeat(size - prefix.len() - suffix.len())
        )
    };
    let at_limit = app
        .send(request(
            Method::POST,
            "/v1/users/u/messages",
            Some(exact(limit)),
        ))
        .await;
    assert_eq!(
        at_limit.status,
        StatusCode::CREATED,
        "a body of exactly max_body_bytes is accepted"
    );
    let over = app
        .send(request(
            Method::POST,
            "/v1/users/u/messages",
            Some(exact(limit + 1)),
        ))
        .await;
    over.problem(StatusCode::PAYLOAD_TOO_LARGE);
    // Without Content-Length (a stream), the limit holds too.
    let chunks: Vec<Result<String, std::io::Error>> = vec![Ok(exact(limit + 1))];
    let streamed = Request::builder()
        .method(Method::POST)
        .uri("/v1/users/u/messages")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    app.send(streamed)
        .await
        .problem(StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(app.get("/v1/users/u").await.body["message_count"], 1);
}

async fn routing_errors_are_problems(backend: Backend) {
    let app = TestApp::new(backend).await;
    let detail = app.get("/v2/nothing").await.problem(StatusCode::NOT_FOUND);
    assert!(detail.contains("/v2/nothing"), "{detail}");
    app.get("/v1/users/u/messages/1/extra")
        .await
        .problem(StatusCode::NOT_FOUND);
    let wrong = app
        .send(request(
            Method::PUT,
            "/v1/users/u/messages",
            Some("{}".into()),
        ))
        .await;
    let detail = wrong.problem(StatusCode::METHOD_NOT_ALLOWED);
    let allow = wrong
        .headers
        .get(header::ALLOW)
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(allow.contains("GET") && allow.contains("POST"), "{allow}");
    assert!(detail.contains("PUT") && detail.contains("GET"), "{detail}");
    let wrong = app
        .send(request(Method::POST, "/v1/users", Some("{}".into())))
        .await;
    wrong.problem(StatusCode::METHOD_NOT_ALLOWED);
    assert!(wrong.headers.contains_key(header::ALLOW));
}

async fn health_readiness_and_openapi(backend: Backend) {
    let app = TestApp::new(backend).await;
    let health = app.get("/healthz").await;
    assert_eq!(
        (health.status, health.body.clone()),
        (StatusCode::OK, json!({"status": "ok"}))
    );
    let ready = app.get("/readyz").await;
    assert_eq!(
        (ready.status, ready.body.clone()),
        (StatusCode::OK, json!({"status": "ready"}))
    );
    let doc = app.get("/openapi.json").await;
    assert_eq!(doc.status, StatusCode::OK);
    assert_eq!(
        doc.body,
        serde_json::from_str::<Value>(&chat_history::openapi_json()).unwrap()
    );
    assert!(doc.body["paths"]["/v1/users/{user_id}/messages"]["post"].is_object());
}

/// Raw text of a GET, for checks on the exact bytes.
trait OneshotText {
    async fn oneshot_text(self, uri: &str) -> String;
}

impl OneshotText for axum::Router {
    async fn oneshot_text(self, uri: &str) -> String {
        use http_body_util::BodyExt;
        use tower::ServiceExt;
        let response = self.oneshot(request(Method::GET, uri, None)).await.unwrap();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }
}

/// With the database gone, requests get 503 with `Retry-After` and a body
/// that names no internals.
#[tokio::test]
async fn unreachable_postgres_is_503_with_retry_after() {
    let store = chat_history::store::connect(
        &chat_history::store::DatabaseUrl::new(
            "postgres://postgres:secret-password@127.0.0.1:1/chat",
        ),
        chat_history::store::ConnectOptions {
            max_connections: 2,
            acquire_timeout: std::time::Duration::from_millis(500),
            ..chat_history::store::ConnectOptions::default()
        },
    )
    .await
    .unwrap();
    let router = chat_history::router(chat_history::AppState::open(store, Limits::default()));
    for (method, uri, body) in [
        (
            Method::POST,
            "/v1/users/u/messages",
            Some(r#"{"messages":[{"role":"user"}]}"#.to_string()),
        ),
        (Method::GET, "/v1/users/u/messages", None),
        (Method::GET, "/readyz", None),
    ] {
        use http_body_util::BodyExt;
        use tower::ServiceExt;
        let response = router
            .clone()
            .oneshot(request(method, uri, body))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{uri}");
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains("secret-password") && !text.contains("127.0.0.1:1"),
            "{text}"
        );
    }
}
