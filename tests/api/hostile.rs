//! Hostile clients: what one caller does must not exhaust the service for
//! the others. Metrics labels from closed sets, connection and request caps
//! shed with 503, bounded memory for transcripts, panics answered as
//! problems, access that fails closed, and writes that time out saying so.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::http::{header, Method, Request, StatusCode};
use axum::routing::get;
use axum::Router;
use chat_history::auth::Access;
use chat_history::domain::{HistoryPage, HistoryQuery, NewMessage, Tenant, Timestamp, UserId};
use chat_history::server::{launch, MAX_BUFFER_BYTES};
use chat_history::store::ConnectOptions;
use chat_history::{AppState, Limits};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tower::ServiceExt;

use crate::on_both_backends;
use crate::support::{request, Backend, Replica, TestApp, TestDb};

on_both_backends!(
    a_transcript_is_streamed_whole_with_the_version_of_its_snapshot,
    a_save_over_max_transcript_messages_is_422_and_stores_nothing,
    clearing_a_long_history_works_in_batches,
    retention_runs_on_a_pool_of_one_connection,
    slow_transcript_readers_cannot_hold_every_connection,
    reads_that_keep_their_connections_leave_every_caller_one,
    history_pages_are_cut_at_their_bytes_and_page_on_to_every_message,
    batched_page_reads_are_cut_alike_whatever_else_the_batch_reads,
    a_replica_cuts_pages_at_max_page_bytes,
);

#[tokio::test]
async fn metrics_labels_come_from_closed_sets() {
    let app = TestApp::new(Backend::Sqlite).await;
    for i in 0..40 {
        let method = Method::from_bytes(format!("XMETHOD{i}").as_bytes()).unwrap();
        app.send(request(method, "/healthz", None)).await;
        app.get(&format!("/nothing/here/{i}")).await;
        let method = Method::from_bytes(format!("YMETHOD{i}").as_bytes()).unwrap();
        app.send(request(method, "/v1/users/u/messages", None))
            .await;
    }
    let body = app
        .router
        .clone()
        .oneshot(request(Method::GET, "/metrics", None))
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes();
    let text = String::from_utf8_lossy(&body);
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("chat_history_http_requests_total"))
        .collect();
    assert!(!series.is_empty(), "{text}");
    for line in &series {
        assert!(
            !line.contains("METHOD"),
            "an invented method became a label: {line}"
        );
        assert!(
            !line.contains("/nothing"),
            "a raw path became a label: {line}"
        );
        let method = line
            .split("method=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert!(
            ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "other"].contains(&method),
            "{line}"
        );
    }
    assert!(
        series.iter().any(|l| l.contains("method=\"other\"")),
        "{text}"
    );
    assert!(
        series.iter().any(|l| l.contains("route=\"unmatched\"")),
        "{text}"
    );
}

/// A server on a free port with `limits`, over SQLite, stopped when dropped.
struct Served {
    address: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _db: TestDb,
}

impl Served {
    async fn start(limits: Limits) -> Self {
        let db = TestDb::new(Backend::Sqlite).await;
        let state = AppState::open(db.store().await, limits);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(launch(listener, state, async {
            let _ = stopped.await;
        }));
        Self {
            address,
            stop: Some(stop),
            _db: db,
        }
    }

    fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(self.address).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(15)))
            .unwrap();
        stream
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Seconds until the server closes `stream` (reads until EOF or a reset).
fn seconds_until_closed(mut stream: TcpStream) -> f64 {
    let started = Instant::now();
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) | Err(_) => return started.elapsed().as_secs_f64(),
            Ok(_) => {}
        }
    }
}

