//! Logging: a tracing subscriber that writes `pretty` lines for a terminal
//! or one JSON object per line for machines, filtered by `RUST_LOG`, and the
//! per-request span, named by the route template (never the raw path, which
//! carries user ids).

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::http::Request;
use axum::Router;
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

const DEFAULT_FILTER: &str = "info,sqlx=warn";

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

/// Wraps `router` in one span per request, named by method and route
/// template; the response is logged once, at INFO, with status and latency.
pub fn trace_requests(router: Router) -> Router {
    router.layer(
        TraceLayer::new_for_http()
            .make_span_with(request_span)
            .on_request(())
            .on_response(DefaultOnResponse::new().level(Level::INFO)),
    )
}

fn request_span(request: &Request<Body>) -> tracing::Span {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str);
    tracing::info_span!("request", method = %request.method(), route)
}
