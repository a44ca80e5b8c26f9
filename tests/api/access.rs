//! Access control and tenancy: every endpoint against every kind of caller,
//! with the other tenant's data compared byte for byte around each call;
//! rate limits; and no key in any log line.

use std::io::Write;
use std::sync::{Arc, Mutex};

use axum::http::{header, Method, StatusCode};
use chat_history::auth::Access;
use chat_history::domain::{NewMessage, Tenant, Timestamp, UserId};
use chat_history::Limits;
use serde_json::{json, Value};

use crate::on_both_backends;
use crate::support::{request, Backend, Reply, TestApp};

on_both_backends!(
    every_endpoint_against_every_caller,
    each_tenant_sees_only_its_own_histories,
    rate_limits_answer_429_with_retry_after,
);

const USER_A: &str = "key-a-user-0123456789";
const ADMIN_A: &str = "key-a-admin-0123456789";
const USER_B: &str = "key-b-user-0123456789";
const UNKNOWN: &str = "key-unknown-0123456789";

fn keys(rate: Option<&str>) -> Access {
    let entries = [
        format!("a:user:{USER_A}"),
        format!("a:admin:{ADMIN_A}"),
        format!("b:user:{USER_B}"),
    ];
    Access::from_entries(
        entries.iter().map(String::as_str),
        |i| format!("entry {i}"),
        rate.map(|r| r.parse().unwrap()),
    )
    .unwrap()
    .0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Caller {
    NoKey,
    UnknownKey,
    UserA,
    UserB,
    AdminA,
}

impl Caller {
    fn key(self) -> Option<&'static str> {
        match self {
            Self::NoKey => None,
            Self::UnknownKey => Some(UNKNOWN),
            Self::UserA => Some(USER_A),
            Self::UserB => Some(USER_B),
            Self::AdminA => Some(ADMIN_A),
        }
    }

    fn tenant(self) -> Option<Tenant> {
        match self {
            Self::UserA | Self::AdminA => Some(Tenant::new("a")),
            Self::UserB => Some(Tenant::new("b")),
            _ => None,
        }
    }
}

async fn call(
    app: &TestApp,
    caller: Caller,
    method: Method,
    uri: &str,
    body: Option<Value>,
) -> Reply {
    let mut req = request(method, uri, body.map(|b| b.to_string()));
    if let Some(key) = caller.key() {
        req.headers_mut().insert(
            header::AUTHORIZATION,
            format!("Bearer {key}").parse().unwrap(),
        );
    }
    app.send(req).await
}

fn messages(prefix: &str, n: usize) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::from_value(
                json!({"role": "user", "content": format!("{prefix}{i}")}),
                "m",
            )
            .unwrap()
        })
        .collect()
}

/// Both tenants back to a known state: `shared` in each (old messages, so a
/// purge has work), and `b-only` in b. Returns each tenant's first seq of `shared`.
async fn reset(app: &TestApp) -> (i64, i64) {
    let old = Timestamp::now().minus_seconds(3600);
    let mut firsts = Vec::new();
    for (tenant, n) in [("a", 3), ("b", 2)] {
        let tenant = Tenant::new(tenant);
        app.store.clear_all(&tenant).await.unwrap();
        let outcome = app
            .store
            .append_messages(
                &tenant,
                &UserId::parse("shared").unwrap(),
                &messages(tenant.as_str(), n),
                old,
                None,
                None,
            )
            .await
            .unwrap();
        let chat_history::domain::AppendOutcome::Stored(appended) = outcome else {
            panic!("stored")
        };
        firsts.push(appended.messages[0].seq);
    }
    app.store
        .append_messages(
            &Tenant::new("b"),
            &UserId::parse("b-only").unwrap(),
            &messages("b", 1),
            old,
            None,
            None,
        )
        .await
        .unwrap();
    (firsts[0], firsts[1])
}

/// Everything a tenant has, as text: users, stats, every message.
async fn dump(app: &TestApp, tenant: &str) -> String {
    let tenant = Tenant::new(tenant);
    let (users, _) = app.store.list_users(&tenant, None, 1000).await.unwrap();
    let mut out = String::new();
    for user in users {
        let stats = app.store.user_stats(&tenant, &user.user_id).await.unwrap();
        let transcript = app.store.transcript(&tenant, &user.user_id).await.unwrap();
        out.push_str(&format!("{user:?} {stats:?} {transcript:?}\n"));
    }
    out
}

struct Endpoint {
    method: Method,
    path: String,
    body: Option<Value>,
    /// The status for a caller with a key of this tenant and a `user` role.
    ok: StatusCode,
    admin_only: bool,
}

