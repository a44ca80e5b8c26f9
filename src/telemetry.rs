//! Logging and metrics: a tracing subscriber that writes `pretty` lines for
//! a terminal or one JSON object per line for machines, filtered by
//! `RUST_LOG`; the per-request span, named by the route template (never the
//! raw path, which carries user ids) with the request id; and the Prometheus
//! recorder behind `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{MatchedPath, Request as AxumRequest};
use axum::http::{HeaderValue, Method, Request};
use axum::response::Response;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tower_http::classify::{ServerErrorsAsFailures, ServerErrorsFailureClass, SharedClassifier};
use tower_http::request_id::{MakeRequestId, RequestId};
use tower_http::trace::{DefaultOnBodyChunk, DefaultOnEos, TraceLayer};
use tracing_subscriber::EnvFilter;

/// Without `RUST_LOG`: the service's own events, but not the line per
/// request (target `chat_history::access`), which at full load costs about
/// a twentieth of the CPU; `RUST_LOG=info,sqlx=warn` turns it on.
const DEFAULT_FILTER: &str = "info,sqlx=warn,chat_history::access=warn";

/// How log lines are written: `pretty` for a terminal, `json` for machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Pretty,
    Json,
}

/// Installs the global subscriber; call once, at start-up.
pub fn init(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Pretty => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .init(),
    }
}

/// One span per request, named by method and route template; the response
/// is logged once, at INFO under the target `chat_history::access` (off
/// unless `RUST_LOG` asks for it), with status and latency. A 5xx answer is
/// also a warning, throttled (see `Throttle`): a flood of requests that are
/// shed with 503 must not become a flood of log lines. A route layer, so
/// the template is known.
pub type TraceRequests = TraceLayer<
    SharedClassifier<ServerErrorsAsFailures>,
    fn(&Request<Body>) -> tracing::Span,
    (),
    fn(&Response, Duration, &tracing::Span),
    DefaultOnBodyChunk,
    DefaultOnEos,
    fn(ServerErrorsFailureClass, Duration, &tracing::Span),
>;

pub fn trace_requests() -> TraceRequests {
    TraceLayer::new_for_http()
        .make_span_with(request_span as fn(&Request<Body>) -> tracing::Span)
        .on_request(())
        .on_response(log_response as fn(&Response, Duration, &tracing::Span))
        .on_failure(log_failure as fn(ServerErrorsFailureClass, Duration, &tracing::Span))
}

fn log_response(response: &Response, latency: Duration, _: &tracing::Span) {
    tracing::info!(
        target: "chat_history::access",
        status = response.status().as_u16(),
        latency_ms = latency.as_secs_f64() * 1000.0,
        "request finished"
    );
}

fn log_failure(failure: ServerErrorsFailureClass, latency: Duration, _: &tracing::Span) {
    static FAILURES: Throttle = Throttle::new();
    if let Some(passed_over) = FAILURES.admit() {
        tracing::warn!(
            classification = %failure,
            latency_ms = latency.as_secs_f64() * 1000.0,
            passed_over,
            "response failed (server error; metrics count every one, this log at most one a {}s)",
            THROTTLE_EVERY.as_secs()
        );
    }
}

/// How often a throttled warning is written, at most.
pub const THROTTLE_EVERY: Duration = Duration::from_secs(10);

/// A warning that a request can cause, and so every request of a flood
/// (503s shed over the cap, a database that went away): written for the
/// first, then at most once per `THROTTLE_EVERY`, with how many were passed
/// over since the last one written. The metrics count every one; the log
/// stays readable, and writing it costs no more under a flood.
pub struct Throttle {
    /// When the next line may be written, in ms since the process's first
    /// throttled event.
    next: AtomicU64,
    passed_over: AtomicU64,
}

impl Throttle {
    pub const fn new() -> Self {
        Self {
            next: AtomicU64::new(0),
            passed_over: AtomicU64::new(0),
        }
    }

    /// `Some(events passed over since the last line)` when this event is
    /// to be written, else `None` (and it is counted as passed over).
    pub fn admit(&self) -> Option<u64> {
        static START: OnceLock<Instant> = OnceLock::new();
        let now = START.get_or_init(Instant::now).elapsed();
        self.admit_at(u64::try_from(now.as_millis()).unwrap_or(u64::MAX))
    }

