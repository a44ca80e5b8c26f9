//! `/v1/admin`: deleting in bulk, always within the caller's tenant.

use axum::extract::State;
use axum::Json;
use serde_json::Value;

use super::extract::JsonBody;
use super::schema::{ClearAllRequest, DeletedResponse, PurgeExpiredRequest};
use super::AppState;
use crate::domain::{Tenant, Timestamp};
use crate::error::{ApiError, Problem};

/// Delete every message older than `max_age` seconds, for all users.
#[utoipa::path(
    post,
    path = "/v1/admin/purge-expired",
    operation_id = "purgeExpired",
    tag = "admin",
    request_body(content = PurgeExpiredRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "Deleted", body = DeletedResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`max_age` missing, not a whole number, or below 1", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn purge_expired(
    State(state): State<AppState>,
    tenant: Tenant,
    JsonBody(body): JsonBody,
) -> Result<Json<DeletedResponse>, ApiError> {
    let max_age = match body.get("max_age") {
        Some(Value::Number(n)) => whole_seconds(n),
        _ => None,
    }
    .ok_or_else(|| {
        ApiError::Unprocessable(
            "send {\"max_age\": SECONDS} with a whole number of seconds of at least 1".into(),
        )
    })?;
    let cutoff = Timestamp::now().minus_seconds(max_age);
    let deleted = state.store.purge_expired(&tenant, cutoff).await?;
    metrics::counter!("chat_history_messages_purged_total").increment(deleted);
    Ok(Json(DeletedResponse { deleted }))
}

/// A JSON number that is a whole number of seconds from 1 to `i64::MAX`, the
/// documented `int64`. As in JSON Schema, `3600.0` is the integer 3600.
fn whole_seconds(n: &serde_json::Number) -> Option<u64> {
    const BEYOND_I64: f64 = 9_223_372_036_854_775_808.0;
    let seconds = match n.as_i64() {
        Some(seconds) => seconds,
        None => {
            let seconds = n.as_f64()?;
            if seconds.fract() != 0.0 || !(0.0..BEYOND_I64).contains(&seconds) {
                return None;
            }
            seconds as i64
        }
    };
    u64::try_from(seconds).ok().filter(|seconds| *seconds >= 1)
}

/// Delete every message of every user.
#[utoipa::path(
    post,
    path = "/v1/admin/clear-all",
    operation_id = "clearAll",
    tag = "admin",
    request_body(content = ClearAllRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "Deleted", body = DeletedResponse),
        (status = 400, description = "Malformed JSON, or `confirm` is not `true`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn clear_all(
    State(state): State<AppState>,
    tenant: Tenant,
    JsonBody(body): JsonBody,
) -> Result<Json<DeletedResponse>, ApiError> {
    if body.get("confirm") != Some(&Value::Bool(true)) {
        return Err(ApiError::BadRequest(
            "this deletes every message; send {\"confirm\": true} to do it".into(),
        ));
    }
    let deleted = state.store.clear_all(&tenant).await?;
    Ok(Json(DeletedResponse { deleted }))
}