/// Reads one whole response with `Connection: close` semantics.
fn response(stream: &mut TcpStream) -> String {
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_head_and_an_idle_connection_are_closed_after_the_header_timeout() {
    let served = Served::start(Limits {
        header_timeout: Duration::from_secs(1),
        ..Limits::default()
    })
    .await;
    let mut half = served.connect();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let mut idle = served.connect();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut first = [0u8; 12];
    idle.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    let (half, idle) = tokio::task::spawn_blocking(move || {
        (seconds_until_closed(half), seconds_until_closed(idle))
    })
    .await
    .unwrap();
    println!("half-sent head closed after {half:.1} s, idle keep-alive after {idle:.1} s");
    assert!(half < 5.0, "a half-sent head stayed open {half:.1} s");
    assert!(
        idle < 5.0,
        "an idle keep-alive connection stayed open {idle:.1} s"
    );
}

/// Sends a `GET /healthz` on `stream` whose head carries one header of
/// `bytes` bytes, and reads the answer.
fn healthz_with_header_of(mut stream: TcpStream, bytes: usize) -> String {
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Padding: {}\r\n\r\n",
        "a".repeat(bytes)
    );
    // The server may close before it has taken all of an oversized head.
    let _ = stream.write_all(head.as_bytes());
    response(&mut stream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_over_the_buffer_gets_431_and_the_connection_is_closed() {
    let served = Served::start(Limits::default()).await;
    let (fits, over) = (served.connect(), served.connect());
    let (fits, over) = tokio::task::spawn_blocking(move || {
        (
            healthz_with_header_of(fits, 16 * 1024),
            healthz_with_header_of(over, 4 * MAX_BUFFER_BYTES),
        )
    })
    .await
    .unwrap();
    assert!(fits.starts_with("HTTP/1.1 200"), "a 16 KiB head: {fits}");
    assert!(
        over.starts_with("HTTP/1.1 431"),
        "a head of {} bytes: {}",
        4 * MAX_BUFFER_BYTES,
        over.lines().next().unwrap_or("no answer")
    );
    let after = get_status(&served, "/healthz").await;
    assert!(after.starts_with("HTTP/1.1 200"), "then: {after}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_over_the_cap_gets_503_and_the_rest_are_served() {
    let served = Served::start(Limits {
        max_connections: 3,
        ..Limits::default()
    })
    .await;
    let held: Vec<TcpStream> = (0..3).map(|_| served.connect()).collect();
    // Let the server accept them before the one over the cap arrives.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut over = served.connect();
    over.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let answer = tokio::task::spawn_blocking(move || response(&mut over))
        .await
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    let lower = answer.to_ascii_lowercase();
    assert!(lower.contains("retry-after: 1"), "{answer}");
    assert!(
        lower.contains("content-type: application/problem+json"),
        "{answer}"
    );
    assert!(answer.contains("CHAT_HISTORY_MAX_CONNECTIONS"), "{answer}");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut stream = served.connect();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let answer = tokio::task::spawn_blocking(move || response(&mut stream))
            .await
            .unwrap();
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "connections were not freed: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends the head and the first byte of an append of `length` bytes; the
/// request stays in flight until the rest arrives.
fn start_append(served: &Served, user: &str, length: usize) -> TcpStream {
    start_append_to(served.connect(), user, length)
}

fn start_append_to(mut stream: TcpStream, user: &str, length: usize) -> TcpStream {
    write!(
        stream,
        "POST /v1/users/{user}/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{"
    )
    .unwrap();
    stream
}

/// Sends the rest of an append started by `start_append`: one message,
/// padded to `length` bytes in all.
fn finish_append(mut stream: TcpStream, length: usize) -> String {
    let head = r#""messages":[{"role":"user","content":""#;
    let tail = r#""}]}"#;
    let padding = "x".repeat(length - 1 - head.len() - tail.len());
    // The server may answer (503) and close before it reads the rest.
    let _ = write!(stream, "{head}{padding}{tail}");
    response(&mut stream)
}

async fn get_status(served: &Served, path: &str) -> String {
    let mut stream = served.connect();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    tokio::task::spawn_blocking(move || response(&mut stream))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_the_in_flight_cap_get_503_and_probes_still_answer() {
    let served = Served::start(Limits {
        max_in_flight: 2,
        ..Limits::default()
    })
    .await;
    let slow: Vec<TcpStream> = (0..2)
        .map(|i| start_append(&served, &format!("s{i}"), 100))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let shed = get_status(&served, "/v1/users/u/messages").await;
    assert!(shed.starts_with("HTTP/1.1 503"), "{shed}");
    assert!(
        shed.to_ascii_lowercase().contains("retry-after: 1"),
        "{shed}"
    );
    assert!(shed.contains("CHAT_HISTORY_MAX_IN_FLIGHT"), "{shed}");
    let probe = get_status(&served, "/healthz").await;
    assert!(probe.starts_with("HTTP/1.1 200"), "{probe}");
    for stream in slow {
        let answer = tokio::task::spawn_blocking(move || finish_append(stream, 100))
            .await
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    }
    let after = get_status(&served, "/v1/users/u/messages").await;
    assert!(after.starts_with("HTTP/1.1 200"), "{after}");
}

/// A flood of requests shed with 503 is counted in full by the metrics,
/// but logged once (then at most once every ten seconds, saying how many
/// were passed over): one caller cannot turn the shedding into a flood of
/// log lines, for the disk and whoever reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_shed_requests_is_counted_but_logged_once() {
    let db = TestDb::new(Backend::Sqlite).await;
    let replica = Replica::start_with(&db.url, &[("CHAT_HISTORY_MAX_IN_FLIGHT", "1")]);
    let held = TcpStream::connect(replica.address).unwrap();
    held.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let held = start_append_to(held, "held", 100);
    std::thread::sleep(Duration::from_millis(300));
    let shed = |replica: &Replica| replica.http("GET", "/v1/users/u/messages", None).0;
    for _ in 0..300 {
        assert_eq!(shed(&replica), 503);
    }
    let counted = replica.metric(
        "chat_history_http_requests_total{method=\"GET\",route=\"/v1/users/{user_id}/messages\",status=\"503\"}",
    );
    assert_eq!(counted, 300.0);
    assert!(finish_append(held, 100).starts_with("HTTP/1.1 201"));
    std::thread::sleep(Duration::from_millis(300));
    let logs = replica.logs.lock().unwrap().clone();
    let events: Vec<Value> = logs
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .collect();
    let failures: Vec<&Value> = events
        .iter()
        .filter(|event| {
            event["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("response failed"))
        })
        .collect();
    assert_eq!(failures.len(), 1, "{logs}");
    assert_eq!(failures[0]["passed_over"], 0, "{logs}");
    // The start-up warning that no keys are set, and the one above.
    let warnings = events
        .iter()
        .filter(|event| event["level"] == "WARN" || event["level"] == "ERROR")
        .count();
    assert_eq!(warnings, 2, "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_in_flight_byte_budget_get_503() {
    let served = Served::start(Limits {
        max_body_bytes: 8192,
        max_in_flight_body_bytes: 8192,
        ..Limits::default()
    })
    .await;
    let big = start_append(&served, "big", 8000);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let small = start_append(&served, "small", 100);
    let shed = tokio::task::spawn_blocking(move || finish_append(small, 100))
        .await
        .unwrap();
    assert!(shed.starts_with("HTTP/1.1 503"), "{shed}");
    assert!(
        shed.contains("CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES"),
        "{shed}"
    );
    let done = tokio::task::spawn_blocking(move || finish_append(big, 8000))
        .await
        .unwrap();
    assert!(done.starts_with("HTTP/1.1 201"), "{done}");
    let again = start_append(&served, "small", 100);
    let stored = tokio::task::spawn_blocking(move || finish_append(again, 100))
        .await
        .unwrap();
    assert!(stored.starts_with("HTTP/1.1 201"), "{stored}");
}

/// Appends one message of `length` bytes in all to `user` over HTTP; the
/// whole response.
async fn append_over_http(served: &Served, user: &'static str, length: usize) -> String {
    let stream = served.connect();
    tokio::task::spawn_blocking(move || {
        finish_append(start_append_to(stream, user, length), length)
    })
    .await
    .unwrap()
}

/// Sends a GET for `path` over a small receive buffer and reads none of
/// the answer: hyper soon cannot write more of it.
async fn stall_on(served: &Served, path: &str) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(served.address).await.unwrap();
    let mut stream = stream.into_std().unwrap();
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_answer_holds_body_budget_until_sent_and_a_reader_that_stalls_is_cut_off() {
    let served = Served::start(Limits {
        max_body_bytes: 8 << 20,
        max_in_flight_body_bytes: 8 << 20,
        request_timeout: Duration::from_secs(3),
        ..Limits::default()
    })
    .await;
    let length = 6 << 20;
    let stored = append_over_http(&served, "big", length).await;
    assert!(
        stored.starts_with("HTTP/1.1 201"),
        "{}",
        &stored[..stored.len().min(600)]
    );
    let stored = append_over_http(&served, "small", 100).await;
    assert!(stored.starts_with("HTTP/1.1 201"), "{stored}");

    // A reader that takes nothing of its 6 MiB answer keeps 6 of the 8 MiB.
    let stalled = stall_on(&served, "/v1/users/big/messages").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let shed = get_status(&served, "/v1/users/big/messages").await;
    assert!(
        shed.starts_with("HTTP/1.1 503"),
        "{}",
        &shed[..shed.len().min(300)]
    );
    assert!(
        shed.contains("CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES"),
        "{shed}"
    );
    assert!(
        shed.to_ascii_lowercase().contains("retry-after: 1"),
        "{shed}"
    );
    // Small answers and small bodies still fit.
    let small = get_status(&served, "/v1/users/small/messages").await;
    assert!(small.starts_with("HTTP/1.1 200"), "{small}");
    let stored = append_over_http(&served, "small", 100).await;
    assert!(stored.starts_with("HTTP/1.1 201"), "{stored}");

    // After CHAT_HISTORY_REQUEST_TIMEOUT (3 s) without taking a byte, the
    // reader is disconnected and its answer's bytes are given back.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let whole = get_status(&served, "/v1/users/big/messages").await;
    assert!(
        whole.starts_with("HTTP/1.1 200"),
        "{}",
        &whole[..whole.len().min(300)]
    );
    assert!(whole.len() > length, "{} bytes", whole.len());
    let taken = tokio::task::spawn_blocking(move || {
        let mut stalled = stalled;
        let mut bytes = Vec::new();
        let _ = stalled.read_to_end(&mut bytes);
        bytes.len()
    })
    .await
    .unwrap();
    assert!(
        taken < length,
        "the stalled reader still got {taken} bytes, its whole answer"
    );
}

#[tokio::test]
async fn a_panic_is_a_problem_500_and_the_service_stays_up() {
    let app = chat_history::api::outer_layers(Router::new().route(
        "/boom",
        get(|| async {
            panic!("secret internals: SELECT * FROM chat_messages");
            #[allow(unreachable_code)]
            ""
        }),
    ));
    for _ in 0..2 {
        let response = app
            .clone()
            .oneshot(request(Method::GET, "/boom", None))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["status"], 500);
        assert!(!body.to_string().contains("secret"), "{body}");
    }
}

#[tokio::test]
async fn with_keys_a_handler_never_runs_without_a_verified_tenant() {
    let db = TestDb::new(Backend::Sqlite).await;
    let (access, _) = Access::from_entries(
        ["acme:user:key-0123456789abcdef"].into_iter(),
        |i| format!("entry {i}"),
        None,
    )
    .unwrap();
    let state = AppState {
        store: db.store().await,
        limits: Limits::default(),
        access: Arc::new(access),
    };
    // A request that reached a handler without passing access control (as a
    // route mounted outside `/v1` would): the extractor refuses it.
    let (mut parts, _) = Request::builder()
        .uri("/elsewhere")
        .body(())
        .unwrap()
        .into_parts();
    let refused = Tenant::from_request_parts(&mut parts, &state)
        .await
        .unwrap_err();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert!(refused.headers().contains_key(header::WWW_AUTHENTICATE));
    // Open service: the default tenant.
    let open = AppState::open(db.store().await, Limits::default());
    let tenant = Tenant::from_request_parts(&mut parts, &open).await.unwrap();
    assert_eq!(tenant, Tenant::default_tenant());
}

#[tokio::test]
async fn a_write_that_times_out_says_its_outcome_is_unknown() {
    let app = TestApp::with_limits(
        Backend::Sqlite,
        Limits {
            request_timeout: Duration::from_secs(1),
            ..Limits::default()
        },
    )
    .await;
    // A body that never ends: the append cannot finish within the timeout.
    let never = futures_util::stream::pending::<Result<axum::body::Bytes, std::io::Error>>();
    let stalled = Request::builder()
        .method(Method::POST)
        .uri("/v1/users/u/messages")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(never))
        .unwrap();
    let reply = app.send(stalled).await;
    let detail = reply.problem(StatusCode::SERVICE_UNAVAILABLE);
    assert!(detail.contains("unknown"), "{detail}");
    assert!(detail.contains("Idempotency-Key"), "{detail}");
    assert_eq!(reply.headers[header::RETRY_AFTER], "1");
}

fn turns(prefix: &str, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("{prefix}{i}"), "n": i}))
        .collect()
}

async fn a_transcript_is_streamed_whole_with_the_version_of_its_snapshot(backend: Backend) {
    let app = TestApp::new(backend).await;
    // Several chunks of the streamed body, appended in batches.
    let all = turns(
        "a fairly long message to fill the chunks of the stream ",
        3000,
    );
    for batch in all.chunks(1000) {
        app.append("long", json!(batch)).await;
    }
    let reply = app.get("/v1/users/long/transcript").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body["messages"], json!(all));
    assert_eq!(reply.body["user_id"], "long");
    assert_eq!(reply.body["version"], 3);
    assert_eq!(reply.headers[header::ETAG], "\"3\"");
    assert_eq!(reply.headers[header::CONTENT_TYPE], "application/json");
}