fn endpoints(first_seq: i64) -> Vec<Endpoint> {
    let e = |method: Method, path: &str, body: Option<Value>, ok: StatusCode| Endpoint {
        method,
        path: path.to_string(),
        body,
        ok,
        admin_only: path.starts_with("/v1/admin"),
    };
    vec![
        e(
            Method::POST,
            "/v1/users/shared/messages",
            Some(json!({"messages": [{"role": "user", "content": "x"}]})),
            StatusCode::CREATED,
        ),
        e(
            Method::GET,
            "/v1/users/shared/messages",
            None,
            StatusCode::OK,
        ),
        e(
            Method::GET,
            &format!("/v1/users/shared/messages/{first_seq}"),
            None,
            StatusCode::OK,
        ),
        e(
            Method::DELETE,
            &format!("/v1/users/shared/messages/{first_seq}"),
            None,
            StatusCode::OK,
        ),
        e(Method::GET, "/v1/users", None, StatusCode::OK),
        e(Method::GET, "/v1/users/shared", None, StatusCode::OK),
        e(Method::HEAD, "/v1/users/shared", None, StatusCode::OK),
        e(Method::DELETE, "/v1/users/shared", None, StatusCode::OK),
        e(
            Method::GET,
            "/v1/users/shared/transcript",
            None,
            StatusCode::OK,
        ),
        e(
            Method::PUT,
            "/v1/users/shared/transcript",
            Some(json!({"messages": [{"role": "user", "content": "y"}]})),
            StatusCode::OK,
        ),
        e(
            Method::POST,
            "/v1/admin/purge-expired",
            Some(json!({"max_age": 60})),
            StatusCode::OK,
        ),
        e(
            Method::POST,
            "/v1/admin/clear-all",
            Some(json!({"confirm": true})),
            StatusCode::OK,
        ),
        e(Method::GET, "/v1/nothing-here", None, StatusCode::NOT_FOUND),
    ]
}

fn expected(endpoint: &Endpoint, caller: Caller) -> StatusCode {
    match caller {
        Caller::NoKey | Caller::UnknownKey => StatusCode::UNAUTHORIZED,
        Caller::UserA | Caller::UserB if endpoint.admin_only => StatusCode::FORBIDDEN,
        _ => endpoint.ok,
    }
}

async fn every_endpoint_against_every_caller(backend: Backend) {
    let app = TestApp::with_access(backend, Limits::default(), keys(None)).await;
    let callers = [
        Caller::NoKey,
        Caller::UnknownKey,
        Caller::UserA,
        Caller::UserB,
        Caller::AdminA,
    ];
    let mut table = Vec::new();
    for index in 0..endpoints(1).len() {
        for caller in callers {
            let (first_a, first_b) = reset(&app).await;
            let first = if caller == Caller::UserB {
                first_b
            } else {
                first_a
            };
            let endpoint = &endpoints(first)[index];
            // What must not change: the other tenant's data (both, for no key).
            let untouched: Vec<&str> = match caller.tenant() {
                Some(t) if t.as_str() == "a" => vec!["b"],
                Some(_) => vec!["a"],
                None => vec!["a", "b"],
            };
            let mut before = Vec::new();
            for tenant in &untouched {
                before.push(dump(&app, tenant).await);
            }
            let reply = call(
                &app,
                caller,
                endpoint.method.clone(),
                &endpoint.path,
                endpoint.body.clone(),
            )
            .await;
            let want = expected(endpoint, caller);
            assert_eq!(
                reply.status, want,
                "{caller:?} {} {}: {}",
                endpoint.method, endpoint.path, reply.body
            );
            if want == StatusCode::UNAUTHORIZED {
                assert_eq!(
                    reply.headers[header::WWW_AUTHENTICATE],
                    "Bearer realm=\"chat-history\""
                );
            }
            if endpoint.method != Method::HEAD && !want.is_success() {
                reply.problem(want);
            }
            for (tenant, before) in untouched.iter().zip(before) {
                assert_eq!(
                    dump(&app, tenant).await,
                    before,
                    "{caller:?} {} {} changed tenant {tenant}",
                    endpoint.method,
                    endpoint.path
                );
            }
            table.push(format!(
                "{:<7} {:<40} {caller:?} -> {}",
                endpoint.method,
                endpoint.path,
                reply.status.as_u16()
            ));
        }
    }
    // The operational endpoints stay open to everyone.
    for caller in callers {
        for path in ["/healthz", "/readyz", "/openapi.json"] {
            let reply = call(&app, caller, Method::GET, path, None).await;
            assert_eq!(reply.status, StatusCode::OK, "{caller:?} {path}");
        }
    }
    if std::env::var_os("ACCESS_MATRIX").is_some() {
        println!("{}", table.join("\n"));
    }
}

