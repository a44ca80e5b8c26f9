//! Operational endpoints outside `/v1`: liveness, readiness and the
//! OpenAPI document.

use std::sync::OnceLock;

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::schema::StatusResponse;
use super::AppState;
use crate::error::{error_chain, Problem};
use crate::telemetry::Throttle;

/// The process is up and serving HTTP; says nothing about the database.
#[utoipa::path(
    get,
    path = "/healthz",
    operation_id = "healthz",
    tag = "operations",
    responses((status = 200, description = "The process is alive", body = StatusResponse))
)]
pub async fn healthz() -> Json<StatusResponse> {
    Json(StatusResponse { status: "ok" })
}

/// The database answers and every migration of this build is applied.
#[utoipa::path(
    get,
    path = "/readyz",
    operation_id = "readyz",
    tag = "operations",
    responses(
        (status = 200, description = "Ready to serve", body = StatusResponse),
        (status = 503, description = "Database unreachable or migrations missing", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying"))),
    )
)]
pub async fn readyz(State(state): State<AppState>) -> Response {
    match state.store.ready().await {
        Ok(()) => Json(StatusResponse { status: "ready" }).into_response(),
        Err(error) => {
            static NOT_READY: Throttle = Throttle::new();
            if let Some(passed_over) = NOT_READY.admit() {
                tracing::warn!(error = %error_chain(&error), passed_over, "not ready");
            }
            let mut response = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {error}"),
            )
            .into_response();
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            response
        }
    }
}

/// Prometheus metrics.
///
/// Requests by route and status, latency, database pool, messages appended
/// and purged, retention runs. Open unless CHAT_HISTORY_METRICS_REQUIRE_KEY
/// is set.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "getMetrics",
    tag = "operations",
    security(("bearer" = []), ()),
    responses(
        (status = 200, description = "Prometheus text exposition format", content_type = "text/plain", body = String),
        (status = 401, description = "No API key, or an unknown one, while CHAT_HISTORY_METRICS_REQUIRE_KEY is set", body = Problem, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer realm=\"chat-history\"`"))),
    )
)]
pub async fn metrics(State(state): State<AppState>) -> Response {
    let pool = state.store.pool_status();
    metrics::gauge!("chat_history_db_connections", "state" => "in_use").set(pool.in_use as f64);
    metrics::gauge!("chat_history_db_connections", "state" => "idle").set(pool.idle as f64);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        crate::telemetry::metrics().render(),
    )
        .into_response()
}

/// This document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "getOpenApi",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document of this service", content_type = "application/json"))
)]
pub async fn openapi_document() -> Response {
    static DOCUMENT: OnceLock<String> = OnceLock::new();
    let document = DOCUMENT.get_or_init(super::openapi_json);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        document.as_str(),
    )
        .into_response()
}