async fn a_save_over_max_transcript_messages_is_422_and_stores_nothing(backend: Backend) {
    let app = TestApp::with_limits(
        backend,
        Limits {
            max_transcript_messages: 5,
            ..Limits::default()
        },
    )
    .await;
    let put = |messages: Vec<Value>| {
        request(
            Method::PUT,
            "/v1/users/t/transcript",
            Some(json!({ "messages": messages }).to_string()),
        )
    };
    let detail = app
        .send(put(turns("m", 6)))
        .await
        .problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        detail.contains("CHAT_HISTORY_MAX_TRANSCRIPT_MESSAGES") && detail.contains('5'),
        "{detail}"
    );
    assert_eq!(
        app.get("/v1/users/t/transcript").await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(app.send(put(turns("m", 5))).await.status, StatusCode::OK);
    // A save deletes at most as many stored messages as one may carry.
    app.append("t", json!(turns("more", 4))).await;
    let detail = app
        .send(put(turns("other", 2)))
        .await
        .problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        detail.contains("would delete at least")
            && detail.contains("CHAT_HISTORY_MAX_TRANSCRIPT_MESSAGES"),
        "{detail}"
    );
    assert_eq!(app.get("/v1/users/t").await.body["message_count"], 9);
    let kept = app.send(put(turns("m", 4))).await;
    assert_eq!(kept.status, StatusCode::OK, "{}", kept.body);
    assert_eq!(kept.body["removed"], 5);
}

