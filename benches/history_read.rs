//! Does a history read cost O(rows returned)? Times the reads a bot makes
//! for a user with 50 messages and for one with 1,000,000 (all older than
//! the 24 h window), on each backend, in one run, and prints the ratios.
//!
//! cargo bench --bench history_read                          # both backends, 1,000,000 rows
//! BENCH_MESSAGES=200000 cargo bench --bench history_read    # quicker
//! BENCH_BACKENDS=sqlite cargo bench --bench history_read

mod common;

use std::time::{Duration, Instant};

use chat_history::domain::{HistoryQuery, Tenant, Timestamp, UserId};
use chat_history::store::Store;

use common::{append, compare, micros, turns};

const SMALL: usize = 50;
const BATCH: usize = 1000;
const ROUNDS: usize = 200;

#[tokio::main]
async fn main() {
    let messages = common::setting("BENCH_MESSAGES", 1_000_000);
    for backend in common::backends() {
        let (store, cleanup) = common::open(&backend, "chat_history_bench_read").await;
        run(&backend, &*store, messages).await;
        store.close().await;
        cleanup.await;
    }
}

async fn run(backend: &str, store: &dyn Store, messages: usize) {
    let tenant = Tenant::default_tenant();
    let big = UserId::parse("big").unwrap();
    let small = UserId::parse("small").unwrap();
    let now = Timestamp::now();

    let started = Instant::now();
    let rows = turns(BATCH, "old");
    let mut written = 0;
    while written < messages {
        let n = BATCH.min(messages - written);
        append(store, "big", &rows[..n], now.minus_seconds(2 * 86_400)).await;
        written += n;
    }
    let load = started.elapsed();
    append(store, "small", &turns(SMALL, "new"), now).await;
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
        "{:<44} {:>12} {:>12} {:>9}",
        "read (median of 200)", "small", "big", "big/small"
    );
    for (name, query) in [
        ("last 50, no age filter", last_50),
        ("last 50 within 24 h (big: all older)", window_24h),
        ("forward from after=0 within 24 h", forward_24h),
    ] {
        let (small_time, big_time) = compare(
            ROUNDS,
            |_| async {
                store.history_window(&tenant, &small, query).await.unwrap();
            },
            |_| async {
                store.history_window(&tenant, &big, query).await.unwrap();
            },
        )
        .await;
        report(name, small_time, big_time);
    }
    let (small_time, big_time) = compare(
        ROUNDS,
        |_| async {
            store.user_stats(&tenant, &small).await.unwrap();
        },
        |_| async {
            store.user_stats(&tenant, &big).await.unwrap();
        },
    )
    .await;
    report("stats (count, bounds)", small_time, big_time);
}

fn report(name: &str, small: Duration, big: Duration) {
    println!(
        "{name:<44} {:>10.0}µs {:>10.0}µs {:>9.2}",
        micros(small),
        micros(big),
        big.as_secs_f64() / small.as_secs_f64()
    );
}
