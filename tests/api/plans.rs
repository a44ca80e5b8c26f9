//! Every statement the per-user endpoints run stays inside one user's key
//! range: that is what lets the tables be distributed by user on Citus (see
//! "Beyond one Postgres" in docs/operations.md) with each request routed to
//! one shard. Postgres's own `auto_explain` sends the plan of every statement
//! the service runs to the client as a notice; the planner is told to avoid
//! sequential scans, so one shows up only where no index serves the query.

use std::sync::{Arc, Mutex};

use axum::http::{header, Method, StatusCode};
use chat_history::auth::Access;
use chat_history::store::{self, ConnectOptions, DatabaseUrl};
use chat_history::{router, AppState, Limits};
use serde_json::{json, Value};
use tower::ServiceExt;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

use crate::support::{request, Backend, TestDb};

/// A request of the scenario and the status it must get.
type Step<'a> = (
    Method,
    String,
    Option<Value>,
    Vec<(&'a str, &'a str)>,
    StatusCode,
);

/// The tables keyed by (tenant, user_id).
const USER_TABLES: [&str; 3] = ["chat_messages", "chat_users", "chat_idempotency"];

/// Collects the plans that auto_explain sends as notices.
#[derive(Clone, Default)]
struct Plans(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> Layer<S> for Plans {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        struct Message<'a>(&'a mut Option<String>);
        impl Visit for Message<'_> {
            fn record_str(&mut self, field: &Field, value: &str) {
                if field.name() == "message" {
                    *self.0 = Some(value.to_owned());
                }
            }
            fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    *self.0 = Some(format!("{value:?}"));
                }
            }
        }
        if event.metadata().target() != "sqlx::postgres::notice" {
            return;
        }
        let mut message = None;
        event.record(&mut Message(&mut message));
        if let Some(message) = message {
            self.0.lock().unwrap().push(message);
        }
    }
}

/// Every scan of a user table in `plan` (a JSON plan node), with the
/// condition it scans by ("" for a sequential scan).
fn scans(plan: &Value, found: &mut Vec<(String, String, String)>) {
    let relation = plan["Relation Name"].as_str().unwrap_or_default();
    let node = plan["Node Type"].as_str().unwrap_or_default();
    if USER_TABLES.contains(&relation) && node != "ModifyTable" {
        let condition = ["Index Cond", "Recheck Cond"]
            .iter()
            .find_map(|key| plan[key].as_str())
            .unwrap_or_default();
        found.push((relation.into(), node.into(), condition.into()));
    }
    if node == "Bitmap Heap Scan" {
        // Its condition is in the Bitmap Index Scan below it.
        return;
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        scans(child, found);
    }
}

/// The service's router on a store whose every statement's plan
/// auto_explain sends as a notice, and where those notices are collected
/// (while the returned guard lives).
async fn explained(
    db: &TestDb,
    limits: Limits,
) -> (axum::Router, Plans, tracing::subscriber::DefaultGuard) {
    let options = "-c session_preload_libraries=auto_explain -c auto_explain.log_min_duration=0 \
                   -c auto_explain.log_level=notice -c auto_explain.log_format=json \
                   -c auto_explain.log_nested_statements=on -c enable_seqscan=off";
    // auto_explain needs a session of its own: straight to the server.
    let url = format!(
        "{}?options={}",
        db.direct_url,
        url::form_urlencoded::byte_serialize(options.as_bytes()).collect::<String>()
    );
    let store = store::connect(&DatabaseUrl::new(&url), ConnectOptions::default())
        .await
        .expect("connect with auto_explain");
    store.migrate().await.expect("migrate");
    let app = router(AppState {
        store,
        limits,
        access: Arc::new(Access::open()),
    });
    let plans = Plans::default();
    let guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(plans.clone()));
    (app, plans, guard)
}

/// The JSON plans among `notices`.
fn explained_plans(notices: &[String]) -> Vec<Value> {
    notices
        .iter()
        .filter_map(|notice| {
            let start = notice.find('{')?;
            Some(
                serde_json::from_str::<Value>(&notice[start..]).unwrap_or_else(|_| {
                    panic!("an auto_explain notice that is not a JSON plan: {notice}")
                }),
            )
        })
        .collect()
}