async fn clearing_a_long_history_works_in_batches(backend: Backend) {
    let app = TestApp::new(backend).await;
    let (tenant, user) = (Tenant::default_tenant(), UserId::parse("long").unwrap());
    let messages: Vec<NewMessage> = (0..5000)
        .map(|i| NewMessage::from_value(json!({"role": "user", "content": i}), "m").unwrap())
        .collect();
    app.store
        .append_messages(&tenant, &user, &messages, Timestamp::now(), None, None)
        .await
        .unwrap();
    app.append("other", json!([{"role": "user"}])).await;
    let reply = app.delete("/v1/users/long").await;
    assert_eq!(reply.body, json!({"deleted": 5000}));
    assert_eq!(
        app.get("/v1/users/long").await.status,
        StatusCode::NOT_FOUND
    );
    let after = app.append("long", json!([{"role": "user"}])).await;
    assert_eq!(after["messages"][0]["seq"], 5001, "seq is never reused");
    assert_eq!(app.get("/v1/users/other").await.body["message_count"], 1);
    app.store
        .append_messages(&tenant, &user, &messages, Timestamp::now(), None, None)
        .await
        .unwrap();
    let cleared = app
        .post_json("/v1/admin/clear-all", &json!({"confirm": true}))
        .await;
    assert_eq!(cleared.body, json!({"deleted": 5000 + 1 + 1}));
}

