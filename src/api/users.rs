//! `/v1/users` and `/v1/users/{user_id}`: who has history, how much, and
//! clearing it.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use utoipa::IntoParams;

use super::extract::{page_limit, user_id, Path, Query, UserPath};
use super::schema::{DeletedResponse, UserListResponse, UserStatsResponse, UserSummaryResponse};
use super::AppState;
use crate::domain::{Tenant, UserId};
use crate::error::{ApiError, Problem};

const DEFAULT_LIMIT: u32 = 100;

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListUsersParams {
    /// How many users at most.
    #[param(minimum = 1, maximum = 1000, default = 100)]
    limit: Option<u32>,
    /// Start after this `user_id` (the last one of the previous page).
    #[param(
        min_length = 1,
        max_length = 256,
        pattern = r"^[^\x00-\x1F\x7F-\x9F]+$"
    )]
    after: Option<String>,
}

/// List the users that have messages.
///
/// Keyset-paginated by `user_id`, ordered by its UTF-8 bytes.
#[utoipa::path(
    get,
    path = "/v1/users",
    operation_id = "listUsers",
    tag = "users",
    params(ListUsersParams),
    responses(
        (status = 200, description = "A page of users", body = UserListResponse),
        (status = 400, description = "A bad query parameter", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn list_users(
    State(state): State<AppState>,
    tenant: Tenant,
    Query(params): Query<ListUsersParams>,
) -> Result<Json<UserListResponse>, ApiError> {
    let limit = page_limit(params.limit, DEFAULT_LIMIT)?;
    let after = params
        .after
        .map(UserId::parse)
        .transpose()
        .map_err(|e| ApiError::invalid_parameter("after", e))?;
    let (users, has_more) = state
        .store
        .list_users(&tenant, after.as_ref(), limit)
        .await?;
    Ok(Json(UserListResponse {
        users: users
            .into_iter()
            .map(|u| UserSummaryResponse {
                user_id: u.user_id,
                message_count: u.message_count,
                newest_at: u.newest_at,
            })
            .collect(),
        has_more,
    }))
}

/// A user's message count, bounds and version.
#[utoipa::path(
    get,
    path = "/v1/users/{user_id}",
    operation_id = "getUserStats",
    tag = "users",
    params(UserPath),
    responses(
        (status = 200, description = "The user's stats", body = UserStatsResponse),
        (status = 400, description = "A bad `user_id`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "The user has no messages", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn user_stats(
    State(state): State<AppState>,
    tenant: Tenant,
    Path(path): Path<UserPath>,
) -> Result<Json<UserStatsResponse>, ApiError> {
    let user = user_id(path.user_id)?;
    let stats = state
        .store
        .user_stats(&tenant, &user)
        .await?
        .ok_or_else(|| no_messages(&user))?;
    Ok(Json(UserStatsResponse {
        user_id: user,
        message_count: stats.message_count,
        first_seq: stats.first_seq,
        last_seq: stats.last_seq,
        oldest_at: stats.oldest_at,
        newest_at: stats.newest_at,
        version: stats.version,
    }))
}

/// Whether the user has any messages (hasHistory): 200 or 404, no body.
#[utoipa::path(
    head,
    path = "/v1/users/{user_id}",
    operation_id = "hasHistory",
    tag = "users",
    params(UserPath),
    responses(
        (status = 200, description = "The user has messages"),
        (status = 400, description = "A bad `user_id`"),
        (status = 404, description = "The user has no messages"),
    )
)]
pub async fn user_exists(
    State(state): State<AppState>,
    tenant: Tenant,
    Path(path): Path<UserPath>,
) -> Result<StatusCode, ApiError> {
    let user = user_id(path.user_id)?;
    match state.store.user_stats(&tenant, &user).await? {
        Some(_) => Ok(StatusCode::OK),
        None => Err(no_messages(&user)),
    }
}

/// Clear a user's history. Idempotent: clearing an empty history deletes 0.
#[utoipa::path(
    delete,
    path = "/v1/users/{user_id}",
    operation_id = "clearHistory",
    tag = "users",
    params(UserPath),
    responses(
        (status = 200, description = "Cleared", body = DeletedResponse),
        (status = 400, description = "A bad `user_id`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn clear_user(
    State(state): State<AppState>,
    tenant: Tenant,
    Path(path): Path<UserPath>,
) -> Result<Json<DeletedResponse>, ApiError> {
    let user = user_id(path.user_id)?;
    let deleted = state.store.clear_user(&tenant, &user).await?;
    Ok(Json(DeletedResponse { deleted }))
}

fn no_messages(user: &UserId) -> ApiError {
    ApiError::NotFound(format!("user {:?} has no messages", user.as_str()))
}
