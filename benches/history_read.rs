//! Does a history read cost O(rows returned)? Times the reads a bot makes
//! for a user with 50 messages and for one with 1,000,000 (all older than
//! the 24 h window), on each backend, in one run, and prints the ratios.
//!
//! cargo bench --bench history_read                      # both backends, 1,000,000 rows
//! BENCH_MESSAGES=200000 cargo bench --bench history_read   # quicker
//! BENCH_BACKENDS=sqlite cargo bench --bench history_read
//!
//! Postgres comes from TEST_DATABASE_URL (default: the local server as
//! `postgres`); a database `chat_history_bench` is created and dropped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chat_history::domain::{HistoryQuery, NewMessage, Tenant, Timestamp, UserId};
use chat_history::store::{self, ConnectOptions, Store};
use serde_json::json;
use sqlx::Connection;

const SMALL: usize = 50;
const BATCH: usize = 1000;
const ROUNDS: usize = 200;

#[tokio::main]
async fn main() {
    let messages: usize = std::env::var("BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let backends = std::env::var("BENCH_BACKENDS").unwrap_or_else(|_| "postgres,sqlite".into());
    for backend in backends.split(',') {
        let (store, cleanup) = open(backend).await;
        run(backend, &*store, messages).await;
        store.close().await;
        cleanup.await;
    }
}

async fn open(
    backend: &str,
) -> (
    Arc<dyn Store>,
    std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>,
) {
    match backend {
        "postgres" => {
            let admin = std::env::var("TEST_DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
            let mut conn = sqlx::PgConnection::connect(&admin)
                .await
                .expect("connect to Postgres");
            sqlx::query("DROP DATABASE IF EXISTS chat_history_bench WITH (FORCE)")
                .execute(&mut conn)
                .await
                .unwrap();
            sqlx::query("CREATE DATABASE chat_history_bench")
                .execute(&mut conn)
                .await
                .unwrap();
            let base = admin
                .rsplit_once('/')
                .map_or(admin.as_str(), |(b, _)| b)
                .to_string();
            let store = store::connect(
                &format!("{base}/chat_history_bench"),
                ConnectOptions::default(),
            )
            .await
            .unwrap();
            store.migrate().await.unwrap();
            let cleanup = Box::pin(async move {
                let _ = sqlx::query("DROP DATABASE IF EXISTS chat_history_bench WITH (FORCE)")
                    .execute(&mut conn)
                    .await;
            });
            (store, cleanup)
        }
        "sqlite" => {
            let path =
                std::env::temp_dir().join(format!("chat_history_bench_{}.db", std::process::id()));
            let store = store::connect(
                &format!("sqlite://{}", path.display()),
                ConnectOptions::default(),
            )
            .await
            .unwrap();
            store.migrate().await.unwrap();
            let cleanup = Box::pin(async move {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
                }
            });
            (store, cleanup)
        }
        other => panic!("unknown backend {other:?}; use postgres or sqlite"),
    }
}

fn batch(n: usize) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let value = json!({"role": role, "content": format!("message {i}: a sentence of ordinary length for a chat turn.")});
            NewMessage::from_value(value, "m").unwrap()
        })
        .collect()
}

async fn run(backend: &str, store: &dyn Store, messages: usize) {
    let tenant = Tenant::default_tenant();
    let big = UserId::parse("big").unwrap();
    let small = UserId::parse("small").unwrap();
    let now = Timestamp::now();
    let two_days_ago = now.minus_seconds(2 * 86_400);

    let started = Instant::now();
    let rows = batch(BATCH);
    let mut written = 0;
    while written < messages {
        let n = BATCH.min(messages - written);
        store
            .append_messages(&tenant, &big, &rows[..n], two_days_ago, None)
            .await
            .unwrap();
        written += n;
    }
    let load = started.elapsed();
    store
        .append_messages(&tenant, &small, &batch(SMALL), now, None)
        .await
        .unwrap();
    println!(
        "\n{backend}: loaded {messages} messages for `big` in {:.1}s ({:.0} messages/s); `small` has {SMALL}",
        load.as_secs_f64(),
        messages as f64 / load.as_secs_f64()
    );

    let last_50 = HistoryQuery {
        limit: 50,
        not_before: None,
        before: None,
        after: None,
    };
    let window_24h = HistoryQuery {
        not_before: Some(now.minus_seconds(86_400)),
        ..last_50
    };
    let forward_24h = HistoryQuery {
        after: Some(0),
        ..window_24h
    };

    println!(
        "{:<44} {:>12} {:>12} {:>8}",
        "read (median of 200)", "small", "big", "big/small"
    );
    let cases: [(&str, HistoryQuery); 3] = [
        ("last 50, no age filter", last_50),
        ("last 50 within 24 h (big: all older)", window_24h),
        ("forward from after=0 within 24 h", forward_24h),
    ];
    for (name, query) in cases {
        let (small_time, big_time) = compare(
            || async {
                store.history_window(&tenant, &small, query).await.unwrap();
            },
            || async {
                store.history_window(&tenant, &big, query).await.unwrap();
            },
        )
        .await;
        report(name, small_time, big_time);
    }
    let (small_time, big_time) = compare(
        || async {
            store.user_stats(&tenant, &small).await.unwrap();
        },
        || async {
            store.user_stats(&tenant, &big).await.unwrap();
        },
    )
    .await;
    report("stats (count, bounds)", small_time, big_time);
}

fn report(name: &str, small: Duration, big: Duration) {
    println!(
        "{name:<44} {:>10.0}µs {:>10.0}µs {:>8.2}",
        small.as_secs_f64() * 1e6,
        big.as_secs_f64() * 1e6,
        big.as_secs_f64() / small.as_secs_f64()
    );
}

/// Median wall times of `small` and `big` over `ROUNDS` calls each, after a
/// warm-up, alternating call by call so both see the same machine load.
async fn compare<A, B, FA, FB>(mut small: A, mut big: B) -> (Duration, Duration)
where
    A: FnMut() -> FA,
    B: FnMut() -> FB,
    FA: std::future::Future<Output = ()>,
    FB: std::future::Future<Output = ()>,
{
    for _ in 0..10 {
        small().await;
        big().await;
    }
    let (mut small_times, mut big_times) = (Vec::with_capacity(ROUNDS), Vec::with_capacity(ROUNDS));
    for _ in 0..ROUNDS {
        let started = Instant::now();
        small().await;
        small_times.push(started.elapsed());
        let started = Instant::now();
        big().await;
        big_times.push(started.elapsed());
    }
    small_times.sort_unstable();
    big_times.sort_unstable();
    (small_times[ROUNDS / 2], big_times[ROUNDS / 2])
}
