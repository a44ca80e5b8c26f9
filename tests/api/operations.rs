//! What operators scrape and trace: `/metrics` (checked by promtool), the
//! request id, and `/metrics` behind a key when so configured.

use std::io::Write;
use std::process::{Command, Stdio};

use axum::http::{header, Method, StatusCode};
use chat_history::auth::Access;
use chat_history::Limits;
use http_body_util::BodyExt;
use serde_json::json;
use tower::ServiceExt;

use crate::support::{request, Backend, TestApp};

async fn scrape(app: &TestApp, key: Option<&str>) -> (StatusCode, String) {
    let mut req = request(Method::GET, "/metrics", None);
    if let Some(key) = key {
        req.headers_mut().insert(
            header::AUTHORIZATION,
            format!("Bearer {key}").parse().unwrap(),
        );
    }
    let response = app.router.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_and_pass_promtool() {
    let app = TestApp::new(Backend::Postgres).await;
    app.append("m", json!([{"role": "user"}, {"role": "assistant"}]))
        .await;
    app.get("/v1/users/m/messages").await;
    app.get("/v1/nowhere").await;
    let (status, text) = scrape(&app, None).await;
    assert_eq!(status, StatusCode::OK);
    for expected in [
        r#"chat_history_http_requests_total{method="POST",route="/v1/users/{user_id}/messages",status="201"}"#,
        r#"chat_history_http_requests_total{method="GET",route="unmatched",status="404"}"#,
        r#"chat_history_http_request_duration_seconds_bucket{method="GET",route="/v1/users/{user_id}/messages",le="0.005"}"#,
        r#"chat_history_db_connections{state="in_use"}"#,
        r#"chat_history_db_connections{state="idle"}"#,
        "chat_history_messages_appended_total ",
        "# HELP chat_history_http_requests_total",
        "# TYPE chat_history_http_request_duration_seconds histogram",
    ] {
        assert!(text.contains(expected), "missing {expected} in:\n{text}");
    }
    assert!(
        !text.contains("route=\"/v1/users/m"),
        "raw paths never become labels"
    );

    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs (Debian's prometheus package; scripts/test installs it)");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let checked = promtool.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    assert!(
        checked.status.success() && said.trim().is_empty(),
        "promtool: {said}"
    );
}

#[tokio::test]
async fn every_response_carries_a_request_id() {
    let app = TestApp::new(Backend::Sqlite).await;
    let generated = app.get("/healthz").await;
    let id = generated.headers["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    let other = app.get("/v1/nowhere").await;
    assert_ne!(
        other.headers["x-request-id"],
        id.as_str(),
        "a new id per request"
    );
    let mut given = request(Method::GET, "/v1/users", None);
    given
        .headers_mut()
        .insert("x-request-id", "trace-me-42".parse().unwrap());
    let echoed = app.send(given).await;
    assert_eq!(echoed.headers["x-request-id"], "trace-me-42");
}

#[tokio::test]
async fn metrics_can_require_a_key() {
    let key = "metrics-reader-0123456789";
    let (keys, _) = Access::from_entries(
        [format!("ops:user:{key}")].iter().map(String::as_str),
        |i| format!("entry {i}"),
        None,
    )
    .unwrap();
    let protected = TestApp::with_access(
        Backend::Sqlite,
        Limits::default(),
        keys.protecting_metrics().unwrap(),
    )
    .await;
    let (status, _) = scrape(&protected, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = scrape(&protected, Some("wrong-key-0123456789")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, text) = scrape(&protected, Some(key)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains("chat_history_http_requests_total"));
    assert_eq!(protected.get("/healthz").await.status, StatusCode::OK);

    let (keys, _) = Access::from_entries(
        [format!("ops:user:{key}")].iter().map(String::as_str),
        |i| format!("entry {i}"),
        None,
    )
    .unwrap();
    let open_metrics = TestApp::with_access(Backend::Sqlite, Limits::default(), keys).await;
    assert_eq!(
        scrape(&open_metrics, None).await.0,
        StatusCode::OK,
        "open unless the setting says otherwise"
    );
    assert!(
        Access::open().protecting_metrics().is_err(),
        "protecting needs keys"
    );
}

#[tokio::test]
async fn docs_are_served_from_the_binary_and_stay_open() {
    let (keys, _) = Access::from_entries(
        ["ops:user:docs-reader-0123456789"].into_iter(),
        |i| format!("entry {i}"),
        None,
    )
    .unwrap();
    let app = TestApp::with_access(Backend::Sqlite, Limits::default(), keys).await;
    let get = |path: &'static str| {
        let router = app.router.clone();
        async move {
            let response = router
                .oneshot(request(Method::GET, path, None))
                .await
                .unwrap();
            let status = response.status();
            let content_type = response
                .headers()
                .get(header::CONTENT_TYPE)
                .map(|v| v.to_str().unwrap().to_string())
                .unwrap_or_default();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (
                status,
                content_type,
                String::from_utf8_lossy(&body).into_owned(),
            )
        }
    };
    let (status, _, _) = get("/docs").await;
    assert!(status.is_redirection(), "{status}");
    let (status, content_type, page) = get("/docs/").await;
    assert_eq!(status, StatusCode::OK);
    assert!(content_type.starts_with("text/html"), "{content_type}");
    assert!(page.contains("swagger-ui"), "{page}");
    assert!(
        !page.contains("https://"),
        "the page loads nothing from elsewhere"
    );
    let (status, _, script) = get("/docs/swagger-initializer.js").await;
    assert_eq!(status, StatusCode::OK);
    assert!(script.contains("/openapi.json"), "{script}");
    assert!(script.contains(r#""validatorUrl": "none""#), "{script}");
    for asset in ["/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"] {
        let (status, _, body) = get(asset).await;
        assert_eq!(status, StatusCode::OK, "{asset}");
        assert!(body.len() > 10_000, "{asset} is the real asset");
    }
}