async fn retention_runs_on_a_pool_of_one_connection(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = chat_history::store::connect(
        &chat_history::store::DatabaseUrl::new(&db.url),
        ConnectOptions {
            max_connections: 1,
            acquire_timeout: Duration::from_secs(2),
            ..ConnectOptions::default()
        },
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    let (tenant, user) = (Tenant::default_tenant(), UserId::parse("u").unwrap());
    let old = [NewMessage::from_value(json!({"role": "user"}), "m").unwrap()];
    store
        .append_messages(
            &tenant,
            &user,
            &old,
            Timestamp::now().minus_seconds(7200),
            None,
            None,
        )
        .await
        .unwrap();
    let report = store
        .retention_pass(Some(Duration::from_secs(3600)), Duration::from_secs(86_400))
        .await
        .expect("retention needs no second connection")
        .expect("no other replica runs it");
    assert_eq!(report.messages, 1);
}

/// A store on a pool of two connections, whose user `u` has `n` messages.
async fn two_connections_and_a_user_of(
    db: &TestDb,
    n: usize,
) -> (Arc<dyn chat_history::store::Store>, Tenant, UserId) {
    let store = chat_history::store::connect(
        &chat_history::store::DatabaseUrl::new(&db.url),
        ConnectOptions {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(2),
            ..ConnectOptions::default()
        },
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    let (tenant, user) = (Tenant::default_tenant(), UserId::parse("u").unwrap());
    let messages: Vec<NewMessage> = (0..n)
        .map(|i| NewMessage::from_value(json!({"role": "user", "content": i}), "m").unwrap())
        .collect();
    store
        .append_messages(&tenant, &user, &messages, Timestamp::now(), None, None)
        .await
        .unwrap();
    (store, tenant, user)
}

async fn slow_transcript_readers_cannot_hold_every_connection(backend: Backend) {
    let db = TestDb::new(backend).await;
    let (store, tenant, user) = two_connections_and_a_user_of(&db, 100).await;
    let deadline = Duration::from_secs(60);
    // A reader that takes nothing: its stream waits, holding its connection.
    let stalled = store
        .transcript_stream(&tenant, &user, deadline)
        .await
        .unwrap();
    // It waits for a slot only within its own deadline.
    let refused = store
        .transcript_stream(&tenant, &user, Duration::from_secs(1))
        .await;
    assert!(
        matches!(refused, Err(chat_history::store::StoreError::Busy(_))),
        "a second stream on a pool of two must be refused"
    );
    // The rest of the pool still serves everything else.
    assert_eq!(
        store
            .user_stats(&tenant, &user)
            .await
            .unwrap()
            .unwrap()
            .message_count,
        100
    );
    drop(stalled);
    let started = Instant::now();
    let mut reader = loop {
        match store.transcript_stream(&tenant, &user, deadline).await {
            Ok(reader) => break reader,
            Err(_) if started.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the slot of a reader that went away is never freed: {e}"),
        }
    };
    let mut read = 0;
    while let Some(row) = reader.messages.recv().await {
        row.unwrap();
        read += 1;
    }
    assert_eq!(read, 100);
}

/// SQLite's reads keep their connections for the next read (see
/// `store/readers.rs`): with every connection kept, a transcript, a count
/// and 32 reads on a pool of two each still get one, the pool's figures
/// count the kept ones idle, and closing gives them back.
async fn reads_that_keep_their_connections_leave_every_caller_one(backend: Backend) {
    let db = TestDb::new(backend).await;
    let (store, tenant, user) = two_connections_and_a_user_of(&db, 30).await;
    for round in 0..2 {
        let pages = futures_util::future::join_all(
            (0..32).map(|_| store.history_window(&tenant, &user, page_query(20, None, None))),
        )
        .await;
        for page in pages {
            let page = page.unwrap_or_else(|e| panic!("round {round}: a read waited in vain: {e}"));
            assert_eq!(seqs(&page), (11..=30).collect::<Vec<_>>());
        }
        let mut transcript = store
            .transcript_stream(&tenant, &user, Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("round {round}: the transcript found no connection: {e}"));
        let stats = store.user_stats(&tenant, &user).await.unwrap().unwrap();
        assert_eq!(stats.message_count, 30);
        let mut read = 0;
        while let Some(row) = transcript.messages.recv().await {
            row.unwrap();
            read += 1;
        }
        assert_eq!(read, 30, "round {round}");
    }
    // Connections given back to sqlx's pool arrive there a moment later.
    let started = Instant::now();
    while store.pool_status().in_use > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "connections kept between reads count as in use: {:?}",
            store.pool_status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(store.pool_status().idle >= 1);
    tokio::time::timeout(Duration::from_secs(10), store.close())
        .await
        .expect("closing waits for the connections reads keep");
}

/// Messages of about 1 KiB each (`{"role":"user","content":"0007xxx…"}`):
/// three fit a page of 4 KiB, a fourth does not.
fn kib_messages(from: usize, n: usize) -> Vec<NewMessage> {
    (from..from + n)
        .map(|i| {
            let content = format!("{i:04}{}", "x".repeat(1000));
            NewMessage::from_value(json!({"role": "user", "content": content}), "m").unwrap()
        })
        .collect()
}

/// A store whose history pages hold 4 KiB of bodies.
async fn store_with_4_kib_pages(db: &TestDb) -> Arc<dyn chat_history::store::Store> {
    let store = chat_history::store::connect(
        &chat_history::store::DatabaseUrl::new(&db.url),
        ConnectOptions {
            page_bytes: 4 << 10,
            ..ConnectOptions::default()
        },
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    store
}

fn page_query(limit: u32, before: Option<i64>, after: Option<i64>) -> HistoryQuery {
    HistoryQuery {
        limit,
        not_before: None,
        before,
        after,
    }
}

fn seqs(page: &HistoryPage) -> Vec<i64> {
    page.messages.iter().map(|m| m.seq).collect()
}

async fn history_pages_are_cut_at_their_bytes_and_page_on_to_every_message(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = store_with_4_kib_pages(&db).await;
    let (tenant, user) = (Tenant::default_tenant(), UserId::parse("u").unwrap());
    let now = Timestamp::now();
    for chunk in 0..4 {
        store
            .append_messages(
                &tenant,
                &user,
                &kib_messages(chunk * 10, 10),
                now,
                None,
                None,
            )
            .await
            .unwrap();
    }
    // Backwards: the newest three, then three at a time down to the first.
    let newest = store
        .history_window(&tenant, &user, page_query(1000, None, None))
        .await
        .unwrap();
    assert_eq!(seqs(&newest), [38, 39, 40]);
    assert!(newest.has_more, "a page cut for its bytes has more");
    let mut read = seqs(&newest);
    let mut page = newest;
    while page.has_more {
        let before = page.messages[0].seq;
        page = store
            .history_window(&tenant, &user, page_query(1000, Some(before), None))
            .await
            .unwrap();
        assert!((1..=3).contains(&page.messages.len()), "{:?}", seqs(&page));
        read.splice(0..0, seqs(&page));
    }
    assert_eq!(read, (1..=40).collect::<Vec<i64>>());
    // Forwards from the beginning, alike.
    let mut read = Vec::new();
    let mut after = 0;
    loop {
        let page = store
            .history_window(&tenant, &user, page_query(1000, None, Some(after)))
            .await
            .unwrap();
        assert!((1..=3).contains(&page.messages.len()), "{:?}", seqs(&page));
        read.extend(seqs(&page));
        after = *read.last().unwrap();
        if !page.has_more {
            break;
        }
    }
    assert_eq!(read, (1..=40).collect::<Vec<i64>>());
    // A limit the bytes allow is served whole, as ever.
    let two = store
        .history_window(&tenant, &user, page_query(2, None, None))
        .await
        .unwrap();
    assert_eq!((seqs(&two), two.has_more), (vec![39, 40], true));
    // A message larger than the page is still served, alone.
    let big = json!({"role": "user", "content": "y".repeat(10_000)});
    store
        .append_messages(
            &tenant,
            &user,
            &[NewMessage::from_value(big, "m").unwrap()],
            now,
            None,
            None,
        )
        .await
        .unwrap();
    let page = store
        .history_window(&tenant, &user, page_query(1000, None, None))
        .await
        .unwrap();
    assert_eq!((seqs(&page), page.has_more), (vec![41], true));
    let page = store
        .history_window(&tenant, &user, page_query(1000, Some(41), None))
        .await
        .unwrap();
    assert_eq!((seqs(&page), page.has_more), (vec![38, 39, 40], true));
    // A cut whose next message is older than the age window has no more.
    let aged = UserId::parse("aged").unwrap();
    let old = now.minus_seconds(7200);
    store
        .append_messages(&tenant, &aged, &kib_messages(0, 5), old, None, None)
        .await
        .unwrap();
    store
        .append_messages(&tenant, &aged, &kib_messages(5, 3), now, None, None)
        .await
        .unwrap();
    let window = HistoryQuery {
        not_before: Some(now.minus_seconds(3600)),
        ..page_query(1000, None, None)
    };
    let page = store.history_window(&tenant, &aged, window).await.unwrap();
    assert_eq!((seqs(&page), page.has_more), (vec![6, 7, 8], false));
}

async fn batched_page_reads_are_cut_alike_whatever_else_the_batch_reads(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = store_with_4_kib_pages(&db).await;
    let tenant = Tenant::default_tenant();
    let users: Vec<UserId> = (0..48)
        .map(|i| UserId::parse(format!("user{i}")).unwrap())
        .collect();
    for user in &users {
        store
            .append_messages(
                &tenant,
                user,
                &kib_messages(0, 10),
                Timestamp::now(),
                None,
                None,
            )
            .await
            .unwrap();
    }
    // Read together (on Postgres, in shared statements, whose bytes are
    // bounded too: reads that do not fit one are made alone), twice.
    for _ in 0..2 {
        let pages = futures_util::future::join_all(users.iter().map(|user| {
            let (store, tenant) = (store.clone(), tenant.clone());
            async move {
                store
                    .history_window(&tenant, user, page_query(1000, None, None))
                    .await
                    .unwrap()
            }
        }))
        .await;
        for (user, page) in users.iter().zip(pages) {
            assert_eq!(
                (seqs(&page), page.has_more),
                (vec![8, 9, 10], true),
                "{}",
                user.as_str()
            );
        }
    }
}

async fn a_replica_cuts_pages_at_max_page_bytes(backend: Backend) {
    let db = TestDb::new(backend).await;
    let replica = Replica::start_with(&db.url, &[("CHAT_HISTORY_MAX_PAGE_BYTES", "4KiB")]);
    let messages: Vec<Value> = (0..10)
        .map(|i| json!({"role": "user", "content": format!("{i:04}{}", "x".repeat(1000))}))
        .collect();
    let (status, _) = replica.http(
        "POST",
        "/v1/users/u/messages",
        Some(&json!({ "messages": messages })),
    );
    assert_eq!(status, 201);
    let (status, body) = replica.http("GET", "/v1/users/u/messages?limit=1000", None);
    assert_eq!(status, 200);
    let page: Value = serde_json::from_str(&body).unwrap();
    let seqs: Vec<i64> = page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs, [8, 9, 10]);
    assert_eq!(page["has_more"], true);
}

/// `count` messages of `len` random characters each: they do not compress,
/// so Postgres keeps each body in TOAST blocks of its own.
fn incompressible_messages(count: usize, len: usize) -> Vec<NewMessage> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..count)
        .map(|_| {
            let content: String = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    ALPHABET[(state % 64) as usize] as char
                })
                .collect();
            NewMessage::from_value(json!({"role": "user", "content": content}), "m").unwrap()
        })
        .collect()
}

