//! Do appends keep flowing while retention purges a million rows? For each
//! backend, in one run: append latency with nothing else running, then the
//! same appends while `purge_expired` deletes 1,000,000 expired messages
//! (1,000 users × 1,000) in its bounded batches.
//!
//! cargo bench --bench purge_under_load
//! BENCH_MESSAGES=200000 BENCH_BACKENDS=sqlite cargo bench --bench purge_under_load

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chat_history::domain::{Tenant, Timestamp};
use chat_history::store::Store;

use common::{append, micros, turns};

const PER_USER: usize = 1000;
const BASELINE_APPENDS: usize = 500;

#[tokio::main]
async fn main() {
    let messages = common::setting("BENCH_MESSAGES", 1_000_000);
    for backend in common::backends() {
        let (store, cleanup) = common::open(&backend, "chat_history_bench_purge").await;
        run(&backend, store.clone(), messages).await;
        store.close().await;
        cleanup.await;
    }
}

async fn run(backend: &str, store: Arc<dyn Store>, messages: usize) {
    let old = Timestamp::now().minus_seconds(2 * 86_400);
    let batch = turns(PER_USER, "old");
    let started = Instant::now();
    let users = messages.div_ceil(PER_USER);
    for user in 0..users {
        append(&*store, &format!("old-{user}"), &batch, old).await;
    }
    println!(
        "\n{backend}: loaded {} expired messages ({users} users) in {:.1}s",
        users * PER_USER,
        started.elapsed().as_secs_f64()
    );

    let baseline = appends_while(&*store, || true, BASELINE_APPENDS).await;

    let done = Arc::new(AtomicBool::new(false));
    let purge = {
        let store = store.clone();
        let done = done.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let deleted = store
                .purge_expired(&Tenant::default_tenant(), Duration::from_secs(86_400))
                .await
                .unwrap();
            done.store(true, Ordering::SeqCst);
            (deleted, started.elapsed())
        })
    };
    let during = appends_while(&*store, || !done.load(Ordering::SeqCst), usize::MAX).await;
    let (deleted, took) = purge.await.unwrap();
    println!(
        "purge deleted {deleted} messages in {:.1}s ({:.0} rows/s) while {} appends ran",
        took.as_secs_f64(),
        deleted as f64 / took.as_secs_f64(),
        during.len()
    );
    println!(
        "{:<28} {:>10} {:>10} {:>10} {:>10}",
        "append latency", "p50", "p99", "max", "appends"
    );
    report("alone", &baseline);
    report("during the purge", &during);
    let ratio =
        |q: f64| percentile(&during, q).as_secs_f64() / percentile(&baseline, q).as_secs_f64();
    println!(
        "during ÷ alone: p50 {:.2}, p99 {:.2}",
        ratio(0.5),
        ratio(0.99)
    );
}

/// Appends one message at a time to live users while `go()` holds, at most
/// `limit` times, and returns each append's latency.
async fn appends_while(store: &dyn Store, go: impl Fn() -> bool, limit: usize) -> Vec<Duration> {
    let message = turns(1, "live");
    let mut latencies = Vec::new();
    while go() && latencies.len() < limit {
        let user = format!("live-{}", latencies.len() % 100);
        let started = Instant::now();
        append(store, &user, &message, Timestamp::now()).await;
        latencies.push(started.elapsed());
    }
    latencies
}

fn percentile(times: &[Duration], q: f64) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort_unstable();
    sorted[((sorted.len() - 1) as f64 * q) as usize]
}

fn report(name: &str, times: &[Duration]) {
    println!(
        "{name:<28} {:>8.0}µs {:>8.0}µs {:>8.0}µs {:>10}",
        micros(percentile(times, 0.5)),
        micros(percentile(times, 0.99)),
        micros(percentile(times, 1.0)),
        times.len()
    );
}
