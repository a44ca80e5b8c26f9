//! What the benchmarks share: a fresh database per backend, message
//! batches, and timing that alternates two candidates so both see the same
//! machine load. Figures are meant to be read as ratios within one run.

#![allow(dead_code)] // each benchmark uses its own part of this module

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chat_history::domain::{AppendOutcome, Appended, NewMessage, Tenant, Timestamp, UserId};
use chat_history::store::{self, ConnectOptions, Store};
use serde_json::json;
use sqlx::Connection;

pub type Cleanup = Pin<Box<dyn Future<Output = ()>>>;

/// The backends named by `BENCH_BACKENDS` (default: both).
pub fn backends() -> Vec<String> {
    std::env::var("BENCH_BACKENDS")
        .unwrap_or_else(|_| "postgres,sqlite".into())
        .split(',')
        .map(str::to_string)
        .collect()
}

/// A number from the environment, or `default`.
pub fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A migrated store on a new database named `name`, and what drops it.
/// Postgres comes from TEST_DATABASE_URL (default: the local server).
pub async fn open(backend: &str, name: &str) -> (Arc<dyn Store>, Cleanup) {
    match backend {
        "postgres" => {
            let admin = std::env::var("TEST_DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
            let mut conn = sqlx::PgConnection::connect(&admin)
                .await
                .expect("connect to Postgres");
            let drop_sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
            sqlx::query(&drop_sql).execute(&mut conn).await.unwrap();
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&mut conn)
                .await
                .unwrap();
            let base = admin.rsplit_once('/').map_or(admin.as_str(), |(b, _)| b);
            let options = ConnectOptions {
                max_connections: 16,
                ..ConnectOptions::default()
            };
            let store =
                store::connect(&store::DatabaseUrl::new(&format!("{base}/{name}")), options)
                    .await
                    .unwrap();
            store.migrate().await.unwrap();
            let cleanup: Cleanup = Box::pin(async move {
                let _ = sqlx::query(&drop_sql).execute(&mut conn).await;
            });
            (store, cleanup)
        }
        "sqlite" => {
            let path = std::env::temp_dir().join(format!("{name}_{}.db", std::process::id()));
            let store = store::connect(
                &store::DatabaseUrl::new(&format!("sqlite://{}", path.display())),
                ConnectOptions::default(),
            )
            .await
            .unwrap();
            store.migrate().await.unwrap();
            let cleanup: Cleanup = Box::pin(async move {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
                }
            });
            (store, cleanup)
        }
        other => panic!("unknown backend {other:?}; use postgres or sqlite"),
    }
}

/// `n` chat turns of ordinary length; `tag` makes them differ between calls.
pub fn turns(n: usize, tag: &str) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let value = json!({
                "role": role,
                "content": format!("{tag} message {i}: a sentence of ordinary length for a chat turn.")
            });
            NewMessage::from_value(value, "m").unwrap()
        })
        .collect()
}

/// Appends without a key; the outcome must be `Stored`.
pub async fn append(
    store: &dyn Store,
    user: &str,
    messages: &[NewMessage],
    at: Timestamp,
) -> Appended {
    let outcome = store
        .append_messages(
            &Tenant::default_tenant(),
            &UserId::parse(user).unwrap(),
            messages,
            at,
            None,
            None,
        )
        .await
        .unwrap();
    match outcome {
        AppendOutcome::Stored(appended) => appended,
        other => panic!("expected Stored, got {other:?}"),
    }
}

/// Median wall times of `a` and `b` over `rounds` calls each, after a
/// warm-up, alternating call by call. Each call gets its round number.
pub async fn compare<A, B, FA, FB>(rounds: usize, mut a: A, mut b: B) -> (Duration, Duration)
where
    A: FnMut(usize) -> FA,
    B: FnMut(usize) -> FB,
    FA: Future<Output = ()>,
    FB: Future<Output = ()>,
{
    let (mut a_times, mut b_times) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for round in 0..rounds {
        let started = Instant::now();
        a(round).await;
        a_times.push(started.elapsed());
        let started = Instant::now();
        b(round).await;
        b_times.push(started.elapsed());
    }
    (median(a_times), median(b_times))
}

pub fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}

pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
