//! The retention task: every `cleanup_interval` it deletes messages older
//! than `retention` and idempotency keys older than a day, in short
//! transactions of bounded size, so appends and reads keep flowing while it
//! runs. On Postgres a lease row lets one replica at a time run it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::domain::IDEMPOTENCY_KEY_TTL_SECONDS;
use crate::error::error_chain;
use crate::store::Store;

/// Starts the task; it stops when `shutdown` is cancelled, abandoning a run
/// between (or inside) batches, each of which commits or rolls back whole.
pub fn spawn(
    store: Arc<dyn Store>,
    retention: Option<Duration>,
    interval: Duration,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = ticks.tick() => {}
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = run_once(&*store, retention) => {}
            }
        }
        tracing::info!("retention task stopped");
    })
}

async fn run_once(store: &dyn Store, retention: Option<Duration>) {
    // The store takes the cutoffs from the database's clock, not this one.
    let keys_ttl = Duration::from_secs(IDEMPOTENCY_KEY_TTL_SECONDS);
    let started = Instant::now();
    let result = store.retention_pass(retention, keys_ttl).await;
    let seconds = started.elapsed().as_secs_f64();
    // Metrics first, so that whoever reads the log line finds them counted.
    let outcome = match &result {
        Ok(Some(report)) => {
            metrics::counter!("chat_history_messages_purged_total").increment(report.messages);
            "ok"
        }
        Ok(None) => "skipped",
        Err(_) => "error",
    };
    metrics::counter!("chat_history_cleanup_runs_total", "outcome" => outcome).increment(1);
    metrics::histogram!("chat_history_cleanup_duration_seconds").record(seconds);
    match result {
        Ok(Some(report)) => tracing::info!(
            messages_deleted = report.messages,
            idempotency_keys_deleted = report.idempotency_keys,
            seconds,
            "retention run finished"
        ),
        Ok(None) => tracing::debug!("retention is running on another replica"),
        Err(e) => tracing::warn!(
            error = %error_chain(&e),
            "retention run failed; retrying at the next interval"
        ),
    }
}