/// The TOAST blocks of `chat_messages` that Postgres has read, once the
/// count has gone past `previous` and settled: a backend reports its counts
/// after it goes idle, a second or more later.
async fn toast_blocks_past(conn: &mut sqlx::PgConnection, previous: i64) -> i64 {
    let mut last = previous;
    let started = Instant::now();
    loop {
        let now: i64 = sqlx::query_scalar(
            "SELECT (coalesce(toast_blks_hit, 0) + coalesce(toast_blks_read, 0))::bigint
             FROM pg_statio_user_tables WHERE relname = 'chat_messages'",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        if now > previous && now == last {
            return now;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the TOAST block count never went past {previous} and settled"
        );
        last = now;
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
}

/// Postgres sends a history page's rows only up to the one that cuts it:
/// the bodies after it are neither read from TOAST nor sent, whatever the
/// `limit`. Measured by what the server read: 40 bodies of 128 KiB, read
/// with `limit=1000` into pages of 4 KiB (one body each), cost a few
/// bodies' blocks per read, not forty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sends_no_rows_past_the_cut_of_a_page() {
    use sqlx::Connection;
    let db = TestDb::new(Backend::Postgres).await;
    // One connection: the statement after a read runs on the same one, so
    // any rows the read left unread are drained (and counted) before it.
    let store = chat_history::store::connect(
        &chat_history::store::DatabaseUrl::new(&db.url),
        ConnectOptions {
            page_bytes: 4 << 10,
            max_connections: 1,
            ..ConnectOptions::default()
        },
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    let (tenant, user) = (Tenant::default_tenant(), UserId::parse("u").unwrap());
    store
        .append_messages(
            &tenant,
            &user,
            &incompressible_messages(40, 128 << 10),
            Timestamp::now(),
            None,
            None,
        )
        .await
        .unwrap();
    let mut conn = sqlx::PgConnection::connect(&db.direct_url).await.unwrap();
    let per_body: i64 = sqlx::query_scalar(
        "SELECT (pg_relation_size(reltoastrelid) / current_setting('block_size')::bigint / 40)::bigint
         FROM pg_class WHERE relname = 'chat_messages'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert!(
        per_body >= 8,
        "each body should take TOAST blocks: {per_body}"
    );
    // Storing the bodies wrote their blocks.
    let before = toast_blocks_past(&mut conn, 0).await;
    for (name, query) in [
        ("back", page_query(1000, None, None)),
        ("forward", page_query(1000, None, Some(0))),
        ("back again", page_query(1000, Some(41), None)),
    ] {
        let page = store.history_window(&tenant, &user, query).await.unwrap();
        assert_eq!((page.messages.len(), page.has_more), (1, true), "{name}");
        let stats = store.user_stats(&tenant, &user).await.unwrap().unwrap();
        assert_eq!(stats.message_count, 40);
    }
    let read = toast_blocks_past(&mut conn, before).await - before;
    assert!(
        read <= 3 * 4 * per_body,
        "three reads of a page of one body read {read} TOAST blocks, {per_body} per body"
    );
}