async fn each_tenant_sees_only_its_own_histories(backend: Backend) {
    let app = TestApp::with_access(backend, Limits::default(), keys(None)).await;
    reset(&app).await;
    let contents = |reply: &Reply| -> Vec<String> {
        reply.body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["message"]["content"].as_str().unwrap().to_string())
            .collect()
    };
    let a = call(
        &app,
        Caller::UserA,
        Method::GET,
        "/v1/users/shared/messages?max_age=7200",
        None,
    )
    .await;
    assert_eq!(contents(&a), ["a0", "a1", "a2"]);
    let b = call(
        &app,
        Caller::UserB,
        Method::GET,
        "/v1/users/shared/messages?max_age=7200",
        None,
    )
    .await;
    assert_eq!(contents(&b), ["b0", "b1"]);
    let users = call(&app, Caller::UserA, Method::GET, "/v1/users", None).await;
    assert_eq!(
        users.body["users"].as_array().unwrap().len(),
        1,
        "b-only is b's"
    );
    call(&app, Caller::UserA, Method::GET, "/v1/users/b-only", None)
        .await
        .problem(StatusCode::NOT_FOUND);
    let purge = call(
        &app,
        Caller::AdminA,
        Method::POST,
        "/v1/admin/purge-expired",
        Some(json!({"max_age": 60})),
    )
    .await;
    assert_eq!(purge.body, json!({"deleted": 3}), "only a's three messages");
    let b_stats = call(&app, Caller::UserB, Method::GET, "/v1/users/shared", None).await;
    assert_eq!(b_stats.body["message_count"], 2);
    // A key for a tenant that has nothing yet sees nothing, and its writes are its own.
    let fresh = call(
        &app,
        Caller::UserB,
        Method::POST,
        "/v1/users/new/messages",
        Some(json!({"messages": [{"role": "user"}]})),
    )
    .await;
    assert_eq!(fresh.body["messages"][0]["seq"], 1);
    call(&app, Caller::UserA, Method::GET, "/v1/users/new", None)
        .await
        .problem(StatusCode::NOT_FOUND);
}

async fn rate_limits_answer_429_with_retry_after(backend: Backend) {
    let app = TestApp::with_access(backend, Limits::default(), keys(Some("3/m"))).await;
    for _ in 0..3 {
        let ok = call(&app, Caller::UserA, Method::GET, "/v1/users", None).await;
        assert_eq!(ok.status, StatusCode::OK);
    }
    let limited = call(&app, Caller::UserA, Method::GET, "/v1/users", None).await;
    limited.problem(StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = limited.headers[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=20).contains(&retry), "{retry}");
    // Limits are per key: another key of the same tenant is not limited.
    let other = call(&app, Caller::AdminA, Method::GET, "/v1/users", None).await;
    assert_eq!(other.status, StatusCode::OK);
    // Unknown keys are refused before they reach a limiter.
    for _ in 0..10 {
        let unknown = call(&app, Caller::UnknownKey, Method::GET, "/v1/users", None).await;
        assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
    }
    // Open endpoints are not limited.
    assert_eq!(
        call(&app, Caller::UserA, Method::GET, "/healthz", None)
            .await
            .status,
        StatusCode::OK
    );
}

/// Log lines from every layer, captured while requests carry keys, hold none of them.
#[tokio::test]
async fn no_key_reaches_the_logs() {
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let app = TestApp::with_access(Backend::Sqlite, Limits::default(), keys(Some("2/m"))).await;
    for caller in [
        Caller::UserA,
        Caller::UserB,
        Caller::AdminA,
        Caller::UnknownKey,
        Caller::NoKey,
    ] {
        call(
            &app,
            caller,
            Method::POST,
            "/v1/users/u/messages",
            Some(json!({"messages": [{"role": "user"}]})),
        )
        .await;
        call(&app, caller, Method::GET, "/v1/users/u/messages", None).await;
        call(
            &app,
            caller,
            Method::POST,
            "/v1/admin/clear-all",
            Some(json!({"confirm": true})),
        )
        .await;
    }
    let mut malformed = request(Method::GET, "/v1/users", None);
    malformed.headers_mut().insert(
        header::AUTHORIZATION,
        format!("Basic {USER_A}").parse().unwrap(),
    );
    app.send(malformed).await;

    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(
        logs.contains("/v1/users/{user_id}/messages"),
        "requests were logged:\n{logs}"
    );
    assert!(
        logs.contains("status=429"),
        "the rate limit was hit and logged:\n{logs}"
    );
    for key in [USER_A, ADMIN_A, USER_B, UNKNOWN] {
        assert!(!logs.contains(key), "a key reached the logs");
    }
    assert!(
        !logs.to_ascii_lowercase().contains("bearer key-"),
        "an Authorization header reached the logs"
    );
}
