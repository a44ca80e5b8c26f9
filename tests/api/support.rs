//! Real databases for tests: a fresh Postgres database or a fresh SQLite
//! file per test, migrated, and dropped afterwards. Postgres comes from
//! `TEST_DATABASE_URL` (default: the local server as user `postgres`); when
//! it cannot be reached the test fails, it never skips. With
//! `TEST_POOLER_URL` (a pooler in transaction mode in front of that server,
//! e.g. `postgres://postgres@127.0.0.1:6432`), the service under test reaches
//! each database through the pooler instead: scripts/pgbouncer-test does that.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderMap, Method, Request, StatusCode};
use axum::Router;
use chat_history::auth::Access;
use chat_history::store::{self, ConnectOptions, DatabaseUrl, Store};
use chat_history::{router, AppState, Limits};
use http_body_util::BodyExt;
use serde_json::Value;
use sqlx::Connection;
use tower::ServiceExt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// Generates one `#[tokio::test]` per backend for each listed async fn
/// taking a `Backend`, in modules `postgres` and `sqlite`.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::Postgres).await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::Sqlite).await
                }
            )*
        }
    };
}

static NEXT_DB: AtomicUsize = AtomicUsize::new(0);
static QUIET_LOGS: Once = Once::new();

fn admin_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database that exists for one test.
pub struct TestDb {
    pub backend: Backend,
    /// How the service reaches it (through the pooler, if one is set).
    pub url: String,
    /// How a test reaches it behind the service's back: the server itself.
    pub direct_url: String,
    name: String,
}

impl TestDb {
    pub async fn new(backend: Backend) -> Self {
        QUIET_LOGS.call_once(|| {
            if std::env::var_os("TEST_LOG").is_some() {
                let _ = tracing_subscriber::fmt().with_test_writer().try_init();
            }
        });
        let name = format!(
            "chtest_{}_{}",
            std::process::id(),
            NEXT_DB.fetch_add(1, Ordering::Relaxed)
        );
        match backend {
            Backend::Postgres => {
                let admin = admin_url();
                let mut conn = sqlx::PgConnection::connect(&admin)
                    .await
                    .unwrap_or_else(|e| {
                        panic!("Postgres tests need a server at TEST_DATABASE_URL ({admin}): {e}")
                    });
                drop_stale_databases(&mut conn).await;
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut conn)
                    .await
                    .expect("create the test database");
                conn.close().await.ok();
                let base = admin.rsplit_once('/').map_or(admin.as_str(), |(b, _)| b);
                let direct_url = format!("{base}/{name}");
                let url = match std::env::var("TEST_POOLER_URL") {
                    Ok(pooler) => format!(
                        "{}/{name}?pool_mode=transaction",
                        pooler.trim_end_matches('/')
                    ),
                    Err(_) => direct_url.clone(),
                };
                Self {
                    backend,
                    url,
                    direct_url,
                    name,
                }
            }
            Backend::Sqlite => {
                let dir = std::env::temp_dir().join("chat-history-tests");
                std::fs::create_dir_all(&dir).expect("create the SQLite test folder");
                let path = dir.join(format!("{name}.db"));
                let url = format!("sqlite://{}", path.display());
                Self {
                    backend,
                    direct_url: url.clone(),
                    url,
                    name: path.display().to_string(),
                }
            }
        }
    }

    /// A store on this database, migrated.
    pub async fn store(&self) -> Arc<dyn Store> {
        let store = self.unmigrated_store().await;
        store.migrate().await.expect("migrations apply");
        store
    }

    pub async fn unmigrated_store(&self) -> Arc<dyn Store> {
        store::connect(&DatabaseUrl::new(&self.url), ConnectOptions::default())
            .await
            .expect("connect to the test database")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        match self.backend {
            Backend::Sqlite => {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", self.name));
                }
            }
            Backend::Postgres => {
                let name = self.name.clone();
                // Drop may run inside the test's runtime: use a thread of its own.
                let _ = std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a runtime to drop the test database");
                    runtime.block_on(async {
                        if let Ok(mut conn) = sqlx::PgConnection::connect(&admin_url()).await {
                            let _ = sqlx::query(&format!(
                                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                            ))
                            .execute(&mut conn)
                            .await;
                        }
                    });
                })
                .join();
            }
        }
    }
}

/// Drops test databases left by test processes that are gone (a test that
/// panicked before its `Drop`, or a killed run).
async fn drop_stale_databases(conn: &mut sqlx::PgConnection) {
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'chtest\\_%'")
            .fetch_all(&mut *conn)
            .await
            .unwrap_or_default();
    for name in names {
        let pid = name.split('_').nth(1).unwrap_or_default();
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .execute(&mut *conn)
                .await;
        }
    }
}

/// The real router over a real database, driven in-process.
pub struct TestApp {
    pub router: Router,
    pub store: Arc<dyn Store>,
    /// The app's database, dropped with it.
    db: TestDb,
}