#[tokio::test]
async fn per_user_statements_scan_only_that_users_key_range() {
    let db = TestDb::new(Backend::Postgres).await;
    let limits = Limits {
        max_messages_per_user: Some(6),
        ..Limits::default()
    };
    let (app, plans, _guard) = explained(&db, limits).await;

    let send = |method: Method, uri: String, body: Option<Value>, headers: Vec<(&str, &str)>| {
        let app = app.clone();
        let mut req = request(method, &uri, body.map(|b| b.to_string()));
        for (name, value) in headers {
            req.headers_mut().insert(
                name.parse::<header::HeaderName>().unwrap(),
                value.parse().unwrap(),
            );
        }
        async move { app.oneshot(req).await.unwrap().status() }
    };
    let user = "/v1/users/whatsapp:+4477";
    let batch = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "it is 42"},
    ]});
    // Other users beside, so that a scan that strays would have rows to find.
    for other in ["a", "b", "c"] {
        let status = send(
            Method::POST,
            format!("/v1/users/{other}/messages"),
            Some(batch.clone()),
            vec![],
        )
        .await;
        assert_eq!(status, StatusCode::CREATED);
    }
    plans.0.lock().unwrap().clear();
    let key = vec![("idempotency-key", "k1")];
    let steps: Vec<Step> = vec![
        (
            Method::POST,
            format!("{user}/messages"),
            Some(batch.clone()),
            key.clone(),
            StatusCode::CREATED,
        ),
        (
            Method::POST,
            format!("{user}/messages"),
            Some(batch.clone()),
            key.clone(),
            StatusCode::CREATED,
        ),
        (
            Method::POST,
            format!("{user}/messages"),
            Some(batch.clone()),
            vec![],
            StatusCode::CREATED,
        ),
        (
            Method::GET,
            format!("{user}/messages"),
            None,
            vec![],
            StatusCode::OK,
        ),
        (
            Method::GET,
            format!("{user}/messages?limit=3&max_age=3600&start=user"),
            None,
            vec![],
            StatusCode::OK,
        ),
        (
            Method::GET,
            format!("{user}/messages?before=8&limit=2"),
            None,
            vec![],
            StatusCode::OK,
        ),
        (
            Method::GET,
            format!("{user}/messages?after=0&limit=2&max_age=3600"),
            None,
            vec![],
            StatusCode::OK,
        ),
        (
            Method::GET,
            format!("{user}/messages?after=3&before=8"),
            None,
            vec![],
            StatusCode::OK,
        ),
        (
            Method::GET,
            format!("{user}/messages/7"),
            None,
            vec![],
            StatusCode::OK,
        ),
        (
            Method::DELETE,
            format!("{user}/messages/7"),
            None,
            vec![],
            StatusCode::OK,
        ),
        (Method::GET, user.to_owned(), None, vec![], StatusCode::OK),
        (Method::HEAD, user.to_owned(), None, vec![], StatusCode::OK),
        (
            Method::GET,
            format!("{user}/transcript"),
            None,
            vec![],
            StatusCode::OK,
        ),
        (
            Method::PUT,
            format!("{user}/transcript"),
            Some(batch.clone()),
            vec![],
            StatusCode::OK,
        ),
        (
            Method::PUT,
            format!("{user}/transcript"),
            Some(json!({"messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1"}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
                {"role": "assistant", "content": "it is 42"},
                {"role": "user", "content": "thanks"},
            ]})),
            vec![],
            StatusCode::OK,
        ),
        (
            Method::PUT,
            format!("{user}/transcript"),
            Some(json!({"messages": [{"role": "user", "content": "new"}]})),
            vec![("if-match", "\"0\"")],
            StatusCode::PRECONDITION_FAILED,
        ),
        (
            Method::DELETE,
            user.to_owned(),
            None,
            vec![],
            StatusCode::OK,
        ),
        (
            Method::GET,
            format!("{user}/transcript"),
            None,
            vec![],
            StatusCode::NOT_FOUND,
        ),
    ];
    for (method, uri, body, headers, expected) in steps {
        let status = send(method.clone(), uri.clone(), body, headers).await;
        assert_eq!(status, expected, "{method} {uri}");
    }

    let notices = plans.0.lock().unwrap().clone();
    let mut statements = 0;
    let mut user_scans = 0;
    for explained in explained_plans(&notices) {
        statements += 1;
        let text = explained["Query Text"].as_str().unwrap_or_default();
        let mut found = Vec::new();
        scans(&explained["Plan"], &mut found);
        for (relation, node, condition) in found {
            user_scans += 1;
            assert!(
                node != "Seq Scan" && condition.contains("tenant") && condition.contains("user_id"),
                "{node} on {relation} by {condition:?}, not by one user's key, in:\n{text}"
            );
        }
    }
    println!("{statements} statements explained, {user_scans} scans of user tables, each within one user's key range");
    assert!(
        statements >= 18,
        "auto_explain reported only {statements} statements"
    );
    assert!(
        user_scans >= 18,
        "only {user_scans} scans of user tables were seen"
    );
}

/// A named statement is planned once, for any values, from its first run
/// on: Postgres would otherwise plan its first five runs for their values,
/// and a statement that takes a batch as arrays on every run, which costs
/// about as much as running it. A plan for the values at hand spells them
/// out; a plan for any values names the parameters.
#[tokio::test]
async fn named_statements_are_planned_once_for_any_values() {
    let db = TestDb::new(Backend::Postgres).await;
    let (app, plans, _guard) = explained(&db, Limits::default()).await;
    let user = "/v1/users/planned-once";
    let batch = json!({"messages": [{"role": "user", "content": "hi"}]});
    let steps = [
        (Method::POST, format!("{user}/messages"), Some(batch)),
        (Method::GET, format!("{user}/messages"), None),
        (Method::GET, user.to_owned(), None),
    ];
    for (method, uri, body) in steps {
        let req = request(method.clone(), &uri, body.map(|b| b.to_string()));
        let status = app.clone().oneshot(req).await.unwrap().status();
        assert!(status.is_success(), "{method} {uri}: {status}");
    }
    let notices = plans.0.lock().unwrap().clone();
    let mut checked = 0;
    for explained in explained_plans(&notices) {
        let text = explained["Query Text"].as_str().unwrap_or_default();
        if !text.contains("$2") {
            continue;
        }
        checked += 1;
        let plan = explained["Plan"].to_string();
        assert!(
            !plan.contains("planned-once"),
            "a plan for the values at hand (the user id spelled out) of:\n{text}\n{plan}"
        );
    }
    assert!(
        checked >= 3,
        "only {checked} statements with parameters were explained"
    );
}