    fn admit_at(&self, now_ms: u64) -> Option<u64> {
        let next = self.next.load(Ordering::Relaxed);
        let every = u64::try_from(THROTTLE_EVERY.as_millis()).unwrap_or(u64::MAX);
        if now_ms >= next
            && self
                .next
                .compare_exchange(
                    next,
                    now_ms.saturating_add(every),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            Some(self.passed_over.swap(0, Ordering::Relaxed))
        } else {
            self.passed_over.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

impl Default for Throttle {
    fn default() -> Self {
        Self::new()
    }
}

fn request_span(request: &Request<Body>) -> tracing::Span {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str);
    let request_id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    tracing::info_span!(
        "request",
        method = method_label(request.method()),
        route,
        request_id
    )
}

/// Request ids for requests that bring none: UUID-shaped, one half drawn at
/// random once per process and the other a counter, so that they are unique
/// across replicas without asking the kernel for randomness per request.
#[derive(Clone)]
pub struct RequestIds {
    process: u64,
    next: Arc<AtomicU64>,
}

impl RequestIds {
    pub fn new() -> Self {
        Self {
            process: uuid::Uuid::new_v4().as_u64_pair().0,
            next: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl Default for RequestIds {
    fn default() -> Self {
        Self::new()
    }
}

impl MakeRequestId for RequestIds {
    fn make_request_id<B>(&mut self, _: &Request<B>) -> Option<RequestId> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = uuid::Uuid::from_u64_pair(self.process, n);
        let mut text = uuid::Uuid::encode_buffer();
        HeaderValue::from_str(id.hyphenated().encode_lower(&mut text))
            .ok()
            .map(RequestId::new)
    }
}

/// Seconds: from 1 ms to 10 s, for request and cleanup durations.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The process-wide Prometheus recorder, installed on first use.
pub fn metrics() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Suffix("_duration_seconds".into()),
                DURATION_BUCKETS,
            )
            .expect("the buckets are not empty")
            .install_recorder()
            .expect("no other metrics recorder is installed");
        describe_metrics();
        handle
    })
}

fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "chat_history_http_requests_total",
        "HTTP requests answered, by method, route template and status."
    );
    describe_histogram!(
        "chat_history_http_request_duration_seconds",
        Unit::Seconds,
        "Time to answer an HTTP request, by method and route template."
    );
    describe_counter!(
        "chat_history_connections_refused_total",
        "Connections answered 503 and closed because CHAT_HISTORY_MAX_CONNECTIONS were open."
    );
    describe_counter!(
        "chat_history_requests_shed_total",
        "Requests answered 503 at once, by reason (in_flight: CHAT_HISTORY_MAX_IN_FLIGHT; body_bytes: CHAT_HISTORY_MAX_IN_FLIGHT_BODY_BYTES)."
    );
    describe_gauge!(
        "chat_history_db_connections",
        "Database pool connections, by state (in_use, idle)."
    );
    describe_counter!(
        "chat_history_messages_appended_total",
        "Messages stored by appends and transcript saves."
    );
    describe_counter!(
        "chat_history_messages_purged_total",
        "Messages deleted for being older than the retention or a purge's max_age."
    );
    describe_counter!(
        "chat_history_batches_total",
        "Batches served, by kind (commit: appends sharing one commit; read: history reads sharing one statement)."
    );
    describe_counter!(
        "chat_history_batched_requests_total",
        "Requests served in batches, by kind; divided by chat_history_batches_total, the mean batch size."
    );
    describe_counter!(
        "chat_history_read_cache_total",
        "Postgres history reads by outcome (hit: the page kept was still current, so no messages were read; miss: they were)."
    );
    describe_counter!(
        "chat_history_batches_split_total",
        "Batches that failed for a reason other than the database going away, and were served one request at a time, by kind."
    );
    describe_counter!(
        "chat_history_cleanup_runs_total",
        "Runs of the retention task, by outcome (ok, skipped: another replica ran it, error)."
    );
    describe_histogram!(
        "chat_history_cleanup_duration_seconds",
        Unit::Seconds,
        "Time a run of the retention task took."
    );
}

/// The method as a metrics label: one the API knows, else `other`, so that
/// invented methods cannot add series.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// Counts and times a request by route template and status: started when
/// the request is routed (so the template is known), finished with its
/// response.
pub struct RequestTimer {
    method: &'static str,
    route: String,
    started: Instant,
}

impl RequestTimer {
    pub fn start(request: &AxumRequest) -> Self {
        // A template of the router's (a closed set), never the raw path.
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .map_or("unmatched", MatchedPath::as_str)
            .to_owned();
        Self {
            method: method_label(request.method()),
            route,
            started: Instant::now(),
        }
    }

    pub fn finish(self, response: &Response) {
        let Self {
            method,
            route,
            started,
        } = self;
        let status = response.status().as_u16().to_string();
        metrics::counter!(
            "chat_history_http_requests_total",
            "method" => method, "route" => route.clone(), "status" => status
        )
        .increment(1);
        metrics::histogram!(
            "chat_history_http_request_duration_seconds",
            "method" => method, "route" => route
        )
        .record(started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_writes_the_first_then_one_a_period_with_the_count_passed_over() {
        let throttle = Throttle::new();
        let every = u64::try_from(THROTTLE_EVERY.as_millis()).unwrap();
        assert_eq!(throttle.admit_at(5), Some(0));
        for at in 6..1006 {
            assert_eq!(throttle.admit_at(at), None);
        }
        assert_eq!(throttle.admit_at(5 + every - 1), None);
        assert_eq!(throttle.admit_at(5 + every), Some(1001));
        assert_eq!(throttle.admit_at(5 + every + 1), None);
        // A quiet spell: the next one is written at once, with its one.
        assert_eq!(throttle.admit_at(100 * every), Some(1));
    }
}