impl TestApp {
    pub async fn new(backend: Backend) -> Self {
        Self::with_limits(backend, Limits::default()).await
    }

    pub async fn with_limits(backend: Backend, limits: Limits) -> Self {
        Self::with_access(backend, limits, Access::open()).await
    }

    pub async fn with_access(backend: Backend, limits: Limits, access: Access) -> Self {
        let db = TestDb::new(backend).await;
        let store = db.store().await;
        let router = router(AppState {
            store: store.clone(),
            limits,
            access: Arc::new(access),
        });
        Self { router, store, db }
    }

    /// The URL of this app's database, for a test's own connection (never
    /// through the pooler: its prepared statements must not leak into the
    /// pooler's server connections).
    pub fn db_url(&self) -> String {
        self.db.direct_url.clone()
    }

    pub async fn send(&self, request: Request<Body>) -> Reply {
        let response = self
            .router
            .clone()
            .oneshot(request)
            .await
            .expect("the router answers");
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("read the body")
            .to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                panic!(
                    "body is not JSON ({e}): {}",
                    String::from_utf8_lossy(&bytes)
                )
            })
        };
        Reply {
            status,
            headers,
            body,
        }
    }

    pub async fn get(&self, uri: &str) -> Reply {
        self.send(request(Method::GET, uri, None)).await
    }

    pub async fn delete(&self, uri: &str) -> Reply {
        self.send(request(Method::DELETE, uri, None)).await
    }

    pub async fn post_json(&self, uri: &str, body: &Value) -> Reply {
        self.send(request(Method::POST, uri, Some(body.to_string())))
            .await
    }

    /// Appends `messages` to `user` and returns the 201 body.
    pub async fn append(&self, user: &str, messages: Value) -> Value {
        let reply = self
            .post_json(
                &format!("/v1/users/{user}/messages"),
                &serde_json::json!({ "messages": messages }),
            )
            .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
        reply.body
    }
}

/// A request with a JSON body (when given).
pub fn request(method: Method, uri: &str, json: Option<String>) -> Request<Body> {
    let builder = Request::builder().method(method).uri(uri);
    match json {
        Some(json) => builder
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(json)),
        None => builder.body(Body::empty()),
    }
    .expect("a valid request")
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Reply {
    /// Asserts this is a problem+json error with `status` and returns its detail.
    pub fn problem(&self, status: StatusCode) -> String {
        assert_eq!(self.status, status, "body: {}", self.body);
        assert_eq!(
            self.headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
            Some("application/problem+json"),
            "content type of a {status} reply"
        );
        assert_eq!(self.body["status"], status.as_u16());
        assert_eq!(self.body["type"], "about:blank");
        assert!(self.body["title"].is_string());
        let detail = self.body["detail"].as_str().expect("a detail").to_string();
        assert!(!detail.is_empty());
        detail
    }
}

/// A service process (the built binary) on `127.0.0.1`, killed when dropped.
pub struct Replica {
    child: Child,
    pub address: SocketAddr,
    pub logs: Arc<Mutex<String>>,
}

impl Replica {
    pub fn start(database_url: &str) -> Self {
        Self::start_with(database_url, &[])
    }

    /// A replica with more settings (`envs`), and its logs kept.
    pub fn start_with(database_url: &str, envs: &[(&str, &str)]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_chat-history"))
            .arg("serve")
            .env("DATABASE_URL", database_url)
            .env("CHAT_HISTORY_BIND", address.to_string())
            .env("CHAT_HISTORY_RETENTION", "1h")
            .env("CHAT_HISTORY_CLEANUP_INTERVAL", "1s")
            .env("CHAT_HISTORY_LOG_FORMAT", "json")
            .env("RUST_LOG", "chat_history=debug")
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a replica");
        let logs = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut logs = sink.lock().unwrap();
                logs.push_str(&line);
                logs.push('\n');
            }
        });
        let replica = Self {
            child,
            address,
            logs,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while replica.http("GET", "/healthz", None).0 != 200 {
            assert!(Instant::now() < deadline, "replica did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        replica
    }

    /// One HTTP/1.1 exchange on a fresh connection: (status, body).
    pub fn http(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
        let Ok(mut stream) = TcpStream::connect(self.address) else {
            return (0, String::new());
        };
        let body = body.map(Value::to_string).unwrap_or_default();
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let status = response
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (status, body)
    }

    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.http("GET", "/metrics", None);
        text.lines()
            .filter(|line| line.starts_with(name))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// (start, end) of each retention run this replica finished, in seconds.
    pub fn retention_runs(&self) -> Vec<(f64, f64)> {
        self.logs
            .lock()
            .unwrap()
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|event| event["message"] == "retention run finished")
            .map(|event| {
                let end = chrono::DateTime::parse_from_rfc3339(event["timestamp"].as_str().unwrap())
                    .unwrap()
                    .timestamp_micros() as f64
                    / 1e6;
                (end - event["seconds"].as_f64().unwrap(), end)
            })
            .collect()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
