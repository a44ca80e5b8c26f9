//! `/v1/admin`: deleting in bulk, always within the caller's tenant.

use std::time::Duration;

use axum::extract::State;
use axum::Json;
use serde::de::{DeserializeOwned, IgnoredAny};

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
    let max_age = admin_body::<PurgeExpiredRequest>(&body)?
        .and_then(|request| request.max_age())
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

/// An admin body as its request type, which is also its documented
/// schema: `None` when it is JSON but not an object of that shape (each
/// endpoint says what it needs), 400 when it is not JSON at all.
fn admin_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<Option<T>, ApiError> {
    let is_object = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let parsed = if is_object {
        serde_json::from_slice::<T>(bytes).map(Some)
    } else {
        // An array would fill a struct's fields in order: not an object, no fields.
        serde_json::from_slice::<IgnoredAny>(bytes).map(|_| None)
    };
    match parsed {
        Ok(body) => Ok(body),
        Err(e) if e.classify() == serde_json::error::Category::Data => Ok(None),
        Err(e) => Err(ApiError::BadRequest(format!(
            "the body is not valid JSON: {e}"
        ))),
    }
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
    if !admin_body::<ClearAllRequest>(&body)?.is_some_and(|request| request.confirm) {
        return Err(ApiError::BadRequest(
            "this deletes every message; send {\"confirm\": true} to do it".into(),
        ));
    }
    let deleted = state.store.clear_all(&tenant).await?;
    Ok(Json(DeletedResponse { deleted }))
}
