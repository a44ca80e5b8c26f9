//! `/v1/admin`: deleting in bulk, always within the caller's tenant.

use std::time::Duration;

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::extract::JsonBody;
use super::schema::{ClearAllRequest, DeletedResponse, PurgeExpiredRequest};
use super::AppState;
use crate::domain::Tenant;
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
    let max_age = admin_body(&body)?
        .max_age
        .and_then(|raw| serde_json::from_str::<serde_json::Number>(raw.get()).ok())
        .and_then(|n| whole_seconds(&n))
        .ok_or_else(|| {
            ApiError::Unprocessable(
                "send {\"max_age\": SECONDS} with a whole number of seconds of at least 1".into(),
            )
        })?;
    let deleted = state
        .store
        .purge_expired(&tenant, Duration::from_secs(max_age))
        .await?;
    metrics::counter!("chat_history_messages_purged_total").increment(deleted);
    Ok(Json(DeletedResponse { deleted }))
}

/// The fields of an admin body, borrowed from its bytes; anything else in
/// it is skipped unread. Valid JSON that is not an object has neither field.
#[derive(Default, Deserialize)]
struct AdminBody<'a> {
    #[serde(borrow)]
    max_age: Option<&'a RawValue>,
    #[serde(borrow)]
    confirm: Option<&'a RawValue>,
}

fn admin_body(bytes: &[u8]) -> Result<AdminBody<'_>, ApiError> {
    match serde_json::from_slice::<AdminBody>(bytes) {
        Ok(body) => Ok(body),
        Err(e) if e.classify() == serde_json::error::Category::Data => Ok(AdminBody::default()),
        Err(e) => Err(ApiError::BadRequest(format!(
            "the body is not valid JSON: {e}"
        ))),
    }
}

/// A JSON number that is a whole number of seconds from 1 to `i64::MAX`, the
/// documented `int64`. As in JSON Schema, `3600.0` is the integer 3600.
fn whole_seconds(n: &serde_json::Number) -> Option<u64> {
    const BEYOND_I64: f64 = 9_223_372_036_854_775_808.0;
    let seconds = match n.as_i64() {
        Some(seconds) => u64::try_from(seconds).ok()?,
        None => {
            let seconds = n.as_f64()?;
            if seconds.fract() != 0.0 || !(0.0..BEYOND_I64).contains(&seconds) {
                return None;
            }
            // A whole number below 2^63: its shortest decimal form is exact.
            format!("{seconds:.0}").parse::<u64>().ok()?
        }
    };
    Some(seconds).filter(|seconds| *seconds >= 1)
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
    if admin_body(&body)?.confirm.map(RawValue::get) != Some("true") {
        return Err(ApiError::BadRequest(
            "this deletes every message; send {\"confirm\": true} to do it".into(),
        ));
    }
    let deleted = state.store.clear_all(&tenant).await?;
    Ok(Json(DeletedResponse { deleted }))
}
